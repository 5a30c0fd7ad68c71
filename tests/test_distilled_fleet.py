"""The distilled recipe through a real fleet (server process, sockets, 2 gloo CPU ranks, tiny bundle).

Sequence parallel at SP degree 2 in both stages must equal the one-process stages bitwise in bf16,
audio included (the SP stage 2 denoises it, as the official pipeline does; the one-process stages
equal ``DistilledPipeline``, see ``test_distilled_parity``); TDP in stage 2 returns the stage-1
audio unchanged and says so in its result fields.
"""

from __future__ import annotations

import pytest
import torch

from mgpu_backend.bundles.tiny import make_tiny_bundle
from mgpu_backend.fleet.client import FleetError
from mgpu_backend.ltx.jobs import stage1_params
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.ltx.schema import STAGE_2_SIGMAS, SampleRequest
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import encode_prompts

from .fleet_harness import module_fleet, run_job

PROMPT = "a paper boat drifts down a rain-filled gutter"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return make_tiny_bundle(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def spec(bundle) -> dict:
    return ModelSpec(checkpoint_path=bundle.distilled_checkpoint_path, gemma_root=bundle.gemma_root, spatial_upsampler_path=bundle.spatial_upsampler_path).to_wire()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    yield from module_fleet(tmp_path_factory, "distilledfleet")


run = run_job


def sample_args(spec, **overrides):
    return {"spec": spec, "pipeline": "distilled", "width": 96, "height": 64, "num_frames": 9, "seed": 7, **overrides}


def positive_tensors(encoded):
    return {"positive_video_context": encoded.tensors["video_context_0"], "positive_audio_context": encoded.tensors["audio_context_0"]}


def test_distilled_job_at_two_ranks_under_sp_equals_the_one_process_stages_bf16(fleet, spec):
    logs = []
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT]})
    positive = positive_tensors(encoded)
    stage1 = run(fleet, "sample", sample_args(spec), positive, on_log=logs.append)  # no negative prompt: none is needed
    upscaled = run(fleet, "upscale", {"spec": spec, "pipeline": "distilled", "seed": 7, "parallel": "sp"}, {**stage1.tensors, **positive}, on_log=logs.append)
    frames = run(fleet, "decode", {"spec": spec, "seed": 7}, upscaled.tensors)

    loader = ModelLoader(ModelSpec.from_json(spec), "cpu", torch.bfloat16)
    (context,) = encode_prompts(loader, [PROMPT])
    params = stage1_params(SampleRequest.from_wire(sample_args(spec)), layer_count=2)
    video, audio = sample_stage1(loader, params, context, None)
    params2 = GenerationParams(height=128, width=192, num_frames=9, seed=7, two_stage=True)
    video2, audio2 = refine_stage2(loader, params2, upsample_video(loader, video), audio, context, sigmas=STAGE_2_SIGMAS, lora_set="none", denoise_audio=True)
    from mgpu_backend.ltx.decode import decode_video

    expected_frames = decode_video(loader, video2, generator=params2.decoder_generator(loader.device, loader.dtype))

    assert (stage1.fields["sp_degree"], stage1.fields["guidance_groups"]) == (2, 1)
    assert "guidance groups do not apply: one pass per step" in stage1.fields["plan"]
    assert (upscaled.fields["stage2_parallel"], upscaled.fields["sp_degree"]) == ("sp", 2)
    assert upscaled.fields["audio"].startswith("denoised in stage 2")
    assert any("stage 2: sequence parallel: video tokens split 2 ways" in line for line in logs), logs
    for name, ours, fleet_tensor in (
        ("stage-1 video", video, stage1.tensors["video_latent"]),
        ("stage-1 audio", audio, stage1.tensors["audio_latent"]),
        ("stage-2 video", video2, upscaled.tensors["video_latent"]),
        ("stage-2 audio", audio2, upscaled.tensors["audio_latent"]),
        ("decoded frames", expected_frames, frames.tensors["frames"]),
    ):
        diff = (ours.float() - fleet_tensor.float()).abs().max().item()
        assert diff == 0.0, f"{name} at 2 ranks under SP differs from the one-process stages by {diff}"
    assert (audio2 - audio).abs().max().item() > 0.05, "the SP stage 2 must return its own, re-denoised audio"


def test_distilled_stage2_planner_picks_tdp_for_small_shards_and_keeps_the_audio_frozen(fleet, spec):
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT]})
    positive = positive_tensors(encoded)
    stage1 = run(fleet, "sample", sample_args(spec), positive)
    upscaled = run(fleet, "upscale", {"spec": spec, "pipeline": "distilled", "seed": 7}, {**stage1.tensors, **positive})
    # 48 stage-2 tokens over 2 ranks is far below the launch-bound shard size: the planner takes TDP.
    assert upscaled.fields["stage2_parallel"] == "tdp" and upscaled.fields["tiling"] != "untiled"
    assert "below the launch-bound" in upscaled.fields["plan"]
    assert upscaled.fields["audio"].startswith("the stage-1 audio, unchanged")
    assert torch.equal(upscaled.tensors["audio_latent"], stage1.tensors["audio_latent"])
    assert tuple(upscaled.tensors["video_latent"].shape) == (1, 128, 2, 4, 6)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"steps": 4}, "the distilled pipeline runs its 8 fixed sigmas"),
        ({"spec_lora": True}, "the distilled pipeline runs the distilled checkpoint as it is, with no distilled LoRA"),
    ],
)
def test_distilled_requests_that_do_not_fit_the_recipe_are_refused_before_any_work(fleet, spec, bundle, args, message):
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT]})
    job_spec = {**spec, "distilled_lora": bundle.distilled_lora_path} if args.pop("spec_lora", False) else spec
    with pytest.raises(FleetError, match=message) as info:
        run(fleet, "sample", sample_args(job_spec, **args), positive_tensors(encoded))
    assert info.value.kind == "input_error"
