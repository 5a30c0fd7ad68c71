"""The shipped example workflows against the node definitions: every node type, input name, widget
value and link type in each UI graph and each API twin, and each UI graph against its API twin.

Our nodes are checked against their own INPUT_TYPES / RETURN_TYPES; ComfyUI core nodes against the
table in workflows/make_workflows.py (taken from ComfyUI of January 2026; the e2e test checks that
table against a running ComfyUI's /object_info)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

PACK_DIR = Path(__file__).resolve().parent.parent
WORKFLOWS = PACK_DIR / "workflows"


def load_builder():
    name = "comfyui_mgpu_make_workflows"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, WORKFLOWS / "make_workflows.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


builder = load_builder()
SCHEMAS = builder.node_schemas()
UI_FILES = sorted(WORKFLOWS.glob("*.json"))
API_FILES = sorted((WORKFLOWS / "api").glob("*.json"))


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def widget_value_problem(kind: str, allowed, value) -> str | None:
    if kind in ("INT", "FLOAT"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "INT" and not isinstance(value, int)):
            return f"{value!r} is not {kind}"
        low, high = allowed
        return None if low <= value <= high else f"{value} outside [{low}, {high}]"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{value!r} is not a string"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not a boolean"
    if kind in ("COMBO", "CONTROL"):
        if allowed is None:
            return None if isinstance(value, str) and value else f"{value!r} is not a file name"
        return None if value in allowed else f"{value!r} is not one of {allowed}"
    return None


def model_file_problem(value) -> str | None:
    """Loader file combos list the user's files; the examples must name the official files or the tiny bundle."""
    known = set(builder.OFFICIAL_FILES.values()) | set(builder.DISTILLED_FILES.values()) | {builder.EMBEDDED}
    return None if value in known else f"{value!r} is neither an official LTX-2 file name nor the embedded bundle"


def check_widget(node_type: str, name: str, kind: str, allowed, value) -> str | None:
    if node_type == "MGPULoadCheckpoint" and name in builder.OFFICIAL_FILES:
        return model_file_problem(value)
    return widget_value_problem(kind, allowed, value)


# --- UI graphs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", UI_FILES, ids=lambda path: path.name)
def test_ui_graph_nodes_inputs_widgets_and_links_match_the_node_definitions(path):
    graph = read(path)
    assert graph["version"] == 0.4 and "extra" in graph and graph["last_link_id"] == len(graph["links"])
    nodes = {node["id"]: node for node in graph["nodes"]}
    assert graph["last_node_id"] == max(nodes)
    problems = []
    for node in graph["nodes"]:
        if node["type"] in builder.UI_ONLY_NODES:
            continue
        if node["type"] not in SCHEMAS:
            problems.append(f"node {node['id']}: unknown type {node['type']!r}")
            continue
        schema = SCHEMAS[node["type"]]
        sockets = {name: (kind, optional) for name, kind, optional in schema["sockets"]}
        widgets = {name: kind for name, kind, _ in schema["widgets"]}
        for entry in node["inputs"]:
            expected = sockets.get(entry["name"], (widgets.get(entry["name"]), None))[0]
            if expected is None:
                problems.append(f"node {node['id']} {node['type']}: no input {entry['name']!r}")
            elif entry["type"] != expected:
                problems.append(f"node {node['id']} {node['type']}.{entry['name']}: type {entry['type']} != {expected}")
            if "widget" in entry and entry["widget"] != {"name": entry["name"]}:
                problems.append(f"node {node['id']}: widget socket {entry} names another widget")
        connected = {entry["name"] for entry in node["inputs"] if entry["link"] is not None}
        missing = [name for name, (_, optional) in sockets.items() if not optional and name not in connected]
        if missing:
            problems.append(f"node {node['id']} {node['type']}: required inputs {missing} are not connected")
        if len(node["widgets_values"]) != len(schema["widgets"]):
            problems.append(f"node {node['id']} {node['type']}: {len(node['widgets_values'])} widget values for {len(schema['widgets'])} widgets")
            continue
        for (name, kind, allowed), value in zip(schema["widgets"], node["widgets_values"]):
            problem = check_widget(node["type"], name, kind, allowed, value)
            if problem:
                problems.append(f"node {node['id']} {node['type']}.{name}: {problem}")
        if [output["type"] for output in node["outputs"]] != [kind for _, kind in schema["outputs"]]:
            problems.append(f"node {node['id']} {node['type']}: outputs {[o['type'] for o in node['outputs']]} != {schema['outputs']}")
    for link_id, source, source_slot, target, target_slot, kind in graph["links"]:
        source_outputs = nodes[source]["outputs"]
        target_input = nodes[target]["inputs"][target_slot]
        if source_outputs[source_slot]["type"] != kind:
            problems.append(f"link {link_id}: carries {kind} but output {source}:{source_slot} is {source_outputs[source_slot]['type']}")
        if link_id not in (source_outputs[source_slot]["links"] or []):
            problems.append(f"link {link_id}: missing from output {source}:{source_slot}'s links")
        if target_input["link"] != link_id or target_input["type"] != kind:
            problems.append(f"link {link_id}: target {target}:{target_slot} is {target_input}")
    assert problems == [], "\n".join(problems)


