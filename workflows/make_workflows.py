"""Writes the shipped example workflows: each graph once, as a UI file (drag-and-drop, also listed in
ComfyUI's template browser under this pack) with its thumbnail next to it, and as its API twin in
``api/`` (headless queueing: ``python -m mgpu_backend queue workflows/api/SLUG.json``).

``TEMPLATES`` is the one table of them: short name (the API twin's file), example, the title users
see and search for in the template browser (the UI file's and thumbnail's name, see ``Template``),
and a one-line description; its order is the browser's (web/template_order.json, written here).

Every example is one model version (LTX-2.0 or LTX-2.3) and one pipeline (two-stage or distilled):
its widget values are ``DEFAULTS[(version, pipeline)]`` of ``mgpu_backend.ltx.schema`` (the tiny
examples shrink only size, frames and steps), and its loader names that version's official files
(``MODEL_FILES``) with ComfyUI's model metadata (``properties.models``: name, Hugging Face url,
models folder), so ComfyUI offers to download what is missing. Node places and sizes come from
``LAYOUT``, which holds in the classic canvas and with "Nodes 2.0" on.

ComfyUI serves a pack's template folder as it is (app/custom_node_manager.py: ``workflows/`` is one
of the folder names it reads) and its frontend shows ``TITLE.jpg`` as the template's thumbnail; the
thumbnails are drawn here from the graph itself (``render_thumbnail``), so they are reproducible.

Run ``python workflows/make_workflows.py`` after changing a node's inputs; tests/test_workflows.py
checks the written files against the node definitions and each UI graph against its API twin, and
tests/e2e/test_browser_ui.py loads each UI graph in ComfyUI's frontend. ``NATIVE_NODES`` lists the
ComfyUI core nodes the graphs use, as /work/comfyui (January 2026) defines them; the e2e test checks
it against a running ComfyUI's /object_info.

This script only writes JSON and JPEG files; it never runs a workflow.
"""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mgpu_backend.ltx import recipes
from mgpu_backend.ltx.schema import (
    DECODE_SPATIAL_TILE_PIXELS,
    DECODE_TEMPORAL_TILE_FRAMES,
    DEFAULTS,
    DISTILLED_LORA_STRENGTH,
    IMAGE_STRENGTH,
    MODEL_VERSIONS,
    TDP_OVERLAP,
    ModelSpec,
    PipelineDefaults,
    stage2_default_sigmas,
)

HERE = Path(__file__).resolve().parent
PACK_DIR = HERE.parent

# ComfyUI core nodes the graphs use: sockets (name, type, optional), widgets in order (name, type,
# allowed values: a list for a combo, (min, max) for a number, None when open), outputs.
NATIVE_NODES = {
    "PrimitiveFloat": {
        "display": "Float",
        "sockets": [],
        "widgets": [("value", "FLOAT", (-sys.maxsize, sys.maxsize))],
        "outputs": [("FLOAT", "FLOAT")],
    },
    "LoadImage": {
        "display": "Load Image",
        "sockets": [],
        "widgets": [("image", "COMBO", None), ("upload", "IMAGEUPLOAD", None)],  # files of ComfyUI/input
        "outputs": [("IMAGE", "IMAGE"), ("MASK", "MASK")],
    },
    "CreateVideo": {
        "display": "Create Video",
        "sockets": [("images", "IMAGE", False), ("audio", "AUDIO", True)],
        "widgets": [("fps", "FLOAT", (1.0, 120.0))],
        "outputs": [("VIDEO", "VIDEO")],
    },
    "ManualSigmas": {
        "display": "ManualSigmas",
        "sockets": [],
        "widgets": [("sigmas", "STRING", None)],
        "outputs": [("SIGMAS", "SIGMAS")],
    },
    "SaveVideo": {
        "display": "Save Video",
        "sockets": [("video", "VIDEO", False)],
        "widgets": [("filename_prefix", "STRING", None), ("format", "COMBO", ["auto", "mp4"]), ("codec", "COMBO", ["auto", "h264"])],
        "outputs": [],
    },
}
UI_ONLY_NODES = {"MarkdownNote"}
"""Frontend-only nodes (notes): in the UI file, never in the API twin."""
API_ONLY_WIDGETS = {"upload"}
"""Widgets the UI stores but the API prompt leaves out (LoadImage's upload button)."""
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}

NO_FILE = "(none)"
LOADER_FILE_INPUTS = ("ckpt_name", "distilled_lora", "spatial_upsampler", "gemma")

LTX_2_FILES = "https://huggingface.co/Lightricks/LTX-2/resolve/main/"
LTX_2_3_FILES = "https://huggingface.co/Lightricks/LTX-2.3/resolve/main/"
LTX_2_3_FP8_FILES = "https://huggingface.co/Lightricks/LTX-2.3-fp8/resolve/main/"
COMFY_TEXT_ENCODERS = "https://huggingface.co/Comfy-Org/ltx-2/resolve/main/split_files/text_encoders/"
# ComfyUI's single-file Gemma, as its own templates name it: bf16 in its LTX-2 templates, fp4_mixed
# (dequantized to bf16 on load) in its LTX-2.3 ones.
GEMMA = "gemma_3_12B_it.safetensors"
GEMMA_FP4_MIXED = "gemma_3_12B_it_fp4_mixed.safetensors"

