"""Latent geometry, layouts and seeded noise shared by the LTX-2 stages.

Between stages (and between ComfyUI nodes) latents travel in ComfyUI's LTX-2 layout, float32:
video ``[B, 128, F', H/32, W/32]`` and audio ``[B, 8, T, 16]``. Inside a stage they are token
sequences (``LatentState``) made by ltx-core's patchifiers through ``VideoLatentTools`` /
``AudioLatentTools``. This module converts between the two, prepares the image conditionings (the
first frame replaced, or guiding latents appended, as ``recipes.CONDITIONINGS`` says), and
reproduces the order in which the reference pipeline draws its noise from one seeded generator, so
that a stage run on its own draws the same numbers as the whole pipeline.

It never loads models and never talks to other ranks.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import av
import numpy as np
import torch
from ltx_core.components.noisers import GaussianNoiser
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.conditioning import ConditioningItem, VideoConditionByKeyframeIndex, VideoConditionByLatentIndex
from ltx_core.tools import AudioLatentTools, LatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, LatentState, VideoLatentShape, VideoPixelShape

from mgpu_backend.ltx.recipes import guides
from mgpu_backend.ltx.schema import VIDEO_LATENT_CHANNELS

# The official pipeline compresses a conditioning image with H.264 at this CRF before encoding it,
# so that the first frame looks like a video frame rather than a clean still.
DEFAULT_IMAGE_CRF = 33
# LTX-2 patchifies with patch size 1: one token per latent cell (video) or latent time step (audio).
_VIDEO_PATCHIFIER = VideoLatentPatchifier(patch_size=1)
_AUDIO_PATCHIFIER = AudioPatchifier(patch_size=1)


@dataclass(frozen=True)
class StageGeometry:
    """Pixel size of one stage and the latent shapes that follow from it (batch 1)."""

    height: int
    width: int
    num_frames: int
    frame_rate: float

    @property
    def pixel_shape(self) -> VideoPixelShape:
        return VideoPixelShape(
            batch=1, frames=self.num_frames, height=self.height, width=self.width, fps=self.frame_rate
        )

    @property
    def video_shape(self) -> VideoLatentShape:
        return VideoLatentShape.from_pixel_shape(self.pixel_shape, latent_channels=VIDEO_LATENT_CHANNELS)

    @property
    def audio_shape(self) -> AudioLatentShape:
        return AudioLatentShape.from_video_pixel_shape(self.pixel_shape)

    @property
    def video_tokens(self) -> int:
        return self.video_shape.token_count()

    @property
    def audio_tokens(self) -> int:
        return self.audio_shape.token_count()

    def video_tools(self) -> VideoLatentTools:
        return VideoLatentTools(_VIDEO_PATCHIFIER, self.video_shape, self.frame_rate)

    def audio_tools(self) -> AudioLatentTools:
        return AudioLatentTools(_AUDIO_PATCHIFIER, self.audio_shape)


def check_latent_shape(name: str, latent: torch.Tensor, expected: torch.Size, hint: str) -> None:
    """Raise a user-facing error when a latent handed to a stage does not fit its parameters."""
    if tuple(latent.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(latent.shape)}, expected {tuple(expected)}; {hint}")


def initial_state(
    tools: LatentTools,
    conditionings: list[ConditioningItem],
    noiser: GaussianNoiser,
    noise_scale: float | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    initial_latent: torch.Tensor | None = None,
) -> LatentState:
    """Token state of one modality: start latent (zeros or ``initial_latent``), conditionings, noise.

    The noiser draws from its generator here, so the call order of this function across modalities
    and stages decides which numbers each latent gets.
    """
    if initial_latent is not None:
        initial_latent = initial_latent.to(device=device, dtype=dtype)
    state = tools.create_initial_state(device, dtype, initial_latent)
    for conditioning in conditionings:
        state = conditioning.apply_to(latent_state=state, latent_tools=tools)
    return noiser(state, noise_scale)


def state_to_comfy(state: LatentState, tools: LatentTools) -> torch.Tensor:
    """Drop appended conditioning tokens and return the latent in ComfyUI layout, float32."""
    state = tools.unpatchify(tools.clear_conditioning(state))
    return state.latent.float()


def job_generator(
    seed: int, device: torch.device, dtype: torch.dtype, stages_before: tuple[StageGeometry, ...] = (), guiding_frames: int = 0
) -> torch.Generator:
    """The job's one noise generator, as the official pipeline holds it after ``stages_before`` drew.

    The reference seeds one generator per job and draws from it in a fixed order: stage-1 video
    tokens, stage-1 audio tokens, stage-2 video tokens, stage-2 audio tokens, then the video
    decoder's noise. A stage that runs on its own (another node, another job op) replays the earlier
    draws: drawing and dropping tensors of the same shapes, dtype and order is the one way that is
    exact on every device, since how far a draw advances a generator is a detail of each backend.
    A first frame replaced adds no tokens; each of the ``guiding_frames`` guiding latents every
    earlier stage appended (``recipes.appended_frames``) adds one latent frame of that stage's size to its
    video draw, which noised the whole sequence in one tensor.
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    for geometry in stages_before:
        shape = geometry.video_shape
        for tokens, channels in (
            (geometry.video_tokens + guiding_frames * shape.height * shape.width, VIDEO_LATENT_CHANNELS),
            (geometry.audio_tokens, geometry.audio_shape.channels * geometry.audio_shape.mel_bins),
        ):
            torch.randn(1, tokens, channels, device=generator.device, dtype=dtype, generator=generator)
    return generator


