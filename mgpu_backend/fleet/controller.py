"""The controller: starts the rank processes, runs one job on them, and notices any rank failing.

``Fleet`` owns the rank processes of one server. ``Fleet.run_job`` hands a job to rank 0, forwards
every event to the caller (log lines that every rank wrote alike collapsed into one), and returns
when all ranks report ``done``. What can go wrong, and what it costs:

- A job fails on some ranks (an exception, an input error found on one rank only): the job ends in
  an error naming the first failing rank with its traceback, on every rank. If the other ranks
  finish by themselves the fleet goes on as it was; if some wait in a collective for the failed
  one, the controller tells every rank to break its process groups (which frees them) and to form
  new ones on a fresh rendezvous store. No process is restarted and no weights are reloaded.
- A rank dies, is stopped (no heartbeat: SIGSTOP) or is hung (no rank progresses or computes for
  ``rank_timeout`` seconds and it is not waiting in a collective): that rank is killed and replaced;
  the surviving ranks keep their processes (and the state their jobs declared safe to keep) and
  form new groups with the replacement, which loads its own on the next job.
- A rank that computes (its main thread's CPU time advances) is never declared hung for a long
  step; a cancel still stops it at its next step boundary.

A rank is started with ``python -m mgpu_backend rank`` from a clean ``__main__``, never forked from
the server, and never outlives it: it exits when its socket to the server closes, and the kernel
kills it when the server thread that started it ends (``PR_SET_PDEATHSIG``), stopped or not; ranks
are therefore started only from the server's long-lived threads (its main thread and job loop).
``stop`` ends every rank and never starts one again; segments a failed job's ranks created are
unlinked. Ranks form their groups over loopback only (``GLOO_SOCKET_IFNAME=lo``), whatever the host
name resolves to, on a file rendezvous in a private temporary folder that keeps only the current
generation's store and is removed with the fleet. A rank that dies or stops while the ranks form
their groups ends the wait at once: the others cannot form a group without it.
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mgpu_backend import PACKAGE_ROOT
from mgpu_backend.fleet import protocol, shared_gpu, shm
from mgpu_backend.fleet.protocol import Message

log = logging.getLogger("mgpu.fleet")

READY_TIMEOUT_SECONDS = 300.0
ERROR_GRACE_SECONDS = 2.0  # after one rank fails, how long the others get to finish before the groups are broken
BREAK_TIMEOUT_SECONDS = 30.0  # how long a surviving rank gets to leave its groups once told to
BUSY_CPU_SECONDS = 0.05  # main-thread CPU time between two heartbeats that counts as working
SILENT_AT_HANG_SECONDS = 3.0  # when a job hangs, a rank silent this long is the stopped one
LOG_COLLAPSE_SECONDS = 1.0  # how long a log line waits for the same line from the other ranks
SERVER_PID_ENV = "MGPU_SERVER_PID"  # a rank exits at once if its parent is no longer this process
FLEET_DIR_ENV = "MGPU_FLEET_DIR"  # the server's private folder


@dataclass(frozen=True)
class DeviceSpec:
    """Which devices the fleet runs on: CUDA GPU indices, or a number of CPU ranks."""

    gpus: tuple[int, ...] = ()
    cpu_ranks: int = 0
    ranks_per_gpu: int = 1  # above 1: that many ranks on each GPU, over gloo (``shared_gpu``)

    def __post_init__(self) -> None:
        if bool(self.gpus) == bool(self.cpu_ranks):
            raise ValueError("give either GPUs or a number of CPU ranks")
        if self.cpu_ranks < 0 or len(set(self.gpus)) != len(self.gpus):
            raise ValueError("CPU ranks must be positive and GPUs distinct")

    @property
    def world_size(self) -> int:
        return len(self.gpus) * self.ranks_per_gpu or self.cpu_ranks

    def describe(self) -> str:
        if not self.gpus:
            return f"{self.cpu_ranks} CPU rank(s)"
        return f"GPUs {','.join(map(str, self.gpus))}" + (f"; {shared_gpu.describe(self.ranks_per_gpu)}" if self.ranks_per_gpu > 1 else "")

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

    def check_gpus_visible(self) -> None:
        """GPUs named by index must exist here: otherwise every rank would die with a CUDA traceback."""
        if not self.gpus:
            return
        import torch

        count = torch.cuda.device_count()
        missing = [gpu for gpu in self.gpus if not 0 <= gpu < count]
        if count == 0:
            raise ValueError(
                f"--gpus {','.join(map(str, self.gpus))} names CUDA GPUs, but none is visible (no CUDA device or driver, or "
                "CUDA_VISIBLE_DEVICES hides them); use --cpu-ranks N to run on the CPU"
            )
        if missing:
            raise ValueError(f"--gpus names GPU {','.join(map(str, missing))}, but only GPUs 0..{count - 1} are visible; use indices in that range")

    @classmethod
    def parse(cls, gpus: str | None, cpu_ranks: int | None) -> DeviceSpec:
        if gpus and cpu_ranks:
            raise ValueError("use --gpus or --cpu-ranks, not both")
        if cpu_ranks:
            return cls(cpu_ranks=cpu_ranks)
        per_gpu = shared_gpu.shared_gpu_ranks()
        if gpus and gpus != "all":
            try:
                return cls(gpus=tuple(int(gpu) for gpu in gpus.split(",")), ranks_per_gpu=per_gpu)
            except ValueError:
                raise ValueError(f"--gpus takes a list like 0,1,2,3 or 'all'; got {gpus!r}") from None
        import torch

        count = torch.cuda.device_count()
        if count == 0:
            if gpus == "all":
                raise ValueError("no CUDA GPU is visible; use --cpu-ranks N to run on the CPU")
            return cls(cpu_ranks=1)
        return cls(gpus=tuple(range(count)), ranks_per_gpu=per_gpu)


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
    last_heartbeat: float = field(default_factory=time.monotonic)
    last_busy: float = 0.0  # when a heartbeat last showed the main thread computing outside a collective
    closed: bool = False  # its connection ended: the process is dead or dying

    def send(self, message: Message) -> None:
        with self.send_lock:
            protocol.send_message(self.sock, message)

    def process_state(self) -> str:
        """The kernel's one-letter state of the process ('T': stopped), or '' when unknown."""
        try:
            with open(f"/proc/{self.process.pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return ""


def ranks_label(ranks: list[int]) -> str:
    """'rank 3', or 'ranks 0-3,5' for several."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


class JobLog:
    """A job's log lines: the same line from every rank becomes one ('ranks 0-7: ...'); a line some
    ranks did not write within LOG_COLLAPSE_SECONDS goes out with the ranks that did."""

    def __init__(self, world_size: int, job_id: str, op: str, on_event: Callable[[Message], None]) -> None:
        self.world_size, self.job_id, self.op, self.on_event = world_size, job_id, op, on_event
        self.pending: deque[tuple[str, set[int], float]] = deque()

    def add(self, rank: int, text: str) -> None:
        for index, (pending_text, ranks, _) in enumerate(self.pending):
            if pending_text == text and rank not in ranks:
                ranks.add(rank)
                if len(ranks) == self.world_size:
                    del self.pending[index]
                    self._write(text, ranks)
                return
        self.pending.append((text, {rank}, time.monotonic()))
        if self.world_size == 1:
            self.flush(0.0)

    def flush(self, older_than: float = LOG_COLLAPSE_SECONDS) -> None:
        now = time.monotonic()
        while self.pending and now - self.pending[0][2] >= older_than:
            text, ranks, _ = self.pending.popleft()
            self._write(text, ranks)

    def _write(self, text: str, ranks: set[int]) -> None:
        ordered = sorted(ranks)
        label = ranks_label(ordered)
        # Also in the server's log (server.log of a fleet a client started), so what a job said
        # (plans, bytes read, per-rank memory) can be read after the fact.
        log.info("job %s %s, %s: %s", self.job_id, self.op, label, text)
        rank = ordered[0] if len(ordered) == 1 else label.split(" ", 1)[1]
        self.on_event(Message("log", {"rank": rank, "ranks": ordered, "text": text}, job=self.job_id))


class Fleet:
    def __init__(
        self,
        devices: DeviceSpec,
        rank_timeout: float = 600.0,
        owner_pid: int | None = None,
        heartbeat_timeout: float | None = None,
        private_dir: str | os.PathLike | None = None,
        held_segments: Callable[[], set[str]] = set,
    ):
        self.devices = devices
        self.private_dir = private_dir  # the server's private folder; the ranks' self-test jobs read files only there
        # Segments named after owner_pid that the caller holds (jobs' inputs): never a failed job's to unlink.
        self.held_segments = held_segments
        self.rank_timeout = rank_timeout
        # A rank silent this long is stopped (SIGSTOP) or frozen, whatever the other ranks do.
        self.heartbeat_timeout = heartbeat_timeout or max(10.0, min(rank_timeout, 60.0))
        self.owner_pid = owner_pid or os.getpid()
        self.ranks: list[RankProcess] = []
        self.events: queue.Queue[tuple[RankProcess, Message | None]] = queue.Queue()
        self.generation = 0
        self.known_jobs: list[str] = []
        self.restarts = 0  # rank processes replaced (all of them, or the failed ones)
        self.regroups = 0  # new process groups formed with the surviving processes
        self.closing = False
        self._spawn_lock = threading.Lock()
        self._spawned: list[RankProcess] = []  # every process started and not yet reaped, for stop()
        self._store_dir = tempfile.TemporaryDirectory(prefix="mgpu-store-")

    # -- lifecycle ----------------------------------------------------------------------------------
    def _new_store(self) -> str:
        self.generation += 1
        return os.path.join(self._store_dir.name, f"store-{self.generation}")

    def _drop_old_stores(self) -> None:
        """Remove the rendezvous files of earlier generations: every rank now uses the current one."""
        current = f"store-{self.generation}"
        for name in os.listdir(self._store_dir.name):
            if name != current:
                try:
                    os.unlink(os.path.join(self._store_dir.name, name))
                except OSError:
                    pass

    def _spawn(self, rank: int, store_path: str) -> RankProcess:
        parent_sock, child_sock = (protocol.tune_socket(end) for end in socket.socketpair())
        device = f"cuda:{rank // self.devices.ranks_per_gpu}" if self.devices.gpus else "cpu"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo binds to what the host name resolves to otherwise
        env[SERVER_PID_ENV] = str(os.getpid())
        if self.private_dir is not None:
            env[FLEET_DIR_ENV] = str(self.private_dir)
        if self.devices.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices.visible_device_ids())
            env.setdefault("NCCL_NVLS_ENABLE", "0")
        command = [
            sys.executable, "-m", "mgpu_backend", "rank",
            "--rank", str(rank), "--world-size", str(self.devices.world_size),
            "--fd", str(child_sock.fileno()), "--device", device,
            "--store", store_path, "--owner-pid", str(self.owner_pid),
        ]  # fmt: skip
        with self._spawn_lock:  # stop() sees every process, also one started while it runs
            if self.closing:
                child_sock.close()
                parent_sock.close()
                raise JobFailed("the fleet server is shutting down", kind="cancelled")
            process = subprocess.Popen(command, pass_fds=[child_sock.fileno()], env=env, cwd=str(PACKAGE_ROOT))
            child_sock.close()
            rank_process = RankProcess(rank, device, process, parent_sock)
            self._spawned.append(rank_process)
        threading.Thread(target=self._read_rank, args=(rank_process,), daemon=True).start()
        return rank_process

    def start(self) -> None:
        store_path = self._new_store()
        self.ranks = [self._spawn(rank, store_path) for rank in range(self.devices.world_size)]
        late = self._collect({rank: "ready" for rank in range(len(self.ranks))}, READY_TIMEOUT_SECONDS, together=True)
        if late:
            self.stop_ranks(self.ranks)
            raise JobFailed(f"{ranks_label(late)} did not start within {READY_TIMEOUT_SECONDS:.0f} s; see the server log", rank=late[0])
        self._drop_old_stores()
        log.info("fleet up: %s, %d rank(s)", self.devices.describe(), len(self.ranks))

    def _collect(self, expected: dict[int, str], timeout: float, together: bool = False) -> list[int]:
        """Wait until each rank sent the message type ``expected[rank]``; return the ranks that did
        not in time or died. Other messages (the end of a broken job) are dropped.

        ``together``: the ranks are forming groups, which none can do without every other, so the
        first rank that dies or is stopped ends the wait; all still pending are returned.
        """
        pending = dict(expected)
        deadline = time.monotonic() + timeout
        failed: list[int] = []
        while pending:
            if together:
                lost = [rank for rank in pending if self.ranks[rank].process.poll() is not None or self.ranks[rank].process_state() in ("T", "t", "Z", "X")]
                if lost:
                    log.warning("%s died or stopped while the ranks formed their groups", ranks_label(lost))
                    return sorted(pending)
            try:
                rank, message = self._next_event(min(1.0, max(0.05, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    break
                continue
            if rank not in pending:
                continue
            if message is None:
                failed.append(rank)
                del pending[rank]
                if together:
                    log.warning("rank %d died while the ranks formed their groups", rank)
                    return sorted([*failed, *pending])
            elif message.type == pending[rank]:
                if message.type == "ready":
                    self.ranks[rank].info.update(message.fields)
                    self.known_jobs = message.fields.get("jobs", self.known_jobs)
                del pending[rank]
        return sorted([*failed, *pending])

    def _next_event(self, timeout: float) -> tuple[int, Message | None]:
        """The next event of a current rank process (events of replaced ones are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            rank_process, message = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            if rank_process.rank < len(self.ranks) and self.ranks[rank_process.rank] is rank_process:
                return rank_process.rank, message

    def stop(self) -> None:
        """End every rank process and wait for them; nothing is started after this. Safe to call twice."""
        with self._spawn_lock:
            self.closing = True
            everyone = list(self._spawned)
        self.stop_ranks(everyone)
        self.ranks = []
        self._store_dir.cleanup()

    def stop_ranks(self, ranks: list[RankProcess]) -> None:
        for rank in ranks:
            try:
                rank.sock.close()
            except OSError:
                pass
        for rank in ranks:
            if rank.process.poll() is None:
                rank.process.send_signal(signal.SIGTERM)
                rank.process.send_signal(signal.SIGCONT)  # a stopped process acts on SIGTERM only once resumed
        deadline = time.monotonic() + 5
        for rank in ranks:
            try:
                rank.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rank.process.kill()
                rank.process.wait()
        with self._spawn_lock:
            self._spawned = [rank for rank in self._spawned if rank not in ranks]

    def restart(self, reason: str) -> None:
        """Replace every rank process (the state of all of them is lost)."""
        log.warning("restarting the fleet: %s", reason)
        if self.closing:
            raise JobFailed("the fleet server is shutting down", kind="cancelled")
        self.restarts += 1
        self.stop_ranks(self.ranks)
        shm.sweep_orphans()
        self.start()

    def rebuild(self, kill: set[int], reason: str, told_to_break: set[int] = frozenset(), broken: set[int] = frozenset()) -> str:
        """Replace the ranks in ``kill``; the others keep their process and state and form new
        groups with the replacements. Returns what happened, for the user's error message.

        ``told_to_break``: ranks already sent 'break' in this job; ``broken``: ranks that already
        reported leaving their groups.
        """
        if self.closing:
            raise JobFailed("the fleet server is shutting down", kind="cancelled")
        log.warning("rebuilding the fleet's process groups%s: %s", f", replacing {ranks_label(sorted(kill))}" if kill else "", reason)
        kill = set(kill)
        for rank in sorted(kill):
            self._kill(self.ranks[rank])
        survivors = [rank for rank in range(len(self.ranks)) if rank not in kill]
        for rank in survivors:
            if rank not in told_to_break:
                self._order(rank, "break")
        late = self._collect({rank: "broken" for rank in survivors if rank not in broken}, BREAK_TIMEOUT_SECONDS)
        if late:  # waiting in a collective with another survivor, or hung: replace it too
            log.warning("%s did not leave the process groups within %.0f s; replacing them", ranks_label(late), BREAK_TIMEOUT_SECONDS)
            for rank in late:
                self._kill(self.ranks[rank])
            kill |= set(late)
            survivors = [rank for rank in survivors if rank not in late]
        if not survivors:
            self.restart(reason)
            return "every rank was restarted (the next job reloads the model)"
        store_path = self._new_store()
        for rank in sorted(kill):
            self.ranks[rank] = self._spawn(rank, store_path)
        for rank in survivors:
            self._order(rank, "regroup", {"store": store_path, "replaced": sorted(kill)})
        expected = {rank: "ready" if rank in kill else "regrouped" for rank in range(len(self.ranks))}
        late = self._collect(expected, READY_TIMEOUT_SECONDS, together=True)
        if late:
            self.restart(f"{ranks_label(late)} did not rejoin after: {reason}")
            return "every rank was restarted (the next job reloads the model)"
        self._drop_old_stores()
        self.regroups += 1
        if not kill:
            return "the ranks kept their weights"
        self.restarts += 1
        return f"replaced {ranks_label(sorted(kill))}; {ranks_label(survivors)} kept {'its' if len(survivors) == 1 else 'their'} process"

    def _order(self, rank: int, kind: str, fields: dict | None = None) -> None:
        try:
            self.ranks[rank].send(Message(kind, fields or {}))
        except OSError:
            pass  # a dead rank: its end shows up as a closed connection

    def _kill(self, rank: RankProcess) -> None:
        """SIGKILL (works on a stopped process too), and forget it."""
        try:
            rank.sock.close()
        except OSError:
            pass
        if rank.process.poll() is None:
            rank.process.kill()
        rank.process.wait()
        with self._spawn_lock:
            self._spawned = [other for other in self._spawned if other is not rank]

    def _read_rank(self, rank: RankProcess) -> None:
        try:
            while True:
                message = protocol.recv_message(rank.sock)
                rank.last_heartbeat = time.monotonic()  # any message is a sign of life
                if message.type == "heartbeat":
                    self._note_heartbeat(rank, message.fields)
                    continue
                if message.type == "log" and not message.job:  # a rank's warning between jobs
                    log.warning("rank %s: %s", rank.rank, message.fields.get("text", ""))
                    continue
                self.events.put((rank, message))
        except (protocol.ConnectionClosed, protocol.ProtocolError, OSError):
            rank.closed = True
            self.events.put((rank, None))

    @staticmethod
    def _note_heartbeat(rank: RankProcess, fields: dict) -> None:
        now = time.monotonic()
        cpu_before = rank.info.get("cpu_seconds")
        rank.info.update(fields)
        rank.info["heartbeat"] = time.time()
        rank.last_heartbeat = now
        cpu = fields.get("cpu_seconds")
        if cpu_before is not None and cpu is not None and cpu - cpu_before >= BUSY_CPU_SECONDS and not fields.get("in_collective"):
            rank.last_busy = now

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

        Raises JobFailed (kind 'error', 'input_error' or 'cancelled'). When it raises, the fleet is
        ready for the next job again (failed ranks replaced), and the shared-memory segments the
        ranks made for this job are gone.
        """
        if self.closing:
            raise JobFailed("the fleet server is shutting down", kind="cancelled")
        if not self.ranks:
            self.start()
        gone = [rank.rank for rank in self.ranks if rank.closed or rank.process.poll() is not None or rank.process_state() in ("Z", "X", "")]
        if gone:
            self.rebuild(set(gone), f"{ranks_label(gone)} gone before job {job_id}")
        before = shm.segments_of(self.owner_pid)
        try:
            return self._run_job(job_id, op, args, tensors, input_segments, on_event)
        except JobFailed:
            # A result that never reached the client, or frames a dead rank left behind.
            for segment in shm.segments_of(self.owner_pid) - before - self.held_segments():
                shm.unlink_segment(segment)
            raise

    def _run_job(self, job_id, op, args, tensors, input_segments, on_event) -> Message:
        try:
            self.ranks[0].send(Message("job", {"op": op, "args": args}, tensors, job=job_id, shm=input_segments))
        except OSError:
            pass  # rank 0 just died: its closed connection below is the job's error
        world_size = len(self.ranks)
        job_log = JobLog(world_size, job_id, op, on_event)
        done: dict[int, dict] = {}
        failures: list[JobFailed] = []
        broken: set[int] = set()
        told_to_break: set[int] = set()
        result: Message | None = None
        step_seconds: list[float | None] = [None] * world_size
        progress_count = [0] * world_size
        last_activity = time.monotonic()
        first_failure_at: float | None = None
        try:
            while len(done) < world_size:
                now = time.monotonic()
                pending = [rank for rank in range(world_size) if rank not in done]
                last_activity = max([last_activity, *(self.ranks[rank].last_busy for rank in pending)])
                silent = [rank for rank in pending if now - self.ranks[rank].last_heartbeat > self.heartbeat_timeout]
                if not silent and now - last_activity > self.rank_timeout:
                    silent = [rank for rank in pending if now - self.ranks[rank].last_heartbeat > SILENT_AT_HANG_SECONDS]
                    if not silent:
                        failure, culprits = self._hang_failure(pending, progress_count)
                        kill = set(culprits or pending)
                        raise self._with_outcome(failure, self.rebuild(kill, f"job {job_id} hung", told_to_break, broken))
                if silent:
                    failure = self._stopped_failure(silent, now)
                    raise self._with_outcome(failure, self.rebuild(set(silent), f"{ranks_label(silent)} stopped", told_to_break, broken))
                if first_failure_at is not None and not told_to_break and now - first_failure_at >= ERROR_GRACE_SECONDS:
                    # Ranks still in the job wait in a collective for a failed one (or will):
                    # breaking the groups everywhere frees them.
                    for rank in range(world_size):
                        self._order(rank, "break")
                    told_to_break = set(range(world_size))
                job_log.flush()
                try:
                    rank, message = self._next_event(0.25)
                except queue.Empty:
                    continue
                if message is None:
                    if self.closing:
                        raise JobFailed("the fleet server is shutting down; the job was stopped", kind="cancelled")
                    try:
                        code = self.ranks[rank].process.wait(timeout=10)
                    except subprocess.TimeoutExpired:  # its connection broke, yet it runs: end it
                        self.ranks[rank].process.kill()
                        code = self.ranks[rank].process.wait()
                    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                    failure = JobFailed(f"rank {rank} (pid {self.ranks[rank].process.pid}) died ({how})", rank=rank)
                    dead = {rank, *(other.rank for other in self.ranks if other.process.poll() is not None)}
                    raise self._with_outcome(failure, self.rebuild(dead, f"rank {rank} died during job {job_id}", told_to_break, broken))
                if message.type == "broken":
                    broken.add(rank)
                    continue
                if message.job != job_id:
                    continue
                if message.type == "progress":
                    last_activity = time.monotonic()
                    progress_count[rank] += 1
                    step_seconds[rank] = message.fields.get("seconds")
                    if rank == 0:
                        on_event(Message("progress", {**message.fields, "rank_seconds": list(step_seconds)}, job=job_id))
                elif message.type == "preview":
                    if rank == 0:  # only rank 0 sends previews; one from elsewhere would be a bug, not news
                        on_event(message)
                elif message.type == "log":
                    last_activity = time.monotonic()
                    job_log.add(rank, str(message.fields.get("text", "")))
                elif message.type == "result":
                    result = message
                elif message.type == "done":
                    done[rank] = message.fields
                    self.ranks[rank].info["memory"] = message.fields.get("memory")
                    status = message.fields.get("status")
                    if status != "ok":
                        failures.append(self._rank_failure(rank, message.fields))
                        first_failure_at = first_failure_at or time.monotonic()
        finally:
            job_log.flush(0.0)
        if failures:
            if told_to_break:
                outcome = self.rebuild(set(), f"job {job_id} failed on {ranks_label([failures[0].rank])}", told_to_break, broken)
            else:
                for rank, fields in done.items():
                    if fields.get("status") != "ok":
                        self._order(rank, "resume")  # every rank finished: the groups are intact
                outcome = ""
            first = failures[0]
            if first.kind == "error" and outcome:
                raise self._with_outcome(first, outcome)
            raise first
        assert result is not None, "rank 0 finished without sending a result"
        return result

    @staticmethod
    def _rank_failure(rank: int, fields: dict) -> JobFailed:
        status = fields.get("status")
        message = fields.get("message", status)
        if status == "error":
            message = f"rank {rank} failed: {message}"
        return JobFailed(message, rank=rank, traceback=fields.get("traceback"), kind=status)

    @staticmethod
    def _with_outcome(failure: JobFailed, outcome: str) -> JobFailed:
        return JobFailed(f"{failure}; {outcome}", rank=failure.rank, traceback=failure.traceback, kind=failure.kind)

    def _stopped_failure(self, silent: list[int], now: float) -> JobFailed:
        parts = []
        for rank in silent:
            process = self.ranks[rank]
            state = " (its process is stopped, e.g. by SIGSTOP)" if process.process_state() in ("T", "t") else ""
            parts.append(f"rank {rank} (pid {process.process.pid}) sent no heartbeat for {now - process.last_heartbeat:.0f} s{state}")
        return JobFailed("; ".join(parts), rank=silent[0])

    def _hang_failure(self, pending: list[int], progress_count: list[int]) -> tuple[JobFailed, list[int]]:
        """Name the rank(s) a hung job waits for: not inside a collective, or behind the others.
        Returns the failure and the ranks to replace ([] when every pending rank waits in a
        collective: a mismatch no single rank can be blamed for)."""
        outside = [rank for rank in pending if not self.ranks[rank].info.get("in_collective", False)]
        if outside and len(outside) < len(self.ranks):
            culprits = outside
        else:
            fewest = min(progress_count[rank] for rank in pending)
            behind = [rank for rank in pending if progress_count[rank] == fewest]
            culprits = behind if len(behind) < len(self.ranks) else []
        suspects = culprits or pending
        who = ", ".join(f"rank {rank}" for rank in suspects) if culprits else ranks_label(suspects)
        where = "; ".join(f"rank {rank} at {self.ranks[rank].info.get('where', '?')}" for rank in suspects)
        failure = JobFailed(f"{who} made no progress for {self.rank_timeout:.0f} s (hung: {where})", rank=culprits[0] if culprits else None)
        return failure, culprits

    def describe(self) -> list[dict]:
        return [
            {
                "rank": rank.rank,
                "pid": rank.process.pid,
                "device": rank.device,
                "alive": rank.process.poll() is None,
                "memory": rank.info.get("memory"),
                "weights": rank.info.get("weights"),
                "heartbeat": rank.info.get("heartbeat"),  # time.time() of the heartbeat that brought memory and weights
            }
            for rank in self.ranks
        ]
