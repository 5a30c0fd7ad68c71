"""Guidance parallelism and the stage-1 planner: a 3-step Euler loop whose four guidance passes are
combined by ltx-core's MultiModalGuider, run under the guidance, hybrid and sp plans on real gloo
ranks, must equal the same loop on one rank; and the planner's choices for typical cases.
"""

from __future__ import annotations


import pytest
import torch

from mgpu_backend.ltx.passes import PASS_NAMES, GuidancePass, SequentialPassRunner
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.guidance_parallel import GuidanceParallelRunner, Plan, plan_stage1
from tests.dist_harness import run_ranks
from tests.helpers import (
    TINY_HEADS,
    TOLERANCE,
    VIDEO_TOKENS,
    build_tiny_model,
    euler_stage1_loop,
    from_portable,
    modality,
    portable,
    single_threaded,
    stage1_loops_on_ranks,
    tiny_contexts,
    tiny_latent_states,
)


class _ScaledLatents:
    """A stand-in transformer whose outputs are exactly known: mixed dtypes and a missing output."""

    def __call__(self, video, audio, perturbations):
        return (video.latent * video.sigma.view(-1, 1, 1)).to(torch.bfloat16), None


def exchange_on_ranks() -> list:
    torch.set_num_threads(1)
    world = Comm.world()
    plan = plan_stage1(world.world_size, VIDEO_TOKENS, 3, "guidance", **TINY_HEADS)
    runner = GuidanceParallelRunner(world, plan)
    video_state, audio_state = tiny_latent_states(seed=8)
    video_context, audio_context = tiny_contexts(seed=9)
    passes = [
        GuidancePass(name, modality(video_state, video_context, sigma), modality(audio_state, audio_context, 0.5), None)
        for name, sigma in zip(PASS_NAMES, (0.9, 0.6, 0.3))
    ]
    return portable(runner.run(_ScaledLatents(), passes))


@pytest.fixture(scope="module")
def single_rank_loop():
    return single_threaded(euler_stage1_loop, build_tiny_model(), SequentialPassRunner())


@pytest.fixture(scope="module")
def four_rank_loops():
    return from_portable(run_ranks(4, stage1_loops_on_ranks, ["guidance", "hybrid", "sp"]))


@pytest.fixture(scope="module")
def two_rank_loops():
    return from_portable(run_ranks(2, stage1_loops_on_ranks, ["sp", "guidance"]))


def _assert_loop_matches(reference: dict, per_rank: list[dict], mode: str, layout: tuple[int, int]) -> None:
    for rank, results in enumerate(per_rank):
        result = results[mode]
        assert tuple(result["layout"]) == layout, (mode, result["layout"])
        assert result["passes"] == reference["passes"]
        video_diff = (result["video"] - reference["video"]).abs().max().item()
        audio_diff = (result["audio"] - reference["audio"]).abs().max().item()
        assert video_diff <= TOLERANCE and audio_diff <= TOLERANCE, (
            f"{mode} plan {layout[0]} groups x SP {layout[1]}, rank {rank}: after 3 steps max abs diff "
            f"video {video_diff:.3g}, audio {audio_diff:.3g} (tolerance {TOLERANCE})"
        )


def test_loop_runs_four_then_three_then_two_passes(single_rank_loop):
    assert [len(names) for names in single_rank_loop["passes"]] == [4, 3, 2], single_rank_loop["passes"]
    moved = (single_rank_loop["video"] - tiny_latent_states(seed=5, frames=2, image_conditioning=True)[0].latent)
    assert moved[:, 15:].abs().mean() > 0.1, "the loop must actually denoise"
    assert moved[:, :15].abs().max() < 1e-6, "clean first-frame tokens must stay clean"


def test_guidance_plan_world_4_loop_matches_single_rank(single_rank_loop, four_rank_loops):
    _assert_loop_matches(single_rank_loop, four_rank_loops, "guidance", (4, 1))


def test_hybrid_plan_world_4_two_groups_of_sp_2_loop_matches_single_rank(single_rank_loop, four_rank_loops):
    _assert_loop_matches(single_rank_loop, four_rank_loops, "hybrid", (2, 2))


def test_sp_plan_world_4_loop_matches_single_rank(single_rank_loop, four_rank_loops):
    _assert_loop_matches(single_rank_loop, four_rank_loops, "sp", (1, 4))