def ui_to_api(graph: dict) -> dict:
    """An independent reading of a UI graph as ComfyUI's 'Export (API)' would write it."""
    links = {link[0]: link for link in graph["links"]}
    prompt = {}
    for node in graph["nodes"]:
        if node["type"] in builder.UI_ONLY_NODES:
            continue
        schema = SCHEMAS[node["type"]]
        linked = {entry["name"]: [str(links[entry["link"]][1]), links[entry["link"]][2]] for entry in node["inputs"] if entry["link"] is not None}
        inputs = {name: linked[name] for name, _, _ in schema["sockets"] if name in linked}
        for (name, kind, _), value in zip(schema["widgets"], node["widgets_values"]):
            if kind != "CONTROL" and name not in builder.API_ONLY_WIDGETS:
                inputs[name] = linked.get(name, value)
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


def test_every_ui_graph_has_an_api_twin_and_they_describe_the_same_prompt():
    assert sorted(path.name for path in UI_FILES) == sorted(path.name for path in API_FILES)
    for ui_path in UI_FILES:
        api_prompt = read(WORKFLOWS / "api" / ui_path.name)
        stripped = {node_id: {"class_type": node["class_type"], "inputs": node["inputs"]} for node_id, node in api_prompt.items()}
        assert ui_to_api(read(ui_path)) == stripped, f"{ui_path.name} and api/{ui_path.name} disagree"


