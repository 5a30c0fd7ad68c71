"""The shipped example workflows against the node definitions: every node type, input name, widget
value and link type in each UI graph and each API twin, and each UI graph against its API twin; the
official files and defaults of each example's model version and pipeline; the template browser's
thumbnails and descriptions; and the tiny examples run through the nodes on a real one-rank fleet.

Our nodes are checked against their own INPUT_TYPES / RETURN_TYPES; ComfyUI core nodes against the
table in workflows/make_workflows.py (taken from ComfyUI of January 2026; the e2e test checks that
table against a running ComfyUI's /object_info)."""

from __future__ import annotations

import inspect
import io
import json
import logging
import sys
from pathlib import Path

import pytest
from tests.helpers import WORKFLOWS, builder


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
    """Loader file combos list the user's files; the examples must name the official files or a tiny bundle."""
    known = {name for files in builder.MODEL_FILES.values() for name in files.values()} | set(builder.embedded_entries())
    return None if value in known else f"{value!r} is neither an official LTX-2 file name nor an embedded bundle"


def check_widget(node_type: str, name: str, kind: str, allowed, value) -> str | None:
    if node_type == "MGPULoadCheckpoint" and name in builder.LOADER_FILE_INPUTS:
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
    # The UI file is named by its template title, the API twin by the example's short name.
    assert sorted(UI_FILES) == sorted(builder.ui_path(name) for name in builder.EXAMPLES)
    assert sorted(API_FILES) == sorted(builder.api_path(name) for name in builder.EXAMPLES)
    for name in builder.EXAMPLES:
        ui_path, api_path = builder.ui_path(name), builder.api_path(name)
        stripped = {node_id: {"class_type": node["class_type"], "inputs": node["inputs"]} for node_id, node in read(api_path).items()}
        assert ui_to_api(read(ui_path)) == stripped, f"{ui_path.name} and api/{api_path.name} disagree"


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


