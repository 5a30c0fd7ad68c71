"""Load Checkpoint MGPU (files + fleet options -> MGPU_MODEL) and MGPU Fleet Control.

The loader picks files from ComfyUI's model folders (checkpoints, loras, latent_upscale_models,
text_encoders) and the recipe they are for (``pipeline``: two-stage = the dev checkpoint plus the
distilled LoRA; distilled = the distilled checkpoint, no LoRA), builds the model spec, and loads it
into every rank right away so that a wrong file fails here and not three nodes later. Its output is
a small handle, not a model: the weights live in the fleet processes. It never touches the weights
itself.

Model versions (LTX-2.0 19B, LTX-2.3 22B): the version is the checkpoint's own ``model_version``
metadata, read from the file header (``ModelSpec.model_version``, torch-free), never a widget, so a
graph cannot contradict its file. Every file list offers the embedded tiny bundle of each version
(``EMBEDDED_ENTRIES``: one entry per version, resolving to ``embedded:tiny`` / ``embedded:tiny-2.3``
and, for the distilled pipeline, their distilled checkpoints); the bundle is one set, so all
embedded inputs must name the same version. The node side follows the version where a default
matters: the fleet fills every value a node leaves open from ``DEFAULTS[(version, pipeline)]`` (SP
Sampler's empty ``stg_blocks``, TDP Upscale's empty ``sigmas``), and the explicit widgets stay
what the user set: SP Sampler only notes on the node when its steps or STG blocks hold the other
version's official values (``version_default_notes``). The loader names the version it found on
the node.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from mgpu_backend.ltx import api
from mgpu_backend.ltx.safetensors_header import ModelFileError
from mgpu_backend.ltx.recipes import DEFAULT_RECIPE, RECIPES, STRENGTH_WORDS, recipe, strength_default_words, strength_fields, strength_readers
from mgpu_backend.ltx.schema import DISTILLED_LORA_STRENGTH, GEMMA_MODES, PARALLEL_PLANS, PIPELINES, QUANTIZATIONS, RESIDENCY_POLICIES, ModelSpec, defaults_for, validate_dtype_with_loras

from .fleet_admin import format_status, status_snapshot, stop_fleet, unload_models
from .fleet_job import FleetJob, node_note, prompt_server
from .layouts import DTYPES, MODEL_TYPE, make_model_handle, parse_gpus
from .validation import refusal

log = logging.getLogger("comfyui-mgpu")

CATEGORY = "MGPU/LTX-2"
EMBEDDED = "(embedded tiny LTX-2, random weights)"
EMBEDDED_2_3 = "(embedded tiny LTX-2.3, random weights)"
EMBEDDED_ENTRIES = {EMBEDDED: "2.0", EMBEDDED_2_3: "2.3"}
"""The loader's embedded tiny bundle entries, one per model version (the first is the default)."""
NO_FILE = "(none)"
NO_QUANTIZATION = "none"


def _folder_paths():
    try:
        import folder_paths
    except ImportError:
        return None
    return folder_paths


def model_file_choices(folder: str) -> list[str]:
    """Files of one ComfyUI model folder (empty outside ComfyUI)."""
    folder_paths = _folder_paths()
    if folder_paths is None:
        return []
    try:
        return folder_paths.get_filename_list(folder)
    except KeyError:  # a ComfyUI too old to know this folder
        return []


def gemma_folder_choices() -> list[str]:
    """Gemma choices inside the text_encoders folders: Hugging Face model folders (with a config.json)
    and single .safetensors files in ComfyUI's own layout (e.g. gemma_3_12B_it.safetensors).

    A file that is not a Gemma-3 text encoder is refused with a clear message when the model loads.
    """
    folder_paths = _folder_paths()
    if folder_paths is None:
        return []
    names = set()
    for base in folder_paths.get_folder_paths("text_encoders"):
        if not os.path.isdir(base):
            continue
        for entry in os.listdir(base):
            if os.path.isfile(os.path.join(base, entry, "config.json")) or entry.endswith(".safetensors"):
                names.add(entry)
    return sorted(names)


