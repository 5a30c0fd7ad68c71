"""The rank loop: one process per GPU (or per CPU rank), all running the same jobs in lockstep.

The server starts each rank with one end of a socket pair. Rank 0 receives jobs from the server and
relays each one to the other ranks over a gloo broadcast: the header, the small inline tensors, and
the descriptors of the inputs that sit in shared memory, which every rank then maps by itself (no
tensor bytes of a large input are copied). Every rank runs the registered job function and reports
progress, logs and a final ``done`` to the server; rank 0 also sends the result.

A job that fails on some ranks only must not leave the others waiting in a collective, and must not
cost the weights. A rank whose job failed waits for the controller's verdict: ``resume`` (every rank
finished: the groups are intact) or ``break``. On ``break`` it destroys its process groups, which
makes any collective a peer waits in fail, reports ``broken``, and waits for ``regroup`` with a new
rendezvous store, where the survivors and any replacement rank form new groups. The process, and
with it ``state`` (the resident model), survives all of this; when ranks were replaced, a survivor
keeps only the entries the job modules declared safe to keep (``jobs.keep_across_replacement``).

A rank exits when the server's end of its socket closes (from the first moment, before it joins any
group), and the kernel kills it when the server dies (``PR_SET_PDEATHSIG``, which also reaches a
stopped rank that could not read its socket), so a rank never outlives its server. A job's input
segments are unmapped before the rank reports the job done. Its log records reach the server and
the submitting client as ``log`` events. This loop stays short and boring: jobs live in ``jobs``
modules.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.controller import SERVER_PID_ENV
from mgpu_backend.fleet.jobs import JOBS, KEPT_ACROSS_REPLACEMENT, JobCancelled, JobContext, JobInputError, load_job_modules
from mgpu_backend.fleet.protocol import Message
from mgpu_backend.fleet.settings import number_setting
from mgpu_backend.fleet.shared_gpu import peer_access_line, shared_gpu_ranks
from mgpu_backend.parallel.comm import Comm

HEARTBEAT_SECONDS = 1.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MEMORY_FRACTION_ENV = "MGPU_MEMORY_FRACTION"
"""Share of its GPU a CUDA rank may allocate (0 < f <= 1), applied once at start-up with
``torch.cuda.set_per_process_memory_fraction``: the allocator refuses more, and the residency policy
plans for total x fraction. Unset: the whole GPU. For running as if on a smaller GPU (bench/e2e.py
``--memory-gb``)."""


class ServerChannel:
    """The rank's end of its socket pair; sends are serialised across the rank's threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, message: Message) -> None:
        with self.lock:
            protocol.send_message(self.sock, message)


def device_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "allocated": torch.cuda.memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device),
            "peak": torch.cuda.max_memory_allocated(device),
            "free": free,
            "total": total,
        }
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return {"rss": resident_pages * os.sysconf("SC_PAGE_SIZE")}


def main_thread_position(thread_id: int) -> tuple[str, bool]:
    """Where the main thread is now, and whether it waits inside a torch.distributed collective.

    When a job hangs, the ranks waiting in a collective are victims; the one that is not is the
    culprit the server names.
    """
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "", False
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
    in_collective = False
    while frame is not None:
        if f"torch{os.sep}distributed" in frame.f_code.co_filename:
            in_collective = True
            break
        frame = frame.f_back
    return where, in_collective


def thread_cpu_seconds(native_id: int) -> float:
    """CPU time a thread of this process has used. A rank whose main thread's CPU time advances is
    working (a long step), not hung, even when it reports no progress for a long time."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime + stime


class ServerLogHandler(logging.Handler):
    """Every log record of a job (INFO and up) becomes a ``log`` event tagged with job and rank;
    outside a job only warnings and errors are sent. The server writes them to its log and
    forwards a job's lines to the client that submitted it."""

    def __init__(self, rank: Rank) -> None:
        super().__init__(logging.INFO)
        self.rank = rank
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("torch") and record.levelno < logging.WARNING:
            return
        job = self.rank.current_job
        if not job and record.levelno < logging.WARNING:
            return
        try:
            self.rank.emit("log", {"text": self.format(record), "level": record.levelname, "logger": record.name}, job=job or "")
        except OSError:  # the server is gone; the reader thread ends this process
            pass


class GroupBroken(Exception):
    """A collective of the control group failed: a peer destroyed its groups or died."""


