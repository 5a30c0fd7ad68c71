"""Safetensors headers read without torch: tensor names, shapes and metadata, and the model version they name.

A safetensors file starts with an 8-byte little-endian length and a JSON header (every tensor's
dtype and shape, plus an optional ``__metadata__`` of strings). That is all the pack needs to know
what a file is before it loads anything: the checkpoint's LTX-2 version (``checkpoint_model_version``,
read from its ``model_version`` metadata exactly as ltx-pipelines' ``detect_params`` reads it), the
layers a LoRA adapts, the sizes the residency plan budgets. The ComfyUI nodes, the CLI and the ranks
all read the version here, so they agree on it.

This module must never import torch, ltx_core or ltx_pipelines (the ComfyUI process imports it), and
never writes files.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

MAX_HEADER_BYTES = 100 * 1024 * 1024

LTX_2_3_VERSION_PREFIX = "2.3"
"""ltx_pipelines.utils.constants: a ``model_version`` starting with "2.3" is LTX-2.3; anything else
(including none) is LTX-2.0."""


class ModelFileError(ValueError):
    """A model file or folder that cannot be used; the message names it and says what to do."""


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
    metadata: dict[str, str]


def read_header(path: str, role: str, remedy: str) -> SafetensorsHeader:
    """The header of a safetensors file, or a ModelFileError that says the file is not one."""
    not_safetensors = ModelFileError(f"{role} {path} is not a .safetensors file. {remedy}")
    try:
        with open(path, "rb") as f:
            size_bytes = f.read(8)
            if len(size_bytes) != 8:
                raise not_safetensors
            (header_size,) = struct.unpack("<Q", size_bytes)
            if header_size > min(MAX_HEADER_BYTES, os.path.getsize(path) - 8):
                raise not_safetensors
            header = json.loads(f.read(header_size))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        if isinstance(error, ModelFileError):
            raise
        raise not_safetensors from error
    if not isinstance(header, dict):
        raise not_safetensors
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or "shape" not in entry or "dtype" not in entry:
            raise not_safetensors
        tensors[name] = (entry["dtype"], tuple(entry["shape"]))
    return SafetensorsHeader(tensors=tensors, metadata=metadata)


def model_version_of(metadata: dict, tensors: dict | None = None) -> str:
    """The pack's model version ("2.0" or "2.3") of a checkpoint with this header metadata (and tensors).

    The ``model_version`` metadata decides, as in ``detect_params``. A file without it (re-saved by
    a converter that drops metadata) is read from its layout instead, where ``detect_params`` would
    take 2.0: the 22B layout's transformer config projects the caption before the connectors, and
    its attention has gates."""
    version = metadata.get("model_version")
    if isinstance(version, str) and version:
        return "2.3" if version.startswith(LTX_2_3_VERSION_PREFIX) else "2.0"
    try:
        transformer = json.loads(metadata.get("config", "{}")).get("transformer", {})
    except (ValueError, AttributeError):
        transformer = {}
    if isinstance(transformer, dict) and transformer.get("caption_proj_before_connector"):
        return "2.3"
    if tensors and any(".to_gate_logits." in name and name.startswith("model.diffusion_model.") for name in tensors):
        return "2.3"
    return "2.0"


def checkpoint_model_version(path: str) -> str:
    """The LTX-2 version of the checkpoint at ``path``: "2.3" when its ``model_version`` metadata
    starts with "2.3", else "2.0" (as ``detect_params``; ``model_version_of`` for a file without
    that metadata). Raises ModelFileError for a file that is not safetensors, where
    ``detect_params`` would quietly fall back to 2.0."""
    header = read_header(path, "checkpoint", "Choose the LTX-2 audio+video checkpoint (e.g. ltx-2.3-22b-dev.safetensors).")
    return model_version_of(header.metadata, header.tensors)