def _resolve_file(folder: str, name: str) -> str:
    folder_paths = _folder_paths()
    if folder_paths is None:
        if os.path.isfile(name):
            return os.path.abspath(name)
        raise ValueError(f"{name!r} is not a file; outside ComfyUI give a path or choose {EMBEDDED!r}")
    path = folder_paths.get_full_path(folder, name)
    if path is None:
        raise ValueError(f"{name!r} is not in ComfyUI's {folder} folder any more; refresh the page and choose again")
    return path


def _resolve_gemma(name: str) -> str:
    folder_paths = _folder_paths()
    bases = folder_paths.get_folder_paths("text_encoders") if folder_paths is not None else [""]
    for base in bases:
        path = os.path.join(base, name)
        if os.path.isfile(os.path.join(path, "config.json")) or (name.endswith(".safetensors") and os.path.isfile(path)):
            return os.path.abspath(path)
    raise ValueError(
        f"Gemma {name!r} is neither a folder with a config.json nor a .safetensors file in any text_encoders folder; "
        "put ComfyUI's gemma_3_12B_it.safetensors or the Hugging Face folder (e.g. gemma-3-12b-it-qat-q4_0-unquantized) "
        "in models/text_encoders"
    )


def build_spec(ckpt_name: str, distilled_lora: str, distilled_lora_strength: float, spatial_upsampler: str, gemma: str,
               quantization: str = NO_QUANTIZATION, residency: str = RESIDENCY_POLICIES[0], pipeline: str = DEFAULT_RECIPE,
               strengths: dict[str, float] | None = None) -> dict:  # fmt: skip
    """The ModelSpec JSON for the chosen files; the embedded tiny bundle is one set of one version,
    never mixed, and named symbolically: the fleet makes (or finds) its files, nothing is written in
    this process. A file the recipe refuses (the distilled recipe: the distilled LoRA, its checkpoint
    being the distilled model) must be (none). ``strengths``: the per-stage LoRA strengths
    (``recipes.STRENGTH_WORDS``) given, ``RECIPE_STRENGTH`` for the recipe's own; the others stay unset."""
    return replace(ModelSpec.from_wire(_files_spec(ckpt_name, distilled_lora, distilled_lora_strength, spatial_upsampler, gemma,
                                                   quantization, residency, pipeline)), **chosen_strengths(strengths or {})).to_wire()  # fmt: skip


def _files_spec(ckpt_name: str, distilled_lora: str, distilled_lora_strength: float, spatial_upsampler: str, gemma: str,
                quantization: str, residency: str, pipeline: str) -> dict:  # fmt: skip
    declared = recipe(pipeline)
    chosen = {"ckpt_name": ckpt_name, "distilled_lora": distilled_lora, "spatial_upsampler": spatial_upsampler, "gemma": gemma}
    for file, _why in declared.refused:
        if chosen[file.node_input] != NO_FILE:
            takers = " or ".join(other.name for other in RECIPES.values() if other.takes(file))
            raise ValueError(
                f"the {declared.name} pipeline runs the {declared.checkpoint.words} with no {file.words}, but {file.node_input} is "
                f"{chosen[file.node_input]!r}; set {file.node_input} to {NO_FILE!r} (or pipeline to {takers}, which takes it)"
            )
    holding = (("distilled_lora", distilled_lora), ("spatial_upsampler", spatial_upsampler), ("gemma", gemma))
    if ckpt_name in EMBEDDED_ENTRIES:
        version = EMBEDDED_ENTRIES[ckpt_name]
        if gemma != ckpt_name:
            raise ValueError(f"the embedded tiny checkpoint only works with its own text encoder: set gemma to {ckpt_name!r}")
        for input_name, value in holding[:2]:
            if value not in (ckpt_name, NO_FILE):
                raise ValueError(
                    f"{input_name} {value!r} does not fit the embedded tiny checkpoint {ckpt_name!r}; choose {ckpt_name!r} or {NO_FILE!r}"
                )
        spec = ModelSpec.embedded_tiny(
            spatial_upsampler=spatial_upsampler == ckpt_name, distilled_lora=distilled_lora == ckpt_name,
            distilled_lora_strength=distilled_lora_strength, version=version,
        )  # fmt: skip
        spec = replace(spec, checkpoint_path=ModelSpec.embedded_tiny_for(pipeline, version).checkpoint_path)
        return replace(spec, quantization=None if quantization == NO_QUANTIZATION else quantization, residency=residency).to_wire()
    embedded = [name for name, value in holding if value in EMBEDDED_ENTRIES]
    if embedded:
        raise ValueError(
            f"{', '.join(embedded)} is set to an embedded tiny bundle but the checkpoint is {ckpt_name!r}; "
            "the tiny bundle is one set: choose real files for every input, or the same embedded entry for the checkpoint too"
        )
    if gemma == NO_FILE:
        raise ValueError("choose the Gemma 3 text encoder folder; LTX-2 cannot run without it")
    spec = ModelSpec(
        checkpoint_path=_resolve_file("checkpoints", ckpt_name),
        gemma_root=_resolve_gemma(gemma),
        spatial_upsampler_path=None if spatial_upsampler == NO_FILE else _resolve_file("latent_upscale_models", spatial_upsampler),
        distilled_lora=None if distilled_lora == NO_FILE else _resolve_file("loras", distilled_lora),
        distilled_lora_strength=distilled_lora_strength,
        quantization=None if quantization == NO_QUANTIZATION else quantization,
        residency=residency,
    )
    return spec.to_wire()


