"""Gemma as a Hugging Face folder (the release's config.json, weight shards and tokenizer), found and read
the way ltx-core finds it. ComfyUI's single-file Gemma is ``gemma_file``; both are built by ``loading``.

Reads files only (config.json, file names); never loads weights, never imports ltx-pipelines.
"""

from __future__ import annotations

import json
from pathlib import Path

from mgpu_backend.ltx.schema import ModelFileError


def gemma_folder_files(gemma_root: str) -> tuple[Path, list[str]]:
    """The Gemma config.json and weight files, found the way ltx-core finds them."""
    root = Path(gemma_root)
    weights = sorted(root.rglob("model*.safetensors"))
    missing = [name for name in ("tokenizer.model",) if not any(root.rglob(name))]
    if not weights or missing:
        what = ", ".join((["model*.safetensors"] if not weights else []) + missing)
        raise ModelFileError(
            f"Gemma folder {gemma_root} has no {what}; it must hold the whole Gemma-3 text encoder as "
            "published (config, weights and tokenizer files)"
        )
    model_folder = weights[0].parent
    config_path = model_folder / "config.json"
    if not config_path.is_file():
        raise ModelFileError(
            f"Gemma folder {model_folder} has no config.json next to its weights; copy it from the release"
        )
    return config_path, sorted(str(p) for p in model_folder.rglob("*.safetensors"))


def gemma_folder_config(gemma_root: str) -> dict:
    """ltx-core's Gemma-3 12B configuration, updated with the folder's own config.json."""
    from ltx_core.text_encoders.gemma.config import GEMMA3_CONFIG_FOR_LTX

    config_path, _ = gemma_folder_files(gemma_root)
    try:
        folder_config = json.loads(config_path.read_text())
    except (OSError, ValueError) as error:
        raise ModelFileError(
            f"Gemma config {config_path} is not valid JSON ({error}); restore it from the release"
        ) from error
    config = GEMMA3_CONFIG_FOR_LTX.to_dict()
    for key, value in folder_config.items():
        if key in ("text_config", "vision_config") and isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    return config
