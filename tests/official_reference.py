"""The official ltx-pipelines 1.0.0 pipelines on a tiny bundle, instrumented from the test side, for the
faithfulness tests (``test_pipeline_parity``: two-stage; ``test_distilled_parity``: distilled).

A reference pipeline runs on the CPU in bfloat16 with its intermediate latents captured by wrapping
its internals (``denoise_audio_video``, ``upsample_video``, ``encode_prompts``). The adjustments,
none of which changes its arithmetic:
- ``torch.cuda.synchronize`` / ``empty_cache`` become no-ops (no GPU here);
- ltx-core's hard-coded Gemma-3 12B configuration is replaced by the tiny bundle's (as agreed with
  the loader); it sizes the feature extractor of the embeddings processor;
- Gemma itself: ltx-core 1.0.0's Gemma code needs transformers 4.x (under transformers 5 the
  reference fails building it, SiglipVisionModel having lost its ``vision_model``, and our loader
  refuses it). So both sides get the same deterministic stand-in Gemma hidden states, which the real
  embeddings processor of each side turns into contexts; the Gemma half is compared by its own test,
  which runs where transformers 4 is installed.
"""

from __future__ import annotations

import importlib
import json
import types
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from ltx_core.model.video_vae import TilingConfig
from ltx_core.text_encoders.gemma.encoders import encoder_configurator
from PIL import Image

from mgpu_backend.bundles import tiny
from mgpu_backend.bundles.full_size import ltx_core_gemma_config
from tests.helpers import max_abs_diff

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
needs_ltx_core_gemma = pytest.mark.skipif(
    TRANSFORMERS_5, reason="ltx-core 1.0.0's Gemma code needs transformers 4.x (installed: 5.x); CI runs it in its transformers-4 venv"
)
"""For a test that builds Gemma with ltx-core's own code (its ModelLedger, ltx-pipelines)."""

TEXT_TOKENS = 128  # a multiple of the connectors' 128 learnable registers, as Gemma's 1024 is
# The 2.3 vocoder extends the bandwidth to 48 kHz; the 2.0 one stops at 24 kHz.
VOCODER_SAMPLE_RATE = {"2.0": 24000, "2.3": 48000}


def stand_in_gemma_output(prompt: str) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Deterministic Gemma-shaped output for a prompt: hidden states of every layer, left padding."""
    generator = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
    text = tiny.GEMMA_TEXT_CONFIG
    hidden_states = tuple(
        torch.randn(1, TEXT_TOKENS, text["hidden_size"], generator=generator).to(torch.bfloat16)
        for _ in range(text["num_hidden_layers"] + 1)
    )
    real_tokens = 5 + len(prompt) // 4
    attention_mask = torch.zeros(1, TEXT_TOKENS, dtype=torch.int64)
    attention_mask[:, TEXT_TOKENS - real_tokens :] = 1
    return hidden_states, attention_mask


def assert_bitwise(ours: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    assert ours.shape == reference.shape, f"{what}: shape {tuple(ours.shape)} != reference {tuple(reference.shape)}"
    assert torch.equal(ours.float(), reference.float()), f"{what}: max abs diff {max_abs_diff(ours, reference):.3e}"


def reference_uint8_frames(frames: torch.Tensor) -> torch.Tensor:
    """Our 0..1 float frames put through the reference's bf16 conversion to uint8.

    Ours are (x + 1) / 2 of the decoder's bf16 output x, exact in float32; the reference computes
    the same in bf16 (rounding x + 1), clamps, scales by 255 in bf16 and truncates.
    """
    decoder_plus_one = (frames * 2).to(torch.bfloat16)
    return ((decoder_plus_one / 2.0).clamp(0.0, 1.0) * 255.0).to(torch.uint8)


def version_id(version: str) -> str:
    return f"ltx-{version}"


def first_frame_image(directory: Path) -> tuple[str, torch.Tensor]:
    """A small smooth PNG of another aspect ratio than the video (so resize and crop both matter):
    its path for the reference, and the image as ComfyUI's LoadImage gives it to us."""
    rows, cols = np.meshgrid(np.linspace(0, 1, 50), np.linspace(0, 1, 62), indexing="ij")
    pixels = (np.stack([rows, cols, (rows * cols) ** 0.5], axis=-1) * 255).round().astype(np.uint8)
    path = directory / "first_frame.png"
    Image.fromarray(pixels).save(path)
    return str(path), torch.from_numpy(np.array(Image.open(path))).float() / 255.0


