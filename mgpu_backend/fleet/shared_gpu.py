"""N ranks on one GPU: a correctness and memory mode of the fleet, never a speed mode.

What it is
    With ``MGPU_SHARED_GPU_RANKS=N`` in the server's environment, every GPU the fleet is given runs N
    rank processes instead of one (``serve --gpus 0`` then has N ranks, all on ``cuda:0``). NCCL
    refuses two ranks on one GPU, so such a fleet's ranks talk over gloo with CUDA tensors: every
    collective (SP all-to-all, guidance exchange, TDP all-reduce, the weight-sharding gathers) works
    and computes exactly what it computes between GPUs, through host memory.

When to use it
    To check on one GPU what a multi-GPU fleet computes (SP degrees 2 to 8, guidance and hybrid plans,
    tiled stages, weight sharding at full-size token counts), and to measure per-rank memory: cap each
    rank with ``MGPU_MEMORY_FRACTION`` (``torch.cuda.set_per_process_memory_fraction``) to stand for a
    smaller GPU. Never for speed: the ranks take turns on one GPU and every exchange crosses host
    memory, so timings say nothing about N GPUs. Speed benchmarks refuse to run in this mode
    (``refuse_for_speed``). CUDA graphs are not captured over a gloo SP group (a graph cannot hold
    gloo's host-side collectives); SP degree 1 plans still capture them.

``peer_access_line`` is the fleet's other line about how its ranks reach each other's GPUs: the
one rank 0 logs at start when some GPUs of the fleet have no peer-to-peer access (consumer cards),
so that NCCL's route through host memory is never a surprise.

This module reads the environment and the GPUs' peer flags only; the controller spawns the ranks,
the rank picks its backend.
"""

from __future__ import annotations

import os

from mgpu_backend.fleet.settings import number_setting

SHARED_GPU_RANKS_ENV = "MGPU_SHARED_GPU_RANKS"
MAX_SHARED_GPU_RANKS = 8


def shared_gpu_ranks(environ: dict | None = None) -> int:
    """Ranks per GPU asked for by ``MGPU_SHARED_GPU_RANKS`` (1 when unset: one rank per GPU)."""
    value = number_setting(
        environ if environ is not None else os.environ, SHARED_GPU_RANKS_ENV, int, lambda ranks: 1 <= ranks <= MAX_SHARED_GPU_RANKS,
        f"a number of ranks per GPU from 1 to {MAX_SHARED_GPU_RANKS}", "for one rank per GPU",
    )  # fmt: skip
    return 1 if value is None else value


def describe(ranks_per_gpu: int) -> str:
    """The server's line about the mode (empty for one rank per GPU)."""
    if ranks_per_gpu == 1:
        return ""
    return (
        f"{ranks_per_gpu} ranks share each GPU over gloo ({SHARED_GPU_RANKS_ENV}={ranks_per_gpu}): a correctness and memory "
        "mode; its timings are not multi-GPU speed figures"
    )


def peer_access_line(gpu_count: int, can_access_peer) -> str | None:
    """One line naming the GPU pairs (of ``gpu_count`` visible GPUs) without peer-to-peer access, or
    None when every pair has it. ``can_access_peer(a, b)``: ``torch.cuda.can_device_access_peer``."""
    missing = [(a, b) for a in range(gpu_count) for b in range(gpu_count) if a != b and not can_access_peer(a, b)]
    if not missing:
        return None
    pairs = ", ".join(f"{a}->{b}" for a, b in missing)
    return (
        f"no peer-to-peer access between GPUs {pairs}: the fleet runs without P2P, NCCL moves SP exchanges and weight "
        "gathers over PCIe through host memory (about 25 GB/s on PCIe 4.0 x16); see 'python -m mgpu_backend doctor'"
    )


def refuse_for_speed(what: str, environ: dict | None = None) -> None:
    """Stop a speed benchmark that would run on ranks sharing a GPU, saying why and what to do."""
    ranks = shared_gpu_ranks(environ)
    if ranks > 1:
        raise SystemExit(
            f"{what} measures speed, but {SHARED_GPU_RANKS_ENV}={ranks} puts {ranks} ranks on each GPU over gloo, which "
            f"takes turns on one GPU and exchanges through host memory; unset {SHARED_GPU_RANKS_ENV} and give the fleet one "
            "GPU per rank (the shared mode is for correctness and memory checks)"
        )
