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
it created. The server exits when told to, after its idle timeout, or once the process that
launched it is gone and no client or job is left; it takes its ranks with it and unlinks every
segment it knows of. It never unpickles and never listens beyond loopback.

Connections are admitted in two stages, so that no one without the token can keep the owner out:
at most MAX_PENDING_HANDSHAKES connections may be in their handshake at once (a new one drops the
oldest, and each has HANDSHAKE_SECONDS in all), and only a connection that proved the token takes
one of the MAX_CONNECTIONS authenticated places. On a Unix socket one process may hold at most
MAX_CONNECTIONS_PER_PROCESS of them, so a single runaway process leaves room for the others, and
the process that launched the fleet (``--parent-pid``: ComfyUI) has OWNER_RESERVED_CONNECTIONS
places beyond the cap that nobody else can take.

The server takes a submit's input segments from the client: it copies each into a segment of its
own (``shm.take_segment``) and unlinks the client's, so the ranks only ever map memory no client
can shorten under them (a SIGBUS would kill a rank), and a queued job holds only server segments,
which leave with the job when it is cancelled or its client goes away.
"""

from __future__ import annotations

import collections
import errno
import itertools
import logging
import os
import secrets
import signal
import socket
import stat
import threading
import time
from dataclasses import dataclass, field

from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.addresses import Address, AddressError, ensure_private_dir, write_token
from mgpu_backend.fleet.controller import DeviceSpec, Fleet, JobFailed
from mgpu_backend.fleet.protocol import Message
from mgpu_backend.tools.processes import peer_pid, process_alive

log = logging.getLogger("mgpu.server")

HANDSHAKE_SECONDS = 10.0  # hello to welcome, in total, however the bytes trickle in
MAX_PENDING_HANDSHAKES = 16  # connections not yet authenticated; one more drops the oldest of them
MAX_CONNECTIONS = 64  # authenticated connections; one more is refused with a reply
MAX_CONNECTIONS_PER_PROCESS = 16  # authenticated connections of one peer process (Unix sockets)
OWNER_RESERVED_CONNECTIONS = 4  # places beyond MAX_CONNECTIONS only the launching process may take
MAX_QUEUED_JOBS = 64  # waiting in the queue, all clients together
MAX_JOBS_PER_CLIENT = 8  # queued plus running, per connection
MAX_QUEUED_INLINE_BYTES = 4 << 30  # inline tensor bytes held by waiting jobs, all clients together
MAX_READING_BYTES = 4 << 30  # bytes of frames being read at once, all clients together
# Bytes waiting to be written to one client: a frame queued while more than this already waits
# drops the client. So a large inline result (up to protocol.MAX_PAYLOAD_BYTES) always gets in.
MAX_OUTBOX_BYTES = int(os.environ.get("MGPU_OUTBOX_BYTES", 64 << 20))
# Result bytes in segments a client was handed and has not acknowledged: past this, its next job
# is refused until it acknowledges (FleetClient does so as soon as it has mapped a result).
MAX_UNACKNOWLEDGED_BYTES = int(os.environ.get("MGPU_UNACKNOWLEDGED_BYTES", 4 << 30))
SHUTDOWN_TEXT = "the fleet server is shutting down; the job was stopped. Start the fleet again and resubmit"
FLUSH_SECONDS = 5.0  # how long a closing connection may take to deliver its last error reply
SHUTDOWN_GRACE_SECONDS = 10.0  # how long a running job gets to stop at its next step when the server exits
ACCEPT_RETRY_SECONDS = 0.2  # pause after a failed accept (out of file descriptors) before the next


class StoppedDuringStartUp(Exception):
    """SIGTERM or SIGINT arrived while the ranks were starting."""


@dataclass
class Job:
    id: str
    op: str
    args: dict
    tensors: dict
    input_segments: list[dict]
    client: ClientConnection  # input_segments are the server's copies (shm.take_segment)
    submitted: float = field(default_factory=time.time)
    stage: str = ""
    step: int = 0
    total: int = 0

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
        self.pending_bytes: dict[str, int] = {}  # job id -> bytes of those segments
        self.authenticated = False
        self.opened = time.monotonic()
        self.peer_pid = peer_pid(sock)
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

    def finish(self) -> None:
        """Accept nothing more; the writer delivers what is queued, then stops."""
        with self.lock:
            self.finishing = True
            self.wakeup.notify_all()

    def close(self, deadline: float | None = None) -> None:
        """Deliver what is queued (an error reply) until ``deadline`` (default: FLUSH_SECONDS from
        now), then close the socket."""
        deadline = time.monotonic() + FLUSH_SECONDS if deadline is None else deadline
        self.finish()
        self.writer.join(timeout=max(0.0, deadline - time.monotonic()))
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
        self.fleet = Fleet(devices, rank_timeout=rank_timeout, private_dir=address.directory, held_segments=self._input_copies)
        self.queued: list[Job] = []  # waiting, first in first out; the job loop takes the first
        self.copying: list[Job] = []  # submits whose input segments are being copied
        self.queued_inline_bytes = 0
        self.current: Job | None = None
        self.no_job_running = threading.Event()
        self.no_job_running.set()
        self.connections: set[ClientConnection] = set()
        self.segment_owners: dict[str, ClientConnection] = {}  # every segment a job or a client holds
        self.reading = protocol.ByteBudget(MAX_READING_BYTES)
        self.job_ids = itertools.count(1)
        self.lock = threading.Lock()
        self.queue_changed = threading.Condition(self.lock)
        self.stopping = threading.Event()
        self.parent_gone = False  # the launching process is gone: exit once no client and no job is left
        self.socket_identity: tuple[int, int] | None = None  # (device, inode) of the socket this server bound
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
            try:
                existing = path.lstat()
            except FileNotFoundError:
                existing = None
            if existing is not None and not stat.S_ISSOCK(existing.st_mode):
                raise AddressError(f"{path} exists and is not a socket, so it was left as it is")
            if existing is not None:
                probe = socket.socket(socket.AF_UNIX)
                try:
                    probe.connect(str(path))
                    owner = peer_pid(probe)
                    remedy = (f"stop it with 'python -m mgpu_backend stop --socket {path}'" if self.address.token_path.exists()
                              else f"its token file is gone, so only 'kill {owner}' stops it" if owner else "its token file is gone: stop that process")
                    raise RuntimeError(f"a fleet server{f' (pid {owner})' if owner else ''} already listens on {path}; {remedy}")
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
            bound = path.lstat()
            self.socket_identity = (bound.st_dev, bound.st_ino)
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
        starting = True

        def on_signal(*_) -> None:
            self.stopping.set()
            if starting:  # the ranks may take minutes to come up: stop waiting for them now
                raise StoppedDuringStartUp

        try:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_signal)
                signal.signal(signal.SIGINT, on_signal)
            self.fleet.start()
            starting = False
            if self.stopping.is_set():
                return
            log.info("serving on %s (pid %d)", self.address, os.getpid())
            for target in (self._accept_loop, self._job_loop, self._watchdog):
                threading.Thread(target=target, daemon=True, name=target.__name__).start()
            print(f"mgpu fleet server ready on {self.address} with {self.devices.describe()}", flush=True)
            self.stopping.wait()
        except StoppedDuringStartUp:
            log.info("stopped while the ranks were starting")
        finally:
            starting = False
            self.shutdown()

    def shutdown(self) -> None:
        """Tell every client with a job that the server is going, stop the running job at its
        next step, end the ranks, close every connection and unlink every segment."""
        log.info("shutting down")
        self.stopping.set()
        if self.listener is not None:
            try:
                self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
            except OSError:
                pass
            self.listener.close()
        if self.address.unix_path is not None and self.socket_identity is not None:
            try:
                now = self.address.unix_path.lstat()
                if (now.st_dev, now.st_ino) == self.socket_identity:  # never a file someone put there since
                    self.address.unix_path.unlink()
            except FileNotFoundError:
                pass
        if self.token:
            self.address.token_path.unlink(missing_ok=True)
        with self.lock:
            connections = list(self.connections)
            waiting, self.queued = self.queued, []
            self.queued_inline_bytes = 0
            running = self.current
            self.queue_changed.notify_all()
        for job in [*waiting, *([running] if running else [])]:
            job.client.send(Message("error", {"message": SHUTDOWN_TEXT, "kind": "shutdown"}, job=job.id))
        for client in connections:  # nothing more is queued for them; what is queued goes out
            client.finish()
        for job in waiting:
            self._discard_inputs(job)
        if running is not None:
            # Let the job stop at its next step first: ranks killed under a running job would look
            # like a rank death, and the fleet would start new ranks while the server exits.
            self.fleet.cancel(running.id)
            self.no_job_running.wait(SHUTDOWN_GRACE_SECONDS)
        self.fleet.stop()
        deadline = time.monotonic() + FLUSH_SECONDS
        for client in connections:
            client.close(deadline)
        with self.lock:  # unacknowledged results and whatever a client still held
            segments = list(self.segment_owners)
            self.segment_owners.clear()
        for segment in segments:
            shm.unlink_segment(segment)
        shm.unlink_created_by(os.getpid())  # the server's input copies, the ranks' segments

    def _watchdog(self) -> None:
        while not self.stopping.wait(1.0):
            if self.parent_pid is not None and not self.parent_gone and not process_alive(self.parent_pid):
                self.parent_gone = True
                log.info("launching process %d is gone; exiting once no client and no job is left", self.parent_pid)
            if self.parent_gone:
                with self.lock:
                    unused = self.current is None and not self.queued and not any(client.authenticated for client in self.connections)
                if unused:
                    log.info("no client and no job left after the launching process; exiting")
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
        """Serve a new connection; when MAX_PENDING_HANDSHAKES others are still in their
        handshake, the oldest of them is dropped to make room (it had its chance)."""
        protocol.tune_socket(sock)
        client = ClientConnection(sock, self)
        with self.lock:
            pending = [other for other in self.connections if not other.authenticated and not other.closed]
            oldest = min(pending, key=lambda other: other.opened) if len(pending) >= MAX_PENDING_HANDSHAKES else None
            self.connections.add(client)
        if oldest is not None:
            oldest.drop()
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
        with self.lock:
            refusal = self._connection_refusal(client)
            client.authenticated = refusal is None
        if refusal:
            client.send(Message("error", {"message": refusal, "kind": "busy"}))
            return False
        client.send(Message("welcome", {"version": protocol.PROTOCOL_VERSION, "server_pid": os.getpid()}))
        return True

    def _connection_refusal(self, client: ClientConnection) -> str | None:
        """Why an authenticated ``client`` gets no place (call with the lock held), or None."""
        others = [other for other in self.connections if other.authenticated and other is not client]
        if client.peer_pid is not None:
            same_process = sum(1 for other in others if other.peer_pid == client.peer_pid)
            if same_process >= MAX_CONNECTIONS_PER_PROCESS:
                return (
                    f"process {client.peer_pid} already has {MAX_CONNECTIONS_PER_PROCESS} connections open to the fleet server; "
                    "close unused clients and retry"
                )
        owner = client.peer_pid is not None and client.peer_pid == self.parent_pid
        if len(others) >= MAX_CONNECTIONS + (OWNER_RESERVED_CONNECTIONS if owner else 0):
            return f"the fleet server already has {MAX_CONNECTIONS} connections open; close unused clients and retry"
        return None

    def _handle(self, client: ClientConnection, message: Message) -> None:
        self.last_activity = time.monotonic()
        if message.type == "submit":
            self._submit(client, message)
        elif message.type == "cancel":
            self.cancel(client, message.job or "")
        elif message.type == "ack":
            self._free_results(client, message.job or "")
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
        job = Job(job_id, op, args, message.tensors, [], client)
        with self.lock:
            problem = self._claim_inputs(client, message.shm)
            kind = "input_error" if problem else None
            if not problem:
                problem, kind = self._queue_refusal(job)
        if problem:
            return refuse(problem, kind)
        # The server's own copies (what the ranks map can no longer change under them), each held
        # under its name before it exists, so that no cleanup can take it half-made.
        with self.lock:
            self.copying.append(job)
        try:
            for descriptor in message.shm:
                copy = {**descriptor, "segment": shm.new_segment_name()}
                with self.lock:
                    job.input_segments.append(copy)
                shm.take_segment(descriptor, copy["segment"])
        except (OSError, protocol.ProtocolError) as exc:
            with self.lock:
                self.copying.remove(job)
            self._discard_inputs(job)
            return refuse(f"cannot read input segment {descriptor['segment']}: {exc}", "input_error")
        self._release_inputs(client, message.shm)
        with self.lock:
            self.copying.remove(job)
            problem, kind = self._queue_refusal(job)  # the queue may have filled during the copy
            if not problem:
                self.queued.append(job)
                self.queued_inline_bytes += job.inline_bytes
                position = len(self.queued)
                self.queue_changed.notify_all()
        if problem:
            self._discard_inputs(job)
            return refuse(problem, kind)
        client.send(Message("accepted", {**reply, "position": position}, job=job_id))

    def _queue_refusal(self, job: Job) -> tuple[str | None, str | None]:
        """Why ``job`` cannot join the queue now, and the error kind; (None, None) when it can (call
        with the lock held)."""
        client = job.client
        running = int(self.current is not None and self.current.client is client)
        mine = running + sum(1 for queued in self.queued if queued.client is client)
        if self.stopping.is_set():
            return SHUTDOWN_TEXT, "shutdown"
        if mine >= MAX_JOBS_PER_CLIENT:
            return f"this client already has {MAX_JOBS_PER_CLIENT} jobs queued or running; wait for one to finish", "busy"
        if len(self.queued) >= MAX_QUEUED_JOBS:
            return f"the queue is full ({MAX_QUEUED_JOBS} jobs); retry later", "busy"
        if self.queued_inline_bytes + job.inline_bytes > MAX_QUEUED_INLINE_BYTES:
            return f"the queue already holds {self.queued_inline_bytes / 2**30:.1f} GiB of inline tensors; retry later", "busy"
        problem = self._unacknowledged_refusal(client)
        return (problem, "busy") if problem else (None, None)

    @staticmethod
    def _unacknowledged_refusal(client: ClientConnection) -> str | None:
        held = sum(client.pending_bytes.values())
        if held <= MAX_UNACKNOWLEDGED_BYTES:
            return None
        return (
            f"this client holds {held / 2**20:.0f} MiB of results it has not acknowledged (at most {MAX_UNACKNOWLEDGED_BYTES / 2**20:.0f} MiB); "
            "read them and send 'ack' for each job (FleetClient does) before running more"
        )

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

    def _release_inputs(self, client: ClientConnection, descriptors: list[dict]) -> None:
        """Unlink the client's input segments a submit named, once copied or refused: only those
        ``client`` may name, never another's that it merely named."""
        mine = []
        with self.lock:
            for descriptor in descriptors:
                name = descriptor.get("segment")
                if not shm.is_segment_name(name):
                    continue
                owner, creator = self.segment_owners.get(name), shm.segment_creator(name)
                if owner is client or (owner is None and creator != os.getpid() and client.peer_pid in (None, creator)):
                    self.segment_owners.pop(name, None)
                    mine.append(name)
        for name in mine:
            shm.unlink_segment(name)

    def _forget_client(self, client: ClientConnection) -> None:
        """A client that goes away takes its queued jobs (and their segments) out of the queue at
        once, cancels its running job and frees its results."""
        with self.lock:
            self.connections.discard(client)
            waiting = self._unqueue(lambda job: job.client is client)
            if self.current is not None and self.current.client is client:
                self.fleet.cancel(self.current.id)
        for job in waiting:
            self._discard_inputs(job)
        for job_id in list(client.pending_segments):
            self._free_results(client, job_id)

    def cancel(self, client: ClientConnection, job_id: str) -> None:
        """Cancel ``job_id`` if ``client`` submitted it: a queued job leaves the queue at once with
        its reply, a running one stops at its next step. Any other id is ignored, so that no one
        learns whether another client's job exists."""
        with self.lock:
            waiting = self._unqueue(lambda job: job.id == job_id and job.client is client)
            if self.current is not None and self.current.id == job_id and self.current.client is client:
                self.fleet.cancel(job_id)
        for job in waiting:
            self._discard_inputs(job)
            client.send(Message("error", {"message": "cancelled before it started", "kind": "cancelled"}, job=job.id))

    def _unqueue(self, which) -> list[Job]:
        """Take the queued jobs ``which(job)`` selects out of the queue (call with the lock held)."""
        taken = [job for job in self.queued if which(job)]
        if taken:
            self.queued = [job for job in self.queued if not which(job)]
            self.queued_inline_bytes -= sum(job.inline_bytes for job in taken)
            for job in taken:
                job.tensors = {}
        return taken

    def _input_copies(self) -> set[str]:
        """The server's copies of the inputs of every job not yet finished, copies in progress included."""
        with self.lock:
            jobs = [*self.queued, *self.copying, *([self.current] if self.current else [])]
            return {descriptor["segment"] for job in jobs for descriptor in job.input_segments}

    def _discard_inputs(self, job: Job, keep: set[str] = frozenset()) -> None:
        """Unlink the server's copies of ``job``'s input segments, except those in ``keep``."""
        for descriptor in job.input_segments:
            if descriptor["segment"] not in keep:
                shm.unlink_segment(descriptor["segment"])

    def _free_results(self, client: ClientConnection, job_id: str) -> None:
        """The client read job ``job_id``'s result segments, or never will: unlink them (also
        when the client did, in case it did not)."""
        with self.lock:
            segments = client.pending_segments.pop(job_id, [])
            client.pending_bytes.pop(job_id, None)
            for segment in segments:
                self.segment_owners.pop(segment, None)
        for segment in segments:
            shm.unlink_segment(segment)

    # -- the job loop -------------------------------------------------------------------------------
    def _job_loop(self) -> None:
        """Run queued jobs one at a time, forever: nothing one job does ends the loop."""
        while True:
            with self.lock:
                while not self.queued and not self.stopping.is_set():
                    self.queue_changed.wait()
                if self.stopping.is_set():
                    return
                job = self.queued.pop(0)
                self.queued_inline_bytes -= job.inline_bytes
                refusal = self._unacknowledged_refusal(job.client)
                if refusal is None:
                    self.current = job
                    self.no_job_running.clear()
            try:
                if refusal is not None:
                    self._discard_inputs(job)
                    job.client.send(Message("error", {"message": refusal, "kind": "busy"}, job=job.id))
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
            self._discard_inputs(job, keep=handed_back)
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
                job.client.pending_bytes[job.id] = sum(desc.get("nbytes", 0) for desc in result.shm)
                self.segment_owners.update(dict.fromkeys(segments, job.client))
        return Message("result", result.fields, result.tensors, job=job.id, shm=result.shm), set(segments)

    def _deliver(self, job: Job, final: Message) -> None:
        if not job.client.send(final):  # the client is gone: nobody will read or acknowledge the result
            self._free_results(job.client, job.id)

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