MODEL_FILES = {
    ("2.0", "two-stage"): {
        "ckpt_name": "ltx-2-19b-dev.safetensors", "distilled_lora": "ltx-2-19b-distilled-lora-384.safetensors",
        "spatial_upsampler": "ltx-2-spatial-upscaler-x2-1.0.safetensors", "gemma": GEMMA,
    },
    ("2.0", "distilled"): {
        "ckpt_name": "ltx-2-19b-distilled.safetensors", "distilled_lora": NO_FILE,
        "spatial_upsampler": "ltx-2-spatial-upscaler-x2-1.0.safetensors", "gemma": GEMMA,
    },
    # The files of ComfyUI's own LTX-2.3 templates, so one download serves both: Lightricks' fp8
    # checkpoints (Lightricks/LTX-2.3-fp8), the 1.0 distilled LoRA and the 1.1 upsampler. The bf16
    # checkpoints and the 1.1 LoRA of Lightricks/LTX-2.3 fill the same roles (docs/model-files.md).
    ("2.3", "two-stage"): {
        "ckpt_name": "ltx-2.3-22b-dev-fp8.safetensors", "distilled_lora": "ltx-2.3-22b-distilled-lora-384.safetensors",
        "spatial_upsampler": "ltx-2.3-spatial-upscaler-x2-1.1.safetensors", "gemma": GEMMA_FP4_MIXED,
    },
    ("2.3", "distilled"): {
        "ckpt_name": "ltx-2.3-22b-distilled-fp8.safetensors", "distilled_lora": NO_FILE,
        "spatial_upsampler": "ltx-2.3-spatial-upscaler-x2-1.1.safetensors", "gemma": GEMMA_FP4_MIXED,
    },
    ("2.3", "hq"): {
        "ckpt_name": "ltx-2.3-22b-dev-fp8.safetensors", "distilled_lora": "ltx-2.3-22b-distilled-lora-384.safetensors",
        "spatial_upsampler": "ltx-2.3-spatial-upscaler-x2-1.1.safetensors", "gemma": GEMMA_FP4_MIXED,
    },
}  # fmt: skip
"""The official files each model version's pipeline loads, per loader input."""
# The keyframes recipe (KeyframeInterpolationPipeline) loads two-stage's files.
MODEL_FILES.update({(version, "keyframes"): MODEL_FILES[(version, "two-stage")] for version in ("2.0", "2.3")})

# Where ComfyUI's frontend downloads each official file from, and into which models folder: the
# loader node's ``properties.models``, as in ComfyUI's own LTX-2 templates (comfyui-workflow-templates).
MODEL_FOLDERS = {"ckpt_name": "checkpoints", "distilled_lora": "loras", "spatial_upsampler": "latent_upscale_models", "gemma": "text_encoders"}
FILE_BASES = {"2.0": LTX_2_FILES, "2.3": LTX_2_3_FILES}


def file_source(version: str, input_name: str, name: str) -> str:
    """The Hugging Face address of one official file: Gemma from Comfy-Org, fp8 checkpoints from their own repository."""
    if input_name == "gemma":
        return COMFY_TEXT_ENCODERS + name
    if name.endswith("-fp8.safetensors"):
        return LTX_2_3_FP8_FILES + name
    return FILE_BASES[version] + name


MODEL_SOURCES = {
    name: (file_source(version, input_name, name), MODEL_FOLDERS[input_name])
    for (version, _pipeline), files in MODEL_FILES.items() for input_name, name in files.items() if name != NO_FILE
}  # fmt: skip
NODE_TITLE_HEIGHT = 30  # the frontend draws a node's title bar above its ``pos``


def embedded_entries() -> dict[str, str]:
    """The loader's embedded tiny bundle entries and their model versions (``model_nodes.EMBEDDED_ENTRIES``)."""
    load_pack()
    return importlib.import_module("comfyui_mgpu_pack.nodes.model_nodes").EMBEDDED_ENTRIES


def recipe_strength() -> float:
    """The loader's per-stage LoRA strength that means the recipe's own (``model_nodes.RECIPE_STRENGTH``)."""
    load_pack()
    return importlib.import_module("comfyui_mgpu_pack.nodes.model_nodes").RECIPE_STRENGTH


def embedded_entry(version: str) -> str:
    (entry,) = [entry for entry, entry_version in embedded_entries().items() if entry_version == version]
    return entry


def model_metadata(files: dict) -> list[dict]:
    """ComfyUI's model entries for the loader's file inputs (none for the embedded bundle)."""
    return [
        {"name": name, "url": MODEL_SOURCES[name][0], "directory": MODEL_SOURCES[name][1]}
        for name in files.values() if name in MODEL_SOURCES
    ]  # fmt: skip


def load_pack():
    """The pack as ComfyUI imports it: a package from its folder (``nodes`` only relatively)."""
    name = "comfyui_mgpu_pack"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PACK_DIR / "__init__.py", submodule_search_locations=[str(PACK_DIR)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def input_kind(spec) -> str:
    kind = spec[0]
    return "COMBO" if isinstance(kind, (list, tuple)) else kind


def _constraint(spec):
    options = spec[1] if len(spec) > 1 else {}
    if isinstance(spec[0], (list, tuple)):
        return list(spec[0])
    if spec[0] in ("INT", "FLOAT"):
        return (options.get("min", -sys.maxsize), options.get("max", sys.maxsize))
    return None


def pack_node_schema(node_class) -> dict:
    """Sockets, widgets and outputs of one of our V1 node classes, in the shape of NATIVE_NODES.

    A seed-like widget with ``control_after_generate`` is followed by the frontend's extra
    "control after generate" widget, which the UI file stores and the API prompt does not.
    """
    declared = node_class.INPUT_TYPES()
    sockets, widgets = [], []
    for section, optional in (("required", False), ("optional", True)):
        for name, spec in declared.get(section, {}).items():
            kind = input_kind(spec)
            if kind in WIDGET_TYPES:
                widgets.append((name, kind, _constraint(spec)))
                if (spec[1] if len(spec) > 1 else {}).get("control_after_generate"):
                    widgets.append((f"{name}:control_after_generate", "CONTROL", ["fixed", "increment", "decrement", "randomize"]))
            else:
                sockets.append((name, kind, optional))
    names = getattr(node_class, "RETURN_NAMES", node_class.RETURN_TYPES)
    return {"sockets": sockets, "widgets": widgets, "outputs": list(zip(names, node_class.RETURN_TYPES))}


def node_schemas() -> dict:
    pack = load_pack()
    schemas = {name: {"display": pack.NODE_DISPLAY_NAME_MAPPINGS[name], **pack_node_schema(cls)} for name, cls in pack.NODE_CLASS_MAPPINGS.items()}
    return {**NATIVE_NODES, **schemas}


@dataclass
class Node:
    id: int
    type: str
    pos: tuple[int, int]
    widgets: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)  # input name -> (source node id, source slot)
    size: tuple[int, int] = (320, 200)
    title: str | None = None
    models: list = field(default_factory=list)  # ComfyUI's model metadata of the node's file inputs


