"""Our LTX-2 stages against the official single-GPU pipeline (ltx-pipelines 1.0.0), world size 1.

The reference ``TI2VidTwoStagesPipeline`` runs on the tiny bundle of each model version (LTX-2.0 in the
19B layout, LTX-2.3 in the 22B layout) in bfloat16 on the CPU, with its
intermediate latents captured by wrapping its internals from the test side; our stages run on the
same files, seed and parameters. Stage-1 video and audio, the upsampled latent, the stage-2 video,
the text contexts and the decoded frames must be equal bitwise.

The reference's test-side adjustments (none changes its arithmetic) are those of ``official_reference``.
"""

from __future__ import annotations

import types

import pytest
import torch
from ltx_core.components.diffusion_steps import EulerDiffusionStep
from ltx_core.components.guiders import MultiModalGuiderParams, create_multimodal_guider_factory
from ltx_core.components.noisers import GaussianNoiser
from ltx_core.components.schedulers import LTX2Scheduler
from ltx_core.guidance.perturbations import PerturbationType
from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps
from ltx_core.model.audio_vae import decode_audio as ltx_decode_audio
from ltx_core.types import VideoPixelShape

from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.decode import decode_audio, decode_video
from mgpu_backend.ltx.latents import StageGeometry, image_to_pixels
from mgpu_backend.ltx.loading import ModelLoader
from mgpu_backend.ltx.passes import SequentialPassRunner
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import TextContext, contexts_from_gemma, encode_prompts

from . import official_reference
from .official_reference import assert_bitwise, first_frame_image, reference_uint8_frames, stand_in_gemma_output
from .helpers import decoder_generator, max_abs_diff

PROMPT = "A cat sleeping on a windowsill while rain runs down the glass."
NEGATIVE_PROMPT = "blurry, out of focus, low contrast"
# Every guidance pass active; STG on the last of the tiny model's two blocks.
VIDEO_GUIDER = MultiModalGuiderParams(
    cfg_scale=3.0, stg_scale=1.0, rescale_scale=0.7, modality_scale=3.0, skip_step=0, stg_blocks=[1]
)
AUDIO_GUIDER = MultiModalGuiderParams(
    cfg_scale=7.0, stg_scale=1.0, rescale_scale=0.7, modality_scale=3.0, skip_step=0, stg_blocks=[1]
)
PARAMS = GenerationParams(
    height=128,
    width=192,
    num_frames=9,
    frame_rate=24.0,
    seed=10,
    num_inference_steps=3,
    video_guider=VIDEO_GUIDER,
    audio_guider=AUDIO_GUIDER,
)


@pytest.fixture(scope="module", params=tiny.VERSIONS, ids=official_reference.version_id)
def bundle_version(request) -> str:
    """Each model version: LTX-2.0 (19B layout) and LTX-2.3 (22B layout)."""
    return request.param


def official_two_stages(bundle):
    def build(module):
        return module.TI2VidTwoStagesPipeline(
            checkpoint_path=bundle.checkpoint_path,
            distilled_lora=[LoraPathStrengthAndSDOps(bundle.distilled_lora_path, 1.0, LTXV_LORA_COMFY_RENAMING_MAP)],
            spatial_upsampler_path=bundle.spatial_upsampler_path,
            gemma_root=bundle.gemma_root,
            loras=[],
            device=torch.device("cpu"),
        )

    return build


@pytest.fixture(scope="module")
def reference_side(bundle):
    """The official two-stage pipeline with its CUDA calls neutralised and its Gemma sized to the tiny bundle."""
    yield from official_reference.reference_side(bundle, "ti2vid_two_stages", official_two_stages(bundle))


def run_reference(reference_side, image_path: str | None) -> dict:
    """One official two-stage run; returns the latents it passed between its steps, and its outputs."""
    return official_reference.run_reference(reference_side, image_path, **official_reference.guided_call(PARAMS, PROMPT, NEGATIVE_PROMPT))


def run_ours(loader: ModelLoader, image: torch.Tensor | None) -> dict:
    progress = []
    positive, negative = contexts_from_gemma(loader, [stand_in_gemma_output(p) for p in (PROMPT, NEGATIVE_PROMPT)])
    stage1_video, stage1_audio = sample_stage1(
        loader, PARAMS, positive, negative, image=image, on_step=lambda step, total, video_x0: progress.append((1, step, total))
    )
    upsampled = upsample_video(loader, stage1_video)
    stage2_video, stage2_audio = refine_stage2(
        loader,
        PARAMS,
        upsampled,
        stage1_audio,
        positive,
        image=image,
        on_step=lambda step, total, video_x0: progress.append((2, step, total)),
    )
    frames = decode_video(loader, stage2_video, generator=decoder_generator(PARAMS, loader.device, loader.dtype))
    return {
        "contexts": (positive, negative),
        "stage1_video": stage1_video,
        "stage1_audio": stage1_audio,
        "upsampled": upsampled,
        "stage2_video": stage2_video,
        "stage2_audio": stage2_audio,
        "frames": frames,
        "progress": progress,
    }


