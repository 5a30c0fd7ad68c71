"""``python -m mgpu_backend generate --pipeline distilled``: the distilled recipe from the command line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from mgpu_backend.tools import media

from tests.helpers import cli, run_generate


@pytest.mark.slow
def test_generate_runs_the_distilled_pipeline_on_the_embedded_tiny_bundle(tmp_path):
    completed = run_generate(tmp_path, "distilled", "--pipeline", "distilled")
    assert "embedded tiny LTX-2 bundle" in completed.stderr and "8 steps, distilled pipeline" in completed.stderr
    # One rank runs stage 2 untiled, so its audio is the official re-denoised one.
    assert "stage-2 plan (auto, distilled): SP degree 1 on 1 rank for" in completed.stderr
    assert completed.stderr.count("denoised in stage 2") == 1, completed.stderr
    facts = media.probe(tmp_path / "distilled.mp4")
    assert facts["video"] == {"codec": "h264", "width": 192, "height": 128, "frames": 9}
    dump = load_file(str(tmp_path / "distilled.safetensors"))
    assert (dump["stage2_audio"] - dump["stage1_audio"]).abs().max().item() > 0.05


@pytest.mark.slow
def test_distilled_debug_dump_under_sp_is_identical_at_1_and_2_cpu_ranks(tmp_path):
    dumps = {}
    for ranks in (1, 2):
        completed = run_generate(tmp_path, f"r{ranks}", "--pipeline", "distilled", "--stage2-parallel", "sp", cpu_ranks=ranks)
        assert f"SP degree {ranks} on {ranks} rank{'s' if ranks > 1 else ''} for" in completed.stderr
        dumps[ranks] = load_file(str(tmp_path / f"r{ranks}.safetensors"))
    for ranks in (2,):
        for name, tensor in dumps[1].items():
            diff = (tensor.float() - dumps[ranks][name].float()).abs().max().item()
            assert diff == 0.0, f"{name} at {ranks} ranks differs from 1 rank by {diff}"
    assert not torch.equal(dumps[1]["stage2_audio"], dumps[1]["stage1_audio"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--distilled-lora", "l.safetensors"], "--distilled-lora does not apply to --pipeline distilled (the distilled checkpoint needs no distilled LoRA)"),
        (["--checkpoint-path", "c.safetensors"], "--checkpoint-path does not apply to --pipeline distilled"),
        (["--distilled-checkpoint-path", "d.safetensors"], "a real model needs --gemma-root, --spatial-upsampler-path too"),
        (["--video-cfg-guidance-scale", "3"], "--video-cfg-guidance-scale do(es) not apply to --pipeline distilled"),
        (["--num-inference-steps", "20"], "runs its 8 fixed distilled sigmas; drop --num-inference-steps"),
    ],
)
def test_generate_distilled_refuses_flags_of_the_other_recipe_before_starting_anything(tmp_path, flags, message):
    completed = cli("generate", "--prompt", "x", "--pipeline", "distilled", "--output", str(tmp_path / "o.mp4"), *flags)
    assert completed.returncode != 0 and message in completed.stderr, completed.stderr[-2000:]
    assert not (tmp_path / "o.mp4").exists()


def test_generate_two_stage_refuses_the_distilled_checkpoint_flag(tmp_path):
    completed = cli("generate", "--prompt", "x", "--distilled-checkpoint-path", "d.safetensors", "--output", str(tmp_path / "o.mp4"))
    assert completed.returncode != 0 and "--distilled-checkpoint-path does not apply to --pipeline two-stage" in completed.stderr
