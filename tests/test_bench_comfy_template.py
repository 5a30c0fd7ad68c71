"""``bench/comfy_template.py``: ComfyUI v0.20.1's LTX-2.3 text-to-video template, whole, stock and with
its loader swapped for the MGPU fleet's, timed node by node.

The graphs are checked against the committed template (``workflows/comfy/ltx23_t2v_api.json``: the
stock one is it with ComfyUI's loader put back, the fleet one differs in that node only), the stages
the bench sums its nodes into are checked on the template's own node ids, the clock on a scripted
event sequence with ComfyUI v0.20.1's throttled progress events, and the table on numbers. With
``COMFYUI_DIR`` (and ``COMFYUI_PYTHON``, its Python) the bench's ``--tiny`` run queues both graphs in
a real ComfyUI --cpu with this pack, cold and warm, and each runs to its end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import bench_module

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "comfy_template.py"
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")


@pytest.fixture(scope="module")
def comfy_template():
    return bench_module("comfy_template")


def test_the_stock_graph_is_the_template_and_the_fleet_graph_differs_only_in_its_loader(comfy_template):
    committed = json.loads((REPO / "workflows" / "comfy" / "ltx23_t2v_api.json").read_text())
    graphs = comfy_template.template_graphs(tiny_run=False)
    stock, fleet = graphs["stock"], graphs["fleet"]
    assert set(stock) == set(fleet) == set(committed) and len(stock) == 46
    differs = [node_id for node_id in stock if stock[node_id] != fleet[node_id]]
    assert differs == ["267:236"]
    assert stock["267:236"] == {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "ltx-2.3-22b-dev-fp8.safetensors"}}
    assert fleet["267:236"]["class_type"] == committed["267:236"]["class_type"] == "MGPUCheckpointLoader"
    assert {key: value for key, value in committed["267:236"]["inputs"].items() if key != "weight_dtype"} == fleet["267:236"]["inputs"]
    assert all(stock[node_id] == committed[node_id] for node_id in stock if node_id != "267:236")
    # The template's size, length and the names of the files the bench writes.
    assert [committed[node]["inputs"]["value"] for node in ("267:257", "267:258", "267:225", "267:260")] == [1280, 720, 5, 25]
    assert comfy_template.template_gemma_name() == "gemma_3_12B_it_fp4_mixed.safetensors"


def test_every_file_the_template_loads_is_linked_from_the_bundle_into_the_folder_comfyui_reads_it_from(comfy_template):
    from mgpu_backend.bundles.full_size import RandomBundle

    bundle = RandomBundle("/b", "/b/ckpt.safetensors", "/b/lora.safetensors", "/b/up.safetensors", "/b/gemma")
    links = comfy_template.model_links(False, bundle, "/g/gemma.safetensors")
    folder_of_input = {"ckpt_name": "checkpoints", "lora_name": "loras", "model_name": "latent_upscale_models", "text_encoder": "text_encoders"}
    stock = comfy_template.template_graphs(tiny_run=False)["stock"]
    loaded = {(folder_of_input[name], value) for entry in stock.values() for name, value in entry["inputs"].items() if name in folder_of_input}
    assert {(folder, name) for folder, name, _ in links} == loaded == {
        ("checkpoints", "ltx-2.3-22b-dev-fp8.safetensors"), ("loras", "ltx-2.3-22b-distilled-lora-384.safetensors"),
        ("latent_upscale_models", "ltx-2.3-spatial-upscaler-x2-1.1.safetensors"), ("text_encoders", "gemma_3_12B_it_fp4_mixed.safetensors"),
    }  # fmt: skip
    assert {name: source for _, name, source in links} == {
        "ltx-2.3-22b-dev-fp8.safetensors": "/b/ckpt.safetensors", "ltx-2.3-22b-distilled-lora-384.safetensors": "/b/lora.safetensors",
        "ltx-2.3-spatial-upscaler-x2-1.1.safetensors": "/b/up.safetensors", "gemma_3_12B_it_fp4_mixed.safetensors": "/g/gemma.safetensors",
    }  # fmt: skip


def test_a_warm_queue_changes_both_noise_seeds_and_nothing_else(comfy_template):
    stock = comfy_template.template_graphs(tiny_run=False)["stock"]
    warm = comfy_template.reseeded(stock, 1)
    assert {node_id for node_id in stock if stock[node_id] != warm[node_id]} == {"267:216", "267:237"}
    assert (warm["267:216"]["inputs"]["noise_seed"], warm["267:237"]["inputs"]["noise_seed"]) == (43, 554471341201607)


def test_each_node_of_the_template_counts_towards_its_stage(comfy_template):
    stock = comfy_template.template_graphs(tiny_run=False)["stock"]
    stages, samplers = comfy_template.graph_stages(stock)
    assert samplers == {"267:215": "stage 1", "267:219": "stage 2"}
    by_stage = {}
    for node_id, stage in stages.items():
        by_stage.setdefault(stage, set()).add(stock[node_id]["class_type"])
    assert by_stage["load"] == {"CheckpointLoaderSimple", "LTXVAudioVAELoader", "LatentUpscaleModelLoader", "LoraLoaderModelOnly"}
    assert by_stage["text encode"] == {"LTXAVTextEncoderLoader", "CLIPTextEncode", "LTXVConditioning"}
    # Between the samplers: the upsampler, stage 2's image conditioning, and its guider (it reads the cropped guides).
    assert by_stage["upsample"] == {"LTXVSeparateAVLatent", "LTXVCropGuides", "LTXVLatentUpsampler", "LTXVImgToVideoInplace", "LTXVConcatAVLatent",
                                    "CFGGuider"}  # fmt: skip
    assert by_stage["decode"] == {"LTXVSeparateAVLatent", "VAEDecodeTiled", "LTXVAudioVAEDecode", "CreateVideo", "SaveVideo"}
    assert stages["267:252"] == "stage 1" and stock["267:252"]["inputs"]["sigmas"].count(",") == 8  # 8 steps
    assert stages["267:211"] == "stage 2" and stock["267:211"]["inputs"]["sigmas"].count(",") == 3  # 3 steps
    assert stages["267:249"] == "stage 1" and stages["267:230"] == "upsample"  # the two image conditionings
    assert "other" not in by_stage
    fleet_stages, _ = comfy_template.graph_stages(comfy_template.template_graphs(tiny_run=False)["fleet"])
    assert fleet_stages == stages


def test_the_clock_spreads_a_throttled_progress_event_over_the_steps_it_covers(comfy_template, monkeypatch):
    """ComfyUI v0.20.1 sends a progress bar's updates at most every 100 ms: value 1, then 3 means two steps."""
    import comfy_graph

    now = iter(float(t) for t in (0, 1, 2, 3, 7, 10, 11, 12, 14, 20))
    monkeypatch.setattr(comfy_graph.time, "perf_counter", lambda: next(now))
    clock = comfy_graph.NodeClock({"a": "stage 1", "b": "stage 2"}, {"a": "stage 1", "b": "stage 2"})  # t = 0
    for kind, data in [
        ("executing", {"node": "a"}),  # 1
        ("progress", {"node": "a", "value": 1, "max": 8}),  # 2
        ("progress", {"node": "a", "value": 2, "max": 8}),  # 3
        ("progress", {"node": "a", "value": 6, "max": 8}),  # 7: four steps of 1 s
        ("progress", {"node": "a", "value": 8, "max": 8}),  # 10: two of 1.5 s
        ("executing", {"node": "b"}),  # 11
        ("progress", {"node": "b", "value": 1, "max": 3}),  # 12
        ("progress", {"node": "b", "value": 3, "max": 3}),  # 14
        ("executing", {"node": None}),
    ]:
        clock(kind, data)
    run = clock.result(20.0, None)
    assert run.step_seconds == {"stage 1": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.5, 1.5], "stage 2": [1.0, 1.0, 1.0]}
    assert run.seconds == {"stage 1": 10.0, "stage 2": 9.0} and run.total_seconds == 20.0  # from the first node's start


