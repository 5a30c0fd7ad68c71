"""The residency policy: decisions for LTX-2 19B and LTX-2.3 22B on 141, 80, 64, 48, 40 and 24 GB
GPUs (bf16 and fp8-cast), the order in which residency is given up (the transformer parked in host
memory while Gemma encodes comes last), the refusal of a model that cannot fit, and a tiny fleet job
that gives bitwise the same latents when every component but the transformer is built per stage
and the transformer is parked for the encode.

The 19B and 22B sizes are the real ones: the safetensors headers of the full-size bundle's files
(``mgpu_backend.bundles.full_size``, from configs/ltx2-19b-transformer.json or
configs/ltx2.3-22b-transformer.json and the official component configurations of
docs/full-size-config.md, the 48-layer Gemma-3 12B), built on the meta device, so no weight is
allocated.
"""

from __future__ import annotations

import os

import pytest
import torch

from mgpu_backend.fleet.client import FleetError
from mgpu_backend.ltx.loading import ModelSpec
from mgpu_backend.ltx.residency import (
    GIB,
    job_peaks,
    MEMORY_LIMIT_ENV,
    ResidencyError,
    component_sizes,
    device_memory_bytes,
    parse_residency,
    plan_residency,
)
from mgpu_backend.parallel.comm import Comm
from tests.dist_harness import run_ranks

from .fleet_harness import run_job
from .helpers import full_size_sizes

GB = 10**9
EVERYTHING_BUT_THE_TRANSFORMER = {
    "gemma", "embeddings_processor", "video_encoder", "video_decoder", "audio_decoder", "vocoder", "spatial_upsampler",
}  # fmt: skip


@pytest.fixture(scope="module")
def sizes_19b():
    return full_size_sizes("ltx2-19b-transformer.json")


@pytest.fixture(scope="module")
def sizes_22b():
    return full_size_sizes("ltx2.3-22b-transformer.json")


def test_19b_component_sizes_are_the_documented_ones(sizes_19b):
    assert round(sizes_19b.transformer_bytes / GB, 1) == 37.8  # docs/full-size-config.md: 18.88 B parameters
    assert round(sizes_19b.transformer_fp8_bytes / GB, 1) == 19.2  # the policy's layers at 1 byte
    assert round(sizes_19b.components["gemma"] / GB, 1) == 24.4  # Gemma-3 12B with its vision tower, bf16
    assert round(sizes_19b.components["video_decoder"] / GB, 1) == 1.1  # 552.8 M parameters
    assert round(sizes_19b.components["spatial_upsampler"] / GB, 2) == 0.25  # 126.3 M parameters


@pytest.mark.parametrize("quantization", [None, "fp8-cast"])
def test_an_h200_keeps_everything_resident_at_19b(sizes_19b, quantization):
    plan = plan_residency(sizes_19b, 141 * GB, world_size=1, quantization=quantization)
    assert plan.per_stage == frozenset() and plan.clean_shard_on_host is False, plan.describe()
    assert plan.peak_bytes <= 141 * GB


def test_an_80_gb_gpu_runs_19b_bf16_with_only_the_transformer_resident(sizes_19b):
    plan = plan_residency(sizes_19b, 80 * GB, world_size=1)
    assert plan.per_stage == EVERYTHING_BUT_THE_TRANSFORMER and plan.clean_shard_on_host is True, plan.describe()
    # It fits without moving the transformer: it stays on the GPU while Gemma encodes (80 GiB too).
    assert plan.transformer_parked_for_encode is False and "parked" not in plan.describe(), plan.describe()
    assert plan_residency(sizes_19b, 80 * GIB, world_size=1).transformer_parked_for_encode is False
    assert plan.peak_bytes <= 80 * GB
    # Forcing every component resident is the user's choice; its estimate says it will not fit.
    assert plan_residency(sizes_19b, 80 * GB, world_size=1, policy="all").peak_bytes > 80 * GB


