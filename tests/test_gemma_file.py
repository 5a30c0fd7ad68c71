"""Gemma as ComfyUI ships it: one .safetensors in ComfyUI's layout gives the encodings its folder gives.

The tiny bundle's Gemma folder is written in ComfyUI's single-file layout by the project's own
converter (``gemma_folder_to_comfy_file``); the file's key names, embedded tokenizer and config are
checked, and the contexts LTX-2 conditions on are compared with the folder's bit for bit. fp8
scaled and NVFP4 files are dequantized on load (NVFP4 checked against ComfyUI's own kernel library,
comfy-kitchen, where it is installed); files the fleet cannot run are refused from their header with
a message that names the file to use.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.gemma_encoder import folder_tokenizer
from mgpu_backend.ltx.gemma_file import (
    COMFY_GEMMA_FILE,
    COMFY_GEMMA_KEY_OPS,
    CONFIG_METADATA_KEY,
    GemmaFileWeights,
    SentencePieceGemmaTokenizer,
    dequantize_nvfp4,
    gemma_folder_to_comfy_file,
    inspect_gemma_file,
)
from mgpu_backend.ltx.loading import ModelFileError, ModelLoader, ModelSpec, validate_model_files
from mgpu_backend.ltx.text import encode_prompts

from tests.helpers import cli

PROMPTS = [
    "A fox steps through fresh snow at the edge of a pine forest.",
    "",
    "  <start_of_turn>user Rain drums on a tin roof at 3:45, 1200 drops a second!<end_of_turn>  ",
    "snow " * 1500,  # longer than 1024 tokens: cut, as the folder's tokenizer cuts it
]


@pytest.fixture(scope="module")
def comfy_file(bundle, tmp_path_factory) -> str:
    return gemma_folder_to_comfy_file(bundle.gemma_root, str(tmp_path_factory.mktemp("comfy") / COMFY_GEMMA_FILE))


@pytest.fixture(scope="module")
def fp8_file(bundle, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("comfy_fp8") / "gemma_3_12B_it_fp8_scaled.safetensors"
    return gemma_folder_to_comfy_file(bundle.gemma_root, str(out), weights="fp8_scaled")


def _spec(bundle, gemma_root: str) -> ModelSpec:
    return ModelSpec(checkpoint_path=bundle.checkpoint_path, gemma_root=gemma_root)


def _contexts(bundle, gemma_root: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    contexts = encode_prompts(ModelLoader(_spec(bundle, gemma_root), "cpu", torch.bfloat16), PROMPTS)
    return [(context.video_context, context.audio_context) for context in contexts]


def _assert_bitwise_equal(ours, theirs) -> None:
    for index, (mine, reference) in enumerate(zip(ours, theirs, strict=True)):
        for a, b in zip(mine, reference, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, (index, a.dtype, a.shape, b.dtype, b.shape)
            assert torch.equal(a, b), f"prompt {index}: max abs diff {(a.float() - b.float()).abs().max().item()}"


@pytest.fixture(scope="module")
def folder_contexts(bundle):
    return _contexts(bundle, bundle.gemma_root)


def test_comfy_file_gives_bitwise_the_folder_encodings(bundle, comfy_file, folder_contexts):
    video_0, video_2 = folder_contexts[0][0], folder_contexts[2][0]
    assert not torch.equal(video_0, video_2), "different prompts gave equal contexts: the comparison would prove nothing"
    assert video_0.shape == (1, 1024, tiny.GEMMA_TEXT_CONFIG["hidden_size"])
    _assert_bitwise_equal(_contexts(bundle, comfy_file), folder_contexts)


def test_embedded_sentencepiece_tokenizes_as_the_folder_tokenizer(bundle, comfy_file):
    from_file = SentencePieceGemmaTokenizer.from_file(comfy_file)
    from_folder = folder_tokenizer(bundle.gemma_root)
    for prompt in PROMPTS:
        ours, theirs = from_file.tokenize_with_weights(prompt)["gemma"], from_folder.tokenize_with_weights(prompt)["gemma"]
        assert [(int(t), int(w)) for t, w in ours] == [(int(t), int(w)) for t, w in theirs], prompt[:40]
    long_prompt = from_file.tokenize_with_weights(PROMPTS[3])["gemma"]
    assert len(long_prompt) == 1024 and all(weight == 1 for _, weight in long_prompt)  # cut, not padded
    short = from_file.tokenize_with_weights(PROMPTS[1])["gemma"]
    assert short[-1] == (from_file.bos_id, 1) and short[0] == (from_file.pad_id, 0)  # <bos> alone, padded on the left


def test_converted_file_has_comfyui_key_names_and_the_tokenizer_bytes(bundle, comfy_file):
    folder_weights = load_file(str(Path(bundle.gemma_root) / tiny.GEMMA_WEIGHTS_NAME))
    with safe_open(comfy_file, framework="pt") as f:
        keys = set(f.keys())
        spiece = f.get_tensor("spiece_model")
        metadata = f.metadata()
        embed = f.get_tensor("model.embed_tokens.weight")
    assert {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.1.self_attn.q_norm.weight",
        "model.layers.1.mlp.down_proj.weight",
        "vision_model.embeddings.patch_embedding.weight",
        "vision_model.encoder.layers.0.self_attn.q_proj.weight",
        "multi_modal_projector.mm_input_projection_weight",
        "spiece_model",
    } <= keys
    assert not [key for key in keys if key.startswith(("language_model.", "vision_tower."))]
    assert len(keys) == len(folder_weights) + 1  # every folder tensor, renamed, plus the tokenizer
    assert torch.equal(embed, folder_weights["language_model.model.embed_tokens.weight"])
    assert spiece.dtype == torch.uint8
    assert spiece.numpy().tobytes() == (Path(bundle.gemma_root) / "tokenizer.model").read_bytes()
    assert json.loads(metadata[CONFIG_METADATA_KEY]) == tiny.GEMMA_TEXT_CONFIG
    assert inspect_gemma_file(comfy_file).text_config == tiny.GEMMA_TEXT_CONFIG


def _as_legacy_scaled_fp8(tensors: dict, metadata: dict) -> None:
    """ComfyUI's older fp8 scaled layout: ``scale_weight`` per layer and a ``scaled_fp8`` marker, no comfy_quant."""
    for key in [key for key in tensors if key.endswith((".weight_scale", ".comfy_quant"))]:
        value = tensors.pop(key)
        if key.endswith(".weight_scale"):
            tensors[key.replace(".weight_scale", ".scale_weight")] = value
    tensors["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("layout", ["comfy_quant", "legacy"])
def test_fp8_scaled_file_is_dequantized_on_load(bundle, fp8_file, folder_contexts, tmp_path, layout):
    if layout == "legacy":
        fp8_file = _rewrite(fp8_file, tmp_path / "gemma_3_12B_it_fp8_e4m3fn_scaled.safetensors", _as_legacy_scaled_fp8)
    with safe_open(fp8_file, framework="pt") as f:
        raw = {key: f.get_tensor(key) for key in f.keys()}
    fp8_weights = [key for key, value in raw.items() if value.dtype == torch.float8_e4m3fn and key.endswith(".weight")]
    # Every linear weight of the two layers: q, k, v, o, gate, up, down.
    assert len(fp8_weights) == 7 * tiny.GEMMA_TEXT_CONFIG["num_hidden_layers"]
    assert inspect_gemma_file(fp8_file).quantized_layers == {"float8_e4m3fn": len(fp8_weights)}
    loaded = GemmaFileWeights(torch.bfloat16).load(fp8_file, COMFY_GEMMA_KEY_OPS).sd
    assert sorted(loaded) == sorted(key for key in raw if key.startswith("model.") and key.endswith(".weight"))
    scale_suffix = ".scale_weight" if layout == "legacy" else ".weight_scale"
    for key in fp8_weights:
        scale = raw[key.removesuffix(".weight") + scale_suffix]
        assert scale.dtype == torch.float32 and scale.numel() == 1 and scale.item() > 0
        assert torch.equal(loaded[key], (raw[key].float() * scale).to(torch.bfloat16)), key

    # The same dequantized values stored plainly give bitwise the fp8 file's encodings ...
    plain = {key: value for key, value in raw.items() if not key.endswith((scale_suffix, ".comfy_quant", "scaled_fp8"))}
    plain.update(loaded)
    plain_path = tmp_path / "dequantized.safetensors"
    with safe_open(fp8_file, framework="pt") as f:
        save_file(plain, str(plain_path), metadata=f.metadata())
    fp8_contexts = _contexts(bundle, fp8_file)
    _assert_bitwise_equal(fp8_contexts, _contexts(bundle, str(plain_path)))
    # ... which are close to, not equal to, the bf16 folder's (fp8 keeps 3 mantissa bits).
    video, reference = fp8_contexts[0][0].float(), folder_contexts[0][0].float()
    assert not torch.equal(video, reference)
    assert (video - reference).abs().mean() < 0.2 * reference.abs().mean()


def _as_nvfp4_mixed(tensors: dict, metadata: dict) -> None:
    """ComfyUI's NVFP4 "mixed" layout, quantized by ComfyUI's own kernel library: every linear weight of the
    text stack but one in NVFP4 (packed codes, tiled fp8 block scales, float32 tensor scale), that one in bf16."""
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    for key in [key for key in tensors if key.startswith("model.layers.") and key.endswith("_proj.weight")]:
        if key == "model.layers.1.mlp.down_proj.weight":
            continue
        packed, params = TensorCoreNVFP4Layout.quantize(tensors[key])
        layer = key.removesuffix(".weight")
        tensors[key] = packed
        tensors[f"{layer}.weight_scale"] = params.block_scale
        tensors[f"{layer}.weight_scale_2"] = params.scale.reshape(())
        tensors[f"{layer}.comfy_quant"] = torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)


