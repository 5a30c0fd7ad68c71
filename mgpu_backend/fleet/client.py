"""The client the ComfyUI nodes and the CLI use to reach the fleet server.

``FleetClient.connect()`` attaches to the server at ``MGPU_SOCKET`` (or this process's default
socket: its own fleet in ComfyUI, the per-user one on the command line; see ``addresses``) and, if
none answers and ``autostart`` is on, starts one with ``python -m mgpu_backend serve`` in a new
session, tied to this process: when this process dies, that server exits with its ranks.
``run()`` submits a job and streams its events to callbacks; ``should_cancel`` is polled while the
job runs (ComfyUI's interrupt) and turns into a cancel that stops every rank at the same step.
The handshake is mutual: the server proves it holds the token before the client does, so a program
squatting on the address never receives a job. Socket failures reach callers as one readable
``FleetUnavailable`` that says what happened when the client can tell: the server is shutting down
(it says so, or it removed its token before closing), it died, or its token file was removed under
it. Nothing here imports ComfyUI or unpickles anything.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import secrets
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mgpu_backend import PACKAGE_ROOT
from mgpu_backend.fleet import addresses, protocol, shm
from mgpu_backend.fleet.addresses import Address, ensure_private_dir, read_token
from mgpu_backend.fleet.protocol import Message
from mgpu_backend.tools.processes import peer_pid, process_alive

START_TIMEOUT_SECONDS = float(os.environ.get("MGPU_START_TIMEOUT", "300"))
POLL_SECONDS = 0.1
HANDSHAKE_SECONDS = 30.0  # the server allows 10 s; a client on a loaded machine waits a little longer
DRAIN_SECONDS = 10.0  # after an abandoned job: how long to wait for its cancel before closing instead
TOKEN_WAIT_SECONDS = 2.0  # a server writes its token just after it starts listening
DEATH_WAIT_SECONDS = 1.0  # a dying process closes its sockets a moment before it is gone
SHUTDOWN_KIND = "shutdown"  # the error kind a stopping server ends its clients' jobs with


class FleetError(Exception):
    """A job failed in the fleet. ``rank`` and ``traceback`` say where, when known."""

    def __init__(self, message: str, kind: str = "error", rank: int | None = None, traceback: str | None = None):
        super().__init__(message)
        self.kind, self.rank, self.traceback = kind, rank, traceback

    @property
    def where(self) -> str:
        """' (rank N)' for a fault on one rank; '' for an input error, which every rank finds alike
        (whichever rank reported it first would be named at random)."""
        return f" (rank {self.rank})" if self.rank is not None and self.kind != "input_error" else ""


class FleetCancelled(FleetError):
    """The job was cancelled (by the caller or because its client went away)."""


class FleetUnavailable(FleetError):
    """No server could be reached or started."""


@dataclass
class JobResult:
    job_id: str
    fields: dict
    tensors: dict[str, torch.Tensor]


class FleetClient:
    """One connection to the server. Its job stream is scoped: every event carries its job id and
    a call reads only its own job's; when a callback raises (or the caller interrupts), the job is
    cancelled and drained, or the connection closed, so the next call starts clean. A lost server
    is a ``FleetUnavailable`` with what to do, never a raw socket error."""

    def __init__(self, sock: socket.socket, address: Address, server_pid: int) -> None:
        self.sock, self.address, self.server_pid = sock, address, server_pid
        self.refs = itertools.count(1)

    # -- connecting ------------------------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        address: str | None = None,
        autostart: bool = True,
        gpus: str | None = None,
        cpu_ranks: int | None = None,
        idle_timeout: float | None = None,
        rank_timeout: float | None = None,
    ) -> FleetClient:
        """Attach to the server, starting one bound to this process if none answers and allowed.

        With ``MGPU_SOCKET`` set (a server started by hand), nothing is ever started. ``address``
        None: ``MGPU_SOCKET`` or this process's default socket (``addresses.default_socket``).
        """
        try:
            addr = Address.parse(address)
        except addresses.AddressError as exc:
            raise FleetUnavailable(str(exc)) from None
        try:
            return cls._attach(addr)
        except (FileNotFoundError, ConnectionRefusedError):
            if not autostart or os.environ.get(addresses.ENV_SOCKET):
                if addr.unix_path == addresses.process_socket() and not os.environ.get(addresses.ENV_SOCKET):
                    start = "this process's own fleet socket: its first fleet job (in ComfyUI: the first MGPU node) starts one there"
                else:
                    start = "start one with 'python -m mgpu_backend serve'"
                raise FleetUnavailable(f"no fleet server answers at {addr}; {start}") from None
        try:
            ensure_private_dir(addr.directory)
        except (addresses.AddressError, OSError) as exc:
            raise FleetUnavailable(f"cannot use {addr.directory} for the fleet: {exc}") from None
        with open(addr.directory / "start.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one client starts the server; the others attach to it
            try:
                return cls._attach(addr)
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            process = cls._spawn_server(addr, gpus, cpu_ranks, idle_timeout, rank_timeout)
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            last_refusal = ""
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise FleetUnavailable(f"the fleet server exited with code {process.returncode} while starting; see {addr.log_path}")
                try:
                    return cls._attach(addr)
                except (FileNotFoundError, ConnectionRefusedError):
                    time.sleep(0.2)
                except FleetUnavailable as exc:  # a server half up, or another process on the address
                    last_refusal = f" (last answer: {exc})"
                    time.sleep(0.2)
            process.kill()
            raise FleetUnavailable(f"the fleet server did not come up within {START_TIMEOUT_SECONDS:.0f} s{last_refusal}")

    @staticmethod
    def _spawn_server(addr, gpus, cpu_ranks, idle_timeout, rank_timeout) -> subprocess.Popen:
        command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", str(addr), "--parent-pid", str(os.getpid())]
        if cpu_ranks:
            command += ["--cpu-ranks", str(cpu_ranks)]
        elif gpus:
            command += ["--gpus", gpus]
        if idle_timeout is not None:
            command += ["--idle-timeout", str(idle_timeout)]
        if rank_timeout is not None:
            command += ["--rank-timeout", str(rank_timeout)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        log_file = open(addr.log_path, "ab")  # noqa: SIM115 - handed to the child
        return subprocess.Popen(
            command, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
        )

    @classmethod
    def _attach(cls, addr: Address) -> FleetClient:
        """Connect and run the mutual handshake. Raises FileNotFoundError / ConnectionRefusedError
        when nothing listens (the caller may start a server), FleetUnavailable for anything else."""
        if addr.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target = str(addr.unix_path)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target = ("127.0.0.1", addr.tcp_port)
        protocol.tune_socket(sock)
        try:
            sock.connect(target)
            token = cls._token(sock, addr)
            server_pid = cls._handshake(sock, addr, token)
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            raise
        except TimeoutError:
            sock.close()
            raise FleetUnavailable(
                f"the fleet server at {addr} did not complete the handshake within {HANDSHAKE_SECONDS:.0f} s "
                "(still starting its ranks, or stuck: see its log); retry in a moment"
            ) from None
        except (OSError, addresses.AddressError, protocol.ConnectionClosed, protocol.ProtocolError) as exc:
            sock.close()
            raise FleetUnavailable(f"could not attach to the fleet server at {addr}: {_reason(exc)}") from None
        except BaseException:
            sock.close()
            raise
        return cls(sock, addr, server_pid)

    @staticmethod
    def _token(sock: socket.socket, addr: Address) -> str:
        """The token of the server ``sock`` reached. A server writes it just after it starts
        listening, so a missing one is waited for a moment; missing after that, it was removed under
        a running server, which no client can then attach to: FleetUnavailable saying so (never
        FileNotFoundError, which would have the caller start a second server on the same address)."""
        deadline = time.monotonic() + TOKEN_WAIT_SECONDS
        while True:
            try:
                return read_token(addr.token_path)
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        pid = peer_pid(sock)
        if pid is not None:
            listener, stop = f"a fleet server (pid {pid})", f"Stop it with 'kill {pid}' (it stops its ranks and removes its socket)"
        else:  # a TCP port: the pid is not known, nor that the listener is a fleet server at all
            listener = "a process"
            stop = f"Stop the process listening on port {addr.tcp_port} (find it with 'ss -ltnp sport = :{addr.tcp_port}')"
        raise FleetUnavailable(
            f"{listener} listens at {addr}, but the fleet's token file {addr.token_path} is missing (removed while the server "
            f"ran), so no client can attach to it. {stop}; a fresh fleet can then start there"
        )

    @staticmethod
    def _handshake(sock: socket.socket, addr: Address, token: str) -> int:
        """hello -> challenge -> auth -> welcome. The server proves it holds the token before this
        client proves it; the token itself never crosses the socket. Returns the server's pid."""
        sock.settimeout(HANDSHAKE_SECONDS)
        client_nonce = secrets.token_hex(protocol.NONCE_HEX_DIGITS // 2)
        protocol.send_message(sock, Message("hello", {"version": protocol.PROTOCOL_VERSION, "nonce": client_nonce}))
        challenge = protocol.recv_message(sock, max_payload=0)
        if challenge.type == "error":
            raise FleetUnavailable(f"the server at {addr} refused the connection: {challenge.fields.get('message')}")
        server_nonce = challenge.fields.get("nonce")
        if (
            challenge.type != "challenge"
            or not protocol.is_nonce(server_nonce)
            or not protocol.proof_matches(
                challenge.fields.get("proof"), protocol.handshake_proof(token, "server", client_nonce, server_nonce)
            )
        ):
            raise FleetUnavailable(
                f"the process listening at {addr} cannot prove it holds this fleet's token, so it is not your fleet server "
                "(another program may have taken the address after a crash); nothing was sent to it. Stop that program, "
                "or start the fleet on another address (--socket / MGPU_SOCKET)"
            )
        proof = protocol.handshake_proof(token, "client", client_nonce, server_nonce)
        protocol.send_message(sock, Message("auth", {"proof": proof}))
        welcome = protocol.recv_message(sock, max_payload=0)
        if welcome.type != "welcome" or not isinstance(welcome.fields.get("server_pid"), int):
            raise FleetUnavailable(f"the server at {addr} refused the connection: {welcome.fields.get('message')}")
        sock.settimeout(None)
        return welcome.fields["server_pid"]

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the wire, with every failure turned into FleetUnavailable ------------------------------
    def _lost(self, exc: BaseException) -> FleetUnavailable:
        """The connection broke: say why when it can be told. A stopping server removes its token
        before it closes its connections; a server that died leaves it in place."""
        self.close()
        if not self.address.token_path.exists():
            return self._shutting_down()
        if _exits_within(self.server_pid, DEATH_WAIT_SECONDS):
            return FleetUnavailable(
                f"the fleet server at {self.address} (pid {self.server_pid}) died ({_reason(exc)}); "
                f"its log: {self.address.log_path}. {RUN_AGAIN}"
            )
        return FleetUnavailable(
            f"lost the connection to the fleet server at {self.address} ({_reason(exc)}). {RUN_AGAIN}; "
            f"see 'python -m mgpu_backend status' and {self.address.log_path}"
        )

    def _shutting_down(self) -> FleetUnavailable:
        self.close()
        return FleetUnavailable(
            f"the fleet server at {self.address} is shutting down (it was told to stop: 'python -m mgpu_backend stop', "
            f"the MGPU Fleet Control node, or a signal), so the job ended before it finished. {RUN_AGAIN}",
            SHUTDOWN_KIND,
        )

    def _send(self, message: Message) -> None:
        try:
            protocol.send_message(self.sock, message)
        except OSError as exc:
            raise self._lost(exc) from exc

    def _recv(self, timeout: float | None = None) -> Message | None:
        """The next message, or None when ``timeout`` passes without one."""
        try:
            if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
                return None
            return protocol.recv_message(self.sock)
        except (OSError, ValueError, protocol.ConnectionClosed, protocol.ProtocolError) as exc:  # ValueError: closed socket
            raise self._lost(exc) from exc

    def _discard(self, message: Message) -> None:
        """Drop a message that is not for the caller (a previous job's), freeing any segment it names."""
        if message.type == "error" and message.job is None:
            if message.fields.get("kind") == SHUTDOWN_KIND:
                raise self._shutting_down()
            self.close()
            raise FleetUnavailable(f"the fleet server closed the connection: {message.fields.get('message')}")
        if message.shm:
            for descriptor in message.shm:
                shm.unlink_segment(descriptor.get("segment", ""))
            self._send(Message("ack", job=message.job))

    def seems_connected(self) -> bool:
        """Whether the connection looks usable without asking the server: nothing waiting on the
        socket (a closed or dying server leaves an end-of-stream or a farewell there). A denoiser call
        of the drop-in MODEL checks this every step, where a status round trip would cost each time."""
        try:
            return not select.select([self.sock], [], [], 0)[0]
        except (OSError, ValueError):  # ValueError: the socket is closed
            return False

    # -- requests ---------------------------------------------------------------------------------
    def status(self) -> dict:
        self._send(Message("status"))
        while (message := self._recv()).type != "status":
            self._discard(message)
        return message.fields

    def shutdown(self) -> None:
        self._send(Message("shutdown"))
        try:
            while (message := self._recv()).type != "bye":
                self._discard(message)
        except FleetUnavailable:
            pass  # it went away: what was asked

    def run(
        self,
        op: str,
        args: dict | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        on_progress: Callable[[dict], None] | None = None,
        on_log: Callable[[str], None] | None = None,
        should_cancel: Callable[[], bool] | None = None,
        on_preview: Callable[[dict, torch.Tensor], None] | None = None,
    ) -> JobResult:
        """Run one job to its end. Raises FleetCancelled or FleetError (FleetUnavailable when the
        server is gone); the fleet and this connection stay usable after any of them.

        ``on_preview(fields, frames)`` receives the job's live previews (``protocol.preview_frames``);
        a malformed one is dropped with a line to ``on_log``: a preview is never worth the job."""
        try:
            inline, shared = shm.split_for_transfer(tensors or {})
        except shm.SharedMemoryFull as exc:
            raise FleetError(str(exc), "input_error") from None
        ref = next(self.refs)
        try:
            self._send(Message("submit", {"op": op, "args": args or {}, "ref": ref}, inline, shm=shared))
        except BaseException:
            for descriptor in shared:  # never reached the server: ours to remove
                shm.unlink_segment(descriptor["segment"])
            raise
        job_id: str | None = None
        finished = False
        try:
            cancel_sent = False
            while True:
                if should_cancel is not None and job_id is not None and not cancel_sent and should_cancel():
                    self._send(Message("cancel", job=job_id))
                    cancel_sent = True
                message = self._recv(POLL_SECONDS)
                if message is None:
                    continue
                if job_id is None:  # the server answers a submit before any event of its job
                    if message.type in ("accepted", "error") and message.fields.get("ref") == ref and message.job:
                        if message.type == "accepted":
                            job_id = message.job
                            continue
                    else:
                        self._discard(message)
                        continue
                elif message.job != job_id:
                    self._discard(message)
                    continue
                if message.type == "progress" and on_progress is not None:
                    on_progress(message.fields)
                elif message.type == "preview" and on_preview is not None:
                    try:
                        frames = protocol.preview_frames(message)
                    except protocol.ProtocolError as exc:
                        if on_log is not None:
                            on_log(f"preview dropped: {exc}")
                        continue
                    on_preview(message.fields, frames)
                elif message.type == "log" and on_log is not None:
                    on_log(f"[rank {message.fields.get('rank')}] {message.fields.get('text', '')}")
                elif message.type == "error":
                    finished = True
                    kind = message.fields.get("kind", "error")
                    if kind == SHUTDOWN_KIND:
                        raise self._shutting_down()
                    error_type = FleetCancelled if kind == "cancelled" else FleetError
                    fields = message.fields
                    raise error_type(fields.get("message", "job failed"), kind, fields.get("rank"), fields.get("traceback"))
                elif message.type == "result":
                    finished = True
                    return JobResult(message.job or "", message.fields.get("result", {}), self._result_tensors(message))
        except BaseException:
            if not finished:
                self._abandon(job_id)
            # The server unlinks a job's inputs when it ends; one that went away cannot.
            for descriptor in shared:
                shm.unlink_segment(descriptor["segment"])
            raise

    def _result_tensors(self, message: Message) -> dict[str, torch.Tensor]:
        """The result's tensors, mapped from their segments; every segment is unlinked and the
        result acknowledged whatever happens, so none outlives this call."""
        tensors_out = dict(message.tensors)
        failure = None
        for descriptor in message.shm:
            try:
                tensors_out[descriptor["name"]] = shm.read_tensor(descriptor)
            except (OSError, protocol.ProtocolError) as exc:
                failure = failure or exc
                shm.unlink_segment(descriptor.get("segment", ""))
        if message.shm:
            self._send(Message("ack", job=message.job))
        if failure is not None:
            raise FleetError(f"could not map the job's result from shared memory: {failure}")
        return tensors_out

    def _abandon(self, job_id: str | None) -> None:
        """The caller stopped reading a job (a callback raised, an interrupt): cancel it and read
        up to its end, so its events never reach the next call; close the connection if that
        cannot be done (the server then cancels the job itself)."""
        if job_id is None or self.sock.fileno() == -1:
            self.close()  # the submit's answer is unknown: only a fresh connection is clean
            return
        try:
            protocol.send_message(self.sock, Message("cancel", job=job_id))
            deadline = time.monotonic() + DRAIN_SECONDS
            while (remaining := deadline - time.monotonic()) > 0:
                if not select.select([self.sock], [], [], remaining)[0]:
                    break
                message = protocol.recv_message(self.sock)
                if message.shm:
                    for descriptor in message.shm:
                        shm.unlink_segment(descriptor.get("segment", ""))
                    protocol.send_message(self.sock, Message("ack", job=message.job))
                if message.job == job_id and message.type in ("result", "error"):
                    return
        except (OSError, ValueError, protocol.ConnectionClosed, protocol.ProtocolError):
            pass
        self.close()


RUN_AGAIN = "Run again: a fleet this process started is started anew (one started by hand: start it again with 'python -m mgpu_backend serve')"






def _exits_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` is gone now or within ``seconds``."""
    deadline = time.monotonic() + seconds
    while process_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, (FleetError, protocol.ProtocolError)) else f"{type(exc).__name__}: {text}"


def _gib(count: int | None) -> str:
    return "-" if count is None else f"{count / 2**30:.2f} GiB"


def format_status(status: dict) -> str:
    """The server's status as a few lines for people: ranks, memory, weights, the job and the queue
    (``status`` CLI, the Fleet Control node)."""
    lines = [f"server pid {status['server_pid']} on {status['address']}: {status['devices']}, up {status['uptime_seconds']} s"]
    for rank in status["ranks"]:
        memory = rank.get("memory") or {}
        total = f" of {_gib(memory['total'])}" if "total" in memory else ""
        peak = f", peak {_gib(memory['peak'])}" if "peak" in memory else ""
        state = "alive" if rank["alive"] else "DEAD"
        lines.append(f"  rank {rank['rank']}: pid {rank['pid']} {rank['device']} {state}, memory {_gib(memory.get('allocated', memory.get('rss')))}{total}{peak}")
        weights = rank.get("weights")
        if weights:
            # Only worth saying on a GPU rank: on a CPU rank the host is the device.
            shard_on_host = weights.get("clean_shard_device") == "cpu" and "cuda" in str(rank["device"])
            from_file = weights.get("clean_shard_file_bytes") or 0
            lines.append(
                f"    weights: transformer working copy {_gib(weights.get('working_bytes'))}, clean shard "
                f"{_gib(weights.get('clean_shard_bytes'))}{' in host memory' if shard_on_host else ''}"
                f"{f' ({_gib(from_file)} of it the checkpoint file itself, no copy)' if from_file else ''}, "
                f"other components {_gib(weights.get('other_components_bytes'))}, host copies {_gib(weights.get('host_copies_bytes'))}"
            )
    job = status["current_job"]
    if job:
        owner = job["id"] if job.get("id") else "(another client's)"
        lines.append(f"current job: {owner} {job['op']} {job['stage']} {job['step']}/{job['total']}")
    else:
        lines.append("current job: none")
    lines.append(f"queue: {status['queue_length']} waiting, {status['jobs_completed']} done, {status['fleet_restarts']} fleet restart(s)")
    return "\n".join(lines)
