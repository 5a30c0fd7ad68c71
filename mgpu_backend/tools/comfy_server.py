"""A ComfyUI of its own: a checkout's ``main.py`` on a free loopback port, with a base directory of its
own (models, custom nodes, database, output), its log in a file there, stopped politely.

For what starts a real ComfyUI next to the project: the end-to-end tests (the pack installed in it)
and ``bench/comfy_graph.py`` (ComfyUI's own LTX-2 graph, the API only).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from mgpu_backend.tools import comfy_queue
from mgpu_backend.tools.processes import free_loopback_port, stop_process

START_TIMEOUT_SECONDS = 300.0


class ComfyUIStartError(RuntimeError):
    """ComfyUI exited or did not answer while starting; the message ends with its log's tail."""


class ComfyUIServer:
    """ComfyUI's ``main.py`` from ``comfyui_dir`` run by ``python`` with ``base`` as its base directory,
    listening on 127.0.0.1 only; ``args`` are added to its command line (e.g. ``--cpu``)."""

    def __init__(self, comfyui_dir: Path, base: Path, args: Sequence[str] = (), python: str = sys.executable, env: dict | None = None) -> None:
        self.comfyui_dir, self.base = Path(comfyui_dir), Path(base)
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.base / "comfyui.log"
        command = [
            python, str(self.comfyui_dir / "main.py"), "--listen", "127.0.0.1", "--port", str(self.port),
            "--base-directory", str(self.base), "--disable-auto-launch", "--database-url", f"sqlite:///{self.base / 'comfyui.db'}", *args,
        ]  # fmt: skip
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - the process writes it until stop()
        self.process = subprocess.Popen(command, cwd=self.base, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, path: str = "/system_stats", timeout: float = START_TIMEOUT_SECONDS) -> float:
        """Seconds until ComfyUI answers ``path`` with 200; ComfyUIStartError if it exits or stays silent."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise ComfyUIStartError(f"ComfyUI exited with {self.process.returncode} while starting:\n{self.log_tail()}")
            try:
                if comfy_queue.http_json(self.url + path, timeout=5)[0] == 200:
                    return time.monotonic() - started
            except (comfy_queue.QueueError, OSError):  # not listening yet, or too busy to answer in time
                pass
            time.sleep(1.0)
        raise ComfyUIStartError(f"ComfyUI did not answer {path} within {timeout:.0f} s:\n{self.log_tail()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, characters: int = 4000) -> str:
        return self.log_text()[-characters:]

    def stop(self) -> None:
        """End ComfyUI (SIGTERM, then SIGKILL after a grace period) and close its log; again: nothing."""
        stop_process(self.process)
        self.log.close()
