"""Checks that run before any heavy work: sizes, frames, steps, sigmas, STG blocks, memory.

Every error says what was wrong and what to do. The memory estimate is deliberately simple (weights
plus the activations of one transformer block at the peak of a forward pass) and errs on the side of
letting a job run: its purpose is to refuse jobs that cannot possibly fit (a 4K, 20-second request on
one GPU), not to predict the allocator to the megabyte.

Nothing here loads a model or allocates device memory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from ltx_core.components.guiders import MultiModalGuiderParams

GIB = 1024**3


def _nearest_multiple(value: int, multiple: int) -> int:
    """The closest positive multiple (ties go up)."""
    return max(multiple, (value + multiple // 2) // multiple * multiple)


def nearest_valid_frame_count(num_frames: int) -> int:
    """The closest 8k+1 frame count (ties go up), at least 1."""
    below = max(1, (num_frames - 1) // 8 * 8 + 1)
    above = below + 8
    return below if num_frames - below < above - num_frames else above


def validate_generation(
    height: int,
    width: int,
    num_frames: int,
    two_stage: bool = True,
    num_inference_steps: int | None = None,
    frame_rate: float | None = None,
) -> None:
    """Raise ``ValueError`` for a size, frame count, step count or frame rate LTX-2 cannot run.

    ``height`` and ``width`` are the final video size: multiples of 64 for the two-stage graph
    (stage 1 runs at half size on a 32-pixel latent grid), of 32 for stage 1 alone.
    """
    for name, value in (("height", height), ("width", width), ("num_frames", num_frames)):
        if int(value) != value or value <= 0:
            raise ValueError(f"{name} must be a positive whole number, got {value}")
    if num_frames % 8 != 1:
        raise ValueError(
            f"frames must be 8k+1 (the video VAE packs 8 frames per latent frame after the first), "
            f"got {num_frames}; use {nearest_valid_frame_count(num_frames)}"
        )
    multiple = 64 if two_stage else 32
    graph = "the two-stage graph (stage 1 runs at half size)" if two_stage else "a single stage"
    for name, value in (("width", width), ("height", height)):
        if value % multiple != 0:
            raise ValueError(
                f"{name} must be a multiple of {multiple} for {graph}, got {value}; "
                f"use {_nearest_multiple(value, multiple)}"
            )
    if num_inference_steps is not None and (int(num_inference_steps) != num_inference_steps or num_inference_steps < 1):
        raise ValueError(f"steps must be a whole number >= 1, got {num_inference_steps}; the official default is 40")
    if frame_rate is not None and not frame_rate > 0:
        raise ValueError(f"frame rate must be positive, got {frame_rate}; the official default is 24")


def validate_sigmas(sigmas: torch.Tensor) -> None:
    """A refinement schedule: at least two values in [0, 1], strictly decreasing."""
    values = [float(v) for v in sigmas.flatten().tolist()]
    if len(values) < 2:
        raise ValueError(
            f"sigmas need at least two values (start and end), got {values}; e.g. 0.909375, 0.725, 0.421875, 0.0"
        )
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"sigmas must lie in [0, 1], got {values}")
    if any(later >= earlier for earlier, later in zip(values, values[1:], strict=False)):
        raise ValueError(f"sigmas must decrease strictly, got {values}; e.g. 0.909375, 0.725, 0.421875, 0.0")


def validate_stg_blocks(guider: MultiModalGuiderParams, layer_count: int | None, modality: str) -> None:
    """STG perturbs transformer blocks by index; an index past the model would silently do nothing."""
    if layer_count is None or not guider.stg_scale or not guider.stg_blocks:
        return
    outside = [block for block in guider.stg_blocks if not 0 <= block < layer_count]
    if outside:
        raise ValueError(
            f"{modality} stg_blocks {list(guider.stg_blocks)} name blocks {outside} outside this model's "
            f"{layer_count} transformer blocks (0..{layer_count - 1}); use blocks in that range "
            f"(the official LTX-2 default [29] is for the 48-block model), or set the {modality} stg scale to 0"
        )


@dataclass(frozen=True)
class TransformerDims:
    """The transformer dimensions the memory estimate needs (defaults: the LTX-2 19B model)."""

    num_layers: int = 48
    video_heads: int = 32
    video_head_dim: int = 128
    audio_heads: int = 32
    audio_head_dim: int = 64
    parameter_count: int = 19_000_000_000

    @property
    def video_dim(self) -> int:
        return self.video_heads * self.video_head_dim

    @property
    def audio_dim(self) -> int:
        return self.audio_heads * self.audio_head_dim

    @classmethod
    def from_checkpoint(cls, checkpoint_path: str) -> TransformerDims:
        """From an LTX-2 checkpoint's header: its config metadata and its transformer tensor sizes."""
        from safetensors import safe_open

        with safe_open(checkpoint_path, framework="pt") as checkpoint:
            config = json.loads((checkpoint.metadata() or {}).get("config", "{}"))
            parameter_count = sum(
                math.prod(checkpoint.get_slice(key).get_shape())
                for key in checkpoint.keys()  # noqa: SIM118 - safe_open is not a mapping
                if key.startswith("model.diffusion_model.") and "_embeddings_connector." not in key
            )
        return cls.from_config(config.get("transformer", {}), parameter_count)

    @classmethod
    def from_config(cls, transformer_config: dict, parameter_count: int) -> TransformerDims:
        """From the ``transformer`` section of a checkpoint's config metadata."""
        return cls(
            num_layers=transformer_config.get("num_layers", 48),
            video_heads=transformer_config.get("num_attention_heads", 32),
            video_head_dim=transformer_config.get("attention_head_dim", 128),
            audio_heads=transformer_config.get("audio_num_attention_heads", 32),
            audio_head_dim=transformer_config.get("audio_attention_head_dim", 64),
            parameter_count=parameter_count,
        )


