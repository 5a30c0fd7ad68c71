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

from tests.helpers import bench_module

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


def table_rows(stdout: str, table: int = 0) -> list[list[str]]:
    """The rows (header first) of the ``table``-th markdown table in ``stdout``."""
    tables: list[list[list[str]]] = []
    previous_in_table = False
    for line in stdout.splitlines():
        in_table = line.startswith("|")
        if in_table and not previous_in_table:
            tables.append([])
        if in_table and "---" not in line:
            tables[-1].append([cell.strip() for cell in line.split("|")[1:-1]])
        previous_in_table = in_table
    return tables[table]


def numbers(cell: str) -> list[float]:
    return [float(value) for value in re.findall(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", cell)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("comfy-native") / "table.md"
    bundle = tmp_path_factory.mktemp("comfy-native-bundle")
    completed = run_bench("--tiny", "--bundle-dir", str(bundle), "--repeats", "2", "--steps", "3", "--multi-gpu", "--profile", "--compile-blocks", "--out", str(out))
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
def test_the_profile_sums_each_sides_operators_by_kind_at_the_largest_size(tiny_run):
    completed, _ = tiny_run
    assert "Where one forward spends its CPU time at 192x128x17 (torch.profiler" in completed.stdout
    header, *rows = table_rows(completed.stdout, 2)
    assert header == ["aten operators", "ComfyUI ms", "ltx-core (fleet) ms", "ComfyUI - ltx-core"]
    groups = {row[0]: [float(cell) for cell in row[1:]] for row in rows}
    assert list(groups) == ["attention", "matrix products", "normalization", "other", "**total**", "aten operators run", "profiled forward, wall ms"]
    for side in (0, 1):
        kinds = [groups[kind][side] for kind in ("attention", "matrix products", "normalization", "other")]
        assert groups["attention"][side] > 0 and groups["matrix products"][side] > 0, groups
        assert groups["**total**"][side] == pytest.approx(sum(kinds), abs=0.25), groups
        assert groups["aten operators run"][side] > 100, groups  # a forward of two blocks runs hundreds
        # the operators' own time is part of the profiled forward's wall time
        assert groups["**total**"][side] <= groups["profiled forward, wall ms"][side] + 0.1, groups
    for kind, (comfy_ms, core_ms, difference) in groups.items():
        assert difference == pytest.approx(comfy_ms - core_ms, abs=0.15), kind
    assert "- ComfyUI's largest aten operators: aten::" in completed.stdout
    assert "- ltx-core's largest aten operators: aten::" in completed.stdout
    # "other" by the operator that ran it: every row an aten operator outside the named kinds, and the
    # rows' own time no more than the "other" total of each side.
    header, *operators = table_rows(completed.stdout, 3)
    assert header == ["aten operator", "ComfyUI ms (calls)", "ltx-core ms (calls)"] and 0 < len(operators) <= 10
    assert all(row[0].startswith("aten::") and comfy_native_group(row[0]) == "other" for row in operators), operators
    for side in (0, 1):
        assert sum(numbers(row[1 + side])[0] for row in operators) <= groups["other"][side] + 0.1 * len(operators), operators


@with_comfyui
def test_compiled_blocks_are_compared_at_the_largest_size_and_cpu_ranks_say_they_ran_eagerly(tiny_run):
    completed, _ = tiny_run
    main_rows = table_rows(completed.stdout, 0)
    header, row = table_rows(completed.stdout, 1)
    assert header[:5] == ["stage-1 size (WxHxF)", "forward ms ComfyUI", "forward ms fleet", "forward ms fleet compiled", "ComfyUI / compiled"]
    assert row[0] == "192x128x17"
    assert row[1:3] == main_rows[-1][2:4]  # the same ComfyUI and default-fleet medians as the main table
    assert float(row[4]) == pytest.approx(float(row[1]) / float(row[3]), rel=0.03, abs=0.002)
    # On a CPU rank the option runs the blocks eagerly: the compiled fleet gives the default fleet's outputs.
    video, audio = row[9].split(" / ")
    assert video == main_rows[-1][8] and audio == main_rows[-1][9]
    assert "for 2 passes and 72 video tokens, 72 tokens per shard; estimated cheapest; passes batched: False; CUDA graphs: off; compiled blocks: False" in completed.stdout
    assert re.search(r"- the first compiled forward at 72 video tokens \(compile \+ capture\): \d+\.\d s", completed.stdout)


def comfy_native_group(name: str) -> str:
    return bench_module("comfy_native").kernel_group(name)


def test_kernel_names_fall_into_the_kind_that_does_their_work():

    names = {
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, false>": "attention",
        "cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>": "attention",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0": "attention",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "matrix products",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTT": "matrix products",
        "aten::addmm": "matrix products",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float>": "normalization",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "other",
        "aten::copy_": "other",
    }
    assert {name: comfy_native_group(name) for name in names} == names


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