def test_the_table_sets_stock_beside_fleet_with_their_ratios_and_names_cached_stages(comfy_template):
    from comfy_graph import GraphRun

    def run(scale: float, warm: bool) -> GraphRun:
        seconds = {"stage 1": 8.0 * scale, "upsample": 0.5, "stage 2": 6.0 * scale, "decode": 10.0}
        if not warm:
            seconds |= {"load": 2.0, "text encode": 4.0}
        return GraphRun(seconds=seconds, step_seconds={"stage 1": [2.0, *[scale] * 7], "stage 2": [3.0, 2 * scale, 2 * scale]},
                        total_seconds=sum(seconds.values()))  # fmt: skip

    runs = {"stock cold": run(1.0, False), "stock warm": run(1.0, True), "fleet cold": run(0.5, False), "fleet warm": run(0.25, True)}
    lines = comfy_template.report_table(runs).splitlines()
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in lines[2:])}
    assert lines[0].split("|")[1:-1] == [" stage ", " stock s (cold) ", " stock s (warm) ", " fleet s (cold) ", " fleet s (warm) ",
                                         " fleet/stock (cold) ", " fleet/stock (warm) "]  # fmt: skip
    assert rows["load"] == ["2.00", "cached", "2.00", "cached", "1.00x", "-"]
    assert rows["stage 1"] == ["8.00", "8.00", "4.00", "2.00", "0.50x", "0.25x"]
    assert rows["stage 1 s/step (median, first left out)"] == ["1.00", "1.00", "0.50", "0.25", "0.50x", "0.25x"]
    assert rows["stage 2 s/step (median, first left out)"] == ["2.00", "2.00", "1.00", "0.50", "0.50x", "0.25x"]
    assert rows["**total**"] == ["**30.5**", "**24.5**", "**23.5**", "**14.0**", "0.77x", "0.57x"]
    only_stock = comfy_template.report_table({**runs, "fleet cold": None, "fleet warm": None}).splitlines()
    assert [c.strip() for c in only_stock[2].split("|")[1:-1]] == ["load", "2.00", "cached", "-", "-", "-", "-"]

    # The GPU run's report: one table per fleet, each under its GPUs and world size; the stock side alone under its own line.
    text = comfy_template.report_text({"0": "TABLE 1", "0,1,2,3": "TABLE 4"}, 95.4, []).splitlines()
    assert "files ready in 95 s" in text[0] and text[0].endswith("ComfyUI with its default memory settings.")
    assert text[1:9] == ["", "Fleet on GPUs 0 (world 1):", "", "TABLE 1", "", "Fleet on GPUs 0,1,2,3 (world 4):", "", "TABLE 4"]
    assert comfy_template.report_text({"-": "TABLE"}, 1.0, ["--gpu-only"]).splitlines()[:4] == [
        text[0].replace("files ready in 95 s", "files ready in 1 s").replace("with its default memory settings", "--gpu-only"), "", "Stock only:", ""]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(not COMFYUI_DIR or not (Path(COMFYUI_DIR or ".") / "main.py").is_file(), reason="set COMFYUI_DIR to a ComfyUI checkout")
