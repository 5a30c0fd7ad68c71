"""The distilled recipe against the official ``DistilledPipeline`` (ltx-pipelines 1.0.0), world size 1,
on the tiny bundle of each model version (LTX-2.0 in the 19B layout, LTX-2.3 in the 22B layout).

The reference runs in bfloat16 on the CPU, its intermediate latents captured by wrapping its
internals from the test side (``official_reference``: no-op CUDA calls, Gemma sized to the tiny
bundle, the same stand-in Gemma hidden states on both sides). Our stages run the distilled
request's schema defaults on the same files and seed: 8 distilled sigmas with one positive-only
pass per step, the 2x upsample, the 3-step tail on the same transformer with no LoRA.

``DistilledPipeline`` re-noises the stage-1 audio in stage 2 (``initial_audio_latent``, noise scale
the first stage-2 sigma), denoises it with the video and decodes that stage-2 audio. The distilled
job's untiled (or SP) stage 2 does the same, so everything is equal bitwise: stage-1 video and audio,
the upsampled latent, the stage-2 video and audio, the decoded frames and the decoded waveform.

Both sides load the tiny bundle's own distilled checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.decode import decode_audio, decode_video
from mgpu_backend.ltx.jobs import active_passes, stage1_params
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.ltx.schema import DISTILLED_SIGMAS, STAGE_2_SIGMAS, SampleRequest, UpscaleRequest
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import contexts_from_gemma

from . import official_reference
from .official_reference import assert_bitwise, first_frame_image, reference_uint8_frames, stand_in_gemma_output
from .helpers import decoder_generator, max_abs_diff

PROMPT = "A cat sleeping on a windowsill while rain runs down the glass."
HEIGHT, WIDTH, FRAMES, FRAME_RATE, SEED = 128, 192, 9, 24.0, 10


@pytest.fixture(scope="module", params=tiny.VERSIONS, ids=official_reference.version_id)
def bundle_version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def spec(bundle) -> ModelSpec:
    """The distilled recipe's model: a checkpoint, Gemma and the upsampler; no distilled LoRA."""
    return ModelSpec(checkpoint_path=bundle.distilled_checkpoint_path, gemma_root=bundle.gemma_root, spatial_upsampler_path=bundle.spatial_upsampler_path)


@pytest.fixture(scope="module")
def reference_side(bundle):
    def build(module):
        return module.DistilledPipeline(
            distilled_checkpoint_path=bundle.distilled_checkpoint_path, gemma_root=bundle.gemma_root,
            spatial_upsampler_path=bundle.spatial_upsampler_path, loras=[], device=torch.device("cpu"),
        )  # fmt: skip

    yield from official_reference.reference_side(bundle, "distilled", build)


def run_reference(reference_side, image_path: str | None) -> dict:
    return official_reference.run_reference(
        reference_side, image_path, prompt=PROMPT, seed=SEED, height=HEIGHT, width=WIDTH, num_frames=FRAMES, frame_rate=FRAME_RATE
    )


