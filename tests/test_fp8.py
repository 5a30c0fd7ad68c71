"""fp8-cast transformer weights on the tiny bundle: what is stored in fp8, what it costs in accuracy,
the LoRA hot-swap round trip on fp8 weights, and Lightricks-style fp8 checkpoint files in both modes.

Every number comes from real builds of ltx-core's transformer from real safetensors files (the tiny
bundle's checkpoint, and fp8 copies of it written by ``tests.helpers.convert_checkpoint_to_fp8``); the
hot-swap runs on two real gloo ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mgpu_backend.ltx import fp8
from mgpu_backend.ltx.jobs import ResidentModel, stage1_params
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.ltx.residency import component_sizes
from mgpu_backend.ltx.schema import SampleRequest
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import encode_prompts
from mgpu_backend.parallel.comm import Comm
from tests.dist_harness import run_ranks
from tests.helpers import convert_checkpoint_to_fp8

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["a red fox runs through fresh snow at dawn", "blurry, low quality"]
GUIDANCE = {"cfg_scale": 3.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0, "stg_blocks": [1]}
STAGE2_SIGMAS = [0.909375, 0.725, 0.421875, 0.0]
# Measured on the tiny bundle (3 steps, 96x64x9, latents of std 1.43): |fp8-cast - bf16| of the
# stage-1 latents reaches 0.22 (video) / 0.27 (audio), mean 0.042 / 0.039; on the scaled fp8 file
# (fp8-cast against its bf16 load) 0.19 / 0.22. The bounds leave about 2x for other CPUs' rounding.
STAGE1_MAX_ABS_DIFF = 0.5
STAGE1_MEAN_ABS_DIFF = 0.08


def _spec(checkpoint: str, bundle: dict) -> ModelSpec:
    return ModelSpec(
        checkpoint_path=checkpoint,
        gemma_root=bundle["gemma_root"],
        spatial_upsampler_path=bundle["spatial_upsampler_path"],
        distilled_lora=bundle["distilled_lora_path"],
    )


def _params(**overrides) -> GenerationParams:
    request = SampleRequest.from_wire({
        "spec": {"checkpoint_path": "unused", "gemma_root": "unused"}, "height": 64, "width": 96, "num_frames": 9, "seed": 7,
        "steps": 3, "video_guidance": GUIDANCE, "audio_guidance": GUIDANCE,
    })  # fmt: skip
    return replace(stage1_params(request, layer_count=2), **overrides)


def _stage1(loader, contexts) -> tuple[torch.Tensor, torch.Tensor]:
    return sample_stage1(loader, _params(), contexts[0], contexts[1])


@pytest.fixture(scope="module")
def bundle(bundle, tmp_path_factory) -> dict:
    """The tiny bundle's paths, and its checkpoint converted to scaled fp8 and to cast fp8."""
    made = bundle
    folder = tmp_path_factory.mktemp("fp8files")
    paths = {name: getattr(made, name) for name in ("checkpoint_path", "gemma_root", "spatial_upsampler_path", "distilled_lora_path")}
    paths["scaled_fp8_path"] = str(convert_checkpoint_to_fp8(made.checkpoint_path, folder / "tiny-fp8.safetensors"))
    paths["cast_fp8_path"] = str(convert_checkpoint_to_fp8(made.checkpoint_path, folder / "tiny-fp8-cast.safetensors", scaled=False))
    return paths


def _velocity_state(loader: ModelLoader, lora_set: str = "none") -> dict[str, torch.Tensor]:
    return dict(loader.transformer(lora_set).velocity_model.state_dict())


def _file_tensors(path: str) -> dict[str, torch.Tensor]:
    prefix = "model.diffusion_model."
    with safe_open(path, framework="pt") as f:
        return {key.removeprefix(prefix): f.get_tensor(key) for key in f.keys() if key.startswith(prefix)}  # noqa: SIM118