def test_nvfp4_dequantization_equals_comfyui_kernel_library_across_scale_tiles():
    pytest.importorskip("comfy_kitchen", reason="ComfyUI's kernel library (pip install comfy-kitchen) is the reference")
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    # 304 rows: three 128-row tiles of block scales, the last one padded; 96 columns: 6 blocks, two 4-wide tiles.
    weight = torch.randn(304, 96, generator=torch.Generator().manual_seed(3)).mul(0.05).to(torch.bfloat16)
    packed, params = TensorCoreNVFP4Layout.quantize(weight)
    assert packed.shape == (304, 48) and params.block_scale.numel() == 3 * 2 * 512
    ours = dequantize_nvfp4(packed, params.block_scale, params.scale, torch.float32)
    reference = TensorCoreNVFP4Layout.dequantize(packed, TensorCoreNVFP4Layout.Params(
        scale=params.scale, orig_dtype=torch.float32, orig_shape=(304, 96), block_scale=params.block_scale))  # fmt: skip
    assert torch.equal(ours, reference)
    assert (ours - weight.float()).abs().max() < 0.25 * weight.float().abs().max()  # and it is the weight, roughly


def test_nvfp4_mixed_file_is_dequantized_as_comfyui_dequantizes_it(bundle, comfy_file, folder_contexts, tmp_path):
    pytest.importorskip("comfy_kitchen", reason="ComfyUI's kernel library (pip install comfy-kitchen) makes the NVFP4 file")
    from comfy_kitchen.tensor.nvfp4 import TensorCoreNVFP4Layout

    fp4_file = _rewrite(comfy_file, tmp_path / "gemma_3_12B_it_fp4_mixed.safetensors", _as_nvfp4_mixed)
    assert inspect_gemma_file(fp4_file).quantized_layers == {"nvfp4": 7 * tiny.GEMMA_TEXT_CONFIG["num_hidden_layers"] - 1}
    with safe_open(fp4_file, framework="pt") as f:
        raw = {key: f.get_tensor(key) for key in f.keys()}
    loaded = {dtype: GemmaFileWeights(dtype).load(fp4_file, COMFY_GEMMA_KEY_OPS).sd for dtype in (torch.float32, torch.bfloat16)}
    nvfp4_weights = [key for key, value in raw.items() if value.dtype == torch.uint8 and key.endswith(".weight")]
    for key in nvfp4_weights:
        layer = key.removesuffix(".weight")
        rows, half_columns = raw[key].shape
        params = TensorCoreNVFP4Layout.Params(
            scale=raw[f"{layer}.weight_scale_2"], orig_dtype=torch.float32, orig_shape=(rows, 2 * half_columns),
            block_scale=raw[f"{layer}.weight_scale"],
        )  # fmt: skip
        reference = TensorCoreNVFP4Layout.dequantize(raw[key], params)
        assert torch.equal(loaded[torch.float32][key], reference), key
        assert torch.equal(loaded[torch.bfloat16][key], reference.to(torch.bfloat16)), key
    assert torch.equal(loaded[torch.bfloat16]["model.layers.1.mlp.down_proj.weight"], raw["model.layers.1.mlp.down_proj.weight"])

    plain = {key: value for key, value in raw.items() if not key.endswith((".weight_scale", ".weight_scale_2", ".comfy_quant"))}
    plain.update(loaded[torch.bfloat16])
    plain_path = tmp_path / "dequantized.safetensors"
    with safe_open(fp4_file, framework="pt") as f:
        save_file(plain, str(plain_path), metadata=f.metadata())
    fp4_contexts = _contexts(bundle, fp4_file)
    _assert_bitwise_equal(fp4_contexts, _contexts(bundle, str(plain_path)))
    video, reference = fp4_contexts[0][0].float(), folder_contexts[0][0].float()
    assert not torch.equal(video, reference)
    assert (video - reference).abs().mean() < 0.5 * reference.abs().mean()