@pytest.fixture(scope="module")
def loader(bundle):
    spec = bundle.spec()
    return ModelLoader(spec, device="cpu", dtype=torch.bfloat16)


def check_run(ours: dict, reference: dict) -> None:
    for our_context, reference_context in zip(ours["contexts"], reference["contexts"], strict=True):
        assert_bitwise(our_context.video_context, reference_context.video_encoding, "video text context")
        assert_bitwise(our_context.audio_context, reference_context.audio_encoding, "audio text context")
    assert ours["stage1_video"].dtype == ours["stage1_audio"].dtype == torch.float32
    assert tuple(ours["stage1_video"].shape) == (1, 128, 2, 2, 3), ours["stage1_video"].shape
    assert tuple(ours["stage1_audio"].shape) == (1, 8, 9, 16), ours["stage1_audio"].shape
    assert_bitwise(ours["stage1_video"], reference["stage1_video"], "stage-1 video latent")
    assert_bitwise(ours["stage1_audio"], reference["stage1_audio"], "stage-1 audio latent")
    assert_bitwise(ours["upsampled"], reference["upsampled"], "upsampled video latent")
    assert tuple(ours["stage2_video"].shape) == (1, 128, 2, 4, 6), ours["stage2_video"].shape
    assert_bitwise(ours["stage2_video"], reference["stage2_video"], "stage-2 video latent")
    # Audio is frozen in stage 2: the very tensor that went in comes out.
    assert ours["stage2_audio"] is ours["stage1_audio"]
    # The reference re-denoises the audio in stage 2, so its final audio differs from its stage 1.
    assert max_abs_diff(reference["stage2_audio"], reference["stage1_audio"]) > 0.05
    assert ours["frames"].dtype == torch.float32 and tuple(ours["frames"].shape) == (9, 128, 192, 3)
    assert ours["frames"].min().item() >= 0.0 and ours["frames"].max().item() <= 1.0
    assert_bitwise(reference_uint8_frames(ours["frames"]), reference["frames"], "decoded frames (uint8)")
    stage1_steps, stage2_steps = PARAMS.num_inference_steps, 3
    expected_progress = [(1, step, stage1_steps) for step in range(1, stage1_steps + 1)]
    expected_progress += [(2, step, stage2_steps) for step in range(1, stage2_steps + 1)]
    assert ours["progress"] == expected_progress


def test_text_to_video_stages_match_the_official_pipeline_bitwise_bf16(bundle, loader, reference_side):
    reference = run_reference(reference_side, image_path=None)
    ours = run_ours(loader, image=None)
    check_run(ours, reference)

    # Stage 2 through a transformer wrapper, the way tiled data parallelism plugs in: same result.
    video_tokens_per_call = []

    def delegating_wrapper(x0_model):
        def call(video, audio, perturbations):
            video_tokens_per_call.append(video.latent.shape[1])
            return x0_model(video=video, audio=audio, perturbations=perturbations)

        return call

    positive = ours["contexts"][0]
    wrapped_video, wrapped_audio = refine_stage2(
        loader, PARAMS, ours["upsampled"], ours["stage1_audio"], positive, transformer_wrapper=delegating_wrapper
    )
    assert video_tokens_per_call == [2 * 4 * 6] * 3, video_tokens_per_call
    assert_bitwise(wrapped_video, reference["stage2_video"], "stage-2 video latent through a wrapper")
    assert wrapped_audio is ours["stage1_audio"]

    # Audio decode: our decoder and vocoder against the reference ledger's, on the stage-1 audio.
    waveform, sample_rate = decode_audio(loader, ours["stage1_audio"])
    ledger = reference_side.pipeline.stage_2_model_ledger
    with torch.inference_mode():
        expected = ltx_decode_audio(reference["stage1_audio"], ledger.audio_decoder(), ledger.vocoder())
    assert sample_rate == expected.sampling_rate == official_reference.VOCODER_SAMPLE_RATE[bundle.version]
    assert waveform.dtype == torch.float32 and waveform.ndim == 3 and waveform.shape[:2] == (1, 2), waveform.shape
    assert_bitwise(waveform[0], expected.waveform, "decoded audio waveform")


