"""First/last-frame (keyframe) image conditioning and image strength through a real fleet (server process,
sockets, gloo CPU ranks) on the tiny LTX-2.0 bundle, against the official ltx-pipelines 1.0.0 runners.

- The ``keyframes`` recipe: a first image (strength 0.9) and a last image (at the last frame) appended to
  the video as guiding latents in both stages, the audio re-denoised in stage 2, as
  ``KeyframeInterpolationPipeline``: the fleet's sample and upscale jobs at one rank, and at two ranks
  (sequence parallel, guidance parallel), equal it bitwise (stage-1 and stage-2 video and audio latents,
  bf16), and so do the decoded frames, whose decoder noise follows both stages' longer draws
  (``guiding_frames`` of the decode job).
- The ``two-stage`` recipe with a first image at strength 0.7 (it replaces the first latent frame) and a
  last image (a guiding latent), as ``TI2VidTwoStagesPipeline`` given the same images: stage 1 bitwise,
  and stage 2 at one rank (untiled, the audio denoised, since tiles cannot hold a guiding latent) too.
- Tiled data parallel with a guiding latent is refused in words.

Each fleet is compared with the official runner at its ranks' torch thread count (``rank.cpu_threads``):
both resize the image with torch's float32 bilinear interpolation, whose last bit depends on how the
threads split it, and a bf16 rounding of the resized pixels can flip with it (seen at the tiny bundle's
128x192 stage 2), and on a CPU with AMX torch's bf16 matmuls round by the thread count too where the
output has fewer blocks than threads (seen in LTX-2.3's layers; this file runs the LTX-2.0 bundle).

Both sides get the same text contexts (``official_reference.stand_in_gemma_output`` through the official
embeddings processor, sent to the fleet as tensors): ltx-core's Gemma needs transformers 4.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps
from PIL import Image

from mgpu_backend.fleet.client import FleetError
from mgpu_backend.fleet.rank import cpu_threads
from mgpu_backend.ltx.schema import STAGE_2_SIGMAS

from . import official_reference
from .fleet_harness import run_job
from .official_reference import assert_bitwise, assert_one_rank_run_is_official, first_frame_image, fleet_latents, reference_uint8_frames
from .test_hq_fleet import context_tensors
from .test_pipeline_parity import NEGATIVE_PROMPT, PARAMS, PROMPT

STAGE1 = {"width": PARAMS.width // 2, "height": PARAMS.height // 2, "num_frames": PARAMS.num_frames, "seed": PARAMS.seed,
          "steps": PARAMS.num_inference_steps}  # fmt: skip
GUIDANCE = {
    f"{modality}_guidance": {"cfg_scale": guider.cfg_scale, "stg_scale": guider.stg_scale, "rescale_scale": guider.rescale_scale,
                             "modality_scale": guider.modality_scale, "skip_step": guider.skip_step, "stg_blocks": list(guider.stg_blocks)}
    for modality, guider in (("video", PARAMS.video_guider), ("audio", PARAMS.audio_guider))
}  # fmt: skip
LAST_FRAME = PARAMS.num_frames - 1
KEYFRAME_STRENGTHS = (0.9, 1.0)  # first, last
TWO_STAGE_STRENGTHS = (0.7, 1.0)


def last_frame_image(directory) -> tuple[str, torch.Tensor]:
    """Another small PNG, of yet another aspect ratio, for the last frame."""
    rows, cols = np.meshgrid(np.linspace(0, 1, 40), np.linspace(0, 1, 72), indexing="ij")
    pixels = (np.stack([1 - rows, (rows + cols) / 2, 1 - cols], axis=-1) * 255).round().astype(np.uint8)
    path = directory / "last_frame.png"
    Image.fromarray(pixels).save(path)
    return str(path), torch.from_numpy(np.array(Image.open(path))).float() / 255.0


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict:
    directory = tmp_path_factory.mktemp("keyframe-images")
    (first_path, first), (last_path, last) = first_frame_image(directory), last_frame_image(directory)
    return {"first_path": first_path, "first": first, "last_path": last_path, "last": last}


def official(bundle, runner: str):
    def build(module):
        return getattr(module, runner)(
            checkpoint_path=bundle.checkpoint_path,
            distilled_lora=[LoraPathStrengthAndSDOps(bundle.distilled_lora_path, 1.0, LTXV_LORA_COMFY_RENAMING_MAP)],
            spatial_upsampler_path=bundle.spatial_upsampler_path, gemma_root=bundle.gemma_root, loras=[], device=torch.device("cpu"),
        )  # fmt: skip

    return build


def reference_run(bundle, module_name: str, runner: str, images: dict, strengths: tuple[float, float], world_size: int) -> dict:
    """The official runner with the first and last images, at the thread count of a fleet of ``world_size`` CPU ranks."""
    first_strength, last_strength = strengths
    conditioning = ((images["first_path"], 0, first_strength), (images["last_path"], LAST_FRAME, last_strength))
    for side in official_reference.reference_side(bundle, module_name, official(bundle, runner)):
        torch.set_num_threads(cpu_threads(world_size))
        try:
            return official_reference.run_reference(side, None, conditioning, **official_reference.guided_call(PARAMS, PROMPT, NEGATIVE_PROMPT))
        finally:
            torch.set_num_threads(1)


def references_of(bundle, images, module_name: str, runner: str, strengths: tuple[float, float]):
    """``reference_of(world_size)``: the official runner's run at that fleet's thread count, made once per count."""
    made = {}

    def reference_of(world_size: int) -> dict:
        if world_size not in made:
            made[world_size] = reference_run(bundle, module_name, runner, images, strengths, world_size)
        return made[world_size]

    return reference_of


@pytest.fixture(scope="module")
def keyframes_reference_of(bundle, images):
    return references_of(bundle, images, "keyframe_interpolation", "KeyframeInterpolationPipeline", KEYFRAME_STRENGTHS)


@pytest.fixture(scope="module")
def keyframes_reference(keyframes_reference_of) -> dict:
    return keyframes_reference_of(1)


@pytest.fixture(scope="module")
def two_stage_reference_of(bundle, images):
    return references_of(bundle, images, "ti2vid_two_stages", "TI2VidTwoStagesPipeline", TWO_STAGE_STRENGTHS)


@pytest.fixture(scope="module")
def two_stage_reference(two_stage_reference_of) -> dict:
    return two_stage_reference_of(1)


def run_fleet(fleet, spec: dict, pipeline: str, reference: dict, images: dict, strengths: tuple[float, float], plan: str = "auto",
              upscale: dict | None = None) -> dict:  # fmt: skip
    first_strength, last_strength = strengths
    contexts = context_tensors(reference)
    conditioning = {"image": images["first"], "last_image": images["last"]}
    strength_fields = {"image_strength": first_strength, "last_image_strength": last_strength}
    stage1 = run_job(fleet, "sample", {"spec": spec, "pipeline": pipeline, "parallel": plan, **STAGE1, **GUIDANCE, **strength_fields},
                     {**contexts, **conditioning})  # fmt: skip
    positive = {name: tensor for name, tensor in contexts.items() if name.startswith("positive")}
    upscaled = run_job(fleet, "upscale", {"spec": spec, "pipeline": pipeline, "seed": PARAMS.seed, **strength_fields, **(upscale or {})},
                       {**stage1.tensors, **positive, **conditioning})  # fmt: skip
    return {"stage1": stage1, "upscaled": upscaled}


@pytest.fixture(scope="module")
def keyframes_one_rank(fleet_of, spec, keyframes_reference, images) -> dict:
    return run_fleet(fleet_of(1), spec, "keyframes", keyframes_reference, images, KEYFRAME_STRENGTHS)


def test_keyframes_fleet_at_one_rank_matches_keyframe_interpolation_pipeline_bitwise_bf16(keyframes_one_rank, keyframes_reference):
    ours = fleet_latents(keyframes_one_rank)
    assert tuple(ours["stage1_video"].shape) == (1, 128, 2, 2, 3) and tuple(ours["stage2_video"].shape) == (1, 128, 2, 4, 6)
    assert_one_rank_run_is_official(keyframes_one_rank, keyframes_reference, "fleet keyframes at one rank")


def test_keyframes_decode_draws_its_noise_after_both_stages_guiding_latents(fleet_of, spec, keyframes_one_rank, keyframes_reference):
    decoded = {
        guiding: run_job(fleet_of(1), "decode", {"spec": spec, "seed": PARAMS.seed, "guiding_frames": guiding}, keyframes_one_rank["upscaled"].tensors)
        for guiding in (2, 0)
    }
    assert_bitwise(reference_uint8_frames(decoded[2].tensors["frames"]), keyframes_reference["frames"], "decoded frames (uint8)")
    # The tiny LTX-2.0 decoder adds seeded noise: a decoder that forgot the guiding latents' draws decodes other frames.
    assert (decoded[0].tensors["frames"] - decoded[2].tensors["frames"]).abs().max().item() > 1e-3


@pytest.mark.slow
def test_keyframes_fleet_at_two_ranks_under_sp_and_guidance_matches_keyframe_interpolation_pipeline_bitwise_bf16(fleet, spec, keyframes_reference_of, images):
    expected = keyframes_reference_of(2)
    for plan in ("sp", "guidance"):
        run = run_fleet(fleet, spec, "keyframes", expected, images, KEYFRAME_STRENGTHS, plan)
        assert (run["upscaled"].fields["stage2_parallel"], run["upscaled"].fields["sp_degree"]) == ("sp", 2), run["upscaled"].fields["plan"]
        assert "2 image latents appended to the video, which tiles cannot hold" in run["upscaled"].fields["plan"]
        for name, tensor in fleet_latents(run).items():
            assert_bitwise(tensor, expected[name], f"fleet keyframes at two ranks under {plan}: {name}")


def test_two_stage_with_first_image_at_0_7_and_a_last_image_matches_ti2vid_two_stages_bitwise_bf16(fleet_of, spec, two_stage_reference, images):
    run = run_fleet(fleet_of(1), spec, "two-stage", two_stage_reference, images, TWO_STAGE_STRENGTHS, upscale={"sigmas": list(STAGE_2_SIGMAS)})
    upscaled = run["upscaled"]
    # The last image's guiding latent rules TDP out: the whole latent on the one rank, the audio denoised as the official runner.
    assert (upscaled.fields["stage2_parallel"], upscaled.fields["sp_degree"], upscaled.fields["tiling"]) == ("sp", 1, "untiled")
    assert "1 image latent appended to the video" in upscaled.fields["plan"]
    for name, tensor in fleet_latents(run).items():
        assert_bitwise(tensor, two_stage_reference[name], f"fleet two-stage with first and last images: {name}")


@pytest.mark.slow
def test_two_stage_with_a_last_image_at_four_ranks_sp_pads_the_uneven_stage_1_tokens_and_matches_the_official_runner(fleet_of, spec, two_stage_reference_of, images):
    """Stage 1 holds 12 video tokens and the last image's 6: 18 tokens over 4 ranks, padded to 20 and cut off again."""
    expected = two_stage_reference_of(4)
    run = run_fleet(fleet_of(4), spec, "two-stage", expected, images, TWO_STAGE_STRENGTHS, "sp", upscale={"sigmas": list(STAGE_2_SIGMAS)})
    assert (run["stage1"].fields["sp_degree"], run["upscaled"].fields["stage2_parallel"], run["upscaled"].fields["sp_degree"]) == (4, "sp", 4)
    for name, tensor in fleet_latents(run).items():
        assert_bitwise(tensor, expected[name], f"fleet two-stage with first and last images at four ranks: {name}")


