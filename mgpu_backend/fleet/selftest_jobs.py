"""Fleet self-test jobs: they exercise relay, lockstep, progress, cancel and faults without a model.

``echo`` returns its input tensors after every rank has checked it received the same bytes;
``count`` runs steps that each all-reduce across the fleet (the shape of a denoising loop), with
knobs to make one rank fail, hang, compute a long step without stepping, or stop itself (SIGSTOP)
so tests and ``doctor`` can check fault handling. ``remember``/``recall`` keep a value in the rank's
state across jobs, and ``hold_file`` keeps a safetensors file resident the way a model is kept,
logging what it read from disk, so tests can see which ranks kept their state after a fault.
``say`` logs through the standard ``logging`` module, as techniques do, to test the fleet's one log.

Any client may run them, so every argument is bounded and checked on each rank before any step (a
bad one is the job's input error): a long step stops at a cancel, ``fill`` allocates at most
MAX_FILL_ELEMENTS, ``hold_file`` reads only files in the fleet's private folder, and ``modules``
imports only the project's own packages and the kernel package it loads.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from mgpu_backend.fleet.controller import FLEET_DIR_ENV
from mgpu_backend.fleet.jobs import JobContext, JobInputError, job, keep_across_replacement

log = logging.getLogger(__name__)


@job("echo")
def echo(ctx: JobContext, fields: dict, tensors: dict[str, torch.Tensor]):
    if ctx.world_size > 1:
        checksum = torch.tensor(
            [float(t.to(torch.float64).sum()) if t.numel() else 0.0 for t in tensors.values()], dtype=torch.float64
        )
        gathered = ctx.control.all_gather(checksum.unsqueeze(0), dim=0)
        if not torch.equal(gathered, checksum.expand_as(gathered)):
            raise RuntimeError(f"ranks received different tensors: {gathered.tolist()}")
    if fields.get("copy"):  # return new tensors, as a real job does, instead of the inputs themselves
        tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    return {"fields": fields, "ranks_agreed": ctx.world_size}, tensors


MAX_STEP_SECONDS = 10.0  # seconds_per_step: a sleep between cancel points
MAX_BUSY_SECONDS = 600.0  # one long step of computing; it ends early at a cancel
MAX_FILL_ELEMENTS = 1 << 30  # 4 GiB of float32, twice bench/ipc.py's default hand-off


def _number(fields: dict, name: str, default: float, low: float, high: float, integer: bool = False, optional: bool = False):
    """``fields[name]`` checked to be a number from ``low`` to ``high`` (None when ``optional`` and unset)."""
    value = fields.get(name, None if optional else default)
    if value is None and optional:
        return None
    kinds = int if integer else (int, float)
    if not isinstance(value, kinds) or isinstance(value, bool) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise JobInputError(f"{name} must be {what} from {low:{'d' if integer else 'g'}} to {high:{'d' if integer else 'g'}}, got {value!r}")
    return value


def _rank_field(ctx: JobContext, fields: dict, name: str) -> int | None:
    return _number(fields, name, None, 0, ctx.world_size - 1, integer=True, optional=True)


@job("count")
def count(ctx: JobContext, fields: dict, tensors: dict[str, torch.Tensor]):
    steps = _number(fields, "steps", 5, 1, 100_000, integer=True)
    seconds_per_step = float(_number(fields, "seconds_per_step", 0.0, 0.0, MAX_STEP_SECONDS))
    fail_rank, fail_step = _rank_field(ctx, fields, "fail_rank"), _number(fields, "fail_step", 0, 0, steps, integer=True)
    hang_rank, hang_step = _rank_field(ctx, fields, "hang_rank"), _number(fields, "hang_step", 0, 0, steps, integer=True)
    busy_rank, busy_step = _rank_field(ctx, fields, "busy_rank"), _number(fields, "busy_step", 0, 0, steps, integer=True)
    busy_seconds = float(_number(fields, "busy_seconds", 0.0, 0.0, MAX_BUSY_SECONDS))
    stop_rank, stop_step = _rank_field(ctx, fields, "stop_rank"), _number(fields, "stop_step", 0, 0, steps, integer=True)
    total = torch.zeros(1, dtype=torch.float64)
    for step in range(steps):
        if ctx.rank == fail_rank and step == fail_step:
            if fields.get("fail_as_input_error"):  # what a rank-local check ("Gemma does not fit") raises
                raise JobInputError(f"requested input error on rank {ctx.rank} at step {step}")
            raise RuntimeError(f"requested failure on rank {ctx.rank} at step {step}")
        if ctx.rank == hang_rank and step == hang_step:
            time.sleep(10**6)
        if ctx.rank == busy_rank and step == busy_step:
            _compute_for(busy_seconds, ctx.cancel_requested)  # one long step: no progress, but the CPU works
        if ctx.rank == stop_rank and step == stop_step:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(seconds_per_step)
        contribution = torch.tensor([float(ctx.rank + 1)], dtype=torch.float64)
        total += ctx.comm.all_reduce_sum(contribution.to(ctx.device)).cpu()
        ctx.step("count", step + 1, steps)
    return {"steps": steps, "total": float(total.item())}, {}


@job("fill")
def fill(ctx: JobContext, fields: dict, tensors: dict[str, torch.Tensor]):
    """Return a float32 tensor of ``numel`` values, to measure the result handoff (bench/ipc.py)."""
    numel = _number(fields, "numel", 0, 0, MAX_FILL_ELEMENTS, integer=True)
    hang_rank = _rank_field(ctx, fields, "hang_rank")
    started = time.perf_counter()
    values = ctx.shared_output("values", (numel,)) if ctx.rank == 0 else torch.empty(numel)
    values.fill_(float(ctx.rank + 1))
    if ctx.rank == hang_rank:  # holds its segment until killed
        time.sleep(10**6)
    return {"fill_seconds": time.perf_counter() - started}, {"values": values}


def _compute_for(seconds: float, cancelled) -> None:
    """Keep the CPU busy for ``seconds``, or until the job is cancelled: the step then ends and
    every rank stops at its boundary."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not cancelled():
        sum(range(10_000))