def test_a_real_comfyui_runs_the_tiny_template_stock_and_on_the_fleet_cold_and_warm_to_the_end():
    """Both graphs (45 nodes: the tiny twin) to their SaveVideo, cold and warm; the warm queue reruns only
    what the new seeds reach (15 nodes: noise, both samplers and what follows them), 8 + 3 steps each.
    Then the full-size graphs on the tiny files: accepted, and run, the model loader among the 18 nodes
    ComfyUI's cache does not hold from the twin's runs, up to ComfyUI's text encoder."""
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MGPU_")}
    completed = subprocess.run(
        [os.environ.get("COMFYUI_PYTHON", sys.executable), str(BENCH), "--comfyui-dir", COMFYUI_DIR, "--tiny"], capture_output=True,
        text=True, timeout=900, cwd=REPO, env={**environment, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr[-6000:]
    lines = completed.stdout.strip().splitlines()
    stop = ("up to its text encoder: node 267:243 LTXV Audio Text Encoder Loader failed: RuntimeError: Error(s) in loading state_dict for "
            "DualLinearProjection:")  # the 12B text projection: the tiny Gemma has not its 3840 x 49 features
    assert lines[:6] == [
        "stock cold: ComfyUI ran 45 of 45 nodes to the end (CheckpointLoaderSimple), stage 1 8 steps, stage 2 3 steps",
        "stock warm: ComfyUI ran 15 of 45 nodes to the end (CheckpointLoaderSimple), stage 1 8 steps, stage 2 3 steps",
        f"stock full size: ComfyUI accepted the template's graph (46 nodes) and ran 18 of them, CheckpointLoaderSimple among them, {stop}",
        "fleet cold: ComfyUI ran 45 of 45 nodes to the end (MGPUCheckpointLoader), stage 1 8 steps, stage 2 3 steps",
        "fleet warm: ComfyUI ran 15 of 45 nodes to the end (MGPUCheckpointLoader), stage 1 8 steps, stage 2 3 steps",
        f"fleet full size: ComfyUI accepted the template's graph (46 nodes) and ran 18 of them, MGPUCheckpointLoader among them, {stop}",
    ], completed.stdout
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.split("|")[1:-1]] for line in lines[8:])}
    assert rows["load"][1] == rows["load"][3] == "cached" and rows["text encode"][3] == "cached"
    assert all(value not in ("-", "cached") for value in rows["decode"][:4])
