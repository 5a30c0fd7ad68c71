"""Random-weight LTX-2 bundles at a full-size (or any) configuration, for benchmarks.

A full-size bundle cannot be built in host memory (the 19B transformer alone is 37.8 GB in bf16).
``write_bundle`` writes the official layouts (``layout.py``: the files ltx-core's loaders,
ltx-pipelines' ModelLedger and our ModelLoader read) at a given ``BundleConfig``, streaming: each
component is given seeded random weights on the target device (``layout.DeviceSeeded``), and each
tensor is copied to the host and appended to its file on its own. With a GPU as the device, host
memory holds one tensor at a time and GPU memory one component.

``full_size_config`` (``configs.py``) gives the LTX-2 19B or LTX-2.3 22B configuration (sources in
docs/full-size-config.md) with a Gemma-3 12B text encoder of FEWER layers than the real 48 (the real
one, 23.5 GB, does not fit on a 64 GB benchmark disk beside the rest): its text-encode time is a
lower bound. ``tiny_config`` gives the tiny bundle's configuration. A random bundle holds no
distilled checkpoint (a second 42 GB file would not fit that disk either). Its Gemma folder carries
the tiny bundle's tokenizer: its ids are valid in any Gemma vocabulary, and prompts are still
padded to ltx-core's 1024 tokens, so Gemma's compute per layer is the real one.

Same seed, configuration and device type: same bytes. This module never downloads anything and
never edits ltx-core.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from mgpu_backend.bundles import gemma_folder, layout
from mgpu_backend.bundles.configs import (
    DEFAULT_GEMMA_LAYERS,
    FULL_SIZE_LORA_RANK,
    FULL_SIZE_VIDEO_VAE_CONFIG,
    GEMMA_FULL_LAYERS,
    BundleConfig,
    full_size_config,
    ltx_core_gemma_config,
    tiny_config,
)

__all__ = [
    "CHECKPOINT_NAME",
    "DEFAULT_GEMMA_LAYERS",
    "DISTILLED_LORA_NAME",
    "FULL_SIZE_LORA_RANK",
    "FULL_SIZE_VIDEO_VAE_CONFIG",
    "GEMMA_DIR_NAME",
    "GEMMA_FULL_LAYERS",
    "SPATIAL_UPSAMPLER_NAME",
    "BundleConfig",
    "RandomBundle",
    "full_size_config",
    "is_complete",
    "ltx_core_gemma_config",
    "planned_bytes",
    "planned_shapes",
    "tiny_config",
    "write_bundle",
]

RANDOM_BUNDLE_FORMAT = 1
"""Bump whenever the bytes written for a configuration and seed change: old folders are rewritten."""

_MANIFEST = "random-bundle.json"

CHECKPOINT_NAME = "ltx-2-random.safetensors"
DISTILLED_LORA_NAME = "ltx-2-random-distilled-lora.safetensors"
SPATIAL_UPSAMPLER_NAME = "ltx-2-random-spatial-upscaler-x2.safetensors"
GEMMA_DIR_NAME = "gemma-3-random"

_STYLE = layout.Style(
    layout.FileNames(CHECKPOINT_NAME, None, DISTILLED_LORA_NAME, SPATIAL_UPSAMPLER_NAME, GEMMA_DIR_NAME),
    {"mgpu_random_bundle": str(RANDOM_BUNDLE_FORMAT)},
    tag_gemma_weights=True,
)


@dataclass(frozen=True)
class RandomBundle(layout.TwoStageFiles):
    """Paths of one written bundle (absolute strings, as ltx-core's loaders take them)."""

    root: str
    checkpoint_path: str
    distilled_lora_path: str
    spatial_upsampler_path: str
    gemma_root: str


def _bundle_at(root: Path) -> RandomBundle:
    root = root.resolve()
    return RandomBundle(
        root=str(root),
        checkpoint_path=str(root / CHECKPOINT_NAME),
        distilled_lora_path=str(root / DISTILLED_LORA_NAME),
        spatial_upsampler_path=str(root / SPATIAL_UPSAMPLER_NAME),
        gemma_root=str(root / GEMMA_DIR_NAME),
    )


def planned_shapes(config: BundleConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Each weight file's tensors (key -> shape, bf16) of a bundle at ``config``, from meta shapes."""
    return layout.planned_shapes(config, _STYLE)


def planned_bytes(config: BundleConfig) -> dict[str, int]:
    """Tensor bytes of each weight file of a bundle at ``config`` (from meta shapes: nothing is
    allocated), so a caller can check the disk before writing tens of gigabytes."""
    return layout.planned_bytes(config, _STYLE)


# --- Writing a bundle ---------------------------------------------------------------------------------


def _manifest_identity(config: BundleConfig, seed: int, device: torch.device) -> dict:
    # Device type matters: the same seed draws other numbers on a GPU than on the CPU.
    return {"format": RANDOM_BUNDLE_FORMAT, "seed": seed, "device_type": device.type, "config": config.to_json()}


def is_complete(directory: str | os.PathLike, config: BundleConfig, device: torch.device | str, seed: int) -> bool:
    """Whether ``directory`` holds a complete bundle that ``write_bundle`` with these arguments reuses."""
    return _is_complete(Path(directory), _manifest_identity(config, seed, torch.device(device)))


def _is_complete(root: Path, identity: dict) -> bool:
    try:
        manifest = json.loads((root / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    files = manifest.pop("files", None)
    if manifest != json.loads(json.dumps(identity)) or not files:
        return False
    # Sizes, not hashes: hashing a full-size bundle would take minutes. Files are renamed into
    # place whole and the manifest is written last, so a size check catches interrupted writes.
    return all((root / name).is_file() and (root / name).stat().st_size == size for name, size in files.items())


def write_bundle(
    directory: str | os.PathLike,
    config: BundleConfig,
    device: torch.device | str = "cpu",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    gemma_dir: str | os.PathLike | None = None,
) -> RandomBundle:
    """Write a random-weight LTX-2 bundle at ``config`` into ``directory`` and return its paths.

    ``gemma_dir`` puts the Gemma folder's files there instead (another disk, or tmpfs when the disk
    cannot hold a 48-layer Gemma beside the checkpoint); the bundle reaches them through a symlink.

    Weights are drawn on ``device`` (a GPU makes full size fast) from ``seed``; each component has
    its own seed, derived from ``seed`` and its name. A directory already holding a complete bundle
    of the same configuration, seed and device type is reused as it is. Each file is written under
    a temporary name and renamed into place, the manifest last.
    """
    device = torch.device(device)
    root = Path(directory)
    if gemma_dir is not None:
        _link_gemma_folder(root, Path(gemma_dir))
    identity = _manifest_identity(config, seed, device)
    if _is_complete(root, identity):
        if log:
            log(f"random bundle in {root} is complete for this configuration and seed: reused")
        return _bundle_at(root)
    (root / _MANIFEST).unlink(missing_ok=True)
    if log:
        log(f"writing a random bundle into {root}, weights drawn on {device} ...")
    sizes = layout.write_files(root, config, _STYLE, layout.DeviceSeeded(device, seed), log)
    layout.write_atomic(root / _MANIFEST, gemma_folder.json_bytes({**identity, "files": dict(sorted(sizes.items()))}))
    return _bundle_at(root)


def _link_gemma_folder(root: Path, target: Path) -> None:
    """Make ``root``'s Gemma folder a symlink to ``target`` (created if missing)."""
    target = target.resolve()
    target.mkdir(parents=True, exist_ok=True)
    link = root / GEMMA_DIR_NAME
    if link.is_symlink():
        if link.resolve() == target:
            return
        link.unlink()
    elif link.exists():
        raise FileExistsError(f"{link} is a folder of its own; remove it to keep the bundle's Gemma in {target}")
    root.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target, target_is_directory=True)
