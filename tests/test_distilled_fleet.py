"""The distilled recipe through a real fleet (server process, sockets, gloo CPU ranks), on the tiny
bundle of each model version (LTX-2.0 in the 19B layout, LTX-2.3 in the 22B layout).

Stage 1 at 2 and 4 ranks under every plan (sp, guidance, hybrid), and sequence parallel in stage 2,
must equal the one-process stages bitwise in bf16, audio included (the SP stage 2 denoises it, as
the official pipeline does; the one-process stages equal ``DistilledPipeline``, see
``test_distilled_parity``). A distilled step runs one pass, so the planner makes stage 1 one SP
group over the whole fleet whatever the mode asks, except hybrid, which keeps its groups and leaves
all but one idle. TDP in stage 2 returns the stage-1 audio unchanged and says so in its result fields.
"""

from __future__ import annotations

import pytest
import torch

from mgpu_backend.bundles import tiny
from mgpu_backend.fleet.client import FleetError
from mgpu_backend.ltx.decode import decode_video
from mgpu_backend.ltx.jobs import stage1_params
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.ltx.schema import STAGE_2_SIGMAS, SampleRequest
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import encode_prompts

from .fleet_harness import run_job
from .official_reference import first_frame_image, version_id
from .helpers import decoder_generator

PROMPT = "a paper boat drifts down a rain-filled gutter"


@pytest.fixture(scope="module", params=tiny.VERSIONS, ids=version_id)
def bundle_version(request):
    return request.param


@pytest.fixture(scope="module")
def spec(bundle) -> dict:
    return ModelSpec(checkpoint_path=bundle.distilled_checkpoint_path, gemma_root=bundle.gemma_root, spatial_upsampler_path=bundle.spatial_upsampler_path).to_wire()


@pytest.fixture(scope="module")
def fleet_of_four(fleet_of):
    return fleet_of(4)


run = run_job


def sample_args(spec, **overrides):
    return {"spec": spec, "pipeline": "distilled", "width": 96, "height": 64, "num_frames": 9, "seed": 7, **overrides}


def positive_tensors(encoded):
    return {"positive_video_context": encoded.tensors["video_context_0"], "positive_audio_context": encoded.tensors["audio_context_0"]}


STAGE2 = GenerationParams(height=128, width=192, num_frames=9, seed=7, two_stage=True)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> torch.Tensor:
    return first_frame_image(tmp_path_factory.mktemp("image"))[1]


