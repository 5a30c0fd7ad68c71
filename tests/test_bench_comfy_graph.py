"""``bench/comfy_graph.py``: ComfyUI's LTX-2 text-to-video template as an API graph, timed node by node.

The graph is checked against the template itself (the ``comfyui-workflow-templates`` package ComfyUI
installs: every node, setting and link of its "Text to Video (LTX 2.0)" subgraph), and queued in a
real ComfyUI on the CPU (``COMFYUI_DIR`` and a Python with ComfyUI's requirements), which accepts
it and runs it up to its text encoder (built for the released Gemma-3 12B only). The clock that
turns ComfyUI's websocket events into stage times is checked on a scripted event sequence, and the
fleet's side runs on the tiny bundle with one CPU rank.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import bench_module

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "comfy_graph.py"
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
TEMPLATES = ("comfyui_workflow_templates_media_video", "comfyui_workflow_templates_media_image")
"""Where ComfyUI's templates package keeps the LTX-2 template: with the video templates in January 2026,
with the image ones in 0.9.73 (ComfyUI v0.20.1's)."""
FILES = {"checkpoint": "ckpt.safetensors", "gemma": "gemma.safetensors", "distilled_lora": "lora.safetensors", "upsampler": "up.safetensors"}


@pytest.fixture(scope="module")
def comfy_graph():
    return bench_module("comfy_graph")


def template() -> tuple[dict, dict]:
    """ComfyUI's LTX-2 text-to-video template: (its subgraph, its top-level nodes by id)."""
    specs = [spec for spec in map(importlib.util.find_spec, TEMPLATES) if spec is not None]
    if not specs:
        pytest.skip(f"needs ComfyUI's workflow templates ({', '.join(TEMPLATES)}): run pytest with the Python of a ComfyUI environment")
    paths = [Path(spec.origin).parent / "templates" / "video_ltx2_t2v.json" for spec in specs]
    path = next((path for path in paths if path.is_file()), None)
    assert path is not None, f"none of {', '.join(map(str, paths))} exists: where does this templates package keep the LTX-2 template?"
    workflow = json.loads(path.read_text())
    (subgraph,) = workflow["definitions"]["subgraphs"]
    assert subgraph["name"] == "Text to Video (LTX 2.0)"
    return subgraph, {str(node["id"]): node for node in workflow["nodes"]}


UI_ONLY = {"MarkdownNote", "Reroute", "PrimitiveNode", "PrimitiveInt", "PrimitiveFloat", "EmptyImage", "ImageScaleBy", "GetImageSize"}
"""Template nodes the API graph replaces by numbers (the size helpers, primitives) or leaves out (notes, reroutes)."""


def test_the_graph_is_the_templates_nodes_settings_and_links(comfy_graph):
    subgraph, top_level = template()
    nodes = {str(node["id"]): node for node in subgraph["nodes"]}
    graph = comfy_graph.template_graph(FILES, 1536, 1024, 121, 24.0, 20, 10, "a prompt", "a negative prompt")

    # The subgraph's working nodes, and the SaveVideo beside it that takes its one output (CreateVideo's).
    active = {node_id for node_id, node in nodes.items() if node.get("mode", 0) == 0 and node["type"] not in UI_ONLY}
    assert set(graph) == active | {"75"}
    (output,) = subgraph["outputs"]
    (output_link,) = [link for link in subgraph["links"] if link["id"] in output["linkIds"]]
    assert top_level["75"]["type"] == graph["75"]["class_type"] == "SaveVideo"
    assert graph["75"]["inputs"]["video"] == [str(output_link["origin_id"]), output_link["origin_slot"]] == ["97", 0]
    nodes["75"] = top_level["75"]
    assert all(graph[node_id]["class_type"] == nodes[node_id]["type"] for node_id in graph)

    # Every link of the template, traced through reroutes and bypassed nodes, is the graph's link.
    links = {link["id"]: link for link in subgraph["links"]}

    def source(link_id: int) -> tuple[str, int] | None:
        link = links[link_id]
        origin = nodes.get(str(link["origin_id"]))
        if origin is None or origin["type"] in UI_ONLY - {"Reroute"}:
            return None  # a subgraph input or a primitive: a number in the graph
        if origin["type"] == "Reroute" or origin.get("mode") == 4:  # passed through
            (through,) = [i["link"] for i in origin["inputs"] if i.get("link") is not None and i["type"] != "LORA"]
            return source(through)
        return str(link["origin_id"]), link["origin_slot"]

    traced = 0
    for node_id in set(graph) - {"75"}:
        for entry in nodes[node_id].get("inputs", []):
            if entry.get("link") is not None and (origin := source(entry["link"])) is not None:
                assert graph[node_id]["inputs"][entry["name"]] == [origin[0], origin[1]], (node_id, entry["name"])
                traced += 1
    assert traced >= 40

    # The template's settings, as its widgets hold them.
    widgets = lambda node_id: nodes[node_id]["widgets_values"]  # noqa: E731
    inputs = lambda node_id: graph[node_id]["inputs"]  # noqa: E731
    assert [inputs("9")[key] for key in ("steps", "max_shift", "base_shift", "stretch", "terminal")] == widgets("9")
    assert inputs("47")["cfg"] == widgets("47")[0] == 4 and inputs("82")["cfg"] == widgets("82")[0] == 1
    assert inputs("8")["sampler_name"] == widgets("8")[0] and inputs("66")["sampler_name"] == widgets("66")[0]
    assert inputs("11")["noise_seed"] == widgets("11")[0] == 10 and inputs("67")["noise_seed"] == widgets("67")[0]
    assert [float(v) for v in inputs("73")["sigmas"].split(",")] == [float(v) for v in widgets("73")[0].split(",")]
    assert [inputs("98")[key] for key in ("tile_size", "overlap", "temporal_size", "temporal_overlap")] == widgets("98")
    assert inputs("68")["strength_model"] == widgets("68")[1]
    assert [inputs("75")[key] for key in ("filename_prefix", "format", "codec")] == widgets("75")
    # Stage 1 at half the final size (the template's ImageScaleBy 0.5), frames and frame rate as given.
    assert (inputs("43")["width"], inputs("43")["height"], inputs("43")["length"]) == (768, 512, 121)
    assert widgets("90") == ["lanczos", 0.5]
    assert inputs("51")["frames_number"] == 121 and inputs("51")["frame_rate"] == 24 and inputs("22")["frame_rate"] == 24.0
    assert inputs("60") == {"text_encoder": "gemma.safetensors", "ckpt_name": "ckpt.safetensors", "device": widgets("60")[2]}


def test_the_clock_sums_each_nodes_time_into_its_stage_and_times_the_sampler_steps(comfy_graph, monkeypatch, capsys):
    now = iter(float(t) for t in range(100))
    monkeypatch.setattr(comfy_graph.time, "perf_counter", lambda: next(now))
    clock = comfy_graph.NodeClock()  # t = 0
    events = [
        ("executing", {"node": "1"}),  # 1: load
        ("executing", {"node": "60"}),  # 2: text encode
        ("executing", {"node": "3"}),  # 3
        ("executing", {"node": "41"}),  # 4: stage 1
        ("progress", {"node": "41", "value": 1, "max": 3}),  # 5
        ("progress", {"node": "41", "value": 2, "max": 3}),  # 6
        ("progress", {"node": "41", "value": 3, "max": 3}),  # 7
        ("execution_cached", {"nodes": ["76"]}),  # 8: not a start
        ("executing", {"node": "84"}),  # 9: upsample
        ("executing", {"node": "70"}),  # 10: stage 2
        ("progress", {"node": "70", "value": 1, "max": 1}),  # 11
        ("progress", {"node": "9", "value": 1, "max": 1}),  # 12: not a sampler: ignored
        ("executing", {"node": "98"}),  # 13: decode
        ("executing", {"node": None}),  # 14: the end marker is no node
    ]
    for kind, data in events:
        clock(kind, data)
    run = clock.result(20.0, None)
    assert run.ran == ["1", "60", "3", "41", "84", "70", "98"]
    assert run.seconds == {"load": 1.0, "text encode": 2.0, "stage 1": 5.0, "upsample": 1.0, "stage 2": 3.0, "decode": 7.0}
    assert run.step_seconds == {"stage 1": [1.0, 1.0, 1.0], "stage 2": [1.0]}
    assert run.total_seconds == 20.0 and run.failure is None
    comfy_graph.log_stages("cold", run)  # what a run cut short still leaves on stderr
    assert capsys.readouterr().err == (
        "ComfyUI cold: 20.0 s: load 1.00 s, text encode 2.00 s, stage 1 5.00 s, upsample 1.00 s, stage 2 3.00 s, decode 7.00 s; "
        "stage 1 steps 1.00, 1.00, 1.00 s; stage 2 steps 1.00 s\n"
    )


@pytest.mark.skipif(not COMFYUI_DIR, reason="set COMFYUI_DIR to a ComfyUI checkout to queue the graph in it")
@pytest.mark.skipif(importlib.util.find_spec("torchsde") is None, reason="this Python lacks ComfyUI's requirements: run pytest with the Python of a ComfyUI environment")
def test_a_real_comfyui_accepts_the_graph_and_runs_it_up_to_its_text_encoder():
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MGPU_")}
    completed = subprocess.run(
        [sys.executable, str(BENCH), "--comfyui-dir", COMFYUI_DIR, "--tiny"], capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**environment, "PYTHONPATH": str(REPO)}, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr[-4000:]
    accepted, stopped = completed.stdout.strip().splitlines()
    assert accepted.startswith("ComfyUI accepted the template graph (30 nodes) and started ")
    started = accepted.rpartition(": ")[2].split(", ")
    # ComfyUI ran the nodes its text encoder does not feed, then the text encoder, where it stopped.
    assert started[-1] == "60" and {"48", "43", "56"} <= set(started) and not {"41", "70", "75"} & set(started), started
    # v0.20.1 builds the 12B text projection first and stops there (January 2026: at the Gemma model itself).
    assert stopped.startswith("stopped at: node 60 LTXAVTextEncoderLoader failed: RuntimeError: Error(s) in loading state_dict for "), stopped


def test_the_table_sets_each_stage_beside_the_fleets_with_its_spawn_in_load_and_its_handoff_in_decode(comfy_graph):
    from e2e import Run

    comfy = comfy_graph.GraphRun(
        seconds={"load": 1.5, "text encode": 2.0, "stage 1": 30.0, "upsample": 1.0, "stage 2": 6.0, "decode": 4.0},
        step_seconds={"stage 1": [9.0, 1.0, 1.2, 1.1], "stage 2": [2.0, 2.0]}, total_seconds=44.5,
    )  # fmt: skip
    fleet = Run(seconds={"fleet spawn": 8.0, "load": 20.0, "text encode": 5.0, "stage 1": 25.0, "upsample": 0.5, "stage 2": 7.0,
                         "decode": 4.5, "handoff": 0.25},
                step_seconds={"stage 1": [3.0, 0.9, 0.8]}, total_seconds=70.25)  # fmt: skip
    lines = comfy_graph.report_table(comfy, comfy, fleet, fleet).splitlines()
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in lines[2:])}
    assert rows["load"] == ["1.50", "1.50", "28.00", "28.00"]
    assert rows["decode"] == ["4.00", "4.00", "4.75", "4.75"]
    assert rows["stage 1"] == ["30.00", "30.00", "25.00", "25.00"]
    assert rows["stage 1 s/step (median, first left out)"] == ["1.10", "1.10", "0.85", "0.85"]
    assert rows["stage 2 s/step (median, first left out)"] == ["2.00", "2.00", "-", "-"]
    assert rows["**total**"] == ["**44.5**", "**44.5**", "**70.2**", "**70.2**"]


