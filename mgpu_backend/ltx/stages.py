"""The LTX-2 two-stage generation, one rank's side: stage 1, the 2x upsampler, stage 2.

The computation is one of the two official text/image-to-video recipes of ltx-pipelines 1.0.0,
rebuilt on ltx-core 1.0.0 so that the parallel techniques can plug into it (``schema.DEFAULTS``
holds each recipe's values):

- the two-stage recipe (``TI2VidTwoStagesPipeline``): stage 1 on the dev checkpoint with full
  guidance over ltx-core's LTX2Scheduler sigmas; stage 2 with the distilled LoRA fused;
- the distilled recipe (``DistilledPipeline``): the distilled checkpoint, stage 1 on the 8 fixed
  distilled sigmas with one positive-only pass per step (no guidance: the neutral guider returns
  the conditional prediction unchanged), stage 2 on the same transformer with no LoRA
  (``refine_stage2(lora_set="none")``).

The functions, shared by both recipes:

- ``sample_stage1``: from noise at half the output size, steps over the recipe's sigmas
  (``GenerationParams.stage1_sigmas``, or LTX2Scheduler's over ``num_inference_steps``) of the
  recipe's stepper (``GenerationParams.stepper``: Euler, or the res_2s sampler of ``res2s.py``), with the
  multimodal guidance asked for (CFG, STG, modality isolation, rescale, skip_step). Each step's
  transformer calls are ``GuidancePass`` objects handed to a ``PassRunner``: the sequential runner
  runs them here; the guidance-parallel runner runs them on separate rank groups. The combine step
  only consumes the runner's outputs.
- ``upsample_video``: the spatial 2x latent upsampler.
- ``refine_stage2``: the stage-2 transformer at full size on a short sigma schedule, positive
  prompt only. ``transformer_wrapper`` lets tiled data parallelism wrap the transformer; the audio
  is the stage-1 audio unchanged (``denoise_audio=False``, TDP's choice) or the re-denoised audio
  of the official pipelines (``denoise_audio=True``: untiled or sequence parallel).

Images condition both stages as the recipe's runner does (``GenerationParams.conditioning``, a key of
``recipes.CONDITIONINGS``): the first image at frame 0 (``image_strength``) replaces the first latent
frame or is appended as a guiding latent, the last image at the last frame (``last_image_strength``)
is always appended; an appended latent is one latent frame of tokens more, noised with the video.

Latents go in and out in ComfyUI's LTX-2 layout, float32 (see ``latents.py``). Every function here
is a plain function of tensors: no sockets and no collectives of its own (parallelism lives in the
runner, the wrapper, or inside the transformer). It never imports ltx_pipelines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from ltx_core.components.diffusion_steps import EulerDiffusionStep
from ltx_core.components.guiders import MultiModalGuider, MultiModalGuiderParams, create_multimodal_guider_factory
from ltx_core.components.noisers import GaussianNoiser
from ltx_core.components.schedulers import LTX2Scheduler
from ltx_core.guidance.perturbations import (
    BatchedPerturbationConfig,
    Perturbation,
    PerturbationConfig,
    PerturbationType,
)
from ltx_core.model.transformer.modality import Modality
from ltx_core.model.upsampler import upsample_video as ltx_upsample_video
from ltx_core.types import LatentState

from mgpu_backend.ltx.latents import (
    DEFAULT_IMAGE_CRF,
    ConditioningImage,
    StageGeometry,
    check_conditioning_image,
    check_latent_shape,
    image_conditionings,
    initial_state,
    job_generator,
    state_to_comfy,
)
from mgpu_backend.ltx.passes import GuidancePass, PassRunner, SequentialPassRunner
from mgpu_backend.ltx.recipes import CONDITIONINGS, STEPPERS, appended_frames, image_frames
from mgpu_backend.ltx.schema import (
    OFFICIAL,
    STAGE_2_SIGMAS,
    Guidance,
    validate_generation,
    validate_image_strengths,
    validate_sigmas,
    validate_stg_blocks,
)
from mgpu_backend.ltx.text import TextContext
from mgpu_backend.ltx.validation import (
    TransformerDims,
    check_fits,
    estimate_memory_bytes,
)

OnStep = Callable[..., None]
"""``on_step(step, total, video_x0)`` after each step: ``video_x0()`` is that step's denoised video in
ComfyUI layout, computed only when called (live previews); a callback may ignore it."""


def guider_params(guidance: Guidance, official: Guidance, layer_count: int | None = None) -> MultiModalGuiderParams:
    """ltx-core's guider parameters for a schema ``Guidance`` whose scales are all set.

    STG blocks it leaves unset are the ``official`` ones, clipped to a model of ``layer_count`` blocks."""
    if layer_count is not None:
        blocks = guidance.blocks_for(layer_count, official)
    else:
        blocks = official.stg_blocks if guidance.stg_blocks is None else guidance.stg_blocks
    return MultiModalGuiderParams(
        cfg_scale=guidance.cfg_scale, stg_scale=guidance.stg_scale, rescale_scale=guidance.rescale_scale,
        modality_scale=guidance.modality_scale, skip_step=guidance.skip_step, stg_blocks=list(blocks),
    )  # fmt: skip


def default_video_guider() -> MultiModalGuiderParams:
    """The official LTX-2.0 video guidance (``schema.OFFICIAL``)."""
    return guider_params(OFFICIAL.video_guidance, OFFICIAL.video_guidance)


def default_audio_guider() -> MultiModalGuiderParams:
    """The official LTX-2.0 audio guidance (``schema.OFFICIAL``)."""
    return guider_params(OFFICIAL.audio_guidance, OFFICIAL.audio_guidance)


@dataclass(frozen=True)
class GenerationParams:
    """One generation job. Defaults are the official LTX-2.0 two-stage defaults.

    ``height`` and ``width`` are the size of the final video. With ``two_stage`` (the default)
    stage 1 runs at half of it (512x768 for 1024x1536) and stage 2 at the full size; without it,
    stage 1 runs at ``height`` x ``width`` and there is no stage 2.
    """

    height: int = 2 * OFFICIAL.stage1_height
    width: int = 2 * OFFICIAL.stage1_width
    num_frames: int = OFFICIAL.num_frames
    frame_rate: float = OFFICIAL.frame_rate
    seed: int = OFFICIAL.seed
    num_inference_steps: int = OFFICIAL.steps
    video_guider: MultiModalGuiderParams = field(default_factory=default_video_guider)
    audio_guider: MultiModalGuiderParams = field(default_factory=default_audio_guider)
    image_crf: int = DEFAULT_IMAGE_CRF
    two_stage: bool = True
    stage1_sigmas: tuple[float, ...] | None = None  # a fixed schedule (the distilled recipe's), else LTX2Scheduler's
    # LTX2Scheduler's shift from stage 1's own token count (the HQ recipe passes it the latent) instead of
    # its default 4096-token anchor (the two-stage recipe passes none).
    shift_sigmas_by_tokens: bool = False
    stepper: str = "euler"  # one of STEPPERS: how both stages step from one sigma to the next
    # The conditioning images: the first image at frame 0 and the last image at the last frame, each at
    # its strength, turned into conditionings as the recipe's runner does (a key of recipes.CONDITIONINGS).
    image_strength: float = 1.0
    last_image_strength: float = 1.0
    conditioning: str = "first-frame"

    def validate(self) -> None:
        validate_generation(
            self.height,
            self.width,
            self.num_frames,
            two_stage=self.two_stage,
            num_inference_steps=self.num_inference_steps,
            frame_rate=self.frame_rate,
        )
        if self.stepper not in STEPPERS:
            raise ValueError(f"stepper must be one of {', '.join(STEPPERS)}, got {self.stepper!r}")
        if self.stage1_sigmas is not None:
            validate_sigmas(self.stage1_sigmas)
            if len(self.stage1_sigmas) - 1 != self.num_inference_steps:
                raise ValueError(
                    f"{len(self.stage1_sigmas) - 1} steps in the fixed stage-1 sigmas but num_inference_steps is "
                    f"{self.num_inference_steps}; set num_inference_steps to {len(self.stage1_sigmas) - 1}"
                )
        validate_image_strengths(self.image_strength, self.last_image_strength)
        if self.conditioning not in CONDITIONINGS:
            raise ValueError(f"conditioning must be one of {', '.join(CONDITIONINGS)}, got {self.conditioning!r}")

    def conditioning_images(self, image: torch.Tensor | None, last_image: torch.Tensor | None) -> list[ConditioningImage]:
        """The first image at frame 0 and the last image at the last frame, each at its strength (those given)."""
        given = [(tensor, strength) for tensor, strength in ((image, self.image_strength), (last_image, self.last_image_strength)) if tensor is not None]
        frames = image_frames(self.num_frames, image is not None, last_image is not None)
        return [ConditioningImage(tensor, frame_idx, strength) for (tensor, strength), frame_idx in zip(given, frames, strict=True)]

    def guiding_frames(self, image: torch.Tensor | None, last_image: torch.Tensor | None) -> int:
        """How many guiding latents the images append to each stage's video (``recipes.appended_frames``)."""
        return appended_frames(self.conditioning, image_frames(self.num_frames, image is not None, last_image is not None))

    def stage1_sigma_schedule(self, device: torch.device) -> torch.Tensor:
        """Stage 1's sigmas, float32: the fixed schedule, or LTX2Scheduler's over the step count."""
        if self.stage1_sigmas is not None:
            return torch.tensor(self.stage1_sigmas, dtype=torch.float32, device=device)
        # The scheduler reads only the latent's shape: a meta tensor allocates nothing.
        latent = torch.empty(self.stage1.video_shape.to_torch_shape(), device="meta") if self.shift_sigmas_by_tokens else None
        return LTX2Scheduler().execute(steps=self.num_inference_steps, latent=latent).to(dtype=torch.float32, device=device)

    @property
    def stage1(self) -> StageGeometry:
        scale = 2 if self.two_stage else 1
        return StageGeometry(self.height // scale, self.width // scale, self.num_frames, self.frame_rate)

    @property
    def stage2(self) -> StageGeometry:
        return StageGeometry(self.height, self.width, self.num_frames, self.frame_rate)


def check_generation_fits(
    params: GenerationParams,
    device: torch.device,
    dims: TransformerDims | None = None,
    dtype: torch.dtype = torch.bfloat16,
    sp_degree: int = 1,
    weights_resident: bool = False,
    available_bytes: int | None = None,
) -> None:
    """Refuse a job whose largest stage would not fit ``device`` (see ``validation.check_fits``).

    ``dims``: ``TransformerDims.from_checkpoint(spec.checkpoint_path)``; the 19B model by default.
    """
    params.validate()
    largest = params.stage2 if params.two_stage else params.stage1
    estimate = estimate_memory_bytes(
        largest.height, largest.width, params.num_frames, params.frame_rate, dims, dtype, sp_degree
    )
    check_fits(estimate, device, available_bytes=available_bytes, weights_resident=weights_resident)


# --------------------------------------------------------------------------------------------------
# Shared by both stages


def modality_input(state: LatentState, context: torch.Tensor, sigma: torch.Tensor, enabled: bool = True) -> Modality:
    """Transformer input of one modality at ``sigma``; clean (conditioning) tokens get timestep 0."""
    return Modality(
        enabled=enabled,
        latent=state.latent,
        sigma=sigma,
        timesteps=state.denoise_mask * sigma,
        positions=state.positions,
        context=context,
        context_mask=None,
        attention_mask=state.attention_mask,
    )


def keep_clean_tokens(denoised: torch.Tensor, state: LatentState) -> torch.Tensor:
    """Where the denoise mask is 0 (conditioning tokens) the prediction is the clean latent."""
    return (denoised * state.denoise_mask + state.clean_latent.float() * (1 - state.denoise_mask)).to(denoised.dtype)


DenoiseFn = Callable[[LatentState, LatentState, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
"""``denoise(video_state, audio_state, sigmas, step)``: both modalities' predictions at ``sigmas[step]``."""



def report_step(on_step: OnStep | None, step: int, total: int, denoised_video: torch.Tensor, video_state: LatentState, video_tools) -> None:
    """``on_step`` after step ``step`` of ``total`` (with the step's video x0 when ``video_tools`` can put it in
    ComfyUI layout): the progress report and cancel point, where an exception ends the stage at a step boundary."""
    if on_step is None:
        return
    if video_tools is None:
        on_step(step, total)
    else:
        on_step(step, total, lambda x0=denoised_video, state=video_state: state_to_comfy(replace(state, latent=x0), video_tools))


def _euler_loop(
    sigmas: torch.Tensor,
    video_state: LatentState,
    audio_state: LatentState,
    denoise: DenoiseFn,
    on_step: OnStep | None,
    video_tools=None,
) -> tuple[LatentState, LatentState]:
    """Step both modalities from ``sigmas[0]`` down to ``sigmas[-1]``; ``on_step`` after each step
    (with the step's video x0 when ``video_tools`` can put it in ComfyUI layout)."""
    stepper = EulerDiffusionStep()
    total = len(sigmas) - 1
    for step in range(total):
        denoised_video, denoised_audio = denoise(video_state, audio_state, sigmas, step)
        denoised_video = keep_clean_tokens(denoised_video, video_state)
        denoised_audio = keep_clean_tokens(denoised_audio, audio_state)
        video_state = replace(video_state, latent=stepper.step(video_state.latent, denoised_video, sigmas, step))
        audio_state = replace(audio_state, latent=stepper.step(audio_state.latent, denoised_audio, sigmas, step))
        report_step(on_step, step + 1, total, denoised_video, video_state, video_tools)
    return video_state, audio_state


def denoising_loop(stepper: str):
    """The loop of ``stepper`` (one of ``STEPPERS``), with ``_euler_loop``'s signature."""
    if stepper == "res2s":
        from mgpu_backend.ltx.res2s import res2s_loop  # res2s builds on this module's pieces

        return res2s_loop
    return _euler_loop


def transformer_layer_count(transformer: torch.nn.Module) -> int | None:
    velocity_model = getattr(transformer, "velocity_model", transformer)
    blocks = getattr(velocity_model, "transformer_blocks", None)
    return None if blocks is None else len(blocks)


# --------------------------------------------------------------------------------------------------
# Stage 1: guidance passes and their combination


@dataclass(frozen=True)
class StepGuidance:
    """The two guiders of one step (their parameters may depend on sigma) and what they skip."""

    video: MultiModalGuider
    audio: MultiModalGuider
    skip_video: bool
    skip_audio: bool

    @property
    def needs_unconditional(self) -> bool:
        return self.video.do_unconditional_generation() or self.audio.do_unconditional_generation()

    @property
    def needs_perturbed(self) -> bool:
        return self.video.do_perturbed_generation() or self.audio.do_perturbed_generation()

    @property
    def needs_isolated(self) -> bool:
        return self.video.do_isolated_modality_generation() or self.audio.do_isolated_modality_generation()


def guidance_passes(
    guidance: StepGuidance,
    video_state: LatentState,
    audio_state: LatentState,
    sigma: torch.Tensor,
    positive: TextContext,
    negative: TextContext,
) -> list[GuidancePass]:
    """The transformer calls of one stage-1 step, only those the guiders use.

    conditional: positive prompt. unconditional: negative prompt (CFG). perturbed: positive prompt
    with self-attention skipped in the STG blocks of the modalities doing STG. isolated: positive
    prompt with both audio<->video cross-attentions skipped (modality guidance).
    """
    video = modality_input(video_state, positive.video_context, sigma, enabled=not guidance.skip_video)
    audio = modality_input(audio_state, positive.audio_context, sigma, enabled=not guidance.skip_audio)
    passes = [GuidancePass("conditional", video, audio, None)]
    if guidance.needs_unconditional:
        passes.append(
            GuidancePass(
                "unconditional",
                modality_input(video_state, negative.video_context, sigma),
                modality_input(audio_state, negative.audio_context, sigma),
                None,
            )
        )
    if guidance.needs_perturbed:
        skipped = []
        if guidance.video.do_perturbed_generation():
            skipped.append(Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, blocks=guidance.video.params.stg_blocks))
        if guidance.audio.do_perturbed_generation():
            skipped.append(Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, blocks=guidance.audio.params.stg_blocks))
        passes.append(GuidancePass("perturbed", video, audio, _one_sample(skipped)))
    if guidance.needs_isolated:
        skipped = [
            Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, blocks=None),
            Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, blocks=None),
        ]
        passes.append(GuidancePass("isolated", video, audio, _one_sample(skipped)))
    return passes


