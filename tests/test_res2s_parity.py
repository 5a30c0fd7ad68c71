"""The HQ recipe's res_2s sampler (``mgpu_backend.ltx.res2s``) against the official
``TI2VidTwoStagesHQPipeline`` of ltx-pipelines 1.0.0, world size 1, and under sequence parallel and
guidance parallel on 2 and 4 gloo ranks.

The reference runs on the tiny LTX-2.3 bundle in bfloat16 on the CPU with the HQ recipe's guidance
(``LTX_2_3_HQ_PARAMS``: CFG and modality isolation, no STG), the distilled LoRA at 0.25 in stage 1
and 0.5 in stage 2, LTX2Scheduler's sigmas shifted by stage 1's token count, and res_2s in both
stages. Our stages run on the same files and seed with ``stepper="res2s"``. The stage-1 and stage-2
video and audio latents must be equal bitwise, and so must the multi-rank runs to the one-rank run.
Test-side adjustments to the reference (none changes its arithmetic) are those of ``official_reference``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from ltx_core.components.schedulers import LTX2Scheduler
from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps
from ltx_pipelines.utils.constants import LTX_2_3_HQ_PARAMS

from mgpu_backend.ltx.jobs import active_passes
from mgpu_backend.ltx.loading import ModelLoader
from mgpu_backend.ltx.parallelize import Stage1Cache, Stage1Options, parallelize_stage1, parallelize_stage2
from mgpu_backend.ltx.res2s import MIDPOINT_NOISE_SEED, STEP_NOISE_SEED, res2s_coefficients, sde_noise
from mgpu_backend.ltx.schema import STAGE_2_SIGMAS, ModelSpec
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import contexts_from_gemma
from mgpu_backend.ltx.validation import TransformerDims
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.guidance_parallel import plan_stage1

from . import official_reference
from .dist_harness import run_ranks
from .helpers import from_portable, max_abs_diff, portable, single_threaded
from .official_reference import assert_bitwise, first_frame_image, stand_in_gemma_output

PROMPT = "A lighthouse beam sweeping over a stormy sea at night, waves breaking on the rocks."
NEGATIVE_PROMPT = "blurry, out of focus, low contrast"
STAGE_1_LORA_STRENGTH, STAGE_2_LORA_STRENGTH = 0.25, 0.5  # hq_2_stage_arg_parser's defaults
PARAMS = GenerationParams(
    height=128,
    width=192,
    num_frames=9,
    frame_rate=24.0,
    seed=10,
    num_inference_steps=3,
    video_guider=LTX_2_3_HQ_PARAMS.video_guider_params,
    audio_guider=LTX_2_3_HQ_PARAMS.audio_guider_params,
    shift_sigmas_by_tokens=True,
    stepper="res2s",
)
STAGE_2_STEPS = 3


@pytest.fixture(scope="module")
def bundle_version() -> str:
    """HQ is an LTX-2.3 recipe."""
    return "2.3"


def official_hq(bundle):
    def build(module):
        return module.TI2VidTwoStagesHQPipeline(
            checkpoint_path=bundle.checkpoint_path,
            distilled_lora=[LoraPathStrengthAndSDOps(bundle.distilled_lora_path, 1.0, LTXV_LORA_COMFY_RENAMING_MAP)],
            distilled_lora_strength_stage_1=STAGE_1_LORA_STRENGTH,
            distilled_lora_strength_stage_2=STAGE_2_LORA_STRENGTH,
            spatial_upsampler_path=bundle.spatial_upsampler_path,
            gemma_root=bundle.gemma_root,
            loras=(),
            device=torch.device("cpu"),
        )

    return build


@pytest.fixture(scope="module")
def reference_side(bundle):
    yield from official_reference.reference_side(bundle, "ti2vid_two_stages_hq", official_hq(bundle))


def run_reference(reference_side, image_path: str | None) -> dict:
    return official_reference.run_reference(reference_side, image_path, **official_reference.guided_call(PARAMS, PROMPT, NEGATIVE_PROMPT))


class OneTransformerPerLoraSet:
    """A loader that builds each LoRA set's transformer once, so that the techniques applied to it
    are on the model the stage runs (as the fleet's ResidentModel does)."""

    def __init__(self, loader: ModelLoader) -> None:
        self.loader, self.device, self.dtype, self.built = loader, loader.device, loader.dtype, {}

    def transformer(self, lora_set: str = "none"):
        if lora_set not in self.built:
            self.built[lora_set] = self.loader.transformer(lora_set)
        return self.built[lora_set]

    def __getattr__(self, name):
        return getattr(self.loader, name)


def hq_loaders(spec: ModelSpec) -> tuple[OneTransformerPerLoraSet, OneTransformerPerLoraSet]:
    """Stage 1's and stage 2's loaders: the same files, the distilled LoRA at each stage's strength."""
    return tuple(
        OneTransformerPerLoraSet(ModelLoader(replace(spec, distilled_lora_strength=strength), "cpu", torch.bfloat16))
        for strength in (STAGE_1_LORA_STRENGTH, STAGE_2_LORA_STRENGTH)
    )


def run_hq(spec: ModelSpec, image: torch.Tensor | None = None, stage1_mode: str | None = None) -> dict:
    """Both HQ stages on this process's ranks: one rank, or stage 1 under ``stage1_mode``'s plan and
    stage 2 sequence parallel over the world (the fleet's parallel stage 2 that keeps the audio)."""
    stage1_loader, stage2_loader = hq_loaders(spec)
    world = Comm.world() if stage1_mode is not None else None
    positive, negative = contexts_from_gemma(stage1_loader.loader, [stand_in_gemma_output(p) for p in (PROMPT, NEGATIVE_PROMPT)])
    progress, result = [], {}
    with torch.inference_mode():
        if world is None:
            runner_stage = None
            stage1_video, stage1_audio = sample_stage1(
                stage1_loader, PARAMS, positive, negative, image=image, lora_set="distilled",
                on_step=lambda step, total, video_x0: progress.append((1, step, total, tuple(video_x0().shape))),
            )  # fmt: skip
        else:
            dims = TransformerDims.from_checkpoint(spec.checkpoint_path)
            plan = plan_stage1(
                world.world_size, PARAMS.stage1.video_tokens, active_passes(PARAMS.video_guider, PARAMS.audio_guider), stage1_mode,
                attention_heads=dims.video_heads, audio_attention_heads=dims.audio_heads,
            )  # fmt: skip
            result["layout"] = (plan.guidance_groups, plan.sp_degree)
            transformer = stage1_loader.transformer("distilled")
            with parallelize_stage1(transformer, plan, world, torch.device("cpu"), Stage1Options(), Stage1Cache()) as runner_stage:
                stage1_video, stage1_audio = sample_stage1(
                    stage1_loader, PARAMS, positive, negative, image=image, pass_runner=runner_stage.runner, lora_set="distilled",
                )  # fmt: skip
        upsampled = upsample_video(stage1_loader, stage1_video)
        stage2_transformer = stage2_loader.transformer("distilled")
        grid = tuple(upsampled.shape[2:])
        sequence_parallel = world is not None and world.world_size > 1
        with parallelize_stage2(stage2_transformer, world or Comm(None), None, grid, sequence_parallel=sequence_parallel) as wrapper:
            stage2_video, stage2_audio = refine_stage2(
                stage2_loader, PARAMS, upsampled, stage1_audio, positive, image=image, transformer_wrapper=wrapper,
                on_step=lambda step, total, video_x0: progress.append((2, step, total, tuple(video_x0().shape))),
                lora_set="distilled", denoise_audio=True,
            )  # fmt: skip
    result.update(stage1_video=stage1_video, stage1_audio=stage1_audio, upsampled=upsampled, stage2_video=stage2_video,
                  stage2_audio=stage2_audio, progress=progress, contexts=(positive, negative))  # fmt: skip
    return result


def check_against_reference(ours: dict, reference: dict) -> None:
    for our_context, reference_context in zip(ours["contexts"], reference["contexts"], strict=True):
        assert_bitwise(our_context.video_context, reference_context.video_encoding, "video text context")
        assert_bitwise(our_context.audio_context, reference_context.audio_encoding, "audio text context")
    assert tuple(ours["stage1_video"].shape) == (1, 128, 2, 2, 3), ours["stage1_video"].shape
    assert tuple(ours["stage1_audio"].shape) == (1, 8, 9, 16), ours["stage1_audio"].shape
    assert_bitwise(ours["stage1_video"], reference["stage1_video"], "stage-1 video latent")
    assert_bitwise(ours["stage1_audio"], reference["stage1_audio"], "stage-1 audio latent")
    assert_bitwise(ours["upsampled"], reference["upsampled"], "upsampled video latent")
    assert tuple(ours["stage2_video"].shape) == (1, 128, 2, 4, 6), ours["stage2_video"].shape
    assert_bitwise(ours["stage2_video"], reference["stage2_video"], "stage-2 video latent")
    assert_bitwise(ours["stage2_audio"], reference["stage2_audio"], "stage-2 audio latent")
    # Stage 2 re-denoises the audio, as the official pipeline does.
    assert max_abs_diff(ours["stage2_audio"], ours["stage1_audio"]) > 0.05
    expected_progress = [(1, step, PARAMS.num_inference_steps, (1, 128, 2, 2, 3)) for step in range(1, PARAMS.num_inference_steps + 1)]
    expected_progress += [(2, step, STAGE_2_STEPS, (1, 128, 2, 4, 6)) for step in range(1, STAGE_2_STEPS + 1)]
    assert ours["progress"] == expected_progress


@pytest.fixture(scope="module")
def single_rank_text_to_video(bundle):
    return single_threaded(run_hq, bundle.spec())


def test_hq_text_to_video_stages_match_the_official_pipeline_bitwise_bf16(reference_side, single_rank_text_to_video):
    reference = run_reference(reference_side, image_path=None)
    check_against_reference(single_rank_text_to_video, reference)
    # Stage 1's schedule is LTX2Scheduler's shifted by its 12 tokens (the 4096-token anchor of the
    # two-stage recipe is far off); stage 2's, the distilled stage-2 sigmas.
    stage1_sigmas = PARAMS.stage1_sigma_schedule(torch.device("cpu"))
    assert reference["sigmas"] == [stage1_sigmas.tolist(), torch.tensor(STAGE_2_SIGMAS).tolist()]
    default_anchor = LTX2Scheduler().execute(steps=PARAMS.num_inference_steps)
    assert abs(stage1_sigmas[1].item() - default_anchor[1].item()) > 0.05, (stage1_sigmas.tolist(), default_anchor.tolist())


def test_hq_image_to_video_stages_match_the_official_pipeline_bitwise_bf16(bundle, reference_side, tmp_path):
    image_path, comfy_image = first_frame_image(tmp_path)
    reference = run_reference(reference_side, image_path=image_path)
    ours = single_threaded(run_hq, bundle.spec(), comfy_image)
    check_against_reference(ours, reference)


def test_res2s_differs_from_euler_on_the_same_stage1(bundle, single_rank_text_to_video):
    """The stepper really switches the loop: Euler over the same sigmas lands elsewhere."""
    stage1_loader, _ = hq_loaders(bundle.spec())
    positive, negative = contexts_from_gemma(stage1_loader.loader, [stand_in_gemma_output(p) for p in (PROMPT, NEGATIVE_PROMPT)])
    euler_video, _ = single_threaded(sample_stage1, stage1_loader, replace(PARAMS, stepper="euler"), positive, negative, None)
    assert max_abs_diff(euler_video, single_rank_text_to_video["stage1_video"]) > 0.05


def test_res2s_coefficients_equal_the_official_ones_bitwise_from_tiny_to_large_steps():
    from ltx_pipelines.utils.res2s import get_res2s_coefficients

    for h in (0.0, 1e-12, 1e-3, 0.1, 0.4648, 1.8378, 4.51, 40.0):
        assert res2s_coefficients(h) == get_res2s_coefficients(h, {}), h


def test_sde_noise_is_the_same_for_the_same_seed_and_standardised_per_sample():
    latent = torch.zeros(1, 45, 128, dtype=torch.bfloat16)
    first = sde_noise(latent, torch.Generator().manual_seed(STEP_NOISE_SEED))
    again = sde_noise(latent, torch.Generator().manual_seed(STEP_NOISE_SEED))
    other = sde_noise(latent, torch.Generator().manual_seed(MIDPOINT_NOISE_SEED))
    assert first.dtype == torch.float64 and first.shape == latent.shape
    assert torch.equal(first, again) and max_abs_diff(first, other) > 1.0
    assert abs(first.mean().item()) < 1e-12 and abs(first.std().item() - 1.0) < 1e-12


def test_an_unknown_stepper_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="stepper must be one of euler, res2s, got 'heun'"):
        replace(PARAMS, stepper="heun").validate()


