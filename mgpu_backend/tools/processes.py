"""Ending a child process the polite way first: SIGTERM, a grace period, then SIGKILL."""

from __future__ import annotations

import subprocess


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