def test_an_80_gb_gpu_keeps_everything_resident_at_19b_fp8_cast(sizes_19b):
    plan = plan_residency(sizes_19b, 80 * GB, world_size=1, quantization="fp8-cast")
    assert plan.per_stage == frozenset() and plan.clean_shard_on_host is False, plan.describe()
    assert not plan.transformer_parked_for_encode
    assert "fp8-cast transformer" in plan.describe()


def test_40_gib_runs_22b_fp8_cast_with_the_transformer_parked_while_gemma_encodes(sizes_22b):
    # Gemma-3 12B (22.7 GiB) beside the fp8 transformer (18.1 GiB) comes to 42.8 GiB in the encode stage
    # (the 2.3 embeddings processor, 5.9 GiB, is built once Gemma is gone); parked, the encode needs
    # 24.7 GiB and the upscale (transformer + video encoder + upsampler + activations) sets the peak.
    assert round(sizes_22b.transformer_fp8_bytes / GIB, 1) == 18.1
    assert round(sizes_22b.components["embeddings_processor"] / GIB, 1) == 5.9
    plan = plan_residency(sizes_22b, 40 * GIB, world_size=1, quantization="fp8-cast")
    assert plan.transformer_parked_for_encode is True, plan.describe()
    assert plan.per_stage == EVERYTHING_BUT_THE_TRANSFORMER and plan.clean_shard_on_host is True, plan.describe()
    assert round(plan.peak_bytes / GIB, 1) == 25.2, plan.describe()
    assert plan.peak_bytes < sizes_22b.transformer_fp8_bytes + sizes_22b.components["gemma"]  # no longer side by side
    line = plan.describe()
    assert "\n" not in line and line.endswith("; clean LoRA shard in host memory; transformer parked in host memory while Gemma encodes"), line
    # 44 GiB fits without parking (42.8 GiB): the transformer then stays on the GPU for the encode.
    unparked = plan_residency(sizes_22b, 44 * GIB, world_size=1, quantization="fp8-cast")
    assert unparked.transformer_parked_for_encode is False and round(unparked.peak_bytes / GIB, 1) == 42.8, unparked.describe()


