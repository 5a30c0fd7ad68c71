"""SP Sampler (stage 1, from noise) and TDP Upscale (stage 2, 2x refine): the two denoising nodes.

Each checks its inputs (sizes, frame counts, sigmas, tiles) with a message that says what to
change before anything is sent, calls ``mgpu_backend.ltx.api`` and returns an AV LATENT in ComfyUI's
LTX-2 layout. Widget defaults and the input checks come from ``mgpu_backend.ltx.schema``, the one
place the official values are written. The recipe comes with the model handle (Load Checkpoint
MGPU's ``pipeline``): for the distilled recipe SP Sampler ignores its steps and guidance widgets
(the recipe's 8 fixed sigmas, one unguided pass per step) and says so on the node, and TDP Upscale's
empty sigmas mean the recipe's tail. How the work is split over GPUs (sequence parallel, guidance
parallel, tiled data parallel) is decided in the fleet, never here.

The model version (LTX-2.0 or LTX-2.3) is the checkpoint's, read from its header through the model
handle (``model_nodes.spec_model_version``). The widgets show LTX-2.0's official values as their
defaults and are sent as set: a user's explicit steps are never replaced behind their back. An empty
``stg_blocks`` takes the checkpoint's own official block in the fleet. When steps or STG blocks hold
the other version's official values (a 2.0 graph on a 2.3 checkpoint), SP Sampler says so on the
node with this version's values (``version_default_notes``); the shipped 2.3 workflows carry 2.3's.

What ComfyUI's own LTX-2 nodes feed in either acts as on stock nodes or is refused before any fleet
work, naming the node and what to use instead: a CONDITIONING from MGPU Text Encode or from
ComfyUI's LTX-2 text encoder is taken (``layouts``); LTXVConditioning's frame rate must be the
node's (TDP Upscale takes it for a latent from native nodes that records none); keyframe guides
(LTXVAddGuide), reference audio, masks, areas, ControlNets and timestep ranges in a conditioning,
and a latent ``noise_mask`` that masks anything, are not applied and so refused
(``check_conditioning_options``, ``check_noise_mask``): ComfyUI's own sampler over the fleet as a
stock MODEL applies them. Audio latents of ComfyUI's length (LTXVEmptyLatentAudio rounds the
duration up, ltx-core to nearest: one frame more at most) are taken and made: the fleet runs at
ltx-core's length and the nodes drop or repeat the last frame at the boundary (``api.audio_latent_for_fleet``,
``api.audio_latent_for_comfy``), so the pack's own results stay those of the official pipeline.
"""

from __future__ import annotations

import math

import torch

from mgpu_backend.ltx import api
from mgpu_backend.ltx.api import parse_tiles
from mgpu_backend.ltx.recipes import DEFAULT_RECIPE, RECIPES, STAGE2_POLICIES, STEPPERS, recipe
from mgpu_backend.ltx.schema import (
    DEFAULTS,
    IMAGE_STRENGTH,
    MAX_SIDE,
    MODEL_VERSIONS,
    OFFICIAL,
    PARALLEL_PLANS,
    SEED_MAX,
    STAGE2_PLANS,
    TDP_OVERLAP,
    TDP_UPSCALE_SIGMAS,
    VIDEO_SPATIAL_COMPRESSION,
    check_image_strengths,
    pixel_geometry,
    stage2_default_sigmas,
    validate_generation,
    validate_stage1_sigmas,
    validate_upscale_sigmas,
)

from .fleet_job import FleetJob, node_note
from .layouts import (
    FRAME_RATE_KEY,
    MODEL_TYPE,
    check_model_handle,
    conditioning_contexts,
    first_frame,
    handle_pipeline,
    latent_frame_rate,
    make_av_latent,
    split_latent,
)
from .model_nodes import CATEGORY, spec_model_version
from .validation import generation_check, refusal

FROM_LOADER = "(from loader)"
FROM_RECIPE = "(from recipe)"
RECIPE_STEPPERS = "; ".join(f"{declared.name}: {declared.stage1.stepper}" for declared in RECIPES.values())
STEPPER_WORDS = " ".join(f"{name}: {words}." for name, words in STEPPERS.items())
MAX_FRAMES = 1025  # the widget's range: about 40 s at 24 fps
VIDEO = OFFICIAL.video_guidance
AUDIO = OFFICIAL.audio_guidance


