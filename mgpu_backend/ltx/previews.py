"""Live previews of the video being denoised: a linear latent-to-RGB projection of each step's x0.

What a preview is
    After a denoising step (stage 1 or stage 2), the denoised prediction x0 of the video, in
    ComfyUI's layout ``[1, 128, F', H/32, W/32]``, is projected channel-wise to RGB with a 128 x 3
    matrix and a bias, for a few latent frames (the first, the last and evenly between), upsampled
    2x and sent as ``uint8 [frames, h, w, 3]``: a strip the node shows through ComfyUI's own preview
    channel, and ``generate --preview-dir`` writes as PNGs. It is what ComfyUI calls a "latent2rgb"
    preview: colours and layout of the scene, not its detail.

Where the factors come from
    They are fitted, not copied: for each loaded checkpoint, rank 0 decodes one small random
    latent (``FIT_GRID``, standard normal like the normalised latents the stages produce, fixed
    seed) with the checkpoint's own video decoder, averages the decoded pixels over each latent
    cell's footprint (32 x 32 pixels, and the 8 frames of a latent frame after the first), and solves
    the ridge least squares problem ``cell colour ~ latent @ weight + bias``. So the projection fits
    the model actually loaded (LTX-2.0, 2.3, or the tiny random bundle) and needs no table from
    anywhere; the fit runs once per checkpoint in a rank's lifetime and is kept in the rank's state.

What it costs
    Per preview: an einsum of a few latent frames (``frames x 128 x h x w`` multiply-adds), one
    interpolation and a copy of at most ``frames x 2h x 2w x 3`` bytes to the host (about 100 KB at
    1536x1024), on rank 0 only: far under 1% of a transformer step (``bench/preview.py`` measures
    it). The other ranks never wait for it beyond rank 0 reaching the next collective that much
    later. The one-off fit costs one decode of ``FIT_GRID`` (9 frames of 512x512) when previews are
    first asked for.

This module never changes the denoising: it reads x0, draws from no generator the stages use, and
runs no collective. It never imports ComfyUI or ltx-core (the ComfyUI side uses ``side_by_side``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mgpu_backend.ltx.schema import VIDEO_LATENT_CHANNELS, VIDEO_SPATIAL_COMPRESSION, VIDEO_TEMPORAL_COMPRESSION

PREVIEW_FRAMES = 4
"""Latent frames side by side in one preview (fewer when the video has fewer)."""
PREVIEW_SCALE = 2
"""Upsampling of the latent grid: a 768x512 stage-1 video previews at 48x32 per frame."""
FIT_GRID = (2, 16, 16)
"""Latent frames, height and width of the random latent the factors are fitted on: 512 cells for
129 unknowns per colour, a 9-frame 512x512 decode."""
FIT_SEED = 0
FIT_RIDGE = 1e-3
"""Ridge weight (relative to the mean diagonal of the normal matrix): keeps the fit well posed for
a decoder that ignores some channels."""
PREVIEW_TENSOR = "frames"
"""Name of the one tensor a ``preview`` event carries."""


@dataclass(frozen=True)
class LatentRGB:
    """A linear map from the 128 latent channels to RGB in the decoder's range (about -1..1)."""

    weight: torch.Tensor  # [128, 3] float32
    bias: torch.Tensor  # [3] float32

    def preview(self, video_x0: torch.Tensor, frames: int = PREVIEW_FRAMES, scale: int = PREVIEW_SCALE) -> torch.Tensor:
        """``uint8 [n, scale*h, scale*w, 3]`` on the CPU from a video x0 ``[B, 128, F', h, w]`` (batch 0)."""
        if video_x0.ndim != 5 or video_x0.shape[1] != VIDEO_LATENT_CHANNELS:
            raise ValueError(f"a preview needs a video latent [B, 128, F', H/32, W/32], got shape {tuple(video_x0.shape)}")
        latent_frames = video_x0.shape[2]
        chosen = torch.linspace(0, latent_frames - 1, min(frames, latent_frames)).round().long().unique()
        picked = video_x0[0, :, chosen.to(video_x0.device)].float()  # [128, n, h, w]
        weight, bias = self.weight.to(picked.device), self.bias.to(picked.device)
        rgb = torch.einsum("cnhw,cr->nrhw", picked, weight) + bias.view(1, 3, 1, 1)
        if scale != 1:
            rgb = torch.nn.functional.interpolate(rgb, scale_factor=scale, mode="bilinear", align_corners=False)
        rgb = ((rgb + 1.0) * 127.5).clamp(0.0, 255.0).round().to(torch.uint8)
        return rgb.permute(0, 2, 3, 1).contiguous().cpu()


