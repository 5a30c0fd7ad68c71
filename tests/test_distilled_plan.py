"""The planner and the request schema for the distilled recipe (pure functions, no processes)."""

from __future__ import annotations

import pytest

from mgpu_backend.ltx.schema import (
    DISTILLED_SIGMAS,
    EMBEDDED_TINY,
    EMBEDDED_TINY_DISTILLED,
    NO_GUIDANCE,
    STAGE_2_SIGMAS,
    TDP_UPSCALE_SIGMAS,
    ModelSpec,
    RequestError,
    SampleRequest,
    UpscaleRequest,
    defaults_for,
)
from mgpu_backend.parallel.guidance_parallel import STAGE2_SP_MIN_SHARD_TOKENS, plan_stage1, plan_stage2

SPEC = ModelSpec(checkpoint_path="/models/ltx-2-19b-distilled.safetensors", gemma_root="/models/gemma")
# The official 1024x1536 x 121-frame output: 16 x 32 x 48 latent cells in stage 2.
FULL_SIZE_STAGE2_TOKENS = 16 * 32 * 48


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_one_pass_per_step_plans_one_sp_group_over_the_whole_fleet_and_says_why(world_size):
    for video_tokens in (12, 6144):  # launch-bound tiny shards and the official stage-1 size alike
        plan = plan_stage1(world_size, video_tokens, ["conditional"])
        assert (plan.guidance_groups, plan.sp_degree) == (1, world_size)
        assert "guidance groups do not apply: one pass per step" in plan.reason


def test_four_passes_still_plan_guidance_groups_where_they_pay():
    plan = plan_stage1(8, 6144, ["conditional", "unconditional", "perturbed", "isolated"])
    assert plan.guidance_groups > 1 and "one pass per step" not in plan.reason


def test_distilled_stage2_takes_sp_above_the_launch_bound_shard_and_tdp_below():
    at_8 = plan_stage2(8, FULL_SIZE_STAGE2_TOKENS, "distilled")
    assert (at_8.technique, at_8.sp_degree, at_8.denoises_audio) == ("sp", 8, True)
    assert f"{FULL_SIZE_STAGE2_TOKENS // 8} tokens per rank, at or above the launch-bound" in at_8.reason
    assert "audio denoised in stage 2" in at_8.reason
    small = plan_stage2(8, 8 * STAGE2_SP_MIN_SHARD_TOKENS - 8, "distilled")
    assert (small.technique, small.sp_degree, small.denoises_audio) == ("tdp", 1, False)
    assert "below the launch-bound" in small.reason and "audio frozen" in small.reason
    exactly = plan_stage2(4, 4 * STAGE2_SP_MIN_SHARD_TOKENS, "distilled")
    assert exactly.technique == "sp"


def test_stage2_one_rank_runs_the_whole_latent_and_the_two_stage_graph_keeps_tdp():
    one = plan_stage2(1, 48, "distilled")
    assert (one.technique, one.sp_degree, one.denoises_audio) == ("sp", 1, True)
    two_stage = plan_stage2(8, FULL_SIZE_STAGE2_TOKENS, "two-stage")
    assert two_stage.technique == "tdp" and "TDP Upscale" in two_stage.reason
    assert plan_stage2(8, FULL_SIZE_STAGE2_TOKENS, "distilled", tiles_given=True).technique == "tdp"
    assert plan_stage2(2, 48, "two-stage", "sp").technique == "sp"
    # 3 ranks do not divide 32 heads: no SP, whatever the size.
    assert plan_stage2(3, FULL_SIZE_STAGE2_TOKENS, "distilled").technique == "tdp"
    with pytest.raises(ValueError, match="SP degree"):
        plan_stage2(3, FULL_SIZE_STAGE2_TOKENS, "distilled", "sp")


def test_distilled_requests_take_the_recipe_defaults():
    official = defaults_for("2.0", "distilled")
    request = SampleRequest.from_wire({"spec": SPEC.to_wire(), "pipeline": "distilled"})
    assert request.steps == 8 == len(DISTILLED_SIGMAS) - 1 and official.stage1_sigmas == DISTILLED_SIGMAS
    for guidance in (request.video_guidance, request.audio_guidance):
        assert (guidance.cfg_scale, guidance.stg_scale, guidance.modality_scale, guidance.rescale_scale) == (1.0, 0.0, 1.0, 0.0)
        assert guidance.blocks_for(48, NO_GUIDANCE) == ()
    upscale = UpscaleRequest.from_wire({"spec": SPEC.to_wire(), "pipeline": "distilled"})
    assert upscale.sigmas == STAGE_2_SIGMAS and upscale.parallel == "auto"
    assert UpscaleRequest.from_wire({"spec": SPEC.to_wire()}).sigmas == TDP_UPSCALE_SIGMAS
    assert UpscaleRequest(spec=SPEC, pipeline="distilled").sigmas == STAGE_2_SIGMAS


def test_distilled_requests_that_cannot_run_say_what_to_change():
    with pytest.raises(RequestError, match="steps must be 8, got 20; leave steps out"):
        SampleRequest.from_wire({"spec": SPEC.to_wire(), "pipeline": "distilled", "steps": 20})
    with pytest.raises(RequestError, match="tiles \\[2, 2\\] apply to tiled data parallel only"):
        UpscaleRequest.from_wire({"spec": SPEC.to_wire(), "pipeline": "distilled", "parallel": "sp", "tiles": [2, 2]})
    with pytest.raises(RequestError, match="parallel must be one of auto, sp, tdp"):
        UpscaleRequest.from_wire({"spec": SPEC.to_wire(), "parallel": "guidance"})


def test_the_embedded_distilled_spec_names_no_lora():
    spec = ModelSpec.embedded_tiny_for("distilled")
    assert spec.distilled_lora is None and spec.checkpoint_path == EMBEDDED_TINY_DISTILLED and spec.spatial_upsampler_path == EMBEDDED_TINY
    assert spec.names_embedded
    assert ModelSpec.embedded_tiny_for("two-stage") == ModelSpec.embedded_tiny()
