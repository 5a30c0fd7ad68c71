"""The client the ComfyUI nodes and the CLI use to reach the fleet server.

``FleetClient.connect()`` attaches to the server at ``MGPU_SOCKET`` (or the default private socket)
and, if none answers and ``autostart`` is on, starts one with ``python -m mgpu_backend serve`` in a
new session, tied to this process: when this process dies, that server exits with its ranks.
``run()`` submits a job and streams its events to callbacks; ``should_cancel`` is polled while the
job runs (ComfyUI's interrupt) and turns into a cancel that stops every rank at the same step.
Nothing here imports ComfyUI or unpickles anything.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mgpu_backend import PACKAGE_ROOT
from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.addresses import Address, ensure_private_dir, read_token
from mgpu_backend.fleet.protocol import Message

START_TIMEOUT_SECONDS = float(os.environ.get("MGPU_START_TIMEOUT", "300"))
POLL_SECONDS = 0.1


class FleetError(Exception):
    """A job failed in the fleet. ``rank`` and ``traceback`` say where, when known."""

    def __init__(self, message: str, kind: str = "error", rank: int | None = None, traceback: str | None = None):
        super().__init__(message)
        self.kind, self.rank, self.traceback = kind, rank, traceback


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
    def __init__(self, sock: socket.socket, address: Address, server_pid: int) -> None:
        self.sock, self.address, self.server_pid = sock, address, server_pid

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

        With ``MGPU_SOCKET`` set (a server started by hand), nothing is ever started.
        """
        addr = Address.parse(address)
        try:
            return cls._attach(addr)
        except (FileNotFoundError, ConnectionRefusedError):
            if not autostart or os.environ.get("MGPU_SOCKET"):
                raise FleetUnavailable(
                    f"no fleet server answers at {addr}; start one with 'python -m mgpu_backend serve'"
                ) from None
        ensure_private_dir(addr.directory)
        with open(addr.directory / "start.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one client starts the server; the others attach to it
            try:
                return cls._attach(addr)
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            process = cls._spawn_server(addr, gpus, cpu_ranks, idle_timeout, rank_timeout)
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            while time.monotonic() < deadline:
                if process.poll() is not None:
                    raise FleetUnavailable(f"the fleet server exited with code {process.returncode} while starting; see its log")
                try:
                    return cls._attach(addr)
                except (FileNotFoundError, ConnectionRefusedError, protocol.ConnectionClosed):
                    time.sleep(0.2)
            process.kill()
            raise FleetUnavailable(f"the fleet server did not come up within {START_TIMEOUT_SECONDS:.0f} s")

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
        log_path = addr.directory / "server.log"
        log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        return subprocess.Popen(
            command, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
        )

    @classmethod
    def _attach(cls, addr: Address) -> FleetClient:
        if addr.unix_path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target = str(addr.unix_path)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            target = ("127.0.0.1", addr.tcp_port)
        protocol.tune_socket(sock)
        try:
            sock.connect(target)
            token = read_token(addr.token_path)
            protocol.send_message(sock, Message("hello", {"version": protocol.PROTOCOL_VERSION, "token": token}))
            reply = protocol.recv_message(sock)
        except BaseException:
            sock.close()
            raise
        if reply.type != "welcome":
            sock.close()
            raise FleetUnavailable(f"the server refused the connection: {reply.fields.get('message')}")
        return cls(sock, addr, reply.fields["server_pid"])

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests ---------------------------------------------------------------------------------
    def status(self) -> dict:
        protocol.send_message(self.sock, Message("status"))
        return protocol.recv_message(self.sock).fields

    def shutdown(self) -> None:
        protocol.send_message(self.sock, Message("shutdown"))
        try:
            protocol.recv_message(self.sock)
        except protocol.ConnectionClosed:
            pass

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
        """Run one job to its end. Raises FleetCancelled or FleetError; the fleet stays usable.

        ``on_preview(fields, frames)`` receives the job's live previews (``protocol.preview_frames``);
        a malformed one is dropped with a line to ``on_log``: a preview is never worth the job."""
        inline, shared = shm.split_for_transfer(tensors or {})
        protocol.send_message(self.sock, Message("submit", {"op": op, "args": args or {}}, inline, shm=shared))
        job_id: str | None = None
        cancel_sent = False
        while True:
            if should_cancel is not None and job_id is not None and not cancel_sent and should_cancel():
                protocol.send_message(self.sock, Message("cancel", job=job_id))
                cancel_sent = True
            readable, _, _ = select.select([self.sock], [], [], POLL_SECONDS)
            if not readable:
                continue
            message = protocol.recv_message(self.sock)
            if message.type == "accepted":
                job_id = message.job
            elif message.type == "progress" and on_progress is not None:
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
                kind = message.fields.get("kind", "error")
                error_type = FleetCancelled if kind == "cancelled" else FleetError
                raise error_type(message.fields.get("message", "job failed"), kind, message.fields.get("rank"), message.fields.get("traceback"))
            elif message.type == "result":
                tensors_out = dict(message.tensors)
                for descriptor in message.shm:
                    tensors_out[descriptor["name"]] = shm.read_tensor(descriptor)
                if message.shm:
                    protocol.send_message(self.sock, Message("ack", job=message.job))
                return JobResult(message.job or "", message.fields.get("result", {}), tensors_out)


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
            lines.append(
                f"    weights: transformer working copy {_gib(weights.get('working_bytes'))}, clean shard "
                f"{_gib(weights.get('clean_shard_bytes'))}{' in host memory' if shard_on_host else ''}, "
                f"other components {_gib(weights.get('other_components_bytes'))}, host copies {_gib(weights.get('host_copies_bytes'))}"
            )
    job = status["current_job"]
    lines.append(f"current job: {job['id']} {job['op']} {job['stage']} {job['step']}/{job['total']}" if job else "current job: none")
    lines.append(f"queue: {status['queue_length']} waiting, {status['jobs_completed']} done, {status['fleet_restarts']} fleet restart(s)")
    return "\n".join(lines)