def parse_stg_blocks(text: str) -> tuple[int, ...] | None:
    """'29' or '28, 29' -> block indices; empty -> None, the fleet's default (the official block,
    or the last block of a smaller model)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not all(part.isdigit() for part in parts):
        raise ValueError(f"stg_blocks must be transformer block indices like 29 or 28,29 (or empty for the default); got {text!r}")
    return tuple(int(part) for part in parts) or None


def parse_sigmas(text: str, force_from_noise: bool, pipeline: str = DEFAULT_RECIPE) -> tuple[float, ...]:
    """'0.625, 0.4, 0.0' -> a strictly decreasing schedule in [0, 1] that does not start from noise
    (sigma 1.0) unless forced: TDP refines an upsampled latent, it does not generate one. Empty: the
    recipe's default (``schema.stage2_default_sigmas``)."""
    if not text.strip():
        return stage2_default_sigmas(pipeline)
    try:
        sigmas = tuple(float(part) for part in text.replace(";", ",").split(",") if part.strip())
    except ValueError:
        raise ValueError(f"sigmas must be numbers separated by commas like {DEFAULT_SIGMAS}; got {text!r}") from None
    validate_upscale_sigmas(sigmas, force_from_noise)
    return sigmas


def _blocks_text(blocks) -> str:
    return ",".join(map(str, blocks))


def official_values_text() -> str:
    """Each model version's official steps and STG block of the default recipe (two-stage), for the tooltips."""
    return ", ".join(f"LTX-{version}: {DEFAULTS[(version, DEFAULT_RECIPE)].steps} steps, STG block "
                     f"{_blocks_text(DEFAULTS[(version, DEFAULT_RECIPE)].video_guidance.stg_blocks)}" for version in MODEL_VERSIONS)  # fmt: skip


def version_default_notes(model_version: str | None, pipeline: str, steps: int, stg_blocks: tuple[int, ...] | None) -> str | None:
    """A note when the sampler's steps or STG blocks hold another model version's official value but
    not this checkpoint's: what the checkpoint is, what it was given, and its own values. None when
    the version is unknown, the recipe ignores those widgets (distilled), or nothing fits."""
    declared = recipe(pipeline)
    if model_version not in declared.versions or declared.ignored("steps") or declared.ignored("guidance"):
        return None  # no version known, one the recipe refuses (the job says so), or no such widgets
    own = DEFAULTS[(model_version, pipeline)]
    own_blocks = own.video_guidance.stg_blocks
    for other_version in (version for version in declared.versions if version != model_version):
        other = DEFAULTS[(other_version, pipeline)]
        given = [f"steps {steps}"] if steps == other.steps != own.steps else []
        if stg_blocks is not None and stg_blocks == other.video_guidance.stg_blocks != own_blocks:
            given.append(f"stg_blocks {_blocks_text(stg_blocks)}")
        if given:
            return (
                f"the checkpoint is LTX-{model_version}, but {' and '.join(given)} {'is' if len(given) == 1 else 'are'} "
                f"LTX-{other_version}'s official {'value' if len(given) == 1 else 'values'}; LTX-{model_version}'s are "
                f"steps {own.steps} and stg_blocks {_blocks_text(own_blocks)} (or empty)"
            )
    return None