# --- API prompts ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", API_FILES, ids=lambda path: path.name)
def test_api_prompt_inputs_and_link_types_match_the_node_definitions(path):
    prompt = read(path)
    problems = []
    for node_id, node in prompt.items():
        schema = SCHEMAS.get(node["class_type"])
        if schema is None:
            problems.append(f"node {node_id}: unknown class_type {node['class_type']!r}")
            continue
        sockets = {name: (kind, optional) for name, kind, optional in schema["sockets"]}
        widgets = {name: (kind, allowed) for name, kind, allowed in schema["widgets"] if kind != "CONTROL" and name not in builder.API_ONLY_WIDGETS}
        unknown = set(node["inputs"]) - set(sockets) - set(widgets)
        missing = {name for name, (_, optional) in sockets.items() if not optional} | set(widgets)
        missing -= set(node["inputs"])
        if unknown or missing:
            problems.append(f"node {node_id} {node['class_type']}: unknown inputs {sorted(unknown)}, missing {sorted(missing)}")
        for name, value in node["inputs"].items():
            expected = sockets.get(name, widgets.get(name, (None,)))[0]
            if isinstance(value, list):
                source, slot = value
                source_node = prompt.get(source)
                if source_node is None:
                    problems.append(f"node {node_id}.{name}: links to missing node {source}")
                    continue
                produced = SCHEMAS[source_node["class_type"]]["outputs"][slot][1]
                if produced != expected:
                    problems.append(f"node {node_id}.{name}: wants {expected}, node {source} slot {slot} gives {produced}")
            elif name in widgets:
                problem = check_widget(node["class_type"], name, *widgets[name], value)
                if problem:
                    problems.append(f"node {node_id} {node['class_type']}.{name}: {problem}")
            else:
                problems.append(f"node {node_id}.{name}: socket input {expected} given a literal {value!r}")
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("path", API_FILES, ids=lambda path: path.name)
def test_graphs_end_in_native_create_video_and_save_video_fed_by_our_image_and_audio(path):
    prompt = read(path)
    by_type = {}
    for node_id, node in prompt.items():
        by_type.setdefault(node["class_type"], []).append(node_id)
    (decode,) = by_type["MGPUDistributedVAEDecode"]
    (create,) = by_type["CreateVideo"]
    (save,) = by_type["SaveVideo"]
    assert prompt[create]["inputs"]["images"] == [decode, 0] and prompt[create]["inputs"]["audio"] == [decode, 1]
    assert prompt[save]["inputs"]["video"] == [create, 0] and prompt[save]["inputs"]["format"] == "mp4"
    # CreateVideo's fps and SP Sampler's frame_rate come from one value, so the video plays at the sampled rate.
    (sampler,) = by_type["MGPUSPSampler"]
    assert prompt[create]["inputs"]["fps"] == prompt[sampler]["inputs"]["frame_rate"]
    chain = [by_type[name][0] for name in ("MGPUSPSampler", "MGPUTDPUpscale", "MGPUDistributedVAEDecode")]
    assert prompt[chain[1]]["inputs"]["av_latent"] == [chain[0], 0] and prompt[chain[2]]["inputs"]["av_latent"] == [chain[1], 0]


def test_two_stage_examples_name_the_official_files_and_the_tiny_one_the_embedded_bundle():
    for name, expected in (("ltx2_t2v_two_stage", builder.OFFICIAL_FILES), ("ltx2_i2v_two_stage", builder.OFFICIAL_FILES), ("ltx2_t2v_tiny", builder.TINY_FILES)):
        prompt = read(WORKFLOWS / "api" / f"{name}.json")
        (loader,) = [node for node in prompt.values() if node["class_type"] == "MGPULoadCheckpoint"]
        assert {key: loader["inputs"][key] for key in expected} == expected, name
    i2v = read(WORKFLOWS / "api" / "ltx2_i2v_two_stage.json")
    image_users = sorted(node["class_type"] for node in i2v.values() if "image" in node["inputs"] and isinstance(node["inputs"]["image"], list))
    assert image_users == ["MGPUSPSampler", "MGPUTDPUpscale"]


def test_tiny_prompt_is_small_enough_for_cpu_ranks():
    prompt = read(WORKFLOWS / "api" / "ltx2_t2v_tiny.json")
    (sampler,) = [node["inputs"] for node in prompt.values() if node["class_type"] == "MGPUSPSampler"]
    assert sampler["width"] * sampler["height"] <= 128 * 192 and sampler["length"] <= 17 and sampler["steps"] <= 4, sampler


def test_shipped_files_are_what_make_workflows_writes():
    for name in builder.WORKFLOWS:
        ui, api_prompt = builder.build(name, SCHEMAS)
        assert read(WORKFLOWS / f"{name}.json") == ui, f"workflows/{name}.json is stale: run python workflows/make_workflows.py"
        assert read(WORKFLOWS / "api" / f"{name}.json") == api_prompt, f"workflows/api/{name}.json is stale"


def test_ui_graphs_sit_where_comfyui_lists_custom_node_templates():
    # ComfyUI's /workflow_templates globs custom_nodes/*/<folder>/*.json for these folder names
    # (app/custom_node_manager.py); API prompts must stay out of that glob, in a subfolder.
    assert UI_FILES and all(path.parent.name == "workflows" for path in UI_FILES)
    assert all("nodes" in read(path) for path in UI_FILES)
    assert all("nodes" not in read(path) for path in API_FILES)


