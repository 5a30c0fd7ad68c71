"""Processes the fleet, tools and tests deal with: a free loopback port for a child to listen on,
ending one the polite way first (SIGTERM, a grace period, then SIGKILL), whether a pid still runs, and
which process is at the other end of a Unix socket."""

from __future__ import annotations

import os
import socket
import struct
import subprocess


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not; one we may not signal does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of the Unix socket ``sock`` (Linux), else None."""
    if sock.family != socket.AF_UNIX or not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    return pid or None


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the system's pick), for a child to bind."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def stop_process(process: subprocess.Popen, grace_seconds: float = 30.0) -> None:
    """Terminate ``process`` (if it still runs), wait up to ``grace_seconds``, then kill it; returns
    once it is gone."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