# The official file names of each model version and pipeline, written out here independently of the
# builder (Lightricks/LTX-2 and Lightricks/LTX-2.3 on Hugging Face; Gemma as ComfyUI ships it).
OFFICIAL_FILES = {
    ("2.0", "two-stage"): ("ltx-2-19b-dev.safetensors", "ltx-2-19b-distilled-lora-384.safetensors", "ltx-2-spatial-upscaler-x2-1.0.safetensors"),
    ("2.0", "distilled"): ("ltx-2-19b-distilled.safetensors", "(none)", "ltx-2-spatial-upscaler-x2-1.0.safetensors"),
    # LTX-2.3: the files ComfyUI's own LTX-2.3 templates name (its fp8 checkpoints, the 1.0 LoRA).
    ("2.3", "two-stage"): ("ltx-2.3-22b-dev-fp8.safetensors", "ltx-2.3-22b-distilled-lora-384.safetensors", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors"),
    ("2.3", "distilled"): ("ltx-2.3-22b-distilled-fp8.safetensors", "(none)", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors"),
    # HQ (LTX-2.3 only): the two-stage files, the distilled LoRA fused in both stages.
    ("2.3", "hq"): ("ltx-2.3-22b-dev-fp8.safetensors", "ltx-2.3-22b-distilled-lora-384.safetensors", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors"),
    # Keyframes (first/last frame): the two-stage files.
    ("2.3", "keyframes"): ("ltx-2.3-22b-dev-fp8.safetensors", "ltx-2.3-22b-distilled-lora-384.safetensors", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors"),
}
OFFICIAL_REPOS = {"2.0": "https://huggingface.co/Lightricks/LTX-2/resolve/main/", "2.3": "https://huggingface.co/Lightricks/LTX-2.3/resolve/main/"}
FP8_REPO = "https://huggingface.co/Lightricks/LTX-2.3-fp8/resolve/main/"
COMFY_TEXT_ENCODERS = "https://huggingface.co/Comfy-Org/ltx-2/resolve/main/split_files/text_encoders/"
COMFY_GEMMA = {"2.0": "gemma_3_12B_it.safetensors", "2.3": "gemma_3_12B_it_fp4_mixed.safetensors"}
EMBEDDED_ENTRIES = {"2.0": "(embedded tiny LTX-2, random weights)", "2.3": "(embedded tiny LTX-2.3, random weights)"}


def loader_inputs(name: str) -> dict:
    (loader,) = [node["inputs"] for node in read(WORKFLOWS / "api" / f"{name}.json").values() if node["class_type"] == "MGPULoadCheckpoint"]
    return loader


def test_every_version_and_pipeline_has_t2v_and_i2v_examples_and_each_version_a_tiny_one():
    covered = {(example.version, example.pipeline, example.image) for example in builder.EXAMPLES.values() if not example.tiny and not example.last_image}
    assert covered == {(version, pipeline, image) for version, pipeline in OFFICIAL_FILES if pipeline != "keyframes" for image in (False, True)}
    # The keyframes recipe is first and last frame to video: two images, no text-to-video example.
    assert {(example.version, example.pipeline, example.image) for example in builder.EXAMPLES.values() if example.last_image} == {("2.3", "keyframes", True)}
    assert sorted(example.version for example in builder.EXAMPLES.values() if example.tiny and example.settings is None and not example.last_image) == ["2.0", "2.3"]
    assert sorted(UI_FILES) == sorted(builder.ui_path(name) for name in builder.EXAMPLES)


def test_the_comfyui_recipe_workflow_sets_what_comfyuis_own_ltx_2_3_i2v_template_sets():
    """The settings are read off ComfyUI's template file (comfyui-workflow-templates' video_ltx2_3_i2v, kept in
    workflows/comfy), node by node, and found in the pack's workflow and its tiny twin."""
    template = read(WORKFLOWS / "comfy" / "ltx23_i2v_api.json")
    by_class: dict[str, list[dict]] = {}
    for node in template.values():
        by_class.setdefault(node["class_type"], []).append(node["inputs"])
    (lora,) = by_class["LoraLoaderModelOnly"]
    cfgs = {guider["cfg"] for guider in by_class["CFGGuider"]}
    schedules = {tuple(float(value) for value in sigmas["sigmas"].split(",")) for sigmas in by_class["ManualSigmas"]}
    (stage1_sigmas,) = [schedule for schedule in schedules if schedule[0] == 1.0]
    (stage2_sigmas,) = schedules - {stage1_sigmas}
    strengths = sorted(inplace["strength"] for inplace in by_class["LTXVImgToVideoInplace"])
    primitives = {node["value"] for node in by_class["PrimitiveInt"]}
    assert (lora["strength_model"], cfgs, strengths) == (0.5, {1}, [0.7, 1])
    assert {1280, 720, 25, 5} <= primitives  # width, height, fps, seconds
    for name in ("ltx23_i2v_comfy_recipe", "ltx23_i2v_comfy_recipe_tiny"):
        graph = read(WORKFLOWS / "api" / f"{name}.json")
        nodes = {node["class_type"]: node["inputs"] for node in graph.values()}
        loader, sampler, upscale = nodes["MGPULoadCheckpoint"], nodes["MGPUSPSampler"], nodes["MGPUTDPUpscale"]
        assert (loader["pipeline"], loader["distilled_lora_strength"], loader["distilled_lora_strength_stage_1"]) == ("two-stage", 0.5, 0.5)
        assert (sampler["video_cfg"], sampler["audio_cfg"], sampler["stg_scale"], sampler["modality_scale"]) == (1.0, 1.0, 0.0, 1.0)
        assert graph[sampler["sigmas"][0]]["class_type"] == "ManualSigmas"
        assert tuple(float(value) for value in graph[sampler["sigmas"][0]]["inputs"]["sigmas"].split(",")) == stage1_sigmas
        assert sampler["frame_rate"] == [str(next(key for key, node in graph.items() if node["class_type"] == "PrimitiveFloat")), 0]
        assert nodes["PrimitiveFloat"]["value"] == 25.0
        assert tuple(float(value) for value in upscale["sigmas"].split(",")) == stage2_sigmas and upscale["stage2_parallel"] == "sp"
    full = {node["class_type"]: node["inputs"] for node in read(WORKFLOWS / "api" / "ltx23_i2v_comfy_recipe.json").values()}["MGPUSPSampler"]
    assert (full["width"], full["height"], full["length"]) == (640, 352, 121)  # ComfyUI's 1280x720 / 2 at 25 fps x 5 s, as ComfyUI rounds it


@pytest.mark.parametrize("name", sorted(builder.EXAMPLES))
def test_loader_names_the_official_files_of_the_examples_version_with_their_download_metadata(name):
    example = builder.EXAMPLES[name]
    loader = loader_inputs(name)
    files = tuple(loader[key] for key in ("ckpt_name", "distilled_lora", "spatial_upsampler"))
    if example.tiny:
        assert set(files) | {loader["gemma"]} == {EMBEDDED_ENTRIES[example.version]}
    else:
        assert files == OFFICIAL_FILES[(example.version, example.pipeline)] and loader["gemma"] == COMFY_GEMMA[example.version]
    assert loader["pipeline"] == example.pipeline
    (ui_loader,) = [node for node in read(builder.ui_path(name))["nodes"] if node["type"] == "MGPULoadCheckpoint"]
    expected = [] if example.tiny else [name_ for name_ in (*files, loader["gemma"]) if name_ != "(none)"]
    models = ui_loader["properties"].get("models", [])
    assert [model["name"] for model in models] == expected
    for model in models:
        if model["name"] == COMFY_GEMMA[example.version]:
            url = COMFY_TEXT_ENCODERS + model["name"]
        else:
            url = (FP8_REPO if model["name"].endswith("-fp8.safetensors") else OFFICIAL_REPOS[example.version]) + model["name"]
        assert model["url"] == url, model


@pytest.mark.parametrize("name", sorted(name for name, example in builder.EXAMPLES.items() if example.settings is None))
def test_widget_values_are_the_official_defaults_of_the_examples_version_and_pipeline(name):
    from mgpu_backend.ltx.schema import (
        DEFAULTS,
        DISTILLED_LORA_STRENGTH,
        stage2_default_sigmas,
    )

    example = builder.EXAMPLES[name]
    recipe = DEFAULTS[(example.version, example.pipeline)]
    by_type = {node["class_type"]: node["inputs"] for node in read(WORKFLOWS / "api" / f"{name}.json").values()}
    sampler, video, audio = by_type["MGPUSPSampler"], recipe.video_guidance, recipe.audio_guidance
    guidance = {"video_cfg": video.cfg_scale, "audio_cfg": audio.cfg_scale, "stg_scale": video.stg_scale, "rescale": video.rescale_scale,
                "modality_scale": video.modality_scale, "seed": recipe.seed}  # fmt: skip
    assert {key: sampler[key] for key in guidance} == guidance
    # The audio's own rescale only where the recipe's differs from the video's (HQ: 0.45 and 1.0); -1: the same.
    assert sampler["audio_rescale"] == (-1.0 if audio.rescale_scale == video.rescale_scale else audio.rescale_scale)
    if example.tiny:
        # Smaller only in size, frames and steps; empty STG blocks: the tiny model's last block.
        assert (sampler["width"], sampler["height"], sampler["length"], sampler["steps"], sampler["stg_blocks"]) == (96, 64, 9, 3, "")
    else:
        sizes = (recipe.stage1_width, recipe.stage1_height, recipe.num_frames, recipe.steps, ",".join(map(str, video.stg_blocks)))
        assert (sampler["width"], sampler["height"], sampler["length"], sampler["steps"], sampler["stg_blocks"]) == sizes
    assert by_type["PrimitiveFloat"]["value"] == recipe.frame_rate  # feeds SP Sampler's frame_rate and CreateVideo's fps
    assert by_type["MGPUTDPUpscale"]["seed"] == recipe.seed == by_type["MGPUDistributedVAEDecode"]["seed"]
    sigmas = ", ".join(map(str, stage2_default_sigmas("two-stage"))) if example.pipeline == "two-stage" else ""
    assert by_type["MGPUTDPUpscale"]["sigmas"] == sigmas
    assert by_type["MGPULoadCheckpoint"]["distilled_lora_strength"] == DISTILLED_LORA_STRENGTH


def test_ltx_2_3_examples_carry_2_3s_steps_and_stg_block_and_2_0s_carry_2_0s():
    sampler = {name: [node["inputs"] for node in read(WORKFLOWS / "api" / f"{name}.json").values() if node["class_type"] == "MGPUSPSampler"][0]
               for name in ("ltx2_t2v_two_stage", "ltx23_t2v_two_stage", "ltx23_i2v_two_stage", "ltx23_t2v_distilled")}  # fmt: skip
    assert (sampler["ltx2_t2v_two_stage"]["steps"], sampler["ltx2_t2v_two_stage"]["stg_blocks"]) == (40, "29")
    assert (sampler["ltx23_t2v_two_stage"]["steps"], sampler["ltx23_t2v_two_stage"]["stg_blocks"]) == (30, "28")
    assert (sampler["ltx23_i2v_two_stage"]["steps"], sampler["ltx23_i2v_two_stage"]["stg_blocks"]) == (30, "28")
    assert (sampler["ltx23_t2v_distilled"]["steps"], sampler["ltx23_t2v_distilled"]["stg_scale"]) == (8, 0.0)


@pytest.mark.parametrize("name", sorted(name for name, example in builder.EXAMPLES.items() if example.image))
def test_i2v_examples_feed_the_image_to_both_stages(name):
    prompt = read(WORKFLOWS / "api" / f"{name}.json")
    image_users = sorted(node["class_type"] for node in prompt.values() if isinstance(node["inputs"].get("image"), list))
    assert image_users == ["MGPUSPSampler", "MGPUTDPUpscale"]


@pytest.mark.parametrize("name", sorted(builder.EXAMPLES))
def test_api_prompts_pass_the_nodes_own_input_checks_with_the_official_files_installed(name, monkeypatch):
    """What ComfyUI runs before queueing: VALIDATE_INPUTS of every node, with the loader's lists
    holding the example's files (as they do once downloaded)."""
    model_nodes = sys.modules["comfyui_mgpu_pack.nodes.model_nodes"]
    installed = set(loader_inputs(name).values())
    monkeypatch.setattr(model_nodes, "model_file_choices", lambda folder: sorted(value for value in installed if isinstance(value, str) and value.endswith(".safetensors")))
    pack = builder.load_pack()
    for node_id, node in read(WORKFLOWS / "api" / f"{name}.json").items():
        node_class = pack.NODE_CLASS_MAPPINGS.get(node["class_type"])
        if node_class is None or not hasattr(node_class, "VALIDATE_INPUTS"):
            continue
        accepted = inspect.signature(node_class.VALIDATE_INPUTS).parameters
        literal = {key: value for key, value in node["inputs"].items() if key in accepted and not isinstance(value, list)}
        assert node_class.VALIDATE_INPUTS(**literal) is True, f"node {node_id} {node['class_type']}"


def test_tiny_prompts_are_small_enough_for_cpu_ranks():
    for name, example in ((name, example) for name, example in builder.EXAMPLES.items() if example.tiny):
        prompt = read(WORKFLOWS / "api" / f"{name}.json")
        (sampler,) = [node["inputs"] for node in prompt.values() if node["class_type"] == "MGPUSPSampler"]
        steps = 4 if example.settings is None else len(example.settings.stage1_sigmas) - 1  # a schedule of the settings keeps its steps
        assert sampler["width"] * sampler["height"] <= 128 * 192 and sampler["length"] <= 17 and sampler["steps"] <= steps, sampler


def test_shipped_files_are_what_make_workflows_writes():
    for name in builder.WORKFLOWS:
        ui, api_prompt = builder.build(name, SCHEMAS)
        assert read(builder.ui_path(name)) == ui, f"workflows/{builder.ui_path(name).name} is stale: run python workflows/make_workflows.py"
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
    named = {widgets[name]: folder for name, folder in LOADER_FILE_FOLDERS.items() if widgets[name] not in (*EMBEDDED_ENTRIES.values(), builder.NO_FILE)}
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


@pytest.mark.parametrize("name", sorted(name for name, example in builder.EXAMPLES.items() if example.pipeline == "distilled"))
def test_distilled_examples_load_the_distilled_checkpoint_and_run_the_recipe_defaults(name):
    from mgpu_backend.ltx.schema import defaults_for

    example = builder.EXAMPLES[name]
    recipe = defaults_for(example.version, "distilled")
    by_type = {node["class_type"]: node["inputs"] for node in read(WORKFLOWS / "api" / f"{name}.json").values()}
    loader = by_type["MGPULoadCheckpoint"]
    assert loader["pipeline"] == "distilled" and loader["ckpt_name"] == OFFICIAL_FILES[(example.version, "distilled")][0] and loader["distilled_lora"] == "(none)"
    sampler = by_type["MGPUSPSampler"]
    assert (sampler["width"], sampler["height"], sampler["length"], sampler["steps"]) == (recipe.stage1_width, recipe.stage1_height, recipe.num_frames, recipe.steps)
    assert (sampler["video_cfg"], sampler["stg_scale"], sampler["modality_scale"], sampler["stg_blocks"]) == (1.0, 0.0, 1.0, "")
    assert by_type["MGPUTDPUpscale"]["sigmas"] == "" and by_type["MGPUTDPUpscale"]["stage2_parallel"] == "auto"


def test_every_example_has_its_own_workflow_id():
    ids = [read(path)["id"] for path in UI_FILES]
    assert len(set(ids)) == len(ids)


# --- the template browser: thumbnails --------------------------------------------------------------------


@pytest.mark.parametrize("path", UI_FILES, ids=lambda path: path.name)
def test_every_template_has_a_small_jpeg_thumbnail_that_the_script_draws_from_its_graph(path):
    # ComfyUI's frontend asks for /api/workflow_templates/<pack>/<name>.jpg for a custom node
    # pack's template; the server serves the template folder as it is.
    from PIL import Image, ImageChops, ImageStat

    thumbnail = path.with_suffix(".jpg")
    assert thumbnail.is_file(), f"{thumbnail.name} is missing: run python workflows/make_workflows.py"
    data = thumbnail.read_bytes()
    assert data[:3] == b"\xff\xd8\xff" and 2_000 <= len(data) <= 40_000, len(data)
    shipped = Image.open(io.BytesIO(data))
    assert shipped.format == "JPEG" and shipped.size == builder.THUMBNAIL_SIZE
    (slug,) = [name for name in builder.EXAMPLES if builder.ui_path(name) == path]
    drawn = Image.open(io.BytesIO(builder.render_thumbnail(read(path), builder.EXAMPLES[slug])))
    # Compared by pixels, not bytes: another JPEG encoder build may write other bytes for the same picture.
    difference = ImageStat.Stat(ImageChops.difference(shipped.convert("RGB"), drawn.convert("RGB"))).mean
    assert max(difference) < 2.0, f"{thumbnail.name} is stale (mean difference {difference}): run python workflows/make_workflows.py"


def test_thumbnails_tell_the_versions_apart():
    from PIL import Image, ImageChops, ImageStat

    first, second = (Image.open(builder.ui_path(name).with_suffix(".jpg")).convert("RGB") for name in ("ltx2_t2v_two_stage", "ltx23_t2v_two_stage"))
    assert max(ImageStat.Stat(ImageChops.difference(first, second)).mean) > 2.0
    assert sorted(path.stem for path in WORKFLOWS.glob("*.jpg")) == sorted(path.stem for path in UI_FILES), "a thumbnail without its template"


# --- the tiny examples run -----------------------------------------------------------------------------------


def run_api_prompt_through_the_nodes(prompt: dict) -> dict:
    """Executes an API prompt as ComfyUI would, in dependency order, with our node classes; the
    native nodes it needs before the video is made are the one-line PrimitiveFloat. Stops at the
    decoder's output (CreateVideo / SaveVideo run in a real ComfyUI in the e2e suite)."""
    pack = builder.load_pack()
    left_out = {node["class_type"] for node in prompt.values() if node["class_type"] not in pack.NODE_CLASS_MAPPINGS and node["class_type"] != "PrimitiveFloat"}
    assert left_out == {"CreateVideo", "SaveVideo"}, left_out
    outputs, remaining = {}, {node_id: node for node_id, node in prompt.items() if node["class_type"] not in left_out}
    while remaining:
        ready = [node_id for node_id, node in remaining.items()
                 if all(value[0] in outputs for value in node["inputs"].values() if isinstance(value, list))]  # fmt: skip
        assert ready, f"nodes {sorted(remaining)} wait on nodes that never run"
        for node_id in ready:
            node = remaining.pop(node_id)
            inputs = {key: outputs[value[0]][value[1]] if isinstance(value, list) else value for key, value in node["inputs"].items()}
            if node["class_type"] == "PrimitiveFloat":
                outputs[node_id] = (inputs["value"],)
            else:
                node_class = pack.NODE_CLASS_MAPPINGS[node["class_type"]]
                outputs[node_id] = getattr(node_class(), node_class.FUNCTION)(**inputs, unique_id=node_id)
    return {prompt[node_id]["class_type"]: result for node_id, result in outputs.items()}


@pytest.fixture
def one_rank_fleet(tmp_path, monkeypatch):
    from .fleet_harness import api_fleet

    yield from api_fleet(tmp_path, monkeypatch)


def test_tiny_api_workflows_of_both_versions_run_through_the_nodes_on_a_real_fleet(one_rank_fleet, caplog):
    results = {}
    for name in ("ltx2_t2v_tiny", "ltx23_t2v_tiny"):
        prompt = read(WORKFLOWS / "api" / f"{name}.json")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="comfyui-mgpu"):
            results[name] = run_api_prompt_through_the_nodes(prompt)
        # TDP Upscale's note is the stage-2 plan, which says once what happens to the audio.
        (stage2_note,) = [record.getMessage() for record in caplog.records if record.getMessage().startswith("stage-2 plan")]
        assert "tiled data parallel on 1 rank for" in stage2_note and stage2_note.count("stage-1 audio") == 1, stage2_note
        (sampler,) = [node["inputs"] for node in prompt.values() if node["class_type"] == "MGPUSPSampler"]
        frames, audio = results[name]["MGPUDistributedVAEDecode"]
        assert tuple(frames.shape) == (sampler["length"], 2 * sampler["height"], 2 * sampler["width"], 3), frames.shape
        assert 0.0 <= float(frames.min()) and float(frames.max()) <= 1.0 and float(frames.std()) > 0.0
        assert audio["waveform"].ndim == 3 and audio["waveform"].shape[-1] > 0 and bool(audio["waveform"].isfinite().all())
        (model,) = results[name]["MGPULoadCheckpoint"]
        assert model["spec"]["checkpoint_path"] == {"ltx2_t2v_tiny": "embedded:tiny", "ltx23_t2v_tiny": "embedded:tiny-2.3"}[name]
    # The 22B layout's vocoder extends the bandwidth: LTX-2.3 audio comes out at twice LTX-2.0's rate.
    rates = [results[name]["MGPUDistributedVAEDecode"][1]["sample_rate"] for name in ("ltx2_t2v_tiny", "ltx23_t2v_tiny")]
    assert rates[1] == 2 * rates[0], rates
