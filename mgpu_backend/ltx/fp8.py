"""FP8 transformer weights: ltx-core's fp8-cast policy, and Lightricks' fp8 checkpoint files.

What it is
    ``quantization="fp8-cast"`` is the official single-GPU runner's ``--quantization fp8-cast``
    (``ltx_core.quantization.QuantizationPolicy.fp8_cast()``): while the transformer is loaded, the
    weights and biases of the attention projections (``to_q``, ``to_k``, ``to_v``, ``to_out.0``) and
    of the feed-forward layers of every block are cast to float8_e4m3fn and stay so on the device;
    every ``Linear`` upcasts its weight to the input's dtype for each forward (ltx-core's module op).
    Everything else (norms, AdaLN, patchify and projection layers) stays in the load dtype. The
    transformer then takes about half the memory (19B: 37.8 GB in bf16, 19.2 GB fp8-cast), the
    compute is the same bf16 matmul, and the outputs differ from bf16 by the rounding of the weights.

    LoRAs fuse into the fp8 weights as ltx-core fuses them (``ltx_core.loader.fuse_loras``): the
    delta is computed in bf16, added to the upcast weight and the sum cast back to fp8 (on CUDA
    with ltx-core's stochastic-rounding kernel, seed 0, so a fusion is repeatable).

Fp8 checkpoint files
    Lightricks also publishes fp8 checkpoints (``ltx-2-19b-dev-fp8.safetensors``): the same layers
    stored as float8_e4m3fn, each with a float32 per-tensor ``<layer>.weight_scale`` (the real
    weight is ``weight * weight_scale``) and an ``<layer>.input_scale`` used only by fp8 scaled
    matmul kernels. ltx-core 1.0.0 drops the scales on load, so fp8-cast on such a file upcasts
    without them (weights several hundred times too large: noise). Here such a file loads:

    - in bf16 (no quantization): dequantized on load, ``(weight.float() * scale).to(bf16)``, as
      ComfyUI does;
    - fp8-cast: the stored fp8 bytes are kept with their scale (a ``weight_scale`` buffer on the
      layer), and the layer upcasts ``(weight.float() * scale).to(input dtype)`` per forward, so a
      weight is exactly the one the bf16 load builds. LoRAs fuse into the dequantized weight and
      are re-quantized with the layer's own scale (ComfyUI's way): the scale never changes, so the
      clean fp8 bytes restore a layer exactly.

    A file stored as fp8 without scales (cast only) is upcast on load in bf16 and kept in fp8-cast.
    ``input_scale`` is ignored in both modes (no fp8 matmul runs here).

This module never edits or forks ltx-core and never reads weights itself: the loader does.
"""

from __future__ import annotations

import types

import torch
from ltx_core.loader.fuse_loras import apply_loras
from ltx_core.loader.primitives import LoraStateDictWithStrength, StateDict
from ltx_core.loader.sd_ops import SDOps
from ltx_core.model.transformer import LTXV_MODEL_COMFY_RENAMING_MAP
from ltx_core.quantization import QuantizationPolicy

from mgpu_backend.ltx.schema import QUANTIZATIONS, parse_quantization  # noqa: F401 - re-exported for the loader


FP8_DTYPE = torch.float8_e4m3fn
WEIGHT_SCALE_SUFFIX = ".weight_scale"
INPUT_SCALE_SUFFIX = ".input_scale"
_FP8_MAX = torch.finfo(FP8_DTYPE).max


def policy(quantization: str | None) -> QuantizationPolicy | None:
    """ltx-core's policy for the option (None: no quantization)."""
    return QuantizationPolicy.fp8_cast() if parse_quantization(quantization) == "fp8-cast" else None


def transformer_sd_ops(quantization: str | None) -> SDOps:
    """The key operations the transformer's state dict is loaded with: ltx-core's checkpoint
    renaming, followed by the policy's downcast as ltx-pipelines' ModelLedger chains them."""
    chosen = policy(quantization)
    if chosen is None or chosen.sd_ops is None:
        return LTXV_MODEL_COMFY_RENAMING_MAP
    base = LTXV_MODEL_COMFY_RENAMING_MAP
    return SDOps(name=f"sd_ops_chain_{base.name}+{chosen.sd_ops.name}", mapping=(*base.mapping, *chosen.sd_ops.mapping))


def downcast_by_policy(key: str, quantization: str | None) -> bool:
    """Whether the policy stores transformer key ``key`` (model naming) in fp8."""
    chosen = policy(quantization)
    if chosen is None or chosen.sd_ops is None:
        return False
    probe = torch.empty((), dtype=torch.bfloat16, device="meta")
    return any(result.new_value.dtype == FP8_DTYPE for result in chosen.sd_ops.apply_to_key_value(key, probe))


# --- From the loaded state dict to the module's tensors ---------------------------------------------


def _layer(key: str) -> str | None:
    return key[: -len(".weight")] if key.endswith(".weight") else None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The real weight of a scaled fp8 tensor, in ``dtype`` (the product taken in float32)."""
    return (weight.float() * scale.float().to(weight.device)).to(dtype)


def quantize_with_scale(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight`` stored as fp8 under a fixed per-tensor ``scale`` (saturating at the fp8 range)."""
    return (weight.float() / scale.float().to(weight.device)).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)