DEFAULT_SIGMAS = ", ".join(map(str, TDP_UPSCALE_SIGMAS))
SAME_AS_RESCALE = -1.0
"""SP Sampler's ``audio_rescale`` that takes ``rescale`` for the audio too (older graphs have no such widget)."""
OWN_AUDIO_RESCALE = "; ".join(
    f"{pipeline} on LTX-{version}: video {official.video_guidance.rescale_scale}, audio {official.audio_guidance.rescale_scale}"
    for (version, pipeline), official in DEFAULTS.items() if official.video_guidance.rescale_scale != official.audio_guidance.rescale_scale
)
"""The recipes whose official audio rescale differs from the video's, in words (``audio_rescale``'s tooltip)."""
STAGE2_AUTO = "; ".join(f"{declared.name}: {STAGE2_POLICIES[declared.stage2_policy]}" for declared in RECIPES.values())
RECIPE_SIGMAS = "; ".join(f"{declared.name}: {', '.join(map(str, declared.upscale_sigmas))}" for declared in RECIPES.values())
SP_SAMPLER_INPUTS = {"steps": ("steps",), "guidance": ("video_cfg", "audio_cfg", "stg_scale", "stg_blocks", "rescale", "audio_rescale", "modality_scale", "negative")}
"""SP Sampler's inputs behind each input a recipe may ignore (``recipes.Ignored.input``)."""


def ignored_inputs(pipeline: str) -> list[str]:
    """SP Sampler's inputs the recipe ignores, in the node's order."""
    declared = recipe(pipeline)
    return [name for key, names in SP_SAMPLER_INPUTS.items() if declared.ignored(key) for name in names]


STOCK_SAMPLER = "use ComfyUI's own sampler with Load Checkpoint (MGPU fleet)"
"""What to use for what the MGPU sampling nodes do not apply: the fleet as a stock MODEL."""
UNAPPLIED_CONDITIONING = {
    "keyframe_idxs": ("a keyframe guide", "LTXVAddGuide"),
    "guide_attention_entries": ("a keyframe guide", "LTXVAddGuide"),
    "ref_audio": ("reference audio", "LTXVReferenceAudio"),
    "control": ("a ControlNet", "the ControlNet apply node"),
    "gligen": ("a GLIGEN box", "GLIGENTextBoxApply"),
    "area": ("an area", "ConditioningSetArea"),
    "mask": ("a mask", "ConditioningSetMask"),
    "hooks": ("hooks", "the hook nodes"),
}
"""Conditioning options ComfyUI's nodes set that SP Sampler and TDP Upscale do not apply: (what it
is, the node that sets it). A None value is an option cleared (LTXVCropGuides clears the guides)."""
UNAPPLIED_DEFAULTS = {
    "strength": (1.0, "a strength", "ConditioningSetAreaStrength"),
    "start_percent": (0.0, "a timestep range", "ConditioningSetTimestepRange"),
    "end_percent": (1.0, "a timestep range", "ConditioningSetTimestepRange"),
}
"""Options that are applied only at their default value: (default, what it is, the node that sets it)."""


def check_conditioning_options(conditioning, input_name: str, node: str) -> float | None:
    """Refuse a CONDITIONING carrying what ``node`` would silently drop; return the frame rate it
    carries (LTXVConditioning's), which the node honours or refuses itself, or None."""
    options = conditioning[0][1] if isinstance(conditioning, (list, tuple)) and conditioning and len(conditioning[0]) > 1 and isinstance(conditioning[0][1], dict) else {}  # fmt: skip
    found = [(what, source) for key, (what, source) in UNAPPLIED_CONDITIONING.items() if options.get(key) is not None]
    found += [(what, source) for key, (default, what, source) in UNAPPLIED_DEFAULTS.items() if options.get(key, default) != default]
    if found:
        what, source = found[0]
        raise ValueError(
            f"{node}: the {input_name} conditioning carries {what} from {source}, which {node} does not apply; "
            f"{STOCK_SAMPLER}, or remove {source}"
        )
    rate = options.get(FRAME_RATE_KEY)
    return None if rate is None else float(rate)


def check_frame_rate(node: str, input_name: str, carried: float, rate: float, runs_at: str, remedy: str) -> None:
    """Refuse a conditioning whose LTXVConditioning frame rate is not the rate ``node`` runs at."""
    if math.isclose(carried, rate, rel_tol=1e-6):
        return
    raise ValueError(f"{node}: the {input_name} conditioning carries frame rate {carried:g} from LTXVConditioning, but {runs_at}; {remedy}")