def _api_value(node: Node, name: str):
    if name in node.links:
        source, slot = node.links[name]
        return [str(source), slot]
    return node.widgets[name]


def to_api(nodes: list[Node], schemas: dict) -> dict:
    prompt = {}
    for node in nodes:
        if node.type in UI_ONLY_NODES:
            continue
        schema = schemas[node.type]
        inputs = {}
        for name, _kind, _optional in schema["sockets"]:
            if name in node.links:
                inputs[name] = _api_value(node, name)
        for name, kind, _allowed in schema["widgets"]:
            if kind != "CONTROL" and name not in API_ONLY_WIDGETS:
                inputs[name] = _api_value(node, name)
        prompt[str(node.id)] = {"class_type": node.type, "inputs": inputs, "_meta": {"title": node.title or schema["display"]}}
    return prompt


def execution_order(nodes: list[Node]) -> list[int]:
    """Node ids with every node after the nodes it reads from (the UI file's ``order`` field)."""
    remaining, placed = {node.id: node for node in nodes}, []
    while remaining:
        ready = sorted(node_id for node_id, node in remaining.items() if all(source not in remaining for source, _ in node.links.values()))
        assert ready, f"the graph has a cycle among nodes {sorted(remaining)}"
        placed += ready
        for node_id in ready:
            del remaining[node_id]
    return placed


# Where the graph first shows: all of it, inside a 1600x1000 window below ComfyUI's top bars and
# right of its sidebar (screen = (canvas position + offset) * scale).
VIEW_ORIGIN, VIEW_SIZE = (80, 110), (1480, 840)


def initial_view(ui_nodes: list[dict]) -> dict:
    left = min(node["pos"][0] for node in ui_nodes)
    top = min(node["pos"][1] for node in ui_nodes) - NODE_TITLE_HEIGHT
    right = max(node["pos"][0] + node["size"][0] for node in ui_nodes)
    bottom = max(node["pos"][1] + node["size"][1] for node in ui_nodes)
    scale = round(min(1.0, VIEW_SIZE[0] / (right - left), VIEW_SIZE[1] / (bottom - top)), 2)
    return {"scale": scale, "offset": [round(VIEW_ORIGIN[0] / scale - left), round(VIEW_ORIGIN[1] / scale - top)]}


def to_ui(nodes: list[Node], schemas: dict, description: str = "", workflow_name: str = "") -> dict:
    links, link_ids = [], {}
    for node in nodes:
        for name, (source, slot) in node.links.items():
            link_id = len(links) + 1
            link_ids[(node.id, name)] = link_id
            links.append([link_id, source, slot, node.id, None, None])  # target slot and type below
    by_id = {node.id: node for node in nodes}
    order_of = {node_id: order for order, node_id in enumerate(execution_order(nodes))}
    ui_nodes = []
    for node in sorted(nodes, key=lambda node: node.id):
        order = order_of[node.id]
        if node.type in UI_ONLY_NODES:
            ui_nodes.append({
                "id": node.id, "type": node.type, "pos": list(node.pos), "size": list(node.size), "flags": {},
                "order": order, "mode": 0, "inputs": [], "outputs": [], "properties": {},
                "widgets_values": [node.widgets["text"]],
            })  # fmt: skip
            continue
        schema = schemas[node.type]
        inputs = []
        for name, kind, optional in schema["sockets"]:
            entry = {"name": name, "type": kind, "link": link_ids.get((node.id, name))}
            if optional:
                entry["shape"] = 7  # the frontend's marker for an optional socket
            inputs.append(entry)
        for name, kind, _allowed in schema["widgets"]:
            if name in node.links:  # a widget fed by a link gets a socket after the plain ones
                inputs.append({"name": name, "type": kind, "widget": {"name": name}, "link": link_ids[(node.id, name)]})
        for slot, entry in enumerate(inputs):
            if entry["link"] is not None:
                link = links[entry["link"] - 1]
                link[4], link[5] = slot, entry["type"]
        outputs = []
        for slot, (name, kind) in enumerate(schema["outputs"]):
            targets = [link[0] for link in links if link[1] == node.id and link[2] == slot]
            outputs.append({"name": name, "type": kind, "links": targets or None, "slot_index": slot})
        widgets_values = []
        for name, kind, _allowed in schema["widgets"]:
            if kind == "CONTROL":
                widgets_values.append("fixed")
            elif name == "upload":
                widgets_values.append("image")
            else:
                widgets_values.append(node.widgets[name])
        ui_node = {
            "id": node.id, "type": node.type, "pos": list(node.pos), "size": list(node.size), "flags": {},
            "order": order, "mode": 0, "inputs": inputs, "outputs": outputs,
            "properties": {"Node name for S&R": node.type, **({"models": node.models} if node.models else {})},
            "widgets_values": widgets_values,
        }  # fmt: skip
        if node.title:
            ui_node["title"] = node.title
        ui_nodes.append(ui_node)
    for link in links:
        assert link[4] is not None, f"link {link} targets an input the schema of node {by_id[link[3]].type} lacks"
    return {
        # Stable per example (the frontend tells open workflows apart by id): the name and node types.
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, "comfyui-mgpu/" + "/".join([workflow_name, *(node.type for node in nodes)]))),
        "revision": 0,
        "last_node_id": max(node.id for node in nodes),
        "last_link_id": len(links),
        "nodes": ui_nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": initial_view(ui_nodes), "description": description},
        "version": 0.4,
    }


