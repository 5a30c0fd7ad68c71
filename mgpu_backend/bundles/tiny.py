"""The tiny LTX-2 bundles with random weights: what tests and ``generate``'s embedded default run on.

No real LTX-2 weights exist on the machines this project is built and tested on. A tiny bundle is
every component in the official file layouts (``layout.py``) at the tiny configuration of
``configs.py``, for LTX-2.0 (the default) or LTX-2.3 (the 22B layout), so that ltx-core's own
loaders and the real inference code run on it end to end. Its files, named in ``tiny-bundle.json``
under the keys of ``ROLES`` (paths relative to the bundle's folder):

- ``checkpoint`` (``ltx-2-tiny.safetensors``; ``ltx-2.3-tiny...`` for 2.3): the dev checkpoint;
- ``distilled_checkpoint``: the distilled model, same layout, its own weights;
- ``distilled_lora``: the distilled LoRA (rank 4) for the dev transformer;
- ``spatial_upsampler``: the x2 latent upsampler;
- ``gemma_root``: the Gemma-3 folder (tokenizer trained here; the same for both versions).

Bytes are deterministic: every tensor is drawn on the host from a generator seeded by its own name
(``layout.NameSeeded``), the files are serialised with sorted keys. This module never downloads
anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from mgpu_backend.bundles import gemma_folder, layout
from mgpu_backend.bundles.configs import (
    CHECKPOINT_CONFIG,
    GEMMA_CONFIG,
    GEMMA_TEXT_CONFIG,
    GEMMA_VISION_CONFIG,
    LORA_RANK,
    LTX2_TRANSFORMER_ARCHITECTURE,
    SPATIAL_UPSAMPLER_CONFIG,
    TRANSFORMER_CONFIG,
    VERSIONS,
    VIDEO_VAE_CONFIG,
    tiny_config,
)

__all__ = [
    "BUNDLE_VERSION",
    "CHECKPOINT_CONFIG",
    "CHECKPOINT_NAME",
    "DISTILLED_LORA_NAME",
    "GEMMA_CONFIG",
    "GEMMA_DIR_NAME",
    "GEMMA_TEXT_CONFIG",
    "GEMMA_VISION_CONFIG",
    "GEMMA_WEIGHTS_NAME",
    "LORA_RANK",
    "LTX2_TRANSFORMER_ARCHITECTURE",
    "ROLES",
    "SPATIAL_UPSAMPLER_CONFIG",
    "SPATIAL_UPSAMPLER_NAME",
    "TRANSFORMER_CONFIG",
    "TinyBundle",
    "VIDEO_VAE_CONFIG",
    "cache_dir",
    "default_tiny_bundle",
    "file_names",
    "make_tiny_bundle",
]

BUNDLE_VERSION = 1
"""Written into every model file's metadata: bump whenever any byte of a file already in the bundle
changes (caches are kept per version). A file added under a new role needs no bump: a bundle whose
manifest does not name every role of ``ROLES`` is incomplete and is rewritten."""

ROLES = ("checkpoint", "distilled_checkpoint", "distilled_lora", "spatial_upsampler", "gemma_root")
"""The keys under which ``tiny-bundle.json`` names the bundle's files."""

_MANIFEST = "tiny-bundle.json"
GEMMA_DIR_NAME = "gemma-3-tiny"
GEMMA_WEIGHTS_NAME = gemma_folder.WEIGHTS_NAME


def file_names(version: str = "2.0") -> layout.FileNames:
    """The tiny bundle's file names for LTX-``version`` (the 2.0 names are those of the first bundles)."""
    if version not in VERSIONS:
        raise ValueError(f"no tiny LTX-2 bundle for version {version!r}; choose one of {', '.join(VERSIONS)}")
    stem = "ltx-2-tiny" if version == "2.0" else f"ltx-{version}-tiny"
    return layout.FileNames(
        checkpoint=f"{stem}.safetensors",
        distilled_checkpoint=f"{stem}-distilled.safetensors",
        distilled_lora=f"{stem}-distilled-lora.safetensors",
        spatial_upsampler=f"{stem}-spatial-upscaler-x2.safetensors",
        gemma_root=GEMMA_DIR_NAME,
    )


CHECKPOINT_NAME = file_names().checkpoint
DISTILLED_LORA_NAME = file_names().distilled_lora
SPATIAL_UPSAMPLER_NAME = file_names().spatial_upsampler