def check_noise_mask(latent: dict, input_name: str, node: str) -> None:
    """Refuse a latent whose ``noise_mask`` keeps any part from being denoised (a mask of ones, as
    LTXVConcatAVLatent fills one in, masks nothing and is what the node does anyway)."""
    mask = latent.get("noise_mask")
    if mask is None:
        return
    parts = mask.unbind() if getattr(mask, "is_nested", False) else [mask]
    if all(bool(torch.all(part == 1.0)) for part in parts):
        return
    raise ValueError(
        f"{node}: {input_name} carries a noise mask (from LTXVImgToVideoInplace, LTXVImgToVideo, LTXVAddGuide or "
        f"SetLatentNoiseMask) that keeps part of the latent from being denoised, which {node} does not apply; for a "
        f"first-frame image connect it to {node}'s image input instead, or {STOCK_SAMPLER}"
    )


IMAGE_INPUTS = {
    "image_strength": ("FLOAT", {"default": IMAGE_STRENGTH, "min": 0.0, "max": 1.0, "step": 0.05, "tooltip": "How strongly the image holds the first frame: 1.0 keeps it as given, lower lets the video drift from it (ComfyUI's LTX-2.3 image-to-video template uses 0.7 in stage 1). Needs the image input."}),
    "last_image": ("IMAGE", {"tooltip": "Optional last frame (first/last-frame video): it guides the video's last frame, appended as a guiding latent as the official pipelines do; resized like image. Give it to TDP Upscale too, which then runs sequence parallel (tiles cannot hold it)."}),
    "last_image_strength": ("FLOAT", {"default": IMAGE_STRENGTH, "min": 0.0, "max": 1.0, "step": 0.05, "tooltip": "How strongly the last image holds the last frame: 1.0 keeps it as given. Needs the last_image input."}),
}
"""The optional image-strength and last-frame inputs of SP Sampler and TDP Upscale (the same images and
strengths go to both, as the official pipelines condition both stages on them)."""


def image_strengths(image: torch.Tensor | None, image_strength: float, last_image: torch.Tensor | None, last_image_strength: float) -> dict:
    """The image-strength and last-frame keywords of ``api.sample`` / ``api.upscale``; a strength set
    without its image is refused before anything is queued."""
    check_image_strengths(image_strength, last_image_strength, image is not None, last_image is not None)
    return {"image_strength": image_strength, "last_image": first_frame(last_image, "last_image"), "last_image_strength": last_image_strength}


