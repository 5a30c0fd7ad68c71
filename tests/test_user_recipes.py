"""The recipe ComfyUI's LTX-2.3 templates run, on the pack's own jobs: the dev checkpoint with the
distilled LoRA at a chosen strength in BOTH stages (the template: 0.5), CFG 1 (one conditional pass
per step), the 8 distilled sigmas given as the stage-1 schedule (ComfyUI's ManualSigmas; SP
Sampler's ``sigmas`` input, the CLI's ``--stage1-sigmas``), then stage 2 over the official tail.

That is what ltx-pipelines 1.0.0's ``DistilledPipeline`` computes when it is handed the dev
checkpoint and the distilled LoRA as a user LoRA at that strength: 8 distilled sigmas with one
positive-only pass per step, the 2x upsample, the 3-step tail on the same transformer with the audio
re-denoised. So the two-stage recipe run with those settings through a real fleet (server process,
sockets, gloo CPU ranks) must equal that official run bitwise at one rank (stage-1 and stage-2
video and audio, bf16), and two ranks must equal one. Both sides get the same text contexts
(``official_reference.stand_in_gemma_output``); the tiny LTX-2.3 bundle's dev checkpoint and LoRA.
"""

from __future__ import annotations

import pytest
import torch

from mgpu_backend.fleet.client import FleetError
from mgpu_backend.fleet.rank import cpu_threads
from mgpu_backend.ltx.schema import DISTILLED_SIGMAS, STAGE_2_SIGMAS, ModelSpec

from . import official_reference
from .fleet_harness import run_job
from .official_reference import assert_bitwise, assert_one_rank_run_is_official, first_frame_image, fleet_latents

PROMPT = "A lighthouse keeper climbs the spiral stairs at dusk, wind howling outside."
HEIGHT, WIDTH, FRAMES, FRAME_RATE, SEED = 128, 192, 9, 25.0, 21
LORA_STRENGTH = 0.5  # ComfyUI's LTX-2.3 templates: LoraLoaderModelOnly at 0.5 on the dev checkpoint, one model for both samplers
CFG_1 = {"cfg_scale": 1.0, "stg_scale": 0.0, "rescale_scale": 0.0, "modality_scale": 1.0}  # CFGGuider at cfg 1: the conditional pass only


@pytest.fixture(scope="module")
def bundle_version() -> str:
    return "2.3"


@pytest.fixture(scope="module")
def template_spec(bundle) -> dict:
    """Two-stage files, the distilled LoRA chosen for stage 1 too, at the template's strength in both stages."""
    return ModelSpec(bundle.checkpoint_path, bundle.gemma_root, spatial_upsampler_path=bundle.spatial_upsampler_path, distilled_lora=bundle.distilled_lora_path,
                     distilled_lora_strength=LORA_STRENGTH, distilled_lora_strength_stage_1=LORA_STRENGTH).to_wire()  # fmt: skip


IMAGE_STRENGTH = 0.7  # the templates' LTXVImgToVideoInplace in stage 1 (DistilledPipeline holds one strength for both stages)


def run_distilled_reference(bundle, conditioning_images: tuple = ()) -> dict:
    """``DistilledPipeline`` on the dev checkpoint with the distilled LoRA at 0.5 as its user LoRA."""
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps

    def build(module):
        lora = LoraPathStrengthAndSDOps(bundle.distilled_lora_path, LORA_STRENGTH, LTXV_LORA_COMFY_RENAMING_MAP)
        return module.DistilledPipeline(distilled_checkpoint_path=bundle.checkpoint_path, gemma_root=bundle.gemma_root,
                                        spatial_upsampler_path=bundle.spatial_upsampler_path, loras=[lora], device=torch.device("cpu"))  # fmt: skip

    for side in official_reference.reference_side(bundle, "distilled", build):
        # At a one-rank fleet's thread count: the image's float32 resize rounds by it (tests/test_keyframes_fleet.py).
        torch.set_num_threads(cpu_threads(1))
        try:
            return official_reference.run_reference(side, None, conditioning_images, prompt=PROMPT, seed=SEED, height=HEIGHT, width=WIDTH,
                                                    num_frames=FRAMES, frame_rate=FRAME_RATE)  # fmt: skip
        finally:
            torch.set_num_threads(1)
    raise AssertionError("the official side yielded no pipeline")


@pytest.fixture(scope="module")
def reference(bundle) -> dict:
    return run_distilled_reference(bundle)


def positive_tensors(reference: dict) -> dict:
    (positive,) = reference["contexts"]
    return {"positive_video_context": positive.video_encoding, "positive_audio_context": positive.audio_encoding}


