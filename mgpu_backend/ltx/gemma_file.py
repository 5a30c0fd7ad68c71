"""Gemma-3 as ComfyUI ships it: one ``.safetensors`` file in ``models/text_encoders``.

What it is
    ComfyUI's LTX-2 templates load Gemma-3 12B from a single file (``gemma_3_12B_it.safetensors``,
    or its quantized twins) in ComfyUI's own layout: the text stack under ``model.*``
    (``model.embed_tokens``, ``model.layers.N.*``, ``model.norm``), the vision tower under
    ``vision_model.*``, the projector under ``multi_modal_projector.*``, and the SentencePiece
    tokenizer embedded as the uint8 tensor ``spiece_model``. No config travels with it.

    This module reads such a file for the fleet: ``inspect_gemma_file`` checks it from its header
    (and a few bytes) before any heavy work and says what is wrong in words a user can act on;
    ``GemmaFileWeights`` reads the text stack under the names ``GemmaEncoder`` expects (they are
    ComfyUI's, unchanged), dequantizing fp8 scaled and NVFP4 weights; ``SentencePieceGemmaTokenizer``
    tokenizes exactly as the Gemma folder's tokenizer does. ``gemma_folder_to_comfy_file`` writes
    the layout from a Hugging Face Gemma folder (tests, bundles, users who want one file); run it
    as ``python -m mgpu_backend.ltx.gemma_file GEMMA_FOLDER OUT.safetensors``.

Config
    The text config is the known Gemma-3 12B one (ltx-core's), and the tensor shapes must agree
    with it. A file written by ``gemma_folder_to_comfy_file`` also carries its folder's text config
    in the ``gemma_text_config`` metadata entry (a smaller test Gemma, say); then that config is
    used, and the shapes are checked against it.

Quantized files (dequantized on load, in float32, rounded once to the loader's dtype: Gemma then
runs at bf16 with the file's values; the file saves disk, not GPU memory)
    fp8 scaled: weights ``float8_e4m3fn``/``float8_e5m2`` with a per-tensor ``weight_scale`` (or the
    older ``scale_weight`` + ``scaled_fp8`` marker); value = fp8 x scale.
    NVFP4 (``gemma_3_12B_it_fp4_mixed.safetensors``, the file most LTX-2 templates name): layers
    whose ``comfy_quant`` says ``nvfp4`` hold two E2M1 codes per byte (high nibble first), one
    fp8 E4M3 scale per 16 values along a row, stored in cuBLAS's tiled block-scale layout
    (128 x 4 tiles), and a per-tensor float32 ``weight_scale_2``; value = E2M1 x block scale x
    tensor scale. The other layers of a "mixed" file are plain bf16.
    Any other format (int8, ...) is refused before any work, naming the file to use instead.

Never imports ComfyUI, never downloads anything, never writes outside the path it is given.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from ltx_core.loader.primitives import StateDict
from ltx_core.loader.sd_ops import SDOps

from mgpu_backend.ltx.gemma_encoder import GEMMA_MAX_TOKENS

COMFY_GEMMA_FILE = "gemma_3_12B_it.safetensors"
"""ComfyUI's bf16 Gemma-3 12B for LTX-2 (Comfy-Org/ltx-2, split_files/text_encoders/)."""

TOKENIZER_KEY = "spiece_model"
CONFIG_METADATA_KEY = "gemma_text_config"

COMFY_GEMMA_KEY_OPS = SDOps("COMFY_GEMMA_TEXT_KEY_OPS").with_matching(prefix="model.")
"""ComfyUI's text-stack keys are GemmaEncoder's own (``model.layers.0.self_attn.q_proj.weight``):
keep them, and leave the vision tower, the projector and the tokenizer tensor out."""

_FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_FLOAT_DTYPES = {"F32", "F16", "BF16"}
_LOADABLE_FORMATS = ("float8_e4m3fn", "float8_e5m2", "nvfp4")
# E2M1 (fp4) codes 0-7 and, with the sign bit 8 set, their negatives.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_NVFP4_BLOCK = 16
# Tensors of ComfyUI's quantized layouts that are not weights of their own.
_QUANT_SUFFIXES = (".weight_scale", ".scale_weight", ".weight_scale_2", ".input_scale", ".scale_input", ".comfy_quant")

_REMEDY = (
    f"Use Gemma-3 12B as ComfyUI ships it for LTX-2 ({COMFY_GEMMA_FILE}, or its fp8 scaled or fp4_mixed version, in "
    "models/text_encoders) or a Gemma-3 Hugging Face folder (e.g. gemma-3-12b-it-qat-q4_0-unquantized)."
)


def _model_file_error(message: str):
    from mgpu_backend.ltx.schema import ModelFileError

    return ModelFileError(message)


# --- Checks before any heavy work ------------------------------------------------------------------


@dataclass(frozen=True)
class GemmaFile:
    """What ``inspect_gemma_file`` found: the text config to build, and how the weights are stored."""

    path: str
    text_config: dict
    quantized_layers: dict[str, int]  # format -> text-stack weights stored so (dequantized on load)


def known_gemma_text_config() -> dict:
    """Gemma-3 12B's text config as LTX-2 uses it (ltx-core's copy of the released config.json)."""
    from ltx_core.text_encoders.gemma.config import GEMMA3_CONFIG_FOR_LTX

    return GEMMA3_CONFIG_FOR_LTX.to_dict()["text_config"]


def inspect_gemma_file(path: str) -> GemmaFile:
    """Check that ``path`` is a Gemma-3 text encoder in ComfyUI's layout that the fleet can run.

    Reads the header, the tiny ``comfy_quant`` entries of a quantized file and nothing else; raises
    ModelFileError naming the file and the fix.
    """
    from mgpu_backend.ltx.safetensors_header import read_header

    header = read_header(path, "Gemma text encoder", _REMEDY)
    tensors = header.tensors
    if any(name.startswith(("language_model.model.", "model.language_model.")) for name in tensors):
        raise _model_file_error(
            f"Gemma text encoder {path} is one shard of a Hugging Face Gemma folder, not ComfyUI's single file; "
            "point gemma_root at the folder that holds it (with its config.json and tokenizer)"
        )
    if any(".lora_" in name or name.endswith((".lora_down.weight", ".lora_up.weight")) for name in tensors):
        raise _model_file_error(
            f"{path} is a LoRA (e.g. ComfyUI's gemma-3-12b-it-abliterated LoRA), not a Gemma-3 text encoder; the fleet "
            f"applies no LoRA to Gemma, so choose the Gemma file itself. {_REMEDY}"
        )
    if "model.embed_tokens.weight" not in tensors or not any(k.startswith("model.layers.") for k in tensors):
        what = "an LTX-2 checkpoint" if any(k.startswith("model.diffusion_model.") for k in tensors) else "another model"
        raise _model_file_error(
            f"{path} is {what}, not a Gemma-3 text encoder in ComfyUI's layout (no model.embed_tokens / model.layers "
            f"weights). {_REMEDY}"
        )
    if not any(k.startswith("model.layers.") and k.endswith(".self_attn.q_norm.weight") for k in tensors):
        raise _model_file_error(
            f"{path} is not a Gemma-3 text encoder (its attention has no q_norm, as Gemma-2 and other models do). {_REMEDY}"
        )
    if TOKENIZER_KEY not in tensors or tensors[TOKENIZER_KEY][0] != "U8":
        raise _model_file_error(
            f"Gemma text encoder {path} has no embedded SentencePiece tokenizer (uint8 tensor {TOKENIZER_KEY!r}), which "
            f"ComfyUI's Gemma files carry. {_REMEDY}"
        )
    formats = _weight_formats(path, header)
    text_config = _text_config(path, header.metadata)
    _check_shapes(path, _logical_shapes(tensors, formats), text_config)
    quantized: dict[str, int] = {}
    for fmt in formats.values():
        if fmt != "plain":
            quantized[fmt] = quantized.get(fmt, 0) + 1
    return GemmaFile(path=path, text_config=text_config, quantized_layers=quantized)


