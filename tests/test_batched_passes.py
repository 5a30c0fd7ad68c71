"""A step's guidance passes as one batched forward on a tiny random LTX-2 transformer (fp32, CPU):
the four passes (CFG's negative prompt, STG, modality isolation, an image-conditioned attention
mask) batched must equal them run one after another, on one rank and under SP degree 2 (gloo), and
a 3-step stage-1 loop with batched passes must equal the sequential loop, also under guidance
parallelism where each group batches its own share.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ltx_core.guidance.perturbations import BatchedPerturbationConfig, PerturbationConfig

from mgpu_backend.ltx.passes import PASS_NAMES, GuidancePass, SequentialPassRunner
from mgpu_backend.parallel.batched_passes import (
    BATCH_PASSES_BELOW_TOKENS,
    BatchedPassRunner,
    PassesNotBatchable,
    batch_passes,
    apply_batched_passes,
    batch_passes_wanted,
    split_outputs,
)
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.guidance_parallel import (
    GuidanceParallelRunner,
    apply_guidance_parallel,
    build_stage1_groups,
    plan_stage1,
)
from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel
from tests.dist_harness import run_ranks
from tests.helpers import (
    ISOLATED,
    STG,
    TINY_HEADS,
    VIDEO_TOKENS,
    build_tiny_model,
    euler_stage1_loop,
    from_portable,
    modality,
    portable,
    single_threaded,
    tiny_contexts,
    tiny_latent_states,
)

# Outputs are of size ~7; a batched kernel rounds differently from a batch-1 one by ~1e-6 there.
TOLERANCE = 1e-5
# The loop's guiders amplify pass differences (CFG 7 on audio: guided = c + 6 (c - u) + ...) and 3
# Euler steps carry them on: measured 8.2e-6 with outputs ~8. A batching mistake moves them by >0.1.
LOOP_TOLERANCE = 5e-5


class CountingTransformer:
    """The model, counting its forwards and the batch size of each."""

    def __init__(self, model) -> None:
        self.model = model
        self.batch_sizes: list[int] = []

    def __call__(self, video, audio, perturbations):
        self.batch_sizes.append(video.latent.shape[0])
        return self.model(video=video, audio=audio, perturbations=perturbations)


def four_passes(image_conditioning: bool = True, video_enabled: bool = True) -> list[GuidancePass]:
    """The passes of one stage-1 step as ``stages.guidance_passes`` builds them: a 0-d sigma, the
    negative prompt in the unconditional pass (always enabled), STG in block 1, both
    audio<->video cross-attentions skipped in the isolated pass."""
    video_state, audio_state = tiny_latent_states(seed=21, frames=2, image_conditioning=image_conditioning)
    positive_video, positive_audio = tiny_contexts(seed=22)
    negative_video, negative_audio = tiny_contexts(seed=23)
    sigma = torch.tensor(0.8)
    video = replace(modality(video_state, positive_video, 0.8, enabled=video_enabled), sigma=sigma)
    audio = replace(modality(audio_state, positive_audio, 0.8), sigma=sigma)
    negative = (replace(video, context=negative_video, enabled=True), replace(audio, context=negative_audio))
    return [
        GuidancePass("conditional", video, audio, None),
        GuidancePass("unconditional", *negative, None),
        GuidancePass("perturbed", video, audio, BatchedPerturbationConfig([STG])),
        GuidancePass("isolated", video, audio, BatchedPerturbationConfig([ISOLATED])),
    ]


def _max_diff(outputs, reference) -> list[tuple[str, float, float]]:
    return [
        (name, (out[0] - ref[0]).abs().max().item(), (out[1] - ref[1]).abs().max().item())
        for name, out, ref in zip(PASS_NAMES, outputs, reference, strict=True)
    ]


def _assert_close(outputs, reference, what: str) -> None:
    diffs = _max_diff(outputs, reference)
    worst = max(max(video, audio) for _, video, audio in diffs)
    details = ", ".join(f"{name} video {video:.3g} audio {audio:.3g}" for name, video, audio in diffs)
    assert worst <= TOLERANCE, f"{what}: max abs diff per pass: {details} (tolerance {TOLERANCE})"


def _forward_both_ways(image_conditioning: bool = True, video_enabled: bool = True, variant: str = "19b"):
    model = build_tiny_model(variant)
    passes = four_passes(image_conditioning, video_enabled)
    counting = CountingTransformer(model)
    with torch.no_grad():
        sequential = SequentialPassRunner().run(model, passes)
        batched = BatchedPassRunner().run(counting, passes)
    return sequential, batched, counting.batch_sizes


# -- batching itself -----------------------------------------------------------------------------


def test_batch_passes_stacks_every_input_in_pass_order_and_split_outputs_undoes_it():
    passes = four_passes()
    video, audio, perturbations = batch_passes(passes)
    assert video.latent.shape[0] == audio.latent.shape[0] == 4
    for field in ("latent", "timesteps", "positions", "context", "attention_mask"):
        for index, guidance_pass in enumerate(passes):
            expected = getattr(guidance_pass.video, field)[0]
            difference = (getattr(video, field)[index] - expected).abs().max().item()
            assert difference == 0, f"video.{field} of pass {guidance_pass.name}: max abs diff {difference}"
    assert (audio.context[1] - passes[1].audio.context[0]).abs().max().item() == 0
    assert video.sigma.tolist() == pytest.approx([0.8] * 4) and audio.sigma.shape == (4,)
    assert perturbations.perturbations == [PerturbationConfig.empty(), PerturbationConfig.empty(), STG, ISOLATED]

    outputs = (video.latent * 2, None)
    split = split_outputs(outputs, passes)
    assert len(split) == 4 and all(audio_out is None for _, audio_out in split)
    for index, (video_out, _) in enumerate(split):
        difference = (video_out - passes[index].video.latent * 2).abs().max().item()
        assert video_out.shape == passes[index].video.latent.shape and difference == 0, difference


def test_batch_passes_without_perturbations_hands_none_to_the_forward():
    passes = four_passes()[:2]
    assert batch_passes(passes)[2] is None


def test_batch_passes_refuses_different_enabled_flags_naming_the_field():
    passes = four_passes(video_enabled=False)
    with pytest.raises(PassesNotBatchable, match=r"'unconditional'.*video\.enabled"):
        batch_passes(passes)


def test_batch_passes_refuses_different_token_and_text_lengths():
    passes = four_passes()
    shorter_text = replace(passes[1], video=replace(passes[1].video, context=passes[1].video.context[:, :5]))
    with pytest.raises(PassesNotBatchable, match=r"video\.context: \(\(5, 64\)"):
        batch_passes([passes[0], shorter_text])
    unmasked = four_passes(image_conditioning=False)[0]
    with pytest.raises(PassesNotBatchable, match=r"video\.latent"):
        batch_passes([passes[0], unmasked])


# -- faithfulness on one rank ------------------------------------------------------------------


def test_four_passes_batched_match_sequential_fp32_in_one_forward():
    sequential, batched, batch_sizes = single_threaded(_forward_both_ways)
    assert batch_sizes == [4], f"expected one forward of batch 4, got batches {batch_sizes}"
    _assert_close(batched, sequential, "four passes batched vs sequential, one rank")


def test_four_passes_batched_match_sequential_fp32_with_22b_options():
    # Split RoPE, gated attention and cross-attention AdaLN, whose prompt AdaLN reads the per-sample sigma.
    sequential, batched, batch_sizes = single_threaded(_forward_both_ways, True, True, "22b")
    assert batch_sizes == [4], f"expected one forward of batch 4, got batches {batch_sizes}"
    _assert_close(batched, sequential, "four passes batched vs sequential, 22B options")


def test_passes_with_different_enabled_flags_batch_in_compatible_sets():
    # A video skip step: the conditional, perturbed and isolated passes run without video, the
    # unconditional one with it; three share a forward and the odd one runs alone.
    sequential, batched, batch_sizes = single_threaded(_forward_both_ways, True, False)
    assert sorted(batch_sizes) == [1, 3], f"expected forwards of batch 3 and 1, got {batch_sizes}"
    _assert_close(batched, sequential, "video-disabled passes batched in two sets vs sequential")


def test_a_single_pass_goes_straight_to_the_inner_runner():
    model = build_tiny_model()
    counting = CountingTransformer(model)
    with torch.no_grad():
        (output,) = BatchedPassRunner().run(counting, four_passes()[:1])
        (reference,) = SequentialPassRunner().run(model, four_passes()[:1])
    assert counting.batch_sizes == [1]
    assert (output[0] - reference[0]).abs().max().item() == 0


# -- the job argument --------------------------------------------------------------------------


def test_batch_passes_auto_batches_only_launch_bound_shards_on_gpus():
    below = plan_stage1(4, 4 * (BATCH_PASSES_BELOW_TOKENS - 100), 4, "sp", **TINY_HEADS)
    above = plan_stage1(4, 4 * (BATCH_PASSES_BELOW_TOKENS + 100), 4, "sp", **TINY_HEADS)
    single = plan_stage1(1, 6144, 4, "auto", **TINY_HEADS)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert batch_passes_wanted("auto", below, gpu) is True
    assert batch_passes_wanted("auto", above, gpu) is False
    assert batch_passes_wanted("auto", single, gpu) is False
    assert batch_passes_wanted("auto", below, cpu) is False, "CPU fleets stay sequential (bit-identical results)"
    assert batch_passes_wanted(True, above, cpu) is True and batch_passes_wanted(False, below, gpu) is False
    for wrong in ("yes", 1, None):
        with pytest.raises(ValueError, match='batch_passes must be "auto", true or false'):
            batch_passes_wanted(wrong, below, gpu)


# -- multi-rank and the stage-1 loop -------------------------------------------------------------


def batched_on_two_ranks() -> bytes:
    """SP degree 2: the four passes batched (one forward) and sequential; then the 3-step loop with
    batched passes under the sp plan (1 group x SP 2) and the guidance plan (2 groups x SP 1)."""
    torch.set_num_threads(1)
    world = Comm.world()
    model = apply_sequence_parallel(build_tiny_model(), world)
    counting = CountingTransformer(model)
    passes = four_passes()
    with torch.no_grad():
        results = {
            "forward_batched": BatchedPassRunner().run(counting, passes),
            "forward_batch_sizes": counting.batch_sizes,
        }
    for mode in ("sp", "guidance"):
        plan = plan_stage1(world.world_size, VIDEO_TOKENS, PASS_NAMES, mode, **TINY_HEADS)
        sp_comm = build_stage1_groups(world, plan)
        runner = apply_guidance_parallel(world, plan, local_runner=apply_batched_passes(SequentialPassRunner()))
        transformer = apply_sequence_parallel(build_tiny_model(), sp_comm)
        results[mode] = {"layout": (plan.guidance_groups, plan.sp_degree), **euler_stage1_loop(transformer, runner)}
    return portable(results)


def hybrid_batched_on_four_ranks() -> bytes:
    """2 groups x SP 2, each group running its share of the passes as one batched forward."""
    torch.set_num_threads(1)
    world = Comm.world()
    plan = plan_stage1(world.world_size, VIDEO_TOKENS, PASS_NAMES, "hybrid", **TINY_HEADS)
    sp_comm = build_stage1_groups(world, plan)
    runner = apply_guidance_parallel(world, plan, local_runner=apply_batched_passes(SequentialPassRunner()))
    assert isinstance(runner, GuidanceParallelRunner) and isinstance(runner.local_runner, BatchedPassRunner)
    transformer = apply_sequence_parallel(build_tiny_model(), sp_comm)
    loop = euler_stage1_loop(transformer, runner)
    layout = (plan.guidance_groups, plan.sp_degree)
    return portable({"layout": layout, "forwards": runner.local_runner.forwards, **loop})


@pytest.fixture(scope="module")
def sequential_forward():
    return single_threaded(_forward_both_ways)[0]


@pytest.fixture(scope="module")
def sequential_loop():
    return single_threaded(euler_stage1_loop, build_tiny_model(), SequentialPassRunner())


@pytest.fixture(scope="module")
def two_rank_results():
    return from_portable(run_ranks(2, batched_on_two_ranks))


def _assert_loop_close(result: dict, reference: dict, what: str) -> None:
    assert result["passes"] == reference["passes"]
    video_diff = (result["video"] - reference["video"]).abs().max().item()
    audio_diff = (result["audio"] - reference["audio"]).abs().max().item()
    assert video_diff <= LOOP_TOLERANCE and audio_diff <= LOOP_TOLERANCE, (
        f"{what}: after 3 steps max abs diff video {video_diff:.3g}, audio {audio_diff:.3g} "
        f"(tolerance {LOOP_TOLERANCE})"
    )


def test_sp_degree_2_batched_passes_match_single_rank_sequential_fp32(sequential_forward, two_rank_results):
    for rank, results in enumerate(two_rank_results):
        assert results["forward_batch_sizes"] == [4], results["forward_batch_sizes"]
        _assert_close(results["forward_batched"], sequential_forward, f"SP degree 2 batched, rank {rank}")


def test_three_step_loop_batched_matches_sequential_on_one_rank(sequential_loop):
    model = build_tiny_model()
    runner = BatchedPassRunner()
    batched = single_threaded(euler_stage1_loop, model, runner)
    assert runner.forwards == 3, f"one batched forward per step expected, got {runner.forwards} for 3 steps"
    _assert_loop_close(batched, sequential_loop, "one rank, batched passes")


@pytest.mark.parametrize("mode, layout", [("sp", (1, 2)), ("guidance", (2, 1))])
def test_three_step_loop_batched_on_two_ranks_matches_single_rank_sequential(
    sequential_loop, two_rank_results, mode, layout
):
    for rank, results in enumerate(two_rank_results):
        assert tuple(results[mode]["layout"]) == layout
        _assert_loop_close(results[mode], sequential_loop, f"{mode} plan {layout}, rank {rank}, batched passes")


def test_hybrid_groups_batching_their_share_match_single_rank_sequential(sequential_loop):
    per_rank = from_portable(run_ranks(4, hybrid_batched_on_four_ranks))
    for rank, results in enumerate(per_rank):
        assert tuple(results["layout"]) == (2, 2)
        # Steps run 4, 3, 2 passes: a group batches 2 / 2 / 1 or 2 / 1 / 1 passes, so 2 or 1
        # batched forwards (a lone pass goes through the sequential runner).
        expected_forwards = 2 if rank < 2 else 1
        assert results["forwards"] == expected_forwards, (rank, results["forwards"])
        _assert_loop_close(results, sequential_loop, f"hybrid 2 groups x SP 2, rank {rank}, batched share")