def test_the_fleet_runs_the_templates_job_on_the_single_gemma_file_and_warm_gives_the_cold_frames(comfy_graph, tmp_path):
    """The fleet's side of the bench, on the tiny bundle with one CPU rank: the spec names the same
    single Gemma file ComfyUI reads, and the job has the template's guidance (two passes a step)."""
    import torch

    from mgpu_backend.bundles import tiny
    from mgpu_backend.ltx.gemma_file import gemma_folder_to_comfy_file

    torch.set_num_threads(1)
    bundle = tiny.default_tiny_bundle()
    gemma_file = gemma_folder_to_comfy_file(bundle.gemma_root, str(tmp_path / "gemma_3_12B_it.safetensors"))
    job = comfy_graph.template_job(192, 128, 9, 24.0, 2)
    assert (job.video_guider.cfg_scale, job.video_guider.stg_scale, job.audio_guider.modality_scale) == (4.0, 0.0, 1.0)
    cold, warm = comfy_graph.run_fleet_side(bundle, gemma_file, job, torch.device("cpu"), None, 1)
    assert {"fleet spawn", "load", "text encode", "stage 1", "upsample", "stage 2", "decode", "handoff"} <= set(cold.seconds)
    assert len(cold.step_seconds["stage 1"]) == 2 and len(warm.step_seconds["stage 2"]) == len(comfy_graph.SINGLE_GPU_STAGE2_SIGMAS) - 1
    assert cold.frames_uint8.shape == (9, 128, 192, 3)
    assert cold.frames_digest == warm.frames_digest
    assert warm.bytes_read == 0  # the warm job reads no model file: the Gemma file too stays in the fleet