def module_tensors(loaded: dict[str, torch.Tensor], dtype: torch.dtype, quantization: str | None) -> tuple[dict, dict]:
    """What the transformer module gets from its loaded state dict: ``(tensors, scales)``.

    ``tensors``: fp8 tensors kept as they are under a quantization, dequantized (scaled) or cast
    (cast-only) to ``dtype`` without; everything else in ``dtype``. A tensor already in ``dtype``
    is passed through, not copied. ``scales``: under a quantization, each scaled fp8 layer's
    float32 ``weight_scale`` (model naming of the layer -> scale), to be attached by
    ``attach_scaled_upcast``. Scale keys themselves never reach the module as weights.
    """
    tensors, scales = {}, {}
    for key, value in loaded.items():
        if key.endswith(INPUT_SCALE_SUFFIX) or key.endswith(WEIGHT_SCALE_SUFFIX):
            continue
        layer = _layer(key)
        scale = loaded.get(layer + WEIGHT_SCALE_SUFFIX) if layer is not None and value.dtype == FP8_DTYPE else None
        if value.dtype == FP8_DTYPE and quantization is not None:
            tensors[key] = value
            if scale is not None:
                scales[layer] = scale.float()
        elif scale is not None:
            tensors[key] = dequantize(value, scale, dtype)
        else:
            tensors[key] = value.to(dtype)
    return tensors, scales


def apply_upcast_module_ops(velocity_model: torch.nn.Module, quantization: str | None) -> torch.nn.Module:
    """The policy's module operations (ltx-core's per-layer upcast) on a built velocity model."""
    chosen = policy(quantization)
    for module_op in () if chosen is None else chosen.module_ops:
        if module_op.matcher(velocity_model):
            velocity_model = module_op.mutator(velocity_model)
    return velocity_model


def cast_to_fp8_(velocity_model: torch.nn.Module) -> torch.nn.Module:
    """Apply fp8-cast to a velocity model already built in bf16 (a random benchmark model): the
    policy's parameters become float8_e4m3fn in place (their bf16 storage is freed) and the policy's
    module ops run. The same tensors a load with ``quantization="fp8-cast"`` makes."""
    for name, parameter in list(velocity_model.named_parameters()):
        if downcast_by_policy(name, "fp8-cast"):
            owner_name, _, attribute = name.rpartition(".")
            owner = velocity_model.get_submodule(owner_name)
            owner._parameters[attribute] = torch.nn.Parameter(parameter.detach().to(FP8_DTYPE), requires_grad=False)
            del parameter
    return apply_upcast_module_ops(velocity_model, "fp8-cast")


def _scaled_upcast_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = dequantize(layer.weight, layer.weight_scale, x.dtype)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def attach_scaled_upcast(velocity_model: torch.nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Give each scaled fp8 layer its scale (a ``weight_scale`` buffer, so it moves and is counted
    with the model) and a forward that upcasts with it; the other layers keep ltx-core's upcast."""
    for layer_name, scale in scales.items():
        layer = velocity_model.get_submodule(layer_name)
        if not isinstance(layer, torch.nn.Linear):
            raise ValueError(f"the checkpoint has an fp8 weight scale for {layer_name}, which is not a linear layer")
        layer.register_buffer("weight_scale", scale.reshape(()))
        layer.forward = types.MethodType(_scaled_upcast_forward, layer)


# --- LoRA fusion --------------------------------------------------------------------------------------


def fuse_loras_into(
    key: str, weight: torch.Tensor, loras: list[LoraStateDictWithStrength], dtype: torch.dtype, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight`` (key ``key``) with ``loras`` fused, in ``dtype``, by ltx-core's ``apply_loras`` (bf16
    and cast-only fp8 weights exactly as ltx-core fuses them). A scaled fp8 weight (``scale``) is
    dequantized to bf16 first; fused into ``dtype`` fp8 it is re-quantized with its unchanged scale."""
    if scale is not None:
        dequantized = dequantize(weight, scale, torch.bfloat16)
        if dtype == FP8_DTYPE:
            return quantize_with_scale(fuse_loras_into(key, dequantized, loras, torch.bfloat16), scale)
        weight = dequantized
    state_dict = StateDict(sd={key: weight}, device=weight.device, size=weight.nbytes, dtype={weight.dtype})
    return apply_loras(state_dict, loras, dtype=dtype).sd[key]


def lora_targets(keys, loras: list[LoraStateDictWithStrength]) -> set[str]:
    """Keys ltx-core's fusion changes: ``<layer>.weight`` with both ``lora_A`` and ``lora_B`` in some LoRA."""
    touched = set()
    for key in keys:
        layer = _layer(key)
        if layer is not None:
            halves = (f"{layer}.lora_A.weight", f"{layer}.lora_B.weight")
            if any(all(half in lora.sd for half in halves) for lora, _ in loras):
                touched.add(key)
    return touched