def check_conditioning_image(image: torch.Tensor | None) -> None:
    """A conditioning image is one ComfyUI IMAGE frame: ``[H, W, 3]`` (or RGBA), values in 0..1."""
    if image is None:
        return
    if image.ndim != 3 or image.shape[-1] not in (3, 4) or min(image.shape[:2]) < 2:
        hint = "; pass one frame, e.g. image[0]" if image.ndim == 4 else ""
        raise ValueError(f"the conditioning image must be one [H, W, 3] frame, got shape {tuple(image.shape)}{hint}")


def image_to_pixels(
    image: torch.Tensor, height: int, width: int, crf: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """ComfyUI IMAGE frame ``[H, W, 3]`` in 0..1 -> VAE input ``[1, 3, 1, height, width]`` in -1..1.

    Same treatment as the official pipeline gives an image file: 8-bit RGB, H.264 round trip at
    ``crf`` (0 skips it), aspect-preserving bilinear resize that covers the target, centre crop.
    """
    check_conditioning_image(image)
    # Round rather than truncate: a ComfyUI image loaded from 8-bit file holds k/255, which times
    # 255 can land just below k in float32.
    rgb = (image[..., :3].detach().float().cpu().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).numpy()
    if crf > 0:
        rgb = _h264_round_trip(rgb, crf)
    pixels = torch.tensor(rgb, dtype=torch.float32, device=device)
    pixels = _cover_and_centre_crop(pixels, height, width)
    return (pixels / 127.5 - 1.0).to(device=device, dtype=dtype)


def _h264_round_trip(rgb: np.ndarray, crf: int) -> np.ndarray:
    """Encode one frame with libx264 and decode it again (dimensions cut to even numbers)."""
    even_height, even_width = rgb.shape[0] // 2 * 2, rgb.shape[1] // 2 * 2
    rgb = np.ascontiguousarray(rgb[:even_height, :even_width])
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=1, options={"crf": str(crf), "preset": "veryfast"})
        stream.height, stream.width = even_height, even_width
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    buffer.seek(0)
    with av.open(buffer) as container:
        decoded = next(container.decode(video=0))
        return decoded.to_ndarray(format="rgb24")


def _cover_and_centre_crop(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[H, W, 3]`` -> ``[1, 3, 1, height, width]``: scale to cover the target, keep the centre."""
    chw = pixels.permute(2, 0, 1).unsqueeze(0)
    source_height, source_width = chw.shape[-2:]
    scale = max(height / source_height, width / source_width)
    # ceil: a rounding error below the target size would make the crop offsets negative.
    scaled_height, scaled_width = math.ceil(source_height * scale), math.ceil(source_width * scale)
    chw = torch.nn.functional.interpolate(chw, size=(scaled_height, scaled_width), mode="bilinear", align_corners=False)
    top, left = (scaled_height - height) // 2, (scaled_width - width) // 2
    chw = chw[:, :, top : top + height, left : left + width]
    return chw.unsqueeze(2)


@dataclass(frozen=True)
class ConditioningImage:
    """One conditioning image (a ComfyUI IMAGE frame ``[H, W, 3]`` in 0..1) at pixel frame ``frame_idx``
    with its ``strength`` (1.0: kept clean; 0.0: denoised like the rest), as ltx_pipelines'
    ``ImageConditioningInput``."""

    image: torch.Tensor
    frame_idx: int
    strength: float


def image_conditionings(
    images: list[ConditioningImage],
    geometry: StageGeometry,
    video_encoder: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    crf: int = DEFAULT_IMAGE_CRF,
    conditioning: str = "first-frame",
) -> list[ConditioningItem]:
    """The images' conditionings at this stage's size, in their order, as the official runners make them:
    ``first-frame`` (``combined_image_conditionings``) replaces the first latent frame by an image at frame
    0 and appends the others as guiding latents; ``keyframes`` (``image_conditionings_by_adding_guiding_latent``)
    appends every image."""
    conditionings = []
    for conditioning_image in images:
        pixels = image_to_pixels(conditioning_image.image, geometry.height, geometry.width, crf, dtype, device)
        with torch.inference_mode():
            encoded = video_encoder(pixels)
        if guides(conditioning, conditioning_image.frame_idx):
            conditionings.append(VideoConditionByKeyframeIndex(keyframes=encoded, frame_idx=conditioning_image.frame_idx, strength=conditioning_image.strength))
        else:
            conditionings.append(VideoConditionByLatentIndex(latent=encoded, strength=conditioning_image.strength, latent_idx=0))
    return conditionings
