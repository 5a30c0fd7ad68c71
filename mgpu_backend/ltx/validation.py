"""The memory check that runs before any heavy work, and the transformer dimensions it needs.

The torch-free input checks (sizes, frames, steps, sigmas, STG blocks) live in ``schema``, where the
ComfyUI side can run them too. Every error says what was wrong and what to do. The memory estimate
is deliberately simple (weights plus the activations of one transformer block at the peak of a
forward pass) and errs on the side of letting a job run: its purpose is to refuse jobs that cannot
possibly fit (a 4K, 20-second request on one GPU), not to predict the allocator to the megabyte.

Nothing here loads a model or allocates device memory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from mgpu_backend.ltx.safetensors_header import read_header
from mgpu_backend.ltx.schema import VIDEO_SPATIAL_COMPRESSION as SPATIAL
from mgpu_backend.ltx.schema import VIDEO_TEMPORAL_COMPRESSION as TEMPORAL

GIB = 1024**3


@dataclass(frozen=True)
class TransformerDims:
    """The transformer dimensions the memory estimate needs (defaults: the LTX-2.0 19B model).

    They serve LTX-2.3 as they are: its transformer has the same widths, heads and layers and 18.99B
    parameters against 2.0's 18.88B (counted from configs/ at full size). Its "22B" is the whole
    checkpoint (22.08B: the 8-layer text connectors at the stream widths, the VAEs, the vocoder)."""

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
        """From an LTX-2 checkpoint's header: its config metadata and its transformer tensor sizes.

        The transformer's parameters are the ``model.diffusion_model.`` tensors but the text
        connectors': about 19B in both versions (2.0's caption projection; 2.3's gates and
        cross-attention AdaLN; 2.3's text projection lives in the text encoder, outside)."""
        header = read_header(checkpoint_path, "checkpoint", "Choose the LTX-2 audio+video checkpoint.")
        try:
            config = json.loads(header.metadata.get("config", "{}"))
        except ValueError:
            config = {}
        parameter_count = sum(
            math.prod(shape)
            for key, (_, shape) in header.tensors.items()
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
# Measured on an H100 (bench/activation_memory.py, docs/BENCHMARKS.md) the forward grows 25-26.5 widths
# per token on one rank and up to 32.5 under SP. The whole jobs measured up to 1536x1024x121 are still
# estimated within 7% of their peaks, and the plan keeps headroom; longer or larger videos on tight caps
# are where 16 falls short (refitting it means refitting the stages' estimates with it).
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
    video_tokens = ((num_frames - 1) // TEMPORAL + 1) * (height // SPATIAL) * (width // SPATIAL)
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
    """What new allocations of this process can get: on a GPU, its free memory plus what this
    process's allocator holds unused, and no more than the rank's limit (``MGPU_MEMORY_LIMIT_GIB``, or
    the GPU's memory times the process's memory fraction) less what it has allocated, so a rank
    capped below its GPU, or sharing it with others, is checked against its own share; on CPU the
    RAM available to new allocations."""
    device = torch.device(device)
    if device.type == "cuda":
        from mgpu_backend.ltx.residency import device_memory_bytes  # here: residency imports FSDP (a second)

        free, _total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - allocated
        return max(0, min(int(free) + cached, device_memory_bytes(device) - allocated))
    available = host_available_bytes()
    return available if available is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def host_available_bytes() -> int | None:
    """The kernel's MemAvailable (what new allocations can get without swapping); None off Linux."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
