"""Decide, on every rank of a group at once, how its all-to-all runs: CUDA IPC kernel or torch.distributed.

``install_fast_all_to_all(comm)`` is the one entry point. Each rank checks what it can do locally
(CUDA present, library built, buffer allocated, every peer's buffer opened); the ranks compare
their answers through torch.distributed, and the kernel is installed on the Comm only when every
rank can use it. Otherwise the Comm keeps torch.distributed, and the log says once which path was
chosen and, for each rank that could not, why. Setting ``MGPU_ALL_TO_ALL=torch`` keeps
torch.distributed everywhere (an off switch for the kernel). Whether the fleet's stage 1 asks for
the kernel at all is the caller's policy (``mgpu_backend.ltx.jobs``: only with ``MGPU_ALL_TO_ALL=ipc``).

It must never leave ranks of one group on different paths, and never raise because the kernel is
unavailable: unavailability is a logged fallback, not an error.
"""

from __future__ import annotations

import logging
import os
import weakref

import torch
import torch.distributed as dist

from mgpu_kernels.build import KernelUnavailable, load_library
from mgpu_kernels.ipc_all_to_all import IpcAllToAll, log_once

log = logging.getLogger(__name__)

CUDA_IPC = "cuda-ipc"
TORCH_DISTRIBUTED = "torch.distributed"
CHOICE_ENV = "MGPU_ALL_TO_ALL"

_installed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_exchange(comm, device, timeout_s: float, buffer_bytes: int, max_buffer_bytes: int) -> IpcAllToAll:
    """This rank's exchange, not yet connected, or ``KernelUnavailable`` saying why not."""
    choice = os.environ.get(CHOICE_ENV, "auto").strip().lower()
    if choice == "torch":
        raise KernelUnavailable(f"{CHOICE_ENV}=torch asks for torch.distributed")
    if choice not in ("", "auto", "ipc"):
        raise ValueError(f"{CHOICE_ENV} must be 'ipc', 'auto' or 'torch', got {choice!r}")
    if not torch.cuda.is_available():
        raise KernelUnavailable("CUDA is not available in this process")
    library = load_library()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise KernelUnavailable(f"this rank computes on {device}, not on a GPU")
    return IpcAllToAll(comm, library, device, timeout_s, buffer_bytes, max_buffer_bytes)


def _gather(comm, value) -> list:
    gathered = [None] * comm.world_size
    dist.all_gather_object(gathered, value, group=comm.group)
    return gathered


def _spoken_reasons(reasons: list[str | None]) -> str:
    failed = {rank: reason for rank, reason in enumerate(reasons) if reason is not None}
    if len(set(failed.values())) == 1 and len(failed) == len(reasons):
        return f"every rank: {next(iter(failed.values()))}"
    return "; ".join(f"rank {rank}: {reason}" for rank, reason in failed.items())


def _keep_torch_distributed(comm, reasons: list[str | None]) -> str:
    comm.use_all_to_all(None)
    log_once(
        "all-to-all over ranks %s: torch.distributed (%s); CUDA IPC kernel not used: %s",
        comm.global_ranks, comm.backend, _spoken_reasons(reasons),
    )
    return TORCH_DISTRIBUTED


def install_fast_all_to_all(
    comm,
    device: torch.device | str | None = None,
    timeout_s: float = 30.0,
    buffer_bytes: int = 16 << 20,
    max_buffer_bytes: int = 2 << 30,
) -> str:
    """Collective: make ``comm.all_to_all`` run on the CUDA IPC kernel when every rank can; return
    ``"cuda-ipc"`` or ``"torch.distributed"``.

    Every rank of ``comm`` must call it together. ``device`` is the GPU this rank exchanges on (default:
    the current CUDA device). ``timeout_s`` bounds how long a rank waits for a peer inside one
    exchange before raising ``AllToAllTimeout``; ``buffer_bytes`` is the first receive buffer (it
    grows as needed up to ``max_buffer_bytes``; larger exchanges use torch.distributed).
    """
    if comm.world_size == 1:
        return TORCH_DISTRIBUTED
    uninstall_fast_all_to_all(comm)
    exchange, handle, reason = None, None, None
    try:
        exchange = _local_exchange(comm, device, timeout_s, buffer_bytes, max_buffer_bytes)
        handle = exchange.allocate()
    except KernelUnavailable as unavailable:
        reason = str(unavailable)
    except Exception as error:  # noqa: BLE001 - an allocation failure on one rank means: nobody uses it
        reason = f"{type(error).__name__}: {error}"

    answers = _gather(comm, (reason, handle))
    reasons = [answer[0] for answer in answers]
    if any(reasons):
        if exchange is not None:
            exchange.release_local()  # nobody opened it: peers only open once every rank allocated
        return _keep_torch_distributed(comm, reasons)

    try:
        exchange.open_peers([answer[1] for answer in answers])
    except Exception as error:  # noqa: BLE001 - e.g. GPUs without peer access: fall back everywhere
        reason = f"{type(error).__name__}: {error}"
    reasons = _gather(comm, reason)
    if any(reasons):
        exchange.close()
        return _keep_torch_distributed(comm, reasons)

    comm.use_all_to_all(exchange)
    _installed[comm] = exchange
    log_once(
        "all-to-all over ranks %s: CUDA IPC kernel on cuda:%d (%d MiB receive buffer per rank, %.1f s timeout)",
        comm.global_ranks, exchange.device_index, exchange.capacity >> 20, exchange.timeout_s,
    )
    return CUDA_IPC


def uninstall_fast_all_to_all(comm) -> None:
    """Collective: put ``comm`` back on torch.distributed and free the kernel's buffers (no-op if none)."""
    exchange = _installed.pop(comm, None)
    if exchange is not None:
        comm.use_all_to_all(None)
        exchange.close()