def test_image_to_video_stages_match_the_official_pipeline_bitwise_bf16(loader, reference_side, tmp_path):
    image_path, comfy_image = first_frame_image(tmp_path)
    reference = run_reference(reference_side, image_path=image_path)
    ours = run_ours(loader, image=comfy_image)
    check_run(ours, reference)
    # Strength 1.0: the first latent frame of stage 1 is the encoded image itself, untouched by noise.
    stage1 = PARAMS.stage1
    with torch.inference_mode():
        pixels = image_to_pixels(
            comfy_image, stage1.height, stage1.width, PARAMS.image_crf, loader.dtype, loader.device
        )
        encoded_image = loader.video_encoder()(pixels)
    assert_bitwise(ours["stage1_video"][:, :, :1], encoded_image, "stage-1 first latent frame vs the encoded image")


@official_reference.needs_ltx_core_gemma
def test_prompt_encoding_matches_the_official_encode_prompts_bitwise(loader, reference_side):
    from ltx_pipelines.utils.helpers import encode_prompts as reference_encode_prompts

    ours = encode_prompts(loader, [PROMPT, NEGATIVE_PROMPT])
    with torch.inference_mode():
        reference = reference_encode_prompts([PROMPT, NEGATIVE_PROMPT], reference_side.pipeline.stage_1_model_ledger)
    for our_context, reference_context in zip(ours, reference, strict=True):
        assert_bitwise(our_context.video_context, reference_context.video_encoding, "video text context")
        assert_bitwise(our_context.audio_context, reference_context.audio_encoding, "audio text context")


# --------------------------------------------------------------------------------------------------
# Guidance passes and their combination, against the reference's denoising function, on a stand-in
# transformer whose output depends on every input that differs between passes.

PERTURBATION_OFFSETS = {
    PerturbationType.SKIP_VIDEO_SELF_ATTN: 0.3,
    PerturbationType.SKIP_AUDIO_SELF_ATTN: 0.5,
    PerturbationType.SKIP_A2V_CROSS_ATTN: 0.7,
    PerturbationType.SKIP_V2A_CROSS_ATTN: 1.1,
}


class StandInTransformer:
    """Denoised = latent mix + context mean + an offset per kind of perturbation; records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, tuple[str, ...]]] = []

    def __call__(self, video, audio, perturbations):
        kinds = ()
        if perturbations is not None:
            (config,) = perturbations.perturbations
            kinds = tuple(sorted(p.type.value for p in config.perturbations))
        offset = sum(PERTURBATION_OFFSETS[PerturbationType(kind)] for kind in kinds)
        self.calls.append((round(video.context.float().mean().item(), 4), kinds))
        mixed_video = video.latent * 0.6 + video.context.float().mean() + offset + video.timesteps * 0.1
        mixed_audio = audio.latent * 0.4 - audio.context.float().mean() + offset * 0.5 + audio.timesteps * 0.2
        return mixed_video.to(video.latent.dtype), mixed_audio.to(audio.latent.dtype)


class RecordingRunner:
    """The sequential runner, recording the pass names of every step."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def run(self, transformer, passes):
        self.steps.append([guidance_pass.name for guidance_pass in passes])
        return SequentialPassRunner().run(transformer, passes)


GUIDANCE_CASES = {
    "all_passes": (VIDEO_GUIDER, AUDIO_GUIDER, ["conditional", "unconditional", "perturbed", "isolated"]),
    "cfg_only": (
        MultiModalGuiderParams(cfg_scale=4.0, rescale_scale=0.0),
        MultiModalGuiderParams(cfg_scale=1.0),
        ["conditional", "unconditional"],
    ),
    "audio_stg_and_modality_only": (
        MultiModalGuiderParams(cfg_scale=1.0),
        MultiModalGuiderParams(cfg_scale=1.0, stg_scale=2.0, stg_blocks=[0], modality_scale=2.0, rescale_scale=0.5),
        ["conditional", "perturbed", "isolated"],
    ),
    "no_guidance": (MultiModalGuiderParams(), MultiModalGuiderParams(), ["conditional"]),
    "skip_steps": (
        MultiModalGuiderParams(cfg_scale=3.0, stg_scale=1.0, stg_blocks=[1], rescale_scale=0.7, skip_step=1),
        MultiModalGuiderParams(cfg_scale=7.0, modality_scale=3.0, skip_step=2),
        ["conditional", "unconditional", "perturbed", "isolated"],
    ),
}


