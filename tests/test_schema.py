"""The request schema: torch-free, THE official defaults (checked against ltx-pipelines' own constants),
typed requests that round-trip and refuse bad input with what to do, prompt digests and the rank's
prompt cache."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
from ltx_core.components.guiders import MultiModalGuiderParams
from ltx_core.model.video_vae import TilingConfig
from ltx_pipelines.utils import constants

from mgpu_backend.ltx import schema
from mgpu_backend.ltx.schema import (
    EMBEDDED_TINY,
    DecodeRequest,
    EncodeRequest,
    Guidance,
    LoadRequest,
    ModelFileError,
    ModelSpec,
    RequestError,
    SampleRequest,
    UnloadRequest,
    UpscaleRequest,
    defaults_for,
    prompt_digest,
)

from .fleet_harness import REPO

SPEC = ModelSpec("/m/ltx-2-19b-dev.safetensors", "/m/gemma", "/m/up.safetensors", "/m/lora.safetensors", 0.8, (("/m/style.safetensors", 0.5),))
OFFICIAL_PARAMS = {"2.0": constants.LTX_2_PARAMS, "2.3": constants.LTX_2_3_PARAMS}


def test_schema_imports_neither_torch_nor_ltx_core():
    code = (
        "import json, sys; import mgpu_backend.ltx.schema; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ltx_core', 'ltx_pipelines', 'numpy'))))"
    )
    completed = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={"PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == []


# --- THE defaults, against ltx-pipelines 1.0.0 ------------------------------------------------------


def _ltx_params(guidance: Guidance) -> MultiModalGuiderParams:
    from mgpu_backend.ltx.stages import guider_params

    return guider_params(guidance, guidance)


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_two_stage_defaults_are_ltx_pipelines_pipeline_params(version):
    ours, official = defaults_for(version, "two-stage"), OFFICIAL_PARAMS[version]
    assert (ours.seed, ours.stage1_height, ours.stage1_width, ours.num_frames, ours.frame_rate, ours.steps) == (
        official.seed, official.stage_1_height, official.stage_1_width, official.num_frames, official.frame_rate, official.num_inference_steps,
    )  # fmt: skip
    assert _ltx_params(ours.video_guidance) == official.video_guider_params
    assert _ltx_params(ours.audio_guidance) == official.audio_guider_params
    assert list(ours.stage2_sigmas) == constants.STAGE_2_DISTILLED_SIGMA_VALUES
    assert ours.stage1_sigmas is None, "two-stage stage 1 runs LTX2Scheduler over the steps"


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_distilled_defaults_are_the_distilled_schedules_without_guidance(version):
    ours, official = defaults_for(version, "distilled"), OFFICIAL_PARAMS[version]
    assert list(ours.stage1_sigmas) == constants.DISTILLED_SIGMA_VALUES
    assert ours.steps == len(constants.DISTILLED_SIGMA_VALUES) - 1 == 8
    assert list(ours.stage2_sigmas) == constants.STAGE_2_DISTILLED_SIGMA_VALUES
    # The distilled pipeline denoises with the positive prompt alone: ltx-core's guider params as they come.
    assert _ltx_params(ours.video_guidance) == MultiModalGuiderParams() == _ltx_params(ours.audio_guidance)
    assert (ours.seed, ours.stage1_height, ours.stage1_width, ours.num_frames, ours.frame_rate) == (
        official.seed, official.stage_1_height, official.stage_1_width, official.num_frames, official.frame_rate,
    )  # fmt: skip


def test_latent_facts_and_other_defaults_are_the_official_constants():
    assert schema.VIDEO_LATENT_CHANNELS == constants.VIDEO_LATENT_CHANNELS
    factors = constants.VIDEO_SCALE_FACTORS
    assert (schema.VIDEO_TEMPORAL_COMPRESSION, schema.VIDEO_SPATIAL_COMPRESSION, schema.VIDEO_SPATIAL_COMPRESSION) == (factors.time, factors.height, factors.width)
    assert schema.DISTILLED_LORA_STRENGTH == constants.DEFAULT_LORA_STRENGTH
    tiling = TilingConfig.default()
    assert schema.DECODE_SPATIAL_TILE_PIXELS == tiling.spatial_config.tile_size_in_pixels
    assert schema.DECODE_TEMPORAL_TILE_FRAMES == tiling.temporal_config.tile_size_in_frames
    assert schema.OFFICIAL == defaults_for("2.0", "two-stage")


def test_schema_choices_are_the_ones_the_fleet_modules_accept():
    from mgpu_backend.parallel.distributed_gemma import GEMMA_MODES
    from mgpu_backend.parallel.guidance_parallel import PLAN_MODES

    assert schema.GEMMA_MODES == GEMMA_MODES and schema.PARALLEL_PLANS == PLAN_MODES


def test_an_omitted_audio_guidance_gets_the_official_audio_default_7():
    request = SampleRequest.from_wire({"spec": SPEC.to_wire()})
    assert request.audio_guidance.cfg_scale == 7.0 == constants.LTX_2_PARAMS.audio_guider_params.cfg_scale
    assert request.video_guidance.cfg_scale == 3.0
    partial = SampleRequest.from_wire({"spec": SPEC.to_wire(), "audio_guidance": {"stg_scale": 0.5}})
    assert partial.audio_guidance == Guidance(7.0, 0.5, 0.7, 3.0, 0, None)


def test_stage1_params_of_an_empty_request_are_the_official_ltx_2_params():
    from mgpu_backend.ltx.jobs import stage1_params

    for version, official in OFFICIAL_PARAMS.items():
        params = stage1_params(SampleRequest.from_wire({"spec": SPEC.to_wire(), "model_version": version}), layer_count=48)
        assert params.video_guider == official.video_guider_params and params.audio_guider == official.audio_guider_params
        assert (params.height, params.width, params.num_inference_steps) == (official.stage_1_height, official.stage_1_width, official.num_inference_steps)
    # A model with fewer blocks (the tiny bundle) perturbs its last block; explicit blocks stay as given.
    small = stage1_params(SampleRequest.from_wire({"spec": SPEC.to_wire(), "audio_guidance": {"stg_blocks": [0]}}), layer_count=2)
    assert small.video_guider.stg_blocks == [1] and small.audio_guider.stg_blocks == [0]


def test_python_built_requests_fill_the_defaults_of_their_version():
    assert SampleRequest(spec=SPEC).steps == 40 and SampleRequest(spec=SPEC, model_version="2.3").steps == 30
    assert SampleRequest(spec=SPEC, audio_guidance=Guidance(cfg_scale=5.0)).audio_guidance == Guidance(5.0, 1.0, 0.7, 3.0, 0, None)
    assert UpscaleRequest(spec=SPEC).sigmas == schema.TDP_UPSCALE_SIGMAS == (0.625, 0.4, 0.0)
    assert (UpscaleRequest(spec=SPEC).seed, UpscaleRequest(spec=SPEC).frame_rate) == (10, 24.0)


# --- requests on the wire -----------------------------------------------------------------------------


REQUESTS = [
    LoadRequest(SPEC, "float32"),
    EncodeRequest(SPEC, ("a fox", ""), "bfloat16", "batch_parallel", True),
    SampleRequest(SPEC, width=96, height=64, num_frames=9, steps=3, video_guidance=Guidance(3.5, stg_blocks=(1,)),
                  audio_guidance=Guidance(stg_blocks=()), parallel="sp", cuda_graphs=False, batch_passes=True,
                  positive_digest="a" * 64, negative_digest="b" * 64),  # fmt: skip
    UpscaleRequest(SPEC, sigmas=(0.909375, 0.725, 0.421875, 0.0), tiles=(2, 3), overlap=1, positive_digest="c" * 64),
    DecodeRequest(SPEC, seed=3, frame_rate=25.0, after_stages=1, spatial_tile_pixels=256, temporal_tile_frames=32),
    UnloadRequest(),
]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.op)
def test_every_request_round_trips_through_json(request_):
    wire = json.loads(json.dumps(request_.to_wire()))
    assert type(request_).from_wire(wire) == request_


@pytest.mark.parametrize(
    ("cls", "change", "message"),
    [
        (SampleRequest, {"stpes": 3}, "unknown sample field(s) ['stpes']; the sample job takes"),
        (SampleRequest, {"steps": 0}, "steps must be an integer from 1 to 1000, got 0; leave it out for the default 40"),
        (SampleRequest, {"steps": True}, "steps must be an integer"),
        (SampleRequest, {"dtype": "int8"}, "dtype must be one of bfloat16, float32, float16, got 'int8'"),
        (SampleRequest, {"parallel": "everything"}, "parallel must be one of auto, sp, guidance, hybrid, got 'everything'"),
        (SampleRequest, {"model_version": "2.1"}, "model_version must be one of 2.0, 2.3, got '2.1'"),
        (SampleRequest, {"audio_guidance": {"cfg": 3}}, "unknown audio_guidance field(s) ['cfg']"),
        (SampleRequest, {"video_guidance": {"stg_blocks": [1.5]}}, "video_guidance.stg_blocks must be a list of block indices"),
        (SampleRequest, {"batch_passes": "yes"}, 'batch_passes must be "auto", true or false'),
        (SampleRequest, {"positive_digest": "abc"}, "positive_digest must be the 64-hex-digit digest the encode job returned"),
        (SampleRequest, {"spec": {"checkpoint_path": 3, "gemma_root": "/g"}}, "'checkpoint_path' must be a non-empty path string"),
        (UpscaleRequest, {"sigmas": [1.0, 0.5, 0.0]}, "TDP Upscale refuses to start from pure noise: the sigmas start at 1.0 (pure noise)"),
        (UpscaleRequest, {"sigmas": [0.4, 0.625, 0.0]}, "sigmas must decrease strictly"),
        (UpscaleRequest, {"sigmas": "0.6"}, "sigmas must be a list of numbers"),
        (UpscaleRequest, {"tiles": [0, 2]}, "tiles must be [height_tiles, width_tiles] of positive integers, got [0, 2]"),
        (DecodeRequest, {"spatial_tile_pixels": 100}, "decode tiles must be multiples of 32 pixels and 8 frames, got 100 px"),
        (DecodeRequest, {"after_stages": 3}, "after_stages must be 0, 1 or 2, got 3"),
        (EncodeRequest, {"prompts": []}, "prompts must be a list of 1 to 16 strings"),
        (EncodeRequest, {"prompts": ["x" * 20_001]}, "a prompt is longer than 20000 characters; shorten it"),
        (EncodeRequest, {"gemma_mode": "fast"}, "gemma_mode must be one of sharded, batch_parallel, got 'fast'"),
        (UnloadRequest, {"spec": {}}, "unknown unload field(s) ['spec']"),
        (SampleRequest, {"image_strength": 1.5}, "image_strength must be a number from 0.0 to 1.0, got 1.5; leave it out for the default 1.0"),
        (UpscaleRequest, {"last_image_strength": -0.1}, "last_image_strength must be a number from 0.0 to 1.0, got -0.1; leave it out for the default 1.0"),
        (UpscaleRequest, {"image_strength": "0.7"}, "image_strength must be a number from 0.0 to 1.0, got '0.7'"),
        (DecodeRequest, {"guiding_frames": 3}, "guiding_frames must be an integer from 0 to 2, got 3; leave it out for the default 0"),
    ],
)
def test_bad_requests_say_what_is_wrong_and_what_to_do(cls, change, message):
    wire = {"spec": SPEC.to_wire(), "prompts": ["a fox"]} if cls is EncodeRequest else ({} if cls is UnloadRequest else {"spec": SPEC.to_wire()})
    with pytest.raises(ValueError) as error:
        cls.from_wire({**wire, **change})
    assert message in str(error.value)
    assert isinstance(error.value, (RequestError, ModelFileError))


def test_forced_upscale_from_noise_is_accepted():
    request = UpscaleRequest.from_wire({"spec": SPEC.to_wire(), "sigmas": [1.0, 0.0], "force_from_noise": True})
    assert request.sigmas == (1.0, 0.0) and request.force_from_noise


def test_torch_free_checks_take_plain_numbers():
    schema.validate_sigmas([0.625, 0.4, 0.0])
    with pytest.raises(ValueError, match=r"at least two values.*e.g. 0.909375, 0.725, 0.421875, 0.0"):
        schema.validate_sigmas([0.5])
    with pytest.raises(ValueError, match="got 120; use 121"):
        schema.validate_generation(512, 768, 120, two_stage=False)
    assert schema.pixel_geometry(16, 32, 48) == (1024, 1536, 121)


# --- the model spec and the embedded bundle ---------------------------------------------------------


def test_embedded_tiny_spec_is_symbolic_and_resolves_to_the_bundle_files(tmp_path):
    from mgpu_backend.bundles.tiny import make_tiny_bundle

    spec = ModelSpec.embedded_tiny(spatial_upsampler=False, distilled_lora_strength=0.8)
    assert spec.to_wire() == {"checkpoint_path": EMBEDDED_TINY, "gemma_root": EMBEDDED_TINY, "spatial_upsampler_path": None,
                              "distilled_lora": EMBEDDED_TINY, "distilled_lora_strength": 0.8, "loras": [],
                              "quantization": None, "residency": "auto",
                              "distilled_lora_strength_stage_1": None, "distilled_lora_strength_stage_2": None}  # fmt: skip
    spec.check_files_exist()  # embedded names are resolved by the ranks, not checked here
    bundle = make_tiny_bundle(tmp_path)
    resolved = spec.resolve_embedded(bundle)
    assert resolved == ModelSpec(bundle.checkpoint_path, bundle.gemma_root, None, bundle.distilled_lora_path, 0.8)
    resolved.check_files_exist()
    with pytest.raises(ModelFileError, match="embedded tiny checkpoint only works with its own text encoder"):
        ModelSpec(EMBEDDED_TINY, str(tmp_path)).resolve_embedded(bundle)


def test_prompt_digest_changes_with_everything_that_changes_the_encoding():
    digest = prompt_digest("a fox", SPEC, "bfloat16", "sharded")
    assert len(digest) == 64 and digest == prompt_digest("a fox", SPEC, "bfloat16", "sharded")
    others = {
        prompt_digest("a fox.", SPEC, "bfloat16", "sharded"),
        prompt_digest("a fox", ModelSpec(SPEC.checkpoint_path, "/m/other-gemma"), "bfloat16", "sharded"),
        prompt_digest("a fox", SPEC, "float32", "sharded"),
        prompt_digest("a fox", SPEC, "bfloat16", "batch_parallel"),
    }
    assert len(others) == 4 and digest not in others
    assert EncodeRequest(SPEC, ("a fox", "b")).digests() == [digest, prompt_digest("b", SPEC, "bfloat16", "sharded")]


def test_rank_prompt_cache_drops_the_least_recently_used_entry_past_its_bound():
    from mgpu_backend.ltx.jobs import PromptCache

    cache = PromptCache(entries=3)
    for name in "abc":
        cache.put(name, name.upper())
    assert cache.get("a") == "A"  # a is now the most recently used
    cache.put("d", "D")
    assert cache.get("b") is None and [cache.get(name) for name in "acd"] == ["A", "C", "D"]
    assert schema.PROMPT_CACHE_ENTRIES == PromptCache().entries == 32


def test_explicit_empty_stg_blocks_perturb_no_block_with_or_without_a_layer_count():
    from mgpu_backend.ltx.stages import guider_params

    none_perturbed = Guidance(3.0, 1.0, 0.7, 3.0, 0, ())
    official = schema.OFFICIAL.video_guidance
    assert guider_params(none_perturbed, official).stg_blocks == [] == guider_params(none_perturbed, official, 48).stg_blocks
    assert guider_params(replace(none_perturbed, stg_blocks=None), official).stg_blocks == [29]


def test_a_sample_requests_sigmas_set_its_steps_and_a_contradicting_steps_or_unknown_sampler_is_refused():
    spec = SPEC.to_wire()
    from mgpu_backend.ltx.schema import DISTILLED_SIGMAS

    request = SampleRequest.from_wire({"spec": spec, "sigmas": list(DISTILLED_SIGMAS), "sampler": "res2s"})
    assert (request.steps, request.sigmas, request.stage1_sigmas, request.sampler) == (8, DISTILLED_SIGMAS, DISTILLED_SIGMAS, "res2s")
    assert SampleRequest.from_wire(request.to_wire()) == request  # through the wire and back
    assert SampleRequest.from_wire({"spec": spec}).stage1_sigmas is None  # the two-stage recipe: LTX2Scheduler's
    refusals = [
        ({"sigmas": [1.0, 0.5, 0.0], "steps": 4}, "steps 4 contradicts the 3 sigmas given (2 steps); leave steps out with sigmas"),
        ({"sigmas": [1.0, 0.5]}, "stage-1 sigmas must run from 1.0 (stage 1 starts from pure noise) down to 0.0 (a clean latent), got 1 ... 0.5"),
        ({"sigmas": "1, 0"}, "sigmas must be a list of numbers"),
        ({"sampler": "euler_ancestral"}, "sampler must be one of euler, res2s (or left out for the recipe's own), got 'euler_ancestral'"),
    ]
    for fields, words in refusals:
        with pytest.raises(RequestError) as raised:
            SampleRequest.from_wire({"spec": spec, **fields})
        assert str(raised.value).startswith(words), str(raised.value)
def test_image_strengths_default_to_1_and_a_strength_without_its_image_is_refused_in_words():
    for cls in (SampleRequest, UpscaleRequest):
        request = cls.from_wire({"spec": SPEC.to_wire(), "image_strength": 0.7})
        assert (request.image_strength, request.last_image_strength) == (0.7, 1.0)
        assert type(request).from_wire(json.loads(json.dumps(request.to_wire()))) == request
    schema.check_image_strengths(0.7, 0.25, True, True)
    schema.check_image_strengths(1.0, 1.0, False, False)
    with pytest.raises(RequestError) as raised:
        schema.check_image_strengths(0.7, 1.0, False, True)
    assert str(raised.value) == (
        "image_strength is 0.7 but no image was given: it is the strength of the first frame image; give the image too, or leave image_strength at 1.0"
    )
    with pytest.raises(RequestError, match="^--last-image-strength is 0.5 but no --last-image was given"):
        schema.check_image_strengths(1.0, 0.5, True, False, {"last_image_strength": "--last-image-strength", "last_image": "--last-image"})