def run_ours(loader: ModelLoader, spec: ModelSpec, image: torch.Tensor | None) -> dict:
    """The distilled recipe as the fleet's sample and upscale jobs build it from their requests."""
    progress = []
    (positive,) = contexts_from_gemma(loader, [stand_in_gemma_output(PROMPT)])
    sample_request = SampleRequest(spec=spec, pipeline="distilled", width=WIDTH // 2, height=HEIGHT // 2, num_frames=FRAMES, seed=SEED)
    stage1 = stage1_params(sample_request, layer_count=2)
    passes = active_passes(stage1.video_guider, stage1.audio_guider)
    stage1_video, stage1_audio = sample_stage1(
        loader, stage1, positive, None, image=image, on_step=lambda step, total, video_x0: progress.append((1, step, total))
    )
    upsampled = upsample_video(loader, stage1_video)
    upscale_request = UpscaleRequest(spec=spec, pipeline="distilled", seed=SEED)
    stage2 = GenerationParams(height=HEIGHT, width=WIDTH, num_frames=FRAMES, frame_rate=FRAME_RATE, seed=SEED, two_stage=True)
    stage2_video, stage2_audio = refine_stage2(
        loader, stage2, upsampled, stage1_audio, positive, image=image, sigmas=upscale_request.sigmas, lora_set="none",
        denoise_audio=True, on_step=lambda step, total, video_x0: progress.append((2, step, total)),
    )  # fmt: skip
    frames = decode_video(loader, stage2_video, generator=decoder_generator(stage2, loader.device, loader.dtype))
    waveform, sample_rate = decode_audio(loader, stage2_audio)
    return {
        "version": sample_request.model_version, "context": positive, "passes": passes, "stage1_sigmas": stage1.stage1_sigmas,
        "stage2_sigmas": upscale_request.sigmas, "stage1_video": stage1_video, "stage1_audio": stage1_audio, "upsampled": upsampled,
        "stage2_video": stage2_video, "stage2_audio": stage2_audio, "frames": frames, "waveform": waveform, "sample_rate": sample_rate,
        "progress": progress,
    }  # fmt: skip


@pytest.fixture(scope="module")
def loader(spec):
    return ModelLoader(spec, device="cpu", dtype=torch.bfloat16)


def check_run(ours: dict, reference: dict, version: str) -> None:
    assert ours["version"] == version, "the request reads the model version from the distilled checkpoint"
    (reference_context,) = reference["contexts"]
    assert_bitwise(ours["context"].video_context, reference_context.video_encoding, "video text context")
    assert_bitwise(ours["context"].audio_context, reference_context.audio_encoding, "audio text context")
    assert ours["passes"] == ["conditional"], "the distilled recipe runs one positive-only pass per step"
    assert [list(ours["stage1_sigmas"]), list(ours["stage2_sigmas"])] == [list(DISTILLED_SIGMAS), list(STAGE_2_SIGMAS)]
    assert [[round(s, 6) for s in sigmas] for sigmas in reference["sigmas"]] == [[round(s, 6) for s in DISTILLED_SIGMAS], [round(s, 6) for s in STAGE_2_SIGMAS]]
    assert tuple(ours["stage1_video"].shape) == (1, 128, 2, 2, 3) and tuple(ours["stage1_audio"].shape) == (1, 8, 9, 16)
    assert_bitwise(ours["stage1_video"], reference["stage1_video"], "stage-1 video latent")
    assert_bitwise(ours["stage1_audio"], reference["stage1_audio"], "stage-1 audio latent")
    assert_bitwise(ours["upsampled"], reference["upsampled"], "upsampled video latent")
    assert tuple(ours["stage2_video"].shape) == (1, 128, 2, 4, 6)
    assert_bitwise(ours["stage2_video"], reference["stage2_video"], "stage-2 video latent")
    # The official stage 2 re-denoises the audio and decodes that; the untiled stage 2 of the distilled job does too.
    assert max_abs_diff(reference["stage2_audio"], reference["stage1_audio"]) > 0.05
    assert_bitwise(ours["stage2_audio"], reference["stage2_audio"], "stage-2 audio latent")
    assert_bitwise(reference_uint8_frames(ours["frames"]), reference["frames"], "decoded frames (uint8)")
    assert ours["sample_rate"] == reference["audio"].sampling_rate == official_reference.VOCODER_SAMPLE_RATE[version]
    assert_bitwise(ours["waveform"][0], reference["audio"].waveform, "decoded waveform (of the stage-2 audio)")
    assert ours["progress"] == [(1, step, 8) for step in range(1, 9)] + [(2, step, 3) for step in range(1, 4)]


def test_distilled_text_to_video_matches_the_official_distilled_pipeline_bitwise_bf16(bundle, loader, spec, reference_side):
    check_run(run_ours(loader, spec, image=None), run_reference(reference_side, image_path=None), bundle.version)


def test_distilled_image_to_video_matches_the_official_distilled_pipeline_bitwise_bf16(bundle, loader, spec, reference_side, tmp_path):
    image_path, comfy_image = first_frame_image(tmp_path)
    ours = run_ours(loader, spec, image=comfy_image)
    check_run(ours, run_reference(reference_side, image_path=image_path), bundle.version)
    # Without the image the first latent frame differs: the conditioning took effect.
    assert max_abs_diff(ours["stage1_video"][:, :, :1], run_ours(loader, spec, image=None)["stage1_video"][:, :, :1]) > 0.05
