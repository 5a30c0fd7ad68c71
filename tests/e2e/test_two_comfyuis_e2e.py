"""Two ComfyUIs of one user, each with a fleet of its own: the first (1 CPU rank) runs the tiny
workflow, the second (2 CPU ranks, the same runtime folder, so the same private socket directory)
starts its own fleet instead of attaching to the first's, and its run outlives the first ComfyUI,
stopped while the second samples.

Runs only with COMFYUI_DIR pointing at a ComfyUI checkout (its Python: COMFYUI_PYTHON), as
test_comfyui_e2e does.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from mgpu_backend.tools import comfy_queue
from mgpu_backend.tools.comfy_server import ComfyUIServer

from mgpu_backend.tools.processes import process_alive

from .comfyui_harness import COMFYUI_DIR, PACK_DIR, START_TIMEOUT_SECONDS, get_json, queue, saved_video

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "main.py").is_file(), reason="set COMFYUI_DIR to a ComfyUI checkout"),
]
SECOND_STEPS = 60


class ComfyUIOnRanks(ComfyUIServer):
    """ComfyUI --cpu with the pack symlinked into ``base``'s custom_nodes, whose fleet runs
    ``cpu_ranks`` CPU ranks; ``runtime`` is the user's runtime folder (XDG_RUNTIME_DIR)."""

    def __init__(self, base: Path, runtime: Path, cpu_ranks: int) -> None:
        (base / "custom_nodes").mkdir(parents=True)
        (base / "custom_nodes" / "comfyui-mgpu").symlink_to(PACK_DIR, target_is_directory=True)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "MGPU_CPU_RANKS": str(cpu_ranks), "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACK_DIR), env.get("PYTHONPATH")]))  # this checkout's mgpu_backend, even beside an installed one
        env.pop("MGPU_SOCKET", None)
        super().__init__(Path(COMFYUI_DIR), base, ["--cpu"], python=os.environ.get("COMFYUI_PYTHON", sys.executable), env=env)


def test_a_second_comfyui_starts_its_own_fleet_and_its_run_outlives_the_first(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    first, second = ComfyUIOnRanks(tmp_path / "first", runtime, 1), ComfyUIOnRanks(tmp_path / "second", runtime, 2)
    try:
        for comfyui in (first, second):
            comfyui.wait_ready("/object_info/MGPUSPSampler", timeout=START_TIMEOUT_SECONDS)
        assert saved_video(first, queue(first)).is_file()
        first_fleet = get_json(f"{first.url}/mgpu/status")
        assert first_fleet["world_size"] == 1
        assert first_fleet["address"] == str(runtime / "comfyui-mgpu" / f"process-{first.process.pid}" / "fleet.sock")

        outcome: list = []

        def long_run() -> None:
            try:
                outcome.append(queue(second, **{"4.steps": SECOND_STEPS, "4.seed": 11}))
            except comfy_queue.QueueError as exc:
                outcome.append(exc)

        runner = threading.Thread(target=long_run)
        runner.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            second_fleet = get_json(f"{second.url}/mgpu/status")
            job = second_fleet.get("current_job") or {}
            if job.get("op") == "sample" and (job.get("step") or 0) >= 1:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the second ComfyUI's run never reached step 1 of stage 1:\n{second.log_tail()}")
        assert second_fleet["world_size"] == 2 and second_fleet["server_pid"] != first_fleet["server_pid"], second_fleet
        assert second_fleet["address"] == str(runtime / "comfyui-mgpu" / f"process-{second.process.pid}" / "fleet.sock")

        first.stop()  # the first ComfyUI ends, and its fleet with it
        first_pids = [first_fleet["server_pid"], *(rank["pid"] for rank in first_fleet["ranks"])]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(process_alive(pid) for pid in first_pids):
            time.sleep(0.5)
        assert not [pid for pid in first_pids if process_alive(pid)], f"the first fleet {first_pids} outlived its ComfyUI"
        during = get_json(f"{second.url}/mgpu/status")
        assert during["server_pid"] == second_fleet["server_pid"] and (during["current_job"] or {}).get("op") in ("sample", "upscale", "decode"), during

        runner.join(timeout=600)
        assert not runner.is_alive(), "the second ComfyUI's run did not end within 600 s"
        (result,) = outcome
        assert isinstance(result, comfy_queue.Outcome), f"the second ComfyUI's run failed: {result}"
        assert saved_video(second, result).is_file()
        after = get_json(f"{second.url}/mgpu/status")
        assert after["server_pid"] == second_fleet["server_pid"] and after["fleet_restarts"] == 0, after
    finally:
        first.stop()
        second.stop()