def test_sp_plan_world_2_loop_matches_single_rank(single_rank_loop, two_rank_loops):
    _assert_loop_matches(single_rank_loop, two_rank_loops, "sp", (1, 2))


def test_guidance_plan_world_2_three_passes_on_two_groups_matches_single_rank(single_rank_loop, two_rank_loops):
    _assert_loop_matches(single_rank_loop, two_rank_loops, "guidance", (2, 1))


def test_pass_exchange_is_bit_exact_for_bf16_and_missing_outputs():
    per_rank = from_portable(run_ranks(2, exchange_on_ranks))
    video_state, audio_state = tiny_latent_states(seed=8)
    for rank, outputs in enumerate(per_rank):
        assert len(outputs) == 3
        for sigma, (video, audio) in zip((0.9, 0.6, 0.3), outputs):
            expected = (video_state.latent * sigma).to(torch.bfloat16)
            assert audio is None
            assert video.dtype == torch.bfloat16, video.dtype
            diff = (video.float() - expected.float()).abs().max().item()
            assert diff == 0.0, f"rank {rank}, pass at sigma {sigma}: exchanged output differs by {diff:.3g}"


@pytest.mark.parametrize(
    "world_size, video_tokens, passes, mode, layout",
    [
        (8, 6144, 4, "auto", (4, 2)),  # 121 frames at 512 x 768: two ranks per pass
        (8, 6144, 2, "auto", (2, 4)),  # CFG only: two groups of four
        (4, 48, 4, "auto", (4, 1)),  # tiny: SP shards would be launch-bound, one pass per rank
        (2, 24000, 4, "auto", (2, 1)),  # four passes split evenly over two ranks
        (2, 24000, 3, "auto", (1, 2)),  # three passes would leave a rank idle half the time: SP
        (1, 6144, 4, "auto", (1, 1)),
        (8, 6144, 3, "guidance", (4, 2)),  # one group per pass, one group idle
        (2, 6144, 4, "guidance", (2, 1)),  # fewer ranks than passes: groups take turns
        (8, 6144, 4, "sp", (1, 8)),
        (4, 6144, 4, "hybrid", (2, 2)),
        (8, 6144, 4, "hybrid", (4, 2)),
    ],
)
def test_planner_choices(world_size, video_tokens, passes, mode, layout):
    plan = plan_stage1(world_size, video_tokens, passes, mode)
    assert (plan.guidance_groups, plan.sp_degree) == layout, plan.reason
    assert plan.guidance_groups * plan.sp_degree == world_size
    assert f"{layout[0]} guidance groups x SP degree {layout[1]}" in plan.reason, plan.reason
    assert sorted(rank for group in plan.rank_groups for rank in group) == list(range(world_size))


def test_planner_assigns_uneven_passes_round_robin():
    plan = plan_stage1(2, 6144, ["conditional", "unconditional", "perturbed"], "guidance")
    assert plan.assign_passes(3) == [0, 1, 0]
    assert plan.assign_passes(1) == [0]
    assert plan_stage1(4, 6144, 4, "guidance").assign_passes(2) == [0, 1]


def test_planner_reason_names_launch_bound_shards():
    plan = plan_stage1(8, 6144, 1, "sp")
    assert "768 tokens per shard (below the launch-bound ~1500)" in plan.reason, plan.reason


def test_planner_refuses_impossible_requests():
    refusal = "SP degree 3 does not divide the 32 attention heads; use 1, 2, 4, 8, 16 or 32"
    with pytest.raises(ValueError, match=refusal):
        plan_stage1(3, 6144, 4, "sp")
    with pytest.raises(ValueError, match="hybrid mode needs at least 2 groups of at least 2 ranks; world size 2"):
        plan_stage1(2, 6144, 4, "hybrid")
    with pytest.raises(ValueError, match="mode must be one of auto, sp, guidance, hybrid, got 'fast'"):
        plan_stage1(2, 6144, 4, "fast")
    with pytest.raises(ValueError, match="unknown guidance passes"):
        plan_stage1(2, 6144, ["conditional", "negative"], "auto")


def test_planner_never_uses_an_sp_degree_that_splits_heads_unevenly():
    plan = plan_stage1(6, 6144, 4, "auto")
    assert plan.sp_degree in (1, 2), plan.reason
    assert isinstance(plan, Plan) and plan.guidance_groups * plan.sp_degree == 6
