"""The controller: starts the rank processes, runs one job on them, and notices any rank failing.

``Fleet`` owns the rank processes of one server. ``Fleet.run_job`` hands a job to rank 0, forwards
every event to the caller, and returns when all ranks report ``done``. A rank that dies, or a job
that makes no progress on any rank for ``rank_timeout`` seconds, fails the job with an error naming
the rank; the fleet then kills every rank and starts a fresh set, so the next job runs normally.
A rank is started with ``python -m mgpu_backend rank`` from a clean ``__main__``, never forked from
the server, and never outlives it (it exits when its socket to the server closes).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mgpu_backend import PACKAGE_ROOT
from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.protocol import Message

log = logging.getLogger("mgpu.fleet")

READY_TIMEOUT_SECONDS = 300.0
ERROR_GRACE_SECONDS = 5.0  # after one rank fails, how long the others get to finish cleanly


@dataclass(frozen=True)
class DeviceSpec:
    """Which devices the fleet runs on: CUDA GPU indices, or a number of CPU ranks."""

    gpus: tuple[int, ...] = ()
    cpu_ranks: int = 0

    def __post_init__(self) -> None:
        if bool(self.gpus) == bool(self.cpu_ranks):
            raise ValueError("give either GPUs or a number of CPU ranks")
        if self.cpu_ranks < 0 or len(set(self.gpus)) != len(self.gpus):
            raise ValueError("CPU ranks must be positive and GPUs distinct")

    @property
    def world_size(self) -> int:
        return len(self.gpus) or self.cpu_ranks

    def describe(self) -> str:
        return f"GPUs {','.join(map(str, self.gpus))}" if self.gpus else f"{self.cpu_ranks} CPU rank(s)"

    def visible_device_ids(self, environ: dict | None = None) -> list[str]:
        """CUDA_VISIBLE_DEVICES for the ranks. ``gpus`` index the GPUs this process sees, so under
        an existing CUDA_VISIBLE_DEVICES=2,3 the indices 0,1 mean the physical GPUs 2 and 3."""
        inherited = (environ if environ is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
        if not inherited:
            return [str(gpu) for gpu in self.gpus]
        ids = [part.strip() for part in inherited.split(",") if part.strip()]
        missing = [gpu for gpu in self.gpus if gpu >= len(ids)]
        if missing:
            raise ValueError(f"GPU index {missing[0]} is not visible: CUDA_VISIBLE_DEVICES={inherited} shows {len(ids)} GPU(s)")
        return [ids[gpu] for gpu in self.gpus]

    @classmethod
    def parse(cls, gpus: str | None, cpu_ranks: int | None) -> DeviceSpec:
        if gpus and cpu_ranks:
            raise ValueError("use --gpus or --cpu-ranks, not both")
        if cpu_ranks:
            return cls(cpu_ranks=cpu_ranks)
        if gpus and gpus != "all":
            try:
                return cls(gpus=tuple(int(gpu) for gpu in gpus.split(",")))
            except ValueError:
                raise ValueError(f"--gpus takes a list like 0,1,2,3 or 'all'; got {gpus!r}") from None
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            if gpus == "all":
                raise ValueError("no CUDA GPU is visible; use --cpu-ranks N to run on the CPU")
            return cls(cpu_ranks=1)
        return cls(gpus=tuple(range(count)))


class JobFailed(Exception):
    def __init__(self, message: str, rank: int | None = None, traceback: str | None = None, kind: str = "error"):
        super().__init__(message)
        self.rank, self.traceback, self.kind = rank, traceback, kind


@dataclass
class RankProcess:
    rank: int
    device: str
    process: subprocess.Popen
    sock: socket.socket
    info: dict = field(default_factory=dict)  # from 'ready' and heartbeats: pid, device, memory
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: Message) -> None:
        with self.send_lock:
            protocol.send_message(self.sock, message)


class Fleet:
    def __init__(self, devices: DeviceSpec, rank_timeout: float = 600.0, owner_pid: int | None = None):
        self.devices = devices
        self.rank_timeout = rank_timeout
        self.owner_pid = owner_pid or os.getpid()
        self.ranks: list[RankProcess] = []
        self.events: queue.Queue[tuple[int, Message | None]] = queue.Queue()
        self.generation = 0
        self.known_jobs: list[str] = []
        self.restarts = 0
        self._store_dir = tempfile.TemporaryDirectory(prefix="mgpu-store-")

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.generation += 1
        self.events = queue.Queue()
        store_path = os.path.join(self._store_dir.name, f"store-{self.generation}")
        visible = ",".join(self.devices.visible_device_ids())
        for rank in range(self.devices.world_size):
            parent_sock, child_sock = (protocol.tune_socket(end) for end in socket.socketpair())
            device = f"cuda:{rank}" if self.devices.gpus else "cpu"
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            if self.devices.gpus:
                env["CUDA_VISIBLE_DEVICES"] = visible
                env.setdefault("NCCL_NVLS_ENABLE", "0")
            command = [
                sys.executable, "-m", "mgpu_backend", "rank",
                "--rank", str(rank), "--world-size", str(self.devices.world_size),
                "--fd", str(child_sock.fileno()), "--device", device,
                "--store", store_path, "--owner-pid", str(self.owner_pid),
            ]  # fmt: skip
            process = subprocess.Popen(command, pass_fds=[child_sock.fileno()], env=env, cwd=str(PACKAGE_ROOT))
            child_sock.close()
            rank_process = RankProcess(rank, device, process, parent_sock)
            self.ranks.append(rank_process)
            threading.Thread(target=self._read_rank, args=(rank_process, self.events), daemon=True).start()
        self._wait_ready()
        log.info("fleet up: %s, %d rank(s)", self.devices.describe(), len(self.ranks))

    def _wait_ready(self) -> None:
        pending = {rank.rank for rank in self.ranks}
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while pending:
            try:
                rank, message = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise JobFailed(f"rank(s) {sorted(pending)} did not start within {READY_TIMEOUT_SECONDS:.0f} s") from None
            if message is None:
                code = self.ranks[rank].process.wait()
                self.stop()
                raise JobFailed(f"rank {rank} exited with code {code} while starting; see the server log", rank=rank)
            if message.type == "ready":
                self.ranks[rank].info.update(message.fields)
                self.known_jobs = message.fields.get("jobs", self.known_jobs)
                pending.discard(rank)

    def stop(self) -> None:
        """Kill every rank process and wait for them; safe to call twice."""
        for rank in self.ranks:
            try:
                rank.sock.close()
            except OSError:
                pass
        for rank in self.ranks:
            if rank.process.poll() is None:
                rank.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for rank in self.ranks:
            try:
                rank.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait()
        self.ranks = []

    def restart(self, reason: str) -> None:
        log.warning("restarting the fleet: %s", reason)
        self.restarts += 1
        self.stop()
        shm.sweep_orphans()
        self.start()

    def alive(self) -> bool:
        return bool(self.ranks) and all(rank.process.poll() is None for rank in self.ranks)

    def _read_rank(self, rank: RankProcess, events: queue.Queue) -> None:
        try:
            while True:
                message = protocol.recv_message(rank.sock)
                if message.type == "heartbeat":
                    rank.info.update(message.fields)
                    rank.info["heartbeat"] = time.time()
                    continue
                events.put((rank.rank, message))
        except (protocol.ConnectionClosed, protocol.ProtocolError, OSError):
            events.put((rank.rank, None))

    # -- running a job ---------------------------------------------------------------------------
    def cancel(self, job_id: str) -> None:
        for rank in self.ranks:
            try:
                rank.send(Message("cancel", job=job_id))
            except OSError:
                pass

    def run_job(
        self, job_id: str, op: str, args: dict, tensors: dict, input_segments: list[dict], on_event: Callable[[Message], None]
    ) -> Message:
        """Run one job on all ranks; forward progress and log events; return rank 0's result message.

        Raises JobFailed (kind 'error', 'input_error' or 'cancelled'). After a rank death or hang
        the fleet has already been restarted when this raises.
        """
        if not self.alive():
            self.restart("a rank was gone before the job started")
        self.ranks[0].send(Message("job", {"op": op, "args": args}, tensors, job=job_id, shm=input_segments))
        done: dict[int, dict] = {}
        result: Message | None = None
        progress_count = [0] * len(self.ranks)
        step_seconds: list[float | None] = [None] * len(self.ranks)
        first_failure: JobFailed | None = None
        last_progress = time.monotonic()
        grace_deadline: float | None = None
        while len(done) < len(self.ranks):
            timeout = self.rank_timeout - (time.monotonic() - last_progress)
            if grace_deadline is not None:
                timeout = min(timeout, grace_deadline - time.monotonic())
            try:
                rank, message = self.events.get(timeout=max(0.05, timeout))
            except queue.Empty:
                if grace_deadline is not None and time.monotonic() >= grace_deadline:
                    stuck = sorted(set(range(len(self.ranks))) - set(done))
                    self.restart(f"ranks {stuck} did not finish after rank {first_failure.rank} failed")
                    raise first_failure from None
                failure = self._hang_failure(progress_count)
                self.restart(f"job {job_id} hung")
                raise failure from None
            if message is None:
                code = self.ranks[rank].process.wait(timeout=10)
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                failure = JobFailed(f"rank {rank} (pid {self.ranks[rank].process.pid}) died ({how}); the fleet was restarted", rank=rank)
                self.restart(f"rank {rank} died during job {job_id}")
                raise failure
            if message.job != job_id:
                continue
            if message.type == "progress":
                last_progress = time.monotonic()
                progress_count[rank] += 1
                step_seconds[rank] = message.fields.get("seconds")
                if rank == 0:
                    on_event(Message("progress", {**message.fields, "rank_seconds": list(step_seconds)}, job=job_id))
            elif message.type == "preview":
                if rank == 0:  # only rank 0 sends previews; one from elsewhere would be a bug, not news
                    on_event(message)
            elif message.type == "log":
                last_progress = time.monotonic()
                # Also in the server's log (server.log of a fleet a client started), so what a job
                # said (plans, bytes read, per-rank memory) can be read after the fact.
                log.info("job %s %s, rank %s: %s", job_id, op, message.fields.get("rank"), message.fields.get("text", ""))
                on_event(message)
            elif message.type == "result":
                result = message
            elif message.type == "done":
                done[rank] = message.fields
                self.ranks[rank].info["memory"] = message.fields.get("memory")
                status = message.fields.get("status")
                if status != "ok" and first_failure is None:
                    first_failure = JobFailed(
                        message.fields.get("message", status), rank=rank, traceback=message.fields.get("traceback"), kind=status
                    )
                    grace_deadline = time.monotonic() + ERROR_GRACE_SECONDS
        if first_failure is not None:
            raise first_failure
        assert result is not None, "rank 0 finished without sending a result"
        return result

    def _hang_failure(self, progress_count: list[int]) -> JobFailed:
        """Name the rank(s) a hung job waits for: not inside a collective, or behind the others."""
        outside = [rank.rank for rank in self.ranks if not rank.info.get("in_collective", False)]
        behind = [r for r, count in enumerate(progress_count) if count == min(progress_count)]
        suspects = outside if 0 < len(outside) < len(self.ranks) else behind
        if len(suspects) == len(self.ranks):
            who, culprit = f"ranks {suspects}", None
        else:
            who, culprit = ", ".join(f"rank {r}" for r in suspects), suspects[0]
        where = "; ".join(f"rank {r} at {self.ranks[r].info.get('where', '?')}" for r in suspects)
        return JobFailed(
            f"{who} made no progress for {self.rank_timeout:.0f} s (hung: {where}); the fleet was restarted",
            rank=culprit,
        )

    def describe(self) -> list[dict]:
        return [
            {
                "rank": rank.rank,
                "pid": rank.process.pid,
                "device": rank.device,
                "alive": rank.process.poll() is None,
                "memory": rank.info.get("memory"),
                "weights": rank.info.get("weights"),
            }
            for rank in self.ranks
        ]