def _rewrite(source: str, out: Path, change) -> str:
    with safe_open(source, framework="pt") as f:
        tensors, metadata = {key: f.get_tensor(key) for key in f.keys()}, f.metadata()
    change(tensors, metadata)
    save_file(tensors, str(out), metadata=metadata)
    return str(out)


def _as_int8(tensors: dict, metadata: dict) -> None:
    weight = "model.layers.0.mlp.gate_proj.weight"
    tensors[weight] = tensors[weight].float().mul(100).round().clamp(-127, 127).to(torch.int8)
    tensors[weight.replace(".weight", ".weight_scale")] = torch.tensor(0.01)
    tensors[weight.replace(".weight", ".comfy_quant")] = torch.tensor(list(b'{"format": "int8_tensorwise"}'), dtype=torch.uint8)


def _as_gemma_lora(tensors: dict, metadata: dict) -> None:
    for key in list(tensors):
        value = tensors.pop(key)
        if key.endswith("_proj.weight") and key.startswith("model.layers."):
            tensors[key.replace(".weight", ".lora_A.weight")] = value[:4].contiguous()
            tensors[key.replace(".weight", ".lora_B.weight")] = value[:, :4].contiguous()


def _without_tokenizer(tensors: dict, metadata: dict) -> None:
    del tensors["spiece_model"]