NOTE_TWO_STAGE = """## LTX-{version} on all GPUs (comfyui-mgpu)

Stage 1 (**SP Sampler**) generates video and audio at {stage1} with sequence parallelism;
stage 2 (**TDP Upscale**) doubles it to {final} and refines it tile by tile on the GPUs;
**Distributed VAE Decode** decodes the tiles on the GPUs.

{recipe}

Files (ComfyUI/models): {files}.

No weights yet? Choose "{embedded}" in every file box of the loader
to try the graph (the output is noise). Frames must be 8k+1; the fleet panel is in the sidebar (MGPU).
"""


def recipe_text(defaults: PipelineDefaults, tiny: bool) -> str:
    """The note's recipe line, from the recipe's declaration (a tiny example runs fewer steps and STG
    on its model's last block)."""
    declared = recipes.recipe(defaults.pipeline)
    opening = f"The {declared.name} recipe of LTX-{defaults.model_version}: the {declared.checkpoint.words}"
    stage2_steps = len(declared.stage2.sigmas) - 1

    def lora(stage: recipes.Stage, none: str = "") -> str:
        fused = [field for field, _strength, unset in recipes.LORA_SETS[stage.lora_set] if unset is not None]  # not those only a user chooses
        return none if not fused else f" with the {' and '.join(recipes.FILE_WORDS[field] for field in fused)}"

    if not declared.guided:
        return (f"{opening}, {defaults.steps} unguided steps (one pass each; the sampler's steps and guidance widgets are ignored), "
                f"then the {stage2_steps}-step tail,{lora(declared.stage2, ' no LoRA')}.")  # fmt: skip
    blocks = ",".join(map(str, defaults.video_guidance.stg_blocks))
    # The recipe's own stepper is named where it is not plain Euler ("15 res2s steps").
    named = "steps" if declared.stage1.stepper == "euler" else f"{declared.stage1.stepper} steps"
    steps = f"{TINY_SIZE['steps']} {named} (the official {defaults.steps}, fewer for the tiny bundle)" if tiny else f"{defaults.steps} {named}"
    if not defaults.video_guidance.stg_scale:
        stg = "no STG"
    else:
        stg = f"STG on the tiny model's last block; officially block {blocks}" if tiny else f"STG on block {blocks}"
    return (f"{opening}{lora(declared.stage1)}, {steps} of up to {declared.passes_per_step()} guided passes ({stg}), "
            f"then {stage2_steps} steps{lora(declared.stage2)}.")  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """What a workflow sets over its recipe's defaults in the pack's nodes: the loader's, SP Sampler's
    and TDP Upscale's widget values, and a stage-1 schedule fed to SP Sampler's ``sigmas`` input by a
    ManualSigmas node. ``words``: the settings in a sentence, for the graph's note."""

    loader: dict
    sampler: dict
    upscale: dict
    stage1_sigmas: tuple[float, ...]
    words: str


# ComfyUI v0.20.1's LTX-2.3 image-to-video template (workflows/comfy/ltx23_i2v_api.json, as
# comfyui-workflow-templates ships it; tests/test_workflows.py checks these values against it): the
# dev checkpoint with the distilled LoRA at 0.5 (one LoraLoaderModelOnly for both samplers), CFGGuider
# at cfg 1, stage 1 at half of 1280x720 (ComfyUI rounds 360 to 352) over 8 manual sigmas with the image
# at strength 0.7 (stage 2: 1.0), stage 2 over 0.85, 0.725, 0.4219, 0.0 (audio included: sequence parallel), 25 fps,
# 5 s (126 frames asked: 16 latent frames, 121 decoded).
COMFY_TEMPLATE_SETTINGS = Settings(
    loader={"distilled_lora_strength": 0.5, "distilled_lora_strength_stage_1": 0.5},
    sampler={"width": 640, "height": 352, "length": 121, "frame_rate": 25.0, "seed": 42, "steps": 8, "video_cfg": 1.0, "audio_cfg": 1.0,
             "stg_scale": 0.0, "rescale": 0.0, "modality_scale": 1.0, "audio_rescale": -1.0, "image_strength": 0.7},
    upscale={"seed": 42, "sigmas": "0.85, 0.725, 0.4219, 0.0", "stage2_parallel": "sp"},
    stage1_sigmas=(1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0),
    words=("ComfyUI's LTX-2.3 image-to-video template's recipe on the pack's nodes: the dev checkpoint with the distilled LoRA at 0.5 "
           "in both stages, CFG 1 (one conditional pass per step: sequence parallel over all GPUs), 8 manual sigmas into SP Sampler's "
           "sigmas input, the image at strength 0.7 in stage 1, stage 2 over 0.85, 0.725, 0.4219, 0.0 with the audio, 25 fps. Unlike the template, both stages step with "
           "Euler (the template: euler_ancestral_cfg_pp, then euler_cfg_pp) and the image goes through the official H.264 treatment (CRF 33)."),
)  # fmt: skip


@dataclass(frozen=True)
class Example:
    """One shipped workflow: the model version and pipeline whose defaults and files it carries, and
    the settings it sets over them (None: the recipe's official defaults)."""

    version: str
    pipeline: str
    image: bool = False
    tiny: bool = False  # the embedded random-weight bundle at a size CPU ranks run in seconds
    settings: Settings | None = None
    last_image: bool = False  # a last-frame image too (first/last-frame video), fed to both stages

    @property
    def recipe(self) -> PipelineDefaults:
        return DEFAULTS[(self.version, self.pipeline)]

    @property
    def files(self) -> dict:
        if self.tiny:
            return {name: embedded_entry(self.version) for name in LOADER_FILE_INPUTS}
        return MODEL_FILES[(self.version, self.pipeline)]


