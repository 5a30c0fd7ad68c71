"""Writes ComfyUI's own LTX-2.3 graphs with the MGPU fleet's loader, from the templates ComfyUI installs.

For each of ComfyUI's LTX-2.3 templates (package ``comfyui-workflow-templates``: image to video,
text to video, first/last frame to video, image+audio to video) this writes, into this folder:

- ``ltx23_NAME.json``: the template as ComfyUI ships it (UI format, subgraph and all), with one edit:
  its ``Load Checkpoint`` is ``Load Checkpoint (MGPU fleet)`` (``comfy_templates.swap_ui_model_loader``).
  Its nodes keep ComfyUI's model metadata (``properties.models``), so ComfyUI offers to download
  ComfyUI's own 2.3 files (``ltx-2.3-22b-dev-fp8.safetensors``, the distilled LoRA, the upscaler, Gemma).
- ``ltx23_NAME_api.json``: its API twin (``comfy_templates.ui_to_api``), for ``POST /prompt`` or
  ``python -m mgpu_backend queue``.
- ``ltx23_NAME_tiny_api.json``: the same API graph on the project's tiny LTX-2.3 bundle, which needs no
  download (``mgpu_backend.bundles.tiny``: copy its checkpoint, LoRA and upsampler into ComfyUI's
  checkpoints, loras and latent_upscale_models folders under the names the graph gives): 192x128,
  9 frames at 8 fps, ComfyUI's Load Checkpoint (swap it for the fleet's with
  ``comfy_templates.swap_model_loader``), and the prompts encoded by MGPU Text Encode from the
  embedded tiny bundle, since ComfyUI's LTXAV text encoder loader builds only the released Gemma 3 12B.
- ``models.json``: per graph, the model files it names (name, url, ComfyUI models folder).

The node definitions come from ``tests/data/comfy_object_info_ltx23.json``, saved from a running
ComfyUI v0.20.1 with this pack by ``--refresh-object-info COMFYUI_DIR`` (only the node types these
graphs use). Run with a Python that has ComfyUI's templates installed (ComfyUI's own):

    /path/to/comfy-venv/bin/python workflows/comfy/make_comfy_workflows.py
    /path/to/comfy-venv/bin/python workflows/comfy/make_comfy_workflows.py --refresh-object-info ~/ComfyUI

This script writes JSON files only; it runs no workflow.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACK_DIR = HERE.parents[1]
sys.path.insert(0, str(PACK_DIR))  # this checkout's mgpu_backend, whichever Python runs the script

from mgpu_backend.bundles import tiny  # noqa: E402
from mgpu_backend.tools import comfy_templates  # noqa: E402

TEMPLATES_PACKAGE = "comfyui_workflow_templates_media_video"
GRAPHS = {  # our name -> ComfyUI's template
    "ltx23_i2v": "video_ltx2_3_i2v",
    "ltx23_t2v": "video_ltx2_3_t2v",
    "ltx23_flf2v": "video_ltx2_3_flf2v",
    "ltx23_ia2v": "video_ltx2_3_ia2v",
}
OBJECT_INFO = PACK_DIR / "tests" / "data" / "comfy_object_info_ltx23.json"
EXTRA_NODE_TYPES = ("MGPUCheckpointLoader", "MGPUDiffusionModelLoader", "UNETLoader", "SaveLatent", "SaveImage")
"""Node types kept in the saved definitions besides the templates' own: the drop-in loaders, the
loader they replace, and the lossless outputs the end-to-end test adds."""

TINY_SIZE = {"width": 192, "height": 128, "duration": 1, "fps": 8}
"""The tiny twins' settings, by the label of the subgraph input that sets them: 9 frames (duration x
fps + 1, as the templates compute it); stage 1 at half size, 96x64, the smallest the latent grid
(32 pixels) and EmptyLTXVLatentVideo's minimum width (64) allow with a non-square frame."""
TINY_TEXT_GRAPH = PACK_DIR / "workflows" / "api" / "ltx23_t2v_tiny.json"
"""The pack's tiny LTX-2.3 graph: its Load Checkpoint MGPU (the embedded tiny bundle) is the one the
tiny twins encode their prompts with."""
TINY_LOADER_ID, TINY_TEXT_ID = "mgpu_tiny_model", "mgpu_text_encode"


def templates_dir() -> Path:
    spec = importlib.util.find_spec(TEMPLATES_PACKAGE)
    if spec is None:
        raise SystemExit(
            f"ComfyUI's workflow templates ({TEMPLATES_PACKAGE}, from pip's comfyui-workflow-templates) are not installed "
            "in this Python: run the script with ComfyUI's Python"
        )
    return Path(spec.origin).parent / "templates"