def _without_config(tensors: dict, metadata: dict) -> None:
    del metadata[CONFIG_METADATA_KEY]  # a tiny Gemma read as what every ComfyUI file is: 12B


def _without_q_norm(tensors: dict, metadata: dict) -> None:
    for key in [key for key in tensors if key.endswith("q_norm.weight")]:
        del tensors[key]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            _as_int8,
            "stores its weights as int8_tensorwise, a format the fleet cannot dequantize; it loads the bf16 file "
            f"{COMFY_GEMMA_FILE}, fp8 scaled and NVFP4 files",
        ),
        (_as_gemma_lora, "is a LoRA (e.g. ComfyUI's gemma-3-12b-it-abliterated LoRA), not a Gemma-3 text encoder"),
        (_without_tokenizer, "has no embedded SentencePiece tokenizer (uint8 tensor 'spiece_model')"),
        (_without_config, "(hidden size 64, 2 layers) is not the Gemma-3 model LTX-2 conditions on (hidden size 3840, 48 layers)"),
        (_without_q_norm, "is not a Gemma-3 text encoder (its attention has no q_norm"),
    ],
)
def test_a_file_the_fleet_cannot_run_is_refused_from_its_header(bundle, comfy_file, tmp_path, change, message):
    path = _rewrite(comfy_file, tmp_path / "gemma.safetensors", change)
    with pytest.raises(ModelFileError) as error:
        ModelLoader(_spec(bundle, path), "cpu", torch.bfloat16)
    assert path in str(error.value) and message in str(error.value), str(error.value)


