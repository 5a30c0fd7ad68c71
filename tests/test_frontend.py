"""The pack's side of what ComfyUI's frontend shows, without a browser: refusals that name the input at
fault (and the web extension that keeps only that input's copy, run in Node.js when it is installed),
the search aliases ComfyUI serves, the template order the extension reads, and the one sentence about
a fleet that is not running. tests/e2e/test_browser_ui.py checks the same in a real ComfyUI page."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import builder

PACK_DIR = Path(__file__).resolve().parent.parent
pack = builder.load_pack()
NODES = pack.NODE_CLASS_MAPPINGS


def test_sp_sampler_refuses_a_bad_frame_count_under_length_and_a_bad_width_under_width():
    sampler = NODES["MGPUSPSampler"]
    good = {"width": 768, "height": 512, "length": 121, "frame_rate": 24.0, "seed": 10, "steps": 40, "stg_blocks": ""}
    assert sampler.VALIDATE_INPUTS(**good) is True
    assert sampler.VALIDATE_INPUTS(**{**good, "length": 126}) == (
        "length: frames must be 8k+1 (the video VAE packs 8 frames per latent frame after the first), got 126; use 129"
    )
    assert sampler.VALIDATE_INPUTS(**{**good, "width": 760}) == "width: width must be a multiple of 32 for a single stage, got 760; use 768"
    assert sampler.VALIDATE_INPUTS(**{**good, "steps": 0}).startswith("steps: steps must be a whole number >= 1, got 0")
    # frame_rate fed by a link is None before the run: skipped, never blamed.
    assert sampler.VALIDATE_INPUTS(**{**good, "frame_rate": None, "length": 126}).startswith("length: ")


def test_the_loader_blames_the_distilled_lora_for_float32_not_dtype():
    loader = NODES["MGPULoadCheckpoint"]
    tiny_lora = "(embedded tiny LTX-2, random weights)"
    assert loader.VALIDATE_INPUTS(distilled_lora=tiny_lora, dtype="bfloat16") is True
    assert loader.VALIDATE_INPUTS(distilled_lora=tiny_lora, dtype="float32").startswith("distilled_lora: dtype float32 cannot be used with the distilled LoRA")
    assert loader.VALIDATE_INPUTS(distilled_lora=tiny_lora, dtype="float64") == "dtype: dtype must be one of bfloat16, float32, got 'float64'"


def test_text_encode_and_tdp_upscale_name_the_input_at_fault():
    encode, upscale = NODES["MGPUTextEncode"], NODES["MGPUTDPUpscale"]
    assert encode.VALIDATE_INPUTS(positive="a fox", negative="x" * 20001) == "negative: a prompt has 20001 characters; the limit is 20000: shorten it"
    assert encode.VALIDATE_INPUTS(positive=" ", negative="") == "positive: the positive prompt is empty; describe the video and its sound"
    assert upscale.VALIDATE_INPUTS(sigmas="0.625, 0.4, 0.0", tiles="3", force_from_noise=False).startswith("tiles: tiles must be 'auto' or HxW")


COMFY_ERRORS = {
    # ComfyUI v0.20.1's answer for SP Sampler with length 126: one copy per VALIDATE_INPUTS argument.
    "4": {
        "class_type": "MGPUSPSampler",
        "dependent_outputs": ["8"],
        "errors": [
            {"type": "custom_validation_failed", "message": "Custom validation failed for node", "details": f"{name} - length: frames must be 8k+1, got 126; use 129", "extra_info": {"input_name": name}}
            for name in ("width", "height", "length", "frame_rate", "seed", "steps", "stg_blocks")
        ]
        + [{"type": "value_bigger_than_max", "message": "Value 9 bigger than max of 8", "details": "overlap", "extra_info": {"input_name": "overlap"}}],
    },
    # Another pack's refusal, filed under two inputs: not ours to rewrite.
    "5": {
        "class_type": "OtherNode",
        "errors": [
            {"type": "custom_validation_failed", "message": "Custom validation failed for node", "details": f"{name} - bad size", "extra_info": {"input_name": name}}
            for name in ("a", "b")
        ],
    },
}


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run the web extension's function")
def test_the_web_extension_keeps_one_copy_of_a_refusal_under_the_input_it_names(tmp_path):
    # Laid out as ComfyUI serves it: the module imports ../../scripts/api.js, here a stand-in with
    # nothing to wrap.
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "api.js").write_text("export const api = {};\n")
    (tmp_path / "extensions" / "pack").mkdir(parents=True)
    shutil.copy(PACK_DIR / "web" / "mgpu_validation.js", tmp_path / "extensions" / "pack")
    runner = tmp_path / "run.js"
    runner.write_text(
        "import { oneErrorPerFault } from './extensions/pack/mgpu_validation.js';\n"
        f"console.log(JSON.stringify(oneErrorPerFault({json.dumps(COMFY_ERRORS)})));\n"
    )
    shown = json.loads(subprocess.run(["node", str(runner)], capture_output=True, text=True, check=True, timeout=60).stdout)
    assert [(error["extra_info"]["input_name"], error["details"]) for error in shown["4"]["errors"]] == [
        ("length", "length: frames must be 8k+1, got 126; use 129"),
        ("overlap", "overlap"),
    ]
    assert shown["5"] == COMFY_ERRORS["5"]


def test_every_node_is_found_by_the_model_names_and_its_own_function():
    search_table = __import__("comfyui_mgpu_pack.nodes", fromlist=["SEARCH_ALIASES"]).SEARCH_ALIASES
    assert search_table.keys() == NODES.keys(), "a node without search aliases of its own: add it to nodes/__init__.py"
    for name, node_class in NODES.items():
        aliases = node_class.SEARCH_ALIASES
        assert {"ltx", "ltx-2", "ltx-2.3", "mgpu"} <= set(aliases), name
        assert len(aliases) == len(set(aliases)), f"{name} repeats an alias"
    assert "ltx sampler" in NODES["MGPUSPSampler"].SEARCH_ALIASES and "ltx upscale" in NODES["MGPUTDPUpscale"].SEARCH_ALIASES


def test_template_order_file_lists_every_ui_workflow_tiny_ones_first():
    order = json.loads((PACK_DIR / "web" / "template_order.json").read_text())
    assert order == builder.template_order(), "web/template_order.json is stale: run python workflows/make_workflows.py"
    assert sorted(order) == sorted(path.stem for path in (PACK_DIR / "workflows").glob("*.json"))
    assert order[:2] == ["LTX-2.3 Tiny Test — no download", "LTX-2.0 Tiny Test — no download"]


def test_template_titles_lead_with_the_words_users_search_for_and_fit_a_card_line():
    for template in builder.TEMPLATES:
        assert template.title.startswith(f"LTX-{template.example.version} "), template.title
        example = template.example
        task = "Tiny Test" if example.tiny else "First-Last Frame" if example.last_image else "Image to Video" if example.image else "Text to Video"
        assert task in template.title and len(template.title) <= 34, template.title


def test_the_fleet_is_said_to_start_with_the_first_node_unless_it_was_started_by_hand(monkeypatch):
    fleet_admin = __import__("comfyui_mgpu_pack.nodes.fleet_admin", fromlist=["not_running_message"])
    reason = "no fleet server answers at /run/x/fleet.sock; start one with 'python -m mgpu_backend serve'"
    monkeypatch.delenv("MGPU_SOCKET", raising=False)
    text = fleet_admin.not_running_message(reason)
    assert text == "fleet not running: the first MGPU node starts it (on every visible GPU, or MGPU_GPUS / MGPU_CPU_RANKS)"
    monkeypatch.setenv("MGPU_SOCKET", "/run/x/fleet.sock")
    assert fleet_admin.not_running_message(reason) == f"fleet not running: {reason}"