def _one_sample(perturbations: list[Perturbation]) -> BatchedPerturbationConfig:
    return BatchedPerturbationConfig(perturbations=[PerturbationConfig(perturbations=perturbations)])


def combine_guidance(
    guidance: StepGuidance,
    passes: list[GuidancePass],
    outputs: list[tuple[torch.Tensor, torch.Tensor]],
    previous: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Guided prediction of both modalities from the passes' outputs.

    A pass that did not run contributes 0.0, whose guidance term has scale 0 in that case. A
    modality skipping this step keeps its previous guided prediction.
    """
    by_name = {guidance_pass.name: output for guidance_pass, output in zip(passes, outputs, strict=True)}
    absent = (0.0, 0.0)
    conditional = by_name["conditional"]
    unconditional = by_name.get("unconditional", absent)
    perturbed = by_name.get("perturbed", absent)
    isolated = by_name.get("isolated", absent)
    guided = []
    modalities = ((guidance.video, guidance.skip_video), (guidance.audio, guidance.skip_audio))
    for index, (guider, skip) in enumerate(modalities):
        if skip:
            guided.append(previous[index])
        else:
            guided.append(guider.calculate(conditional[index], unconditional[index], perturbed[index], isolated[index]))
    return guided[0], guided[1]


def _image_conditionings(loader, params: GenerationParams, geometry: StageGeometry, image: torch.Tensor | None,
                         last_image: torch.Tensor | None = None) -> list:  # fmt: skip
    """The images' conditionings at this stage's size, as the recipe's runner makes them (none without an image)."""
    images = params.conditioning_images(image, last_image)
    if not images:
        return []
    return image_conditionings(images, geometry, loader.video_encoder(), loader.dtype, loader.device, params.image_crf, params.conditioning)


def sample_stage1(
    loader,
    params: GenerationParams,
    positive: TextContext,
    negative: TextContext | None,
    image: torch.Tensor | None = None,
    pass_runner: PassRunner = SequentialPassRunner(),  # noqa: B008 - stateless
    on_step: OnStep | None = None,
    lora_set: str = "none",
    last_image: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 from pure noise: ``(video [1,128,F',H1/32,W1/32], audio [1,8,T,16])``, float32.

    ``lora_set``: ``"none"`` (the two-stage and distilled recipes) or ``"distilled"`` (the HQ recipe
    runs stage 1 with the distilled LoRA too, at its own strength).
    ``image`` (``[H, W, 3]`` in 0..1) conditions the first frame at ``params.image_strength`` and
    ``last_image`` the last frame at ``params.last_image_strength``, as ``params.conditioning`` says
    (``first-frame``: the first image becomes the first latent frame; a guiding latent otherwise).
    Noise comes from a generator seeded with ``params.seed``: video tokens (guiding latents' included) first, then audio.
    ``negative`` may be None when no step runs the unconditional pass (the distilled recipe).
    """
    params.validate()
    check_conditioning_image(image)
    check_conditioning_image(last_image)
    device, dtype = loader.device, loader.dtype
    geometry = params.stage1
    video_tools, audio_tools = geometry.video_tools(), geometry.audio_tools()
    with torch.inference_mode():
        conditionings = _image_conditionings(loader, params, geometry, image, last_image)
        transformer = loader.transformer(lora_set)
        layer_count = transformer_layer_count(transformer)
        validate_stg_blocks(params.video_guider, layer_count, "video")
        validate_stg_blocks(params.audio_guider, layer_count, "audio")

        sigmas = params.stage1_sigma_schedule(device)
        noiser = GaussianNoiser(generator=job_generator(params.seed, device, dtype))
        video_state = initial_state(video_tools, conditionings, noiser, 1.0, dtype, device)
        audio_state = initial_state(audio_tools, [], noiser, 1.0, dtype, device)

        video_guiders = create_multimodal_guider_factory(params.video_guider, negative_context=None if negative is None else negative.video_context)
        audio_guiders = create_multimodal_guider_factory(params.audio_guider, negative_context=None if negative is None else negative.audio_context)
        sigma_values = sigmas.tolist()
        previous: tuple[torch.Tensor, torch.Tensor] | None = None

        def guided_denoise(video_state, audio_state, sigmas_of_call, step):
            nonlocal previous
            # The Euler loop hands the schedule itself (its values read once, no device sync per step);
            # res_2s hands its own (a midpoint sigma, the extra last sigma before 0).
            sigma = sigma_values[step] if sigmas_of_call is sigmas else float(sigmas_of_call[step])
            video_guider = video_guiders.build_from_sigma(sigma)
            audio_guider = audio_guiders.build_from_sigma(sigma)
            guidance = StepGuidance(
                video_guider, audio_guider, video_guider.should_skip_step(step), audio_guider.should_skip_step(step)
            )
            if guidance.skip_video and guidance.skip_audio:
                return previous
            if guidance.needs_unconditional and negative is None:
                raise ValueError("the guidance asks for the unconditional pass (cfg_scale != 1) but no negative prompt was given; encode one")
            passes = guidance_passes(guidance, video_state, audio_state, sigmas_of_call[step], positive, negative)
            outputs = pass_runner.run(transformer, passes)
            previous = combine_guidance(guidance, passes, outputs, previous)
            return previous

        loop = denoising_loop(params.stepper)
        video_state, audio_state = loop(sigmas, video_state, audio_state, guided_denoise, on_step, video_tools)
        return state_to_comfy(video_state, video_tools), state_to_comfy(audio_state, audio_tools)


# --------------------------------------------------------------------------------------------------
# Between the stages


def upsample_video(loader, video_latent: torch.Tensor) -> torch.Tensor:
    """Spatial 2x of a stage-1 video latent: ``[1,128,F',h,w]`` -> ``[1,128,F',2h,2w]``, float32.

    The upsampler works on un-normalised latents; the video encoder's per-channel statistics
    un-normalise before and normalise after, as in the official pipeline.
    """
    if video_latent.ndim != 5 or video_latent.shape[1] != 128:
        raise ValueError(
            f"upsample_video expects a video latent [B, 128, F', H/32, W/32], got shape {tuple(video_latent.shape)}"
        )
    with torch.inference_mode():
        latent = video_latent.to(device=loader.device, dtype=loader.dtype)
        upsampled = ltx_upsample_video(
            latent=latent, video_encoder=loader.video_encoder(), upsampler=loader.spatial_upsampler()
        )
        return upsampled.float()


# --------------------------------------------------------------------------------------------------
# Stage 2


def refine_stage2(
    loader,
    params: GenerationParams,
    video_latent: torch.Tensor,
    audio_latent: torch.Tensor,
    positive: TextContext,
    image: torch.Tensor | None = None,
    sigmas: torch.Tensor | list[float] | tuple[float, ...] | None = None,
    transformer_wrapper: Callable[[torch.nn.Module], Callable] | None = None,
    on_step: OnStep | None = None,
    lora_set: str = "distilled",
    denoise_audio: bool = False,
    last_image: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine the upsampled video at full size on the stage-2 transformer; audio passes through.

    ``lora_set``: ``"distilled"`` (the two-stage and HQ recipes: the distilled LoRA on the dev checkpoint) or
    ``"none"`` (the distilled recipe: the distilled checkpoint as stage 1 ran it).

    ``video_latent`` is the upsampled stage-1 latent at ``params.height`` x ``params.width``.
    It is noised to ``sigmas[0]`` (default: the official stage-2 schedule ``schema.STAGE_2_SIGMAS``) with the noise the official pipeline uses: the generator seeded with
    ``params.seed``, advanced past stage 1's draws (its guiding latents' included). Positive prompt only, no
    guidance. ``image`` and ``last_image`` condition the first and last frames at full size as in stage 1.

    Audio is frozen by design. The official 1.0.0 pipeline re-noises the stage-1 audio and
    denoises it again in stage 2; here the audio runs through the same re-noise-and-denoise, because
    the video attends to it (so the video equals the official one), but the result is dropped:
    the returned audio latent IS ``audio_latent``, unchanged bitwise. The stage-1 audio was
    denoised with full guidance; the stage-2 audio would only be a guidance-free re-run of it.
    ``denoise_audio=True`` returns the re-denoised audio instead, as the official pipelines do (the
    distilled recipe untiled or sequence parallel: every rank sees the whole audio and video). TDP
    must not: a tile's audio attended to that tile's video only.

    ``transformer_wrapper(x0_model)`` may return any callable with the X0 model's call signature
    ``(video=, audio=, perturbations=)``; tiled data parallelism uses it to split the video.
    """
    if not params.two_stage:
        raise ValueError("refine_stage2 needs two-stage params (two_stage=True): it refines a 2x upsampled latent")
    params.validate()
    geometry, stage1 = params.stage2, params.stage1
    sigmas = torch.as_tensor(STAGE_2_SIGMAS if sigmas is None else sigmas, dtype=torch.float32)
    validate_sigmas(sigmas)
    check_conditioning_image(image)
    check_conditioning_image(last_image)
    check_latent_shape(
        "the stage-2 video latent",
        video_latent,
        geometry.video_shape.to_torch_shape(),
        f"upsample the stage-1 latent of a {stage1.height}x{stage1.width} video first, "
        f"or set height/width to the upsampled size",
    )
    check_latent_shape(
        "the audio latent",
        audio_latent,
        geometry.audio_shape.to_torch_shape(),
        f"pass the stage-1 audio of the same job ({params.num_frames} frames at {params.frame_rate} fps)",
    )
    device, dtype = loader.device, loader.dtype
    sigmas = sigmas.to(device)
    video_tools, audio_tools = geometry.video_tools(), geometry.audio_tools()
    with torch.inference_mode():
        conditionings = _image_conditionings(loader, params, geometry, image, last_image)
        x0_model = loader.transformer(lora_set)
        transformer = x0_model if transformer_wrapper is None else transformer_wrapper(x0_model)

        guiding_frames = params.guiding_frames(image, last_image)
        noiser = GaussianNoiser(generator=job_generator(params.seed, device, dtype, stages_before=(stage1,), guiding_frames=guiding_frames))
        noise_scale = sigmas[0]
        video_state = initial_state(video_tools, conditionings, noiser, noise_scale, dtype, device, video_latent)
        audio_state = initial_state(audio_tools, [], noiser, noise_scale, dtype, device, audio_latent)

        def positive_only(video_state, audio_state, sigmas, step):
            sigma = sigmas[step]
            return transformer(
                video=modality_input(video_state, positive.video_context, sigma),
                audio=modality_input(audio_state, positive.audio_context, sigma),
                perturbations=None,
            )

        loop = denoising_loop(params.stepper)
        video_state, denoised_audio = loop(sigmas, video_state, audio_state, positive_only, on_step, video_tools)
        if denoise_audio:
            return state_to_comfy(video_state, video_tools), state_to_comfy(denoised_audio, audio_tools)
        return state_to_comfy(video_state, video_tools), audio_latent
