"""Run one function on N real gloo ranks (separate processes) and collect what each returns.

Test-only. The function must live at module level in an importable module (spawned children import
it by name) and return CPU tensors or plain Python values.
"""

from __future__ import annotations

import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _to_plain(value):
    """Tensors become (marker, numpy array) so they cross the queue by value: a tensor would cross
    as a shared-memory file descriptor that dies with the rank process before the test reads it."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            return ("__tensor_bf16__", tensor.view(torch.int16).numpy().copy())
        return ("__tensor__", tensor.numpy().copy())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_plain(item) for key, item in value.items()}
    return value


def _from_plain(value):
    if isinstance(value, tuple) and len(value) == 2 and value[0] in ("__tensor__", "__tensor_bf16__"):
        tensor = torch.from_numpy(value[1])
        return tensor.view(torch.bfloat16) if value[0] == "__tensor_bf16__" else tensor
    if isinstance(value, (list, tuple)):
        return type(value)(_from_plain(item) for item in value)
    if isinstance(value, dict):
        return {key: _from_plain(item) for key, item in value.items()}
    return value


def _rank_main(rank: int, world_size: int, store_path: str, fn, args, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        results.put((rank, "ok", _to_plain(fn(*args))))
    except BaseException:  # noqa: BLE001 - the traceback is handed to the test process
        results.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 300.0) -> list:
    """Call ``fn(*args)`` on ranks 0..world_size-1 with torch.distributed (gloo) initialised."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(rank, world_size, store_path, fn, args, results))
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        collected: dict[int, object] = {}
        errors = []
        deadline = time.monotonic() + timeout
        try:
            while len(collected) < world_size:
                try:
                    rank, status, value = results.get(timeout=0.5)
                except queue.Empty:
                    # A rank that died before reporting (killed, or its interpreter failed before
                    # _rank_main) would leave the others waiting in a collective and this loop forever.
                    dead = [rank for rank, proc in enumerate(procs) if rank not in collected and proc.exitcode not in (None, 0)]
                    if dead:
                        raise AssertionError(f"rank(s) {dead} died before reporting (exit codes {[procs[rank].exitcode for rank in dead]})") from None
                    if time.monotonic() > deadline:
                        raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(collected))} did not report within {timeout:.0f} s") from None
                    continue
                if status == "error":
                    errors.append(f"rank {rank}:\n{value}")
                collected[rank] = _from_plain(value)
        finally:
            for proc in procs:
                proc.join(timeout if len(collected) == world_size else 0)
                if proc.is_alive():
                    proc.kill()
        if errors:
            raise AssertionError("\n".join(errors))
    return [collected[rank] for rank in range(world_size)]