@job("say")
def say(ctx: JobContext, fields: dict, tensors: dict[str, torch.Tensor]):
    """Log ``text`` on every rank through the module's logger, and a line naming the rank."""
    text = str(fields.get("text", ""))
    log.info("%s", text)
    log.info("%s from rank %d", text, ctx.rank)
    return {}, {}


# Both run the same collectives whether a rank holds the entry or not: a survivor may keep them.
keep_across_replacement("remembered", "held_file")


@job("remember")
def remember(ctx: JobContext, fields: dict, tensors: dict[str, torch.Tensor]):
    """Keep ``value`` in every rank's state; ``recall`` returns what each rank kept."""
    ctx.state["remembered"] = fields.get("value")
    if ctx.rank == fields.get("fail_rank"):
        raise RuntimeError(f"requested failure on rank {ctx.rank} after remembering")
    return {"remembered": fields.get("value")}, {}


@job("recall")
def recall(ctx: JobContext, fields: dict, tensors: dict[str, torch.Tensor]):
    kept = torch.tensor([float(ctx.state.get("remembered", -1))], dtype=torch.float64)
    every_rank = ctx.control.all_gather(kept, dim=0) if ctx.world_size > 1 else kept
    return {"remembered": every_rank.tolist()}, {}


@job("hold_file")
def hold_file(ctx: JobContext, fields: dict, tensors: dict[str, torch.Tensor]):
    """Keep the safetensors file ``path`` resident (read once per rank process); log and return the
    bytes each rank read from disk for this job. Only a file in the fleet's private folder (where its
    socket is) may be named: any client may run this job."""
    path = fields.get("path")
    folder = os.environ.get(FLEET_DIR_ENV)
    inside = isinstance(path, str) and folder is not None and Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
    if not inside or not os.path.isfile(path):
        raise JobInputError(f"hold_file needs the 'path' of a safetensors file in the fleet's private folder {folder}, got {path!r}")
    held = ctx.state.get("held_file")
    read = 0
    if held is None or held[0] != path:
        weights = load_file(path)
        read = sum(tensor.nbytes for tensor in weights.values())
        ctx.state["held_file"] = (path, weights)
    ctx.log(f"hold_file: {read / 2**20:.1f} MiB read from disk")
    per_rank = torch.tensor([float(read)], dtype=torch.float64)
    every_rank = ctx.control.all_gather(per_rank, dim=0) if ctx.world_size > 1 else per_rank
    checksum = sum(float(tensor.to(torch.float64).sum()) for tensor in ctx.state["held_file"][1].values())
    return {"bytes_read": [int(value) for value in every_rank.tolist()], "checksum": checksum}, {}


MAX_MODULE_NAMES = 16
# What ``modules`` may import: the project's packages and the kernel package they load (imports run code).
MODULE_PACKAGES = ("mgpu_backend", "mgpu_kernels", "kernels")


@job("modules")
def modules(ctx: JobContext, fields: dict, tensors: dict[str, torch.Tensor]):
    """Where each named module of MODULE_PACKAGES is imported from on every rank (its file, or the
    import error), so a test or ``doctor`` can tell which copy of a package the fleet runs."""
    names = fields.get("names")
    if (
        not isinstance(names, list)
        or not 0 < len(names) <= MAX_MODULE_NAMES
        or not all(isinstance(name, str) and all(part.isidentifier() for part in name.split(".")) for name in names)
    ):
        raise JobInputError(f"names must be a list of 1 to {MAX_MODULE_NAMES} dotted module names, got {names!r}")
    outside = [name for name in names if name.split(".")[0] not in MODULE_PACKAGES]
    if outside:
        raise JobInputError(f"modules imports only modules of the packages {', '.join(MODULE_PACKAGES)}; not {', '.join(outside)}")
    here = {}
    for name in names:
        try:
            here[name] = getattr(importlib.import_module(name), "__file__", None) or "(built in)"
        except Exception as exc:  # noqa: BLE001 - the answer is which error, not a failed job
            here[name] = f"ImportError: {type(exc).__name__}: {exc}"
    digest = hashlib.sha256(json.dumps(here, sort_keys=True).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    every_rank = ctx.control.all_gather(mine.unsqueeze(0), dim=0).flatten().tolist() if ctx.world_size > 1 else [mine.item()]
    differing = [rank for rank, value in enumerate(every_rank) if value != every_rank[0]]
    return {"modules": here, "ranks_differing_from_rank_0": differing}, {}
