"""The whole-job benchmark ``bench/e2e.py`` on CPU: its memory, weight and residency options, the fleet's
refusal printed as the result, the recipes it does not serve yet, and the rank's memory-cap hook.

The runs are real: a tiny random bundle written to disk, a fleet of one gloo rank spawned by the
benchmark, every job through ``mgpu_backend.ltx.api``. Nothing here asserts a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_backend.fleet.rank import MEMORY_FRACTION_ENV, memory_fraction
from tests.official_reference import needs_ltx_core_gemma

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "e2e.py"


def run_bench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MGPU_")}  # no cap or socket of the caller's
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**environment, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


def table_rows(stdout: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]


@pytest.mark.slow
def test_fleet_only_run_with_minimal_residency_and_fp8_cast_reports_the_decision_the_ranks_logged(tmp_path):
    out = tmp_path / "e2e.md"
    completed = run_bench(
        "--tiny", "--cpu-ranks", "1", "--fleet-only", "--residency", "minimal", "--quantization", "fp8-cast",
        "--memory-gb", "7", "--out", str(out),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    stdout = completed.stdout
    assert "the official pipeline was not run (--fleet-only): no comparison" in stdout
    assert "official" not in table_rows(stdout)[0][1], "no official column when it was skipped"
    assert table_rows(stdout)[0] == ["stage", "fleet s (cold)", "fleet s (warm)", "peak GPU GiB fleet"]
    stages = {row[0]: row[1:] for row in table_rows(stdout)[1:]}
    assert float(stages["stage 1"][0]) > 0 and float(stages["stage 1"][1]) > 0 and float(stages["**total**"][0].strip("*")) > 0
    assert "max abs diff official vs fleet" not in stdout
    assert "fp8-cast transformer weights, fleet residency minimal" in stdout
    assert "CPU ranks planned for 7 GiB (MGPU_MEMORY_LIMIT_GIB" in stdout
    # The decision comes from the load job's log, as the rank wrote it: the cap reached the rank's
    # plan, the transformer was quantized, and everything but the transformer is built per stage.
    (decision,) = [line for line in stdout.splitlines() if line.startswith("- fleet residency (its load log): ")]
    assert decision.startswith("- fleet residency (its load log): rank 0: residency minimal: estimated peak "), decision
    assert "GiB of 7.0 GiB device memory (fp8-cast transformer)" in decision
    per_stage = decision.split("built per stage: ")[1].split(";")[0].split(", ")
    assert per_stage == ["audio_decoder", "embeddings_processor", "gemma", "spatial_upsampler", "video_decoder", "video_encoder", "vocoder"]
    assert decision.endswith("clean LoRA shard in host memory; transformer parked in host memory while Gemma encodes")
    # Rebuilding per stage from host copies reads nothing again, and the warm job is the cold one bitwise.
    assert "warm load 0 bytes, warm job 0 bytes" in stdout
    assert "- fleet cold vs warm frames: bitwise equal" in stdout
    assert out.read_text().lstrip().startswith("`python "), "the --out file carries the command line"


@pytest.mark.slow
def test_a_cap_below_what_the_model_needs_prints_the_fleets_refusal_not_a_traceback():
    completed = run_bench("--tiny", "--cpu-ranks", "1", "--fleet-only", "--memory-gb", "1")
    assert completed.returncode == 1, completed.stderr[-3000:]
    first = completed.stdout.splitlines()[0]
    assert first.startswith("**The fleet world 1 (CPU) refused the job on rank 0:** this model needs about "), first
    assert "per GPU even with residency 'minimal'" in first and "but the device has 1.0 GiB" in first
    assert "Traceback" not in completed.stdout + completed.stderr
    assert "CPU ranks planned for 1 GiB" in completed.stdout


@pytest.mark.slow
@needs_ltx_core_gemma
def test_the_distilled_recipe_runs_on_both_sides_with_equal_outputs():
    completed = run_bench("--tiny", "--pipeline", "distilled", timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = completed.stdout
    assert "LTX-2.0 distilled job" in report and "8 stage-1 steps" in report
    for name in ("stage 1 video", "stage 1 audio", "stage 2 video"):
        assert f"max abs diff official vs fleet, {name} latent: 0\n" in report, name
    assert "decoded video frames, official vs fleet: max abs diff 0 uint8 levels" in report
    assert "fleet cold vs warm frames: bitwise equal" in report


def test_memory_fraction_hook_reads_a_share_of_the_gpu_and_refuses_anything_else():
    assert memory_fraction({}) is None
    assert memory_fraction({MEMORY_FRACTION_ENV: ""}) is None
    assert memory_fraction({MEMORY_FRACTION_ENV: "0.5"}) == 0.5
    assert memory_fraction({MEMORY_FRACTION_ENV: " 1 "}) == 1.0
    assert memory_fraction({MEMORY_FRACTION_ENV: "0.3418803418803419"}) == 0.3418803418803419
    for text in ("0", "-0.25", "1.5", "half", "nan"):
        with pytest.raises(ValueError) as raised:
            memory_fraction({MEMORY_FRACTION_ENV: text})
        assert str(raised.value) == (
            f"MGPU_MEMORY_FRACTION must be a share of the GPU above 0 and at most 1 (0.5: half), got {text!r}; "
            "unset it to use the whole GPU"
        )


def test_identical_residency_decisions_of_several_ranks_are_reported_once_naming_the_ranks(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import e2e

    same = "residency auto: estimated peak 62.5 GiB of 80.0 GiB device memory (unquantized transformer); built per stage: gemma"
    other = "residency auto: estimated peak 70.0 GiB of 80.0 GiB device memory (fp8-cast transformer); built per stage: none"
    job_log = [f"[rank 0] {same}", "[rank 0] loaded in 3.2 s", f"[rank 1] {same}", f"[rank 2] {other}", "[rank 1] residency of nothing else"]
    assert e2e.residency_lines(job_log) == [f"ranks 0, 1: {same}", f"rank 2: {other}"]


@needs_ltx_core_gemma
def test_the_official_distilled_run_is_timed_stage_by_stage_and_gives_the_untimed_pipelines_frames(tmp_path, monkeypatch):
    """The official side of the distilled recipe, ready for when the fleet serves it: the clock sees 8
    single-pass stage-1 steps and the 3-step stage 2, and changes nothing of the output."""
    import torch
    from ltx_core.model.video_vae import TilingConfig
    from ltx_core.text_encoders.gemma.encoders import encoder_configurator
    from ltx_pipelines.distilled import DistilledPipeline

    from mgpu_backend.bundles import full_size
    from mgpu_backend.tools.generate import TINY_DEFAULTS

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import e2e

    torch.set_num_threads(1)
    device = torch.device("cpu")
    bundle = full_size.write_bundle(tmp_path / "bundle", full_size.tiny_config(), device, 0)
    job = e2e.Job(
        height=TINY_DEFAULTS["height"], width=TINY_DEFAULTS["width"], num_frames=TINY_DEFAULTS["num_frames"], frame_rate=24.0,
        seed=10, steps=8, video_guider=None, audio_guider=None, pipeline="distilled", official_steps=8,
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # the pipeline synchronises CUDA unconditionally
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *args, **kwargs: None)
    run = e2e.run_official(bundle, job, device)
    assert len(run.step_seconds["stage 1"]) == 8 and len(run.step_seconds["stage 2"]) == 3
    assert set(run.seconds) >= {"load", "text encode", "stage 1", "upsample", "stage 2", "decode"}
    assert run.latents["stage 1 video"].shape == (1, 128, 2, 2, 3) and run.latents["stage 2 video"].shape == (1, 128, 2, 4, 6)
    assert "the transformer once (both stages)" in run.notes[0]

    gemma = json.loads((Path(bundle.gemma_root) / "config.json").read_text())
    monkeypatch.setattr(encoder_configurator, "GEMMA3_CONFIG_FOR_LTX", full_size.ltx_core_gemma_config(gemma))
    pipeline = DistilledPipeline(bundle.checkpoint_path, bundle.gemma_root, bundle.spatial_upsampler_path, [], device=device)
    with torch.inference_mode():
        chunks, _audio = pipeline(job.prompt, job.seed, job.height, job.width, job.num_frames, job.frame_rate, [], TilingConfig.default())
        untimed = torch.cat([chunk.cpu() for chunk in chunks])
    assert untimed.shape == (9, 128, 192, 3)
    assert torch.equal(run.frames_uint8, untimed)