def reference_side(bundle, module_name: str, build: Callable[[types.ModuleType], object]) -> Iterator[types.SimpleNamespace]:
    """The official pipeline of ``ltx_pipelines.<module_name>`` that ``build(module)`` makes, with its
    CUDA calls neutralised and its Gemma sized to the tiny bundle (``yield from`` it in a fixture)."""
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        patch.setattr(torch.cuda, "empty_cache", lambda *args, **kwargs: None)
        tiny_gemma = ltx_core_gemma_config(json.loads((Path(bundle.gemma_root) / "config.json").read_text()))
        patch.setattr(encoder_configurator, "GEMMA3_CONFIG_FOR_LTX", tiny_gemma)
        module = importlib.import_module(f"ltx_pipelines.{module_name}")
        yield types.SimpleNamespace(module=module, pipeline=build(module))


def guided_call(params, prompt: str, negative_prompt: str) -> dict:
    """The keywords of a guided official runner's call (two-stage, HQ) for the fleet's ``GenerationParams``."""
    return dict(
        prompt=prompt, negative_prompt=negative_prompt, seed=params.seed, height=params.height, width=params.width,
        num_frames=params.num_frames, frame_rate=params.frame_rate, num_inference_steps=params.num_inference_steps,
        video_guider_params=params.video_guider, audio_guider_params=params.audio_guider,
    )


def run_reference(side: types.SimpleNamespace, image_path: str | None, conditioning_images: tuple = (), **call) -> dict:
    """One official run; returns the latents it passed between its steps, and its outputs.

    ``image_path``: a first-frame image at strength 1.0; ``conditioning_images``: ``(path, frame_idx,
    strength)`` of each image instead, as the runners' ``--image PATH FRAME_IDX STRENGTH``.

    ``contexts``: the prompts' encodings; ``sigmas``: each denoising's schedule; ``stage1_video`` /
    ``stage1_audio`` / ``stage2_video`` / ``stage2_audio``: what each denoising returned;
    ``upsampled``: the 2x latent; ``frames``: the decoded uint8 frames; ``audio``: the decoded audio.
    """
    module, captured = side.module, {"denoised": [], "sigmas": []}
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
        images += [module.ImageConditioningInput(path, frame_idx, strength) for path, frame_idx, strength in conditioning_images]
        with torch.inference_mode():
            video_chunks, audio = side.pipeline(images=images, tiling_config=TilingConfig.default(), **call)
            captured["frames"] = torch.cat(list(video_chunks))  # decoding happens while iterating
    captured["audio"] = audio
    (captured["stage1_video"], captured["stage1_audio"]), (captured["stage2_video"], captured["stage2_audio"]) = captured["denoised"]
    return captured


def fleet_latents(run: dict) -> dict:
    """The latents a fleet's sample and upscale jobs (``run["stage1"]``, ``run["upscaled"]``) returned,
    named as ``run_reference`` names the official runner's."""
    return {
        "stage1_video": run["stage1"].tensors["video_latent"], "stage1_audio": run["stage1"].tensors["audio_latent"],
        "stage2_video": run["upscaled"].tensors["video_latent"], "stage2_audio": run["upscaled"].tensors["audio_latent"],
    }  # fmt: skip


def assert_one_rank_run_is_official(run: dict, reference: dict, what: str) -> None:
    """A one-rank fleet run whose stage 2 re-denoises the audio (sequence parallel at degree 1, as the
    official runners) equals the official run bitwise, latent by latent; its audio did change in stage 2."""
    upscaled = run["upscaled"]
    assert (upscaled.fields["stage2_parallel"], upscaled.fields["sp_degree"]) == ("sp", 1), upscaled.fields
    assert upscaled.fields["audio"].startswith("denoised in stage 2")
    ours = fleet_latents(run)
    for name, tensor in ours.items():
        assert_bitwise(tensor, reference[name], f"{what}: {name}")
    assert (ours["stage2_audio"] - ours["stage1_audio"]).abs().max().item() > 0.05, "stage 2 must re-denoise the audio, as the official runner"