def test_fp8_cast_stores_exactly_the_policy_layers_in_float8_at_half_their_bf16_bytes(bundle):
    spec = _spec(bundle["checkpoint_path"], bundle)
    bf16 = _velocity_state(ModelLoader(spec, "cpu", torch.bfloat16))
    cast_loader = ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8-cast")
    cast = _velocity_state(cast_loader)
    assert cast.keys() == bf16.keys()
    # The registry holds the fp8-cast state dict under the policy's key operations, and drops it.
    assert cast_loader.drop_host_copy("transformer") > 0 and cast_loader.drop_host_copy("transformer") == 0
    fp8_keys = {key for key, value in cast.items() if value.dtype == fp8.FP8_DTYPE}
    assert fp8_keys == {key for key in bf16 if fp8.downcast_by_policy(key, "fp8-cast")}
    assert len(fp8_keys) > 100, len(fp8_keys)  # q/k/v/out of six attentions + two feed-forwards, weights and biases, per block
    for key, value in cast.items():
        if key in fp8_keys:
            assert value.nbytes * 2 == bf16[key].nbytes, key
            assert torch.equal(value.view(torch.uint8), bf16[key].to(fp8.FP8_DTYPE).view(torch.uint8)), key
        else:
            assert value.dtype == torch.bfloat16 and torch.equal(value, bf16[key]), key
    bf16_bytes, cast_bytes = (sum(value.nbytes for value in state.values()) for state in (bf16, cast))
    fp8_bf16_bytes = sum(bf16[key].nbytes for key in fp8_keys)
    assert cast_bytes == bf16_bytes - fp8_bf16_bytes // 2, (cast_bytes, bf16_bytes, fp8_bf16_bytes)
    assert cast_bytes < 0.75 * bf16_bytes, (cast_bytes, bf16_bytes)
    # The residency policy's figures, read from the file header alone, are the built bytes.
    sizes = component_sizes(spec)
    assert (sizes.transformer_bytes, sizes.transformer_fp8_bytes) == (bf16_bytes, cast_bytes)