def test_residency_is_given_up_in_order_and_parking_the_transformer_comes_last(sizes_22b):
    # Shrinking the budget 0.1 GiB at a time, auto walks through every level once, in order.
    levels, peaks = [], []
    for tenths in range(1500, 0, -1):
        try:
            plan = plan_residency(sizes_22b, tenths * GIB // 10, world_size=1, quantization="fp8-cast")
        except ResidencyError:
            break
        level = (plan.per_stage, plan.clean_shard_on_host, plan.transformer_parked_for_encode)
        if not levels or levels[-1] != level:
            levels.append(level)
            peaks.append(plan.peak_bytes)
    gemma = {"gemma", "embeddings_processor"}
    vaes = gemma | {"video_encoder", "video_decoder", "audio_decoder", "vocoder"}
    assert levels == [
        (frozenset(), False, False),
        (frozenset(gemma), False, False),
        (frozenset(vaes), False, False),
        (frozenset(EVERYTHING_BUT_THE_TRANSFORMER), False, False),
        (frozenset(EVERYTHING_BUT_THE_TRANSFORMER), True, False),
        (frozenset(EVERYTHING_BUT_THE_TRANSFORMER), True, True),
    ], levels
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == len(peaks), peaks
    minimal = plan_residency(sizes_22b, None, world_size=1, policy="minimal", quantization="fp8-cast")
    assert (minimal.per_stage, minimal.clean_shard_on_host, minimal.transformer_parked_for_encode) == levels[-1]
    assert minimal.peak_bytes == peaks[-1]
    assert plan_residency(sizes_22b, None, world_size=1, policy="all", quantization="fp8-cast").transformer_parked_for_encode is False


@pytest.mark.parametrize("quantization", [None, "fp8-cast"])
def test_19b_is_parked_while_gemma_encodes_at_48_gb_in_bf16_and_40_gb_fp8_cast(sizes_19b, quantization):
    # fp8-cast, Gemma and the transformer fit side by side in 48 GB (42.6 GiB); in 40 GB they do not.
    budget = 48 * GB if quantization is None else 40 * GB
    plan = plan_residency(sizes_19b, budget, world_size=1, quantization=quantization)
    assert plan.transformer_parked_for_encode and plan.per_stage == EVERYTHING_BUT_THE_TRANSFORMER, plan.describe()
    assert plan.peak_bytes <= budget


def test_a_40_gb_gpu_is_refused_for_19b_bf16_and_told_that_fp8_cast_fits(sizes_19b):
    with pytest.raises(ResidencyError) as refused:
        plan_residency(sizes_19b, 40 * GB, world_size=1)
    message = str(refused.value)
    assert "even with residency 'minimal'" in message and "load it with quantization 'fp8-cast'" in message, message
    assert "Otherwise shard the transformer over the GPUs (residency 'sharded': about 28.6 GiB per GPU on 2 GPUs)" in message, message
    # The stage that sets the bf16 peak is a denoising one: the whole transformer with what it builds.
    assert "the transformer alone is 35.2 GiB, and the upscale stage builds video_encoder, spatial_upsampler beside it" in message, message
    plan = plan_residency(sizes_19b, 40 * GB, world_size=1, quantization="fp8-cast")
    assert plan.peak_bytes <= 40 * GB and plan.transformer_parked_for_encode, plan.describe()


@pytest.mark.parametrize("quantization", [None, "fp8-cast"])
def test_a_24_gb_gpu_is_refused_for_19b_before_loading_with_the_reason(sizes_19b, quantization):
    # Gemma streamed from host memory no longer sets the peak; a denoising stage does: the whole
    # transformer (17.9 GiB even fp8-cast), the upscale's builds and its activations leave too little of 24 GB.
    with pytest.raises(ResidencyError) as refused:
        plan_residency(sizes_19b, 24 * GB, world_size=1, quantization=quantization)
    message = str(refused.value)
    # Two GPUs hold the fp8-cast 19B sharded (with Gemma spread over them for the encode).
    sharded = {None: "'sharded' with quantization 'fp8-cast'", "fp8-cast": "'sharded'"}[quantization]
    assert "use a GPU with more memory" in message, message
    assert f"Otherwise shard the transformer over the GPUs (residency {sharded}: about 18.6 GiB per GPU on 2 GPUs)" in message, message
    if quantization is None:
        assert "even fp8-cast weights would need about 25.4 GiB" in message, message
    else:
        assert "about 25.4 GiB per GPU even with residency 'minimal' (the transformer alone is 17.9 GiB, and the upscale stage" in message, message


def test_gemmas_streamed_floor_is_its_token_embeddings_and_two_layers(sizes_19b):
    # Gemma-3 12B: 262144 x 3840 token embeddings in bf16 (2.01 GB); a text layer 0.45 GB.
    assert round(sizes_19b.gemma_streamed_bytes / GB, 2) == 2.91
    assert sizes_19b.gemma_streamed_bytes < sizes_19b.components["gemma"] / 8


def test_gemma_is_streamed_only_when_parking_the_transformer_is_not_enough(sizes_22b):
    # A 24 GiB rank of 4 sharing one GPU (Gemma not spread): parked, Gemma (22.7 GiB) whole and its
    # processor exceed 24 GiB, so Gemma's layers beyond the budget stay in host memory; at 32 GiB it fits whole.
    tight = plan_residency(sizes_22b, 24 * GIB, world_size=4, policy="sharded", gemma_split=1)
    roomy = plan_residency(sizes_22b, 32 * GIB, world_size=4, policy="sharded", gemma_split=1)
    assert tight.gemma_streamed and tight.transformer_parked_for_encode and tight.peak_bytes <= 24 * GIB, tight.describe()
    assert "Gemma's layers beyond the device's room streamed from host memory" in tight.describe()
    assert not roomy.gemma_streamed, roomy.describe()
    peaks = job_peaks(sizes_22b, tight, 4 * GIB, 4 * GIB, 2 * GIB)
    assert peaks["encode"] == 24 * GIB, peaks  # Gemma takes what the budget leaves beside the processor
    # Spread over two GPUs of their own, the same ranks need no streaming.
    assert not plan_residency(sizes_22b, 24 * GIB, world_size=4, policy="sharded", gemma_split=4).gemma_streamed
    # Without a budget (CPU ranks) nothing is streamed.
    assert not plan_residency(sizes_22b, None, world_size=4, policy="sharded").gemma_streamed


def test_more_ranks_shrink_only_the_clean_shard(sizes_19b):
    one, eight = (plan_residency(sizes_19b, 141 * GB, world_size=world) for world in (1, 8))
    assert one.peak_bytes - eight.peak_bytes == sizes_19b.transformer_bytes - -(-sizes_19b.transformer_bytes // 8)


def test_the_decision_is_logged_in_one_line(sizes_19b):
    line = plan_residency(sizes_19b, 80 * GB, world_size=1).describe()
    assert "\n" not in line and line.startswith("residency auto: estimated peak"), line
    assert "built per stage: audio_decoder, embeddings_processor, gemma" in line and "clean LoRA shard in host memory" in line
    parked = plan_residency(sizes_19b, 48 * GB, world_size=1).describe()
    assert "\n" not in parked and parked.endswith("clean LoRA shard in host memory; transformer parked in host memory while Gemma encodes"), parked


def test_residency_and_the_memory_limit_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="residency must be one of auto, all, minimal, sharded, got 'some'"):
        parse_residency("some")
    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    assert device_memory_bytes(torch.device("cpu")) is None
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "79.5")
    assert device_memory_bytes(torch.device("cpu")) == int(79.5 * GIB)
    for text in ("lots", "0", "-8", "inf", "nan"):
        monkeypatch.setenv(MEMORY_LIMIT_ENV, text)
        with pytest.raises(ValueError, match=f"{MEMORY_LIMIT_ENV} must be a positive number of GiB, got '{text}'; unset it to use the GPU's memory"):
            device_memory_bytes(torch.device("cpu"))