@pytest.mark.parametrize("case", sorted(GUIDANCE_CASES))
def test_guidance_passes_and_combination_match_the_reference_denoiser(case):
    from ltx_pipelines.utils.helpers import denoise_audio_video, multi_modal_guider_factory_denoising_func
    from ltx_pipelines.utils.samplers import euler_denoising_loop
    from ltx_pipelines.utils.types import PipelineComponents

    video_guider, audio_guider, expected_passes = GUIDANCE_CASES[case]
    dtype, device, steps = torch.bfloat16, torch.device("cpu"), 6
    generator = torch.Generator().manual_seed(1)
    positive, negative = (
        TextContext(*(torch.randn(1, 4, 8, generator=generator).to(dtype) for _ in range(2))) for _ in range(2)
    )
    params = GenerationParams(
        height=128, width=192, num_frames=9, seed=4, num_inference_steps=steps,
        video_guider=video_guider, audio_guider=audio_guider,
    )  # fmt: skip
    ours_transformer, runner = StandInTransformer(), RecordingRunner()
    loader = types.SimpleNamespace(device=device, dtype=dtype, transformer=lambda lora_set: ours_transformer)
    video, audio = sample_stage1(loader, params, positive, negative, pass_runner=runner)

    reference_transformer = StandInTransformer()

    def reference_loop(sigmas, video_state, audio_state, stepper):
        denoise = multi_modal_guider_factory_denoising_func(
            create_multimodal_guider_factory(video_guider, negative_context=negative.video_context),
            create_multimodal_guider_factory(audio_guider, negative_context=negative.audio_context),
            positive.video_context,
            positive.audio_context,
            reference_transformer,
        )
        return euler_denoising_loop(sigmas, video_state, audio_state, stepper, denoise)

    with torch.inference_mode():
        reference_video, reference_audio = denoise_audio_video(
            output_shape=VideoPixelShape(1, 9, 64, 96, 24.0),
            conditionings=[],
            noiser=GaussianNoiser(torch.Generator().manual_seed(4)),
            sigmas=LTX2Scheduler().execute(steps=steps).float(),
            stepper=EulerDiffusionStep(),
            denoising_loop_fn=reference_loop,
            components=PipelineComponents(dtype, device),
            dtype=dtype,
            device=device,
        )
    assert ours_transformer.calls == reference_transformer.calls
    skipped_by_both = [
        step
        for step in range(steps)
        if video_guider.skip_step and step % (video_guider.skip_step + 1)
        and audio_guider.skip_step and step % (audio_guider.skip_step + 1)
    ]  # fmt: skip
    assert len(runner.steps) == steps - len(skipped_by_both), runner.steps
    assert all(names == expected_passes for names in runner.steps), runner.steps
    assert_bitwise(video, reference_video.latent, f"{case}: stage-1 video")
    assert_bitwise(audio, reference_audio.latent, f"{case}: stage-1 audio")


def test_on_step_exception_stops_the_stage_at_that_step_and_propagates():
    class Cancelled(Exception):
        pass

    transformer = StandInTransformer()
    loader = types.SimpleNamespace(
        device=torch.device("cpu"), dtype=torch.bfloat16, transformer=lambda lora_set: transformer
    )
    context = TextContext(torch.zeros(1, 4, 8, dtype=torch.bfloat16), torch.zeros(1, 4, 8, dtype=torch.bfloat16))
    seen = []

    def cancel_at_second_step(step, total, video_x0):
        seen.append((step, total))
        if step == 2:
            raise Cancelled

    params = GenerationParams(height=128, width=192, num_frames=9, num_inference_steps=5, video_guider=VIDEO_GUIDER,
                              audio_guider=AUDIO_GUIDER)  # fmt: skip
    with pytest.raises(Cancelled):
        sample_stage1(loader, params, context, context, on_step=cancel_at_second_step)
    assert seen == [(1, 5), (2, 5)]
    assert len(transformer.calls) == 2 * 4, "the stage ran past the step whose callback raised"


def test_stage_latent_tools_round_trip_in_frame_row_column_token_order():
    geometry = StageGeometry(height=128, width=160, num_frames=17, frame_rate=25.0)  # latent 3 x 4 x 5, 17 audio steps
    video_patchifier, audio_patchifier = geometry.video_tools().patchifier, geometry.audio_tools().patchifier
    video = torch.randn(1, 128, 3, 4, 5)
    tokens = video_patchifier.patchify(video)
    assert tuple(tokens.shape) == (1, 3 * 4 * 5, 128)
    assert torch.equal(tokens[0, 2 * 20 + 1 * 5 + 3], video[0, :, 2, 1, 3])
    assert torch.equal(video_patchifier.unpatchify(tokens, output_shape=geometry.video_shape), video)
    audio = torch.randn(1, 8, 17, 16)
    tokens = audio_patchifier.patchify(audio)
    assert tuple(tokens.shape) == (1, 17, 128)
    assert torch.equal(tokens[0, 5], audio[0, :, 5, :].reshape(-1))
    assert torch.equal(audio_patchifier.unpatchify(tokens, output_shape=geometry.audio_shape), audio)
