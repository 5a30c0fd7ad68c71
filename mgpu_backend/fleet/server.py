"""The fleet server: a private socket, a FIFO job queue, and one ``Fleet`` running one job at a time.

Clients (ComfyUI nodes, the CLI) connect, prove they are the same user with the token (a mutual
challenge-response: neither side ever sends the token), and submit jobs; each job's events stream
back to the client that submitted it. Several clients may be connected at once.

Nothing a client sends stops the server serving the others: every malformed frame gets an error
reply and closes only its connection; the accept and job loops survive any error; every send to a
client goes through that connection's bounded outbox, drained by its own writer thread, so a client
that stops reading never blocks the job loop (it is dropped when its outbox overflows, and its
jobs cancelled); handshakes have a total deadline; connections, jobs per client and queued bytes
are capped. A client sees and cancels only its own jobs and may name only shared-memory segments
it created. The server exits when told to, after its idle timeout, or when the process that
launched it dies, takes its ranks with it and unlinks every segment it knows of. It never
unpickles and never listens beyond loopback.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import queue
import secrets
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.addresses import Address, ensure_private_dir, write_token
from mgpu_backend.fleet.controller import DeviceSpec, Fleet, JobFailed
from mgpu_backend.fleet.protocol import Message

log = logging.getLogger("mgpu.server")

HANDSHAKE_SECONDS = 10.0  # hello to welcome, in total, however the bytes trickle in
MAX_CONNECTIONS = 64  # open connections, authenticated or not; one more is refused with a reply
MAX_QUEUED_JOBS = 64  # waiting in the queue, all clients together
MAX_JOBS_PER_CLIENT = 8  # queued plus running, per connection
MAX_QUEUED_INLINE_BYTES = 4 << 30  # inline tensor bytes held by waiting jobs, all clients together
MAX_READING_BYTES = 4 << 30  # bytes of frames being read at once, all clients together
# Bytes waiting to be written to one client: a frame queued while more than this already waits
# drops the client. So a large inline result (up to protocol.MAX_PAYLOAD_BYTES) always gets in.
MAX_OUTBOX_BYTES = int(os.environ.get("MGPU_OUTBOX_BYTES", 64 << 20))
FLUSH_SECONDS = 5.0  # how long a closing connection may take to deliver its last error reply
SHUTDOWN_GRACE_SECONDS = 10.0  # how long a running job gets to stop at its next step when the server exits
ACCEPT_RETRY_SECONDS = 0.2  # pause after a failed accept (out of file descriptors) before the next


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

    @property
    def inline_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors.values())


class ClientConnection:
    """One client socket: its reader runs in the server's per-client thread; everything sent to it
    is queued in a bounded outbox and written by its own writer thread, so ``send`` never blocks."""

    def __init__(self, sock: socket.socket, server: Server) -> None:
        self.sock, self.server = sock, server
        self.lock = threading.Lock()
        self.wakeup = threading.Condition(self.lock)
        self.outbox: collections.deque[tuple[list, int]] = collections.deque()
        self.outbox_bytes = 0
        self.finishing = False  # deliver what is queued, then stop
        self.closed = False  # stop at once, discard what is queued
        self.pending_segments: dict[str, list[str]] = {}  # job id -> result segments not yet acknowledged
        self.peer_pid = _peer_pid(sock)
        self.writer = threading.Thread(target=self._write_loop, daemon=True, name="client-writer")
        self.writer.start()

    def send(self, message: Message) -> bool:
        """Queue ``message``; False when the client is gone. Overflowing the outbox drops the client."""
        try:
            frame = protocol.encode(message)
        except protocol.ProtocolError as exc:
            log.error("cannot encode a %s message for a client: %s", message.type, exc)
            return False
        size = sum(len(buffer) for buffer in frame)
        with self.lock:
            if self.closed or self.finishing:
                return False
            overflow = self.outbox_bytes > MAX_OUTBOX_BYTES
            if not overflow:
                self.outbox.append((frame, size))
                self.outbox_bytes += size
                self.wakeup.notify()
                return True
        log.warning("a client stopped reading (%d bytes waiting for it); dropping it and cancelling its jobs", self.outbox_bytes)
        self.drop()
        return False

    def _write_loop(self) -> None:
        while True:
            with self.lock:
                while not self.outbox and not self.closed and not self.finishing:
                    self.wakeup.wait()
                if self.closed or not self.outbox:
                    return
                frame, size = self.outbox.popleft()
            try:
                for buffer in frame:
                    self.sock.sendall(buffer)
            except OSError:
                self.drop()
                return
            with self.lock:
                self.outbox_bytes -= size

    def drop(self) -> None:
        """Stop this connection now: wakes its reader (end of stream) and its writer (broken pipe)."""
        with self.lock:
            self.closed = True
            self.outbox.clear()
            self.outbox_bytes = 0
            self.wakeup.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Deliver what is queued (an error reply) for up to FLUSH_SECONDS, then close the socket."""
        with self.lock:
            self.finishing = True
            self.wakeup.notify_all()
        self.writer.join(timeout=FLUSH_SECONDS)
        self.drop()
        self.writer.join(timeout=FLUSH_SECONDS)
        try:
            self.sock.close()
        except OSError:
            pass


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
        self.queued_inline_bytes = 0
        self.current: Job | None = None
        self.no_job_running = threading.Event()
        self.no_job_running.set()
        self.connections: set[ClientConnection] = set()
        self.segment_owners: dict[str, ClientConnection] = {}  # every segment a job or a client holds
        self.reading = protocol.ByteBudget(MAX_READING_BYTES)
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
            except OSError:
                listener.close()
                raise
            finally:
                os.umask(old_umask)
            os.chmod(path, 0o600)
        else:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind(("127.0.0.1", self.address.tcp_port))
            except OSError:
                listener.close()
                raise
        listener.listen(16)
        self.token = write_token(self.address.token_path)
        self.listener = listener

    def serve_forever(self) -> None:
        shm.sweep_orphans()
        # The socket first: a bad --socket fails at once, before any rank is started. Clients that
        # connect meanwhile wait in the backlog until the ranks are ready.
        if self.listener is None:
            self.listen()
        try:
            self.fleet.start()
            log.info("serving on %s (pid %d)", self.address, os.getpid())
            for target in (self._accept_loop, self._job_loop, self._watchdog):
                threading.Thread(target=target, daemon=True, name=target.__name__).start()
            signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
            signal.signal(signal.SIGINT, lambda *_: self.stopping.set())
            print(f"mgpu fleet server ready on {self.address} with {self.devices.describe()}", flush=True)
            self.stopping.wait()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        log.info("shutting down")
        self.stopping.set()
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            except OSError:
                pass
            self.listener.close()
        if self.address.unix_path is not None:
            self.address.unix_path.unlink(missing_ok=True)
        self.address.token_path.unlink(missing_ok=True)
        with self.lock:
            connections = list(self.connections)
            for job in self.queued:
                job.cancelled = True
            running = self.current
        for client in connections:
            client.drop()
        if running is not None:
            # Let the job stop at its next step first: ranks killed under a running job would look
            # like a rank death, and the fleet would start new ranks while the server exits.
            self.fleet.cancel(running.id)
            self.no_job_running.wait(SHUTDOWN_GRACE_SECONDS)
        self.fleet.stop()
        with self.lock:  # inputs of waiting and running jobs, unacknowledged results, the ranks' segments
            segments = list(self.segment_owners)
            for job in self.queued + ([self.current] if self.current else []):
                segments += [desc["segment"] for desc in job.input_segments if desc["segment"] in self.segment_owners]
            self.segment_owners.clear()
        for segment in segments:
            shm.unlink_segment(segment)
        shm.unlink_created_by(os.getpid())

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
        """Accept forever: a failed accept (no file descriptor left, a connection reset while
        queued) is waited out, never the end of the loop."""
        failures = 0
        while not self.stopping.is_set():
            try:
                sock, _ = self.listener.accept()
            except OSError as exc:
                if self.stopping.is_set():
                    return
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    log.warning("accept failed (%s, %d time(s) in a row); retrying", exc, failures)
                out_of_resources = exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
                time.sleep(ACCEPT_RETRY_SECONDS if out_of_resources else 0.01)
                continue
            failures = 0
            try:
                self._admit(sock)
            except Exception:  # noqa: BLE001 - e.g. no thread can be started: refuse this one, keep accepting
                log.exception("could not serve a new connection")
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        with self.lock:
            full = len(self.connections) >= MAX_CONNECTIONS
        if full:
            # The refusal fits in the socket's buffer: sent without blocking, never waited for.
            text = f"the fleet server already has {MAX_CONNECTIONS} connections open; close unused clients and retry"
            try:
                sock.setblocking(False)
                for buffer in protocol.encode(Message("error", {"message": text, "kind": "busy"})):
                    sock.send(buffer)
            except OSError:
                pass
            sock.close()
            return
        protocol.tune_socket(sock)
        client = ClientConnection(sock, self)
        with self.lock:
            self.connections.add(client)
        try:
            threading.Thread(target=self._serve_client, args=(client,), daemon=True, name="client-reader").start()
        except BaseException:
            with self.lock:
                self.connections.discard(client)
            client.close()
            raise

    def _serve_client(self, client: ClientConnection) -> None:
        try:
            if self._handshake(client):
                while True:
                    self._handle(client, protocol.recv_untrusted(client.sock, budget=self.reading))
        except protocol.ProtocolError as exc:
            client.send(Message("error", {"message": f"protocol error: {exc}", "kind": "protocol_error"}))
        except (protocol.ConnectionClosed, OSError):
            pass
        except Exception as exc:  # noqa: BLE001 - any frame the server cannot handle ends only this connection
            log.exception("a client frame could not be handled")
            text = f"the server could not handle a frame ({type(exc).__name__}); the connection is closed"
            client.send(Message("error", {"message": text, "kind": "protocol_error"}))
        finally:
            self._forget_client(client)
            client.close()

    def _handshake(self, client: ClientConnection) -> bool:
        """Mutual proof of the token within HANDSHAKE_SECONDS in total, the token never sent:
        hello (client nonce) -> challenge (server nonce, server's proof) -> auth (client's proof)
        -> welcome. A squatter on the port cannot make the server's proof, so the client leaves."""
        deadline = time.monotonic() + HANDSHAKE_SECONDS

        def read() -> Message:
            return protocol.recv_untrusted(client.sock, max_payload=0, deadline=deadline, max_header=protocol.HANDSHAKE_HEADER_BYTES)

        hello = read()
        if hello.type != "hello" or hello.fields.get("version") != protocol.PROTOCOL_VERSION:
            text = f"expected hello with protocol version {protocol.PROTOCOL_VERSION}; update both sides"
            client.send(Message("error", {"message": text, "kind": "protocol_error"}))
            return False
        client_nonce = hello.fields.get("nonce")
        if not protocol.is_nonce(client_nonce):
            text = f"hello needs a 'nonce' of {protocol.NONCE_HEX_DIGITS} lowercase hex digits"
            client.send(Message("error", {"message": text, "kind": "protocol_error"}))
            return False
        server_nonce = secrets.token_hex(protocol.NONCE_HEX_DIGITS // 2)
        proof = protocol.handshake_proof(self.token, "server", client_nonce, server_nonce)
        client.send(Message("challenge", {"nonce": server_nonce, "proof": proof}))
        auth = read()
        expected = protocol.handshake_proof(self.token, "client", client_nonce, server_nonce)
        if auth.type != "auth" or not protocol.proof_matches(auth.fields.get("proof"), expected):
            client.send(Message("error", {"message": "authentication failed: wrong token", "kind": "auth"}))
            return False
        client.send(Message("welcome", {"version": protocol.PROTOCOL_VERSION, "server_pid": os.getpid()}))
        return True

    def _handle(self, client: ClientConnection, message: Message) -> None:
        self.last_activity = time.monotonic()
        if message.type == "submit":
            self._submit(client, message)
        elif message.type == "cancel":
            self.cancel(client, message.job or "")
        elif message.type == "ack":
            with self.lock:
                segments = client.pending_segments.pop(message.job or "", [])
                for segment in segments:
                    self.segment_owners.pop(segment, None)
            for segment in segments:  # read by now; unlinked here as well, in case the client did not
                shm.unlink_segment(segment)
        elif message.type == "status":
            client.send(Message("status", self.status(client)))
        elif message.type == "shutdown":
            client.send(Message("bye", {}))
            self.stopping.set()
        else:
            raise protocol.ProtocolError(f"unknown message type {message.type!r}")

    def _submit(self, client: ClientConnection, message: Message) -> None:
        op, args = message.fields.get("op"), message.fields.get("args", {})
        job_id = f"job-{next(self.job_ids)}"
        ref = message.fields.get("ref")  # the client's number for this submit, echoed in the reply
        reply = {"ref": ref} if isinstance(ref, int) and not isinstance(ref, bool) else {}

        def refuse(text: str, kind: str) -> None:
            self._release_inputs(client, message.shm)
            client.send(Message("error", {**reply, "message": text, "kind": kind}, job=job_id))

        if not isinstance(op, str) or not isinstance(args, dict):
            return refuse("submit needs an 'op' string and an 'args' object", "input_error")
        if op not in self.fleet.known_jobs:
            return refuse(f"unknown job type {op!r}; known: {', '.join(self.fleet.known_jobs)}", "input_error")
        job = Job(job_id, op, args, message.tensors, message.shm, client)
        with self.lock:
            problem, kind = self._claim_inputs(client, message.shm), "input_error"
            running = int(self.current is not None and self.current.client is client)
            mine = running + sum(1 for queued in self.queued if queued.client is client)
            if problem:
                pass
            elif mine >= MAX_JOBS_PER_CLIENT:
                problem, kind = f"this client already has {MAX_JOBS_PER_CLIENT} jobs queued or running; wait for one to finish", "busy"
            elif self.queued_inline_bytes + job.inline_bytes > MAX_QUEUED_INLINE_BYTES:
                held = self.queued_inline_bytes / 2**30
                problem, kind = f"the queue already holds {held:.1f} GiB of inline tensors; retry later", "busy"
            else:
                try:
                    self.jobs.put_nowait(job)
                except queue.Full:
                    problem, kind = f"the queue is full ({MAX_QUEUED_JOBS} jobs); retry later", "busy"
            if not problem:
                self.queued.append(job)
                self.queued_inline_bytes += job.inline_bytes
                position = len(self.queued)
        if problem:
            return refuse(problem, kind)
        client.send(Message("accepted", {**reply, "position": position}, job=job_id))

    def _claim_inputs(self, client: ClientConnection, descriptors: list[dict]) -> str | None:
        """Tie a submit's input segments to ``client``, or say why one is not its to name (call
        with the lock held). Only segments this client's process created qualify: never the
        server's or a rank's (results of any client), never one another connection holds."""
        names = [descriptor["segment"] for descriptor in descriptors]
        if len(set(names)) != len(names):
            return "a shared-memory segment is named twice in one submit"
        for name in names:
            if not shm.is_segment_name(name):
                return f"invalid shared-memory segment name {name!r}"
            owner = self.segment_owners.get(name)
            if shm.segment_creator(name) == os.getpid() or (owner is not None and owner is not client):
                return f"shared-memory segment {name} is not yours to name"
            if client.peer_pid is not None and shm.segment_creator(name) != client.peer_pid:
                return f"shared-memory segment {name} was not created by your process (pid {client.peer_pid})"
        for name in names:
            self.segment_owners[name] = client
        return None

    def _release_inputs(self, client: ClientConnection, descriptors: list[dict], keep: set[str] = frozenset()) -> None:
        """Unlink the input segments of a refused or finished job except those in ``keep``: only
        those ``client`` may name, never another's that it merely named."""
        mine = []
        with self.lock:
            for descriptor in descriptors:
                name = descriptor.get("segment")
                if name in keep or not shm.is_segment_name(name):
                    continue
                owner, creator = self.segment_owners.get(name), shm.segment_creator(name)
                if owner is client or (owner is None and creator != os.getpid() and client.peer_pid in (None, creator)):
                    self.segment_owners.pop(name, None)
                    mine.append(name)
        for name in mine:
            shm.unlink_segment(name)

    def _forget_client(self, client: ClientConnection) -> None:
        """A client that goes away cancels its queued and running jobs and frees its results."""
        with self.lock:
            self.connections.discard(client)
            for job in self.queued:
                if job.client is client:
                    job.cancelled = True
            if self.current is not None and self.current.client is client:
                self.fleet.cancel(self.current.id)
            segments = [segment for segments in client.pending_segments.values() for segment in segments]
            client.pending_segments.clear()
            for segment in segments:
                self.segment_owners.pop(segment, None)
        for segment in segments:
            shm.unlink_segment(segment)

    def cancel(self, client: ClientConnection, job_id: str) -> None:
        """Cancel ``job_id`` if ``client`` submitted it; any other id is ignored, so that no one
        learns whether another client's job exists."""
        with self.lock:
            for job in self.queued:
                if job.id == job_id and job.client is client:
                    job.cancelled = True
            if self.current is not None and self.current.id == job_id and self.current.client is client:
                self.fleet.cancel(job_id)

    # -- the job loop -------------------------------------------------------------------------------
    def _job_loop(self) -> None:
        """Run queued jobs one at a time, forever: nothing one job does ends the loop."""
        while not self.stopping.is_set():
            job = self.jobs.get()
            try:
                with self.lock:
                    self.queued.remove(job)
                    self.queued_inline_bytes -= job.inline_bytes
                    job.cancelled = job.cancelled or self.stopping.is_set()
                    if not job.cancelled:
                        self.current = job
                        self.no_job_running.clear()
                if job.cancelled:
                    self._release_inputs(job.client, job.input_segments)
                    job.client.send(Message("error", {"message": "cancelled before it started", "kind": "cancelled"}, job=job.id))
                    continue
                self._run(job)
            except Exception:  # noqa: BLE001 - a bug in one job's bookkeeping must not stop the queue
                log.exception("job %s: unexpected error in the job loop; serving on", job.id)
            finally:
                self._finish(job)
                job.tensors = {}  # its inline payload is not held once it is done
            self.last_activity = time.monotonic()

    def _run(self, job: Job) -> None:
        """Run ``job``; free its inputs and mark it done before its last message goes out, so a
        client that has its result finds the job finished and its inputs gone."""
        final, handed_back = None, set()
        try:
            final, handed_back = self._run_on_fleet(job)
        finally:  # the job's inputs, except those now a result segment the client unlinks
            self._release_inputs(job.client, job.input_segments, keep=handed_back)
            self._finish(job)
        if final is not None:
            self._deliver(job, final)

    def _finish(self, job: Job) -> None:
        with self.lock:
            if self.current is job:
                self.current = None
                self.completed += 1
                self.no_job_running.set()

    def _run_on_fleet(self, job: Job) -> tuple[Message, set[str]]:
        """Run the job; return its last message (result or error) and the segments it names."""
        def forward(event: Message) -> None:
            if event.type == "progress":
                job.stage, job.step, job.total = event.fields.get("stage", ""), event.fields.get("step", 0), event.fields.get("total", 0)
            job.client.send(event)

        try:
            result = self.fleet.run_job(job.id, job.op, job.args, job.tensors, job.input_segments, forward)
        except JobFailed as exc:
            fields = {"message": str(exc), "kind": exc.kind, "rank": exc.rank, "traceback": exc.traceback}
            return Message("error", fields, job=job.id), set()
        except Exception as exc:  # noqa: BLE001 - the server must survive anything a job does
            log.exception("job %s failed in the server", job.id)
            return Message("error", {"message": f"server error: {exc}", "kind": "error"}, job=job.id), set()
        segments = [desc["segment"] for desc in result.shm]
        if segments:
            with self.lock:  # the client's until it acknowledges (or goes away): no other may name them
                job.client.pending_segments[job.id] = segments
                self.segment_owners.update(dict.fromkeys(segments, job.client))
        return Message("result", result.fields, result.tensors, job=job.id, shm=result.shm), set(segments)

    def _deliver(self, job: Job, final: Message) -> None:
        if job.client.send(final):
            return
        with self.lock:  # the client is gone: nobody will read or acknowledge the result
            segments = job.client.pending_segments.pop(job.id, [])
            for segment in segments:
                self.segment_owners.pop(segment, None)
        for segment in segments:
            shm.unlink_segment(segment)

    def status(self, client: ClientConnection | None = None) -> dict:
        """The fleet's state as ``client`` may see it: another client's job shows its op and
        progress but not its id, so it cannot be named (ids are only ever told to their client)."""
        with self.lock:
            current = None
            if self.current is not None:
                job = self.current
                mine = job.client is client
                current = {"id": job.id if mine else None, "mine": mine, "op": job.op}
                current.update(stage=job.stage, step=job.step, total=job.total)
            return {
                "server_pid": os.getpid(),
                "address": str(self.address),
                "devices": self.devices.describe(),
                "world_size": self.devices.world_size,
                "ranks": self.fleet.describe(),
                "current_job": current,
                "queue_length": len(self.queued),
                "queued_mine": [job.id for job in self.queued if job.client is client],
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



def _peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket (Linux), else None."""
    if sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    return pid or None
