"""``bench/comfy_native.py --tiny`` on the CPU: ComfyUI's own LTX-2 and the fleet at world 1 on one tiny
checkpoint agree, and the table says so; the ``--multi-gpu`` fleet side on two gloo ranks.

It needs a ComfyUI checkout (``COMFYUI_DIR``) and a Python with ComfyUI's requirements (the bench's
docstring lists them): run it as ``COMFYUI_DIR=~/ComfyUI ~/comfy-venv/bin/python -m pytest
tests/test_bench_comfy_native.py``. The runs are real: a tiny random bundle written to disk, ComfyUI's
loader and model in the bench's process, a fleet of one gloo rank spawned by it. Nothing asserts a time.

Tolerances: both sides run fp32 on the CPU, so the denoiser outputs differ by float rounding only
(ComfyUI's sub-quadratic attention against ltx-core's SDPA; measured about 1e-6 on outputs of
magnitude 4); 1e-4 leaves room for other CPUs and still fails on any real disagreement, which is
1e-2 or more (ComfyUI without the causal-positioning metadata is off by 4e-2). Three CFG-4 Euler steps
amplify the rounding (measured 2e-5): 1e-3 there.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "comfy_native.py"
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
FORWARD_TOLERANCE = 1e-4
STEPPED_TOLERANCE = 1e-3

needs_comfyui = [
    pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to compare its LTX-2 with the fleet"),
    pytest.mark.skipif(
        importlib.util.find_spec("torchvision") is None or importlib.util.find_spec("torchsde") is None,
        reason="this Python lacks ComfyUI's requirements (torchvision, torchsde, ...): run pytest with the Python of a ComfyUI environment",
    ),
]


def with_comfyui(test):
    for mark in needs_comfyui:
        test = mark(test)
    return test


def run_bench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MGPU_")}  # no socket of the caller's
    return subprocess.run(
        [sys.executable, str(BENCH), "--comfyui-dir", COMFYUI_DIR, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**environment, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def table_rows(stdout: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]


def numbers(cell: str) -> list[float]:
    return [float(value) for value in re.findall(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", cell)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("comfy-native") / "table.md"
    bundle = tmp_path_factory.mktemp("comfy-native-bundle")
    completed = run_bench("--tiny", "--bundle-dir", str(bundle), "--repeats", "2", "--steps", "3", "--multi-gpu", "--out", str(out))
    assert completed.returncode == 0, completed.stderr[-4000:]
    return completed, out


@with_comfyui
def test_tiny_run_prints_one_row_per_size_with_both_sides_timed(tiny_run):
    completed, _ = tiny_run
    header, *rows = table_rows(completed.stdout)
    assert header == [
        "stage-1 size (WxHxF)", "video + audio tokens", "forward ms ComfyUI", "forward ms fleet", "ComfyUI / fleet",
        "CFG step ms ComfyUI", "CFG step ms fleet", "ComfyUI / fleet", "forward max abs diff video (rel)",
        "forward max abs diff audio (rel)", "max abs diff after the steps video / audio",
    ]  # fmt: skip
    assert [row[:2] for row in rows] == [["96x64x9", "12 + 9"], ["192x128x17", "72 + 18"]]
    for row in rows:
        comfy_forward, fleet_forward, forward_ratio, comfy_step, fleet_step, step_ratio = (float(cell) for cell in row[2:8])
        assert comfy_forward > 0 and fleet_forward > 0 and comfy_step > 0 and fleet_step > 0, row
        assert forward_ratio == pytest.approx(comfy_forward / fleet_forward, rel=0.03, abs=0.002), row
        assert step_ratio == pytest.approx(comfy_step / fleet_step, rel=0.03, abs=0.002), row


@with_comfyui
def test_comfyui_and_the_fleet_give_the_same_denoiser_outputs_in_fp32(tiny_run):
    completed, _ = tiny_run
    for row in table_rows(completed.stdout)[1:]:
        video_abs, video_rel = numbers(row[8])
        audio_abs, audio_rel = numbers(row[9])
        assert video_abs < FORWARD_TOLERANCE and audio_abs < FORWARD_TOLERANCE, row
        assert video_rel < FORWARD_TOLERANCE and audio_rel < FORWARD_TOLERANCE, row
        stepped_video, stepped_audio = numbers(row[10])
        assert stepped_video < STEPPED_TOLERANCE and stepped_audio < STEPPED_TOLERANCE, row


@with_comfyui
def test_the_notes_name_dtype_passes_and_what_multi_gpu_needs(tiny_run):
    completed, out = tiny_run
    notes = completed.stdout
    assert "float32 on both sides" in notes
    assert "ComfyUI LTXAV / LTXAVModel, weights float32" in notes and "on cpu" in notes
    # ComfyUI's CFGGuider batches the conditional and unconditional pass into one call per step.
    assert "- ComfyUI ran 1 model call(s) per step, batch 2" in notes
    assert "for 2 passes and 12 video tokens" in notes and "for 2 passes and 72 video tokens" in notes
    assert "- --multi-gpu: skipped, it needs at least 2 GPUs (0 visible); this ComfyUI has no MultiGPU work-unit nodes" in notes
    written = out.read_text()
    assert written.startswith("\n`python ") and " on CPU " in written.splitlines()[1]
    assert completed.stdout.strip() in written


@with_comfyui
def test_an_ltx_2_3_checkpoint_is_refused_in_words_when_comfyui_does_not_implement_it(tmp_path):
    completed = run_bench("--tiny", "--model", "2.3", "--bundle-dir", str(tmp_path), timeout=600)
    assert completed.returncode == 1, completed.stderr[-4000:]
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ComfyUI's LTX-2 model (LTXAVModel) does not match this checkpoint's transformer: "), last
    assert last.endswith("this ComfyUI does not implement this model version (LTX-2.3's gated attention and cross-attention AdaLN need a newer ComfyUI); use --model 2.0")
    assert "Traceback" not in completed.stderr


@pytest.mark.slow
def test_the_fleet_on_two_ranks_gives_the_world_1_cfg_steps_and_the_multi_gpu_notes_say_so(tmp_path, monkeypatch):
    """The ``--multi-gpu`` comparison's fleet side, on two gloo ranks (the CLI runs it on 2+ GPUs only):
    the planner's split of the two CFG passes gives the world-1 latents; no ComfyUI is needed."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import comfy_native

    torch.set_num_threads(1)
    bundle = comfy_native.full_size.write_bundle(tmp_path / "bundle", comfy_native.bundle_config("2.0", True), "cpu", 0)
    spec = comfy_native.replace(bundle.spec(), distilled_lora=None)
    config = comfy_native.checkpoint_transformer_config(bundle.checkpoint_path)
    inputs = [comfy_native.make_inputs((96, 64, 9), config, 3, torch.device("cpu"), torch.float32)]
    socket_dir = tmp_path / "fleet"
    socket_dir.mkdir(mode=0o700)
    world_1 = comfy_native.run_fleet(spec, inputs, "float32", 1, str(socket_dir), None, cpu_ranks=1, forwards=False)
    world_2 = comfy_native.run_fleet(spec, inputs, "float32", 1, str(socket_dir), None, cpu_ranks=2, forwards=False)
    assert "1 guidance groups x SP degree 1 on 1 rank for 2 passes" in world_1[0].notes[0]
    # Two passes on two ranks: the planner runs them side by side (one guidance group each).
    assert "2 guidance groups x SP degree 1 on 2 ranks for 2 passes" in world_2[0].notes[0], world_2[0].notes
    for single, multi in zip(world_1[0].stepped, world_2[0].stepped):
        assert single.shape == multi.shape and float((single - multi).abs().max()) < 1e-5

    comfy = comfy_native.SideResult(step_ms=[30.0, 20.0, 22.0])
    world_2[0].step_ms = [15.0, 10.0, 12.0]
    lines = comfy_native.multi_gpu_lines([], 2, inputs, [comfy], world_1, world_2)
    assert lines[0] == "- --multi-gpu on 2 GPUs: this ComfyUI has no MultiGPU work-unit nodes; ComfyUI runs on one"
    assert lines[1].startswith("  - 96x64x9: fleet world 2 CFG step 11.0 ms (stage-1 plan"), lines[1]
    assert "ComfyUI on one GPU 21.0 ms: 1.91x; latents vs fleet world 1: max abs diff " in lines[1]
    skipped = comfy_native.multi_gpu_lines(["comfy_extras/nodes_multigpu.py"], 1, inputs, [comfy], world_1, None)
    assert skipped == ["- --multi-gpu: skipped, it needs at least 2 GPUs (1 visible); this ComfyUI has MultiGPU work-unit code in comfy_extras/nodes_multigpu.py"]
