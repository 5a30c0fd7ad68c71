"""The project's one recipe for random LTX-2 weights: which distribution each tensor gets, drawn two ways.

Compute does not depend on the weights' values, but activations must stay in range through 48
blocks, a VAE and a vocoder, as with a trained model. ``weight_rule`` says what each tensor is
(from its name and shape, whichever component or file it sits in); the two samplers draw it:

- ``named_random_tensor``: on the host, one tensor at a time, from a generator seeded by the
  tensor's own name, so adding a tensor never changes the others (the tiny bundles);
- ``materialize_random_``: on a device, a whole meta-built module filled in place from one
  generator in state-dict order (full-size bundles and benchmark models: drawing 19B numbers on the
  host is slow, and a 19B model must never exist on the host or in fp32).

Both samplers keep the values they drew when first written, so bundles already on disk stay
valid; the two differences between them are stated in ``materialize_random_``. This module never
touches files or ltx-core.
"""

from __future__ import annotations

import math
import zlib

import torch

NAME_SEED = 0x17C2
"""Mixed into every name-seeded generator (changing it changes every tiny-bundle weight)."""


def weight_rule(key: str, shape: tuple[int, ...]) -> str:
    """What a tensor is, by its state-dict or file key and shape:

    "positive": latent statistics (``std-of-means``), U(0.5, 1.5); "scale": the video decoder's
    timestep scale, 1000 as in the real model; "uniform": connector registers, U(-1, 1);
    "lora_b": a LoRA's B matrix; "matrix": any other tensor of 2+ dims, N(0, 1/fan_in); "gemma_gain":
    a Gemma-3 RMSNorm gain, which Gemma applies as (1 + weight); "gain": any other norm gain;
    "small": every other vector, N(0, 0.02^2).
    """
    if key.endswith("std-of-means"):
        return "positive"
    if key.endswith("timestep_scale_multiplier"):
        return "scale"
    if key.endswith("learnable_registers"):
        return "uniform"
    if key.endswith("lora_B.weight"):
        return "lora_b"
    if len(shape) >= 2:
        return "matrix"
    if key.endswith(".weight") and "norm" in key.split(".")[-2]:
        # The language model's and the projector's norms are Gemma RMSNorms; the vision tower's are LayerNorms.
        return "gemma_gain" if "language_model." in key or "multi_modal_projector." in key else "gain"
    return "small"


def named_random_tensor(name: str, shape: tuple[int, ...], rule: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """One tensor on the host, drawn for ``rule`` from a generator seeded by ``name``.

    Gains are 1 + N(0, 0.02^2) and Gemma gains N(0, 0.02^2) (the same 1 + small noise once Gemma
    adds its 1); a LoRA B is N(0, 0.05^2): trained B matrices are small but not zero, about a tenth
    of the base weight's scale.
    """
    if rule == "scale":
        return torch.full(shape, 1000.0, dtype=dtype)
    generator = torch.Generator().manual_seed(NAME_SEED ^ zlib.crc32(name.encode("utf-8")))
    if rule == "positive":
        values = 0.5 + torch.rand(shape, generator=generator)
    elif rule == "uniform":
        values = torch.rand(shape, generator=generator) * 2.0 - 1.0
    else:
        values = torch.randn(shape, generator=generator)
        if rule == "matrix":
            values = values / math.prod(shape[1:]) ** 0.5
        elif rule in ("small", "gemma_gain"):
            values = values * 0.02
        elif rule == "lora_b":
            values = values * 0.05
        elif rule == "gain":
            values = 1.0 + values * 0.02
        else:
            raise AssertionError(rule)
    return values.to(dtype)


def materialize_random_(module: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """Give a module built on the meta device real, seeded random weights on ``device`` in ``dtype``.

    The meta module is cast, its storage is allocated once on the device, and each tensor is filled
    in place from one device generator (state-dict order, so the same seed gives the same weights on
    the same device type). ``weight_rule``'s distributions, except that every gain is exactly 1
    (Gemma's too, so Gemma's norms scale by 2) and a LoRA B is a matrix like any other, N(0, 1/rank):
    neither changes what a benchmark measures.
    """
    module = module.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, tensor in _named_tensors(module):
            if tensor.is_floating_point():
                fill_random_(tensor, weight_rule(name, tuple(tensor.shape)), generator)
    leftover = [name for name, tensor in _named_tensors(module) if tensor.is_meta]
    assert not leftover, f"tensors left on the meta device: {leftover[:5]}"
    return module.eval()


def fill_random_(tensor: torch.Tensor, rule: str, generator: torch.Generator, fan_in: int | None = None) -> torch.Tensor:
    """Fill ``tensor`` in place with ``rule``'s distribution (``materialize_random_``'s variant of
    ``weight_rule``). ``fan_in``: a matrix's input width when ``tensor`` is only some of its rows
    (a weight shard), else read from its shape."""
    if rule == "positive":
        tensor.uniform_(0.5, 1.5, generator=generator)
    elif rule == "scale":
        tensor.fill_(1000.0)
    elif rule == "uniform":
        tensor.uniform_(-1.0, 1.0, generator=generator)
    elif rule in ("matrix", "lora_b"):
        tensor.normal_(0.0, (fan_in or math.prod(tensor.shape[1:])) ** -0.5, generator=generator)
    elif rule in ("gain", "gemma_gain"):
        tensor.fill_(1.0)
    else:
        tensor.normal_(0.0, 0.02, generator=generator)
    return tensor


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    # Parameters and all buffers, persistent or not: a meta buffer left unfilled would fail later.
    return list(module.named_parameters()) + list(module.named_buffers())
