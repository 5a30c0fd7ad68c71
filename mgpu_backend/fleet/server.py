"""The fleet server: a private socket, a FIFO job queue, and one ``Fleet`` running one job at a time.

Clients (ComfyUI nodes, the CLI) connect, prove they are the same user with the token, and submit
jobs; each job's events stream back to the client that submitted it. Several clients may be
connected at once; a malformed frame gets an error reply and closes only that connection. The
server exits when told to, after its idle timeout, or when the process that launched it dies, and
takes its ranks with it. It never unpickles and never listens beyond loopback.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.addresses import Address, ensure_private_dir, write_token
from mgpu_backend.fleet.controller import DeviceSpec, Fleet, JobFailed
from mgpu_backend.fleet.protocol import Message

log = logging.getLogger("mgpu.server")

HANDSHAKE_TIMEOUT_SECONDS = 5.0
MAX_QUEUED_JOBS = 64


@dataclass
class Job:
    id: str
    op: str
    args: dict
    tensors: dict
    input_segments: list[dict]
    client: ClientConnection
    submitted: float = field(default_factory=time.time)
    stage: str = ""
    step: int = 0
    total: int = 0
    cancelled: bool = False


class ClientConnection:
    def __init__(self, sock: socket.socket, server: Server) -> None:
        self.sock, self.server = sock, server
        self.lock = threading.Lock()
        self.closed = False
        self.pending_segments: dict[str, list[str]] = {}  # job id -> shared-memory segments not yet acknowledged

    def send(self, message: Message) -> bool:
        with self.lock:
            if self.closed:
                return False
            try:
                protocol.send_message(self.sock, message)
                return True
            except OSError:
                self.closed = True
                return False

    def close(self) -> None:
        with self.lock:
            self.closed = True
            try:
                self.sock.close()
            except OSError:
                pass
        for segments in self.pending_segments.values():
            for segment in segments:
                shm.unlink_segment(segment)
        self.pending_segments.clear()


class Server:
    def __init__(
        self,
        address: Address,
        devices: DeviceSpec,
        idle_timeout: float = 3600.0,
        parent_pid: int | None = None,
        rank_timeout: float = 600.0,
    ) -> None:
        self.address, self.devices = address, devices
        self.idle_timeout, self.parent_pid = idle_timeout, parent_pid
        self.fleet = Fleet(devices, rank_timeout=rank_timeout)
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=MAX_QUEUED_JOBS)
        self.queued: list[Job] = []
        self.current: Job | None = None
        self.job_ids = itertools.count(1)
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.last_activity = time.monotonic()
        self.started = time.time()
        self.completed = 0
        self.token = ""
        self.listener: socket.socket | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def listen(self) -> None:
        ensure_private_dir(self.address.directory)
        if self.address.unix_path is not None:
            path = self.address.unix_path
            if path.exists():
                probe = socket.socket(socket.AF_UNIX)
                try:
                    probe.connect(str(path))
                    raise RuntimeError(f"a fleet server already listens on {path}; stop it with 'python -m mgpu_backend stop'")
                except (ConnectionRefusedError, FileNotFoundError):
                    path.unlink()
                finally:
                    probe.close()
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o177)
            try:
                listener.bind(str(path))
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
        else:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.address.tcp_port))
        listener.listen(16)
        self.token = write_token(self.address.token_path)
        self.listener = listener

    def serve_forever(self) -> None:
        shm.sweep_orphans()
        self.fleet.start()
        self.listen()
        log.info("serving on %s (pid %d)", self.address, os.getpid())
        for target in (self._accept_loop, self._job_loop, self._watchdog):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
        print(f"mgpu fleet server ready on {self.address} with {self.devices.describe()}", flush=True)
        self.stopping.wait()
        self.shutdown()

    def shutdown(self) -> None:
        log.info("shutting down")
        if self.listener is not None:
            self.listener.close()
        if self.address.unix_path is not None:
            self.address.unix_path.unlink(missing_ok=True)
        self.address.token_path.unlink(missing_ok=True)
        self.fleet.stop()

    def _watchdog(self) -> None:
        while not self.stopping.wait(1.0):
            if self.parent_pid is not None and not _process_alive(self.parent_pid):
                log.info("launching process %d is gone; exiting", self.parent_pid)
                self.stopping.set()
            busy = self.current is not None or self.queued
            if busy:
                self.last_activity = time.monotonic()
            elif self.idle_timeout > 0 and time.monotonic() - self.last_activity > self.idle_timeout:
                log.info("idle for %.0f s; exiting", self.idle_timeout)
                self.stopping.set()

    # -- clients ------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            protocol.tune_socket(sock)
            threading.Thread(target=self._serve_client, args=(ClientConnection(sock, self),), daemon=True).start()

    def _serve_client(self, client: ClientConnection) -> None:
        try:
            client.sock.settimeout(HANDSHAKE_TIMEOUT_SECONDS)
            hello = protocol.recv_message(client.sock, max_payload=0)
            if hello.type != "hello" or hello.fields.get("version") != protocol.PROTOCOL_VERSION:
                client.send(Message("error", {"message": f"expected hello with protocol version {protocol.PROTOCOL_VERSION}"}))
                return
            if not isinstance(hello.fields.get("token"), str) or not _constant_time_equal(hello.fields["token"], self.token):
                client.send(Message("error", {"message": "authentication failed: wrong token"}))
                return
            client.sock.settimeout(None)
            client.send(Message("welcome", {"version": protocol.PROTOCOL_VERSION, "server_pid": os.getpid()}))
            while True:
                self._handle(client, protocol.recv_message(client.sock))
        except protocol.ProtocolError as exc:
            client.send(Message("error", {"message": f"protocol error: {exc}"}))
        except (protocol.ConnectionClosed, OSError):
            pass
        finally:
            self._forget_client(client)
            client.close()

    def _handle(self, client: ClientConnection, message: Message) -> None:
        self.last_activity = time.monotonic()
        if message.type == "submit":
            self._submit(client, message)
        elif message.type == "cancel":
            self.cancel(message.job or "")
        elif message.type == "ack":
            client.pending_segments.pop(message.job or "", None)
        elif message.type == "status":
            client.send(Message("status", self.status()))
        elif message.type == "shutdown":
            client.send(Message("bye", {}))
            self.stopping.set()
        else:
            raise protocol.ProtocolError(f"unknown message type {message.type!r}")

    def _submit(self, client: ClientConnection, message: Message) -> None:
        op, args = message.fields.get("op"), message.fields.get("args", {})
        job_id = f"job-{next(self.job_ids)}"
        if not isinstance(op, str) or not isinstance(args, dict):
            client.send(Message("error", {"message": "submit needs an 'op' string and an 'args' object", "kind": "input_error"}, job=job_id))
            return
        if op not in self.fleet.known_jobs:
            known = ", ".join(self.fleet.known_jobs)
            client.send(Message("error", {"message": f"unknown job type {op!r}; known: {known}", "kind": "input_error"}, job=job_id))
            return
        job = Job(job_id, op, args, message.tensors, message.shm, client)
        with self.lock:
            try:
                self.jobs.put_nowait(job)
            except queue.Full:
                client.send(Message("error", {"message": f"the queue is full ({MAX_QUEUED_JOBS} jobs)", "kind": "busy"}, job=job_id))
                return
            self.queued.append(job)
            position = len(self.queued)
        client.send(Message("accepted", {"position": position}, job=job_id))

    def _forget_client(self, client: ClientConnection) -> None:
        """A client that goes away cancels its queued and running jobs."""
        with self.lock:
            for job in self.queued:
                if job.client is client:
                    job.cancelled = True
            if self.current is not None and self.current.client is client:
                self.fleet.cancel(self.current.id)

    def cancel(self, job_id: str) -> None:
        with self.lock:
            for job in self.queued:
                if job.id == job_id:
                    job.cancelled = True
            if self.current is not None and self.current.id == job_id:
                self.fleet.cancel(job_id)

    # -- the job loop -------------------------------------------------------------------------------
    def _job_loop(self) -> None:
        while not self.stopping.is_set():
            job = self.jobs.get()
            with self.lock:
                self.queued.remove(job)
                if job.cancelled:
                    for descriptor in job.input_segments:
                        shm.unlink_segment(descriptor["segment"])
                    job.client.send(Message("error", {"message": "cancelled before it started", "kind": "cancelled"}, job=job.id))
                    continue
                self.current = job
            self._run(job)
            with self.lock:
                self.current = None
                self.completed += 1
            self.last_activity = time.monotonic()

    def _run(self, job: Job) -> None:
        handed_back: set[str] = set()
        try:
            handed_back = self._run_on_fleet(job)
        finally:  # the job's inputs, except those now a result segment the client unlinks
            for descriptor in job.input_segments:
                if descriptor["segment"] not in handed_back:
                    shm.unlink_segment(descriptor["segment"])

    def _run_on_fleet(self, job: Job) -> set[str]:
        """Run the job and deliver its result; return the segments the result names."""
        def forward(event: Message) -> None:
            if event.type == "progress":
                job.stage, job.step, job.total = event.fields.get("stage", ""), event.fields.get("step", 0), event.fields.get("total", 0)
            job.client.send(event)

        try:
            result = self.fleet.run_job(job.id, job.op, job.args, job.tensors, job.input_segments, forward)
        except JobFailed as exc:
            fields = {"message": str(exc), "kind": exc.kind, "rank": exc.rank, "traceback": exc.traceback}
            job.client.send(Message("error", fields, job=job.id))
            return set()
        except Exception as exc:  # noqa: BLE001 - the server must survive anything a job does
            log.exception("job %s failed in the server", job.id)
            job.client.send(Message("error", {"message": f"server error: {exc}", "kind": "error"}, job=job.id))
            return set()
        segments = [desc["segment"] for desc in result.shm]
        if segments:
            job.client.pending_segments[job.id] = segments
        delivered = job.client.send(Message("result", result.fields, result.tensors, job=job.id, shm=result.shm))
        if not delivered:
            for segment in segments:
                shm.unlink_segment(segment)
        return set(segments)

    def status(self) -> dict:
        with self.lock:
            current = None
            if self.current is not None:
                job = self.current
                current = {"id": job.id, "op": job.op, "stage": job.stage, "step": job.step, "total": job.total}
            return {
                "server_pid": os.getpid(),
                "address": str(self.address),
                "devices": self.devices.describe(),
                "world_size": self.devices.world_size,
                "ranks": self.fleet.describe(),
                "current_job": current,
                "queue_length": len(self.queued),
                "jobs_completed": self.completed,
                "fleet_restarts": self.fleet.restarts,
                "uptime_seconds": round(time.time() - self.started, 1),
                "idle_timeout": self.idle_timeout,
                "parent_pid": self.parent_pid,
            }


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _constant_time_equal(given: str, expected: str) -> bool:
    import hmac

    return hmac.compare_digest(given.encode(), expected.encode())