# The tiny examples' size: the stage-2 latent is 4x6 cells, so tiles overlap by 1 cell to fit 2x2
# tiles on 4 ranks. STG blocks stay empty there: the official block is past the tiny model's last.
TINY_SIZE = {"width": 96, "height": 64, "length": 9, "steps": 3, "overlap": 1}


IMAGE_STRENGTH_WIDGETS = {"image_strength": IMAGE_STRENGTH, "last_image_strength": IMAGE_STRENGTH}
"""SP Sampler's and TDP Upscale's image strengths: the images kept as given."""


def sampler_widgets(example: Example) -> dict:
    """SP Sampler's widget values: the recipe's official defaults (the tiny examples smaller)."""
    recipe = example.recipe
    video, audio = recipe.video_guidance, recipe.audio_guidance
    load_pack()
    same_as_rescale = importlib.import_module("comfyui_mgpu_pack.nodes.sampling_nodes").SAME_AS_RESCALE
    # One widget each for STG scale and modality scale: the official values are the same for video and audio.
    assert (video.stg_scale, video.modality_scale, video.stg_blocks) == (audio.stg_scale, audio.modality_scale, audio.stg_blocks)
    widgets = {
        "width": recipe.stage1_width, "height": recipe.stage1_height, "length": recipe.num_frames, "frame_rate": recipe.frame_rate,
        "seed": recipe.seed, "steps": recipe.steps, "video_cfg": video.cfg_scale, "audio_cfg": audio.cfg_scale,
        "stg_scale": video.stg_scale, "stg_blocks": ",".join(map(str, video.stg_blocks)), "rescale": video.rescale_scale,
        "modality_scale": video.modality_scale, "parallel": "(from loader)", "compile_blocks": False, "sampler": "(from recipe)",
        "audio_rescale": same_as_rescale if audio.rescale_scale == video.rescale_scale else audio.rescale_scale,
        **IMAGE_STRENGTH_WIDGETS,
    }  # fmt: skip
    if example.settings is not None:
        widgets.update(example.settings.sampler)
    if example.tiny:
        widgets.update({name: TINY_SIZE[name] for name in ("width", "height", "length")}, stg_blocks="")
        if example.settings is None:
            widgets["steps"] = TINY_SIZE["steps"]
    return widgets


@dataclass(frozen=True)
class Box:
    """A node's place on the canvas: ``pos`` is below the title bar (NODE_TITLE_HEIGHT above it)."""

    x: int
    y: int
    width: int
    height: int

    @property
    def pos(self) -> tuple[int, int]:
        return (self.x, self.y)

    @property
    def size(self) -> tuple[int, int]:
        return (self.width, self.height)

    def below(self, height: int, width: int | None = None, gap: int = 60) -> Box:
        """The box under this one, clear of its bottom edge and of the next title bar."""
        return Box(self.x, self.y + self.height + gap, width or self.width, height)

    def right(self, width: int, height: int, gap: int = 40) -> Box:
        return Box(self.x + self.width + gap, self.y, width, height)


# Sizes hold each node as ComfyUI's frontend 1.43 draws it in both modes: classic (LiteGraph) and
# "Nodes 2.0" (Vue), which draws widgets taller (e.g. the loader's 15 widgets need about 595 px there). The
# loader is wide enough for its combo labels and file names to show whole; TDP Upscale leaves room
# under its widgets for the stage-2 plan it prints there; MGPU Text Encode for several prompt lines.
# The output column stacks decode, Create Video and Save Video, so the whole graph shows at a zoom
# (initial_view) where the classic canvas still draws text. tests/e2e/test_browser_ui.py loads every
# workflow in both modes and fails on any overlap.
_LOADER = Box(40, 60, 500, 620)
_TEXT = _LOADER.right(440, 520)
_SAMPLER = _TEXT.right(360, 640)
_UPSCALE = _SAMPLER.right(400, 560)
_DECODE = _UPSCALE.right(480, 240)
_CREATE = _DECODE.below(120)
_FRAME_RATE = _LOADER.below(90, width=300)
LAYOUT = {
    "loader": _LOADER, "text": _TEXT, "sampler": _SAMPLER, "upscale": _UPSCALE, "decode": _DECODE, "create": _CREATE,
    "save": _CREATE.below(560), "frame_rate": _FRAME_RATE, "image": _TEXT.below(420), "note": _FRAME_RATE.below(420, width=_LOADER.width),
    "sigmas": _TEXT.below(420).below(100), "last_image": _TEXT.below(420).below(420),
}  # fmt: skip