def test_tiled_stage_2_with_a_last_image_is_refused_in_words(fleet_of, spec, images):
    latent = {"video_latent": torch.zeros(1, 128, 2, 2, 3), "audio_latent": torch.zeros(1, 8, 9, 16)}
    contexts = {"positive_video_context": torch.zeros(1, 128, 32), "positive_audio_context": torch.zeros(1, 128, 32)}
    for extra in ({"parallel": "tdp"}, {"tiles": [1, 2]}):
        with pytest.raises(FleetError) as raised:
            run_job(fleet_of(1), "upscale", {"spec": spec, "pipeline": "two-stage", **extra}, {**latent, **contexts, "last_image": images["last"]})
        assert raised.value.kind == "input_error"
        assert (
            "stage 2 cannot run tiled data parallel with 1 image latent appended to the video (the last image's, or every image's under "
            "the keyframes conditioning): no tile can hold them; leave the tiles out and use parallel 'auto' or 'sp'"
        ) in str(raised.value)


def test_a_strength_without_its_image_is_refused_by_the_sample_job(fleet_of, spec, images):
    with pytest.raises(FleetError) as raised:
        run_job(fleet_of(1), "sample", {"spec": spec, **STAGE1, "last_image_strength": 0.5}, {"image": images["first"]})
    assert raised.value.kind == "input_error"
    assert "last_image_strength is 0.5 but no last_image was given: it is the strength of the last frame image; give the last_image too, or leave last_image_strength at 1.0" in str(raised.value)