def spec_model_version(spec: dict) -> str | None:
    """The LTX-2 version of a model spec's checkpoint (its header metadata, or the embedded bundle's);
    None when this process cannot read the file (the ranks then decide, and say so if it is no checkpoint)."""
    try:
        return ModelSpec.from_wire(spec).model_version
    except (ModelFileError, OSError):
        return None


def describe_version(version: str, pipeline: str) -> str:
    """One line naming a model version and the official stage-1 defaults its recipe runs."""
    declared, official = recipe(pipeline), defaults_for(version, pipeline)
    if declared.fixed_steps is not None:
        return (f"LTX-{version} checkpoint, {declared.name} pipeline: {declared.fixed_steps} fixed {declared.name} steps, "
                f"then the {len(declared.stage2.sigmas) - 1}-step tail")  # fmt: skip
    stg = f"STG block {','.join(map(str, official.video_guidance.stg_blocks))}" if official.video_guidance.stg_scale else "no STG"
    return f"LTX-{version} checkpoint: official defaults {official.steps} steps, {stg}"


RECIPE_STRENGTH = -1.0
"""A per-stage LoRA strength input's value for the recipe's own (the model spec's unset strength)."""


def strength_tooltip(field: str) -> str:
    """A per-stage LoRA strength input's tooltip: the recipes that read it and what each fuses by default."""
    return (f"The {strength_readers(field)} pipelines only: {STRENGTH_WORDS[field]}. {RECIPE_STRENGTH:g}: the recipe's own "
            f"({strength_default_words(field)}, as their official runners); 0: no distilled LoRA there. The hq pipeline "
            "does not read distilled_lora_strength.")  # fmt: skip


def chosen_strengths(strengths: dict[str, float]) -> dict[str, float | None]:
    """The per-stage strength inputs as model spec fields: ``RECIPE_STRENGTH`` is the recipe's own (unset)."""
    unknown = sorted(set(strengths) - set(strength_fields()))
    if unknown:
        raise ValueError(f"unknown input(s) {unknown}; Load Checkpoint MGPU's per-stage strengths are {list(strength_fields())}")
    return {field: None if value is None or value == RECIPE_STRENGTH else float(value) for field, value in strengths.items()}


def pipeline_tooltip() -> str:
    """The loader's ``pipeline`` tooltip, from the recipes' declarations."""
    described = " ".join(f"{declared.name}: {declared.summary} {declared.when}" for declared in RECIPES.values())
    return f"The recipe the checkpoint is for. {described} SP Sampler and TDP Upscale take this recipe's steps, sigmas and guidance."