def two_stage_graph(example: Example, prefix: str) -> list[Node]:
    recipe, files = example.recipe, example.files
    default_positive, negative = default_prompts()
    sampler = sampler_widgets(example)
    width, height = sampler["width"], sampler["height"]
    listed = ", ".join(f"{MODEL_SOURCES[name][1]}/{name}" for name in files.values() if name in MODEL_SOURCES)
    described = recipe_text(recipe, example.tiny) if example.settings is None else example.settings.words
    note = NOTE_TWO_STAGE.format(version=example.version, stage1=f"{width}x{height}", final=f"{2 * width}x{2 * height}", recipe=described,
                                 files=listed or "none (the embedded bundle)", embedded=embedded_entry(example.version))  # fmt: skip
    # A stage-2 schedule of TDP Upscale's own (two-stage) is written out; the recipe's official tail (distilled) left empty.
    declared = recipes.recipe(example.pipeline)
    sigmas = ", ".join(map(str, stage2_default_sigmas(example.pipeline))) if declared.upscale_sigmas != declared.stage2.sigmas else ""
    overlap = TINY_SIZE["overlap"] if example.tiny else TDP_OVERLAP
    nodes = [
        Node(1, "MGPULoadCheckpoint", LAYOUT["loader"].pos, {**files, "distilled_lora_strength": DISTILLED_LORA_STRENGTH, "gpus": "all", "gemma_mode": "sharded", "parallel": "auto",
                                                  "dtype": "bfloat16", "quantization": "none", "residency": "auto", "pipeline": example.pipeline,
                                                  **{field: recipe_strength() for field in recipes.strength_fields()}},
             size=LAYOUT["loader"].size, models=model_metadata(files)),
        Node(2, "MGPUTextEncode", LAYOUT["text"].pos, {"positive": IMAGE_PROMPT if example.image else default_positive, "negative": negative, "free_gemma": False},
             {"model": (1, 0)}, size=LAYOUT["text"].size),
        Node(3, "PrimitiveFloat", LAYOUT["frame_rate"].pos, {"value": recipe.frame_rate}, size=LAYOUT["frame_rate"].size, title="Frame rate"),
        Node(4, "MGPUSPSampler", LAYOUT["sampler"].pos, sampler, {"model": (1, 0), "positive": (2, 0), "negative": (2, 1), "frame_rate": (3, 0)}, size=LAYOUT["sampler"].size),
        Node(
            5, "MGPUTDPUpscale", LAYOUT["upscale"].pos,
            {"seed": recipe.seed, "sigmas": sigmas, "tiles": "auto", "overlap": overlap, "frame_rate": 0.0, "force_from_noise": False, "stage2_parallel": "auto",
             "sampler": "(from recipe)", **IMAGE_STRENGTH_WIDGETS},
            {"model": (1, 0), "av_latent": (4, 0), "positive": (2, 0)}, size=LAYOUT["upscale"].size,
        ),
        Node(6, "MGPUDistributedVAEDecode", LAYOUT["decode"].pos, {"seed": recipe.seed, "spatial_tile_pixels": DECODE_SPATIAL_TILE_PIXELS,
                                                        "temporal_tile_frames": DECODE_TEMPORAL_TILE_FRAMES},
             {"model": (1, 0), "av_latent": (5, 0)}, size=LAYOUT["decode"].size),
        Node(7, "CreateVideo", LAYOUT["create"].pos, {"fps": recipe.frame_rate}, {"images": (6, 0), "audio": (6, 1), "fps": (3, 0)}, size=LAYOUT["create"].size),
        Node(8, "SaveVideo", LAYOUT["save"].pos, {"filename_prefix": prefix, "format": "mp4", "codec": "h264"}, {"video": (7, 0)}, size=LAYOUT["save"].size),
        Node(9, "MarkdownNote", LAYOUT["note"].pos, {"text": note}, size=LAYOUT["note"].size),
    ]  # fmt: skip
    if example.image:
        nodes.append(Node(10, "LoadImage", LAYOUT["image"].pos, {"image": "example.png", "upload": "image"}, size=LAYOUT["image"].size))
        nodes[3].links["image"] = (10, 0)
        nodes[4].links["image"] = (10, 0)
    if example.last_image:
        assert example.settings is None, "the last image's box is where the settings' sigmas node goes"
        nodes.append(Node(12, "LoadImage", LAYOUT["last_image"].pos, {"image": "example_last.png", "upload": "image"}, size=LAYOUT["last_image"].size,
                          title="Last frame"))  # fmt: skip
        nodes[3].links["last_image"] = (12, 0)
        nodes[4].links["last_image"] = (12, 0)
    if example.settings is not None:
        nodes[0].widgets.update(example.settings.loader)
        nodes[2].widgets["value"] = example.settings.sampler["frame_rate"]
        nodes[4].widgets.update(example.settings.upscale)
        nodes.append(Node(11, "ManualSigmas", LAYOUT["sigmas"].pos, {"sigmas": ", ".join(map(str, example.settings.stage1_sigmas))},
                          size=LAYOUT["sigmas"].size, title="Stage-1 sigmas"))  # fmt: skip
        nodes[3].links["sigmas"] = (11, 0)
    return nodes


IMAGE_PROMPT = (
    "The scene in the picture comes to life: gentle natural motion, a slow push-in of the camera, "
    "ambient sound that fits the place."
)


def default_prompts() -> tuple[str, str]:
    """MGPU Text Encode's own defaults, so the examples and the node agree."""
    load_pack()
    text_nodes = importlib.import_module("comfyui_mgpu_pack.nodes.text_nodes")
    return text_nodes.DEFAULT_PROMPT, text_nodes.DEFAULT_NEGATIVE_PROMPT


@dataclass(frozen=True)
class Template:
    """One entry of ComfyUI's template browser: the example it shows and the words users search for.

    ComfyUI v0.20.1 lists a pack's templates by file name only (``GET /workflow_templates``) and its
    frontend (1.43.18) uses that name as the card's title, as its description (``-`` and ``_`` read
    as spaces) and as the only text its template search matches: so the UI file is named by
    ``title``, short enough for the card's one-line title (about 33 characters at 1600 px) and led by
    the words users search for (LTX-2.3, image to video). ``slug`` names the API twin
    (``workflows/api/SLUG.json``), short for command lines.
    ``description`` is the graph's ``extra.description`` (shown by frontends that read it)."""

    slug: str
    example: Example
    title: str
    description: str

    @property
    def file_stem(self) -> str:
        unsafe = sorted(set(self.title) & set(TITLE_UNSAFE_CHARACTERS))
        assert not unsafe, f"template title {self.title!r} has {unsafe}: not allowed in file names or template URLs"
        return self.title


# Not allowed in a Windows file name, or changing the meaning of the template's URL (# ? %).
TITLE_UNSAFE_CHARACTERS = '<>:"/\\|?*#%'