class Rank:
    def __init__(self, rank: int, world_size: int, sock: socket.socket, device: torch.device, store_path: str, owner_pid: int):
        self.rank, self.world_size, self.device, self.owner_pid = rank, world_size, device, owner_pid
        self.channel = ServerChannel(sock)
        self.inbox: queue.Queue[Message] = queue.Queue()  # jobs (rank 0) and the controller's orders
        self.current_job: str | None = None
        self.cancelled_jobs: set[str] = set()
        self.state: dict = {}
        self.input_segments: dict[str, tuple[torch.Tensor, dict]] = {}  # rank 0: this job's mapped inputs
        # The two Comm objects live as long as the process: jobs keep them (the weight tracker of a
        # resident model holds ``comm``), and a regroup points them at the new groups in place.
        self.comm, self.control = Comm(None), Comm(None)
        # Reading the socket first: a rank whose server goes away while it waits for its peers in
        # the rendezvous must exit then, not wait there forever.
        threading.Thread(target=self.read_server, daemon=True, name="server-reader").start()
        self.join_groups(store_path)
        load_job_modules()

    # -- process groups ---------------------------------------------------------------------------
    def join_groups(self, store_path: str) -> None:
        store = dist.FileStore(store_path, self.world_size)
        # Ranks sharing a GPU talk over gloo with CUDA tensors: NCCL refuses two ranks on one GPU.
        backend = "nccl" if self.device.type == "cuda" and shared_gpu_ranks() == 1 else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)
        # Job relay and cancel flags travel on CPU over gloo, also when the compute group is NCCL.
        # Its long timeout lets ranks 1..N-1 wait for the next job as long as the fleet stays idle.
        control_group = dist.new_group(backend="gloo", timeout=timedelta(days=365)) if self.world_size > 1 else None
        self.comm.__dict__.update(Comm.world().__dict__)  # also drops an all-to-all bound to old groups
        self.control.__dict__.update(Comm(control_group, list(range(self.world_size))).__dict__)

    def leave_groups(self) -> None:
        """Destroy every process group of this rank: a collective a peer waits in on us fails now.

        A gloo group closes its connections only when its last reference goes, so the rank's Comm
        objects and the subgroups a job cached (a sequence-parallel layout) let go of them first.
        """
        stale = [key for key, value in self.state.items() if _holds_other_comm(value, (self.comm, self.control))]
        for key in stale:
            del self.state[key]
        self.comm.__dict__.update(Comm(None).__dict__)
        self.control.__dict__.update(Comm(None).__dict__)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group that broke under us is gone either way
                logging.getLogger(__name__).warning("destroying the process groups failed:\n%s", traceback.format_exc())
        gc.collect()

    def rejoin(self) -> None:
        """Leave the groups, tell the controller, and form new ones where it says (state is kept)."""
        self.leave_groups()
        self.emit("broken", {}, job="")
        while True:
            order = self.inbox.get()
            if order.type == "regroup":
                break
            # A 'break' or 'resume' sent before this rank noticed the broken group on its own.
        if order.fields.get("replaced"):
            dropped = sorted(key for key in self.state if key not in KEPT_ACROSS_REPLACEMENT)
            for key in dropped:
                del self.state[key]
            if dropped:
                logging.getLogger(__name__).warning(
                    "%s replaced: dropped %s from rank %d's state, to be rebuilt with the new ranks",
                    ", ".join(f"rank {rank}" for rank in order.fields["replaced"]), ", ".join(dropped), self.rank,
                )
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        self.join_groups(order.fields["store"])
        self.emit("regrouped", {"pid": os.getpid()}, job="")

    # -- talking to the server ------------------------------------------------------------------
    def emit(self, kind: str, fields: dict, job: str | None = None, tensors=None, shm_descriptors=None) -> None:
        fields = {"rank": self.rank, **fields}
        self.channel.send(Message(kind, fields, tensors or {}, job=job if job is not None else self.current_job, shm=shm_descriptors or []))

    def read_server(self) -> None:
        """Reader thread: queue jobs and orders, note cancels, exit when the server goes away."""
        try:
            while True:
                message = protocol.recv_message(self.channel.sock)
                if message.type == "cancel":
                    self.cancelled_jobs.add(message.job or "")
                elif message.type == "shutdown":
                    break
                else:
                    self.inbox.put(message)
        except (protocol.ConnectionClosed, protocol.ProtocolError, OSError):
            pass
        os._exit(0)

    def heartbeat(self) -> None:
        main_thread = threading.main_thread()
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            where, in_collective = main_thread_position(main_thread.ident)
            fields = {
                "memory": device_memory(self.device),
                "where": where,
                "in_collective": in_collective,
                "cpu_seconds": thread_cpu_seconds(main_thread.native_id),
            }
            model = self.state.get("model")
            if model is not None:
                try:
                    fields["weights"] = model.memory_report()
                except RuntimeError:  # the job thread is swapping weights right now; next beat
                    pass
            try:
                self.emit("heartbeat", fields, job="")
            except OSError:
                os._exit(0)

    # -- the loop -----------------------------------------------------------------------------------
    def next_job(self) -> Message:
        """Rank 0 takes the next job (or order) from the server and relays a job's frame, shared-memory
        descriptors and all; the other ranks receive it. Raises GroupBroken when the relay fails."""
        if self.rank == 0:
            message = self.inbox.get()
            if message.type != "job" or self.world_size == 1:
                return message
            frame = b"".join(bytes(part) for part in protocol.encode(message))
            try:
                self.control.broadcast(torch.tensor([len(frame)], dtype=torch.int64))
                self.control.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8))
            except RuntimeError as exc:
                raise GroupBroken(str(exc)) from exc
            return message
        try:
            length = self.control.broadcast(torch.zeros(1, dtype=torch.int64))
            frame = self.control.broadcast(torch.empty(int(length.item()), dtype=torch.uint8))
        except RuntimeError as exc:
            raise GroupBroken(str(exc)) from exc
        return protocol.decode(frame.numpy().tobytes())

    def map_inputs(self, message: Message) -> str | None:
        """Map the job's shared-memory inputs on this rank; agree with the others that all could.

        Returns an input error for the job (the same decision on every rank), or None. Rank 0 maps
        them shared, so that an input handed back as a result goes back by name; the other ranks map
        them private (their writes stay theirs). The server unlinks them at the end of the job.
        """
        self.input_segments, error = {}, None
        try:
            for descriptor in message.shm:
                tensor = shm.read_tensor(descriptor, unlink=False, shared=self.rank == 0)
                message.tensors[descriptor["name"]] = tensor
                self.input_segments[descriptor["name"]] = (tensor, descriptor)
        except (OSError, protocol.ProtocolError) as exc:
            error = f"cannot map an input segment on rank {self.rank}: {exc}"
        if self.world_size > 1:
            failed = self.control.all_reduce_max(torch.tensor([self.rank + 1 if error else 0], dtype=torch.int64))
            if failed.item() and error is None:
                error = f"cannot map an input segment on rank {int(failed.item()) - 1}; see that rank's log line"
        if error:
            message.tensors, self.input_segments = {}, {}
        return error

    def run(self) -> None:
        threading.Thread(target=self.heartbeat, daemon=True, name="heartbeat").start()
        self.emit(
            "ready",
            {"pid": os.getpid(), "device": str(self.device), "memory": device_memory(self.device), "jobs": sorted(JOBS)},
            job="",
        )
        while True:
            try:
                message = self.next_job()
            except GroupBroken:
                self.rejoin()  # a job failed elsewhere and the controller broke the groups
                continue
            if message.type == "break":
                self.rejoin()
                continue
            if message.type != "job":  # a 'resume' that a rank without a failure never waits for
                continue
            self.current_job = message.job
            try:
                status = self.run_job(message)
            finally:
                self.current_job = None
                self.input_segments = {}
            if status != "ok":
                self.settle()

    def settle(self) -> None:
        """After a failed job: the controller either saw every rank finish (resume) or breaks the
        groups to free ranks still waiting in a collective for this one (break, then regroup)."""
        while True:
            order = self.inbox.get()
            if order.type == "resume":
                return
            if order.type == "break":
                self.rejoin()
                return

    def run_job(self, message: Message) -> str:
        op = message.fields.get("op")
        ctx = JobContext(
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            comm=self.comm,
            control=self.control,
            state=self.state,
            emit=self.emit,
            cancel_requested=lambda: message.job in self.cancelled_jobs,
            job_id=message.job or "",
            owner_pid=self.owner_pid,
        )
        started = time.perf_counter()
        fields = tensors = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the peak reported at 'done' is this job's
        try:
            input_error = self.map_inputs(message)
            if input_error:
                raise JobInputError(input_error)
            if op not in JOBS:
                raise JobInputError(f"unknown job type {op!r}; known: {', '.join(sorted(JOBS))}")
            # Jobs never train: tensors made in one job (cached weights) must be usable in the next.
            with torch.inference_mode():
                fields, tensors = JOBS[op](ctx, message.fields.get("args", {}), message.tensors)
            if self.rank == 0:
                self.send_result(fields, tensors, ctx.shared_outputs)
                ctx.shared_outputs.clear()  # handed over: the client unlinks them now
            status = {"status": "ok"}
        except JobCancelled as exc:
            status = {"status": "cancelled", "message": str(exc)}
        except JobInputError as exc:
            status = {"status": "input_error", "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its traceback
            status = {"status": "error", "message": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        ctx.discard_shared_outputs()
        # Unmap this job's inputs now, not when the next job replaces them: the tensors are their
        # mappings' last references (a job keeps what it needs in ``state``).
        message.tensors, self.input_segments, fields, tensors = {}, {}, None, None
        status["seconds"] = round(time.perf_counter() - started, 6)
        status["memory"] = device_memory(self.device)
        self.emit("done", status)
        return status["status"]

    def send_result(self, fields: dict, tensors: dict[str, torch.Tensor], shared_outputs: dict) -> None:
        """Send rank 0's result: tensors built in shared memory and inputs returned as they are go
        by segment name; other large tensors are copied into new segments; small ones go inline."""
        in_place = [shared_outputs.pop(name)[1] for name, tensor in tensors.items() if name in shared_outputs and shared_outputs[name][0] is tensor]
        for name, tensor in tensors.items():
            for input_tensor, descriptor in self.input_segments.values():
                if tensor is input_tensor:  # an input handed back (edited in place or not): no copy
                    in_place.append({**descriptor, "name": name})
                    break
        rest = {name: tensor for name, tensor in tensors.items() if name not in {d["name"] for d in in_place}}
        inline, copied = shm.split_for_transfer(rest, owner_pid=self.owner_pid)
        self.emit("result", {"result": fields}, tensors=inline, shm_descriptors=in_place + copied)


def _holds_other_comm(value, keep: tuple[Comm, ...], depth: int = 3) -> bool:
    """Whether a state entry holds a Comm (a subgroup) other than the rank's own two."""
    if isinstance(value, Comm):
        return all(value is not kept for kept in keep)
    if depth and isinstance(value, dict):
        return any(_holds_other_comm(item, keep, depth - 1) for item in value.values())
    if depth and isinstance(value, (list, tuple)):
        return any(_holds_other_comm(item, keep, depth - 1) for item in value)
    return False


def memory_fraction(environ) -> float | None:
    """``MGPU_MEMORY_FRACTION`` from ``environ``, checked; None when unset or empty."""
    return number_setting(environ, MEMORY_FRACTION_ENV, float, lambda share: 0 < share <= 1,
                          "a share of the GPU above 0 and at most 1 (0.5: half)", "to use the whole GPU")  # fmt: skip


PR_SET_PDEATHSIG = 1


def die_with_server(environ) -> None:
    """Have the kernel SIGKILL this rank when the thread of the server that started it ends, and
    exit now if the server is already gone (it may have died before this line ran)."""
    server_pid = environ.get(SERVER_PID_ENV)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the socket to the server still ends the rank
        return
    if server_pid and os.getppid() != int(server_pid):
        os._exit(0)


def cpu_threads(world_size: int) -> int:
    """The torch threads of each CPU rank: the host's cores shared evenly over the ranks."""
    return max(1, (os.cpu_count() or 1) // world_size)


def main(rank: int, world_size: int, fd: int, device: str, store_path: str, owner_pid: int) -> None:
    die_with_server(os.environ)
    # Ctrl-C on a foreground server reaches the whole process group; the server alone decides how
    # its ranks end (a rank that died of it would be taken for a fault and replaced).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
        if (fraction := memory_fraction(os.environ)) is not None:
            torch.cuda.set_per_process_memory_fraction(fraction, torch_device)
    else:
        torch.set_num_threads(cpu_threads(world_size))
    rank_process = Rank(rank, world_size, sock, torch_device, store_path, owner_pid)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(ServerLogHandler(rank_process))
    if rank == 0 and torch_device.type == "cuda" and (line := peer_access_line(torch.cuda.device_count(), torch.cuda.can_device_access_peer)):
        logging.getLogger(__name__).warning(line)
    rank_process.run()
