"""Fleet jobs for benchmarks and ``doctor``: the real stage-1 path on a random full-size transformer.

No LTX-2 weights exist on the machines this project is measured on, and compute does not depend on
the weights' values: ``random_transformer`` builds ltx-core's LTXModel at a given configuration
(for example the 19B one in shared/configs) directly on the device with seeded random weights, so
two processes that build it with the same seed hold the same weights. ``bench_stage1`` runs the
fleet's own stage-1 code (plan, SP, guidance passes, progress and cancel points) on it.

Nothing here is used by the user-facing jobs.
"""

from __future__ import annotations

import json
import math
import time

import torch
from ltx_core.model.transformer import LTXModelConfigurator, X0Model

from .jobs import JobContext, JobInputError, job
from .ltx.jobs import _float, _guider, _int, run_stage1
from .ltx.stages import GenerationParams, transformer_layer_count
from .ltx.text import TextContext
from .ltx.validation import TransformerDims


def random_transformer(config: dict, device: torch.device, dtype: torch.dtype, seed: int) -> X0Model:
    """ltx-core's X0Model(LTXModel) at ``config`` with seeded random weights, built on ``device``."""
    with torch.device("meta"):
        velocity_model = LTXModelConfigurator.from_config(config)
    return X0Model(materialize_random_(velocity_model, device, dtype, seed)).eval()


def materialize_random_(module: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Give a module built on the meta device real, seeded random weights on ``device`` in ``dtype``.

    Built this way a 19B model never exists on the host or in fp32: the meta module is cast, its
    storage is allocated once on the device, and each tensor is filled in place from one device
    generator (state-dict order, so the same seed gives the same weights on the same device type).
    Scales keep activations in range, like a trained model's: matrices N(0, 1/fan_in), norm gains
    1, other vectors N(0, 0.02^2); the latent statistics and the VAE decoder's timestep scale get
    the positive values their role needs. The same rules as the tiny bundle's weights
    (mgpu_backend/ltx/tiny.py), drawn on the device because drawing 19B numbers on the host is slow.
    """
    module = module.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, tensor in _named_tensors(module):
            if not tensor.is_floating_point():
                continue
            if name.endswith("std-of-means"):
                tensor.uniform_(0.5, 1.5, generator=generator)
            elif name.endswith("timestep_scale_multiplier"):
                tensor.fill_(1000.0)
            elif name.endswith("learnable_registers"):
                tensor.uniform_(-1.0, 1.0, generator=generator)
            elif tensor.ndim >= 2:
                tensor.normal_(0.0, math.prod(tensor.shape[1:]) ** -0.5, generator=generator)
            elif name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]:
                tensor.fill_(1.0)
            else:
                tensor.normal_(0.0, 0.02, generator=generator)
    leftover = [name for name, tensor in _named_tensors(module) if tensor.is_meta]
    assert not leftover, f"tensors left on the meta device: {leftover[:5]}"
    return module.eval()


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    # Parameters and all buffers, persistent or not: a meta buffer left unfilled would fail later.
    return list(module.named_parameters()) + list(module.named_buffers())


def random_contexts(caption_channels: int, device: torch.device, dtype: torch.dtype, seed: int, tokens: int = 1024) -> tuple[TextContext, TextContext]:
    """Positive and negative text contexts of the shape the embeddings processor returns."""
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    make = lambda: torch.randn(1, tokens, caption_channels, device=device, dtype=dtype, generator=generator)  # noqa: E731
    return TextContext(make(), make()), TextContext(make(), make())


class RandomModel:
    """Stands in for ``ResidentModel`` where only the stage-1 transformer is needed."""

    def __init__(self, config: dict, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.model = random_transformer(config, device, dtype, seed)

    def transformer(self, lora_set: str = "none") -> X0Model:
        return self.model

    def layer_count(self) -> int:
        return transformer_layer_count(self.model)

    def attention_heads(self) -> tuple[int, int]:
        block = self.model.velocity_model.transformer_blocks[0]
        return block.attn1.heads, block.audio_attn1.heads


@job("bench_stage1")
def bench_stage1(ctx: JobContext, args: dict, tensors: dict):
    """Stage 1 of the fleet on a random transformer; returns step times and the latents."""
    config = args.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("transformer"), dict):
        raise JobInputError("bench_stage1 needs 'config' with a 'transformer' section (shared/configs/*.json)")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.get("dtype", "bfloat16")]
    seed = _int(args, "seed", 10, 0, 2**31)
    key = ("random_model", json_key(config), dtype, seed)
    if ctx.state.get("bench_key") != key:
        ctx.state.pop("bench_model", None)
        ctx.state["bench_model"] = RandomModel(config, ctx.device, dtype, seed)
        ctx.state["bench_key"] = key
    model = ctx.state["bench_model"]
    layers = model.layer_count()
    params = GenerationParams(
        height=_int(args, "height", 512, 32, 8192), width=_int(args, "width", 768, 32, 8192),
        num_frames=_int(args, "num_frames", 121, 1, 100_000), frame_rate=_float(args, "frame_rate", 24.0, 1.0, 240.0),
        seed=seed, num_inference_steps=_int(args, "steps", 4, 1, 1000),
        video_guider=_guider(args, "video_guidance", layers), audio_guider=_guider(args, "audio_guidance", layers),
        two_stage=False,
    )  # fmt: skip
    positive, negative = random_contexts(config["transformer"]["caption_channels"], ctx.device, dtype, seed)
    original_step = ctx.step
    marks: list[float] = []

    def timed_step(stage: str, step: int, total: int) -> None:
        original_step(stage, step, total)  # synchronises the device first, then the cancel point
        marks.append(time.perf_counter())

    ctx.step = timed_step
    started = time.perf_counter()
    dims = TransformerDims.from_config(config["transformer"], sum(p.numel() for p in model.model.parameters()))
    fields, out = run_stage1(ctx, model, params, positive, negative, None, args.get("parallel", "auto"), dims)
    boundaries = [started, *marks]
    fields["step_seconds"] = [b - a for a, b in zip(boundaries, boundaries[1:])]
    fields["video_tokens"] = params.stage1.video_tokens
    fields["audio_tokens"] = params.stage1.audio_tokens
    if ctx.device.type == "cuda":
        fields["peak_memory_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    return fields, out


def json_key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)