# In the order the template browser lists them (web/mgpu_panel.js orders the pack's templates by
# web/template_order.json): the no-download ones first, then LTX-2.3, then LTX-2.0.
TEMPLATES = [
    # The embedded random-weight bundles at a tiny size: try the whole graph with no download; the
    # e2e test queues the 2.0 one.
    Template("ltx23_t2v_tiny", Example("2.3", "two-stage", tiny=True), "LTX-2.3 Tiny Test — no download",
             "Try the whole LTX-2.3 two-stage graph with no download: the embedded tiny random-weight bundle (the output is noise)."),
    Template("ltx2_t2v_tiny", Example("2.0", "two-stage", tiny=True), "LTX-2.0 Tiny Test — no download",
             "Try the whole LTX-2.0 two-stage graph with no download: the embedded tiny random-weight bundle (the output is noise)."),
    Template("ltx23_flf_keyframes_tiny", Example("2.3", "keyframes", image=True, tiny=True, last_image=True), "LTX-2.3 Tiny Test — keyframes",
             "The LTX-2.3 keyframes graph, a first and a last image, on the embedded tiny random-weight bundle, no download (the output is noise)."),
    Template("ltx23_i2v_comfy_recipe_tiny", Example("2.3", "two-stage", image=True, tiny=True, settings=COMFY_TEMPLATE_SETTINGS),
             "LTX-2.3 Tiny Test — ComfyUI recipe",
             "ComfyUI's LTX-2.3 template settings on the embedded tiny random-weight bundle, no download (the output is noise)."),
    Template("ltx23_t2v_two_stage", Example("2.3", "two-stage"), "LTX-2.3 Text to Video (two-stage)",
             "LTX-2.3 text to video on all GPUs, two-stage recipe (30 steps, STG block 28): 1536x1024, 121 frames with audio."),
    Template("ltx23_i2v_two_stage", Example("2.3", "two-stage", image=True), "LTX-2.3 Image to Video (two-stage)",
             "LTX-2.3 image to video on all GPUs, two-stage recipe: the image is the first frame; 1536x1024, 121 frames with audio."),
    Template("ltx23_t2v_distilled", Example("2.3", "distilled"), "LTX-2.3 Text to Video (distilled)",
             "LTX-2.3 text to video on all GPUs, distilled recipe: 8 + 3 unguided steps; 1536x1024, 121 frames with audio."),
    Template("ltx23_i2v_distilled", Example("2.3", "distilled", image=True), "LTX-2.3 Image to Video (distilled)",
             "LTX-2.3 image to video on all GPUs, distilled recipe: the image is the first frame; 8 + 3 unguided steps."),
    Template("ltx23_t2v_hq", Example("2.3", "hq"), "LTX-2.3 Text to Video (HQ)",
             "LTX-2.3 text to video on all GPUs, HQ recipe: 15 res_2s steps with the distilled LoRA in both stages; 1920x1088, 121 frames with audio."),
    Template("ltx23_i2v_hq", Example("2.3", "hq", image=True), "LTX-2.3 Image to Video (HQ)",
             "LTX-2.3 image to video on all GPUs, HQ recipe: the image is the first frame; 15 res_2s steps, 1920x1088, 121 frames with audio."),
    Template("ltx23_i2v_comfy_recipe", Example("2.3", "two-stage", image=True, settings=COMFY_TEMPLATE_SETTINGS), "LTX-2.3 Image to Video (ComfyUI)",
             "LTX-2.3 image to video on all GPUs, ComfyUI's own template settings: distilled LoRA 0.5 in both stages, CFG 1, 8 + 3 steps, 1280x704."),
    Template("ltx23_flf_keyframes", Example("2.3", "keyframes", image=True, last_image=True), "LTX-2.3 First-Last Frame to Video",
             "LTX-2.3 first and last frame to video on all GPUs, keyframes recipe: both images guide the motion; 1536x1024, 121 frames with audio."),
    Template("ltx2_t2v_two_stage", Example("2.0", "two-stage"), "LTX-2.0 Text to Video (two-stage)",
             "LTX-2.0 text to video on all GPUs, two-stage recipe: 768x512 sampled, 1536x1024 out, 121 frames with audio."),
    Template("ltx2_i2v_two_stage", Example("2.0", "two-stage", image=True), "LTX-2.0 Image to Video (two-stage)",
             "LTX-2.0 image to video on all GPUs, two-stage recipe: the image is the first frame; 1536x1024, 121 frames with audio."),
    Template("ltx2_t2v_distilled", Example("2.0", "distilled"), "LTX-2.0 Text to Video (distilled)",
             "LTX-2.0 text to video on all GPUs, distilled recipe: 8 + 3 unguided steps; 1536x1024, 121 frames with audio."),
    Template("ltx2_i2v_distilled", Example("2.0", "distilled", image=True), "LTX-2.0 Image to Video (distilled)",
             "LTX-2.0 image to video on all GPUs, distilled recipe: the image is the first frame; 8 + 3 unguided steps."),
]  # fmt: skip
TEMPLATE_BY_SLUG = {template.slug: template for template in TEMPLATES}
EXAMPLES = {template.slug: template.example for template in TEMPLATES}
assert len(TEMPLATE_BY_SLUG) == len(TEMPLATES) and len({template.title for template in TEMPLATES}) == len(TEMPLATES)
# Every example is of a declared version and pipeline; the keyframes recipe has no example graph yet.
assert {(example.version, example.pipeline) for example in EXAMPLES.values()} <= set(DEFAULTS) and set(MODEL_FILES) == set(DEFAULTS)
assert sorted({example.version for example in EXAMPLES.values()}) == sorted(MODEL_VERSIONS)
WORKFLOWS = {name: (lambda name=name: two_stage_graph(EXAMPLES[name], f"video/{name}_mgpu")) for name in EXAMPLES}
TEMPLATE_ORDER_FILE = PACK_DIR / "web" / "template_order.json"


def ui_path(slug: str) -> Path:
    """The UI file of one example, as the template browser lists it (its thumbnail: the same stem, .jpg)."""
    return HERE / f"{TEMPLATE_BY_SLUG[slug].file_stem}.json"


