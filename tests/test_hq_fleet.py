"""The HQ recipe (``pipeline: hq``) through a real fleet (server process, sockets, gloo CPU ranks) on
the tiny LTX-2.3 bundle, against ltx-pipelines 1.0.0's ``TI2VidTwoStagesHQPipeline``.

The fleet's jobs take everything from the recipe's declaration: the sample job fuses the distilled
LoRA at its stage-1 strength (``distilled-stage-1``, 0.25) and steps with res_2s over LTX2Scheduler's
sigmas shifted by the stage's own tokens, under the HQ guidance (CFG and modality isolation, no STG);
the upscale job swaps the working copy to the stage-2 strength (``distilled-stage-2``, 0.5) and runs
res_2s over the official tail, sequence parallel so that the audio is denoised too. One rank must
equal the official runner bitwise (stage-1 and stage-2 video and audio latents, bf16); two ranks,
under the SP and guidance plans, must equal one rank bitwise, a stage 1 after a stage-2 swap included.

Both sides get the same text contexts (``official_reference.stand_in_gemma_output`` through the
official embeddings processor, sent to the fleet as tensors): ltx-core's Gemma needs transformers 4.
"""

from __future__ import annotations

import pytest

from mgpu_backend.ltx.schema import ModelSpec

from .fleet_harness import run_job
from .official_reference import assert_bitwise, assert_one_rank_run_is_official, fleet_latents
from .test_res2s_parity import NEGATIVE_PROMPT, PARAMS, reference_side, run_reference  # noqa: F401 - reference_side is a fixture

STAGE1 = {"width": PARAMS.width // 2, "height": PARAMS.height // 2, "num_frames": PARAMS.num_frames, "seed": PARAMS.seed,
          "steps": PARAMS.num_inference_steps}  # fmt: skip


@pytest.fixture(scope="module")
def bundle_version() -> str:
    """HQ runs LTX-2.3 only (the official layer has its parameters for no other version)."""
    return "2.3"


@pytest.fixture(scope="module")
def hq_spec(bundle) -> dict:
    """The tiny bundle's dev checkpoint, Gemma, upsampler and distilled LoRA; the per-stage strengths left to the spec's defaults."""
    return ModelSpec(bundle.checkpoint_path, bundle.gemma_root, spatial_upsampler_path=bundle.spatial_upsampler_path,
                     distilled_lora=bundle.distilled_lora_path).to_wire()  # fmt: skip


@pytest.fixture(scope="module")
def reference(reference_side) -> dict:
    return run_reference(reference_side, image_path=None)


def context_tensors(reference: dict) -> dict:
    positive, negative = reference["contexts"]
    return {
        "positive_video_context": positive.video_encoding, "positive_audio_context": positive.audio_encoding,
        "negative_video_context": negative.video_encoding, "negative_audio_context": negative.audio_encoding,
    }  # fmt: skip


def run_hq_job(fleet, spec: dict, reference: dict, plan: str = "auto", logs: list | None = None) -> dict:
    contexts = context_tensors(reference)
    on_log = {} if logs is None else {"on_log": logs.append}
    stage1 = run_job(fleet, "sample", {"spec": spec, "pipeline": "hq", "parallel": plan, **STAGE1}, contexts, **on_log)
    positive = {name: tensor for name, tensor in contexts.items() if name.startswith("positive")}
    upscaled = run_job(fleet, "upscale", {"spec": spec, "pipeline": "hq", "seed": PARAMS.seed}, {**stage1.tensors, **positive}, **on_log)
    return {"stage1": stage1, "upscaled": upscaled}


@pytest.fixture(scope="module")
def one_rank(fleet_of, hq_spec, reference) -> dict:
    logs = []
    run = run_hq_job(fleet_of(1), hq_spec, reference, logs=logs)
    return {**run, "logs": logs}


def test_hq_fleet_job_at_one_rank_matches_the_official_hq_pipeline_bitwise_bf16(one_rank, reference):
    ours = fleet_latents(one_rank)
    assert tuple(ours["stage1_video"].shape) == (1, 128, 2, 2, 3) and tuple(ours["stage2_video"].shape) == (1, 128, 2, 4, 6)
    assert_one_rank_run_is_official(one_rank, reference, "fleet HQ at one rank")


def test_hq_stage1_strength_comes_from_the_spec(fleet_of, hq_spec, reference, one_rank):
    """The stage-1 LoRA set reads the spec's ``distilled_lora_strength_stage_1``: another strength, another latent."""
    stronger = {**hq_spec, "distilled_lora_strength_stage_1": 0.5}
    stage1 = run_job(fleet_of(1), "sample", {"spec": stronger, "pipeline": "hq", **STAGE1}, context_tensors(reference))
    difference = (stage1.tensors["video_latent"] - one_rank["stage1"].tensors["video_latent"]).abs().max().item()
    assert difference > 0.01, difference


def test_hq_fleet_job_at_two_ranks_under_sp_and_guidance_equals_one_rank_bitwise_bf16(fleet, hq_spec, reference, one_rank):
    expected = fleet_latents(one_rank)
    layouts = {}
    for plan in ("sp", "guidance"):  # the second stage 1 runs after the first job's swap to the stage-2 strength
        run = run_hq_job(fleet, hq_spec, reference, plan)
        layouts[plan] = (run["stage1"].fields["guidance_groups"], run["stage1"].fields["sp_degree"])
        assert (run["upscaled"].fields["stage2_parallel"], run["upscaled"].fields["sp_degree"]) == ("sp", 2), run["upscaled"].fields["plan"]
        assert "the hq recipe's stage 2 denoises the audio too" in run["upscaled"].fields["plan"]
        for name, tensor in fleet_latents(run).items():
            assert_bitwise(tensor, expected[name], f"fleet HQ at two ranks under {plan}: {name}")
    assert layouts == {"sp": (1, 2), "guidance": (2, 1)}


def test_hq_on_an_ltx_2_0_checkpoint_is_refused_before_any_work(fleet_of, tiny_bundle_of, reference):
    from mgpu_backend.fleet.client import FleetError

    old = tiny_bundle_of("2.0")
    spec = ModelSpec(old.checkpoint_path, old.gemma_root, spatial_upsampler_path=old.spatial_upsampler_path, distilled_lora=old.distilled_lora_path).to_wire()
    with pytest.raises(FleetError) as raised:
        run_job(fleet_of(1), "sample", {"spec": spec, "pipeline": "hq", **STAGE1}, context_tensors(reference))
    assert raised.value.kind == "input_error"
    assert "the hq pipeline runs LTX-2.3 only (ltx-pipelines has its parameters for no other version), got an LTX-2.0 checkpoint" in str(raised.value)
