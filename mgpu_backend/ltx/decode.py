"""Latents to media on one rank: tiled video VAE decode, audio VAE decode + vocoder.

Video is decoded tile by tile exactly as the official pipeline does (ltx-core's tiled decode with
``TilingConfig.default()``: 512-pixel tiles with 64 pixels of overlap, 64-frame chunks with 24
frames of overlap, trapezoidal blending) and returned as a ComfyUI IMAGE batch. The distributed
decoder spreads the same tiles over ranks; this module is its single-rank reference.

It never talks to other ranks.
"""

from __future__ import annotations

import torch
from ltx_core.model.video_vae import TilingConfig


def decode_video(
    loader,
    video_latent: torch.Tensor,
    tiling: TilingConfig | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[1, 128, F', H/32, W/32]`` -> frames ``[F, H, W, 3]`` float32 in 0..1.

    ``tiling`` defaults to ``TilingConfig.default()``, the official pipeline's tiling.
    ``generator`` feeds the noise a timestep-conditioned decoder adds to the latent (once per
    tile); ``params.decoder_generator(device, dtype)`` is the one the official pipeline uses.
    Without it the decoder draws from torch's default generator, as ltx-core does.
    """
    if video_latent.ndim != 5 or video_latent.shape[0] != 1 or video_latent.shape[1] != 128:
        raise ValueError(
            f"decode_video expects one video latent [1, 128, F', H/32, W/32], got shape {tuple(video_latent.shape)}"
        )
    tiling = TilingConfig.default() if tiling is None else tiling
    with torch.inference_mode():
        decoder = loader.video_decoder()
        latent = video_latent.to(device=loader.device, dtype=loader.dtype)
        chunks = [chunk.float() for chunk in decoder.tiled_decode(latent, tiling, generator=generator)]
        video = torch.cat(chunks, dim=2)[0]  # [3, F, H, W] in -1..1
        return ((video + 1.0) / 2.0).clamp(0.0, 1.0).permute(1, 2, 3, 0).contiguous()


def decode_audio(loader, audio_latent: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[B, 8, T, 16]`` -> ``(waveform [B, channels, samples] float32, sample_rate)``."""
    if audio_latent.ndim != 4 or audio_latent.shape[1] != 8:
        raise ValueError(f"decode_audio expects an audio latent [B, 8, T, 16], got shape {tuple(audio_latent.shape)}")
    with torch.inference_mode():
        decoder, vocoder = loader.audio_decoder(), loader.vocoder()
        latent = audio_latent.to(device=loader.device, dtype=loader.dtype)
        waveform = vocoder(decoder(latent)).float()
        return waveform, int(vocoder.output_sampling_rate)