# --- On the tiny bundle -------------------------------------------------------------------------------


def _refused_before_loading(spec_json: dict, limit_gib: str) -> dict:
    from mgpu_backend.ltx.jobs import ResidentModel

    os.environ[MEMORY_LIMIT_ENV] = limit_gib
    spec = ModelSpec.from_wire(spec_json)
    try:
        ResidentModel(spec, torch.device("cpu"), torch.bfloat16, Comm.world())
    except ResidencyError as error:
        return {"error": str(error)}
    return {"error": None}


def test_a_rank_refuses_a_model_larger_than_its_memory_limit_before_loading(spec, bundle):
    sizes = component_sizes(ModelSpec.from_wire(spec))
    limit_gib = f"{sizes.transformer_bytes / GIB / 2:.6f}"  # half the tiny transformer
    (out,) = run_ranks(1, _refused_before_loading, spec, limit_gib)
    assert out["error"] is not None and "even with residency 'minimal'" in out["error"], out


_run = run_job


def _two_stage_job(socket_path, spec: dict, residency: str, logs: list) -> dict:
    common = {"spec": {**spec, "residency": residency}}
    _run(socket_path, "load", common, on_log=logs.append)
    encoded = _run(socket_path, "encode", {**common, "prompts": ["a red fox in the snow", "blurry"]}, on_log=logs.append)
    contexts = {
        "positive_video_context": encoded.tensors["video_context_0"], "positive_audio_context": encoded.tensors["audio_context_0"],
        "negative_video_context": encoded.tensors["video_context_1"], "negative_audio_context": encoded.tensors["audio_context_1"],
    }  # fmt: skip
    image = torch.rand(64, 96, 3, generator=torch.Generator().manual_seed(3))  # conditions stage 1 through the VAE encoder
    guidance = {"cfg_scale": 3.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0, "stg_blocks": [1]}
    sample_args = {**common, "width": 96, "height": 64, "num_frames": 9, "seed": 7, "steps": 2, "video_guidance": guidance, "audio_guidance": guidance}
    stage1 = _run(socket_path, "sample", sample_args, {**contexts, "image": image})
    stage2 = _run(socket_path, "upscale", {**common, "seed": 7}, {**stage1.tensors, **contexts, "image": image})
    decoded = _run(socket_path, "decode", {**common, "seed": 7, "after_stages": 2}, stage2.tensors)
    return {
        "contexts": contexts, "stage1_video": stage1.tensors["video_latent"], "stage1_audio": stage1.tensors["audio_latent"],
        "stage2_video": stage2.tensors["video_latent"], "frames": decoded.tensors["frames"], "waveform": decoded.tensors["waveform"],
    }  # fmt: skip