class LoadCheckpointMGPU:
    """Pick the LTX-2 files and fleet options; load them into every rank of the fleet."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (MODEL_TYPE,)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("Handle of the model loaded in the fleet; connect it to every other MGPU node.",)
    FUNCTION = "load"
    DESCRIPTION = "Loads an LTX-2 audio+video model into every GPU of the MGPU fleet (one process per GPU)."

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "ckpt_name": ([*EMBEDDED_ENTRIES, *model_file_choices("checkpoints")], {"default": EMBEDDED, "tooltip": "The LTX-2 checkpoint from models/checkpoints; its version (LTX-2.0 or LTX-2.3) is read from the file. Two-stage pipeline: ltx-2-19b-dev.safetensors or ltx-2.3-22b-dev.safetensors; distilled: ltx-2-19b-distilled.safetensors or ltx-2.3-22b-distilled-1.1.safetensors. The embedded tiny entries (one per version) need no download (random weights: noise out) and are for trying the graph."}),
                "distilled_lora": ([*EMBEDDED_ENTRIES, NO_FILE, *model_file_choices("loras")], {"default": EMBEDDED, "tooltip": "Two-stage pipeline: the distilled LoRA TDP Upscale refines with, from models/loras, made for the checkpoint's version: ltx-2-19b-distilled-lora-384.safetensors (LTX-2.0) or ltx-2.3-22b-distilled-lora-384-1.1.safetensors (LTX-2.3). (none) if you only run SP Sampler, and always (none) for the distilled pipeline."}),
                "distilled_lora_strength": ("FLOAT", {"default": DISTILLED_LORA_STRENGTH, "min": 0.0, "max": 2.0, "step": 0.05, "tooltip": f"Strength of the distilled LoRA in stage 2. The official pipeline uses {DISTILLED_LORA_STRENGTH}."}),
                "spatial_upsampler": ([*EMBEDDED_ENTRIES, NO_FILE, *model_file_choices("latent_upscale_models")], {"default": EMBEDDED, "tooltip": "The 2x latent upsampler TDP Upscale needs, from models/latent_upscale_models, of the checkpoint's version: ltx-2-spatial-upscaler-x2-1.0.safetensors (LTX-2.0) or ltx-2.3-spatial-upscaler-x2-1.1.safetensors (LTX-2.3). (none) if you only run SP Sampler."}),
                "gemma": ([*EMBEDDED_ENTRIES, *gemma_folder_choices()], {"default": EMBEDDED, "tooltip": "The Gemma 3 12B text encoder in models/text_encoders (the same for LTX-2.0 and LTX-2.3): ComfyUI's single file (gemma_3_12B_it.safetensors, or its fp8 scaled or fp4_mixed version, dequantized to bf16 on load) or a Hugging Face folder (config.json, tokenizer, safetensors shards), e.g. gemma-3-12b-it-qat-q4_0-unquantized."}),
                "gpus": ("STRING", {"default": "all", "tooltip": "GPUs the fleet runs on: 'all' or a list like 0,1. Applies when the fleet starts; after changing it press Restart in the MGPU panel."}),
                "gemma_mode": (list(GEMMA_MODES), {"default": GEMMA_MODES[0], "tooltip": "sharded: one Gemma copy split over the GPUs (least memory). batch_parallel: a copy per GPU, prompts encoded in parallel (faster, needs Gemma to fit on one GPU)."}),
                "parallel": (list(PARALLEL_PLANS), {"default": PARALLEL_PLANS[0], "tooltip": "How SP Sampler spreads a step over the GPUs: sp splits the video tokens (sequence parallel), guidance runs the guidance passes on different GPUs, hybrid does both, auto lets the planner choose from GPU count and size."}),
                "dtype": (list(DTYPES), {"default": DTYPES[0], "tooltip": "Compute precision in the fleet. bfloat16 is what LTX-2 is made for; float32 doubles the memory and is for checking results."}),
                "quantization": ([NO_QUANTIZATION, *QUANTIZATIONS], {"default": NO_QUANTIZATION, "tooltip": "fp8-cast keeps the transformer weights in float8 on every GPU (about half its memory) and upcasts them per layer, as the official --quantization fp8-cast; outputs differ slightly from bfloat16. Lightricks' -fp8 checkpoints load either way."}),
                "residency": (list(RESIDENCY_POLICIES), {"default": RESIDENCY_POLICIES[0], "tooltip": "What stays on each GPU between jobs. auto keeps what fits the GPU and builds the rest per stage (Gemma first); all keeps everything (fastest warm runs, most memory); minimal keeps only the transformer; sharded spreads the transformer's weights over the fleet's GPUs (1/N each: for GPUs too small to hold it whole, at the cost of gathering each block over the GPU links)."}),
                "pipeline": (list(PIPELINES), {"default": DEFAULT_RECIPE, "tooltip": pipeline_tooltip()}),
            },
            "optional": {
                field: ("FLOAT", {"default": RECIPE_STRENGTH, "min": RECIPE_STRENGTH, "max": 2.0, "step": 0.05, "tooltip": strength_tooltip(field)})
                for field in strength_fields()
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, distilled_lora=None, dtype=None):
        """ComfyUI runs this before queueing: float32 with the distilled LoRA would fail only in stage 2;
        the LoRA is the input at fault (validation.py). Naming an input here skips ComfyUI's own choice
        check for it, so that is done here too; an input fed by a link is None here."""

        def check_dtype(value):
            if value not in DTYPES:
                raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")

        def check_lora(value):
            if value not in (*EMBEDDED_ENTRIES, NO_FILE, *model_file_choices("loras")):
                raise ValueError(f"distilled_lora {value!r} is not in models/loras; pick one of the listed files, or (none)")
            if dtype in DTYPES:
                validate_dtype_with_loras(dtype, value != NO_FILE)

        return refusal([("dtype", dtype, check_dtype), ("distilled_lora", distilled_lora, check_lora)])

    def load(self, ckpt_name, distilled_lora, distilled_lora_strength, spatial_upsampler, gemma, gpus, gemma_mode, parallel, dtype,
             quantization=NO_QUANTIZATION, residency=RESIDENCY_POLICIES[0], pipeline=DEFAULT_RECIPE, unique_id=None, **strengths):  # fmt: skip
        gpus = parse_gpus(gpus)
        spec = build_spec(ckpt_name, distilled_lora, distilled_lora_strength, spatial_upsampler, gemma, quantization, residency, pipeline, strengths)
        handle = make_model_handle(spec, dtype=dtype, gemma_mode=gemma_mode, parallel=parallel, gpus=gpus, pipeline=pipeline)
        version = spec_model_version(spec)
        if version is not None:
            recipe(pipeline).check_version(version)  # before any weight is read: the recipe's official runner has no such version
        job = FleetJob(unique_id, "Load Checkpoint MGPU")
        # Takes effect when this process starts the fleet; 'all' leaves the choice to the server
        # (every visible GPU, or one CPU rank without CUDA).
        api.configure(gpus=None if gpus == "all" else gpus)
        job.call(api.load, spec, dtype=dtype)
        if version is not None:
            node_note(unique_id, describe_version(version, pipeline))
        self._warn_on_device_mismatch(gpus, unique_id)
        return (handle,)

    @staticmethod
    def _warn_on_device_mismatch(gpus: str, node_id) -> None:
        if gpus == "all" or os.environ.get("MGPU_CPU_RANKS"):
            return
        from mgpu_backend.fleet.controller import DeviceSpec

        wanted = DeviceSpec(gpus=tuple(int(gpu) for gpu in gpus.split(","))).describe()
        running = status_snapshot().get("devices")
        if running and running != wanted:
            message = f"the fleet already runs on {running}, not {wanted}; press Restart in the MGPU panel to apply gpus={gpus}"
            log.warning(message)
            server = prompt_server()
            if server is not None and hasattr(server, "send_progress_text") and node_id is not None:
                server.send_progress_text(message, node_id)


FLEET_ACTIONS = ("status", "unload models", "restart fleet")


class MGPUFleetControl:
    """Show the fleet, unload its models, or restart it (the next MGPU node starts a fresh one)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("status",)
    OUTPUT_TOOLTIPS = ("The fleet status after the action, as text.",)
    FUNCTION = "control"
    OUTPUT_NODE = True
    DESCRIPTION = "Fleet housekeeping: status, unload models (free GPU memory, keep the processes), restart (new processes)."

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "action": (list(FLEET_ACTIONS), {"default": FLEET_ACTIONS[0], "tooltip": "status: show devices, memory, job and queue. unload models: free the GPUs' memory; the next job reloads. restart fleet: stop every fleet process; use it after changing gpus or when a job hangs."}),
            }
        }

    @classmethod
    def IS_CHANGED(cls, action):
        return float("nan")  # the fleet changes under us: never reuse a cached answer

    def control(self, action):
        if action == "unload models":
            message = unload_models()["message"]
        elif action == "restart fleet":
            message = stop_fleet()["message"]
        elif action == "status":
            message = ""
        else:
            raise ValueError(f"action must be one of {list(FLEET_ACTIONS)}, got {action!r}")
        text = "\n".join(part for part in (message, format_status(status_snapshot())) if part)
        return {"ui": {"text": [text]}, "result": (text,)}
