"""The distilled recipe against the official ``DistilledPipeline`` (ltx-pipelines 1.0.0), world size 1.

The reference runs on the tiny bundle in bfloat16 on the CPU, its intermediate latents captured by
wrapping its internals from the test side (the adjustments of ``test_pipeline_parity``: no-op CUDA
calls, Gemma sized to the tiny bundle, the same stand-in Gemma hidden states on both sides). Our
stages run the distilled request's schema defaults on the same files and seed: 8 distilled sigmas
with one positive-only pass per step, the 2x upsample, the 3-step tail on the same transformer with
no LoRA. Stage-1 video and audio, the upsampled latent, the stage-2 video, the stage-2 audio (the
untiled stage 2 denoises it, as the official one does) and the decoded frames must be equal bitwise.

Both sides load the tiny bundle's own distilled checkpoint.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from ltx_core.model.video_vae import TilingConfig
from ltx_core.text_encoders.gemma.encoders import encoder_configurator
from PIL import Image

from mgpu_backend.bundles import tiny
from mgpu_backend.bundles.full_size import ltx_core_gemma_config
from mgpu_backend.ltx.decode import decode_video
from mgpu_backend.ltx.jobs import active_passes, stage1_params
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.ltx.schema import DISTILLED_SIGMAS, STAGE_2_SIGMAS, SampleRequest, UpscaleRequest
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import contexts_from_gemma

from .test_pipeline_parity import PROMPT, assert_bitwise, max_abs_diff, reference_uint8_frames, stand_in_gemma_output

HEIGHT, WIDTH, FRAMES, FRAME_RATE, SEED = 128, 192, 9, 24.0, 10


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return tiny.make_tiny_bundle(tmp_path_factory.mktemp("tiny-ltx2"))


@pytest.fixture(scope="module")
def spec(bundle) -> ModelSpec:
    """The distilled recipe's model: a checkpoint, Gemma and the upsampler; no distilled LoRA."""
    return ModelSpec(checkpoint_path=bundle.distilled_checkpoint_path, gemma_root=bundle.gemma_root, spatial_upsampler_path=bundle.spatial_upsampler_path)


@pytest.fixture(scope="module")
def reference_side(bundle):
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        patch.setattr(torch.cuda, "empty_cache", lambda *args, **kwargs: None)
        tiny_gemma = ltx_core_gemma_config(json.loads((Path(bundle.gemma_root) / "config.json").read_text()))
        patch.setattr(encoder_configurator, "GEMMA3_CONFIG_FOR_LTX", tiny_gemma)
        from ltx_pipelines import distilled as reference_module

        pipeline = reference_module.DistilledPipeline(
            distilled_checkpoint_path=bundle.distilled_checkpoint_path,
            gemma_root=bundle.gemma_root,
            spatial_upsampler_path=bundle.spatial_upsampler_path,
            loras=[],
            device=torch.device("cpu"),
        )
        yield types.SimpleNamespace(module=reference_module, pipeline=pipeline)


def run_reference(reference_side, image_path: str | None) -> dict:
    module, captured = reference_side.module, {"denoised": [], "sigmas": []}
    original_denoise, original_upsample = module.denoise_audio_video, module.upsample_video

    def stand_in_encode_prompts(prompts, model_ledger, **_enhancement):
        processor = model_ledger.gemma_embeddings_processor()
        captured["contexts"] = [processor.process_hidden_states(*stand_in_gemma_output(prompt)) for prompt in prompts]
        return captured["contexts"]

    def capturing_denoise(*args, **kwargs):
        captured["sigmas"].append(kwargs["sigmas"].tolist())
        video_state, audio_state = original_denoise(*args, **kwargs)
        captured["denoised"].append((video_state.latent.clone(), audio_state.latent.clone()))
        return video_state, audio_state

    def capturing_upsample(*args, **kwargs):
        captured["upsampled"] = original_upsample(*args, **kwargs)
        return captured["upsampled"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "encode_prompts", stand_in_encode_prompts)
        patch.setattr(module, "denoise_audio_video", capturing_denoise)
        patch.setattr(module, "upsample_video", capturing_upsample)
        images = [] if image_path is None else [module.ImageConditioningInput(image_path, 0, 1.0)]
        with torch.inference_mode():
            video_chunks, audio = reference_side.pipeline(
                prompt=PROMPT, seed=SEED, height=HEIGHT, width=WIDTH, num_frames=FRAMES, frame_rate=FRAME_RATE,
                images=images, tiling_config=TilingConfig.default(),
            )  # fmt: skip
            captured["frames"] = torch.cat(list(video_chunks))
    captured["audio"] = audio
    (captured["stage1_video"], captured["stage1_audio"]), (captured["stage2_video"], captured["stage2_audio"]) = captured["denoised"]
    return captured


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
    frames = decode_video(loader, stage2_video, generator=stage2.decoder_generator(loader.device, loader.dtype))
    return {
        "context": positive, "passes": passes, "stage1_sigmas": stage1.stage1_sigmas, "stage2_sigmas": upscale_request.sigmas,
        "stage1_video": stage1_video, "stage1_audio": stage1_audio, "upsampled": upsampled,
        "stage2_video": stage2_video, "stage2_audio": stage2_audio, "frames": frames, "progress": progress,
    }  # fmt: skip