def text_stack_tensors(path: str) -> dict:
    """The header entries (dtype, shape) of the text-stack tensors the fleet builds from the file: the
    ``model.*`` weights, NVFP4 ones at their unpacked shape, without the quantization scales, the vision
    tower, the projector or the tokenizer (what the residency plan sizes Gemma by)."""
    from mgpu_backend.ltx.safetensors_header import read_header

    header = read_header(path, "Gemma text encoder", _REMEDY)
    shapes = _logical_shapes(header.tensors, _weight_formats(path, header))
    return {
        name: entry for name, entry in shapes.items()
        if name.startswith("model.") and not name.endswith(_QUANT_SUFFIXES) and not name.endswith(".scaled_fp8")
    }  # fmt: skip


def _weight_formats(path: str, header) -> dict[str, str]:
    """Text-stack weight -> how it is stored ("plain", "float8_e4m3fn", "float8_e5m2", "nvfp4"); anything
    the fleet cannot dequantize is refused here, naming the file to use instead."""
    declared = _declared_formats(path, header)
    formats: dict[str, str] = {}
    unloadable = sorted({fmt for fmt in declared.values() if fmt not in _LOADABLE_FORMATS})
    for name, (dtype, _) in header.tensors.items():
        if not name.startswith("model.") or name.endswith(_QUANT_SUFFIXES) or name.endswith(".scaled_fp8"):
            continue
        layer = name.removesuffix(".weight")
        if dtype in _FLOAT_DTYPES:
            formats[name] = "plain"
        elif dtype in _FP8_DTYPES:
            formats[name] = "float8_e4m3fn" if dtype == "F8_E4M3" else "float8_e5m2"
        elif (
            dtype == "U8"
            and declared.get(layer) == "nvfp4"
            and f"{layer}.weight_scale" in header.tensors
            and f"{layer}.weight_scale_2" in header.tensors
        ):
            formats[name] = "nvfp4"
        else:
            unloadable.append(declared.get(layer) or f"{dtype} tensors")
    if unloadable:
        raise _model_file_error(
            f"Gemma text encoder {path} stores its weights as {', '.join(sorted(set(unloadable)))}, a format the fleet "
            f"cannot dequantize; it loads the bf16 file {COMFY_GEMMA_FILE}, fp8 scaled and NVFP4 files: download "
            f"{COMFY_GEMMA_FILE} from Comfy-Org/ltx-2 (split_files/text_encoders) into models/text_encoders and choose it"
        )
    return formats


def _logical_shapes(tensors: dict, formats: dict[str, str]) -> dict:
    """The header's tensors with an NVFP4 weight's packed shape (rows, columns / 2) as the layer's (rows, columns)."""
    shapes = dict(tensors)
    for name, fmt in formats.items():
        if fmt == "nvfp4":
            dtype, (rows, half_columns) = tensors[name]
            shapes[name] = (dtype, (rows, 2 * half_columns))
    return shapes


def _declared_formats(path: str, header) -> dict[str, str]:
    """Layer -> quantization format, as ComfyUI declares it (per-layer ``comfy_quant`` or file metadata)."""
    formats: dict[str, str] = {}
    quant_metadata = header.metadata.get("_quantization_metadata")
    if quant_metadata:
        try:
            for layer, conf in json.loads(quant_metadata).get("layers", {}).items():
                formats[layer] = str(conf.get("format"))
        except (ValueError, AttributeError) as error:
            raise _model_file_error(f"{path} has unreadable _quantization_metadata ({error}). {_REMEDY}") from error
    quant_keys = [name for name in header.tensors if name.endswith(".comfy_quant")]
    if quant_keys:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            for name in quant_keys:
                try:
                    conf = json.loads(f.get_tensor(name).numpy().tobytes())
                except ValueError as error:
                    raise _model_file_error(
                        f"{path}: {name} is not ComfyUI's JSON quantization entry ({error}). {_REMEDY}"
                    ) from error
                formats[name.removesuffix(".comfy_quant")] = str(conf.get("format"))
    return formats


