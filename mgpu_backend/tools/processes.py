"""Child processes the tools and tests start: a free loopback port for one to listen on, and ending
one the polite way first (SIGTERM, a grace period, then SIGKILL)."""

from __future__ import annotations

import socket
import subprocess


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