def fit_latent_rgb(decoder: torch.nn.Module, device: torch.device, dtype: torch.dtype, grid: tuple[int, int, int] = FIT_GRID) -> LatentRGB:
    """Fit the projection to ``decoder`` (an ltx-core ``VideoDecoder``) on one random latent."""
    latent_frames, height, width = grid
    generator = torch.Generator(device=device).manual_seed(FIT_SEED)
    latent = torch.randn((1, VIDEO_LATENT_CHANNELS, latent_frames, height, width), generator=generator, device=device, dtype=dtype)
    with torch.inference_mode():
        # A timestep-conditioned decoder adds noise to its input: a generator of our own keeps the
        # fit the same from run to run and leaves every generator of the job untouched.
        decoded = decoder(latent, None, torch.Generator(device=device).manual_seed(FIT_SEED)).float()[0]  # [3, F, H, W]
    cell_colours = _cell_means(decoded, latent_frames, height, width)  # [3, F', h, w]
    inputs = latent[0].double().flatten(1).T.cpu()  # [cells, 128]
    targets = cell_colours.double().flatten(1).T.cpu()  # [cells, 3]
    design = torch.cat([inputs, torch.ones(inputs.shape[0], 1, dtype=torch.float64)], dim=1)
    normal = design.T @ design
    normal += FIT_RIDGE * normal.diagonal().mean() * torch.eye(normal.shape[0], dtype=torch.float64)
    solution = torch.linalg.solve(normal, design.T @ targets)  # [129, 3]
    return LatentRGB(weight=solution[:-1].float().contiguous(), bias=solution[-1].float().contiguous())


def _cell_means(decoded: torch.Tensor, latent_frames: int, height: int, width: int) -> torch.Tensor:
    """Mean decoded colour over each latent cell's footprint: the first latent frame is one pixel
    frame, each later one ``VIDEO_TEMPORAL_COMPRESSION`` frames; a cell is 32 x 32 pixels."""
    if decoded.shape[2] != height * VIDEO_SPATIAL_COMPRESSION or decoded.shape[3] != width * VIDEO_SPATIAL_COMPRESSION:
        raise ValueError(f"the video decoder made {tuple(decoded.shape[2:])} pixels of a {height}x{width} latent; expected 32x per side")
    spans = [(0, 1)] + [(1 + VIDEO_TEMPORAL_COMPRESSION * k, 1 + VIDEO_TEMPORAL_COMPRESSION * (k + 1)) for k in range(latent_frames - 1)]
    frames = torch.stack([decoded[:, start:end].mean(dim=1) for start, end in spans], dim=1)  # [3, F', H, W]
    return torch.nn.functional.avg_pool2d(frames, VIDEO_SPATIAL_COMPRESSION)


def side_by_side(frames: torch.Tensor) -> torch.Tensor:
    """A preview's frames ``[n, h, w, 3]`` as one strip ``[h, n*w, 3]``: what the node shows and
    ``generate --preview-dir`` writes."""
    return frames.permute(1, 0, 2, 3).reshape(frames.shape[1], frames.shape[0] * frames.shape[2], frames.shape[3]).contiguous()


def preview_due(step: int, total: int, every: int) -> bool:
    """Every ``every``-th step and the last one; never with ``every`` 0."""
    return every > 0 and (step % every == 0 or step == total)


_FITTED = "preview_latent_rgb"


def _checkpoint_key(checkpoint_path: str, dtype: torch.dtype) -> tuple:
    """What the fitted projection depends on: the checkpoint's decoder (the file as it is now) and dtype."""
    try:
        stat = os.stat(checkpoint_path)
        return (str(checkpoint_path), stat.st_size, stat.st_mtime_ns, str(dtype))
    except OSError:
        return (str(checkpoint_path), None, None, str(dtype))


VideoX0 = Callable[[], torch.Tensor]
"""What a stage hands its step callback: this step's denoised video in ComfyUI layout, computed
only when called."""


def step_reporter(ctx, stage: str, factors: LatentRGB | None = None, every: int = 0):
    """The ``on_step(step, total, video_x0=None)`` of a stage: a preview event (rank 0, when due and
    ``factors`` are given), then ``ctx.step``, the fleet's progress report and cancel point."""

    def on_step(step: int, total: int, video_x0: VideoX0 | None = None) -> None:
        if factors is not None and video_x0 is not None and preview_due(step, total, every):
            frames = factors.preview(video_x0())
            ctx.emit("preview", {"stage": stage, "step": step, "total": total}, tensors={PREVIEW_TENSOR: frames})
        ctx.step(stage, step, total)

    return on_step


def stage_previews(ctx, resident, every: int) -> LatentRGB | None:
    """The projection rank 0 previews with, or None (previews off, or another rank: only rank 0
    sends events). Fitted once per checkpoint and kept in the rank's state, so a decoder that the
    residency plan does not keep is read only for that one fit."""
    if every <= 0 or ctx.rank != 0:
        return None
    key = _checkpoint_key(resident.spec.checkpoint_path, resident.dtype)
    kept = ctx.state.get(_FITTED)
    if kept is not None and kept[0] == key:
        return kept[1]
    factors = fit_latent_rgb(resident.video_decoder(), resident.device, resident.dtype)
    ctx.state[_FITTED] = (key, factors)
    return factors
