"""Sequence parallelism on a tiny random LTX-2 transformer: SP degrees 2 and 4 (real gloo ranks)
against the unparallelised model, with every perturbation type, a video token count that no degree
divides, and image conditioning (zero-timestep first frame, appended keyframe tokens, attention mask).

The model and input builders here are also used by ``test_guidance_parallel``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.sequence_parallel import (
    VideoTokenShards,
    apply_sequence_parallel,
    check_sp_degree,
    remove_sequence_parallel,
    sequence_parallel_degree,
)
from tests.dist_harness import run_ranks
from tests.helpers import CommOfSize, build_tiny_model, from_portable, portable, run_sp_forward_cases, single_threaded, sp_forward_cases

TOLERANCE = 1e-5


LOCAL_QUERIES = "4, local video queries"  # SP degree 4 as on GPUs: video-query cross-attention on the local shards


def sp_forward_on_ranks() -> dict:
    """On 4 ranks: every case at SP degree 4 (one group), at SP degree 4 with the video-query
    cross-attentions on the local shards (the GPU layout), then at SP degree 2 (two groups of two),
    re-applying SP to the same model instances."""
    torch.set_num_threads(1)
    world = Comm.world()
    models = {variant: build_tiny_model(variant) for variant in ("19b", "22b")}
    results = {}
    for key, degree, groups, video_query_exchange in ((4, 4, [[0, 1, 2, 3]], None), (LOCAL_QUERIES, 4, [[0, 1, 2, 3]], False), (2, 2, [[0, 1], [2, 3]], None)):
        comm = world if degree == world.world_size else world.split(groups)
        for model in models.values():
            apply_sequence_parallel(model, comm, video_query_exchange=video_query_exchange)
            assert sequence_parallel_degree(model) == degree
        results[key] = run_sp_forward_cases(models)
    for model in models.values():
        remove_sequence_parallel(model)
    results["after_removal"] = run_sp_forward_cases(models)
    return portable(results)


@pytest.fixture(scope="module")
def single_rank_outputs():
    return single_threaded(run_sp_forward_cases, {variant: build_tiny_model(variant) for variant in ("19b", "22b")})


@pytest.fixture(scope="module")
def four_rank_outputs():
    return from_portable(run_ranks(4, sp_forward_on_ranks))


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(sp_forward_cases()))
@pytest.mark.parametrize("sp_degree", [2, 4, LOCAL_QUERIES])
def test_sp_degree_matches_single_rank_fp32(sp_degree, case, single_rank_outputs, four_rank_outputs):
    video_tokens = sp_forward_cases()[case][1].latent.shape[1]
    assert video_tokens % (4 if sp_degree == LOCAL_QUERIES else sp_degree) != 0, "the case must exercise padding"
    reference_video, reference_audio = single_rank_outputs[case]
    assert reference_video.abs().mean() > 0.1 and reference_audio.abs().mean() > 0.1
    for rank, per_rank in enumerate(four_rank_outputs):
        video, audio = per_rank[sp_degree][case]
        video_diff = _max_abs_diff(video, reference_video)
        audio_diff = _max_abs_diff(audio, reference_audio)
        assert video_diff <= TOLERANCE and audio_diff <= TOLERANCE, (
            f"SP degree {sp_degree}, {case}, rank {rank}: max abs diff video {video_diff:.3g}, "
            f"audio {audio_diff:.3g} (tolerance {TOLERANCE})"
        )


def test_sp_ranks_of_a_group_return_identical_outputs(four_rank_outputs):
    for sp_degree in (2, 4, LOCAL_QUERIES):
        for case in sp_forward_cases():
            first_video, first_audio = four_rank_outputs[0][sp_degree][case]
            for rank, per_rank in enumerate(four_rank_outputs[1:], start=1):
                video, audio = per_rank[sp_degree][case]
                diff = max(_max_abs_diff(video, first_video), _max_abs_diff(audio, first_audio))
                assert diff == 0.0, f"SP degree {sp_degree}, {case}: rank {rank} differs from rank 0 by {diff:.3g}"


def test_removed_sp_restores_single_rank_forward(single_rank_outputs, four_rank_outputs):
    for case, (reference_video, reference_audio) in single_rank_outputs.items():
        video, audio = four_rank_outputs[0]["after_removal"][case]
        diff = max(_max_abs_diff(video, reference_video), _max_abs_diff(audio, reference_audio))
        assert diff <= TOLERANCE, f"{case} after remove_sequence_parallel: max abs diff {diff:.3g}"


def test_image_conditioning_case_has_clean_tokens_appended_tokens_and_mask():
    _, video, _, _ = sp_forward_cases()["image_conditioned"]
    assert video.latent.shape[1] == 45, video.latent.shape
    assert video.attention_mask is not None and video.attention_mask.shape == (1, 45, 45)
    zero_timestep_tokens = int((video.timesteps.flatten() == 0).sum())
    assert zero_timestep_tokens == 15, f"first latent frame should have zero timesteps, got {zero_timestep_tokens}"


def test_sp_degree_3_refused_with_the_valid_degrees():
    with pytest.raises(ValueError) as refused:
        check_sp_degree(3, 32, 32)
    assert str(refused.value) == "SP degree 3 does not divide the 32 attention heads; use 1, 2, 4, 8, 16 or 32"

    model = build_tiny_model()
    with pytest.raises(ValueError) as refused:
        apply_sequence_parallel(model, CommOfSize(3))
    assert str(refused.value) == "SP degree 3 does not divide the 8 attention heads; use 1, 2, 4 or 8"
    assert sequence_parallel_degree(model) == 1


def test_sp_degree_refused_when_it_does_not_divide_the_audio_heads():
    with pytest.raises(ValueError) as refused:
        check_sp_degree(4, 32, 2)
    assert str(refused.value) == "SP degree 4 does not divide the 2 audio attention heads; use 1 or 2"


def test_sp_on_cpu_weights_runs_the_video_query_cross_attentions_head_parallel_and_says_why(caplog):
    model = build_tiny_model()
    with caplog.at_level(logging.INFO, logger="mgpu_backend.parallel.sequence_parallel"):
        apply_sequence_parallel(model, CommOfSize(4))
    blocks = model.velocity_model.transformer_blocks
    exchanged = {name for name in ("attn1", "attn2", "audio_to_video_attn", "video_to_audio_attn", "audio_attn1", "audio_attn2")
                 if getattr(blocks[0], name).attention_function.__class__.__module__ == "mgpu_backend.parallel.sequence_parallel"}  # fmt: skip
    assert exchanged == {"attn1", "attn2", "audio_to_video_attn", "video_to_audio_attn"}
    (line,) = [record.getMessage() for record in caplog.records]
    assert "text and video-from-audio cross-attention head-parallel over all video queries too (CPU attention rounds" in line
    with caplog.at_level(logging.INFO, logger="mgpu_backend.parallel.sequence_parallel"):
        apply_sequence_parallel(model, CommOfSize(4), video_query_exchange=False)
    local = {name for name in ("attn2", "audio_to_video_attn") if getattr(blocks[0], name).attention_function.__class__.__module__ == "mgpu_backend.parallel.sequence_parallel"}
    assert local == set() and "on the local shards" in caplog.records[-1].getMessage()
    remove_sequence_parallel(model)
    assert sequence_parallel_degree(model) == 1


def test_sp_degree_1_leaves_model_unchanged_and_logs_one_line(caplog, single_rank_outputs):
    model = build_tiny_model()
    with caplog.at_level(logging.INFO, logger="mgpu_backend.parallel.sequence_parallel"):
        apply_sequence_parallel(model, Comm.world())
    assert len(caplog.records) == 1 and "SP degree 1" in caplog.records[0].getMessage()
    _, video, audio, _ = sp_forward_cases()["unperturbed"]
    with torch.no_grad():
        out_video, out_audio = single_threaded(model, video, audio, None)
    reference_video, reference_audio = single_rank_outputs["unperturbed"]
    diff = max(_max_abs_diff(out_video, reference_video), _max_abs_diff(out_audio, reference_audio))
    assert diff == 0.0, f"degree 1 changed the output by {diff:.3g}"


@pytest.mark.parametrize("video_tokens, sp_degree, padding", [(45, 4, 3), (45, 2, 1), (48, 8, 0), (1, 4, 3)])
def test_video_token_shards_cover_the_sequence_in_order(video_tokens, sp_degree, padding):
    shards = VideoTokenShards(video_tokens, sp_degree)
    assert shards.padding == padding and shards.padded_tokens % sp_degree == 0
    tokens = torch.arange(float(video_tokens)).view(1, video_tokens, 1)
    pieces = [shards.shard(tokens, 1, rank) for rank in range(sp_degree)]
    assert all(piece.shape[1] == shards.shard_tokens for piece in pieces)
    joined = torch.cat(pieces, dim=1)
    assert torch.equal(joined[:, :video_tokens], tokens), joined.flatten().tolist()
    assert torch.equal(joined[:, video_tokens:], tokens[:, -1:].expand(1, padding, 1))
