"""Writes the shipped example workflows: each graph once, as a UI file (drag-and-drop, also listed in
ComfyUI's template browser under this pack) and as its API twin in ``api/`` (headless queueing:
``python -m mgpu_backend queue workflows/api/NAME.json``).

Run ``python workflows/make_workflows.py`` after changing a node's inputs; tests/test_workflows.py
checks the written files against the node definitions and each UI graph against its API twin.
``NATIVE_NODES`` lists the ComfyUI core nodes the graphs use, as /work/comfyui (January 2026)
defines them; the e2e test checks it against a running ComfyUI's /object_info.

This script only writes JSON; it never runs a workflow.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

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

EMBEDDED = "(embedded tiny LTX-2, random weights)"
OFFICIAL_FILES = {
    "ckpt_name": "ltx-2-19b-dev.safetensors",
    "distilled_lora": "ltx-2-19b-distilled-lora-384.safetensors",
    "spatial_upsampler": "ltx-2-spatial-upscaler-x2-1.0.safetensors",
    "gemma": "gemma-3-12b-it-qat-q4_0-unquantized",
}
TINY_FILES = {name: EMBEDDED for name in OFFICIAL_FILES}


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


def to_ui(nodes: list[Node], schemas: dict) -> dict:
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
            "properties": {"Node name for S&R": node.type}, "widgets_values": widgets_values,
        }  # fmt: skip
        if node.title:
            ui_node["title"] = node.title
        ui_nodes.append(ui_node)
    for link in links:
        assert link[4] is not None, f"link {link} targets an input the schema of node {by_id[link[3]].type} lacks"
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, "comfyui-mgpu/" + "/".join(node.type for node in nodes))),
        "revision": 0,
        "last_node_id": max(node.id for node in nodes),
        "last_link_id": len(links),
        "nodes": ui_nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 0.75, "offset": [40, 40]}},
        "version": 0.4,
    }


NOTE_TWO_STAGE = """## LTX-2 on all GPUs (comfyui-mgpu)

Stage 1 (**SP Sampler**) generates video and audio at {stage1} with sequence parallelism;
stage 2 (**TDP Upscale**) doubles it to {final} and refines it tile by tile on the GPUs;
**Distributed VAE Decode** decodes the tiles on the GPUs.

Files (ComfyUI/models): checkpoints/ltx-2-19b-dev.safetensors,
loras/ltx-2-19b-distilled-lora-384.safetensors,
latent_upscale_models/ltx-2-spatial-upscaler-x2-1.0.safetensors,
text_encoders/gemma-3-12b-it-qat-q4_0-unquantized/ (the whole Hugging Face folder).

No weights yet? Choose "(embedded tiny LTX-2, random weights)" in every file box of the loader
to try the graph (the output is noise). Frames must be 8k+1; the fleet panel is in the sidebar (MGPU).
"""


def two_stage_graph(files: dict, *, prompt: str | None = None, width: int, height: int, length: int, steps: int, prefix: str, image: bool, overlap: int = 4) -> list[Node]:
    default_positive, negative = default_prompts()
    x = 40
    nodes = [
        Node(1, "MGPULoadCheckpoint", (x, 60), {**files, "distilled_lora_strength": 1.0, "gpus": "all", "gemma_mode": "sharded", "parallel": "auto", "dtype": "bfloat16", "quantization": "none", "residency": "auto"}, size=(380, 340)),
        Node(2, "MGPUTextEncode", (x + 420, 60), {"positive": prompt or default_positive, "negative": negative, "free_gemma": False}, {"model": (1, 0)}, size=(420, 360)),
        Node(3, "PrimitiveFloat", (x, 420), {"value": 24.0}, size=(260, 60), title="Frame rate"),
        Node(
            4, "MGPUSPSampler", (x + 880, 60),
            {"width": width, "height": height, "length": length, "frame_rate": 24.0, "seed": 10, "steps": steps,
             "video_cfg": 3.0, "audio_cfg": 7.0, "stg_scale": 1.0, "stg_blocks": "", "rescale": 0.7,
             "modality_scale": 3.0, "parallel": "(from loader)", "compile_blocks": False},
            {"model": (1, 0), "positive": (2, 0), "negative": (2, 1), "frame_rate": (3, 0)}, size=(340, 480),
        ),
        Node(
            5, "MGPUTDPUpscale", (x + 1260, 60),
            {"seed": 10, "sigmas": "0.625, 0.4, 0.0", "tiles": "auto", "overlap": overlap, "frame_rate": 0.0, "force_from_noise": False},
            {"model": (1, 0), "av_latent": (4, 0), "positive": (2, 0)}, size=(340, 300),
        ),
        Node(6, "MGPUDistributedVAEDecode", (x + 1640, 60), {"seed": 10, "spatial_tile_pixels": 512, "temporal_tile_frames": 64}, {"model": (1, 0), "av_latent": (5, 0)}, size=(340, 200)),
        Node(7, "CreateVideo", (x + 1640, 320), {"fps": 24.0}, {"images": (6, 0), "audio": (6, 1), "fps": (3, 0)}, size=(300, 100)),
        Node(8, "SaveVideo", (x + 2020, 60), {"filename_prefix": prefix, "format": "mp4", "codec": "h264"}, {"video": (7, 0)}, size=(480, 520)),
        Node(9, "MarkdownNote", (x, 520), {"text": NOTE_TWO_STAGE.format(stage1=f"{width}x{height}", final=f"{2 * width}x{2 * height}")}, size=(800, 300)),
    ]  # fmt: skip
    if image:
        nodes.append(Node(10, "LoadImage", (x + 420, 460), {"image": "example.png", "upload": "image"}, size=(320, 360)))
        nodes[3].links["image"] = (10, 0)
        nodes[4].links["image"] = (10, 0)
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


WORKFLOWS = {
    "ltx2_t2v_two_stage": lambda: two_stage_graph(OFFICIAL_FILES, width=768, height=512, length=121, steps=40, prefix="video/ltx2_t2v_mgpu", image=False),
    "ltx2_i2v_two_stage": lambda: two_stage_graph(OFFICIAL_FILES, width=768, height=512, length=121, steps=40, prefix="video/ltx2_i2v_mgpu", image=True, prompt=IMAGE_PROMPT),
    # The embedded random-weight bundle at a tiny size: tries the whole graph with no download,
    # and is what the e2e test queues. Its stage-2 latent is 4x6 cells, so tiles overlap by 1 cell
    # to fit 2x2 tiles on 4 ranks.
    "ltx2_t2v_tiny": lambda: two_stage_graph(TINY_FILES, width=96, height=64, length=9, steps=3, prefix="video/ltx2_tiny_mgpu", image=False, overlap=1),
}


def build(name: str, schemas: dict) -> tuple[dict, dict]:
    nodes = WORKFLOWS[name]()
    return to_ui(nodes, schemas), to_api(nodes, schemas)


def main() -> None:
    schemas = node_schemas()
    (HERE / "api").mkdir(exist_ok=True)
    for name in WORKFLOWS:
        ui, api = build(name, schemas)
        (HERE / f"{name}.json").write_text(json.dumps(ui, indent=2) + "\n")
        (HERE / "api" / f"{name}.json").write_text(json.dumps(api, indent=2) + "\n")
        print(f"wrote workflows/{name}.json and workflows/api/{name}.json")


if __name__ == "__main__":
    main()
