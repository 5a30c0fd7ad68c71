"""``tools.comfy_templates``: ComfyUI's UI-format workflows (subgraphs, reroutes, bypassed and muted
nodes, primitives) as the API graphs its frontend queues, and the loader swap that puts them on the
fleet; and the graphs ``workflows/comfy/make_comfy_workflows.py`` ships from ComfyUI's LTX-2.3 templates.

The node definitions are ``tests/data/comfy_object_info_ltx23.json``, saved from a running ComfyUI
v0.20.1 with the pack by the generator's ``--refresh-object-info``. The shipped UI workflows are the
templates with only the loader's type changed, so converting them exercises the templates themselves;
the tests that compare them with the installed templates need ComfyUI's templates package (ComfyUI's
Python) and skip without it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

import pytest

from mgpu_backend.tools import comfy_templates
from mgpu_backend.tools.comfy_templates import WorkflowError, swap_model_loader, swap_ui_model_loader, ui_to_api

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "workflows" / "comfy"
OBJECT_INFO = json.loads((REPO / "tests" / "data" / "comfy_object_info_ltx23.json").read_text())
GRAPHS = ("ltx23_i2v", "ltx23_t2v", "ltx23_flf2v", "ltx23_ia2v")
API_NODES = {"ltx23_i2v": 46, "ltx23_t2v": 46, "ltx23_flf2v": 35, "ltx23_ia2v": 50}


def shipped(name: str) -> dict:
    return json.loads((SHIPPED / f"{name}.json").read_text())


def by_type(graph: dict, class_type: str) -> dict:
    return {node_id: entry["inputs"] for node_id, entry in graph.items() if entry["class_type"] == class_type}


def generator():
    spec = importlib.util.spec_from_file_location("make_comfy_workflows", SHIPPED / "make_comfy_workflows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_image_to_video_template_becomes_46_api_nodes_with_its_widget_values_named():
    graph = ui_to_api(shipped("ltx23_i2v"), OBJECT_INFO)
    assert len(graph) == 46
    types = Counter(entry["class_type"] for entry in graph.values())
    assert types["MGPUCheckpointLoader"] == 1 and types["CheckpointLoaderSimple"] == 0
    assert types["SamplerCustomAdvanced"] == 2 and types["CFGGuider"] == 2 and types["PrimitiveInt"] == 4
    assert not set(types) & comfy_templates.VIRTUAL_NODES  # the MarkdownNote and the Reroute are gone
    assert all(node_id.startswith("320:") for node_id in graph if node_id not in ("269", "75"))

    assert [inputs["cfg"] for inputs in by_type(graph, "CFGGuider").values()] == [1, 1]
    assert sorted(inputs["sigmas"] for inputs in by_type(graph, "ManualSigmas").values()) == [
        "0.85, 0.7250, 0.4219, 0.0", "1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"]
    assert by_type(graph, "LoraLoaderModelOnly") == {"320:285": {
        "lora_name": "ltx-2.3-22b-distilled-lora-384.safetensors", "strength_model": 0.5, "model": ["320:316", 0]}}
    assert {node_id: inputs["strength"] for node_id, inputs in by_type(graph, "LTXVImgToVideoInplace").items()} == {"320:288": 1, "320:296": 0.7}
    # A seed's control_after_generate and LoadImage's upload button are frontend-only widgets.
    assert sorted(inputs["noise_seed"] for inputs in by_type(graph, "RandomNoise").values()) == [42, 519681071352364]
    assert graph["269"]["inputs"] == {"image": "egyptian_queen.png"}
    # A dynamic combo's chosen option names its widgets after it; linked ones come from their source.
    assert graph["320:290"]["inputs"] == {
        "resize_type": "scale dimensions", "resize_type.width": ["320:312", 0], "resize_type.height": ["320:299", 0],
        "resize_type.crop": "center", "scale_method": "lanczos", "input": ["269", 0]}
    assert graph["320:323"]["inputs"] == {"expression": "a * b + 1", "values.a": ["320:301", 0], "values.b": ["320:300", 0]}
    # Promoted widgets left unconnected on the subgraph node keep the inner node's value.
    assert {graph[node_id]["inputs"]["value"] for node_id in ("320:312", "320:299", "320:301", "320:300")} == {1280, 720, 5, 25}
    # The subgraph's output reaches SaveVideo; the Reroute (293) is followed to the checkpoint's VAE.
    assert graph["75"]["inputs"]["video"] == ["320:310", 0]
    assert [graph[node_id]["inputs"]["vae"] for node_id in ("320:288", "320:315", "320:287")] == [["320:316", 2]] * 3
    assert graph["320:316"] == {"inputs": {"ckpt_name": "ltx-2.3-22b-dev-fp8.safetensors", "weight_dtype": "default"},
                                "class_type": "MGPUCheckpointLoader", "_meta": {"title": "Load Checkpoint (MGPU fleet)"}}


@pytest.mark.parametrize("name", GRAPHS)
def test_every_template_converts_with_every_link_to_a_node_of_the_graph_and_matches_its_shipped_api_twin(name):
    graph = ui_to_api(shipped(name), OBJECT_INFO)
    assert len(graph) == API_NODES[name]
    for node_id, entry in graph.items():
        definition = OBJECT_INFO[entry["class_type"]]
        declared = {**definition["input"].get("required", {}), **definition["input"].get("optional", {})}
        for input_name, value in entry["inputs"].items():
            assert input_name.split(".")[0] in declared, (node_id, input_name)
            if isinstance(value, list):
                assert value[0] in graph and value[1] < len(OBJECT_INFO[graph[value[0]]["class_type"]]["output"]), (node_id, input_name, value)
    assert graph == json.loads((SHIPPED / f"{name}_api.json").read_text())


def test_image_audio_template_drops_the_bypassed_recorder_and_loads_the_audio_file_without_its_player_widgets():
    graph = ui_to_api(shipped("ltx23_ia2v"), OBJECT_INFO)
    assert "339" not in graph  # RecordAudio, bypassed: nothing feeds the subgraph through it
    assert graph["276"]["inputs"] == {"audio": "ltx_23_audio.mp3"}
    assert graph["340:332"]["inputs"] == {"start_index": 0, "duration": ["340:331", 0], "audio": ["276", 0]}
    assert by_type(graph, "SolidMask") == {"340:333": {"value": 0, "width": ["340:330", 0], "height": ["340:324", 0]}}


def test_first_last_frame_template_feeds_both_images_through_the_subgraph_inputs():
    graph = ui_to_api(shipped("ltx23_flf2v"), OBJECT_INFO)
    assert graph["129:124"]["inputs"]["input"] == ["31", 0] and graph["129:125"]["inputs"]["input"] == ["39", 0]
    assert {inputs["frame_idx"]: inputs["strength"] for inputs in by_type(graph, "LTXVAddGuide").values()} == {0: 0.7, -1: 0.7}
    assert by_type(graph, "SamplerEulerAncestral") == {"129:117": {"eta": 0, "s_noise": 1}}
    assert graph["129:127"]["inputs"]["ckpt_name"] == "ltx-2.3-22b-distilled-fp8.safetensors"


def node(node_id, node_type, widgets=None, inputs=(), outputs=(), mode=0, **extra):
    return {"id": node_id, "type": node_type, "mode": mode, "widgets_values": widgets,
            "inputs": [dict(entry) for entry in inputs], "outputs": [dict(entry) for entry in outputs], **extra}


def small_workflow() -> dict:
    """checkpoint -> [LoRA, bypassed] -> reroute -> CFGGuider, whose cfg a legacy PrimitiveNode sets;
    a muted CLIPTextEncode feeds its positive input."""
    return {
        "nodes": [
            node(1, "CheckpointLoaderSimple", ["a.safetensors"], outputs=[{"name": "MODEL", "type": "MODEL"}]),
            node(2, "LoraLoaderModelOnly", ["l.safetensors", 0.5], mode=4,
                 inputs=[{"name": "model", "type": "MODEL", "link": 1}], outputs=[{"name": "MODEL", "type": "MODEL"}]),
            node(3, "Reroute", inputs=[{"name": "", "type": "*", "link": 2}], outputs=[{"name": "", "type": "MODEL"}]),
            node(4, "PrimitiveNode", [3.5, "fixed"], outputs=[{"name": "FLOAT", "type": "FLOAT"}]),
            node(5, "CLIPTextEncode", ["text"], mode=2, inputs=[{"name": "clip", "type": "CLIP", "link": None}],
                 outputs=[{"name": "CONDITIONING", "type": "CONDITIONING"}]),
            node(6, "CFGGuider", [8.0], inputs=[
                {"name": "model", "type": "MODEL", "link": 3}, {"name": "positive", "type": "CONDITIONING", "link": 5},
                {"name": "cfg", "type": "FLOAT", "link": 4, "widget": {"name": "cfg"}}]),
            node(7, "Note", ["a note"]),
        ],
        "links": [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 3, 0, "MODEL"], [3, 3, 0, 6, 0, "MODEL"], [4, 4, 0, 6, 2, "FLOAT"],
                  [5, 5, 0, 6, 1, "CONDITIONING"]],
    }


def test_a_bypassed_lora_passes_the_model_through_a_primitive_node_sets_the_widget_and_a_muted_node_feeds_nothing():
    graph = ui_to_api(small_workflow(), OBJECT_INFO)
    assert graph == {
        "1": {"inputs": {"ckpt_name": "a.safetensors"}, "class_type": "CheckpointLoaderSimple", "_meta": {"title": "Load Checkpoint"}},
        "6": {"inputs": {"cfg": 3.5, "model": ["1", 0]}, "class_type": "CFGGuider", "_meta": {"title": "CFGGuider"}},
    }
    workflow = small_workflow()
    workflow["nodes"][1]["mode"] = 0  # the LoRA on again
    assert ui_to_api(workflow, OBJECT_INFO)["6"]["inputs"]["model"] == ["2", 0]
    workflow["nodes"][3]["type"] = "PrimitiveFloat"
    workflow["nodes"][3]["mode"] = 2  # a muted real node on the cfg widget: the frontend drops the input, value and all
    assert ui_to_api(workflow, OBJECT_INFO)["6"]["inputs"] == {"model": ["2", 0]}


def test_nested_subgraphs_get_path_ids_and_a_promoted_widget_value_reaches_the_inner_node():
    inner = {
        "id": "inner-def", "name": "inner", "inputs": [{"name": "cfg", "type": "FLOAT", "linkIds": [11]}],
        "outputs": [{"name": "GUIDER", "type": "GUIDER", "linkIds": [12]}],
        "nodes": [node(1, "CFGGuider", [8.0], inputs=[{"name": "model", "type": "MODEL", "link": None},
                                                      {"name": "cfg", "type": "FLOAT", "link": 11, "widget": {"name": "cfg"}}])],
        "links": [{"id": 11, "origin_id": -10, "origin_slot": 0, "target_id": 1, "target_slot": 1, "type": "FLOAT"},
                  {"id": 12, "origin_id": 1, "origin_slot": 0, "target_id": -20, "target_slot": 0, "type": "GUIDER"}],
    }
    outer = {
        "id": "outer-def", "name": "outer", "inputs": [], "outputs": [{"name": "GUIDER", "type": "GUIDER", "linkIds": [22]}],
        "nodes": [node(5, "inner-def", [2.5], inputs=[{"name": "cfg", "type": "FLOAT", "link": None, "widget": {"name": "cfg"}}])],
        "links": [{"id": 22, "origin_id": 5, "origin_slot": 0, "target_id": -20, "target_slot": 0, "type": "GUIDER"}],
    }
    workflow = {
        "nodes": [node(9, "outer-def", []),
                  node(10, "SamplerCustomAdvanced", inputs=[{"name": "guider", "type": "GUIDER", "link": 30}])],
        "links": [[30, 9, 0, 10, 1, "GUIDER"]],
        "definitions": {"subgraphs": [inner, outer]},
    }
    graph = ui_to_api(workflow, OBJECT_INFO)
    assert graph["9:5:1"]["inputs"] == {"cfg": 2.5}
    assert graph["10"]["inputs"] == {"guider": ["9:5:1", 0]}


def test_an_unknown_node_type_and_surplus_widget_values_are_refused_naming_the_node():
    workflow = small_workflow()
    workflow["nodes"][0]["type"] = "SomePackLoader"
    with pytest.raises(WorkflowError, match=r"node 1 \(SomePackLoader\): ComfyUI has no node type 'SomePackLoader'; install"):
        ui_to_api(workflow, OBJECT_INFO)
    workflow = small_workflow()
    workflow["nodes"][5]["widgets_values"] = [8.0, "extra"]
    with pytest.raises(WorkflowError, match=r"node 6 \(CFGGuider\) has 2 widget values but its definition names 1"):
        ui_to_api(workflow, OBJECT_INFO)


def test_swap_model_loader_changes_only_the_loaders_class_and_title():
    graph = {
        "1": {"inputs": {"ckpt_name": "a.safetensors"}, "class_type": "CheckpointLoaderSimple", "_meta": {"title": "Load Checkpoint"}},
        "2": {"inputs": {"unet_name": "u.safetensors", "weight_dtype": "fp8_e4m3fn"}, "class_type": "UNETLoader", "_meta": {"title": "my unet"}},
        "3": {"inputs": {"cfg": 1, "model": ["1", 0]}, "class_type": "CFGGuider", "_meta": {"title": "CFGGuider"}},
    }
    before = copy.deepcopy(graph)
    swapped = swap_model_loader(graph)
    assert graph == before  # a copy
    assert swapped == {
        "1": {"inputs": {"ckpt_name": "a.safetensors"}, "class_type": "MGPUCheckpointLoader", "_meta": {"title": "Load Checkpoint (MGPU fleet)"}},
        "2": {"inputs": {"unet_name": "u.safetensors", "weight_dtype": "fp8_e4m3fn"}, "class_type": "MGPUDiffusionModelLoader", "_meta": {"title": "my unet"}},
        "3": before["3"],
    }
    with pytest.raises(WorkflowError, match="the graph has no CheckpointLoaderSimple or UNETLoader to swap"):
        swap_model_loader({"3": before["3"]})


def test_tiny_twins_load_only_the_tiny_bundles_files_at_192x128_and_9_frames_and_encode_with_mgpu_text_encode():
    for name in GRAPHS:
        full = json.loads((SHIPPED / f"{name}_api.json").read_text())
        graph = json.loads((SHIPPED / f"{name}_tiny_api.json").read_text())
        files = [value for entry in graph.values() for value in entry["inputs"].values() if isinstance(value, str) and value.endswith(".safetensors")]
        assert files and all(file.startswith("ltx-2.3-tiny") for file in files), (name, files)
        types = Counter(entry["class_type"] for entry in graph.values())
        assert types["CheckpointLoaderSimple"] == 1 and types["MGPUTextEncode"] == 1 and types["MGPULoadCheckpoint"] == 1
        assert not types["CLIPTextEncode"] and not types["LTXAVTextEncoderLoader"]
        assert len(graph) == len(full) - 3 + 2  # two encoders and Gemma's loader out; the MGPU loader and encoder in
        settings = generator().labelled_settings(shipped(name))
        assert {label: [graph[node_id]["inputs"][key] for node_id, key in settings[label]] for label in ("width", "height", "duration", "fps")} == {
            "width": [192], "height": [128], "duration": [1], "fps": [8]}
        # Everything a CLIPTextEncode fed now comes from MGPU Text Encode's output of the same role.
        fed = sorted((key, value[1]) for entry in graph.values() for key, value in entry["inputs"].items() if isinstance(value, list) and value[0] == "mgpu_text_encode")
        assert fed == [("negative", 1), ("positive", 0)], (name, fed)


def test_models_json_names_comfyuis_own_ltx_2_3_files_for_each_graph():
    models = json.loads((SHIPPED / "models.json").read_text())
    assert sorted(models) == sorted(GRAPHS)
    names = {name: sorted(entry["name"] for entry in entries) for name, entries in models.items()}
    assert names["ltx23_i2v"] == names["ltx23_t2v"] == names["ltx23_ia2v"] == [
        "gemma_3_12B_it_fp4_mixed.safetensors", "ltx-2.3-22b-dev-fp8.safetensors", "ltx-2.3-22b-distilled-lora-384.safetensors",
        "ltx-2.3-spatial-upscaler-x2-1.1.safetensors"]
    assert names["ltx23_flf2v"] == ["gemma_3_12B_it_fp4_mixed.safetensors", "ltx-2.3-22b-distilled-fp8.safetensors"]
    assert all(entry["url"].startswith("https://huggingface.co/") for entries in models.values() for entry in entries)


def installed_templates() -> Path:
    spec = importlib.util.find_spec("comfyui_workflow_templates_media_video")
    if spec is None:
        pytest.skip("needs ComfyUI's workflow templates (comfyui-workflow-templates): run with ComfyUI's Python")
    return Path(spec.origin).parent / "templates"


@pytest.mark.parametrize("name", GRAPHS)
def test_shipped_ui_workflow_is_the_installed_template_with_only_the_loader_type_changed(name):
    template = json.loads((installed_templates() / f"{generator().GRAPHS[name]}.json").read_text())
    assert shipped(name) == swap_ui_model_loader(template)
    changed = [(a["id"], a["type"], b["type"]) for sub_a, sub_b in zip(template["definitions"]["subgraphs"], shipped(name)["definitions"]["subgraphs"])
               for a, b in zip(sub_a["nodes"], sub_b["nodes"]) if a != b]
    assert [(old, new) for _, old, new in changed] == [("CheckpointLoaderSimple", "MGPUCheckpointLoader")]
    assert ui_to_api(shipped(name), OBJECT_INFO) == json.loads((SHIPPED / f"{name}_api.json").read_text())


def test_comfyuis_ltx_2_3_blueprints_convert_with_every_link_inside_the_graph():
    comfyui_dir = os.environ.get("COMFYUI_DIR")
    if not comfyui_dir or not (Path(comfyui_dir) / "blueprints").is_dir():
        pytest.skip("set COMFYUI_DIR to a ComfyUI checkout (its blueprints/ folder)")
    sizes = {}
    for path in sorted((Path(comfyui_dir) / "blueprints").glob("*(LTX-2.3).json")):
        graph = ui_to_api(json.loads(path.read_text()), OBJECT_INFO)
        assert all(value[0] in graph for entry in graph.values() for value in entry["inputs"].values() if isinstance(value, list)), path.name
        assert Counter(entry["class_type"] for entry in graph.values())["CheckpointLoaderSimple"] == 1, path.name
        sizes[path.name] = len(graph)
    assert sizes == {"First-Last-Frame to Video (LTX-2.3).json": 32, "Image to Video (LTX-2.3).json": 44, "Text to Video (LTX-2.3).json": 45}