def hq_stages_on_ranks(wire_spec: dict, modes: list[str]) -> dict:
    torch.set_num_threads(1)
    return portable({mode: run_hq(ModelSpec.from_wire(wire_spec), stage1_mode=mode) for mode in modes})


def _assert_ranks_equal_one_rank(single: dict, per_rank: list[dict], mode: str, layout: tuple[int, int]) -> None:
    for rank, results in enumerate(per_rank):
        result = results[mode]
        assert tuple(result["layout"]) == layout, (mode, result["layout"])
        for name in ("stage1_video", "stage1_audio", "stage2_video", "stage2_audio"):
            assert_bitwise(result[name], single[name], f"{mode} plan {layout[0]} groups x SP {layout[1]}, rank {rank}: {name}")


@pytest.fixture(scope="module")
def two_rank_runs(spec):
    return from_portable(run_ranks(2, hq_stages_on_ranks, spec, ["sp", "guidance"]))


@pytest.mark.slow
def test_hq_stages_at_two_ranks_under_sp_and_guidance_parallel_equal_one_rank_bitwise_bf16(single_rank_text_to_video, two_rank_runs):
    _assert_ranks_equal_one_rank(single_rank_text_to_video, two_rank_runs, "sp", (1, 2))
    _assert_ranks_equal_one_rank(single_rank_text_to_video, two_rank_runs, "guidance", (2, 1))


@pytest.mark.slow
def test_hq_stages_at_four_ranks_under_sp_guidance_and_hybrid_plans_equal_one_rank_bitwise_bf16(single_rank_text_to_video, spec):
    per_rank = from_portable(run_ranks(4, hq_stages_on_ranks, spec, ["sp", "guidance", "hybrid"]))
    _assert_ranks_equal_one_rank(single_rank_text_to_video, per_rank, "sp", (1, 4))
    _assert_ranks_equal_one_rank(single_rank_text_to_video, per_rank, "guidance", (4, 1))  # three passes on four groups: one idles
    _assert_ranks_equal_one_rank(single_rank_text_to_video, per_rank, "hybrid", (2, 2))