def _text_config(path: str, metadata: dict[str, str]) -> dict:
    config = known_gemma_text_config()
    if CONFIG_METADATA_KEY in metadata:
        try:
            carried = json.loads(metadata[CONFIG_METADATA_KEY])
        except ValueError as error:
            raise _model_file_error(f"{path}: its {CONFIG_METADATA_KEY} metadata is not JSON ({error}). {_REMEDY}") from error
        if not isinstance(carried, dict):
            raise _model_file_error(f"{path}: its {CONFIG_METADATA_KEY} metadata is not a JSON object. {_REMEDY}")
        config.update(carried)
    return config


def _check_shapes(path: str, tensors: dict, config: dict) -> None:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    layers = 1 + max(int(name.split(".")[2]) for name in tensors if name.startswith("model.layers."))
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        expected.update(
            {
                p + "self_attn.q_proj.weight": (config["num_attention_heads"] * head_dim, hidden),
                p + "self_attn.k_proj.weight": (config["num_key_value_heads"] * head_dim, hidden),
                p + "self_attn.q_norm.weight": (head_dim,),
                p + "mlp.gate_proj.weight": (config["intermediate_size"], hidden),
            }
        )
    wrong = [
        f"{name} {tuple(tensors[name][1]) if name in tensors else 'missing'} (expected {shape})"
        for name, shape in expected.items()
        if name not in tensors or tuple(tensors[name][1]) != shape
    ]
    if layers != config["num_hidden_layers"] or wrong:
        found_hidden = tensors.get("model.embed_tokens.weight", (None, (None, None)))[1][-1]
        shown = "; ".join(wrong[:3]) + (f"; and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        raise _model_file_error(
            f"Gemma text encoder {path} (hidden size {found_hidden}, {layers} layers) is not the Gemma-3 model LTX-2 "
            f"conditions on (hidden size {hidden}, {config['num_hidden_layers']} layers)"
            f"{': ' + shown if shown else ''}. {_REMEDY}"
        )


# --- Reading ---------------------------------------------------------------------------------------