@pytest.mark.parametrize(
    ("pick", "message"),
    [
        (lambda bundle: bundle.checkpoint_path, "is an LTX-2 checkpoint, not a Gemma-3 text encoder in ComfyUI's layout"),
        (lambda bundle: str(Path(bundle.gemma_root) / tiny.GEMMA_WEIGHTS_NAME), "is one shard of a Hugging Face Gemma folder"),
        (lambda bundle: str(Path(bundle.gemma_root) / "tokenizer.model"), "is not a .safetensors file"),
    ],
)
def test_another_file_given_as_gemma_says_what_it_is(bundle, pick, message):
    spec = _spec(bundle, pick(bundle))
    with pytest.raises(ModelFileError) as error:
        validate_model_files(spec)
    assert spec.gemma_root in str(error.value) and message in str(error.value), str(error.value)


def test_residency_sizes_a_gemma_file_by_the_text_stack_it_builds_whatever_the_file_stores(bundle, comfy_file, fp8_file):
    from mgpu_backend.ltx.residency import component_sizes

    text_stack = [value for name, value in load_file(comfy_file).items() if name.startswith("model.")]
    bf16_bytes = sum(value.numel() for value in text_stack) * 2
    assert component_sizes(_spec(bundle, comfy_file)).components["gemma"] == bf16_bytes
    # fp8 scaled: the same layers, dequantized to bfloat16 on load; the per-tensor scales build nothing
    assert component_sizes(_spec(bundle, fp8_file)).components["gemma"] == bf16_bytes


def test_spec_names_a_gemma_file_or_says_where_it_should_be(bundle, comfy_file):
    spec = ModelSpec.from_wire(_spec(bundle, comfy_file).to_json())
    spec.check_files_exist()
    assert spec.gemma_root == comfy_file
    with pytest.raises(ModelFileError, match="models/text_encoders/gemma_3_12B_it.safetensors"):
        ModelSpec.from_wire(_spec(bundle, comfy_file + ".missing").to_json()).check_files_exist()


def test_generate_with_a_checkpoint_as_gemma_stops_before_starting_the_fleet(bundle, tmp_path):
    completed = cli(
        "generate", "--prompt", "x", "--output", str(tmp_path / "o.mp4"), "--cpu-ranks", "1",
        "--checkpoint-path", bundle.checkpoint_path, "--gemma-root", bundle.checkpoint_path,
        "--spatial-upsampler-path", bundle.spatial_upsampler_path, "--distilled-lora", bundle.distilled_lora_path,
        env_extra={"MGPU_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert completed.returncode != 0
    assert f"{bundle.checkpoint_path} is an LTX-2 checkpoint, not a Gemma-3 text encoder" in completed.stderr, completed.stderr
    assert not (tmp_path / "o.mp4").exists()


def test_load_checkpoint_lists_and_resolves_gemma_files_and_folders(tmp_path, monkeypatch):
    import types

    from nodes import model_nodes

    text_encoders = tmp_path / "text_encoders"
    (text_encoders / "gemma-3-12b-it-qat-q4_0-unquantized").mkdir(parents=True)
    (text_encoders / "gemma-3-12b-it-qat-q4_0-unquantized" / "config.json").write_text("{}")
    (text_encoders / "not-a-model").mkdir()
    (text_encoders / COMFY_GEMMA_FILE).write_bytes(b"")
    (text_encoders / "notes.txt").write_text("")
    folder_paths = types.SimpleNamespace(get_folder_paths=lambda name: [str(text_encoders)] if name == "text_encoders" else [])
    monkeypatch.setitem(__import__("sys").modules, "folder_paths", folder_paths)
    assert model_nodes.gemma_folder_choices() == ["gemma-3-12b-it-qat-q4_0-unquantized", COMFY_GEMMA_FILE]
    assert model_nodes._resolve_gemma(COMFY_GEMMA_FILE) == str(text_encoders / COMFY_GEMMA_FILE)
    with pytest.raises(ValueError, match="put ComfyUI's gemma_3_12B_it.safetensors or the Hugging Face folder"):
        model_nodes._resolve_gemma("notes.txt")