class SPSampler:
    """Stage 1: generate video and audio from noise with full multimodal guidance."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("av_latent",)
    OUTPUT_TOOLTIPS = ("Video + audio latent as LTXVConcatAVLatent makes it; LTXVSeparateAVLatent splits it.",)
    FUNCTION = "sample"
    DESCRIPTION = (
        "LTX-2 stage 1 on all GPUs of the fleet: the same result as one GPU, faster "
        "(sequence parallel: each GPU holds a share of the video tokens; guidance passes may run on separate GPUs)."
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "The model from Load Checkpoint MGPU."}),
                "positive": ("CONDITIONING", {"tooltip": "Positive conditioning from MGPU Text Encode (or ComfyUI's LTX-2 text encoder). Keyframe guides, reference audio and masks on it are refused: they need ComfyUI's own sampler."}),
                "negative": ("CONDITIONING", {"tooltip": "Negative conditioning from MGPU Text Encode (or ComfyUI's LTX-2 text encoder)."}),
                "width": ("INT", {"default": OFFICIAL.stage1_width, "min": VIDEO_SPATIAL_COMPRESSION, "max": MAX_SIDE, "step": VIDEO_SPATIAL_COMPRESSION, "tooltip": "Width of this stage in pixels, a multiple of 32. In the two-stage graph TDP Upscale doubles it (768 gives a 1536 video), so the final width is a multiple of 64."}),
                "height": ("INT", {"default": OFFICIAL.stage1_height, "min": VIDEO_SPATIAL_COMPRESSION, "max": MAX_SIDE, "step": VIDEO_SPATIAL_COMPRESSION, "tooltip": "Height of this stage in pixels, a multiple of 32. In the two-stage graph TDP Upscale doubles it (512 gives a 1024 video), so the final height is a multiple of 64."}),
                "length": ("INT", {"default": OFFICIAL.num_frames, "min": 1, "max": MAX_FRAMES, "step": 8, "tooltip": "Number of frames, 8k+1 (the video VAE packs 8 frames per latent frame): 121 is 5 s at 24 fps."}),
                "frame_rate": ("FLOAT", {"default": OFFICIAL.frame_rate, "min": 1.0, "max": 120.0, "step": 0.01, "tooltip": "Frames per second. Sets how long the audio is; use the same value in CreateVideo."}),
                "seed": ("INT", {"default": OFFICIAL.seed, "min": 0, "max": SEED_MAX, "control_after_generate": True, "tooltip": "Noise seed. The same seed and inputs give the same video on any number of GPUs."}),
                "steps": ("INT", {"default": OFFICIAL.steps, "min": 1, "max": 200, "tooltip": f"Denoising steps. The official values differ per model version ({official_values_text()}); the node notes when the loaded checkpoint's differ from these. Fewer is faster and rougher. Ignored by the distilled pipeline."}),
                "video_cfg": ("FLOAT", {"default": VIDEO.cfg_scale, "min": 0.0, "max": 20.0, "step": 0.1, "tooltip": "Classifier-free guidance of the video: how strongly it follows the prompt. 1.0 turns it off (one pass less per step)."}),
                "audio_cfg": ("FLOAT", {"default": AUDIO.cfg_scale, "min": 0.0, "max": 20.0, "step": 0.1, "tooltip": f"Classifier-free guidance of the audio. The official default {AUDIO.cfg_scale} is higher than the video's."}),
                "stg_scale": ("FLOAT", {"default": VIDEO.stg_scale, "min": 0.0, "max": 10.0, "step": 0.05, "tooltip": "Spatio-temporal guidance (a pass with perturbed attention in stg_blocks) for video and audio. 0 turns it off (one pass less per step)."}),
                "stg_blocks": ("STRING", {"default": "", "tooltip": "Transformer blocks STG perturbs, e.g. 28 or 28,29; they must exist in the model. Empty: the checkpoint's official block (LTX-2.0: 29, LTX-2.3: 28; the last block of a smaller model)."}),
                "rescale": ("FLOAT", {"default": VIDEO.rescale_scale, "min": 0.0, "max": 1.0, "step": 0.05, "tooltip": "Rescales the guided prediction toward the conditional one's spread to avoid over-saturation. 0 turns it off."}),
                "modality_scale": ("FLOAT", {"default": VIDEO.modality_scale, "min": 0.0, "max": 10.0, "step": 0.1, "tooltip": "Audio-video sync guidance (a pass with the cross-modal attention cut). 1.0 turns it off (one pass less per step)."}),
                "parallel": ([FROM_LOADER, *PARALLEL_PLANS], {"default": FROM_LOADER, "tooltip": "How the steps are spread over the GPUs; (from loader) uses the loader's choice. sp: sequence parallel, guidance: passes on separate GPUs, hybrid: both, auto: planner."}),
            },
            "optional": {
                "audio_rescale": ("FLOAT", {"default": SAME_AS_RESCALE, "min": SAME_AS_RESCALE, "max": 1.0, "step": 0.05, "tooltip": f"The audio's own rescale, where it differs from the video's (the official values where they differ: {OWN_AUDIO_RESCALE}). {SAME_AS_RESCALE}: the same as rescale."}),
                "image": ("IMAGE", {"tooltip": "Optional first frame for image-to-video; it is resized to cover width x height and centre-cropped."}),
                "compile_blocks": ("BOOLEAN", {"default": False, "tooltip": "Compile the transformer blocks with torch.compile (GPU). The first run of each size waits tens of seconds for the compile; later runs on the same fleet get faster steps when each GPU holds a small share of the video (4 or more GPUs). Results differ from off by bf16 rounding only."}),
                "sigmas": ("SIGMAS", {"tooltip": "Optional stage-1 schedule, e.g. from ManualSigmas (ComfyUI's LTX-2.3 templates: 1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0), from 1.0 down to 0.0. It replaces the recipe's schedule, and steps follow it (the steps widget is then not read)."}),
                "sampler": ([FROM_RECIPE, *STEPPERS], {"default": FROM_RECIPE, "tooltip": f"How each step moves from one sigma to the next; {FROM_RECIPE} is the loader's recipe's ({RECIPE_STEPPERS}). {STEPPER_WORDS}"}),
                **IMAGE_INPUTS,
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, width=None, height=None, length=None, frame_rate=None, seed=None, steps=None, stg_blocks=None):
        """ComfyUI runs this before queueing: a bad size or frame count is refused at once, under the
        input at fault (validation.py). An input fed by a link is None here and checked when the node runs."""
        values = {"width": width, "height": height, "length": length, "frame_rate": frame_rate, "seed": seed, "steps": steps}
        return refusal([*((name, value, generation_check(name)) for name, value in values.items()), ("stg_blocks", stg_blocks, parse_stg_blocks)])

    def sample(self, model, positive, negative, width, height, length, frame_rate, seed, steps, video_cfg, audio_cfg, stg_scale, stg_blocks, rescale, modality_scale, parallel,
               image=None, compile_blocks=False, audio_rescale=SAME_AS_RESCALE, sigmas=None, sampler=FROM_RECIPE, unique_id=None,
               image_strength=IMAGE_STRENGTH, last_image=None, last_image_strength=IMAGE_STRENGTH):  # fmt: skip
        handle = check_model_handle(model)
        pipeline = handle_pipeline(handle)
        declared = recipe(pipeline)
        schedule = None if sigmas is None else validate_stage1_sigmas(sigmas)
        if schedule is not None:
            steps = len(schedule) - 1  # the schedule's steps, whatever the widget holds (noted below)
        validate_generation(height, width, length, two_stage=False, num_inference_steps=steps, frame_rate=frame_rate)
        blocks = parse_stg_blocks(stg_blocks)
        used = {"positive": positive, "negative": negative} if declared.encodes_negative_prompt else {"positive": positive}  # unguided: no negative pass
        for input_name, conditioning in used.items():
            carried = check_conditioning_options(conditioning, input_name, "SP Sampler")
            if carried is not None:
                check_frame_rate("SP Sampler", input_name, carried, frame_rate, f"SP Sampler's frame_rate is {frame_rate:g}",
                                 f"set SP Sampler's frame_rate to {carried:g} (it also sets how long the audio is) or LTXVConditioning's to {frame_rate:g}")  # fmt: skip
        positive_contexts = conditioning_contexts(positive, "positive")
        negative_contexts = conditioning_contexts(negative, "negative") if declared.encodes_negative_prompt else None
        shared = {"stg_scale": stg_scale, "modality_scale": modality_scale, "stg_blocks": blocks}
        audio_rescale = rescale if audio_rescale == SAME_AS_RESCALE else audio_rescale
        video_guidance = api.Guidance(cfg_scale=video_cfg, rescale_scale=rescale, **shared)
        audio_guidance = api.Guidance(cfg_scale=audio_cfg, rescale_scale=audio_rescale, **shared)
        version_note = version_default_notes(spec_model_version(handle["spec"]), pipeline, steps, blocks)
        if version_note is not None:
            node_note(unique_id, version_note)
        ignored = ignored_inputs(pipeline)
        if schedule is not None:
            ignored = [name for name in ignored if name != "steps"]
        if declared.ignored("steps") and schedule is None:
            steps = None
        if declared.ignored("guidance"):
            video_guidance, audio_guidance = None, None
        if ignored:
            node_note(unique_id, f"{declared.name} pipeline: {declared.stage1_words}; {', '.join(ignored)} are ignored")
        if schedule is not None:
            node_note(unique_id, f"the sigmas input sets {steps} steps ({', '.join(f'{sigma:g}' for sigma in schedule)}); the steps widget is not read")
        job = FleetJob(unique_id, "SP Sampler")
        video_latent, audio_latent = job.call(
            api.sample,
            handle["spec"],
            positive_contexts,
            negative_contexts,
            width=width,
            height=height,
            num_frames=length,
            frame_rate=frame_rate,
            seed=seed,
            steps=steps,
            video_guidance=video_guidance,
            audio_guidance=audio_guidance,
            image=first_frame(image),
            parallel=handle["parallel"] if parallel == FROM_LOADER else parallel,
            compile_blocks=bool(compile_blocks),
            pipeline=pipeline,
            dtype=handle["dtype"],
            sigmas=schedule,
            sampler=None if sampler == FROM_RECIPE else sampler,
            **image_strengths(image, image_strength, last_image, last_image_strength),
        )
        guiding = declared.guiding_frames(length, image is not None, last_image is not None)
        return (make_av_latent(video_latent, api.audio_latent_for_comfy(audio_latent, length, frame_rate), frame_rate, stages=1, guiding_frames=guiding),)


class TDPUpscale:
    """Stage 2: 2x spatial upsample, then a short refinement with the distilled LoRA, tile by tile."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("av_latent",)
    OUTPUT_TOOLTIPS = ("The refined video latent at twice the size, with the input audio latent unchanged (tdp) or the re-denoised audio (sp).",)
    FUNCTION = "upscale"
    DESCRIPTION = (
        "LTX-2 stage 2 on all GPUs: the upsampled latent is cut into overlapping tiles refined on different GPUs "
        "and blended. An upscaler only: the audio of stage 1 is passed through unchanged. With the "
        f"{' and '.join(declared.name for declared in RECIPES.values() if declared.stage2_policy != 'tdp')} recipes "
        "it may instead run sequence parallel (faithful to one GPU, audio re-denoised), as stage2_parallel and the planner decide."
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "The model from Load Checkpoint MGPU; it needs the spatial upsampler and the distilled LoRA."}),
                "av_latent": ("LATENT", {"tooltip": "The stage-1 AV LATENT from SP Sampler (or LTXVConcatAVLatent; its audio at ComfyUI's or ltx-core's length). A noise mask that keeps frames (LTXVImgToVideoInplace) is refused: use the image input."}),
                "positive": ("CONDITIONING", {"tooltip": "Positive conditioning from MGPU Text Encode or ComfyUI's LTX-2 text encoder (stage 2 uses no negative prompt)."}),
                "seed": ("INT", {"default": OFFICIAL.seed, "min": 0, "max": SEED_MAX, "control_after_generate": True, "tooltip": "Seed of the noise added back at the first sigma."}),
                "sigmas": ("STRING", {"default": "", "tooltip": f"Refinement schedule, strictly decreasing in [0, 1], comma separated. Empty: the loader's recipe ({RECIPE_SIGMAS}). Higher first sigma: more change. Starting at 1.0 is refused unless force_from_noise."}),
                "tiles": ("STRING", {"default": "auto", "tooltip": "Tile counts as HxW (height x width), e.g. 2x2, or auto for a balanced split over the GPUs. More tiles than GPUs is fine."}),
                "overlap": ("INT", {"default": TDP_OVERLAP, "min": 0, "max": 64, "tooltip": "Overlap between neighbouring tiles in latent cells (32 output pixels each). More overlap hides seams and costs time."}),
                "frame_rate": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 120.0, "step": 0.01, "tooltip": "0: the frame rate SP Sampler recorded in the latent (or, for a latent from native nodes, LTXVConditioning's on positive). Set it only for a latent from native nodes (the rate it was sampled at)."}),
                "force_from_noise": ("BOOLEAN", {"default": False, "tooltip": "Allow sigmas starting at 1.0 (pure noise). Tiles then do not share one picture: only for experiments."}),
            },
            "optional": {
                "image": ("IMAGE", {"tooltip": "The first-frame image of image-to-video, to keep the first frame anchored at full size."}),
                "stage2_parallel": (list(STAGE2_PLANS), {"default": STAGE2_PLANS[0], "tooltip": f"tdp: tiles on different GPUs, the stage-1 audio passes through. sp: sequence parallel over all GPUs, faithful to the one-GPU pipeline including the re-denoised audio. auto: the loader's recipe's rule ({STAGE2_AUTO})."}),
                "sampler": ([FROM_RECIPE, *STEPPERS], {"default": FROM_RECIPE, "tooltip": f"How each step moves from one sigma to the next; {FROM_RECIPE} is the loader's recipe's ({RECIPE_STEPPERS}). {STEPPER_WORDS}"}),
                **IMAGE_INPUTS,
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, sigmas=None, tiles=None, force_from_noise=None):
        """ComfyUI runs this before queueing: a bad schedule or tiling is refused before stage 1 runs,
        under the input at fault (an input fed by a link is None here, checked when the node runs)."""
        return refusal([("sigmas", sigmas, lambda text: parse_sigmas(text, bool(force_from_noise))), ("tiles", tiles, parse_tiles)])

    def upscale(self, model, av_latent, positive, seed, sigmas, tiles, overlap, frame_rate, force_from_noise, image=None, stage2_parallel="auto",
                sampler=FROM_RECIPE, unique_id=None, image_strength=IMAGE_STRENGTH, last_image=None, last_image_strength=IMAGE_STRENGTH):  # fmt: skip
        handle = check_model_handle(model)
        spec, pipeline = handle["spec"], handle_pipeline(handle)
        needed = [file for file in recipe(pipeline).files_for("upscale") if file.needed_from == "upscale"]
        missing = [file.node_input for file in needed if not spec.get(file.spec_field)]
        if missing:
            raise ValueError(f"TDP Upscale needs {' and '.join(missing)}; choose them in Load Checkpoint MGPU")
        video_latent, audio_latent = split_latent(av_latent, "av_latent")
        if audio_latent is None:
            raise ValueError(
                "av_latent has no audio: TDP Upscale takes the AV LATENT of SP Sampler "
                "(or LTXVConcatAVLatent of a video and an audio latent)"
            )
        check_noise_mask(av_latent, "av_latent", "TDP Upscale")
        carried = check_conditioning_options(positive, "positive", "TDP Upscale")
        if carried is not None and not frame_rate and not av_latent.get(FRAME_RATE_KEY):
            rate = carried  # a latent from native nodes: LTXVConditioning's frame rate is the one it was made at
        else:
            rate = latent_frame_rate(av_latent, frame_rate, "av_latent")
            if carried is not None:
                check_frame_rate("TDP Upscale", "positive", carried, rate, f"av_latent is at {rate:g} fps",
                                 f"set LTXVConditioning's frame_rate to {rate:g} or remove LTXVConditioning")  # fmt: skip
        api.check_audio_latent_length(audio_latent, video_latent, rate, "TDP Upscale")
        positive_contexts = conditioning_contexts(positive, "positive")
        schedule, tile_counts = parse_sigmas(sigmas, force_from_noise, pipeline), parse_tiles(tiles)
        if stage2_parallel == "sp" and tile_counts is not None:
            raise ValueError(f"tiles {tiles!r} apply to stage2_parallel tdp only; set tiles to auto for sp")
        job, fields = FleetJob(unique_id, "TDP Upscale"), {}
        refined_video, refined_audio = job.call(
            api.upscale,
            spec,
            video_latent,
            api.audio_latent_for_fleet(audio_latent, video_latent, rate),
            positive_contexts,
            frame_rate=rate,
            seed=seed,
            sigmas=schedule,
            tiles=tile_counts,
            overlap=overlap,
            image=first_frame(image),
            force_from_noise=force_from_noise,
            pipeline=pipeline,
            parallel=stage2_parallel,
            fields=fields,
            dtype=handle["dtype"],
            sampler=None if sampler == FROM_RECIPE else sampler,
            **image_strengths(image, image_strength, last_image, last_image_strength),
        )
        node_note(unique_id, fields.get("plan", "stage 2"))  # the plan's reason already says what stage 2 does with the audio
        frames = pixel_geometry(*refined_video.shape[2:])[2]
        guiding = recipe(pipeline).guiding_frames(frames, image is not None, last_image is not None)
        if fields.get("stage2_parallel") == "sp":
            return (make_av_latent(refined_video, api.audio_latent_for_comfy(refined_audio, frames, rate), rate, stages=2, guiding_frames=guiding),)  # denoised over the whole latent: faithful
        # TDP must not change the audio (its audio is context only). Reusing the input tensor makes
        # that exact, whatever precision the round trip through the fleet used.
        return (make_av_latent(refined_video, audio_latent, rate, stages=2, guiding_frames=guiding),)