def template(name: str) -> dict:
    return json.loads((templates_dir() / f"{GRAPHS[name]}.json").read_text())


def node_types(workflow: dict) -> set[str]:
    subgraphs = (workflow.get("definitions") or {}).get("subgraphs", [])
    ids = {sub["id"] for sub in subgraphs}
    return {node["type"] for nodes in [workflow["nodes"], *(sub["nodes"] for sub in subgraphs)] for node in nodes} - ids


def refresh_object_info(comfyui_dir: Path, python: str) -> None:
    """Save the definitions of the node types the graphs use from a real ComfyUI with this pack."""
    from mgpu_backend.tools.comfy_server import ComfyUIServer

    wanted = set(EXTRA_NODE_TYPES)
    for name in GRAPHS:
        wanted |= node_types(template(name))
    with tempfile.TemporaryDirectory(prefix="comfy-object-info-") as base:
        (Path(base) / "custom_nodes").mkdir()
        (Path(base) / "custom_nodes" / "comfyui-mgpu").symlink_to(PACK_DIR, target_is_directory=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACK_DIR), os.environ.get("PYTHONPATH")]))}
        server = ComfyUIServer(comfyui_dir, Path(base), ["--cpu"], python=python, env=env)  # this checkout's mgpu_backend
        try:
            server.wait_ready("/object_info/MGPUCheckpointLoader")
            info = comfy_templates.fetch_object_info(server.url)
        finally:
            server.stop()
    known = {name: info[name] for name in sorted(wanted - comfy_templates.VIRTUAL_NODES) if name in info}
    missing = wanted - comfy_templates.VIRTUAL_NODES - set(known)
    if missing:
        raise SystemExit(f"ComfyUI in {comfyui_dir} has no node types {sorted(missing)}")
    OBJECT_INFO.parent.mkdir(parents=True, exist_ok=True)
    OBJECT_INFO.write_text(json.dumps(known, indent=1) + "\n")  # unsorted: a dynamic combo's widgets are in key order
    print(f"wrote {OBJECT_INFO.relative_to(PACK_DIR)}: {len(known)} node definitions")


# -- the tiny twin ------------------------------------------------------------------------------------

def tiny_model_files(workflow: dict) -> dict[str, str]:
    """ComfyUI's LTX-2.3 file names the template loads -> the tiny bundle's file in the same role."""
    names = tiny.file_names("2.3")
    tiny_files = {}
    for entry in comfy_templates.model_files(workflow):
        name, folder = entry["name"], entry["directory"]
        if folder == "text_encoders":
            continue  # the tiny twin encodes with MGPU Text Encode
        if folder == "checkpoints":
            tiny_files[name] = names.distilled_checkpoint if "distilled" in name else names.checkpoint
        elif folder == "loras" and "distilled" in name:
            tiny_files[name] = names.distilled_lora
        elif folder == "latent_upscale_models":
            tiny_files[name] = names.spatial_upsampler
    return tiny_files


def labelled_settings(workflow: dict) -> dict[str, list[tuple[str, str]]]:
    """Each subgraph input's label (``width``, ``fps``, ...) -> the (API node id, input name) it sets."""
    settings: dict[str, list] = {}
    definitions = {sub["id"]: sub for sub in (workflow.get("definitions") or {}).get("subgraphs", [])}
    for instance in workflow["nodes"]:
        definition = definitions.get(instance["type"])
        if definition is None:
            continue
        nodes = {node["id"]: node for node in definition["nodes"]}
        links = {link["id"]: link for link in definition["links"]}
        for entry in definition["inputs"]:
            for link_id in entry.get("linkIds") or []:
                target = nodes[links[link_id]["target_id"]]
                name = target["inputs"][links[link_id]["target_slot"]]["name"]
                settings.setdefault(entry.get("label") or entry["name"], []).append((f"{instance['id']}:{target['id']}", name))
    return settings


def consumers(graph: dict, node_id: str) -> list[tuple[str, str, int]]:
    """(node id, input name, output slot) of every input fed by ``node_id``."""
    return [
        (target_id, name, value[1]) for target_id, entry in graph.items() for name, value in entry["inputs"].items()
        if isinstance(value, list) and len(value) == 2 and value[0] == node_id
    ]  # fmt: skip


def tiny_text_loader() -> dict:
    graph = json.loads(TINY_TEXT_GRAPH.read_text())
    (loader,) = [entry for entry in graph.values() if entry["class_type"] == "MGPULoadCheckpoint"]
    return copy.deepcopy(loader)


