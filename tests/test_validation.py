"""Input checks of the LTX-2 stages (the schema's torch-free ones and the memory estimate): clear refusals before any model work."""

from __future__ import annotations

import json

import pytest
import torch
from ltx_core.components.guiders import MultiModalGuiderParams
from ltx_pipelines.utils.constants import LTX_2_PARAMS, STAGE_2_DISTILLED_SIGMA_VALUES

from mgpu_backend.ltx.schema import STAGE_2_SIGMAS, nearest_valid_frame_count, validate_generation, validate_sigmas, validate_stg_blocks
from mgpu_backend.ltx.stages import GenerationParams
from mgpu_backend.ltx.validation import GIB, TransformerDims, check_fits, estimate_memory_bytes


def test_frames_not_8k_plus_1_are_refused_with_the_nearest_valid_count():
    with pytest.raises(ValueError, match=r"frames must be 8k\+1.*got 120; use 121"):
        validate_generation(1024, 1536, 120)
    with pytest.raises(ValueError, match="got 116; use 113"):
        validate_generation(1024, 1536, 116)
    assert [nearest_valid_frame_count(n) for n in (1, 2, 5, 8, 9, 120, 122, 125)] == [1, 1, 9, 9, 9, 121, 121, 129]


def test_two_stage_sizes_must_be_multiples_of_64_and_single_stage_of_32():
    with pytest.raises(ValueError, match="width must be a multiple of 64 for the two-stage graph.*got 1504; use 1536"):
        validate_generation(1024, 1504, 121, two_stage=True)
    with pytest.raises(ValueError, match="height must be a multiple of 64.*got 992; use 1024"):
        validate_generation(992, 1536, 121)
    validate_generation(992, 1504, 121, two_stage=False)
    with pytest.raises(ValueError, match="multiple of 32 for a single stage, got 1000; use 992"):
        validate_generation(1000, 1504, 121, two_stage=False)


def test_non_positive_sizes_steps_and_frame_rate_are_refused():
    with pytest.raises(ValueError, match="height must be a positive whole number, got 0"):
        validate_generation(0, 1536, 121)
    with pytest.raises(ValueError, match="num_frames must be a positive whole number, got -7"):
        validate_generation(1024, 1536, -7)
    with pytest.raises(ValueError, match="steps must be a whole number >= 1, got 0"):
        validate_generation(1024, 1536, 121, num_inference_steps=0)
    with pytest.raises(ValueError, match="frame rate must be positive, got 0"):
        validate_generation(1024, 1536, 121, frame_rate=0)
    validate_generation(1024, 1536, 121, num_inference_steps=1, frame_rate=24.0)


def test_generation_params_defaults_equal_the_official_ltx2_defaults():
    params = GenerationParams()
    official = LTX_2_PARAMS
    stage1 = params.stage1
    assert (stage1.height, stage1.width) == (official.stage_1_height, official.stage_1_width) == (512, 768)
    assert (params.height, params.width) == (official.stage_2_height, official.stage_2_width) == (1024, 1536)
    assert (params.num_frames, params.frame_rate, params.seed, params.num_inference_steps) == (
        official.num_frames,
        official.frame_rate,
        official.seed,
        official.num_inference_steps,
    )
    assert params.video_guider == official.video_guider_params
    assert params.audio_guider == official.audio_guider_params
    assert list(STAGE_2_SIGMAS) == list(STAGE_2_DISTILLED_SIGMA_VALUES)
    # Stage 1 alone runs at the given size.
    single = GenerationParams(height=480, width=704, two_stage=False)
    assert (single.stage1.height, single.stage1.width) == (480, 704)