@pytest.fixture(scope="module")
def one_process(spec, image) -> dict:
    """The distilled recipe's stages in this process, one thread (like a CPU rank), on the same files."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loader = ModelLoader(ModelSpec.from_wire(spec), "cpu", torch.bfloat16)
        (context,) = encode_prompts(loader, [PROMPT])
        params = stage1_params(SampleRequest.from_wire(sample_args(spec)), layer_count=2)
        video, audio = sample_stage1(loader, params, context, None)
        image_video, image_audio = sample_stage1(loader, params, context, None, image=image)
        video2, audio2 = refine_stage2(loader, STAGE2, upsample_video(loader, video), audio, context, sigmas=STAGE_2_SIGMAS, lora_set="none", denoise_audio=True)
        frames = decode_video(loader, video2, generator=decoder_generator(STAGE2, loader.device, loader.dtype))
    finally:
        torch.set_num_threads(threads)
    return {
        "stage-1 video": video, "stage-1 audio": audio, "stage-2 video": video2, "stage-2 audio": audio2, "decoded frames": frames,
        "image-to-video stage-1 video": image_video, "image-to-video stage-1 audio": image_audio,
    }  # fmt: skip


def assert_equal(fleet_tensor: torch.Tensor, ours: torch.Tensor, what: str) -> None:
    assert fleet_tensor.shape == ours.shape, f"{what}: {tuple(fleet_tensor.shape)} != {tuple(ours.shape)}"
    diff = (ours.float() - fleet_tensor.float()).abs().max().item()
    assert diff == 0.0, f"{what} differs from the one-process stages by {diff}"


def test_distilled_job_at_two_ranks_under_sp_equals_the_one_process_stages_bf16(fleet, spec, one_process):
    logs = []
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT]})
    positive = positive_tensors(encoded)
    stage1 = run(fleet, "sample", sample_args(spec), positive, on_log=logs.append)  # no negative prompt: none is needed
    upscaled = run(fleet, "upscale", {"spec": spec, "pipeline": "distilled", "seed": 7, "parallel": "sp"}, {**stage1.tensors, **positive}, on_log=logs.append)
    frames = run(fleet, "decode", {"spec": spec, "seed": 7}, upscaled.tensors)

    assert (stage1.fields["sp_degree"], stage1.fields["guidance_groups"]) == (2, 1)
    assert "guidance groups do not apply: one pass per step" in stage1.fields["plan"]
    assert (upscaled.fields["stage2_parallel"], upscaled.fields["sp_degree"]) == ("sp", 2)
    assert upscaled.fields["audio"].startswith("denoised in stage 2")
    assert any("stage 2: sequence parallel: video tokens split 2 ways" in line for line in logs), logs
    for name, fleet_tensor in (
        ("stage-1 video", stage1.tensors["video_latent"]),
        ("stage-1 audio", stage1.tensors["audio_latent"]),
        ("stage-2 video", upscaled.tensors["video_latent"]),
        ("stage-2 audio", upscaled.tensors["audio_latent"]),
        ("decoded frames", frames.tensors["frames"]),
    ):
        assert_equal(fleet_tensor, one_process[name], f"{name} at 2 ranks under SP")
    assert (one_process["stage-2 audio"] - one_process["stage-1 audio"]).abs().max().item() > 0.05, "the SP stage 2 must return its own, re-denoised audio"


def test_distilled_stage1_at_two_ranks_under_the_guidance_plan_is_sp_and_hybrid_is_refused(fleet, spec, one_process):
    positive = positive_tensors(run(fleet, "encode", {"spec": spec, "prompts": [PROMPT]}))
    stage1 = run(fleet, "sample", sample_args(spec, parallel="guidance"), positive)
    assert (stage1.fields["guidance_groups"], stage1.fields["sp_degree"]) == (1, 2), stage1.fields["plan"]
    assert_equal(stage1.tensors["video_latent"], one_process["stage-1 video"], "stage-1 video at 2 ranks under guidance")
    assert_equal(stage1.tensors["audio_latent"], one_process["stage-1 audio"], "stage-1 audio at 2 ranks under guidance")
    with pytest.raises(FleetError, match="hybrid mode needs at least 2 groups of at least 2 ranks; world size 2") as info:
        run(fleet, "sample", sample_args(spec, parallel="hybrid"), positive)
    assert info.value.kind == "input_error"


def test_distilled_job_at_four_ranks_under_sp_guidance_and_hybrid_equals_the_one_process_stages_bf16(fleet_of_four, spec, one_process, image):
    """3 video tokens per rank at SP degree 4: the shards where CPU attention rounded a short query
    call differently, before the video-query cross-attentions ran head-parallel."""
    positive = positive_tensors(run(fleet_of_four, "encode", {"spec": spec, "prompts": [PROMPT]}))
    layouts = {}
    for plan in ("sp", "guidance", "hybrid"):
        stage1 = run(fleet_of_four, "sample", sample_args(spec, parallel=plan), positive)
        layouts[plan] = (stage1.fields["guidance_groups"], stage1.fields["sp_degree"])
        assert_equal(stage1.tensors["video_latent"], one_process["stage-1 video"], f"stage-1 video at 4 ranks under {plan}")
        assert_equal(stage1.tensors["audio_latent"], one_process["stage-1 audio"], f"stage-1 audio at 4 ranks under {plan}")
    assert layouts == {"sp": (1, 4), "guidance": (1, 4), "hybrid": (2, 2)}
    upscaled = run(fleet_of_four, "upscale", {"spec": spec, "pipeline": "distilled", "seed": 7, "parallel": "sp"}, {**stage1.tensors, **positive})
    assert (upscaled.fields["stage2_parallel"], upscaled.fields["sp_degree"]) == ("sp", 4)
    assert_equal(upscaled.tensors["video_latent"], one_process["stage-2 video"], "stage-2 video at 4 ranks under SP")
    assert_equal(upscaled.tensors["audio_latent"], one_process["stage-2 audio"], "stage-2 audio at 4 ranks under SP")
    # Image-to-video: the clean first frame's zero timesteps and the text mask under the same exchanges.
    conditioned = run(fleet_of_four, "sample", sample_args(spec, parallel="sp"), {**positive, "image": image})
    for name in ("video", "audio"):
        assert_equal(conditioned.tensors[f"{name}_latent"], one_process[f"image-to-video stage-1 {name}"], f"image-to-video stage-1 {name} at 4 ranks under SP")
    assert (one_process["image-to-video stage-1 video"] - one_process["stage-1 video"]).abs().max().item() > 0.05, "the image must condition the video"


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
    args = dict(args)  # the parameter's dict serves every version
    job_spec = {**spec, "distilled_lora": bundle.distilled_lora_path} if args.pop("spec_lora", False) else spec
    with pytest.raises(FleetError, match=message) as info:
        run(fleet, "sample", sample_args(job_spec, **args), positive_tensors(encoded))
    assert info.value.kind == "input_error"
