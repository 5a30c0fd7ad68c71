"""LTX-2.3 (the 22B layout) in the pack: the version read from the checkpoint, the defaults that follow
it, LoRAs of the other version refused, and every job on four CPU ranks equal to one process (bf16).

The version tests read real safetensors files (the tiny bundles of both versions, and files written
here); the fleet tests run a real server with gloo ranks on the embedded tiny LTX-2.3 bundle.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch
from ltx_pipelines.utils.constants import LTX_2_3_PARAMS, LTX_2_PARAMS, detect_params

from mgpu_backend.bundles.tiny import make_tiny_bundle
from mgpu_backend.fleet.client import FleetError
from mgpu_backend.ltx.decode import decode_audio, decode_tiling, decode_video
from mgpu_backend.ltx.jobs import EMBEDDED_23_FOLDER, stage1_params
from mgpu_backend.ltx.latents import job_generator
from mgpu_backend.ltx.loading import ModelLoader, validate_model_files
from mgpu_backend.ltx.safetensors_header import checkpoint_model_version
from mgpu_backend.ltx.schema import (
    EMBEDDED_TINY,
    EMBEDDED_TINY_2_3,
    DecodeRequest,
    ModelFileError,
    ModelSpec,
    RequestError,
    SampleRequest,
    UpscaleRequest,
)
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import encode_prompts

from .fleet_harness import REPO, run_job
from .helpers import sample_args as ltx_fleet_sample_args

PROMPT = "a lighthouse beam sweeps over a stormy sea at night"
NEGATIVE = "blurry, low quality"
SINGLE_GPU_SIGMAS = [0.909375, 0.725, 0.421875, 0.0]


@pytest.fixture(scope="module")
def bundles(tiny_bundle_of):
    return {version: tiny_bundle_of(version) for version in ("2.0", "2.3")}


def spec_of(bundle, distilled_lora: str | None = None) -> ModelSpec:
    return ModelSpec(bundle.checkpoint_path, bundle.gemma_root, bundle.spatial_upsampler_path, distilled_lora or bundle.distilled_lora_path)


def write_safetensors(path, metadata: dict | None) -> str:
    header = {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    if metadata is not None:
        header["__metadata__"] = metadata
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0" * 4)
    return str(path)


# --- The version of a checkpoint ----------------------------------------------------------------


def test_checkpoint_version_is_read_from_the_metadata_as_ltx_pipelines_detects_it(bundles, tmp_path):
    official = {"2.0": LTX_2_PARAMS, "2.3": LTX_2_3_PARAMS}
    for version, bundle in bundles.items():
        assert checkpoint_model_version(bundle.checkpoint_path) == version
        assert detect_params(bundle.checkpoint_path) == official[version]
    cases = {"none": (None, "2.0"), "2.3.1": ({"model_version": "2.3.1"}, "2.3"), "2.1": ({"model_version": "2.1.0"}, "2.0")}
    for name, (metadata, version) in cases.items():
        path = write_safetensors(tmp_path / f"{name}.safetensors", metadata)
        assert checkpoint_model_version(path) == version, name
        assert detect_params(path) == official[version], name
    # Without model_version metadata (a converter dropped it) the 22B layout still says 2.3, where
    # detect_params falls back to 2.0: from the config metadata, or from the gated attention's weights.
    config_23 = write_safetensors(tmp_path / "config.safetensors", {"config": json.dumps({"transformer": {"caption_proj_before_connector": True}})})
    assert checkpoint_model_version(config_23) == "2.3" and detect_params(config_23) == LTX_2_PARAMS
    gated = tmp_path / "gated.safetensors"
    header = json.dumps({"model.diffusion_model.transformer_blocks.0.attn1.to_gate_logits.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    gated.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    assert checkpoint_model_version(str(gated)) == "2.3"
    (tmp_path / "not.safetensors").write_bytes(b"GGUF and more")
    with pytest.raises(ModelFileError, match="is not a .safetensors file"):
        checkpoint_model_version(str(tmp_path / "not.safetensors"))


def test_version_reader_and_schema_import_no_torch():
    code = "import sys, mgpu_backend.ltx.schema, mgpu_backend.ltx.safetensors_header; print('torch' in sys.modules)"
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO)})
    assert completed.stdout.strip() == "False", completed.stderr


def test_request_defaults_follow_the_checkpoint_version_and_a_contradicting_version_is_refused(bundles):
    for version, steps, block in (("2.0", 40, 29), ("2.3", 30, 28)):
        spec = spec_of(bundles[version])
        for request in (SampleRequest(spec=spec), SampleRequest.from_wire({"spec": spec.to_wire()})):
            assert (request.model_version, request.steps) == (version, steps)
            assert stage1_params(request, layer_count=48).video_guider.stg_blocks == [block]
        assert UpscaleRequest.from_wire({"spec": spec.to_wire()}).model_version == version
    spec = spec_of(bundles["2.3"])
    assert SampleRequest(spec=spec, model_version="2.3").steps == 30
    expected = (
        f"model_version 2.0 contradicts the checkpoint {bundles['2.3'].checkpoint_path}, which is LTX-2.3 (its model_version "
        "metadata); leave model_version out to use LTX-2.3's defaults, or choose an LTX-2.0 checkpoint"
    )
    for build in (lambda: SampleRequest(spec=spec, model_version="2.0"), lambda: UpscaleRequest.from_wire({"spec": spec.to_wire(), "model_version": "2.0"})):
        with pytest.raises(RequestError) as info:
            build()
        assert str(info.value) == expected


def test_embedded_tiny_names_its_version_and_mixing_the_two_bundles_is_refused(bundles):
    spec = ModelSpec.embedded_tiny(version="2.3")
    assert spec.checkpoint_path == spec.gemma_root == spec.distilled_lora == EMBEDDED_TINY_2_3
    assert spec.embedded_version == spec.model_version == "2.3" and ModelSpec.embedded_tiny().model_version == "2.0"
    assert SampleRequest(spec=spec).steps == 30  # nothing is read: the name says the version
    resolved = spec.resolve_embedded(bundles["2.3"])
    assert resolved == spec_of(bundles["2.3"]) and resolved.model_version == "2.3"
    mixed = ModelSpec(EMBEDDED_TINY_2_3, EMBEDDED_TINY_2_3, None, EMBEDDED_TINY)
    with pytest.raises(ModelFileError, match="names both embedded tiny bundles"):
        mixed.embedded_version


# --- LoRAs of the other version ---------------------------------------------------------------------


def test_distilled_lora_of_the_other_version_is_refused_naming_the_version_it_is_for(bundles):
    lora_20, lora_23 = bundles["2.0"].distilled_lora_path, bundles["2.3"].distilled_lora_path
    with pytest.raises(ModelFileError) as info:
        validate_model_files(spec_of(bundles["2.3"], distilled_lora=lora_20))
    assert str(info.value) == (
        f"distilled LoRA {lora_20} is a LoRA for LTX-2.0 (it adapts the attention layers but none of the attention gates "
        f"LTX-2.3 has), but checkpoint {bundles['2.3'].checkpoint_path} is LTX-2.3; use the distilled LoRA made for LTX-2.3 "
        "(ltx-2.3-22b-distilled-lora-384-1.1.safetensors), or a checkpoint of LTX-2.0"
    )
    with pytest.raises(ModelFileError) as info:
        validate_model_files(spec_of(bundles["2.0"], distilled_lora=lora_23))
    assert str(info.value) == (
        f"distilled LoRA {lora_23} is a LoRA for LTX-2.3 (it adapts transformer_blocks.0.attn1.to_gate_logits, a layer only "
        f"LTX-2.3 has), but checkpoint {bundles['2.0'].checkpoint_path} is LTX-2.0; use the distilled LoRA made for LTX-2.0 "
        "(ltx-2-19b-distilled-lora-384.safetensors), or a checkpoint of LTX-2.3"
    )
    user_23_on_20 = ModelSpec(bundles["2.0"].checkpoint_path, bundles["2.0"].gemma_root, loras=((lora_23, 0.5),))
    with pytest.raises(ModelFileError, match=r"^LoRA .* is a LoRA for LTX-2\.3 .* is LTX-2\.0; use the LoRA made for LTX-2\.0, or"):
        validate_model_files(user_23_on_20)
    for version in ("2.0", "2.3"):
        validate_model_files(spec_of(bundles[version]))  # each version's own LoRA loads


# --- Every job on four CPU ranks -----------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache23")


@pytest.fixture(scope="module")
def fleet(fleet_of, cache):
    return fleet_of(4, env={"MGPU_CACHE_DIR": str(cache)})


run = run_job


SPEC = ModelSpec.embedded_tiny(version="2.3").to_wire()


def sample_args(**overrides) -> dict:
    # Every guidance pass active, STG on the last of the tiny model's two blocks (as the 2.0 fleet tests).
    return ltx_fleet_sample_args(SPEC, **overrides)


def assert_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    assert ours.shape == theirs.shape, f"{what}: {tuple(ours.shape)} != {tuple(theirs.shape)}"
    diff = (ours.float() - theirs.float()).abs().max().item()
    assert diff == 0.0, f"{what} at 4 ranks differs from one process by {diff}"


@pytest.mark.slow
def test_every_job_of_ltx23_at_four_cpu_ranks_equals_one_process_bf16(fleet, cache):
    """load, encode (sharded and batch-parallel Gemma), sample under sp / guidance / hybrid, the
    upscale with the distilled LoRA swapped in and out, and the distributed decode: each equal to
    the one-process stages on the same tiny LTX-2.3 files."""
    loaded = run(fleet, "load", {"spec": SPEC})
    assert loaded.fields["layers"] == 2
    assert (cache / EMBEDDED_23_FOLDER / "ltx-2.3-tiny.safetensors").is_file()  # the ranks wrote the 2.3 bundle
    loader = ModelLoader(spec_of(make_tiny_bundle(cache / "in-process", "2.3")), "cpu", torch.bfloat16)  # the same bytes
    assert loader.spec.model_version == "2.3"

    positive, negative = encode_prompts(loader, [PROMPT, NEGATIVE])
    assert positive.video_context.shape[-1] == 128 and positive.audio_context.shape[-1] == 64  # projected in the encoder
    for mode in ("sharded", "batch_parallel"):
        encoded = run(fleet, "encode", {"spec": SPEC, "prompts": [PROMPT, NEGATIVE], "gemma_mode": mode})
        for index, context in enumerate((positive, negative)):
            assert_equal(encoded.tensors[f"video_context_{index}"], context.video_context, f"{mode} video context {index}")
            assert_equal(encoded.tensors[f"audio_context_{index}"], context.audio_context, f"{mode} audio context {index}")
    contexts = {
        "positive_video_context": positive.video_context, "positive_audio_context": positive.audio_context,
        "negative_video_context": negative.video_context, "negative_audio_context": negative.audio_context,
    }  # fmt: skip

    request = SampleRequest.from_wire(sample_args())
    assert request.model_version == "2.3"
    video, audio = sample_stage1(loader, stage1_params(request, layer_count=2), positive, negative)
    layouts = {}
    for plan in ("sp", "guidance", "hybrid"):
        stage1 = run(fleet, "sample", sample_args(parallel=plan), contexts)
        layouts[plan] = (stage1.fields["guidance_groups"], stage1.fields["sp_degree"])
        assert_equal(stage1.tensors["video_latent"], video, f"stage-1 video under {plan}")
        assert_equal(stage1.tensors["audio_latent"], audio, f"stage-1 audio under {plan}")
    assert layouts == {"sp": (1, 4), "guidance": (4, 1), "hybrid": (2, 2)}

    stage2_inputs = {"video_latent": video, "audio_latent": audio, "positive_video_context": positive.video_context, "positive_audio_context": positive.audio_context}
    upscaled = run(fleet, "upscale", {"spec": SPEC, "seed": 7, "sigmas": SINGLE_GPU_SIGMAS, "tiles": [1, 1]}, stage2_inputs)
    params2 = GenerationParams(height=128, width=192, num_frames=9, seed=7, two_stage=True)
    video2, _ = refine_stage2(loader, params2, upsample_video(loader, video), audio, positive, sigmas=SINGLE_GPU_SIGMAS)
    assert_equal(upscaled.tensors["video_latent"], video2, "stage-2 video (distilled LoRA fused)")
    assert torch.equal(upscaled.tensors["audio_latent"], audio), "stage 2 must return the stage-1 audio"
    again = run(fleet, "sample", sample_args(parallel="sp"), contexts)  # the LoRA swapped out again
    assert_equal(again.tensors["video_latent"], video, "stage-1 video after the LoRA swap")

    tiled = run(fleet, "upscale", {"spec": SPEC, "seed": 7, "tiles": [2, 2], "overlap": 1}, stage2_inputs)
    assert tiled.fields["tiling"] != "untiled" and tiled.tensors["video_latent"].shape == video2.shape
    assert torch.isfinite(tiled.tensors["video_latent"]).all()
    assert torch.equal(tiled.tensors["audio_latent"], audio)

    decode = {"spec": SPEC, "seed": 7, "after_stages": 0, "spatial_tile_pixels": 64, "temporal_tile_frames": 16}
    decoded = run(fleet, "decode", decode, {"video_latent": video2, "audio_latent": audio})
    request = DecodeRequest.from_wire(decode)
    tiling = decode_tiling(request.spatial_tile_pixels, request.temporal_tile_frames)
    frames = decode_video(loader, video2, tiling=tiling, generator=job_generator(7, torch.device("cpu"), torch.bfloat16))
    assert_equal(decoded.tensors["frames"], frames, "decoded frames (64-pixel tiles spread over 4 ranks)")
    # The decode job's audio lasts exactly as long as its video: 9 frames at the request's 24 fps.
    waveform, sample_rate = decode_audio(loader, audio, video_frames=frames.shape[0], frame_rate=DecodeRequest.from_wire(decode).frame_rate)
    assert decoded.fields["sample_rate"] == sample_rate == 48000 and waveform.shape[-1] == 48000 * 9 // 24
    assert_equal(decoded.tensors["waveform"], waveform, "decoded waveform")


def test_a_request_naming_the_other_version_is_refused_by_the_ranks(fleet):
    with pytest.raises(FleetError, match="model_version 2.0 contradicts the checkpoint embedded:tiny-2.3, which is LTX-2.3"):
        run(fleet, "sample", sample_args(model_version="2.0", steps=1))


def test_generate_refuses_a_model_version_that_contradicts_the_checkpoint_before_starting_a_fleet(bundles, tmp_path):
    bundle = bundles["2.3"]
    command = [
        sys.executable, "-m", "mgpu_backend", "generate", "--prompt", "x", "--output", str(tmp_path / "o.mp4"), "--model-version", "2.0",
        "--checkpoint-path", bundle.checkpoint_path, "--gemma-root", bundle.gemma_root, "--spatial-upsampler-path",
        bundle.spatial_upsampler_path, "--distilled-lora", bundle.distilled_lora_path, "--socket", str(tmp_path / "none.sock"),
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert completed.returncode != 0
    assert completed.stderr.strip().endswith(
        f"error: --model-version: model_version 2.0 contradicts the checkpoint {bundle.checkpoint_path}, which is LTX-2.3 "
        "(its model_version metadata); leave model_version out to use LTX-2.3's defaults, or choose an LTX-2.0 checkpoint"
    ), completed.stderr[-2000:]
    assert not (tmp_path / "none.sock").exists()


def test_benchmark_contexts_have_the_widths_each_full_size_transformer_takes():
    from mgpu_backend.ltx.diagnostics import bench_config, context_widths, random_contexts, transformer_version

    widths = {version: context_widths(bench_config(version)["transformer"]) for version in ("2.0", "2.3")}
    assert widths == {"2.0": (3840, 3840), "2.3": (4096, 2048)}
    assert [transformer_version(bench_config(version)["transformer"]) for version in ("2.0", "2.3")] == ["2.0", "2.3"]
    tiny = bench_config("2.3", tiny=True)["transformer"]
    positive, negative = random_contexts(tiny, torch.device("cpu"), torch.float32, seed=3, tokens=8)
    assert positive.video_context.shape == negative.video_context.shape == (1, 8, 128)
    assert positive.audio_context.shape == (1, 8, 64) and not torch.equal(positive.video_context[..., :64], positive.audio_context)


def test_ltx23_transformer_layout_stage1_loop_at_two_ranks_sp_and_guidance_matches_one_rank_fp32():
    """The guidance loop of the degree tests on the 22B layout (gated attention, cross-attention
    AdaLN, split RoPE) at two ranks; four ranks under sp, guidance and hybrid run in the fleet test."""
    from mgpu_backend.ltx.passes import SequentialPassRunner
    from tests.dist_harness import run_ranks
    from tests.helpers import TOLERANCE, euler_stage1_loop, stage1_loops_on_ranks
    from tests.helpers import build_tiny_model, from_portable, single_threaded

    reference = single_threaded(euler_stage1_loop, build_tiny_model("22b"), SequentialPassRunner())
    per_rank = from_portable(run_ranks(2, stage1_loops_on_ranks, ["sp", "guidance"], "22b"))
    for results in per_rank:
        assert (tuple(results["sp"]["layout"]), tuple(results["guidance"]["layout"])) == ((1, 2), (2, 1))
        for mode in ("sp", "guidance"):
            assert results[mode]["passes"] == reference["passes"]
            for name in ("video", "audio"):
                diff = (results[mode][name] - reference[name]).abs().max().item()
                assert diff <= TOLERANCE, f"{mode} at 2 ranks: {name} differs from one rank by {diff}"


@pytest.mark.slow
def test_generate_runs_the_embedded_ltx23_bundle_end_to_end_into_an_mp4_with_48_khz_audio(tmp_path):
    from mgpu_backend.tools import media

    env = {**os.environ, "PYTHONPATH": str(REPO), "MGPU_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MGPU_SOCKET", None)
    (tmp_path / "sock").mkdir(mode=0o700)
    command = [
        sys.executable, "-m", "mgpu_backend", "generate", "--prompt", PROMPT, "--model-version", "2.3", "--output", str(tmp_path / "o.mp4"),
        "--cpu-ranks", "2", "--socket", str(tmp_path / "sock" / "fleet.sock"), "--debug-dump", str(tmp_path / "o.safetensors"),
    ]  # fmt: skip
    completed = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "embedded tiny LTX-2 bundle of version 2.3" in completed.stderr
    assert (tmp_path / "cache" / EMBEDDED_23_FOLDER / "ltx-2.3-tiny.safetensors").is_file()
    facts = media.probe(tmp_path / "o.mp4")
    assert facts["video"] == {"codec": "h264", "width": 192, "height": 128, "frames": 9}
    assert facts["audio"]["codec"] == "aac" and facts["audio"]["sample_rate"] == 48000