def test_invalid_params_fail_before_any_model_is_touched():
    class NoModels:
        def __getattr__(self, name):
            raise AssertionError(f"the loader was used ({name}) before the input was validated")

    from mgpu_backend.ltx.stages import refine_stage2, sample_stage1

    with pytest.raises(ValueError, match="got 120; use 121"):
        sample_stage1(NoModels(), GenerationParams(num_frames=120), None, None)
    with pytest.raises(ValueError, match="must decrease strictly"):
        refine_stage2(
            NoModels(), GenerationParams(), torch.zeros(1), torch.zeros(1), None, sigmas=[0.5, 0.7, 0.0]
        )


def test_refinement_sigmas_must_decrease_within_0_and_1():
    validate_sigmas(torch.tensor(STAGE_2_SIGMAS))
    with pytest.raises(ValueError, match="at least two values"):
        validate_sigmas(torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\]"):
        validate_sigmas(torch.tensor([1.5, 0.0]))
    with pytest.raises(ValueError, match="must decrease strictly"):
        validate_sigmas(torch.tensor([0.7, 0.7, 0.0]))


def test_stg_blocks_outside_the_model_are_refused_with_the_valid_range():
    official = GenerationParams().video_guider
    outside = r"video stg_blocks \[29\] name blocks \[29\] outside this model's 4 .*\(0..3\)"
    with pytest.raises(ValueError, match=outside):
        validate_stg_blocks(official, 4, "video")
    validate_stg_blocks(official, 48, "video")
    validate_stg_blocks(MultiModalGuiderParams(stg_scale=1.0, stg_blocks=[3]), 4, "audio")
    # STG off: the blocks are never used, so they are not checked.
    validate_stg_blocks(MultiModalGuiderParams(stg_scale=0.0, stg_blocks=[29]), 4, "audio")


def test_memory_estimate_counts_tokens_weights_and_activations_of_the_19b_model():
    estimate = estimate_memory_bytes(1024, 1536, 121, 24.0)
    assert estimate.video_tokens == 16 * 32 * 48 == 24576
    assert estimate.audio_tokens == 126  # round(121 / 24 * 25)
    assert estimate.weight_bytes == 19_000_000_000 * 2
    expected_activations = 2 * (16 * (24576 * 4096 + 126 * 2048) + 2 * 1024 * (4096 + 2048))
    assert estimate.activation_bytes == expected_activations, (estimate.activation_bytes, expected_activations)
    # 3.3 GB of activations and 38 GB of weights: fits one H200, not a 24 GB card.
    assert 3.0 < estimate.activation_bytes / GIB < 3.2
    halved = estimate_memory_bytes(1024, 1536, 121, 24.0, sp_degree=4)
    video_part = 2 * 16 * 24576 * 4096
    assert estimate.activation_bytes - halved.activation_bytes == video_part - video_part // 4


def test_check_fits_refuses_a_job_larger_than_the_free_memory_and_says_the_numbers():
    estimate = estimate_memory_bytes(1024, 1536, 121, 24.0)
    check_fits(estimate, torch.device("cpu"), available_bytes=140 * GIB)
    with pytest.raises(ValueError) as refused:
        check_fits(estimate, torch.device("cuda", 0), available_bytes=24 * GIB)
    message = str(refused.value)
    assert "needs about 38.4 GiB on cuda:0" in message, message
    assert "24576 video tokens, 126 audio tokens: 3.0 GiB of activations + 35.4 GiB of weights" in message, message
    assert "only 24.0 GiB is free; the weights alone do not fit" in message, message
    # Weights fit but a 4K, 20 s job's activations do not: the hint is to shrink or shard the job.
    long_job = estimate_memory_bytes(2176, 3840, 481, 24.0)
    with pytest.raises(ValueError, match=r"497760 video tokens.*only 80.0 GiB is free; lower the resolution"):
        check_fits(long_job, torch.device("cuda", 0), available_bytes=80 * GIB)
    # With the weights already resident only the activations must still fit.
    check_fits(estimate, torch.device("cuda", 0), available_bytes=4 * GIB, weights_resident=True)