def api_path(slug: str) -> Path:
    return HERE / "api" / f"{slug}.json"


def build(name: str, schemas: dict) -> tuple[dict, dict]:
    nodes = WORKFLOWS[name]()
    return to_ui(nodes, schemas, TEMPLATE_BY_SLUG[name].description, name), to_api(nodes, schemas)


# --- thumbnails -------------------------------------------------------------------------------------

THUMBNAIL_SIZE = (400, 300)
THUMBNAIL_QUALITY = 80
# Node colours by role, so the two stages, the decoder and the native nodes read apart at a glance.
NODE_COLOURS = {
    "MGPULoadCheckpoint": (86, 112, 160), "MGPUTextEncode": (96, 140, 96), "MGPUSPSampler": (170, 110, 60),
    "MGPUTDPUpscale": (150, 80, 140), "MGPUDistributedVAEDecode": (70, 140, 150), "MarkdownNote": (70, 70, 70),
}  # fmt: skip
NODE_LABELS = {"MGPULoadCheckpoint": "load", "MGPUTextEncode": "text", "MGPUSPSampler": "SP", "MGPUTDPUpscale": "TDP",
               "MGPUDistributedVAEDecode": "decode", "LoadImage": "image", "SaveVideo": "save"}  # fmt: skip
NATIVE_COLOUR = (110, 110, 110)
VERSION_COLOURS = {"2.0": (60, 120, 200), "2.3": (220, 130, 40)}


def thumbnail_caption(example: Example) -> tuple[str, str]:
    task = "first-last frame to video" if example.last_image else "image to video" if example.image else "text to video"
    steps = example.recipe.steps if example.settings is None else len(example.settings.stage1_sigmas) - 1
    detail = "embedded tiny bundle, no download" if example.tiny else f"{steps} + 3 steps on all GPUs"
    recipe = example.pipeline if example.settings is None else "ComfyUI recipe"
    return f"LTX-{example.version}  {recipe}", f"{task} · {detail}"


def render_thumbnail(ui_graph: dict, example: Example) -> bytes:
    """A JPEG of the graph as the canvas lays it out (nodes by role, links between them) under a
    caption naming the model version, pipeline and task. Pure drawing of the graph: reproducible."""
    from PIL import Image, ImageDraw, ImageFont

    width, height = THUMBNAIL_SIZE
    image = Image.new("RGB", THUMBNAIL_SIZE, (30, 30, 34))
    draw = ImageDraw.Draw(image)
    band = 78
    draw.rectangle((0, 0, width, band), fill=(18, 18, 20))
    draw.rectangle((0, band - 4, width, band), fill=VERSION_COLOURS[example.version])
    title, subtitle = thumbnail_caption(example)
    draw.text((14, 10), title, fill=(240, 240, 240), font=ImageFont.load_default(size=26))
    draw.text((14, 46), subtitle, fill=(200, 200, 200), font=ImageFont.load_default(size=15))
    boxes = {node["id"]: (node["pos"][0], node["pos"][1] - NODE_TITLE_HEIGHT, node["pos"][0] + node["size"][0], node["pos"][1] + node["size"][1])
             for node in ui_graph["nodes"]}  # fmt: skip
    left, top = min(box[0] for box in boxes.values()), min(box[1] for box in boxes.values())
    right, bottom = max(box[2] for box in boxes.values()), max(box[3] for box in boxes.values())
    margin, label_font = 12, ImageFont.load_default(size=12)
    scale = min((width - 2 * margin) / (right - left), (height - band - 2 * margin) / (bottom - top))

    def at(x: float, y: float) -> tuple[float, float]:
        return margin + (x - left) * scale, band + margin + (y - top) * scale

    for _link_id, source, _slot, target, _target_slot, _kind in ui_graph["links"]:
        start, end = at(boxes[source][2], (boxes[source][1] + boxes[source][3]) / 2), at(boxes[target][0], (boxes[target][1] + boxes[target][3]) / 2)
        draw.line((*start, *end), fill=(150, 150, 160), width=1)
    for node in ui_graph["nodes"]:
        x0, y0, x1, y1 = boxes[node["id"]]
        colour = NODE_COLOURS.get(node["type"], NATIVE_COLOUR)
        draw.rounded_rectangle((*at(x0, y0), *at(x1, y1)), radius=3, fill=tuple(channel // 2 for channel in colour), outline=colour, width=2)
        title_bottom = at(x1, y0 + NODE_TITLE_HEIGHT)[1]
        draw.rectangle((*at(x0, y0), at(x1, y0)[0], title_bottom), fill=colour)
        if node["type"] in NODE_LABELS:
            draw.text((at(x0, y0)[0] + 4, title_bottom + 3), NODE_LABELS[node["type"]], fill=(235, 235, 235), font=label_font)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=THUMBNAIL_QUALITY, optimize=True)
    return out.getvalue()


def template_order() -> list[str]:
    """The template browser's order of the pack's templates (their file names), for web/mgpu_panel.js:
    ComfyUI lists them in the order its server's directory listing happens to give."""
    return [template.file_stem for template in TEMPLATES]


def main() -> None:
    schemas = node_schemas()
    (HERE / "api").mkdir(exist_ok=True)
    for name in WORKFLOWS:
        ui, api = build(name, schemas)
        ui_path(name).write_text(json.dumps(ui, indent=2, ensure_ascii=False) + "\n")
        api_path(name).write_text(json.dumps(api, indent=2) + "\n")
        ui_path(name).with_suffix(".jpg").write_bytes(render_thumbnail(ui, EXAMPLES[name]))
        print(f"wrote workflows/{ui_path(name).name}, its .jpg and workflows/api/{name}.json")
    TEMPLATE_ORDER_FILE.write_text(json.dumps(template_order(), indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {TEMPLATE_ORDER_FILE.relative_to(PACK_DIR)}")


if __name__ == "__main__":
    main()
