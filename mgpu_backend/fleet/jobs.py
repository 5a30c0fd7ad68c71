"""The registry of job types the ranks can run, and the context a job runs in.

A job type is a function ``fn(ctx, fields, tensors) -> (fields, tensors)`` registered with
``@job("name")``. It runs on every rank at once (SPMD); rank 0's return value is the job's result.
Adding an LTX-2 operation means registering a function in a module listed in ``JOB_MODULES``:
the server, the protocol and the rank loop never change for it.

A job reports progress with ``ctx.step(stage, step, total)``, which is also the cancel point: every
rank calls it at the same places, the ranks agree on a cancel flag there, and all of them raise
``JobCancelled`` at the same step. Jobs must never talk to the socket themselves.

``ctx.state`` outlives jobs, failed jobs included, and a surviving rank keeps it when another rank
is replaced, as far as the job module declared with ``keep_across_replacement`` that it may.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mgpu_backend.fleet import shm
from mgpu_backend.parallel.comm import Comm

JOB_MODULES = ("mgpu_backend.fleet.selftest_jobs", "mgpu_backend.ltx.jobs", "mgpu_backend.ltx.diagnostics", "mgpu_backend.comfy_model.jobs")

JobFn = Callable[["JobContext", dict[str, Any], dict[str, torch.Tensor]], tuple[dict[str, Any], dict[str, torch.Tensor]]]
JOBS: dict[str, JobFn] = {}
# The ``state`` entries a surviving rank keeps when other ranks are replaced (see keep_across_replacement).
KEPT_ACROSS_REPLACEMENT: set[str] = set()


class JobCancelled(Exception):
    """Raised on every rank at the same step boundary when the client cancelled the job."""


class JobInputError(ValueError):
    """Bad input found before any heavy work; the fleet stays as it was."""


def job(name: str) -> Callable[[JobFn], JobFn]:
    def register(fn: JobFn) -> JobFn:
        if name in JOBS and JOBS[name] is not fn:
            raise ValueError(f"job type {name!r} is registered twice")
        JOBS[name] = fn
        return fn

    return register


def keep_across_replacement(*keys: str) -> None:
    """Declare ``state`` entries that stay valid when a rank dies and is replaced by a fresh one.

    After a replacement the survivors keep their process, but an entry is only kept if the jobs
    run the same collectives whether or not a rank holds it (the replacement starts empty and
    builds it on its next job). Every other entry is dropped on the survivors, so that all ranks
    rebuild it together; a job module opts in here once its state can rejoin a fleet.
    """
    KEPT_ACROSS_REPLACEMENT.update(keys)


def load_job_modules() -> None:
    for module in JOB_MODULES:
        importlib.import_module(module)


@dataclass
class JobContext:
    """What a job sees of its rank: who it is, how to talk to the other ranks, how to report."""

    rank: int
    world_size: int
    device: torch.device
    comm: Comm  # the whole fleet (NCCL on GPUs, gloo on CPU)
    control: Comm  # gloo, CPU tensors: cancel flags and job relay
    state: dict[str, Any]  # lives as long as the rank process: loaded models, caches
    emit: Callable[[str, dict[str, Any]], None]  # send an event to the server
    # Every rank hears a cancel from the server, not all at the same moment: poll it to cut a long
    # step short, but stop only in ``step``, where the ranks agree.
    cancel_requested: Callable[[], bool]
    job_id: str = ""
    owner_pid: int = 0  # the server's pid: shared-memory segments are named after it
    shared_outputs: dict[str, tuple[torch.Tensor, dict]] = field(default_factory=dict)
    _last_step_time: float = field(default_factory=time.perf_counter)

    def shared_output(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A result tensor allocated in shared memory (rank 0): returning it under ``name`` hands it
        to the client without a copy. Use it for results of hundreds of megabytes (decoded frames)."""
        tensor, descriptor = shm.create_tensor(name, tuple(shape), dtype, owner_pid=self.owner_pid)
        self.shared_outputs[name] = (tensor, descriptor)
        return tensor

    def discard_shared_outputs(self) -> None:
        for _, descriptor in self.shared_outputs.values():
            shm.unlink_segment(descriptor["segment"])
        self.shared_outputs.clear()

    def log(self, text: str) -> None:
        self.emit("log", {"text": text})

    def step(self, stage: str, step: int, total: int) -> None:
        """Report that ``step`` of ``total`` in ``stage`` is done; raise JobCancelled if cancelled.

        Collective: every rank must call it with the same arguments.
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # report a step when it is done, not when it is queued
        now = time.perf_counter()
        seconds, self._last_step_time = now - self._last_step_time, now
        self.emit("progress", {"stage": stage, "step": step, "total": total, "seconds": round(seconds, 6)})
        flag = torch.tensor([1 if self.cancel_requested() else 0], dtype=torch.int32)
        if self.control.all_reduce_max(flag).item():
            raise JobCancelled(f"cancelled at {stage} step {step}/{total}")
