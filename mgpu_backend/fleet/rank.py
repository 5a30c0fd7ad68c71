"""The rank loop: one process per GPU (or per CPU rank), all running the same jobs in lockstep.

The server starts each rank with one end of a socket pair. Rank 0 receives jobs from the server and
relays each one (the whole frame, bytes and all) to the other ranks over a gloo broadcast; then every
rank runs the registered job function and reports progress, logs and a final ``done`` to the server.
Rank 0 also sends the result. A rank exits when the server's end of its socket closes, so a rank
never outlives its server. This loop stays short and boring: jobs live in ``jobs`` modules.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.jobs import JOBS, JobCancelled, JobContext, JobInputError, load_job_modules
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.fleet.protocol import Message

HEARTBEAT_SECONDS = 2.0
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


class Rank:
    def __init__(self, rank: int, world_size: int, sock: socket.socket, device: torch.device, store_path: str, owner_pid: int):
        self.rank, self.world_size, self.device, self.owner_pid = rank, world_size, device, owner_pid
        self.channel = ServerChannel(sock)
        self.jobs: queue.Queue[Message] = queue.Queue()
        self.current_job: str | None = None
        self.cancelled_jobs: set[str] = set()
        self.state: dict = {}
        self.input_segments: dict[str, tuple[torch.Tensor, dict]] = {}  # rank 0: this job's mapped inputs

        store = dist.FileStore(store_path, world_size)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        self.comm = Comm.world()
        # Job relay and cancel flags travel on CPU over gloo, also when the compute group is NCCL.
        # Its long timeout lets ranks 1..N-1 wait for the next job as long as the fleet stays idle.
        control_group = dist.new_group(backend="gloo", timeout=timedelta(days=365)) if world_size > 1 else None
        self.control = Comm(control_group, list(range(world_size)))
        load_job_modules()

    # -- talking to the server ------------------------------------------------------------------
    def emit(self, kind: str, fields: dict, job: str | None = None, tensors=None, shm_descriptors=None) -> None:
        fields = {"rank": self.rank, **fields}
        self.channel.send(Message(kind, fields, tensors or {}, job=job or self.current_job, shm=shm_descriptors or []))

    def read_server(self) -> None:
        """Reader thread: queue jobs (rank 0), note cancels, exit when the server goes away."""
        try:
            while True:
                message = protocol.recv_message(self.channel.sock)
                if message.type == "job":
                    self.jobs.put(message)
                elif message.type == "cancel":
                    self.cancelled_jobs.add(message.job or "")
                elif message.type == "shutdown":
                    break
        except (protocol.ConnectionClosed, protocol.ProtocolError, OSError):
            pass
        os._exit(0)

    def heartbeat(self) -> None:
        main_thread = threading.main_thread().ident
        while True:
            time.sleep(HEARTBEAT_SECONDS)
            where, in_collective = main_thread_position(main_thread)
            fields = {"memory": device_memory(self.device), "where": where, "in_collective": in_collective}
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
        """Rank 0 takes the next job from the server and broadcasts its frame; others receive it."""
        if self.rank == 0:
            message = self.jobs.get()
            # Large inputs the client left in shared memory, mapped in place. The server unlinks them
            # at the end of the job, except one handed back as a result (see send_result).
            self.input_segments = {}
            try:
                for descriptor in message.shm:
                    tensor = shm.read_tensor(descriptor, unlink=False, shared=True)
                    message.tensors[descriptor["name"]] = tensor
                    self.input_segments[descriptor["name"]] = (tensor, descriptor)
            except (OSError, protocol.ProtocolError) as exc:  # fail this job on every rank, not the fleet
                message.tensors, self.input_segments = {}, {}
                message.fields = {**message.fields, "input_error": f"cannot map an input segment: {exc}"}
            message.shm = []
            if self.world_size > 1:
                frame = b"".join(bytes(part) for part in protocol.encode(message))
                self.control.broadcast(torch.tensor([len(frame)], dtype=torch.int64))
                self.control.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8))
            return message
        length = self.control.broadcast(torch.zeros(1, dtype=torch.int64))
        frame = self.control.broadcast(torch.empty(int(length.item()), dtype=torch.uint8))
        return protocol.decode(frame.numpy().tobytes())

    def run(self) -> None:
        threading.Thread(target=self.read_server, daemon=True, name="server-reader").start()
        threading.Thread(target=self.heartbeat, daemon=True, name="heartbeat").start()
        self.emit(
            "ready",
            {"pid": os.getpid(), "device": str(self.device), "memory": device_memory(self.device), "jobs": sorted(JOBS)},
            job="",
        )
        while True:
            message = self.next_job()
            self.current_job = message.job
            self.run_job(message)
            self.current_job = None
            self.input_segments = {}

    def run_job(self, message: Message) -> None:
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
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the peak reported at 'done' is this job's
        try:
            if message.fields.get("input_error"):
                raise JobInputError(message.fields["input_error"])
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
        status["seconds"] = round(time.perf_counter() - started, 6)
        status["memory"] = device_memory(self.device)
        self.emit("done", status)

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


def memory_fraction(environ) -> float | None:
    """``MGPU_MEMORY_FRACTION`` from ``environ``, checked; None when unset or empty."""
    text = environ.get(MEMORY_FRACTION_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise ValueError(f"{MEMORY_FRACTION_ENV} must be a share of the GPU above 0 and at most 1 (0.5: half), got {text!r}; unset it to use the whole GPU")
    return value


def main(rank: int, world_size: int, fd: int, device: str, store_path: str, owner_pid: int) -> None:
    sock = socket.socket(fileno=fd)
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
        if (fraction := memory_fraction(os.environ)) is not None:
            torch.cuda.set_per_process_memory_fraction(fraction, torch_device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    Rank(rank, world_size, sock, torch_device, store_path, owner_pid).run()