class GemmaFileWeights:
    """Reads the text stack of ComfyUI's Gemma file as ltx-core's weight loaders do, fp8 and NVFP4 dequantized.

    ``load(path, sd_ops, device)`` is the protocol of ltx-core's ``SafetensorsStateDictLoader``.
    An fp8 weight becomes ``fp8.float() * weight_scale`` rounded once to ``dtype``: the value
    ComfyUI computes with, and half the host memory of float32 at 12B.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        self.dtype = dtype

    def load(self, path: str | list[str], sd_ops: SDOps | None = None, device: torch.device | None = None) -> StateDict:
        from safetensors import safe_open

        device = device or torch.device("cpu")
        sd: dict[str, torch.Tensor] = {}
        for shard in path if isinstance(path, list) else [path]:
            with safe_open(shard, framework="pt", device="cpu") as f:
                names = set(f.keys())
                for name in sorted(names):
                    if name == TOKENIZER_KEY or name.endswith(_QUANT_SUFFIXES) or name.endswith(".scaled_fp8"):
                        continue
                    key = name if sd_ops is None else sd_ops.apply_to_key(name)
                    if key is None:
                        continue
                    value = f.get_tensor(name)
                    if value.dtype in _FP8_DTYPES.values():
                        value = _dequantize_fp8(f, names, name, value, self.dtype)
                    elif value.dtype == torch.uint8 and f"{name}_scale_2" in names:
                        layer = name.removesuffix(".weight")
                        block_scales = f.get_tensor(f"{layer}.weight_scale")
                        value = dequantize_nvfp4(value, block_scales, f.get_tensor(f"{layer}.weight_scale_2"), self.dtype)
                    sd[key] = value.to(device=device)
        return StateDict(sd=sd, device=device, size=sum(t.nbytes for t in sd.values()), dtype={t.dtype for t in sd.values()})


def _dequantize_fp8(f, names: set[str], name: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    layer = name.removesuffix(".weight")
    scale_name = next((s for s in (f"{layer}.weight_scale", f"{layer}.scale_weight") if s in names), None)
    dequantized = value.to(torch.float32)
    if scale_name is not None:
        scale = f.get_tensor(scale_name).to(torch.float32)
        if scale.numel() != 1:
            raise _model_file_error(
                f"{name}: its fp8 scale {scale_name} has shape {tuple(scale.shape)}, but only per-tensor scales are "
                f"ComfyUI's fp8 scaled format. {_REMEDY}"
            )
        dequantized = dequantized * scale.reshape(())
    return dequantized.to(dtype)


def dequantize_nvfp4(
    packed: torch.Tensor, block_scales: torch.Tensor, tensor_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """An NVFP4 weight as ComfyUI stores it -> ``[rows, 2 x packed columns]`` in ``dtype`` (see the module docstring).

    Computed in float32 and rounded once; in float32 it equals comfy-kitchen's own dequantization bitwise."""
    rows, columns = packed.shape[0], 2 * packed.shape[1]
    codes = torch.stack((packed >> 4, packed & 0x0F), dim=-1).reshape(rows, columns)
    values = torch.tensor(_E2M1_VALUES, dtype=torch.float32)[codes.long()]
    scales = _untile_block_scales(block_scales, rows, columns // _NVFP4_BLOCK).to(torch.float32)
    scales = scales * tensor_scale.to(torch.float32).reshape(())
    blocks = values.reshape(rows, columns // _NVFP4_BLOCK, _NVFP4_BLOCK) * scales.unsqueeze(-1)
    return blocks.reshape(rows, columns).to(dtype)


def _untile_block_scales(tiled: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """cuBLAS's block-scale layout -> ``[rows, columns]``: the padded matrix is cut into 128 x 4 tiles, stored
    tile row by tile row; inside a tile, row 32 * i + j, column c sits at byte 16 * j + 4 * i + c."""
    row_tiles, column_tiles = -(-rows // 128), -(-columns // 4)
    if tiled.numel() != row_tiles * column_tiles * 512:
        raise _model_file_error(
            f"an NVFP4 block-scale tensor holds {tiled.numel()} scales, not the {row_tiles * column_tiles * 512} of "
            f"cuBLAS's tiled layout for a {rows} x {columns * _NVFP4_BLOCK} weight. {_REMEDY}"
        )
    tiles = tiled.reshape(row_tiles, column_tiles, 32, 4, 4)  # [tile row, tile column, j, i, c]
    return tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, column_tiles * 4)[:rows, :columns]


class SentencePieceGemmaTokenizer:
    """The SentencePiece model ComfyUI embeds, tokenizing as the Gemma folder's tokenizer does for LTX-2.

    Same output as ltx-core's ``LTXVGemmaTokenizer.tokenize_with_weights``: the stripped prompt as
    ``<bos>`` + its pieces, cut to ``max_length`` and padded on the left with ``<pad>`` (weight 0).
    """

    def __init__(self, model_proto: bytes, max_length: int = GEMMA_MAX_TOKENS):
        import sentencepiece

        self.processor = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.max_length = max_length
        self.bos_id = self.processor.bos_id()
        pad_id = self.processor.pad_id()
        # As the Hugging Face wrapper does when a model has no pad token: pad with the end token.
        self.pad_id = pad_id if pad_id >= 0 else self.processor.eos_id()

    @classmethod
    def from_file(cls, path: str, max_length: int = GEMMA_MAX_TOKENS) -> SentencePieceGemmaTokenizer:
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return cls(f.get_tensor(TOKENIZER_KEY).numpy().tobytes(), max_length)

    def tokenize_with_weights(self, text: str) -> dict[str, list[tuple[int, int]]]:
        ids = [self.bos_id, *self.processor.encode(text.strip())][: self.max_length]
        padding = [(self.pad_id, 0)] * (self.max_length - len(ids))
        return {"gemma": padding + [(token, 1) for token in ids]}


# --- Writing ---------------------------------------------------------------------------------------

_FOLDER_TO_COMFY_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("vision_tower.vision_model.", "vision_model."),
    ("model.vision_tower.vision_model.", "vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)
_TIED_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def gemma_folder_to_comfy_file(gemma_root: str, out_path: str, weights: str = "bf16") -> str:
    """Write the Gemma-3 of a Hugging Face folder as ComfyUI's single file; returns ``out_path``.

    ``weights``: ``"bf16"`` keeps the folder's tensors as they are (what ``gemma_3_12B_it.safetensors``
    holds); ``"fp8_scaled"`` stores the text stack's linear weights as ComfyUI's fp8 scaled format
    (``float8_e4m3fn``, a per-tensor ``weight_scale`` = amax / 448 and a ``comfy_quant`` entry).
    The folder's text config goes into the ``gemma_text_config`` metadata, so a Gemma other than
    12B (the test bundle's) is read back as what it is. Needs the whole model in host memory.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mgpu_backend.ltx.hf_gemma import gemma_folder_config, gemma_folder_files

    if weights not in ("bf16", "fp8_scaled"):
        raise ValueError(f"weights must be 'bf16' or 'fp8_scaled', got {weights!r}")
    text_config = gemma_folder_config(gemma_root)["text_config"]
    _, weight_paths = gemma_folder_files(gemma_root)
    tensors: dict[str, torch.Tensor] = {}
    for weight_path in weight_paths:
        with safe_open(weight_path, framework="pt") as f:
            for name in f.keys():
                if name in _TIED_HEADS:
                    continue
                prefix = next((p for p, _ in _FOLDER_TO_COMFY_PREFIXES if name.startswith(p)), None)
                if prefix is None:
                    raise _model_file_error(
                        f"{weight_path}: tensor {name} is not part of a Gemma-3 checkpoint; is {gemma_root} a Gemma folder?"
                    )
                tensors[dict(_FOLDER_TO_COMFY_PREFIXES)[prefix] + name[len(prefix) :]] = f.get_tensor(name)
    if weights == "fp8_scaled":
        for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("_proj.weight")]:
            tensors.update(_fp8_scaled(name, tensors[name]))
    tokenizer_path = next(Path(gemma_root).rglob("tokenizer.model"))
    tensors[TOKENIZER_KEY] = torch.frombuffer(bytearray(tokenizer_path.read_bytes()), dtype=torch.uint8)
    partial = f"{out_path}.partial"
    metadata = {CONFIG_METADATA_KEY: json.dumps(text_config)}
    save_file({name: t.contiguous() for name, t in tensors.items()}, partial, metadata=metadata)
    os.replace(partial, out_path)
    return out_path


def _fp8_scaled(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    layer = name.removesuffix(".weight")
    scale = (weight.float().abs().amax() / _FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return {
        name: (weight.float() / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn),
        f"{layer}.weight_scale": scale.reshape(()),
        f"{layer}.comfy_quant": torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8),
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m mgpu_backend.ltx.gemma_file",
        description="Write a Hugging Face Gemma-3 folder as ComfyUI's single text-encoder file (models/text_encoders).",
    )
    parser.add_argument("gemma_root", help="the Gemma-3 folder (config.json, model*.safetensors, tokenizer.model)")
    parser.add_argument("out", help=f"the file to write, e.g. ComfyUI/models/text_encoders/{COMFY_GEMMA_FILE}")
    parser.add_argument("--weights", choices=("bf16", "fp8_scaled"), default="bf16", help="how to store the weights")
    args = parser.parse_args(argv)
    print(gemma_folder_to_comfy_file(args.gemma_root, args.out, args.weights))
    return 0


if __name__ == "__main__":
    sys.exit(main())