# Live activations at the peak of one block, in units of tokens x model width: the residual
# stream, its normalised copy, q, k, v and the attention output (6), and the feed-forward hidden
# layer with its activation (2 x 4 = 8). The rotary tables add about 2 more (cos and sin).
ACTIVATION_WIDTHS_PER_TOKEN = 16


@dataclass(frozen=True)
class MemoryEstimate:
    weight_bytes: int
    activation_bytes: int
    video_tokens: int
    audio_tokens: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes


def estimate_memory_bytes(
    height: int,
    width: int,
    num_frames: int,
    frame_rate: float = 24.0,
    dims: TransformerDims | None = None,
    dtype: torch.dtype = torch.bfloat16,
    sp_degree: int = 1,
    text_tokens: int = 1024,
) -> MemoryEstimate:
    """Memory one rank needs to run the transformer at this size (one pass at a time).

    Video tokens are (F'=(frames-1)/8+1) x H/32 x W/32; audio tokens are 25 per second. Attention
    is assumed fused (no tokens x tokens score matrix, as with PyTorch's SDPA kernels on unmasked
    attention); sequence parallelism splits the video activations over ``sp_degree`` ranks, while
    the weights stay whole on every rank.
    """
    dims = TransformerDims() if dims is None else dims
    element_bytes = torch.empty((), dtype=dtype).element_size()
    video_tokens = ((num_frames - 1) // 8 + 1) * (height // 32) * (width // 32)
    audio_tokens = round(num_frames / frame_rate * 25)
    video_per_rank = -(-video_tokens // sp_degree)
    activation_elements = ACTIVATION_WIDTHS_PER_TOKEN * (
        video_per_rank * dims.video_dim + audio_tokens * dims.audio_dim
    ) + 2 * text_tokens * (dims.video_dim + dims.audio_dim)
    return MemoryEstimate(
        weight_bytes=dims.parameter_count * element_bytes,
        activation_bytes=activation_elements * element_bytes,
        video_tokens=video_tokens,
        audio_tokens=audio_tokens,
    )


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device, or the RAM available to new allocations on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_fits(
    estimate: MemoryEstimate, device: torch.device, available_bytes: int | None = None, weights_resident: bool = False
) -> None:
    """Refuse a job whose estimate exceeds what ``device`` has free.

    ``weights_resident``: the weights are already loaded (and so already missing from the free
    memory); count only the activations.
    """
    available = available_memory_bytes(device) if available_bytes is None else available_bytes
    needed = estimate.activation_bytes if weights_resident else estimate.total_bytes
    if needed <= available:
        return
    if not weights_resident and estimate.weight_bytes > available:
        # Every rank holds a full replica of the weights: more GPUs do not help here.
        what_to_do = "the weights alone do not fit; use a device with more free memory"
    else:
        what_to_do = (
            "lower the resolution or the frame count, "
            "or spread the video tokens over more GPUs with sequence parallelism"
        )
    raise ValueError(
        f"this job needs about {needed / GIB:.1f} GiB on {device} "
        f"({estimate.video_tokens} video tokens, {estimate.audio_tokens} audio tokens: "
        f"{estimate.activation_bytes / GIB:.1f} GiB of activations"
        + ("" if weights_resident else f" + {estimate.weight_bytes / GIB:.1f} GiB of weights")
        + f") but only {available / GIB:.1f} GiB is free; {what_to_do}"
    )
