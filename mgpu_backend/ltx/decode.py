"""Latents to media on one rank: tiled video VAE decode, audio VAE decode + vocoder.

Video is decoded tile by tile exactly as the official pipeline does (ltx-core's tiled decode with
``TilingConfig.default()``: 512-pixel tiles with 64 pixels of overlap, 64-frame chunks with 24
frames of overlap, trapezoidal blending) and returned as a ComfyUI IMAGE batch. The distributed
decoder spreads the same tiles over ranks; this module is its single-rank reference.

It never talks to other ranks.
"""

from __future__ import annotations

import torch
from ltx_core.model.video_vae import SpatialTilingConfig, TemporalTilingConfig, TilingConfig

from mgpu_backend.ltx.schema import DECODE_SPATIAL_TILE_PIXELS, DECODE_TEMPORAL_TILE_FRAMES, audio_sample_count


def decode_tiling(spatial_tile_pixels: int = DECODE_SPATIAL_TILE_PIXELS, temporal_tile_frames: int = DECODE_TEMPORAL_TILE_FRAMES) -> TilingConfig:
    """The decode's tiles for a tile side and chunk length; the defaults give ``TilingConfig.default()``'s
    tiles (overlaps: a quarter of the side up to 64 pixels, 3/8 of the chunk up to 24 frames)."""
    spatial, temporal = spatial_tile_pixels, temporal_tile_frames
    return TilingConfig(
        spatial_config=SpatialTilingConfig(tile_size_in_pixels=spatial, tile_overlap_in_pixels=min(64, spatial // 4 // 32 * 32)),
        # ltx-core takes temporal overlaps in whole latent frames (multiples of 8): 24 for the default 64.
        temporal_config=TemporalTilingConfig(tile_size_in_frames=temporal, tile_overlap_in_frames=min(24, temporal * 3 // 8 // 8 * 8)),
    )


def decode_video(
    loader,
    video_latent: torch.Tensor,
    tiling: TilingConfig | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[1, 128, F', H/32, W/32]`` -> frames ``[F, H, W, 3]`` float32 in 0..1.

    ``tiling`` defaults to ``TilingConfig.default()``, the official pipeline's tiling.
    ``generator`` feeds the noise a timestep-conditioned decoder adds to the latent (once per
    tile); the official pipeline's is ``job_generator(seed, ..., stages_before=<every stage>)``.
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


def decode_audio(
    loader, audio_latent: torch.Tensor, video_frames: int | None = None, frame_rate: float | None = None
) -> tuple[torch.Tensor, int]:
    """``[B, 8, T, 16]`` -> ``(waveform [B, channels, samples] float32, sample_rate)``.

    With ``video_frames`` and ``frame_rate`` the waveform lasts exactly as long as the video
    (``fit_audio_to_video``); without them it is the vocoder's output as it comes."""
    if audio_latent.ndim != 4 or audio_latent.shape[1] != 8:
        raise ValueError(f"decode_audio expects an audio latent [B, 8, T, 16], got shape {tuple(audio_latent.shape)}")
    with torch.inference_mode():
        decoder, vocoder = loader.audio_decoder(), loader.vocoder()
        latent = audio_latent.to(device=loader.device, dtype=loader.dtype)
        waveform = vocoder(decoder(latent)).float()
        sample_rate = int(vocoder.output_sampling_rate)
    if video_frames is not None and frame_rate is not None:
        waveform = fit_audio_to_video(waveform, video_frames, frame_rate, sample_rate)
    return waveform, sample_rate


def fit_audio_to_video(waveform: torch.Tensor, video_frames: int, frame_rate: float, sample_rate: int) -> torch.Tensor:
    """``waveform [..., samples]`` cut or padded with silence to the video's duration.

    The audio latent has round(seconds x 25) frames (ltx-core's ``AudioLatentShape.from_duration``)
    and the VAE + vocoder turn it into a whole number of hops, so the decoded audio is a little
    shorter or longer than the video (9 frames at 24 fps: 0.341 s against 0.375 s). The official
    pipeline writes it as it comes; here both streams end together."""
    wanted = audio_sample_count(video_frames, frame_rate, sample_rate)
    have = waveform.shape[-1]
    if have >= wanted:
        return waveform[..., :wanted].contiguous()
    return torch.nn.functional.pad(waveform, (0, wanted - have))