@dataclass(frozen=True)
class TinyBundle(layout.TwoStageFiles):
    """Paths of one tiny LTX-2 bundle (all absolute strings, as ltx-core's loaders take them)."""

    root: str
    version: str
    checkpoint_path: str
    distilled_checkpoint_path: str
    distilled_lora_path: str
    spatial_upsampler_path: str
    gemma_root: str

    def __str__(self) -> str:
        return "\n".join(
            [
                f"tiny LTX-{self.version} bundle v{BUNDLE_VERSION} in {self.root}",
                f"  checkpoint:           {self.checkpoint_path}",
                f"  distilled checkpoint: {self.distilled_checkpoint_path}",
                f"  distilled LoRA:       {self.distilled_lora_path}",
                f"  spatial upsampler:    {self.spatial_upsampler_path}",
                f"  gemma root:           {self.gemma_root}",
            ]
        )


def _bundle_at(root: Path, version: str) -> TinyBundle:
    root, names = root.resolve(), file_names(version)
    return TinyBundle(
        root=str(root),
        version=version,
        checkpoint_path=str(root / names.checkpoint),
        distilled_checkpoint_path=str(root / names.distilled_checkpoint),
        distilled_lora_path=str(root / names.distilled_lora),
        spatial_upsampler_path=str(root / names.spatial_upsampler),
        gemma_root=str(root / names.gemma_root),
    )


def _roles(version: str) -> dict[str, str]:
    names = file_names(version)
    return {role: getattr(names, role) for role in ROLES}


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_complete(root: Path, version: str) -> bool:
    """True when ``root`` holds every file of a bundle of this version, unchanged since it was made."""
    try:
        manifest = json.loads((root / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("version") != BUNDLE_VERSION or any(manifest.get(role) != name for role, name in _roles(version).items()):
        return False
    files = manifest.get("files", {})
    return bool(files) and all(
        (root / name).is_file() and _sha256_file(root / name) == digest for name, digest in files.items()
    )


def make_tiny_bundle(directory: str | os.PathLike, version: str = "2.0") -> TinyBundle:
    """Write the tiny LTX-``version`` bundle into ``directory`` (created if needed) and return its paths.

    Deterministic: the same bytes every time. A directory that already holds a complete bundle of
    this version is reused as it is. Each file is written atomically and the manifest last, so a
    directory interrupted half-way is never taken for a complete bundle.
    """
    root, names = Path(directory), file_names(version)
    if _is_complete(root, version):
        return _bundle_at(root, version)
    style = layout.Style(names, {"mgpu_tiny_bundle": str(BUNDLE_VERSION)}, tag_gemma_weights=False)
    written = layout.write_files(root, tiny_config(version), style, layout.NameSeeded())
    manifest = {
        "version": BUNDLE_VERSION,
        "model_version": version,
        **_roles(version),
        "files": {name: _sha256_file(root / name) for name in sorted(written)},
    }
    layout.write_atomic(root / _MANIFEST, gemma_folder.json_bytes(manifest))
    return _bundle_at(root, version)


def cache_dir() -> Path:
    """``$MGPU_CACHE_DIR``, or ``~/.cache/comfyui-mgpu``."""
    return Path(os.environ.get("MGPU_CACHE_DIR") or Path.home() / ".cache" / "comfyui-mgpu")


def default_tiny_bundle(version: str = "2.0") -> TinyBundle:
    """The tiny LTX-``version`` bundle in the cache, made on first use.

    Safe against several processes making it at once: each builds in a private folder and renames
    it into place; a process that loses the race drops its copy and uses the winner's.
    """
    final = cache_dir() / (f"tiny-ltx2-v{BUNDLE_VERSION}" if version == "2.0" else f"tiny-ltx{version}-v{BUNDLE_VERSION}")
    if _is_complete(final, version):
        return _bundle_at(final, version)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_tiny_bundle(staging, version)
        if final.exists() and not _is_complete(final, version):
            # A damaged folder (edited by hand, or an older bundle of this version): move it aside.
            aside = final.with_name(f".{final.name}.stale.{uuid.uuid4().hex}")
            try:
                final.rename(aside)
            except FileNotFoundError:
                pass  # another process moved it first
            else:
                shutil.rmtree(aside, ignore_errors=True)
        try:
            staging.rename(final)
        except OSError:
            if not _is_complete(final, version):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _bundle_at(final, version)