@pytest.fixture(scope="module")
def loader(spec):
    return ModelLoader(spec, device="cpu", dtype=torch.bfloat16)


def check_run(ours: dict, reference: dict) -> None:
    (reference_context,) = reference["contexts"]
    assert_bitwise(ours["context"].video_context, reference_context.video_encoding, "video text context")
    assert ours["passes"] == ["conditional"], "the distilled recipe runs one positive-only pass per step"
    assert [list(ours["stage1_sigmas"]), list(ours["stage2_sigmas"])] == [list(DISTILLED_SIGMAS), list(STAGE_2_SIGMAS)]
    assert [[round(s, 6) for s in sigmas] for sigmas in reference["sigmas"]] == [[round(s, 6) for s in DISTILLED_SIGMAS], [round(s, 6) for s in STAGE_2_SIGMAS]]
    assert tuple(ours["stage1_video"].shape) == (1, 128, 2, 2, 3) and tuple(ours["stage1_audio"].shape) == (1, 8, 9, 16)
    assert_bitwise(ours["stage1_video"], reference["stage1_video"], "stage-1 video latent")
    assert_bitwise(ours["stage1_audio"], reference["stage1_audio"], "stage-1 audio latent")
    assert_bitwise(ours["upsampled"], reference["upsampled"], "upsampled video latent")
    assert tuple(ours["stage2_video"].shape) == (1, 128, 2, 4, 6)
    assert_bitwise(ours["stage2_video"], reference["stage2_video"], "stage-2 video latent")
    # The official stage 2 re-denoises the audio; the untiled stage 2 of the distilled job does too.
    assert max_abs_diff(reference["stage2_audio"], reference["stage1_audio"]) > 0.05
    assert_bitwise(ours["stage2_audio"], reference["stage2_audio"], "stage-2 audio latent")
    assert_bitwise(reference_uint8_frames(ours["frames"]), reference["frames"], "decoded frames (uint8)")
    assert ours["progress"] == [(1, step, 8) for step in range(1, 9)] + [(2, step, 3) for step in range(1, 4)]


def test_distilled_text_to_video_matches_the_official_distilled_pipeline_bitwise_bf16(loader, spec, reference_side):
    check_run(run_ours(loader, spec, image=None), run_reference(reference_side, image_path=None))


def test_distilled_image_to_video_matches_the_official_distilled_pipeline_bitwise_bf16(loader, spec, reference_side, tmp_path):
    rows, cols = np.meshgrid(np.linspace(0, 1, 50), np.linspace(0, 1, 62), indexing="ij")
    pixels = (np.stack([rows, cols, (rows * cols) ** 0.5], axis=-1) * 255).round().astype(np.uint8)
    image_path = tmp_path / "first_frame.png"
    Image.fromarray(pixels).save(image_path)
    comfy_image = torch.from_numpy(np.array(Image.open(image_path))).float() / 255.0
    ours = run_ours(loader, spec, image=comfy_image)
    check_run(ours, run_reference(reference_side, image_path=str(image_path)))
    # Without the image the first latent frame differs: the conditioning took effect.
    assert max_abs_diff(ours["stage1_video"][:, :, :1], run_ours(loader, spec, image=None)["stage1_video"][:, :, :1]) > 0.05
