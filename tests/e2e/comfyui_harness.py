"""A real ComfyUI with this pack for the end-to-end tests: the server (``--cpu``, the pack symlinked
into a temporary base directory, the tiny model files in its models/ folders, a fleet of its own),
JSON over HTTP, and queueing the tiny API workflow."""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.request
from pathlib import Path

from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.gemma_file import gemma_folder_to_comfy_file
from mgpu_backend.tools import comfy_queue
from mgpu_backend.tools.comfy_server import ComfyUIServer

PACK_DIR = Path(__file__).resolve().parents[2]
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
TINY_WORKFLOW = PACK_DIR / "workflows" / "api" / "ltx2_t2v_tiny.json"
START_TIMEOUT_SECONDS = 240
GEMMA_FILE = "gemma_3_tiny_it.safetensors"  # the tiny Gemma in the layout of ComfyUI's gemma_3_12B_it.safetensors


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def post_json(url: str, payload: dict):
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        body = response.read()
        return json.loads(body) if body else None


class ComfyUI(ComfyUIServer):
    """ComfyUI --cpu with the pack symlinked into ``base``'s custom_nodes, the tiny model files in its
    models/ folders (``model_files``: their names there), and a fleet of its own behind a private runtime folder."""

    def __init__(self, base: Path) -> None:
        (base / "custom_nodes").mkdir(parents=True)
        (base / "custom_nodes" / "comfyui-mgpu").symlink_to(PACK_DIR, target_is_directory=True)
        self.model_files = place_user_models(base / "models")
        runtime = base / "run"
        runtime.mkdir(mode=0o700)
        env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "MGPU_CPU_RANKS": os.environ.get("MGPU_CPU_RANKS", "2"), "OMP_NUM_THREADS": "1"}
        env.pop("MGPU_SOCKET", None)  # ComfyUI must start its own fleet
        super().__init__(Path(COMFYUI_DIR), base, ["--cpu"], python=os.environ.get("COMFYUI_PYTHON", sys.executable), env=env)


def place_user_models(models: Path) -> dict[str, str]:
    """Copy the tiny bundle's files where a user puts downloaded LTX-2 files, and write its Gemma
    folder as one ComfyUI-layout file there; returns the Load Checkpoint MGPU input naming each."""
    bundle = tiny.default_tiny_bundle()  # the same cache the fleet's embedded entry reads
    placed = {}
    for input_name, folder, source in (
        ("ckpt_name", "checkpoints", bundle.checkpoint_path),
        ("spatial_upsampler", "latent_upscale_models", bundle.spatial_upsampler_path),
        ("distilled_lora", "loras", bundle.distilled_lora_path),
    ):
        (models / folder).mkdir(parents=True)
        placed[input_name] = Path(shutil.copyfile(source, models / folder / Path(source).name)).name
    (models / "text_encoders").mkdir()
    placed["gemma"] = Path(gemma_folder_to_comfy_file(bundle.gemma_root, str(models / "text_encoders" / GEMMA_FILE))).name
    return placed


def queue(comfyui: ComfyUI, **overrides) -> comfy_queue.Outcome:
    workflow = comfy_queue.apply_overrides(json.loads(TINY_WORKFLOW.read_text()), [f"{key}={value}" for key, value in overrides.items()])
    return comfy_queue.queue_prompt(comfyui.url, workflow, say=lambda text: None, timeout=600)


def saved_video(comfyui: ComfyUI, outcome: comfy_queue.Outcome) -> Path:
    (entry,) = [item for _, item in comfy_queue.output_files(outcome.outputs) if item["filename"].endswith(".mp4")]
    return comfyui.base / entry["type"] / entry["subfolder"] / entry["filename"]
