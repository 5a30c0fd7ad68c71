"""Guidance parallelism and the stage-1 planner: a 3-step Euler loop whose four guidance passes are
combined by ltx-core's MultiModalGuider, run under the guidance, hybrid and sp plans on real gloo
ranks, must equal the same loop on one rank; and the planner's choices for typical cases.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ltx_core.components.diffusion_steps import EulerDiffusionStep
from ltx_core.components.guiders import MultiModalGuiderFactory, MultiModalGuiderParams
from ltx_core.guidance.perturbations import (
    BatchedPerturbationConfig,
    Perturbation,
    PerturbationConfig,
    PerturbationType,
)

from mgpu_backend.ltx.passes import PASS_NAMES, GuidancePass, SequentialPassRunner
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.guidance_parallel import (
    GuidanceParallelRunner,
    Plan,
    apply_guidance_parallel,
    build_stage1_groups,
    plan_stage1,
)
from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel
from tests.dist_harness import run_ranks
from tests.test_sequence_parallel import (
    ISOLATED,
    build_tiny_model,
    from_portable,
    modality,
    portable,
    single_threaded,
    tiny_contexts,
    tiny_latent_states,
)

TOLERANCE = 1e-5
SIGMAS = torch.tensor([1.0, 0.7, 0.4, 0.0])
TINY_HEADS = {"attention_heads": 8, "audio_attention_heads": 8}
VIDEO_TOKENS = 45  # 2 latent frames of 3 x 5 plus one appended keyframe of 3 x 5


def _guider_factories() -> tuple[MultiModalGuiderFactory, MultiModalGuiderFactory]:
    """Guidance that changes the active passes between steps: all four at sigma 1.0, no STG at
    0.7 (three passes: uneven on two groups), CFG only at 0.4 (two passes: idle groups)."""
    negative_video, negative_audio = tiny_contexts(seed=11)

    def schedule(cfg: float, stg: float, modality_scale: float, rescale: float) -> dict:
        # Bins by sigma upper bound: (0.75, 1.0] all passes, (0.5, 0.75] no STG, below 0.5 CFG only.
        return {
            1.0: MultiModalGuiderParams(
                cfg_scale=cfg, stg_scale=stg, stg_blocks=[1], rescale_scale=rescale, modality_scale=modality_scale
            ),
            0.75: MultiModalGuiderParams(
                cfg_scale=cfg, stg_scale=0.0, stg_blocks=[1], rescale_scale=rescale, modality_scale=modality_scale
            ),
            0.5: MultiModalGuiderParams(cfg_scale=cfg, stg_scale=0.0, rescale_scale=0.0, modality_scale=1.0),
        }

    return (
        MultiModalGuiderFactory.from_dict(schedule(3.0, 1.0, 3.0, 0.7), negative_context=negative_video),
        MultiModalGuiderFactory.from_dict(schedule(7.0, 1.0, 3.0, 0.0), negative_context=negative_audio),
    )


def _step_passes(video, audio, video_guider, audio_guider) -> list[GuidancePass]:
    passes = [GuidancePass("conditional", video, audio, None)]
    if video_guider.do_unconditional_generation() or audio_guider.do_unconditional_generation():
        negative_video = replace(video, context=video_guider.negative_context)
        negative_audio = replace(audio, context=audio_guider.negative_context)
        passes.append(GuidancePass("unconditional", negative_video, negative_audio, None))
    if video_guider.do_perturbed_generation() or audio_guider.do_perturbed_generation():
        skipped = [Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, video_guider.params.stg_blocks)]
        skipped.append(Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, audio_guider.params.stg_blocks))
        passes.append(GuidancePass("perturbed", video, audio, BatchedPerturbationConfig([PerturbationConfig(skipped)])))
    if video_guider.do_isolated_modality_generation() or audio_guider.do_isolated_modality_generation():
        passes.append(GuidancePass("isolated", video, audio, BatchedPerturbationConfig([ISOLATED])))
    return passes


def _guided(guider, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return guider.calculate(
        outputs["conditional"],
        outputs.get("unconditional", 0.0),
        outputs.get("perturbed", 0.0),
        outputs.get("isolated", 0.0),
    )


def euler_stage1_loop(transformer, runner) -> dict:
    """Three Euler steps of image-conditioned AV denoising with full multi-modal guidance."""
    video_state, audio_state = tiny_latent_states(seed=5, frames=2, image_conditioning=True)
    video_context, audio_context = tiny_contexts(seed=6)
    video_factory, audio_factory = _guider_factories()
    stepper = EulerDiffusionStep()
    pass_names = []
    with torch.no_grad():
        for step in range(len(SIGMAS) - 1):
            sigma = float(SIGMAS[step])
            video_guider, audio_guider = video_factory.build_from_sigma(sigma), audio_factory.build_from_sigma(sigma)
            passes = _step_passes(
                modality(video_state, video_context, sigma),
                modality(audio_state, audio_context, sigma),
                video_guider,
                audio_guider,
            )
            pass_names.append([guidance_pass.name for guidance_pass in passes])
            outputs = runner.run(transformer, passes)
            denoised_video = _guided(video_guider, {p.name: out[0] for p, out in zip(passes, outputs)})
            denoised_audio = _guided(audio_guider, {p.name: out[1] for p, out in zip(passes, outputs)})
            # Clean conditioning tokens (denoise mask 0) keep their clean latent.
            mask = video_state.denoise_mask
            denoised_video = denoised_video * mask + video_state.clean_latent * (1 - mask)
            video_state = replace(video_state, latent=stepper.step(video_state.latent, denoised_video, SIGMAS, step))
            audio_state = replace(audio_state, latent=stepper.step(audio_state.latent, denoised_audio, SIGMAS, step))
    return {"video": video_state.latent, "audio": audio_state.latent, "passes": pass_names}


def stage1_loops_on_ranks(modes: list[str], variant: str = "19b") -> dict:
    torch.set_num_threads(1)
    world = Comm.world()
    results = {}
    for mode in modes:
        plan = plan_stage1(world.world_size, VIDEO_TOKENS, PASS_NAMES, mode, **TINY_HEADS)
        sp_comm, runner = build_stage1_groups(world, plan), apply_guidance_parallel(world, plan)
        transformer = apply_sequence_parallel(build_tiny_model(variant), sp_comm)
        results[mode] = {"layout": (plan.guidance_groups, plan.sp_degree), **euler_stage1_loop(transformer, runner)}
    return portable(results)


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