def test_a_tiny_fleet_job_under_minimal_residency_gives_bitwise_the_latents_of_all(fleet, spec):
    all_logs, minimal_logs = [], []
    everything = _two_stage_job(fleet, spec, "all", all_logs)
    minimal = _two_stage_job(fleet, spec, "minimal", minimal_logs)
    for name, value in everything.items():
        values = value.values() if isinstance(value, dict) else [value]
        others = minimal[name].values() if isinstance(value, dict) else [minimal[name]]
        for ours, theirs in zip(values, others):
            assert torch.equal(ours, theirs), f"{name} differs between residency all and minimal"
    assert any("residency all:" in line and "built per stage: none" in line for line in all_logs), all_logs
    assert any("residency minimal:" in line and "built per stage: audio_decoder" in line for line in minimal_logs), minimal_logs
    # Minimal parks the transformer for the encode: the encode job asked the tracker, which on a CPU
    # rank (weights in host memory already) frees nothing and says so; under all it is never asked.
    assert any(line.endswith("transformer parked in host memory while Gemma encodes") for line in minimal_logs), minimal_logs
    cpu_rank_note = "on a CPU rank the host is the device, nothing to free"
    assert any("transformer not parked on rank" in line and cpu_rank_note in line for line in minimal_logs), minimal_logs
    assert not any("parked" in line for line in all_logs), all_logs
    # Built per stage, the embeddings processor is built only where prompts are encoded (rank 0 in the
    # default Gemma mode): the other rank keeps no host copy of it.
    skipped = "embeddings processor not built at load on rank 1: built per stage, it is read when this rank first encodes a prompt"
    assert any(skipped in line for line in minimal_logs), minimal_logs
    assert not any("not built at load on rank 0" in line for line in minimal_logs) and not any(skipped in line for line in all_logs)


def test_jobs_reload_a_model_resident_with_another_quantization_and_refuse_an_unknown_one(fleet, spec):
    plain = _run(fleet, "load", {"spec": spec}).fields["weights"]
    logs = []
    cast = _run(fleet, "load", {"spec": {**spec, "quantization": "fp8-cast"}}, on_log=logs.append).fields["weights"]
    assert any("residency auto:" in line and "(fp8-cast transformer)" in line for line in logs), logs
    assert cast["working_bytes"] < 0.75 * plain["working_bytes"], (cast, plain)
    assert cast["clean_shard_bytes"] < 0.75 * plain["clean_shard_bytes"], "the clean shard holds the fp8 bytes too"
    with pytest.raises(FleetError, match=r"quantization must be null .* or one of 'fp8-cast', got 'int8'"):
        _run(fleet, "load", {"spec": {**spec, "quantization": "int8"}})
    with pytest.raises(FleetError, match="residency must be one of auto, all, minimal"):
        _run(fleet, "load", {"spec": {**spec, "residency": "most"}})
    _run(fleet, "unload", {})