def tiny_twin(workflow: dict, api_graph: dict) -> dict:
    """The API graph on the tiny bundle: its model files, tiny sizes, prompts encoded by MGPU Text Encode."""
    graph = copy.deepcopy(api_graph)
    files = tiny_model_files(workflow)
    for entry in graph.values():
        for name, value in entry["inputs"].items():
            if isinstance(value, str) and value in files:
                entry["inputs"][name] = files[value]
    settings = labelled_settings(workflow)
    for label, value in TINY_SIZE.items():
        if label not in settings:
            raise SystemExit(f"the template has no subgraph input labelled {label!r}; update TINY_SIZE for it")
        for node_id, name in settings[label]:
            current = graph[node_id]["inputs"][name]
            if isinstance(current, list):
                raise SystemExit(f"{node_id}.{name} ({label}) is fed by a link, not a value the tiny twin can set")
            graph[node_id]["inputs"][name] = type(current)(value)

    # The prompts: every CLIPTextEncode is replaced by MGPU Text Encode's output of its role.
    encoders = [node_id for node_id, entry in graph.items() if entry["class_type"] == "CLIPTextEncode"]
    texts = {}
    for node_id in encoders:
        roles = {name for _, name, _ in consumers(graph, node_id)}
        if len(roles) != 1 or not roles <= {"positive", "negative"}:
            raise SystemExit(f"CLIPTextEncode {node_id} feeds {sorted(roles)}, not one positive or negative input")
        (role,) = roles
        if role in texts:
            raise SystemExit(f"two CLIPTextEncode nodes feed '{role}' inputs; the tiny twin encodes one prompt of each")
        texts[role] = (node_id, graph[node_id]["inputs"]["text"])
    if set(texts) != {"positive", "negative"}:
        raise SystemExit(f"the graph encodes only {sorted(texts)} prompts")
    for slot, role in enumerate(("positive", "negative")):
        node_id = texts[role][0]
        for target_id, name, _ in consumers(graph, node_id):
            graph[target_id]["inputs"][name] = [TINY_TEXT_ID, slot]
    for node_id, _ in texts.values():
        clip = graph[node_id]["inputs"]["clip"][0]
        del graph[node_id]
        if not consumers(graph, clip):
            del graph[clip]  # LTXAVTextEncoderLoader, now unused
    graph[TINY_LOADER_ID] = tiny_text_loader()
    graph[TINY_TEXT_ID] = {
        "inputs": {"model": [TINY_LOADER_ID, 0], "positive": texts["positive"][1], "negative": texts["negative"][1]},
        "class_type": "MGPUTextEncode", "_meta": {"title": "MGPU Text Encode"},
    }
    for entry in graph.values():
        if entry["class_type"] == "SaveVideo":
            entry["inputs"]["filename_prefix"] += "_tiny"
    return graph


def write_json(path: Path, value) -> None:
    path.write_text(json.dumps(value, indent=1, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refresh-object-info", type=Path, metavar="COMFYUI_DIR",
                        help="first save the node definitions from this ComfyUI checkout (started with --cpu, this pack installed)")
    parser.add_argument("--comfyui-python", default=sys.executable, help="the Python that runs that ComfyUI (default: this one)")
    args = parser.parse_args()
    if args.refresh_object_info:
        refresh_object_info(args.refresh_object_info, args.comfyui_python)
    object_info = comfy_templates.load_object_info(OBJECT_INFO)
    models = {}
    for name in GRAPHS:
        workflow = template(name)
        swapped = comfy_templates.swap_ui_model_loader(workflow)
        api_graph = comfy_templates.ui_to_api(swapped, object_info)
        stock_api = comfy_templates.ui_to_api(workflow, object_info)
        expected = comfy_templates.swap_model_loader(stock_api)
        for entry in expected.values():
            if entry["class_type"] == "MGPUCheckpointLoader":
                entry["inputs"]["weight_dtype"] = "default"  # its optional widget, which the UI queues at its default
        if api_graph != expected:
            raise SystemExit(f"{name}: the swapped UI's API graph differs from the template's API graph with the loader swapped")
        write_json(HERE / f"{name}.json", swapped)
        write_json(HERE / f"{name}_api.json", api_graph)
        write_json(HERE / f"{name}_tiny_api.json", tiny_twin(workflow, stock_api))
        models[name] = comfy_templates.model_files(workflow)
        print(f"{name}: {len(api_graph)} API nodes from {GRAPHS[name]}")
    write_json(HERE / "models.json", models)


if __name__ == "__main__":
    main()