def test_fp8_cast_applied_to_a_built_bf16_model_equals_the_fp8_cast_load(bundle):
    spec = _spec(bundle["checkpoint_path"], bundle)
    built = ModelLoader(spec, "cpu", torch.bfloat16).transformer()
    fp8.cast_to_fp8_(built.velocity_model)
    loaded = ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8-cast").transformer()
    assert _differing_keys(built, loaded) == []
    layer = next(name for name, module in loaded.velocity_model.named_modules() if isinstance(module, torch.nn.Linear)
                 and module.weight.dtype == fp8.FP8_DTYPE)  # fmt: skip
    linear_built, linear_loaded = built.velocity_model.get_submodule(layer), loaded.velocity_model.get_submodule(layer)
    x = torch.randn(2, linear_loaded.in_features, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    assert torch.equal(linear_built(x), linear_loaded(x))  # both upcast per layer (ltx-core's module op)


def test_fp8_cast_stage1_differs_from_bf16_by_a_small_measured_amount(bundle):
    torch.set_num_threads(1)
    spec = _spec(bundle["checkpoint_path"], bundle)
    bf16_loader = ModelLoader(spec, "cpu", torch.bfloat16)
    cast_loader = ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8-cast")
    contexts = encode_prompts(bf16_loader, PROMPTS)  # quantization is the transformer's only
    assert all(torch.equal(a.video_context, b.video_context) for a, b in zip(contexts, encode_prompts(cast_loader, PROMPTS)))
    for name, reference, quantized in zip(("video", "audio"), _stage1(bf16_loader, contexts), _stage1(cast_loader, contexts)):
        assert torch.isfinite(quantized).all(), name
        diff = (quantized - reference).abs()
        assert 0 < diff.max().item() <= STAGE1_MAX_ABS_DIFF, (name, diff.max().item())
        assert diff.mean().item() <= STAGE1_MEAN_ABS_DIFF, (name, diff.mean().item())


def test_unknown_quantization_is_refused_with_the_allowed_values(bundle):
    spec = _spec(bundle["checkpoint_path"], bundle)
    with pytest.raises(ValueError, match=r"quantization must be null .* or one of 'fp8-cast', got 'fp8'"):
        ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8")
    assert fp8.parse_quantization(None) is None and fp8.parse_quantization("fp8-cast") == "fp8-cast"


def test_a_scaled_fp8_file_loads_dequantized_in_bf16_and_kept_with_its_scales_in_fp8_cast(bundle):
    stored = _file_tensors(bundle["scaled_fp8_path"])
    spec = _spec(bundle["scaled_fp8_path"], bundle)
    upcast = _velocity_state(ModelLoader(spec, "cpu", torch.bfloat16))
    kept = _velocity_state(ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8-cast"))
    scaled_layers = [key.removesuffix(fp8.WEIGHT_SCALE_SUFFIX) for key in stored if key.endswith(fp8.WEIGHT_SCALE_SUFFIX)]
    assert scaled_layers
    for layer in scaled_layers:
        weight, scale = stored[layer + ".weight"], stored[layer + fp8.WEIGHT_SCALE_SUFFIX]
        assert weight.dtype == fp8.FP8_DTYPE and scale.dtype == torch.float32
        assert torch.equal(upcast[layer + ".weight"], (weight.float() * scale).to(torch.bfloat16)), layer
        assert layer + fp8.WEIGHT_SCALE_SUFFIX not in upcast  # consumed by the dequantization
        assert torch.equal(kept[layer + ".weight"].view(torch.uint8), weight.view(torch.uint8)), layer
        assert torch.equal(kept[layer + fp8.WEIGHT_SCALE_SUFFIX], scale), layer
    assert not any(key.endswith(fp8.INPUT_SCALE_SUFFIX) for key in (*upcast, *kept))
    # A kept layer computes with exactly the weight the bf16 load builds (its bias is fp8-cast).
    layer = scaled_layers[0]
    model = ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8-cast").transformer().velocity_model
    linear = model.get_submodule(layer)
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, upcast[layer + ".weight"], kept[layer + ".bias"].to(torch.bfloat16))
    assert torch.equal(linear(x), expected)
    # Header-only sizes count the kept fp8 weights and their scales.
    assert component_sizes(spec).transformer_fp8_bytes == sum(value.nbytes for value in kept.values())


def test_a_cast_only_fp8_file_loads_upcast_in_bf16_and_as_stored_in_fp8_cast(bundle):
    stored = _file_tensors(bundle["cast_fp8_path"])
    spec = _spec(bundle["cast_fp8_path"], bundle)
    upcast = _velocity_state(ModelLoader(spec, "cpu", torch.bfloat16))
    kept = _velocity_state(ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8-cast"))
    fp8_weights = [key for key, value in stored.items() if value.dtype == fp8.FP8_DTYPE]
    assert fp8_weights and not any(key.endswith(fp8.WEIGHT_SCALE_SUFFIX) for key in stored)
    for key in fp8_weights:
        assert torch.equal(upcast[key], stored[key].to(torch.bfloat16)), key
        assert torch.equal(kept[key].view(torch.uint8), stored[key].view(torch.uint8)), key


def test_stage1_of_an_fp8_file_is_close_in_both_modes(bundle):
    torch.set_num_threads(1)
    spec = _spec(bundle["scaled_fp8_path"], bundle)
    upcast_loader = ModelLoader(spec, "cpu", torch.bfloat16)
    kept_loader = ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8-cast")
    contexts = encode_prompts(upcast_loader, PROMPTS)
    for name, upcast, kept in zip(("video", "audio"), _stage1(upcast_loader, contexts), _stage1(kept_loader, contexts)):
        assert torch.isfinite(kept).all(), name
        # Same weights in both modes; only the biases differ (fp8-cast rounds them to fp8).
        assert (kept - upcast).abs().max().item() <= STAGE1_MAX_ABS_DIFF, name


# --- The LoRA hot-swap on fp8 weights, on two gloo ranks --------------------------------------------


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _differing_keys(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Keys whose tensors are not bitwise equal (fp8 has no equality of its own on the CPU: compare bytes)."""
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    return [key for key in ours if not _same_bytes(ours[key], theirs[key])]


def _hot_swap_scenario(bundle: dict, checkpoint_key: str) -> dict:
    torch.set_num_threads(1)
    spec = _spec(bundle[checkpoint_key], bundle)
    resident = ResidentModel(spec, torch.device("cpu"), torch.bfloat16, Comm.world(), quantization="fp8-cast")
    reference = ModelLoader(spec, "cpu", torch.bfloat16, quantization="fp8-cast")
    contexts = encode_prompts(resident.loader, PROMPTS)
    out = {}
    first_video, first_audio = _stage1(resident, contexts)
    out["clean_differs_from_loader"] = _differing_keys(resident.transformer("none"), reference.transformer("none"))
    # Stage 2: the distilled LoRA fused into the fp8 working copy, then the stage-2 loop on it.
    stage2_params = _params(height=128, width=192, two_stage=True)
    upsampled = upsample_video(resident, first_video)
    fused = resident.transformer("distilled")
    distilled_reference = reference.transformer("distilled")
    out["fused_differs_from_loader"] = _differing_keys(fused, distilled_reference)
    out["fused_fp8_keys"] = sum(
        value.dtype == fp8.FP8_DTYPE and not _same_bytes(value, clean)
        for value, clean in zip(distilled_reference.state_dict().values(), reference.transformer("none").state_dict().values())
    )
    video2, _ = refine_stage2(resident, stage2_params, upsampled, first_audio, contexts[0], sigmas=STAGE2_SIGMAS)
    out["stage2_finite"] = bool(torch.isfinite(video2).all())
    # Stage 1 again: the clean fp8 bytes are back, so the output is bitwise the first one.
    second_video, second_audio = _stage1(resident, contexts)
    out["stage1_again_equal"] = torch.equal(first_video, second_video) and torch.equal(first_audio, second_audio)
    out["clean_again_differs_from_loader"] = _differing_keys(resident.transformer("none"), reference.transformer("none"))
    out["swaps"] = resident.tracker.stats.swaps
    return out


@pytest.mark.parametrize("checkpoint_key", ["checkpoint_path", "scaled_fp8_path"])
def test_fp8_lora_hot_swap_round_trip_gives_bitwise_the_first_stage1_output(bundle, checkpoint_key):
    for rank, out in enumerate(run_ranks(2, _hot_swap_scenario, bundle, checkpoint_key)):
        assert out["clean_differs_from_loader"] == [], (rank, out["clean_differs_from_loader"][:3])
        assert out["fused_differs_from_loader"] == [], (rank, out["fused_differs_from_loader"][:3])
        assert out["fused_fp8_keys"] > 50, (rank, out["fused_fp8_keys"])  # the LoRA really changed fp8 weights
        assert out["stage2_finite"], rank
        assert out["stage1_again_equal"], f"rank {rank}: stage 1 after a stage-2 swap differs from the first stage 1"
        assert out["clean_again_differs_from_loader"] == [], (rank, out["clean_again_differs_from_loader"][:3])
        assert out["swaps"] == 2, (rank, out["swaps"])


def test_fp8_checkpoint_converter_keeps_everything_else_and_marks_the_layers(bundle):
    original, converted = _file_tensors(bundle["checkpoint_path"]), _file_tensors(bundle["scaled_fp8_path"])
    with safe_open(bundle["scaled_fp8_path"], framework="pt") as f:
        metadata = f.metadata()
    with safe_open(bundle["checkpoint_path"], framework="pt") as f:
        assert metadata["config"] == f.metadata()["config"]
    layers = [key.removesuffix(".weight") for key, value in converted.items() if value.dtype == fp8.FP8_DTYPE]
    marked = json.loads(metadata["_quantization_metadata"])["layers"]
    assert set(marked) == {"model.diffusion_model." + layer for layer in layers}
    for key, value in original.items():
        if key.removesuffix(".weight") not in layers:
            assert torch.equal(converted[key], value), key


def test_fp8_bench_tiny_run_prints_both_modes_with_fewer_bytes_and_a_nonzero_difference(tmp_path):
    out = tmp_path / "fp8.md"
    completed = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fp8.py"), "--tiny", "--warmup", "0", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in completed.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    (reference_name, *reference), (quantized_name, *quantized) = [[cell.strip() for cell in row] for row in rows]
    assert (reference_name, quantized_name) == ("float32", "fp8-cast"), rows
    # fp32 reference on the CPU: the policy's layers go from 4 bytes to 1, the rest (about 40% of the bytes at tiny size) stays
    assert float(quantized[0].split()[0]) < 0.6 * float(reference[0].split()[0]), rows
    assert reference[4] == reference[5] == "0 / 0", rows
    assert all(float(value) > 0 for cell in quantized[4:6] for value in cell.split(" / ")), rows
    assert out.read_text().startswith("`python "), "the --out file carries the command line"
