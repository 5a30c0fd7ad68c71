"""The recipes (pipelines) of the pack's ltx-core engine, each declared once.

A recipe is what the official ltx-pipelines 1.0.0 runner of the same name does, written as data:
the model files it needs (with the CLI flag and loader-node input naming each), the LoRA set and
stepper of each stage, its guidance (the official parameters' guided passes, or one unguided pass),
its stage-1 schedule, its stage-2 policy over the fleet, the model versions its runner has
parameters for, how its runner conditions on images (``CONDITIONINGS``), and the inputs it ignores
with the words of their refusal. ``RECIPES`` holds them
by their wire name (``"two-stage"``, ``"distilled"``, ``"hq"``, ``"keyframes"``: the
``pipeline`` field of the requests, the CLI's ``--pipeline``, the loader node's ``pipeline``), and
``recipe(name)`` is the one way to get one. The request schema derives ``DEFAULTS[(version,
pipeline)]`` from these declarations and the model version's official parameters; the jobs, the
planner, the loader, the weight tracker, the CLI, the nodes, the workflow generator and the benches
ask the declaration and never compare recipe names. A new recipe is one more declaration here (its
tests and its workflows aside).

docs/techniques.md carries one section per recipe rendered from these declarations
(``recipes_markdown``; ``python -m mgpu_backend.ltx.recipes docs/techniques.md`` writes it again).

This module must never import torch, ltx_core, ltx_pipelines or anything that does (the ComfyUI
process and the schema import it), and never opens a model file.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mgpu_backend.ltx.safetensors_header import ModelFileError

# --- The schedules the recipes run ------------------------------------------------------------------

# ltx_pipelines.utils.constants.DISTILLED_SIGMA_VALUES: the distilled model's stage-1 schedule.
DISTILLED_SIGMAS = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0)
# ltx_pipelines.utils.constants.STAGE_2_DISTILLED_SIGMA_VALUES: stage 2 of both official pipelines.
STAGE_2_SIGMAS = (0.909375, 0.725, 0.421875, 0.0)
# TDP Upscale's own default: the official multi-GPU page has TDP start from a smaller first sigma than
# the single-GPU stage 2, because re-injected noise lets the tiles drift apart (docs/techniques.md).
TDP_UPSCALE_SIGMAS = (0.625, 0.4, 0.0)
DISTILLED_LORA_STRENGTH = 1.0  # ltx_pipelines.utils.constants.DEFAULT_LORA_STRENGTH
# ltx_pipelines.utils.args.hq_2_stage_arg_parser's defaults: the HQ recipe fuses the distilled LoRA in
# both stages, at these strengths (its own strength in the runner's list is not read).
HQ_LORA_STRENGTH_STAGE_1, HQ_LORA_STRENGTH_STAGE_2 = 0.25, 0.5

# --- LoRA sets --------------------------------------------------------------------------------------

LORA_SETS = {
    "none": (),
    "distilled": (("distilled_lora", "distilled_lora_strength", DISTILLED_LORA_STRENGTH),),
    "distilled-stage-1": (("distilled_lora", "distilled_lora_strength_stage_1", HQ_LORA_STRENGTH_STAGE_1),),
    "distilled-stage-2": (("distilled_lora", "distilled_lora_strength_stage_2", HQ_LORA_STRENGTH_STAGE_2),),
    "distilled-stage-1-if-chosen": (("distilled_lora", "distilled_lora_strength_stage_1", None),),
}
"""What a stage fuses into the checkpoint's transformer besides the user LoRAs (which every set
fuses first, in their order): ``(file field, strength field, strength when the spec leaves it
unset)`` triples of the model spec. ``none``: the user LoRAs only; ``distilled``: they and the
distilled LoRA at ``distilled_lora_strength`` (the two-stage recipe's stage 2); ``distilled-stage-1``
/ ``-2``: the distilled LoRA at the HQ recipe's per-stage strength (its official runner's 0.25 / 0.5
unless set); ``distilled-stage-1-if-chosen``: the distilled LoRA in stage 1 only when the spec sets
``distilled_lora_strength_stage_1`` (the two-stage recipe: its official runner fuses none there, but
ComfyUI's LTX-2.3 templates run the dev checkpoint with the distilled LoRA in both stages). A LoRA at
strength 0 is no LoRA: it is left out. Two sets of one file at two strengths are two sets: the weight
tracker swaps between them as between any two (and not between two sets of equal pairs)."""

STRENGTH_WORDS = {
    "distilled_lora_strength_stage_1": "the distilled LoRA's strength in stage 1",
    "distilled_lora_strength_stage_2": "the distilled LoRA's strength in stage 2",
}
"""The per-stage strength fields a recipe may read (``Recipe.stage_strengths``), in words. The model
spec leaves them unset (None) by default: each recipe's LoRA set then decides (``LORA_SETS``)."""

LORA_FILES = frozenset(field for triples in LORA_SETS.values() for field, _strength, _unset in triples)
"""The model spec fields that hold a LoRA a set fuses."""


def stage_loras(spec, lora_set: str) -> tuple[tuple[str, float], ...]:
    """The ``(path, strength)`` pairs a stage with ``lora_set`` fuses from ``spec`` (a ``ModelSpec``),
    in the order ltx-core fuses them: the user LoRAs, then the set's own (left out at strength 0, or
    unset where the set fuses its LoRA only when chosen)."""
    if lora_set not in LORA_SETS:
        raise ValueError(f"lora_set must be one of {' or '.join(map(repr, LORA_SETS))}, got {lora_set!r}")
    pairs = [(path, strength) for path, strength in spec.loras]
    for field, strength_field, unset in LORA_SETS[lora_set]:
        strength = getattr(spec, strength_field)
        strength = unset if strength is None else strength
        if not strength:
            continue
        path = getattr(spec, field)
        if path is None:
            raise ModelFileError(f"the LoRA set {lora_set!r} needs the {FILE_WORDS[field]} (at {strength_field} {strength:g}), but the model spec names "
                                 f"none; set {field}, or leave {strength_field} unset")  # fmt: skip
        pairs.append((path, strength))
    return tuple(pairs)


def strength_readers(field: str) -> str:
    """The recipes reading the per-stage strength ``field``, in words: "two-stage, hq and keyframes"."""
    names = [declared.name for declared in RECIPES.values() if field in declared.stage_strengths]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def strength_defaults(field: str) -> dict[str, float | None]:
    """What each recipe reading the per-stage strength ``field`` fuses when the spec leaves it unset
    (None: no LoRA), by recipe name."""
    return {
        declared.name: unset
        for declared in RECIPES.values()
        for stage in (declared.stage1, declared.stage2)
        for _file, strength_field, unset in LORA_SETS[stage.lora_set]
        if strength_field == field
    }


def strength_default_words(field: str) -> str:
    """``strength_defaults`` in words: "two-stage: none unless set; hq: 0.25"."""
    return "; ".join(f"{name}: {'none unless set' if unset is None else f'{unset:g}'}" for name, unset in strength_defaults(field).items())


# --- The declarations ----------------------------------------------------------------------------------

FILE_WORDS = {  # each model spec field's file, in words
    "checkpoint_path": "checkpoint",
    "distilled_lora": "distilled LoRA",
    "spatial_upsampler_path": "spatial upsampler",
    "gemma_root": "Gemma text encoder",
}


@dataclass(frozen=True)
class ModelFile:
    """One file a recipe needs: the ``ModelSpec`` field holding it, the words for it, the CLI flag and
    the Load Checkpoint MGPU input that name it, the first job that opens it (``load``: every job;
    ``upscale``: stage 2 only), and the ``bundles.tiny.TinyBundle`` attribute of the tiny bundle's
    file standing in for it."""

    spec_field: str
    words: str
    flag: str
    node_input: str
    needed_from: str
    tiny_file: str


@dataclass(frozen=True)
class Stage:
    """One denoising stage: its stepper (``euler``: ltx-core's EulerDiffusionStep; the field a
    higher-order stepper fills), the LoRA set fused for it (``LORA_SETS``), and its sigmas (None:
    ltx-core's LTX2Scheduler over the model version's official step count, shifted by the stage's own
    token count when ``shift_by_tokens``, else by its default 4096-token anchor)."""

    lora_set: str
    sigmas: tuple[float, ...] | None
    stepper: str = "euler"
    shift_by_tokens: bool = False


@dataclass(frozen=True)
class Ignored:
    """An input a recipe cannot honour, refused when a user sets it (the CLI, the requests) or noted
    on the node (SP Sampler): the input (``steps``, ``guidance``) and why, in a few words that the
    refusals quote ("one unguided pass per step")."""

    input: str
    why: str


STEPPERS = {
    "euler": "Euler steps (ltx-core's EulerDiffusionStep)",
    "res2s": "res_2s steps (the official HQ sampler: two denoises per step, SDE noise; `mgpu_backend.ltx.res2s`)",
}
"""The steppers a stage may declare."""
GUIDANCES = {
    "multimodal": "the official parameters' guidance: a conditional pass plus the CFG, STG and modality passes their scales ask for (up to 4 per step)",
    "none": "one conditional pass per step (no negative prompt, no guidance scales)",
}
GUIDED_PASSES = {"multimodal": 4, "none": 1}
"""The most transformer forwards one stage-1 step runs under each guidance (a skipped pass is one fewer)."""
DENOISES = {"euler": (1, 0), "res2s": (2, 1)}
"""The denoise calls (each up to ``GUIDED_PASSES`` forwards in stage 1) of each stepper: per step, and
once more per stage (res_2s evaluates its extra last sigma: 2N + 1 for N steps)."""
OFFICIAL_PARAMS = {
    "2.0": "ltx_pipelines.utils.constants.LTX_2_PARAMS",
    "2.3": "ltx_pipelines.utils.constants.LTX_2_3_PARAMS",
}
"""The official parameters (steps, sizes, guidance) a recipe's runner takes per model version, by
default (``Recipe.official_params``; ``schema.OFFICIAL_PARAMS`` holds their values)."""
STAGE2_POLICIES = {
    "tdp": "TDP Upscale (tiles over the GPUs, the stage-1 audio kept)",
    "planned": "the planner's rule (SP over the fleet while each GPU keeps enough tokens, else TDP)",
    "sp": "SP over the fleet (the audio denoised, as the official runner; TDP only where the fleet is no usable SP degree)",
}

CONDITIONINGS = {
    "first-frame": (
        "an image at frame 0 replaces the first latent frame, an image at any other frame (the last image) is appended "
        "as a guiding latent (ltx_pipelines' `combined_image_conditionings`)"
    ),
    "keyframes": (
        "every image, the first included, is appended as a guiding latent at its frame (ltx_pipelines' "
        "`image_conditionings_by_adding_guiding_latent`); stage 2 cannot be tiled (TDP) with them"
    ),
}
"""How a recipe's runner turns the conditioning images (the first image at frame 0, the last image at the
last frame) into conditionings: ``first-frame`` replaces the first latent frame by the first image
(``VideoConditionByLatentIndex``); ``keyframes`` appends every image's latent tokens to the video
sequence (``VideoConditionByKeyframeIndex``), positions offset to its frame. An appended (guiding) latent
is one latent frame of tokens more per image in both stages, noised with the rest."""



def guides(conditioning: str, frame_idx: int) -> bool:
    """Whether an image at pixel frame ``frame_idx`` is appended as a guiding latent under ``conditioning``
    (a key of ``CONDITIONINGS``), rather than replacing the first latent frame."""
    return conditioning == "keyframes" or frame_idx != 0


def appended_frames(conditioning: str, frame_indices) -> int:
    """How many guiding latents (one latent frame of tokens each) images at ``frame_indices`` append."""
    return sum(guides(conditioning, frame_idx) for frame_idx in frame_indices)


def image_frames(num_frames: int, has_image: bool, has_last_image: bool) -> list[int]:
    """The pixel frames of the conditioning images given: the first image at 0, the last image at the last frame."""
    return [frame_idx for frame_idx, given in ((0, has_image), (num_frames - 1, has_last_image)) if given]


@dataclass(frozen=True)
class Recipe:
    """One recipe: everything the pack knows about a pipeline, and the only place it is written."""

    name: str  # the wire value of ``pipeline``
    label: str  # its title in the docs
    official_runner: str  # the ltx_pipelines module and class it reproduces
    short: str  # what it is, a few words (the CLI's --pipeline help)
    summary: str  # what it is, one sentence
    when: str  # when to use it, one sentence
    files: tuple[ModelFile, ...]  # every file, the checkpoint first, in the order a missing one is named
    stage1: Stage
    stage2: Stage
    guidance: str  # a key of GUIDANCES
    stage2_policy: str  # a key of STAGE2_POLICIES
    upscale_sigmas: tuple[float, ...]  # the upscale job's default schedule (the CLI's, TDP Upscale's)
    refused: tuple[tuple[ModelFile, str], ...] = ()  # files it must not get, each with why (words of the refusal)
    ignores: tuple[Ignored, ...] = ()
    # The official parameters its runner takes per model version it supports (``OFFICIAL_PARAMS``'
    # form); a version missing here is one the official layer has no parameters for, refused.
    official_params: tuple[tuple[str, str], ...] = tuple(OFFICIAL_PARAMS.items())
    conditioning: str = "first-frame"  # a key of CONDITIONINGS

    def __post_init__(self) -> None:
        assert self.guidance in GUIDANCES and self.stage2_policy in STAGE2_POLICIES, self
        assert self.conditioning in CONDITIONINGS, self
        assert self.stage1.lora_set in LORA_SETS and self.stage2.lora_set in LORA_SETS, self
        assert self.stage1.stepper in STEPPERS and self.stage2.stepper in STEPPERS, self
        # GenerationParams has one stepper for both stages.
        assert self.stage1.stepper == self.stage2.stepper, self
        assert self.files[0].spec_field == "checkpoint_path", self
        assert self.official_params and all(version in OFFICIAL_PARAMS for version, _params in self.official_params), self

    @property
    def lora_strengths(self) -> tuple[str, ...]:
        """The model spec's strength fields its stages' LoRA sets read (a user LoRA's strength aside)."""
        return tuple(dict.fromkeys(strength for stage in (self.stage1, self.stage2) for _file, strength, _unset in LORA_SETS[stage.lora_set]))

    @property
    def stage_strengths(self) -> tuple[str, ...]:
        """Its per-stage strength fields (``STRENGTH_WORDS``), each a flag of its official runner."""
        return tuple(field for field in self.lora_strengths if field in STRENGTH_WORDS)

    @property
    def versions(self) -> tuple[str, ...]:
        """The model versions it runs: those its official runner has parameters for."""
        return tuple(version for version, _params in self.official_params)

    def check_version(self, model_version: str) -> None:
        """Refuse, in words, a model version its official runner has no parameters for."""
        if model_version not in self.versions:
            names = " and ".join(f"LTX-{version}" for version in self.versions)
            others = [other.name for other in RECIPES.values() if model_version in other.versions]
            raise UnsupportedModelVersion(
                f"the {self.name} pipeline runs {names} only (ltx-pipelines has its parameters for no other version), got an "
                f"LTX-{model_version} checkpoint; use an {names} checkpoint, or pipeline {' or '.join(map(repr, others))}"
            )

    @property
    def checkpoint(self) -> ModelFile:
        return self.files[0]

    @property
    def guided(self) -> bool:
        return self.guidance != "none"

    @property
    def encodes_negative_prompt(self) -> bool:
        """Whether its jobs encode a negative prompt (only guidance reads one)."""
        return self.guided

    @property
    def fixed_steps(self) -> int | None:
        """Stage 1's step count when its sigmas are fixed (None: the model version's official count)."""
        return None if self.stage1.sigmas is None else len(self.stage1.sigmas) - 1

    def guiding_frames(self, num_frames: int, has_image: bool, has_last_image: bool) -> int:
        """How many guiding latents its conditioning appends to each stage's video for the images given."""
        return appended_frames(self.conditioning, image_frames(num_frames, has_image, has_last_image))

    def ignored(self, input_name: str) -> Ignored | None:
        return next((ignored for ignored in self.ignores if ignored.input == input_name), None)

    def takes(self, file: ModelFile) -> bool:
        """Whether it runs with the file of ``file``'s model spec field."""
        return any(own.spec_field == file.spec_field for own in self.files)

    def files_for(self, op: str) -> tuple[ModelFile, ...]:
        """The files a job ``op`` opens (``load``, ``encode``, ``sample``: the ``load`` ones; ``upscale``: all)."""
        return tuple(file for file in self.files if op == "upscale" or file.needed_from == "load")

    def passes_per_step(self) -> int:
        return GUIDED_PASSES[self.guidance]

    def forwards(self, stage: Stage, steps: int) -> int:
        """The most transformer forwards ``steps`` steps of ``stage`` run (stage 2 is unguided)."""
        per_step, per_stage = DENOISES[stage.stepper]
        return (per_step * steps + per_stage) * (self.passes_per_step() if stage is self.stage1 else 1)

    @staticmethod
    def stepper_words(stage: Stage) -> str:
        return STEPPERS[stage.stepper]

    @property
    def stage1_words(self) -> str:
        """Stage 1 in a few words: "8 fixed distilled steps, one unguided pass each"."""
        steps = "the model version's official steps" if self.fixed_steps is None else f"{self.fixed_steps} fixed {self.name} steps"
        passes = "one unguided pass each" if not self.guided else f"up to {self.passes_per_step()} guided passes each"
        return f"{steps}, {passes}"


def _file(spec_field: str, flag: str, node_input: str, needed_from: str, tiny_file: str, words: str | None = None) -> ModelFile:
    return ModelFile(spec_field, words or FILE_WORDS[spec_field], flag, node_input, needed_from, tiny_file)


_GEMMA = _file("gemma_root", "--gemma-root", "gemma", "load", "gemma_root")
_UPSAMPLER = _file("spatial_upsampler_path", "--spatial-upsampler-path", "spatial_upsampler", "upscale", "spatial_upsampler_path")
_DEV_CHECKPOINT = _file("checkpoint_path", "--checkpoint-path", "ckpt_name", "load", "checkpoint_path", "dev checkpoint")
_DISTILLED_CHECKPOINT = _file("checkpoint_path", "--distilled-checkpoint-path", "ckpt_name", "load", "distilled_checkpoint_path", "distilled checkpoint")
_DISTILLED_LORA = _file("distilled_lora", "--distilled-lora", "distilled_lora", "upscale", "distilled_lora_path")

TWO_STAGE = Recipe(
    name="two-stage",
    label="Two-stage",
    official_runner="ltx_pipelines.ti2vid_two_stages.TI2VidTwoStagesPipeline",
    short="dev checkpoint + distilled LoRA, guided",
    summary=(
        "The dev checkpoint denoises the half-size video with the model version's guidance (CFG, STG and "
        "modality passes), the spatial upsampler doubles it, and the dev checkpoint with the distilled LoRA "
        "fused refines it in a few steps."
    ),
    when="The best quality of the two: the default, for final renders and whenever the guidance scales matter.",
    files=(_DEV_CHECKPOINT, _GEMMA, _UPSAMPLER, _DISTILLED_LORA),
    stage1=Stage(lora_set="distilled-stage-1-if-chosen", sigmas=None),
    stage2=Stage(lora_set="distilled", sigmas=STAGE_2_SIGMAS),
    guidance="multimodal",
    stage2_policy="tdp",
    upscale_sigmas=TDP_UPSCALE_SIGMAS,
)

DISTILLED = Recipe(
    name="distilled",
    label="Distilled",
    official_runner="ltx_pipelines.distilled.DistilledPipeline",
    short=f"distilled checkpoint, {len(DISTILLED_SIGMAS) - 1} + {len(STAGE_2_SIGMAS) - 1} unguided steps",
    summary=(
        "The distilled checkpoint denoises the half-size video over 8 fixed sigmas with one unguided pass per "
        "step, the spatial upsampler doubles it, and the same transformer (no LoRA, no swap) refines it over "
        "the official 3-step tail, audio included."
    ),
    when="Drafts and fast iterations: 15 to 20 times fewer stage-1 forwards than two-stage, no negative prompt, no guidance scales.",
    files=(_DISTILLED_CHECKPOINT, _GEMMA, _UPSAMPLER),
    stage1=Stage(lora_set="none", sigmas=DISTILLED_SIGMAS),
    stage2=Stage(lora_set="none", sigmas=STAGE_2_SIGMAS),
    guidance="none",
    stage2_policy="planned",
    upscale_sigmas=STAGE_2_SIGMAS,
    refused=((_DISTILLED_LORA, "the distilled checkpoint needs no distilled LoRA"),),
    ignores=(
        Ignored("guidance", "one unguided pass per step"),
        Ignored("steps", f"its {len(DISTILLED_SIGMAS) - 1} fixed distilled sigmas"),
    ),
)

HQ = Recipe(
    name="hq",
    label="HQ",
    official_runner="ltx_pipelines.ti2vid_two_stages_hq.TI2VidTwoStagesHQPipeline",
    short="dev checkpoint + distilled LoRA in both stages, res_2s, guided (LTX-2.3)",
    summary=(
        "The dev checkpoint with the distilled LoRA fused at a low strength denoises the half-size video with "
        "the res_2s sampler (two denoises per step) under CFG and modality guidance (no STG), over LTX2Scheduler's "
        "sigmas shifted by the stage's own token count; the spatial upsampler doubles it, and the dev checkpoint "
        "with the distilled LoRA at a higher strength refines video and audio with res_2s over the official tail."
    ),
    when="LTX-2.3 renders where quality matters most: half of two-stage's steps, each costing two denoises.",
    files=(_DEV_CHECKPOINT, _GEMMA, _UPSAMPLER, replace(_DISTILLED_LORA, needed_from="load")),
    stage1=Stage(lora_set="distilled-stage-1", sigmas=None, stepper="res2s", shift_by_tokens=True),
    stage2=Stage(lora_set="distilled-stage-2", sigmas=STAGE_2_SIGMAS, stepper="res2s"),
    guidance="multimodal",
    stage2_policy="sp",
    upscale_sigmas=STAGE_2_SIGMAS,
    official_params=(("2.3", "ltx_pipelines.utils.constants.LTX_2_3_HQ_PARAMS"),),
)

KEYFRAMES = Recipe(
    name="keyframes",
    label="Keyframes",
    official_runner="ltx_pipelines.keyframe_interpolation.KeyframeInterpolationPipeline",
    short="dev checkpoint + distilled LoRA, guided, first/last images as guiding latents",
    summary=(
        "Two-stage's models and guidance, with every conditioning image (the first image at frame 0, the last "
        "image at the last frame) appended to the video as a guiding latent in both stages instead of replacing "
        "the first latent frame; stage 2 refines video and audio at full size with the same guiding latents."
    ),
    when="Interpolating between a first and a last frame (keyframes) when both images should steer the motion.",
    files=(_DEV_CHECKPOINT, _GEMMA, _UPSAMPLER, _DISTILLED_LORA),
    stage1=Stage(lora_set="distilled-stage-1-if-chosen", sigmas=None),
    stage2=Stage(lora_set="distilled", sigmas=STAGE_2_SIGMAS),
    guidance="multimodal",
    stage2_policy="sp",
    upscale_sigmas=STAGE_2_SIGMAS,
    conditioning="keyframes",
)

RECIPES: dict[str, Recipe] = {declared.name: declared for declared in (TWO_STAGE, DISTILLED, HQ, KEYFRAMES)}
"""Every recipe by its wire name; the first is the default."""
RECIPE_NAMES = tuple(RECIPES)
DEFAULT_RECIPE = RECIPE_NAMES[0]


class UnknownRecipe(ValueError):
    """A pipeline name no recipe declares."""


class UnsupportedModelVersion(ValueError):
    """A model version a recipe's official runner has no parameters for."""


def recipe(name: str) -> Recipe:
    """The recipe ``name``; an unknown one is refused in words that list the known ones."""
    try:
        return RECIPES[name]
    except (KeyError, TypeError):
        raise UnknownRecipe(f"pipeline must be one of {', '.join(RECIPE_NAMES)}, got {name!r}") from None


def strength_fields() -> tuple[str, ...]:
    """Every per-stage LoRA strength field a recipe reads, each once, in declaration order."""
    return tuple(dict.fromkeys(field for declared in RECIPES.values() for field in declared.stage_strengths))


def strength_flag(field: str) -> str:
    """The CLI flag of a per-stage strength field, as its official runner names it."""
    return "--" + field.replace("_", "-")


def model_flags() -> tuple[str, ...]:
    """Every CLI flag that names a recipe's model file, each once, in declaration order."""
    return tuple(dict.fromkeys(file.flag for declared in RECIPES.values() for file in declared.files))


# --- The recipes in docs/techniques.md ---------------------------------------------------------------

DOCS_BEGIN = "<!-- recipes: generated by mgpu_backend.ltx.recipes.recipes_markdown(); tests/test_recipes.py checks it -->"
DOCS_END = "<!-- recipes: end of the generated part -->"


def _stage1_parallelism(declared: Recipe) -> str:
    if declared.passes_per_step() > 1:
        return (f"guidance parallel x SP: the planner puts the up to {declared.passes_per_step()} passes of a step on guidance "
                "groups of GPUs and splits each pass's tokens inside a group (e.g. 4 groups x SP 2 on 8 GPUs)")  # fmt: skip
    return "SP over all GPUs: one pass per step leaves nothing for guidance groups"


def _unset_words(declared: Recipe, field: str) -> str:
    unset = strength_defaults(field)[declared.name]
    return "no LoRA there, as the official runner" if unset is None else f"{unset:g}, as the official runner"


def recipes_markdown() -> str:
    """One section per recipe for docs/techniques.md, rendered from the declarations (and the schema's
    defaults per model version), between ``DOCS_BEGIN`` and ``DOCS_END``."""
    from mgpu_backend.ltx.schema import DEFAULTS, MODEL_VERSIONS  # the schema imports this module

    lines = [DOCS_BEGIN]
    for declared in RECIPES.values():
        module, runner = declared.official_runner.rsplit(".", 1)
        versions = [version for version in MODEL_VERSIONS if version in declared.versions]
        steps = ", ".join(f"LTX-{version}: {DEFAULTS[(version, declared.name)].steps}" for version in versions)
        stage1_sigmas = "ltx-core's LTX2Scheduler over the version's steps" if declared.stage1.sigmas is None else f"the fixed `{', '.join(map(str, declared.stage1.sigmas))}`"
        stage2_steps = len(declared.stage2.sigmas) - 1
        passes = declared.passes_per_step() * DENOISES[declared.stage1.stepper][0]
        lines += [
            "",
            f"### {declared.label} (`pipeline: {declared.name}`, reproduces `{module}.{runner}`)",
            "",
            f"{declared.summary} **When:** {declared.when}",
            "",
            f"- **Files:** {'; '.join(f'{file.words} (`{file.flag}`, loader input `{file.node_input}`)' for file in declared.files)}.",
        ]
        for file, why in declared.refused:
            lines.append(f"- **Refused:** the {file.words} (`{file.flag}`): {why}.")
        lines += [
            f"- **Stage 1:** {steps} steps ({stage1_sigmas}), {declared.stepper_words(declared.stage1)}, "
            f"LoRA set `{declared.stage1.lora_set}`; {GUIDANCES[declared.guidance]}.",
            f"- **Stage 2:** {stage2_steps} steps (`{', '.join(map(str, declared.stage2.sigmas))}` as the official runner; the upscale job's "
            f"default `{', '.join(map(str, declared.upscale_sigmas))}`), {declared.stepper_words(declared.stage2)}, LoRA set "
            f"`{declared.stage2.lora_set}`{'' if declared.stage1.lora_set == declared.stage2.lora_set else ' (swapped in for stage 2, out after)'}.",
            f"- **Cost per GPU:** up to {passes} transformer {'pass' if passes == 1 else 'passes'} per stage-1 step "
            f"({', '.join(f'LTX-{version}: {declared.forwards(declared.stage1, DEFAULTS[(version, declared.name)].steps)}' for version in versions)} stage-1 forwards), "
            f"then {declared.forwards(declared.stage2, stage2_steps)} full-size forwards (4x the tokens each).",
            f"- **What spreads it:** stage 1 by {_stage1_parallelism(declared)}; stage 2 (`auto`) by {STAGE2_POLICIES[declared.stage2_policy]}.",
            f"- **Images:** `{declared.conditioning}`: {CONDITIONINGS[declared.conditioning]}.",
        ]
        if tuple(versions) != MODEL_VERSIONS:
            lines.append(f"- **Model versions:** {', '.join(f'LTX-{version}' for version in versions)} only (`{', '.join(params for _v, params in declared.official_params)}`: "
                         "the official layer has parameters for no other); a checkpoint of another version is refused.")  # fmt: skip
        if declared.stage_strengths:
            lines.append(f"- **LoRA strengths:** {'; '.join(f'{STRENGTH_WORDS[field]}: `{field}` of the model spec (`{strength_flag(field)}`; unset: {_unset_words(declared, field)})' for field in declared.stage_strengths)}.")
        if declared.ignores:
            ignored = "; ".join(f"{ignored.input} ({ignored.why})" for ignored in declared.ignores)
            lines.append(f"- **Ignores:** {ignored}; the CLI and the API refuse them when set, SP Sampler notes them on the node.")
    return "\n".join([*lines, "", DOCS_END])


def with_recipes_markdown(text: str) -> str:
    """``text`` (docs/techniques.md) with its generated part rendered again from the declarations;
    ``python -m mgpu_backend.ltx.recipes docs/techniques.md`` writes it back."""
    begin, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if begin < 0 or end < begin:
        raise ValueError(f"no generated part ({DOCS_BEGIN} ... {DOCS_END}) in the text; put both markers where the recipes go")
    return text[:begin] + recipes_markdown() + text[end + len(DOCS_END) :]


if __name__ == "__main__":
    import sys
    from pathlib import Path

    for name in sys.argv[1:]:
        Path(name).write_text(with_recipes_markdown(Path(name).read_text(encoding="utf-8")), encoding="utf-8")
