"""The request schema of the LTX-2 jobs: the model spec, one typed request per job, and THE defaults.

Every LTX-2 job of the fleet (load, encode, sample, upscale, decode, unload) takes exactly one of
the frozen request types below. A request is built on the client side (ComfyUI nodes, ``api``, the
CLI), sent as ``to_wire()``'s plain JSON, and read back on every rank with ``from_wire(dict)``, which
checks types and ranges and says what was wrong and what to do. A field a job leaves out gets the
official default of its model version and pipeline, in ``DEFAULTS``: the version's official
parameters (``VERSION_PARAMS``) with its recipe's schedule and guidance (``recipes.RECIPES``, where
each pipeline is declared); everything else in the pack (jobs, api, CLI flags, node widgets) reads
its defaults here. The model version is the
checkpoint's own (``ModelSpec.model_version``: its ``model_version`` metadata, read from the file
header by ``safetensors_header`` as ltx-pipelines' ``detect_params`` reads it); a request that names
a version only checks it (``request_model_version``).

The torch-free facts and input checks the ComfyUI side needs before it queues anything (latent
channels and compression, frame counts, sizes, sigma schedules) live here too, so that the ComfyUI
process never imports the model code.

This module must never import torch, ltx_core, ltx_pipelines or anything that does, and never
writes files: the embedded tiny bundle is named symbolically (``EMBEDDED_TINY``) and made or found
by the ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from mgpu_backend.ltx.recipes import (  # noqa: F401 - the recipes' schedules are named here too
    DEFAULT_RECIPE,
    DISTILLED_LORA_STRENGTH,
    DISTILLED_SIGMAS,
    RECIPE_NAMES,
    RECIPES,
    STAGE_2_SIGMAS,
    STEPPERS,
    TDP_UPSCALE_SIGMAS,
    Recipe,
    UnknownRecipe,
    UnsupportedModelVersion,
    recipe,
)
from mgpu_backend.ltx.safetensors_header import ModelFileError, checkpoint_model_version

# --- Facts of the LTX-2 latent space --------------------------------------------------------------

VIDEO_LATENT_CHANNELS = 128  # ltx_pipelines.utils.constants.VIDEO_LATENT_CHANNELS
VIDEO_SPATIAL_COMPRESSION = 32  # ltx_core.types.SpatioTemporalScaleFactors.default(): width = height = 32
VIDEO_TEMPORAL_COMPRESSION = 8  # SpatioTemporalScaleFactors.default(): time = 8 (plus the first frame alone)

MODEL_VERSIONS = ("2.0", "2.3")
"""LTX-2.0 (19B) and LTX-2.3 (22B), as the checkpoint's ``model_version`` metadata names them."""
PIPELINES = RECIPE_NAMES
"""The recipes' wire names (``recipes.RECIPES``): the requests' ``pipeline``."""
DTYPES = ("bfloat16", "float32", "float16")
GEMMA_MODES = ("sharded", "batch_parallel")
PARALLEL_PLANS = ("auto", "sp", "guidance", "hybrid")
QUANTIZATIONS = ("fp8-cast",)
"""How the transformer's weights may be held besides the load dtype (``None``): ``fp8-cast`` keeps them
in float8 and upcasts per layer, as the official ``--quantization fp8-cast``."""
RESIDENCY_POLICIES = ("auto", "all", "minimal", "sharded")
"""Which components stay on the GPU between jobs: what fits, everything, the transformer only, or
the transformer's weights sharded over the fleet's GPUs (1/N each, gathered block by block)."""
STAGE2_PLANS = ("auto", "sp", "tdp")
"""Stage 2 over the fleet: sequence parallel (faithful, audio denoised), tiled data parallel (audio
frozen), or the planner's choice (``guidance_parallel.plan_stage2``)."""
AFTER_STAGES = (0, 1, 2)  # stages that drew noise from the job's generator before the decoder

SEED_MAX = 2**63 - 1  # the ranks seed torch generators with a signed 64-bit value
MAX_SIDE = 8192
MAX_FRAMES = 100_000
MAX_STEPS = 1000
MIN_FRAME_RATE, MAX_FRAME_RATE = 1.0, 240.0
MAX_PROMPTS = 16
MAX_PROMPT_CHARS = 20_000

EMBEDDED_TINY = "embedded:tiny"
"""A model spec path that names the embedded tiny random-weight bundle: the ranks make it (or find it
in their cache) and put the real paths in place, so that the ComfyUI process writes no model file."""
EMBEDDED_TINY_2_3 = "embedded:tiny-2.3"
"""The same for the embedded tiny LTX-2.3 bundle (the 22B layout)."""
EMBEDDED_TINY_DISTILLED = "embedded:tiny-distilled"
EMBEDDED_TINY_2_3_DISTILLED = "embedded:tiny-2.3-distilled"
"""Checkpoint paths that name an embedded tiny bundle's distilled checkpoint (its own weights, the
dev checkpoint's layout), resolved on the ranks like the bundle's other files."""
EMBEDDED_DISTILLED_CHECKPOINTS = {"2.0": EMBEDDED_TINY_DISTILLED, "2.3": EMBEDDED_TINY_2_3_DISTILLED}
_EMBEDDED_CHECKPOINTS = {"checkpoint_path": {"2.0": EMBEDDED_TINY, "2.3": EMBEDDED_TINY_2_3}, "distilled_checkpoint_path": EMBEDDED_DISTILLED_CHECKPOINTS}
"""The embedded name of each tiny bundle checkpoint (a recipe's ``checkpoint.tiny_file``), per version."""
EMBEDDED_TINY_VERSIONS = {EMBEDDED_TINY: "2.0", EMBEDDED_TINY_2_3: "2.3", EMBEDDED_TINY_DISTILLED: "2.0", EMBEDDED_TINY_2_3_DISTILLED: "2.3"}
"""Every embedded name and the model version of the bundle its file belongs to."""

CONTEXT_MISSING = "context missing"
"""Start of the job error a rank raises when a request names a prompt digest it does not hold (the
fleet restarted, or the cache let it go); the client then resends the contexts it kept."""

PROMPT_CACHE_ENTRIES = 32
"""Prompt encodings each rank keeps by digest (least recently used go first)."""

PREVIEW_EVERY = 1
"""Live previews of the denoising stages: one every this many steps (and the last), where the caller
wants previews; a request's ``preview_every`` of 0 (its default) sends none."""
MAX_PREVIEW_EVERY = MAX_STEPS


class RequestError(ValueError):
    """A job argument that cannot be used; the message names it and says what to do."""


def parse_quantization(value) -> str | None:
    """The ``quantization`` option, checked: None or one of ``QUANTIZATIONS``."""
    if value is None or value in QUANTIZATIONS:
        return value
    allowed = ", ".join(repr(name) for name in QUANTIZATIONS)
    raise ModelFileError(
        f"quantization must be null (weights in the load dtype) or one of {allowed}, got {value!r}; "
        "'fp8-cast' keeps the transformer in float8 (about half the memory), as the official --quantization fp8-cast"
    )