# --- model metadata, descriptions, layout, the distilled examples ----------------------------------------


LOADER_FILE_FOLDERS = {"ckpt_name": "checkpoints", "distilled_lora": "loras", "spatial_upsampler": "latent_upscale_models", "gemma": "text_encoders"}


@pytest.mark.parametrize("path", UI_FILES, ids=lambda path: path.name)
def test_ui_loader_carries_comfyui_model_metadata_for_every_file_it_names(path):
    graph = read(path)
    (loader,) = [node for node in graph["nodes"] if node["type"] == "MGPULoadCheckpoint"]
    widgets = dict(zip([name for name, _, _ in SCHEMAS["MGPULoadCheckpoint"]["widgets"]], loader["widgets_values"], strict=True))
    named = {widgets[name]: folder for name, folder in LOADER_FILE_FOLDERS.items() if widgets[name] not in (builder.EMBEDDED, builder.NO_FILE)}
    models = loader["properties"].get("models", [])
    assert {model["name"]: model["directory"] for model in models} == named, path.name
    for model in models:
        assert set(model) == {"name", "url", "directory"}
        assert model["url"].startswith("https://huggingface.co/") and model["url"].endswith("/" + model["name"]), model


@pytest.mark.parametrize("path", UI_FILES, ids=lambda path: path.name)
def test_ui_graph_has_a_one_line_description(path):
    description = read(path)["extra"]["description"]
    assert description.strip() and "\n" not in description and len(description) <= 160, description


@pytest.mark.parametrize("path", UI_FILES, ids=lambda path: path.name)
def test_no_node_overlaps_another_title_bars_included(path):
    boxes = [
        (node["id"], node["pos"][0], node["pos"][1] - builder.NODE_TITLE_HEIGHT, node["pos"][0] + node["size"][0], node["pos"][1] + node["size"][1])
        for node in read(path)["nodes"]
    ]  # fmt: skip
    overlapping = [
        (first[0], second[0])
        for index, first in enumerate(boxes) for second in boxes[index + 1:]
        if first[1] < second[3] and second[1] < first[3] and first[2] < second[4] and second[2] < first[4]
    ]  # fmt: skip
    assert overlapping == [], f"{path.name}: nodes overlap: {overlapping}"


def test_distilled_examples_load_the_distilled_checkpoint_and_run_the_recipe_defaults():
    from mgpu_backend.ltx.schema import defaults_for

    recipe = defaults_for("2.0", "distilled")
    for name in ("ltx2_t2v_distilled", "ltx2_i2v_distilled"):
        prompt = read(WORKFLOWS / "api" / f"{name}.json")
        by_type = {node["class_type"]: node["inputs"] for node in prompt.values()}
        loader = by_type["MGPULoadCheckpoint"]
        assert loader["pipeline"] == "distilled" and loader["ckpt_name"] == "ltx-2-19b-distilled.safetensors" and loader["distilled_lora"] == "(none)"
        sampler = by_type["MGPUSPSampler"]
        assert (sampler["width"], sampler["height"], sampler["length"], sampler["steps"]) == (recipe.stage1_width, recipe.stage1_height, recipe.num_frames, recipe.steps)
        assert (sampler["video_cfg"], sampler["stg_scale"], sampler["modality_scale"]) == (1.0, 0.0, 1.0)
        assert by_type["MGPUTDPUpscale"]["sigmas"] == "" and by_type["MGPUTDPUpscale"]["stage2_parallel"] == "auto"
    i2v = read(WORKFLOWS / "api" / "ltx2_i2v_distilled.json")
    assert sorted(node["class_type"] for node in i2v.values() if isinstance(node["inputs"].get("image"), list)) == ["MGPUSPSampler", "MGPUTDPUpscale"]