def test_a_gpu_ranks_free_memory_is_its_own_share_when_capped_below_the_gpu(monkeypatch):
    """A rank capped to part of its GPU (a memory fraction, or MGPU_MEMORY_LIMIT_GIB) is checked against
    what it may still take, not against the GPU's free memory; its allocator's unused blocks count."""
    from types import SimpleNamespace

    from mgpu_backend.ltx.residency import MEMORY_LIMIT_ENV
    from mgpu_backend.ltx.validation import available_memory_bytes

    fraction = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction["value"], raising=False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 14 * GIB)
    monkeypatch.delenv(MEMORY_LIMIT_ENV, raising=False)
    gpu = torch.device("cuda", 0)
    assert available_memory_bytes(gpu) == 64 * GIB  # 60 free + 4 held unused by this process
    fraction["value"] = 0.3  # a 24 GiB share of the 80 GiB GPU, 10 of it allocated
    assert available_memory_bytes(gpu) == 14 * GIB
    stage = estimate_memory_bytes(1024, 1536, 121, 24.0, sp_degree=1)  # 3.0 GiB of activations
    check_fits(stage, gpu, weights_resident=True)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "12")  # the limit wins over the fraction: 2 GiB left
    assert available_memory_bytes(gpu) == 2 * GIB
    with pytest.raises(ValueError, match=r"only 2.0 GiB is free; lower the resolution"):
        check_fits(stage, gpu, weights_resident=True)
    monkeypatch.setenv(MEMORY_LIMIT_ENV, "8")  # already over its limit: nothing left, not a negative number
    assert available_memory_bytes(gpu) == 0


def test_check_fits_on_cpu_reads_the_available_ram():
    tiny = estimate_memory_bytes(64, 96, 9, 24.0, dims=TransformerDims(2, 2, 16, 2, 8, parameter_count=10_000))
    check_fits(tiny, torch.device("cpu"))
    huge = estimate_memory_bytes(2048, 2048, 1001, 24.0, dtype=torch.float32)
    with pytest.raises(ValueError, match="GiB is free"):
        check_fits(huge, torch.device("cpu"))


def test_transformer_dims_come_from_the_checkpoint_header(tmp_path):
    from safetensors.torch import save_file

    config = {"transformer": {"num_layers": 3, "num_attention_heads": 4, "attention_head_dim": 8,
                              "audio_num_attention_heads": 2, "audio_attention_head_dim": 4}}  # fmt: skip
    tensors = {
        "model.diffusion_model.transformer_blocks.0.attn1.to_q.weight": torch.zeros(32, 32),
        "model.diffusion_model.proj_out.bias": torch.zeros(7),
        # Text connectors and VAE weights are not transformer weights.
        "model.diffusion_model.video_embeddings_connector.learnable_registers": torch.zeros(128, 16),
        "vae.decoder.conv_in.weight": torch.zeros(10, 10),
    }
    path = tmp_path / "checkpoint.safetensors"
    save_file(tensors, str(path), metadata={"config": json.dumps(config)})
    dims = TransformerDims.from_checkpoint(str(path))
    assert dims == TransformerDims(3, 4, 8, 2, 4, parameter_count=32 * 32 + 7), dims
    assert (dims.video_dim, dims.audio_dim) == (32, 8)


def test_generation_fits_check_uses_the_largest_stage_of_the_graph():
    from mgpu_backend.ltx.stages import check_generation_fits

    stage1_only = estimate_memory_bytes(512, 768, 121, 24.0).total_bytes
    two_stage = estimate_memory_bytes(1024, 1536, 121, 24.0).total_bytes
    available = (stage1_only + two_stage) // 2
    check_generation_fits(GenerationParams(height=512, width=768, two_stage=False), "cpu", available_bytes=available)
    with pytest.raises(ValueError, match="24576 video tokens"):
        check_generation_fits(GenerationParams(), "cpu", available_bytes=available)
    with pytest.raises(ValueError, match="got 120; use 121"):
        check_generation_fits(GenerationParams(num_frames=120), "cpu", available_bytes=available)