def parse_residency(value) -> str:
    """The ``residency`` option, checked: one of ``RESIDENCY_POLICIES``."""
    if value in RESIDENCY_POLICIES:
        return value
    raise ModelFileError(
        f"residency must be one of {', '.join(RESIDENCY_POLICIES)}, got {value!r}: 'auto' keeps what fits, "
        "'all' keeps every component on the GPU, 'minimal' keeps only the transformer, 'sharded' spreads the "
        "transformer's weights over the GPUs"
    )


# --- Field readers: one message style for every request -------------------------------------------


def integer_field(data: dict, name: str, default: int, low: int, high: int) -> int:
    value = data.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"{name} must be an integer from {low} to {high}, got {value!r}; leave it out for the default {default}")
    return value


def number_field(data: dict, name: str, default: float, low: float = -math.inf, high: float = math.inf) -> float:
    value = data.get(name, default)
    if value is None:
        value = default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise RequestError(f"{name} must be a number from {low} to {high}, got {value!r}; leave it out for the default {default}")
    return float(value)


def _choice(data: dict, name: str, default, choices: Sequence):
    value = data.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or value not in choices:
        raise RequestError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def _sampler(data: dict) -> str | None:
    """A request's ``sampler``: one of the steppers the recipes declare, or None for the recipe's own."""
    value = data.get("sampler")
    if value is not None and (not isinstance(value, str) or value not in STEPPERS):
        raise RequestError(f"sampler must be one of {', '.join(STEPPERS)} (or left out for the recipe's own), got {value!r}")
    return value


def _flag(data: dict, name: str, default: bool | None) -> bool | None:
    value = data.get(name, default)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}" + ("" if default is None else f"; the default is {str(default).lower()}"))
    return value


def _digest(data: dict, name: str) -> str | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise RequestError(f"{name} must be the 64-hex-digit digest the encode job returned, got {value!r}; encode the prompt again")
    return value


def _floats(value, name: str) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise RequestError(f"{name} must be a list of numbers, got {value!r}")
    return tuple(float(v) for v in value)