def run_template_recipe(fleet, spec: dict, reference: dict, image: torch.Tensor | None = None) -> dict:
    """SP Sampler and TDP Upscale as the template-settings workflow sets them (stage 2 sequence parallel: audio
    denoised); ``image``: the first frame at ``IMAGE_STRENGTH`` in both stages."""
    images = {} if image is None else {"image": image}
    strength = {} if image is None else {"image_strength": IMAGE_STRENGTH}
    sample = {"spec": spec, "pipeline": "two-stage", "width": WIDTH // 2, "height": HEIGHT // 2, "num_frames": FRAMES, "frame_rate": FRAME_RATE,
              "seed": SEED, "sigmas": list(DISTILLED_SIGMAS), "video_guidance": CFG_1, "audio_guidance": CFG_1, **strength}  # fmt: skip
    progress: list[dict] = []
    stage1 = run_job(fleet, "sample", sample, {**positive_tensors(reference), **images}, on_progress=progress.append)
    upscale = {"spec": spec, "pipeline": "two-stage", "frame_rate": FRAME_RATE, "seed": SEED, "sigmas": list(STAGE_2_SIGMAS), "parallel": "sp", **strength}
    upscaled = run_job(fleet, "upscale", upscale, {**stage1.tensors, **positive_tensors(reference), **images})
    return {"stage1": stage1, "upscaled": upscaled, "stage1_steps": max(event.get("total", 0) for event in progress if event.get("stage") == "stage1")}


@pytest.fixture(scope="module")
def one_rank(fleet_of, template_spec, reference) -> dict:
    return run_template_recipe(fleet_of(1), template_spec, reference)


def test_the_template_recipe_at_one_rank_is_the_official_distilled_runner_on_dev_plus_lora_bitwise(one_rank, reference):
    assert reference["sigmas"][0] == torch.tensor(DISTILLED_SIGMAS).tolist()  # float32, as both sides run them
    assert one_rank["stage1_steps"] == len(DISTILLED_SIGMAS) - 1
    assert_one_rank_run_is_official(one_rank, reference, "the template recipe at one rank")


def test_the_template_recipe_with_an_image_at_0_7_at_one_rank_is_the_official_distilled_runner_bitwise(fleet_of, template_spec, bundle, tmp_path):
    """Image to video as the template: the first frame at strength 0.7 (CRF 33, the official treatment)."""
    path, image = first_frame_image(tmp_path)
    reference = run_distilled_reference(bundle, ((path, 0, IMAGE_STRENGTH),))
    run = run_template_recipe(fleet_of(1), template_spec, reference, image=image)
    assert_one_rank_run_is_official(run, reference, f"the template recipe with an image at {IMAGE_STRENGTH}, one rank")


def test_the_stage1_lora_strength_and_sigmas_each_change_stage1(fleet_of, template_spec, reference, one_rank):
    """Without the chosen stage-1 strength the dev checkpoint runs clean in stage 1; another schedule, another latent."""
    clean = run_job(fleet_of(1), "sample", {"spec": {**template_spec, "distilled_lora_strength_stage_1": None}, "pipeline": "two-stage", "width": WIDTH // 2,
                                            "height": HEIGHT // 2, "num_frames": FRAMES, "frame_rate": FRAME_RATE, "seed": SEED, "sigmas": list(DISTILLED_SIGMAS),
                                            "video_guidance": CFG_1, "audio_guidance": CFG_1}, positive_tensors(reference))  # fmt: skip
    ours = one_rank["stage1"].tensors["video_latent"]
    assert (clean.tensors["video_latent"] - ours).abs().max().item() > 0.01
    progress: list[dict] = []
    other = run_job(fleet_of(1), "sample", {"spec": template_spec, "pipeline": "two-stage", "width": WIDTH // 2, "height": HEIGHT // 2, "num_frames": FRAMES,
                                            "frame_rate": FRAME_RATE, "seed": SEED, "sigmas": [1.0, 0.9, 0.6, 0.0], "video_guidance": CFG_1,
                                            "audio_guidance": CFG_1}, positive_tensors(reference), on_progress=progress.append)  # fmt: skip
    assert max(event.get("total", 0) for event in progress if event.get("stage") == "stage1") == 3
    assert (other.tensors["video_latent"] - ours).abs().max().item() > 0.01


@pytest.mark.slow
def test_the_template_recipe_at_two_ranks_equals_one_rank_bitwise(fleet, template_spec, reference, one_rank):
    """Text to video: no image, so no resize whose rounding follows the ranks' thread count."""
    run = run_template_recipe(fleet, template_spec, reference)
    assert (run["stage1"].fields["sp_degree"], run["upscaled"].fields["sp_degree"]) == (2, 2)
    expected = fleet_latents(one_rank)
    for name, tensor in fleet_latents(run).items():
        assert_bitwise(tensor, expected[name], f"the template recipe at two ranks: {name}")


def test_a_chosen_stage1_lora_without_its_file_is_refused_before_sampling(fleet_of, bundle, reference):
    spec = ModelSpec(bundle.checkpoint_path, bundle.gemma_root, spatial_upsampler_path=bundle.spatial_upsampler_path, distilled_lora_strength_stage_1=0.5).to_wire()
    with pytest.raises(FleetError) as raised:
        run_job(fleet_of(1), "sample", {"spec": spec, "pipeline": "two-stage", "width": WIDTH // 2, "height": HEIGHT // 2, "num_frames": FRAMES,
                                        "sigmas": list(DISTILLED_SIGMAS), "video_guidance": CFG_1, "audio_guidance": CFG_1}, positive_tensors(reference))  # fmt: skip
    assert raised.value.kind == "input_error"
    assert ("the two-stage pipeline's stage 1: the LoRA set 'distilled-stage-1-if-chosen' needs the distilled LoRA (at distilled_lora_strength_stage_1 0.5), "
            "but the model spec names none; set distilled_lora, or leave distilled_lora_strength_stage_1 unset") in str(raised.value)  # fmt: skip
