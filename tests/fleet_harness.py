"""Start a real fleet server (subprocess, real sockets, gloo CPU ranks) for tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mgpu_backend.fleet.client import FleetClient, FleetUnavailable
from mgpu_backend.tools.processes import free_loopback_port, process_alive, stop_process

REPO = Path(__file__).resolve().parent.parent


def start_server(socket_path: Path, cpu_ranks: int = 2, *extra: str, env: dict | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", str(socket_path), "--cpu-ranks", str(cpu_ranks), *extra]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    log = open(socket_path.parent / "server.log", "ab")  # noqa: SIM115
    process = subprocess.Popen(command, env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    wait_for_server(socket_path, process)
    return process


def wait_for_server(socket_path: Path, process: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            log = (socket_path.parent / "server.log").read_text()
            raise RuntimeError(f"server exited with {process.returncode}:\n{log}")
        try:
            FleetClient.connect(str(socket_path), autostart=False).close()
            return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
    raise TimeoutError(f"no server on {socket_path} after {timeout} s")


def stop_server(process: subprocess.Popen) -> None:
    stop_process(process, grace_seconds=15)




def wait_gone(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Wait until none of ``pids`` is alive; return those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if process_alive(pid)]
        if not alive:
            return []
        time.sleep(0.2)
    return [pid for pid in pids if process_alive(pid)]


def token_of(socket_path: Path) -> str:
    return (socket_path.parent / (socket_path.name + ".token")).read_text()


def raw_handshake(sock, token: str):
    """The client's side of the handshake by hand, proving ``token`` whatever the server shows;
    returns the server's last reply (``welcome`` or an ``error``)."""
    import secrets

    from mgpu_backend.fleet import protocol

    client_nonce = secrets.token_hex(32)
    protocol.send_message(sock, protocol.Message("hello", {"version": protocol.PROTOCOL_VERSION, "nonce": client_nonce}))
    challenge = protocol.recv_message(sock)
    if challenge.type != "challenge":
        return challenge
    proof = protocol.handshake_proof(token, "client", client_nonce, challenge.fields["nonce"])
    protocol.send_message(sock, protocol.Message("auth", {"proof": proof}))
    return protocol.recv_message(sock)


def module_fleet(tmp_path_factory, name: str, cpu_ranks: int = 2, *extra: str, env: dict | None = None, own_tmpdir: bool = False) -> Iterator[Path]:
    """A fleet server for one test module, in a private folder of its own; yields its socket and
    stops it when the module is done (``yield from`` it in a module-scoped fixture, or take the
    ``fleet_of`` fixture of tests/conftest.py). ``own_tmpdir``: the server's TMPDIR (its rendezvous
    and store folders) is the folder ``tmp`` beside its socket."""
    directory = tmp_path_factory.mktemp(name)
    directory.chmod(0o700)
    socket_path = directory / "fleet.sock"
    if own_tmpdir:
        (directory / "tmp").mkdir()
        env = {**(env or {}), "TMPDIR": str(directory / "tmp")}
    process = start_server(socket_path, cpu_ranks, "--idle-timeout", "0", *extra, env=env)
    try:
        yield socket_path
    finally:
        stop_server(process)


@contextmanager
def tcp_fleet(tmp_path: Path, monkeypatch) -> Iterator[tuple[str, int, Path]]:
    """A one-rank fleet served on a free loopback TCP port, its token under a private runtime folder:
    yields ``(address, port, runtime folder)`` once a client can connect, and stops it after."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    port = free_loopback_port()
    address = f"tcp://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", address, "--cpu-ranks", "1", "--idle-timeout", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_RUNTIME_DIR": str(runtime)}
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                FleetClient.connect(address, autostart=False).close()
                break
            except FleetUnavailable:
                assert time.monotonic() < deadline and process.poll() is None, "TCP server did not come up"
                time.sleep(0.2)
        yield address, port, runtime
    finally:
        stop_server(process)


def api_fleet(tmp_path: Path, monkeypatch) -> Iterator[Path]:
    """A one-rank fleet that ``mgpu_backend.ltx.api`` (what the nodes call) talks to, for a test's body."""
    from mgpu_backend.ltx import api

    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "0")
    try:
        monkeypatch.setenv("MGPU_SOCKET", str(socket_path))  # never start a fleet of its own
        api.configure(address=str(socket_path))
        yield socket_path
    finally:
        api.configure()
        stop_server(process)


def run_job(socket_path, op: str, args: dict, tensors: dict | None = None, **callbacks):
    """One job on the fleet at ``socket_path`` through a connection of its own."""
    with FleetClient.connect(str(socket_path), autostart=False) as client:
        return client.run(op, args, tensors or {}, **callbacks)