def _no_unknown_fields(data: dict, cls: type, what: str) -> None:
    if not isinstance(data, dict):
        raise RequestError(f"a {what} request must be a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RequestError(f"unknown {what} field(s) {unknown}; the {what} job takes {sorted(known)}")


# --- Checks before any work (torch-free: the nodes run them before queueing) -----------------------


def _nearest_multiple(value: int, multiple: int) -> int:
    """The closest positive multiple (ties go up)."""
    return max(multiple, (value + multiple // 2) // multiple * multiple)


def nearest_valid_frame_count(num_frames: int) -> int:
    """The closest 8k+1 frame count (ties go up), from 1 to the largest 8k+1 <= ``MAX_FRAMES``."""
    below = max(1, (num_frames - 1) // 8 * 8 + 1)
    above = below + 8
    nearest = below if num_frames - below < above - num_frames else above
    return min(nearest, (MAX_FRAMES - 1) // VIDEO_TEMPORAL_COMPRESSION * VIDEO_TEMPORAL_COMPRESSION + 1)


def validate_generation(
    height: int,
    width: int,
    num_frames: int,
    two_stage: bool = True,
    num_inference_steps: int | None = None,
    frame_rate: float | None = None,
    seed: int | None = None,
) -> None:
    """Raise ``RequestError`` (a ValueError) for a size, frame count, step count, frame rate or seed LTX-2 cannot run.

    ``height`` and ``width`` are the final video size: multiples of 64 for the two-stage graph
    (stage 1 runs at half size on a 32-pixel latent grid), of 32 for stage 1 alone. Every message
    speaks of the final size, whatever stage the limit comes from.
    """
    for name, value in (("height", height), ("width", width), ("num_frames", num_frames)):
        if isinstance(value, bool) or int(value) != value or value <= 0:
            raise RequestError(f"{name} must be a positive whole number, got {value}")
    largest_frames = nearest_valid_frame_count(MAX_FRAMES)
    if num_frames > MAX_FRAMES:
        raise RequestError(f"frames must be 8k+1 from 1 to {largest_frames}, got {num_frames}; use {largest_frames} or fewer")
    if num_frames % VIDEO_TEMPORAL_COMPRESSION != 1:
        raise RequestError(
            f"frames must be 8k+1 (the video VAE packs 8 frames per latent frame after the first), "
            f"got {num_frames}; use {nearest_valid_frame_count(num_frames)}"
        )
    multiple = 2 * VIDEO_SPATIAL_COMPRESSION if two_stage else VIDEO_SPATIAL_COMPRESSION
    graph = "the two-stage graph (stage 1 runs at half size)" if two_stage else "a single stage"
    largest_side = (2 if two_stage else 1) * MAX_SIDE  # stage 1's limit, in the final video's pixels
    for name, value in (("height", height), ("width", width)):
        if value > largest_side:
            raise RequestError(f"{name} must be at most {largest_side} for {graph}, got {value}; use {largest_side} or less")
        if value % multiple != 0:
            raise RequestError(
                f"{name} must be a multiple of {multiple} for {graph}, got {value}; "
                f"use {_nearest_multiple(value, multiple)}"
            )
    official = OFFICIAL
    if num_inference_steps is not None:
        if isinstance(num_inference_steps, bool) or int(num_inference_steps) != num_inference_steps or num_inference_steps < 1:
            raise RequestError(f"steps must be a whole number >= 1, got {num_inference_steps}; the official default is {official.steps}")
        if num_inference_steps > MAX_STEPS:
            raise RequestError(f"steps must be at most {MAX_STEPS}, got {num_inference_steps}; the official default is {official.steps}")
    if frame_rate is not None:
        if not frame_rate > 0:
            raise RequestError(f"frame rate must be positive, got {frame_rate:g}; the official default is {official.frame_rate:g}")
        if not MIN_FRAME_RATE <= frame_rate <= MAX_FRAME_RATE:
            raise RequestError(
                f"frame rate must be from {MIN_FRAME_RATE:g} to {MAX_FRAME_RATE:g} frames per second, got {frame_rate:g}; "
                f"the official default is {official.frame_rate:g}"
            )
    if seed is not None and (isinstance(seed, bool) or int(seed) != seed or not 0 <= seed <= SEED_MAX):
        raise RequestError(f"seed must be a whole number from 0 to {SEED_MAX}, got {seed}; the official default is {official.seed}")


def validate_dtype_with_loras(dtype: str, distilled_lora: bool, user_loras: bool = False) -> None:
    """LoRAs (the distilled LoRA of stage 2 too) fuse only into bfloat16 or fp8 weights, as in ltx-core.

    Checked by the CLI and the loader node before any job; a load job in float32 stays allowed, since a
    stage-1-only graph never fuses the distilled LoRA (the ranks refuse the fusion itself in words)."""
    if dtype == "bfloat16" or not (distilled_lora or user_loras):
        return
    which = "the distilled LoRA (stage 2 of the two-stage job fuses it)" if distilled_lora else "LoRAs"
    raise RequestError(
        f"dtype {dtype} cannot be used with {which}: ltx-core fuses LoRAs only into bfloat16 (or fp8-cast) weights; "
        "use dtype bfloat16 (optionally with quantization fp8-cast), or a model without LoRAs"
    )


def decoded_video_bytes(height: int, width: int, num_frames: int) -> int:
    """Bytes of the decoded video as it leaves the fleet: ComfyUI's IMAGE, [frames, H, W, 3] float32."""
    return num_frames * height * width * 3 * 4


def audio_sample_count(num_frames: int, frame_rate: float, sample_rate: int) -> int:
    """Waveform samples that last as long as ``num_frames`` video frames at ``frame_rate``."""
    return round(num_frames * sample_rate / frame_rate)


def validate_sigmas(sigmas: Iterable[float]) -> tuple[float, ...]:
    """A refinement schedule: at least two values in [0, 1], strictly decreasing; returned as floats.

    Takes any sequence of numbers (a torch tensor too, through ``tolist``)."""
    values = [float(v) for v in (sigmas.flatten().tolist() if hasattr(sigmas, "flatten") else sigmas)]
    example = ", ".join(map(str, STAGE_2_SIGMAS))
    if len(values) < 2:
        raise RequestError(f"sigmas need at least two values (start and end), got {values}; e.g. {example}")
    if any(not 0.0 <= v <= 1.0 for v in values):
        raise RequestError(f"sigmas must lie in [0, 1], got {values}")
    if any(later >= earlier for earlier, later in zip(values, values[1:], strict=False)):
        raise RequestError(f"sigmas must decrease strictly, got {values}; e.g. {example}")
    return tuple(values)


def validate_stage1_sigmas(sigmas: Sequence[float]) -> tuple[float, ...]:
    """A stage-1 schedule of the user's (ComfyUI's ManualSigmas, ``--stage1-sigmas``): valid, from pure
    noise (1.0, where stage 1 starts) down to a clean latent (0.0), at most ``MAX_STEPS`` steps."""
    values = validate_sigmas(sigmas)
    if values[0] != 1.0 or values[-1] != 0.0:
        raise RequestError(
            f"stage-1 sigmas must run from 1.0 (stage 1 starts from pure noise) down to 0.0 (a clean latent), got "
            f"{values[0]:g} ... {values[-1]:g}; e.g. the distilled schedule {', '.join(map(str, DISTILLED_SIGMAS))}"
        )
    if len(values) - 1 > MAX_STEPS:
        raise RequestError(f"stage-1 sigmas hold {len(values) - 1} steps, more than {MAX_STEPS}; use fewer")
    return values


def validate_upscale_sigmas(sigmas: Sequence[float], force_from_noise: bool) -> None:
    """A TDP Upscale schedule: valid, and not from pure noise (sigma 1.0) unless forced."""
    validate_sigmas(sigmas)
    if sigmas[0] >= 1.0 and not force_from_noise:
        default = ", ".join(map(str, TDP_UPSCALE_SIGMAS))
        raise RequestError(
            f"TDP Upscale refuses to start from pure noise: the sigmas start at {sigmas[0]} (pure noise), so each tile "
            "would denoise on its own and the tiles would not agree on one video. Generate stage 1 with the SP Sampler "
            f"and upscale that (default sigmas {default}), or set force_from_noise only to study the failure"
        )


IMAGE_STRENGTH = 1.0  # a conditioning image kept clean (the official --image default strength)
IMAGE_INPUTS = {  # each image strength field: the input of its image, and where that image conditions
    "image_strength": ("image", "first frame"),
    "last_image_strength": ("last_image", "last frame"),
}


def validate_image_strengths(image_strength: float, last_image_strength: float, spelled: dict | None = None) -> None:
    """Each image strength is a number in [0, 1] (1.0: the image kept clean; 0.0: denoised like the rest);
    ``spelled`` as in ``check_image_strengths``."""
    for name, value in (("image_strength", image_strength), ("last_image_strength", last_image_strength)):
        name = (spelled or {}).get(name, name)
        number_field({name: value}, name, IMAGE_STRENGTH, 0.0, 1.0)


def check_image_strengths(image_strength: float, last_image_strength: float, has_image: bool, has_last_image: bool, spelled: dict | None = None) -> None:
    """Refuse a strength set for an image that is not there (it would be ignored), in words; ``spelled``
    names the inputs as the caller's user knows them (the CLI's flags), by field name."""
    validate_image_strengths(image_strength, last_image_strength, spelled)
    spelled = spelled or {}
    for name, strength, given in (("image_strength", image_strength, has_image), ("last_image_strength", last_image_strength, has_last_image)):
        image, where = IMAGE_INPUTS[name]
        name, image = spelled.get(name, name), spelled.get(image, image)
        if strength != IMAGE_STRENGTH and not given:
            raise RequestError(
                f"{name} is {strength} but no {image} was given: it is the strength of the {where} image; "
                f"give the {image} too, or leave {name} at {IMAGE_STRENGTH}"
            )


def validate_stg_blocks(guidance, layer_count: int | None, modality: str) -> None:
    """STG perturbs transformer blocks by index; an index past the model would silently do nothing.

    ``guidance``: anything with ``stg_scale`` and ``stg_blocks`` (a ``Guidance``, ltx-core's params)."""
    if layer_count is None or not guidance.stg_scale or not guidance.stg_blocks:
        return
    outside = [block for block in guidance.stg_blocks if not 0 <= block < layer_count]
    if outside:
        raise RequestError(
            f"{modality} stg_blocks {list(guidance.stg_blocks)} name blocks {outside} outside this model's "
            f"{layer_count} transformer blocks (0..{layer_count - 1}); use blocks in that range "
            f"(the official LTX-2 default [29] is for the 48-block model), or set the {modality} stg scale to 0"
        )


def pixel_geometry(latent_frames: int, latent_height: int, latent_width: int) -> tuple[int, int, int]:
    """Pixel (height, width, frames) of a video latent grid: 32x spatial, 8x temporal (+1) compression."""
    return (
        latent_height * VIDEO_SPATIAL_COMPRESSION,
        latent_width * VIDEO_SPATIAL_COMPRESSION,
        (latent_frames - 1) * VIDEO_TEMPORAL_COMPRESSION + 1,
    )


def embedded_tiny_name(version: str) -> str:
    """The model spec path that names the embedded tiny bundle of LTX-``version``."""
    for name in (EMBEDDED_TINY, EMBEDDED_TINY_2_3):
        if EMBEDDED_TINY_VERSIONS[name] == version:
            return name
    raise ModelFileError(f"there is no embedded tiny bundle of LTX-{version}; choose one of {', '.join(MODEL_VERSIONS)}")


# --- The model spec ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """The files of one LTX-2 model and how each GPU holds them (``quantization``, ``residency``).
    Small and JSON-able: it travels in the MGPU model handle, so every job names the same model.

    A path may be ``EMBEDDED_TINY`` (or ``EMBEDDED_TINY_2_3``): the embedded tiny bundle's file of that
    role, resolved on the ranks (``resolve_embedded``). ``model_version`` is the checkpoint's own."""

    checkpoint_path: str
    gemma_root: str
    spatial_upsampler_path: str | None = None
    distilled_lora: str | None = None
    distilled_lora_strength: float = DISTILLED_LORA_STRENGTH
    loras: tuple[tuple[str, float], ...] = ()
    quantization: str | None = None
    residency: str = "auto"
    # The distilled LoRA's strength in each stage, for the recipes whose LoRA sets read them (the HQ
    # recipe: both, not distilled_lora_strength; the two-stage recipe: stage 1). None: the recipe's
    # own (recipes.LORA_SETS: HQ 0.25 / 0.5 as its official runner; two-stage: no LoRA in stage 1).
    distilled_lora_strength_stage_1: float | None = None
    distilled_lora_strength_stage_2: float | None = None

    @classmethod
    def embedded_tiny(cls, spatial_upsampler: bool = True, distilled_lora: bool = True, distilled_lora_strength: float = DISTILLED_LORA_STRENGTH,
                      version: str = "2.0") -> ModelSpec:  # fmt: skip
        """The embedded tiny random-weight bundle of LTX-``version``, named symbolically (nothing is written here)."""
        name = embedded_tiny_name(version)
        return cls(
            checkpoint_path=name,
            gemma_root=name,
            spatial_upsampler_path=name if spatial_upsampler else None,
            distilled_lora=name if distilled_lora else None,
            distilled_lora_strength=distilled_lora_strength,
        )

    @classmethod
    def embedded_tiny_for(cls, pipeline: str, version: str = "2.0") -> ModelSpec:
        """The embedded tiny bundle of LTX-``version`` as ``pipeline`` loads it: the files its recipe
        declares (the two-stage recipe: the dev checkpoint and the distilled LoRA; the distilled recipe:
        the distilled checkpoint, no LoRA)."""
        declared = recipe(pipeline)
        fields = {file.spec_field for file in declared.files}
        spec = cls.embedded_tiny(spatial_upsampler="spatial_upsampler_path" in fields, distilled_lora="distilled_lora" in fields, version=version)
        return replace(spec, checkpoint_path=_EMBEDDED_CHECKPOINTS[declared.checkpoint.tiny_file][version])

    def _paths(self) -> tuple[str | None, ...]:
        return (self.checkpoint_path, self.gemma_root, self.spatial_upsampler_path, self.distilled_lora, *(path for path, _ in self.loras))

    @property
    def names_embedded(self) -> bool:
        return any(path in EMBEDDED_TINY_VERSIONS for path in self._paths())

    @property
    def embedded_version(self) -> str | None:
        """The model version of the embedded tiny bundle this spec names (None: it names none).
        A spec naming the tiny bundles of both versions is refused: their files do not fit each other."""
        versions = {EMBEDDED_TINY_VERSIONS[path] for path in self._paths() if path in EMBEDDED_TINY_VERSIONS}
        if len(versions) > 1:
            raise ModelFileError(
                f"the model spec names both embedded tiny bundles ({EMBEDDED_TINY!r} is LTX-2.0, {EMBEDDED_TINY_2_3!r} is "
                "LTX-2.3); their files do not fit each other: name one of them for every file"
            )
        return versions.pop() if versions else None

    def resolve_embedded(self, bundle) -> ModelSpec:
        """This spec with every embedded path replaced by the file of ``bundle`` (a ``TinyBundle``:
        ``version``, ``checkpoint_path``, ``gemma_root``, ``spatial_upsampler_path``,
        ``distilled_lora_path``, ``distilled_checkpoint_path`` for a distilled name), which must be the
        bundle of the version the spec names. The embedded checkpoints only work with their own Gemma,
        and the other way round."""
        version = self.embedded_version
        if version is None:
            return self
        name = embedded_tiny_name(version)
        assert bundle.version == version, (bundle.version, version)
        if (self.checkpoint_path in EMBEDDED_TINY_VERSIONS) != (self.gemma_root == name):
            raise ModelFileError(
                "the embedded tiny checkpoint only works with its own text encoder: name both checkpoint_path and "
                f"gemma_root {name!r}, or real files for both"
            )

        def resolved(path, real):
            return real if path == name else path

        checkpoint = bundle.distilled_checkpoint_path if self.checkpoint_path in EMBEDDED_DISTILLED_CHECKPOINTS.values() else bundle.checkpoint_path
        return replace(
            self,
            checkpoint_path=checkpoint if self.checkpoint_path in EMBEDDED_TINY_VERSIONS else self.checkpoint_path,
            gemma_root=resolved(self.gemma_root, bundle.gemma_root),
            spatial_upsampler_path=resolved(self.spatial_upsampler_path, bundle.spatial_upsampler_path),
            distilled_lora=resolved(self.distilled_lora, bundle.distilled_lora_path),
        )

    @property
    def model_version(self) -> str:
        """The LTX-2 version of this spec's checkpoint: the embedded bundle's, or read from the
        checkpoint file's ``model_version`` metadata (header only, no torch)."""
        if self.checkpoint_path in EMBEDDED_TINY_VERSIONS:
            return EMBEDDED_TINY_VERSIONS[self.checkpoint_path]
        return checkpoint_model_version(self.checkpoint_path)

    def to_wire(self) -> dict:
        return {
            "checkpoint_path": self.checkpoint_path,
            "gemma_root": self.gemma_root,
            "spatial_upsampler_path": self.spatial_upsampler_path,
            "distilled_lora": self.distilled_lora,
            "distilled_lora_strength": self.distilled_lora_strength,
            "loras": [[path, strength] for path, strength in self.loras],
            "quantization": self.quantization,
            "residency": self.residency,
            "distilled_lora_strength_stage_1": self.distilled_lora_strength_stage_1,
            "distilled_lora_strength_stage_2": self.distilled_lora_strength_stage_2,
        }

    to_json = to_wire

    @classmethod
    def from_wire(cls, data: dict) -> ModelSpec:
        """Parse ``to_wire``'s form, checking every type (not whether the files exist)."""
        if not isinstance(data, dict):
            raise ModelFileError(f"a model spec must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.__dataclass_fields__))
        if unknown:
            raise ModelFileError(f"unknown model spec field(s) {unknown}; expected {sorted(cls.__dataclass_fields__)}")
        for name in ("checkpoint_path", "gemma_root"):
            if not isinstance(data.get(name), str) or not data[name]:
                raise ModelFileError(f"model spec field {name!r} must be a non-empty path string, got {data.get(name)!r}")
        for name in ("spatial_upsampler_path", "distilled_lora"):
            if data.get(name) is not None and (not isinstance(data[name], str) or not data[name]):
                raise ModelFileError(f"model spec field {name!r} must be a path string or null, got {data[name]!r}")
        strengths = {}
        for name in ("distilled_lora_strength", "distilled_lora_strength_stage_1", "distilled_lora_strength_stage_2"):
            strength = data.get(name, cls.__dataclass_fields__[name].default)
            if strength is None and cls.__dataclass_fields__[name].default is None:
                strengths[name] = None  # the recipe's own
                continue
            if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
                raise ModelFileError(f"model spec field {name!r} must be a number, got {strength!r}")
            strengths[name] = float(strength)
        loras = data.get("loras", [])
        if not isinstance(loras, (list, tuple)):
            raise ModelFileError(f"model spec field 'loras' must be a list of [path, strength], got {loras!r}")
        parsed_loras = []
        for entry in loras:
            if (
                not isinstance(entry, (list, tuple))
                or len(entry) != 2
                or not isinstance(entry[0], str)
                or isinstance(entry[1], bool)
                or not isinstance(entry[1], (int, float))
            ):
                raise ModelFileError(f"each LoRA must be [path, strength], got {entry!r}")
            parsed_loras.append((entry[0], float(entry[1])))
        return cls(
            checkpoint_path=data["checkpoint_path"],
            gemma_root=data["gemma_root"],
            spatial_upsampler_path=data.get("spatial_upsampler_path"),
            distilled_lora=data.get("distilled_lora"),
            **strengths,
            loras=tuple(parsed_loras),
            quantization=parse_quantization(data.get("quantization")),
            residency=parse_residency(data.get("residency", "auto")),
        )

    def check_files_exist(self) -> None:
        """Raise ModelFileError naming the first file or folder that is not there."""
        files = [("checkpoint", self.checkpoint_path)]
        if self.spatial_upsampler_path is not None:
            files.append(("spatial upsampler", self.spatial_upsampler_path))
        if self.distilled_lora is not None:
            files.append(("distilled LoRA", self.distilled_lora))
        files += [("LoRA", path) for path, _ in self.loras]
        for role, path in files:
            if path not in EMBEDDED_TINY_VERSIONS and not Path(path).is_file():
                raise ModelFileError(f"{role} file {path} does not exist; check the path (or download the file there)")
        if self.gemma_root not in EMBEDDED_TINY_VERSIONS and not Path(self.gemma_root).is_dir() and not Path(self.gemma_root).is_file():
            raise ModelFileError(
                f"Gemma folder {self.gemma_root} does not exist (nor a file of that name); point gemma_root at the "
                "Gemma-3 Hugging Face folder (config.json, model*.safetensors, tokenizer.model) or at ComfyUI's single "
                "file (models/text_encoders/gemma_3_12B_it.safetensors)"
            )


# --- Guidance and THE defaults ------------------------------------------------------------------------


@dataclass(frozen=True)
class Guidance:
    """Multimodal guidance of one modality, as ltx-core's ``MultiModalGuiderParams``.

    A field left as None takes the default of the request's model version and pipeline. ``stg_blocks``
    None means the version's official block, or the last block of a model that has fewer (the tiny
    test bundle); ``()`` perturbs no block.
    """

    cfg_scale: float | None = None
    stg_scale: float | None = None
    rescale_scale: float | None = None
    modality_scale: float | None = None
    skip_step: int | None = None
    stg_blocks: tuple[int, ...] | None = None

    def over(self, default: Guidance) -> Guidance:
        """This guidance with every field it leaves out taken from ``default`` (``stg_blocks``
        stays None: the job clips the official block to the model it runs)."""
        return Guidance(**{f.name: getattr(default, f.name) if getattr(self, f.name) is None and f.name != "stg_blocks" else getattr(self, f.name) for f in fields(self)})

    def blocks_for(self, layer_count: int, official: Guidance) -> tuple[int, ...]:
        """The blocks STG perturbs in a model of ``layer_count`` blocks."""
        if self.stg_blocks is not None:
            return self.stg_blocks
        return tuple(min(block, layer_count - 1) for block in official.stg_blocks)

    def to_wire(self) -> dict:
        wire = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stg_blocks" and getattr(self, f.name) is not None}
        wire["stg_blocks"] = None if self.stg_blocks is None else list(self.stg_blocks)
        return wire

    to_json = to_wire

    @classmethod
    def from_wire(cls, data, name: str, default: Guidance) -> Guidance:
        """Parse one modality's guidance object; the fields it leaves out come from ``default``."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise RequestError(f"{name} must be an object of guidance scales, got {data!r}")
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise RequestError(f"unknown {name} field(s) {unknown}; guidance takes {[f.name for f in fields(cls)]}")
        blocks = data.get("stg_blocks")
        if blocks is not None and (not isinstance(blocks, (list, tuple)) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)):
            raise RequestError(f"{name}.stg_blocks must be a list of block indices, or null for the official block")
        return cls(
            cfg_scale=number_field(data, "cfg_scale", default.cfg_scale, 0.0, 100.0),
            stg_scale=number_field(data, "stg_scale", default.stg_scale, 0.0, 100.0),
            rescale_scale=number_field(data, "rescale_scale", default.rescale_scale, 0.0, 1.0),
            modality_scale=number_field(data, "modality_scale", default.modality_scale, 0.0, 100.0),
            skip_step=integer_field(data, "skip_step", default.skip_step, 0, 1000),
            stg_blocks=None if blocks is None else tuple(blocks),
        )


@dataclass(frozen=True)
class PipelineDefaults:
    """The official defaults of one model version and pipeline (sizes are stage 1's, in pixels)."""

    model_version: str
    pipeline: str
    seed: int
    stage1_height: int
    stage1_width: int
    num_frames: int
    frame_rate: float
    steps: int
    video_guidance: Guidance
    audio_guidance: Guidance
    stage1_sigmas: tuple[float, ...] | None  # None: ltx-core's LTX2Scheduler over ``steps``
    stage2_sigmas: tuple[float, ...]


TDP_OVERLAP = 4  # latent cells between neighbouring tiles (docs/techniques.md)
# ltx_core.model.video_vae.TilingConfig.default(): 512-pixel tiles, 64-frame chunks.
DECODE_SPATIAL_TILE_PIXELS = 512
DECODE_TEMPORAL_TILE_FRAMES = 64

# The model versions' official parameters, before a recipe's own (``_recipe_defaults``).
_LTX_2_0_PARAMS = PipelineDefaults(
    model_version="2.0",
    pipeline="",
    # ltx_pipelines.utils.constants.LTX_2_PARAMS (PipelineParams' own defaults):
    seed=10,
    stage1_height=512,
    stage1_width=768,
    num_frames=121,
    frame_rate=24.0,
    steps=40,
    video_guidance=Guidance(cfg_scale=3.0, stg_scale=1.0, rescale_scale=0.7, modality_scale=3.0, skip_step=0, stg_blocks=(29,)),
    audio_guidance=Guidance(cfg_scale=7.0, stg_scale=1.0, rescale_scale=0.7, modality_scale=3.0, skip_step=0, stg_blocks=(29,)),
    stage1_sigmas=None,  # the recipe's
    stage2_sigmas=(),  # the recipe's
)
# ltx_pipelines.utils.constants.LTX_2_3_PARAMS: LTX_2_PARAMS with 30 steps and STG on block 28.
_LTX_2_3_PARAMS = replace(
    _LTX_2_0_PARAMS,
    model_version="2.3",
    steps=30,
    video_guidance=replace(_LTX_2_0_PARAMS.video_guidance, stg_blocks=(28,)),
    audio_guidance=replace(_LTX_2_0_PARAMS.audio_guidance, stg_blocks=(28,)),
)
VERSION_PARAMS = {"2.0": _LTX_2_0_PARAMS, "2.3": _LTX_2_3_PARAMS}
# ltx_pipelines.utils.constants.LTX_2_3_HQ_PARAMS: 15 steps, a 544x960 stage 1 (1088x1920 out), CFG and
# modality guidance with no STG.
_LTX_2_3_HQ_PARAMS = replace(
    _LTX_2_3_PARAMS,
    steps=15,
    stage1_height=1088 // 2,
    stage1_width=1920 // 2,
    video_guidance=Guidance(cfg_scale=3.0, stg_scale=0.0, rescale_scale=0.45, modality_scale=3.0, skip_step=0, stg_blocks=()),
    audio_guidance=Guidance(cfg_scale=7.0, stg_scale=0.0, rescale_scale=1.0, modality_scale=3.0, skip_step=0, stg_blocks=()),
)
OFFICIAL_PARAMS = {
    "ltx_pipelines.utils.constants.LTX_2_PARAMS": _LTX_2_0_PARAMS,
    "ltx_pipelines.utils.constants.LTX_2_3_PARAMS": _LTX_2_3_PARAMS,
    "ltx_pipelines.utils.constants.LTX_2_3_HQ_PARAMS": _LTX_2_3_HQ_PARAMS,
}
"""The official parameter sets a recipe names (``Recipe.official_params``), by their ltx-pipelines name."""
# An unguided recipe (ltx_pipelines.distilled): one positive-only pass per step (simple_denoising_func:
# no guidance, which is ltx-core's MultiModalGuiderParams() as it comes).
NO_GUIDANCE = Guidance(cfg_scale=1.0, stg_scale=0.0, rescale_scale=0.0, modality_scale=1.0, skip_step=0, stg_blocks=())


def _recipe_defaults(version_params: PipelineDefaults, declared: Recipe) -> PipelineDefaults:
    """A recipe's defaults on a model version: the version's official parameters, with the recipe's
    stage-1 schedule (fixed sigmas fix the step count), guidance and stage-2 schedule."""
    video, audio = (version_params.video_guidance, version_params.audio_guidance) if declared.guided else (NO_GUIDANCE, NO_GUIDANCE)
    return replace(
        version_params, pipeline=declared.name, steps=version_params.steps if declared.fixed_steps is None else declared.fixed_steps,
        video_guidance=video, audio_guidance=audio, stage1_sigmas=declared.stage1.sigmas, stage2_sigmas=declared.stage2.sigmas,
    )  # fmt: skip


DEFAULTS: dict[tuple[str, str], PipelineDefaults] = {
    (version, declared.name): _recipe_defaults(OFFICIAL_PARAMS[dict(declared.official_params)[version]], declared)
    for version in MODEL_VERSIONS
    for declared in RECIPES.values()
    if version in declared.versions
}
"""The defaults of each model version and recipe its official runner supports."""


def recipe_of(pipeline: str) -> Recipe:
    """``recipes.recipe`` for a request: an unknown pipeline is a ``RequestError``."""
    try:
        return recipe(pipeline)
    except UnknownRecipe as error:
        raise RequestError(str(error)) from None


def defaults_for(model_version: str = "2.0", pipeline: str = DEFAULT_RECIPE) -> PipelineDefaults:
    """THE defaults of one model version and pipeline."""
    if model_version not in MODEL_VERSIONS:
        raise RequestError(f"model_version must be one of {', '.join(MODEL_VERSIONS)}, got {model_version!r}")
    declared = recipe_of(pipeline)
    try:
        declared.check_version(model_version)
    except UnsupportedModelVersion as error:
        raise RequestError(str(error)) from None
    return DEFAULTS[(model_version, declared.name)]


def stage2_default_sigmas(pipeline: str) -> tuple[float, ...]:
    """Stage 2's default schedule, the recipe's ``upscale_sigmas``: the distilled recipe runs the
    official 3-step tail (its stage 2 is part of the recipe); the two-stage graph's TDP Upscale starts
    lower (``TDP_UPSCALE_SIGMAS``)."""
    return recipe_of(pipeline).upscale_sigmas


OFFICIAL = defaults_for()
"""The LTX-2.0 two-stage defaults: what the running jobs use today."""


def request_model_version(spec: ModelSpec, asked: str | None = None) -> str:
    """The model version a request runs: its checkpoint's (``ModelSpec.model_version``), whatever the
    pipeline. ``asked`` (a request's or the CLI's ``model_version``) is only a check: a version that
    contradicts the checkpoint is refused. A checkpoint this process cannot read takes ``asked`` or
    2.0, as ``detect_params`` falls back; the ranks check that against the file they load."""
    if asked is not None and (isinstance(asked, bool) or asked not in MODEL_VERSIONS):
        raise RequestError(f"model_version must be one of {', '.join(MODEL_VERSIONS)}, got {asked!r}; leave it out to follow the checkpoint")
    try:
        found = spec.model_version
    except (ModelFileError, OSError):
        found = None
    if found is None:
        return asked or "2.0"
    if asked is not None and asked != found:
        raise RequestError(model_version_contradiction(asked, found, spec.checkpoint_path))
    return found


def model_version_contradiction(asked: str, found: str, checkpoint_path: str) -> str:
    return (
        f"model_version {asked} contradicts the checkpoint {checkpoint_path}, which is LTX-{found} (its model_version "
        f"metadata); leave model_version out to use LTX-{found}'s defaults, or choose an LTX-{asked} checkpoint"
    )


# --- Requests -----------------------------------------------------------------------------------------


def _spec_of(data: dict, what: str) -> ModelSpec:
    if not isinstance(data.get("spec"), dict):
        raise RequestError(f"the {what} job needs a model 'spec' object (see ModelSpec.to_wire)")
    return ModelSpec.from_wire(data["spec"])


@dataclass(frozen=True)
class LoadRequest:
    """Load every component of the model into every rank (a no-op for the resident model)."""

    spec: ModelSpec
    dtype: str = "bfloat16"

    op = "load"

    def to_wire(self) -> dict:
        return {"spec": self.spec.to_wire(), "dtype": self.dtype}

    @classmethod
    def from_wire(cls, data: dict) -> LoadRequest:
        _no_unknown_fields(data, cls, cls.op)
        return cls(spec=_spec_of(data, cls.op), dtype=_choice(data, "dtype", "bfloat16", DTYPES))


@dataclass(frozen=True)
class EncodeRequest:
    """Encode prompts with Gemma on the fleet; the ranks keep each result by its digest."""

    spec: ModelSpec
    prompts: tuple[str, ...]
    dtype: str = "bfloat16"
    gemma_mode: str = "sharded"
    free_gemma: bool = False

    op = "encode"

    def digests(self) -> list[str]:
        return [prompt_digest(prompt, self.spec, self.dtype, self.gemma_mode) for prompt in self.prompts]

    def to_wire(self) -> dict:
        return {"spec": self.spec.to_wire(), "prompts": list(self.prompts), "dtype": self.dtype, "gemma_mode": self.gemma_mode, "free_gemma": self.free_gemma}

    @classmethod
    def from_wire(cls, data: dict) -> EncodeRequest:
        _no_unknown_fields(data, cls, cls.op)
        prompts = data.get("prompts")
        if not isinstance(prompts, (list, tuple)) or not 0 < len(prompts) <= MAX_PROMPTS or not all(isinstance(p, str) for p in prompts):
            raise RequestError(f"prompts must be a list of 1 to {MAX_PROMPTS} strings")
        if any(len(prompt) > MAX_PROMPT_CHARS for prompt in prompts):
            raise RequestError(f"a prompt is longer than {MAX_PROMPT_CHARS} characters; shorten it")
        return cls(
            spec=_spec_of(data, cls.op),
            prompts=tuple(prompts),
            dtype=_choice(data, "dtype", "bfloat16", DTYPES),
            gemma_mode=_choice(data, "gemma_mode", "sharded", GEMMA_MODES),
            free_gemma=bool(_flag(data, "free_gemma", False)),
        )


def prompt_digest(prompt: str, spec: ModelSpec, dtype: str, gemma_mode: str) -> str:
    """sha256 of what determines a prompt's encoding: the text, the model files, dtype and Gemma mode."""
    payload = {"prompt": prompt, "spec": spec.to_wire(), "dtype": dtype, "gemma_mode": gemma_mode}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def _recipe_of(data: dict, op: str) -> tuple[ModelSpec, str, str, PipelineDefaults]:
    """A stage request's model spec, model version (the checkpoint's, checked against a given one),
    pipeline, and that recipe's official defaults."""
    spec = _spec_of(data, op)
    version = request_model_version(spec, data.get("model_version"))
    pipeline = _choice(data, "pipeline", DEFAULT_RECIPE, PIPELINES)
    return spec, version, pipeline, defaults_for(version, pipeline)


def _free_step_recipes() -> str:
    return " or ".join(name for name, declared in RECIPES.items() if declared.fixed_steps is None)


def _fill_unset(request, defaults: dict) -> None:
    """Give each field of a frozen ``request`` that is None its value from ``defaults``."""
    for name, default in defaults.items():
        if getattr(request, name) is None:
            object.__setattr__(request, name, default)


def _image_strengths(data: dict) -> dict:
    """A stage request's image strengths, each a number in [0, 1] (whether its image came is the job's to check)."""
    return {name: number_field(data, name, IMAGE_STRENGTH, 0.0, 1.0) for name in IMAGE_INPUTS}


@dataclass(frozen=True)
class SampleRequest:
    """Stage 1: full-frame generation from noise at ``width`` x ``height`` (sequence/guidance parallel).

    Fields left as None take ``defaults_for(model_version, pipeline)``, where the model version is the
    checkpoint's (an explicit one must agree with it). The prompts' contexts come as
    tensors with the job, or by the digests of an earlier encode job (``positive_digest``, ...)."""

    spec: ModelSpec
    dtype: str = "bfloat16"
    model_version: str | None = None  # None: the checkpoint's (request_model_version)
    pipeline: str = DEFAULT_RECIPE
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    frame_rate: float | None = None
    seed: int | None = None
    steps: int | None = None
    video_guidance: Guidance | None = None
    audio_guidance: Guidance | None = None
    parallel: str = "auto"
    cuda_graphs: bool | None = None  # None: on with CUDA
    compile_blocks: bool | None = None  # None: off
    batch_passes: str | bool = "auto"
    positive_digest: str | None = None
    negative_digest: str | None = None
    preview_every: int = 0  # live previews every this many steps; 0: none
    sigmas: tuple[float, ...] | None = None  # the user's stage-1 schedule (1.0 ... 0.0); None: the recipe's
    sampler: str | None = None  # one of STEPPERS; None: the recipe's stage-1 stepper
    image_strength: float = IMAGE_STRENGTH  # the first-frame image's (the "image" tensor's), in [0, 1]
    last_image_strength: float = IMAGE_STRENGTH  # the last-frame image's (the "last_image" tensor's), in [0, 1]

    op = "sample"

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_version", request_model_version(self.spec, self.model_version))
        official = defaults_for(self.model_version, self.pipeline)
        if self.sigmas is not None:
            object.__setattr__(self, "sigmas", validate_stage1_sigmas(self.sigmas))
        _fill_unset(self, {
            "width": official.stage1_width, "height": official.stage1_height, "num_frames": official.num_frames,
            "frame_rate": official.frame_rate, "seed": official.seed,
            "steps": official.steps if self.sigmas is None else len(self.sigmas) - 1,
        })  # fmt: skip
        object.__setattr__(self, "video_guidance", (self.video_guidance or Guidance()).over(official.video_guidance))
        object.__setattr__(self, "audio_guidance", (self.audio_guidance or Guidance()).over(official.audio_guidance))

    @property
    def defaults(self) -> PipelineDefaults:
        return defaults_for(self.model_version, self.pipeline)

    def to_wire(self) -> dict:
        wire = {f.name: getattr(self, f.name) for f in fields(self)}
        wire.update(spec=self.spec.to_wire(), video_guidance=self.video_guidance.to_wire(), audio_guidance=self.audio_guidance.to_wire(),
                    sigmas=None if self.sigmas is None else list(self.sigmas))  # fmt: skip
        return wire

    @property
    def stage1_sigmas(self) -> tuple[float, ...] | None:
        """The schedule stage 1 runs: the user's, else the recipe's fixed one (None: LTX2Scheduler's over ``steps``)."""
        return self.defaults.stage1_sigmas if self.sigmas is None else self.sigmas

    @classmethod
    def from_wire(cls, data: dict) -> SampleRequest:
        _no_unknown_fields(data, cls, cls.op)
        spec, version, pipeline, official = _recipe_of(data, cls.op)
        sigmas = None if data.get("sigmas") is None else validate_stage1_sigmas(_floats(data["sigmas"], "sigmas"))
        steps = integer_field(data, "steps", official.steps if sigmas is None else len(sigmas) - 1, 1, MAX_STEPS)
        if sigmas is not None and steps != len(sigmas) - 1:
            raise RequestError(f"steps {steps} contradicts the {len(sigmas)} sigmas given ({len(sigmas) - 1} steps); leave steps out with sigmas")
        if sigmas is None and official.stage1_sigmas is not None and steps != official.steps:
            raise RequestError(
                f"the {pipeline} pipeline runs its {official.steps} fixed sigmas {list(official.stage1_sigmas)}, so steps must "
                f"be {official.steps}, got {steps}; leave steps out (or use the {_free_step_recipes()} pipeline for another step count)"
            )
        batch_passes = data.get("batch_passes", "auto")
        if batch_passes != "auto" and not isinstance(batch_passes, bool):
            raise RequestError(f'batch_passes must be "auto", true or false, got {batch_passes!r}; leave it out for "auto"')
        return cls(
            spec=spec,
            dtype=_choice(data, "dtype", "bfloat16", DTYPES),
            model_version=version,
            pipeline=pipeline,
            width=integer_field(data, "width", official.stage1_width, VIDEO_SPATIAL_COMPRESSION, MAX_SIDE),
            height=integer_field(data, "height", official.stage1_height, VIDEO_SPATIAL_COMPRESSION, MAX_SIDE),
            num_frames=integer_field(data, "num_frames", official.num_frames, 1, MAX_FRAMES),
            frame_rate=number_field(data, "frame_rate", official.frame_rate, MIN_FRAME_RATE, MAX_FRAME_RATE),
            seed=integer_field(data, "seed", official.seed, 0, SEED_MAX),
            steps=steps,
            video_guidance=Guidance.from_wire(data.get("video_guidance"), "video_guidance", official.video_guidance),
            audio_guidance=Guidance.from_wire(data.get("audio_guidance"), "audio_guidance", official.audio_guidance),
            parallel=_choice(data, "parallel", "auto", PARALLEL_PLANS),
            cuda_graphs=_flag(data, "cuda_graphs", None),
            compile_blocks=_flag(data, "compile_blocks", None),
            batch_passes=batch_passes,
            positive_digest=_digest(data, "positive_digest"),
            negative_digest=_digest(data, "negative_digest"),
            preview_every=integer_field(data, "preview_every", 0, 0, MAX_PREVIEW_EVERY),
            sigmas=sigmas,
            sampler=_sampler(data),
            **_image_strengths(data),
        )


@dataclass(frozen=True)
class UpscaleRequest:
    """Stage 2: 2x spatial upsample, then the refinement over the stage-2 sigmas (the distilled LoRA
    on the dev checkpoint of the two-stage recipe; the distilled checkpoint as it is, no LoRA, in the
    distilled recipe), tiled data parallel (audio frozen) or sequence parallel (audio denoised).

    ``sigmas`` None: the recipe's (two-stage: ``TDP_UPSCALE_SIGMAS``; distilled: the official tail
    ``STAGE_2_SIGMAS``). ``parallel``: one of ``STAGE2_PLANS``. ``tiles`` (height tiles, width
    tiles), TDP only; None: a balanced split over the fleet."""

    spec: ModelSpec
    dtype: str = "bfloat16"
    model_version: str | None = None  # None: the checkpoint's (request_model_version)
    pipeline: str = DEFAULT_RECIPE
    frame_rate: float | None = None
    seed: int | None = None
    sigmas: tuple[float, ...] | None = None
    parallel: str = "auto"
    tiles: tuple[int, int] | None = None
    overlap: int = TDP_OVERLAP
    force_from_noise: bool = False
    positive_digest: str | None = None
    preview_every: int = 0  # live previews every this many steps; 0: none
    sampler: str | None = None  # one of STEPPERS; None: the recipe's stage-2 stepper
    image_strength: float = IMAGE_STRENGTH  # the first-frame image's (the "image" tensor's), in [0, 1]
    last_image_strength: float = IMAGE_STRENGTH  # the last-frame image's (the "last_image" tensor's), in [0, 1]

    op = "upscale"

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_version", request_model_version(self.spec, self.model_version))
        official = defaults_for(self.model_version, self.pipeline)
        _fill_unset(self, {"frame_rate": official.frame_rate, "seed": official.seed, "sigmas": stage2_default_sigmas(self.pipeline)})

    def to_wire(self) -> dict:
        wire = {f.name: getattr(self, f.name) for f in fields(self)}
        wire.update(spec=self.spec.to_wire(), sigmas=list(self.sigmas), tiles=None if self.tiles is None else list(self.tiles))
        return wire

    @classmethod
    def from_wire(cls, data: dict) -> UpscaleRequest:
        _no_unknown_fields(data, cls, cls.op)
        spec, version, pipeline, official = _recipe_of(data, cls.op)
        sigmas = data.get("sigmas")
        sigmas = stage2_default_sigmas(pipeline) if sigmas is None else _floats(sigmas, "sigmas")
        force_from_noise = bool(_flag(data, "force_from_noise", False))
        validate_upscale_sigmas(sigmas, force_from_noise)
        parallel = _choice(data, "parallel", "auto", STAGE2_PLANS)
        tiles = data.get("tiles")
        if tiles is not None and (
            not isinstance(tiles, (list, tuple)) or len(tiles) != 2 or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in tiles)
        ):
            raise RequestError(f"tiles must be [height_tiles, width_tiles] of positive integers, got {tiles!r}")
        if tiles is not None and parallel == "sp":
            raise RequestError(f"tiles {list(tiles)} apply to tiled data parallel only; leave them out with parallel 'sp', or use parallel 'tdp'")
        return cls(
            spec=spec,
            dtype=_choice(data, "dtype", "bfloat16", DTYPES),
            model_version=version,
            pipeline=pipeline,
            frame_rate=number_field(data, "frame_rate", official.frame_rate, MIN_FRAME_RATE, MAX_FRAME_RATE),
            seed=integer_field(data, "seed", official.seed, 0, SEED_MAX),
            sigmas=sigmas,
            parallel=parallel,
            tiles=None if tiles is None else (tiles[0], tiles[1]),
            overlap=integer_field(data, "overlap", TDP_OVERLAP, 0, 64),
            force_from_noise=force_from_noise,
            positive_digest=_digest(data, "positive_digest"),
            preview_every=integer_field(data, "preview_every", 0, 0, MAX_PREVIEW_EVERY),
            sampler=_sampler(data),
            **_image_strengths(data),
        )


@dataclass(frozen=True)
class DecodeRequest:
    """Distributed VAE decode of the video and the audio.

    ``seed``, ``frame_rate``, ``after_stages`` (how many stages drew noise from the job's generator
    before the decoder) and ``guiding_frames`` (the image latents each stage appended to its video,
    ``recipes.Recipe.guiding_frames``) reproduce the official pipeline's decoder noise."""

    spec: ModelSpec
    dtype: str = "bfloat16"
    seed: int = OFFICIAL.seed
    frame_rate: float = OFFICIAL.frame_rate
    after_stages: int = 2
    spatial_tile_pixels: int = DECODE_SPATIAL_TILE_PIXELS
    temporal_tile_frames: int = DECODE_TEMPORAL_TILE_FRAMES
    guiding_frames: int = 0  # the guiding latents each of those stages appended (their draws included them)

    op = "decode"

    def to_wire(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "spec": self.spec.to_wire()}

    @classmethod
    def from_wire(cls, data: dict) -> DecodeRequest:
        _no_unknown_fields(data, cls, cls.op)
        spatial = integer_field(data, "spatial_tile_pixels", DECODE_SPATIAL_TILE_PIXELS, 64, MAX_SIDE)
        temporal = integer_field(data, "temporal_tile_frames", DECODE_TEMPORAL_TILE_FRAMES, 16, 4096)
        if spatial % VIDEO_SPATIAL_COMPRESSION or temporal % VIDEO_TEMPORAL_COMPRESSION:
            raise RequestError(f"decode tiles must be multiples of 32 pixels and 8 frames, got {spatial} px and {temporal} frames")
        after_stages = data.get("after_stages", 2)
        if isinstance(after_stages, bool) or after_stages not in AFTER_STAGES:
            raise RequestError(f"after_stages must be 0, 1 or 2, got {after_stages!r}")
        return cls(
            spec=_spec_of(data, cls.op),
            dtype=_choice(data, "dtype", "bfloat16", DTYPES),
            seed=integer_field(data, "seed", OFFICIAL.seed, 0, SEED_MAX),
            frame_rate=number_field(data, "frame_rate", OFFICIAL.frame_rate, MIN_FRAME_RATE, MAX_FRAME_RATE),
            after_stages=after_stages,
            spatial_tile_pixels=spatial,
            temporal_tile_frames=temporal,
            guiding_frames=integer_field(data, "guiding_frames", 0, 0, len(IMAGE_INPUTS)),
        )


@dataclass(frozen=True)
class UnloadRequest:
    """Drop the resident model and its parallel groups' state; the fleet stays up."""

    op = "unload"

    def to_wire(self) -> dict:
        return {}

    @classmethod
    def from_wire(cls, data: dict) -> UnloadRequest:
        _no_unknown_fields(data, cls, cls.op)
        return cls()

