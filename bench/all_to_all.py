"""All-to-all latency against message size: the CUDA IPC kernel against torch.distributed.

Spawns ``--ranks`` processes and times ``Comm.all_to_all`` of an SP-shaped bf16 tensor (tokens, 32
heads, 128) from token shards to head shards, for messages of 64 KB .. 256 MB per rank, once with the
kernel installed and once through torch.distributed, and checks that both give the same bytes.
Each figure is the median over ``--repeats`` rounds of the slowest rank's mean time per call.

- With at least ``--ranks`` GPUs: one GPU per rank; the torch.distributed path is NCCL.
- With fewer: every rank shares GPU 0 (NCCL refuses two ranks on one GPU), so the torch.distributed
  path is gloo over CPU copies (device to host, gloo all_to_all_single, host to device), and the kernel's
  ranks take turns on the GPU under the driver's time slicing. That measures the plumbing, not
  NVLink: read it as an upper bound for the kernel.

    python bench/all_to_all.py [--ranks 2] [--min-kb 64] [--max-mb 256] [--repeats 5] [--timeout 30]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mgpu_kernels import CUDA_IPC, install_fast_all_to_all, uninstall_fast_all_to_all  # noqa: E402
from mgpu_backend.parallel.comm import Comm  # noqa: E402

HEADS, HEAD_DIM = 32, 128
BYTES_PER_TOKEN = HEADS * HEAD_DIM * 2  # bf16


def _sizes(min_kb: int, max_mb: int) -> list[int]:
    sizes, size = [], min_kb * 1024
    while size <= max_mb * 2**20:
        sizes.append(size)
        size *= 4
    return sizes


def _time_per_call(call, iterations: int, repeats: int) -> float:
    """Median over rounds of the slowest rank's mean seconds per call."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(iterations):
            call()
        torch.cuda.synchronize()
        mine = (time.perf_counter() - started) / iterations
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        rounds.append(max(everyone))
    return statistics.median(rounds)


def _rank_main(rank: int, world: int, store_path: str, args, one_gpu_per_rank: bool, results) -> None:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank if one_gpu_per_rank else 0)
    torch.cuda.set_device(device)
    backend = "nccl" if one_gpu_per_rank else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        comm = Comm.world()
        if one_gpu_per_rank:
            def torch_path(x):
                return comm.torch_all_to_all(x, 1, 0)
        else:
            # all_to_all_single on packed chunks: gloo has no list all-to-all in older torch (2.11).
            def torch_path(x):
                send = torch.stack(x.cpu().chunk(world, dim=1))
                received = torch.empty_like(send)
                dist.all_to_all_single(received, send)
                return torch.cat(received.unbind(0), dim=0).to(device)

        rows = []
        for size in _sizes(args.min_kb, args.max_mb):
            tokens = max(1, size // BYTES_PER_TOKEN)
            generator = torch.Generator(device=device).manual_seed(rank)
            x = torch.randn(tokens, HEADS, HEAD_DIM, device=device, generator=generator).to(torch.bfloat16)
            iterations = max(1, min(20, (32 << 20) // size))
            torch_seconds = _time_per_call(lambda: torch_path(x), iterations, args.repeats)
            choice = install_fast_all_to_all(comm, timeout_s=args.timeout, buffer_bytes=x.numel() * 2)
            if choice != CUDA_IPC:
                raise RuntimeError(f"rank {rank}: the CUDA IPC kernel is not available here (see the log)")
            same = bool(torch.equal(comm.all_to_all(x, 1, 0), torch_path(x)))
            kernel_seconds = _time_per_call(lambda: comm.all_to_all(x, 1, 0), iterations, args.repeats)
            uninstall_fast_all_to_all(comm)
            rows.append((tokens * BYTES_PER_TOKEN, kernel_seconds, torch_seconds, same))
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def _human(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--min-kb", type=int, default=64)
    parser.add_argument("--max-mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=30.0, help="kernel timeout per exchange, seconds")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/all_to_all.py needs CUDA: there is no kernel to measure on CPU")
    # Multicast over NVLink can take a shared host's GPUs down; nothing here needs it.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    one_gpu_per_rank = torch.cuda.device_count() >= args.ranks
    torch_label = "NCCL" if one_gpu_per_rank else "gloo over CPU copies"

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(rank, args.ranks, store_path, args, one_gpu_per_rank, results))
            for rank in range(args.ranks)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            sys.exit(f"a rank failed (exit codes {[proc.exitcode for proc in procs]})")
        rows = results.get()

    placement = "one GPU per rank" if one_gpu_per_rank else "all ranks on GPU 0"
    print(f"all-to-all, {args.ranks} ranks, {placement}, {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"{datetime.date.today().isoformat()}; bf16 (tokens, {HEADS}, {HEAD_DIM}), heads scattered, tokens gathered")
    print(f"| message per rank | CUDA IPC kernel | torch.distributed ({torch_label}) | kernel speedup | kernel bus bandwidth | same bytes |")
    print("|---|---|---|---|---|---|")
    for nbytes, kernel_seconds, torch_seconds, same in rows:
        leaving = nbytes * (args.ranks - 1) / args.ranks
        print(f"| {_human(nbytes)} | {kernel_seconds * 1e3:.3f} ms | {torch_seconds * 1e3:.3f} ms | "
              f"{torch_seconds / kernel_seconds:.1f}x | {leaving / kernel_seconds / 1e9:.1f} GB/s | {same} |")


if __name__ == "__main__":
    main()
