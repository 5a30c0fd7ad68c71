"""ComfyUI's own code inside a rank: importing it, loading a model with its loaders, patching weights.

A rank imports ComfyUI from the checkout that started the fleet (``comfy_dir``), never a copy of
its code of our own: the LTX model that runs in the fleet is the one ComfyUI's users run. Before
anything of ComfyUI is imported, the checkout's ``comfyui_version.py`` is read and a release older than
the first one this engine was checked against is refused (``TESTED_COMFYUI_VERSIONS``); a newer one
is taken on trust of the plan, whose structural checks (``plan.check_code``) decide before any weight
is loaded, and logged as untested. Then ComfyUI is told not
to parse the rank's argv (``comfy.options.args_parsing = False``) and, on a CPU rank, to run on the
CPU (``args.cpu``), before ``comfy.model_management`` picks its device.

Models are loaded by ComfyUI's own loaders with the options its nodes use (CheckpointLoaderSimple,
UNETLoader and its weight dtypes), and weight patches (LoRAs) are applied by ComfyUI's own
``ModelPatcher``, so patched weights are bitwise those ComfyUI computes in its own process.

This module never edits ComfyUI's files and never imports ComfyUI at module import time (the fleet
runs without ComfyUI until a ``comfy.*`` job arrives).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from mgpu_backend.comfy_model import wire

log = logging.getLogger(__name__)

TESTED_COMFYUI_VERSIONS = ("0.20.1",)
"""The ComfyUI releases whose LTX code this engine's plan was checked against (``plan.py``), oldest
first. Older releases are refused; newer ones run when the plan's structural checks pass."""

LOADERS = ("checkpoint", "diffusion_model")
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")


class ComfyInputError(ValueError):
    """Something a user can fix about what the ComfyUI side asked for (the jobs turn it into JobInputError)."""


def comfyui_version(comfy_dir: Path) -> str:
    """The ``__version__`` written in ``comfy_dir/comfyui_version.py``, read as text (nothing imported)."""
    version_file = comfy_dir / "comfyui_version.py"
    if not (comfy_dir / "comfy").is_dir() or not version_file.is_file():
        raise ComfyInputError(
            f"{comfy_dir} is not a ComfyUI checkout (it needs comfy/ and comfyui_version.py); "
            "pass the folder ComfyUI's main.py runs from"
        )
    found = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", version_file.read_text(errors="replace"))
    if found is None:
        raise ComfyInputError(f"{version_file} names no __version__; is this a ComfyUI release checkout?")
    return found.group(1)


def _release(version: str) -> tuple[int, ...]:
    numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if numbers is None:
        raise ComfyInputError(f"ComfyUI's version {version!r} is not a release number (major.minor.patch)")
    return tuple(int(number) for number in numbers.groups())


def check_comfyui_version(version: str) -> None:
    """Refuse a ComfyUI older than the first tested release; log a newer untested one (its LTX code
    is then checked structurally by the plan before anything is loaded)."""
    oldest = TESTED_COMFYUI_VERSIONS[0]
    if _release(version) < _release(oldest):
        raise ComfyInputError(
            f"ComfyUI {version} is older than v{oldest}, the first release the fleet's engine was checked against "
            f"(tested: {', '.join('v' + known for known in TESTED_COMFYUI_VERSIONS)}); update ComfyUI, or use the pack's own "
            "nodes (Load Checkpoint MGPU), which run without it"
        )
    if version not in TESTED_COMFYUI_VERSIONS:
        log.info("ComfyUI %s is newer than the releases the fleet's engine was tested with (%s): its LTX code is checked "
                 "structurally before loading", version, ", ".join(TESTED_COMFYUI_VERSIONS))


def import_comfy(comfy_dir: str, device: torch.device) -> tuple[ModuleType, str]:
    """ComfyUI's ``comfy`` package from ``comfy_dir``, imported once per rank, on ``device``, and
    the ComfyUI version it is."""
    root = Path(comfy_dir)
    if not root.is_absolute():
        raise ComfyInputError(f"comfy_dir must be an absolute path, got {comfy_dir!r}")
    version = comfyui_version(root)
    check_comfyui_version(version)
    loaded = sys.modules.get("comfy")
    if loaded is not None:
        where = Path(next(iter(loaded.__path__))).resolve().parent  # ComfyUI's comfy is a namespace package
        if where != root.resolve():
            raise ComfyInputError(
                f"this fleet already runs ComfyUI from {where}, not {root}; restart the fleet from the ComfyUI you use"
            )
        _import_model_code()  # raises again, in words, where an earlier import stopped half way
        return loaded, version
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if str(root) not in sys.path:
        # Last on the path: ComfyUI's top-level names (nodes, utils, app ...) never shadow the process's own.
        sys.path.append(str(root))
    import comfy.options

    comfy.options.args_parsing = False  # the rank's argv is the fleet's, not ComfyUI's
    import comfy.cli_args

    if device.type == "cpu":
        comfy.cli_args.args.cpu = True
    _import_model_code()
    import comfy.model_management

    chosen = comfy.model_management.get_torch_device()
    if torch.device(chosen).type != device.type or (device.type == "cuda" and torch.device(chosen).index != device.index):
        raise RuntimeError(f"ComfyUI chose {chosen} on the rank of {device}")
    return importlib.import_module("comfy"), version


def _import_model_code() -> None:
    """ComfyUI's device management and loaders, or a refusal naming the missing requirement."""
    try:
        importlib.import_module("comfy.model_management")
        importlib.import_module("comfy.sd")
    except ImportError as exc:
        raise ComfyInputError(
            f"ComfyUI's requirements are not importable by the fleet's Python {sys.executable} ({exc}); start the "
            "fleet with the Python that runs ComfyUI, or install ComfyUI's requirements.txt into it"
        ) from exc


def model_options(weight_dtype: str) -> dict[str, Any]:
    """UNETLoader's mapping of its ``weight_dtype`` choice to ``model_options`` (ComfyUI's nodes.py)."""
    if weight_dtype == "fp8_e4m3fn":
        return {"dtype": torch.float8_e4m3fn}
    if weight_dtype == "fp8_e4m3fn_fast":
        return {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
    if weight_dtype == "fp8_e5m2":
        return {"dtype": torch.float8_e5m2}
    return {}


def model_file_key(path: str, loader: str, weight_dtype: str) -> str:
    """One name per (file, size, modification time, loader, weight dtype): a changed file is a new model."""
    stat = os.stat(path)
    text = f"{os.path.realpath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}\0{loader}\0{weight_dtype}"
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass
class LoadedModel:
    """One ComfyUI model resident in a rank, and the weight patch set its weights carry now."""

    key: str
    patcher: Any  # comfy.model_patcher.ModelPatcher
    set_digest: str = ""  # "" = no patches
    plan: Any = None  # plan.AppliedPlan, made on the first forward
    captured: Any = None  # captured_blocks.CapturedBlocks around the plan's blocks, on CUDA ranks

    @property
    def diffusion_model(self) -> torch.nn.Module:
        return self.patcher.model.diffusion_model


def load_model(path: str, loader: str, weight_dtype: str, device: torch.device):
    """A ``ModelPatcher`` loaded as ComfyUI's loader node loads ``path``, its weights on ``device``."""
    import comfy.sd

    options = model_options(weight_dtype)
    if loader == "checkpoint":
        patcher = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False, model_options=options)[0]
    else:
        patcher = comfy.sd.load_diffusion_model(path, model_options=options)
    if patcher is None:
        raise ComfyInputError(f"ComfyUI found no diffusion model in {path}")
    patcher.patch_model(device_to=device, load_weights=True)
    return patcher


def make_adapter(class_name: str, weights):
    """One of ComfyUI's own weight adapters (comfy.weight_adapter), by class name; nothing else. Its
    ``loaded_keys`` (which file keys the LoRA loader consumed) is empty: nothing computes with it."""
    import comfy.weight_adapter

    known = {adapter.__name__: adapter for adapter in comfy.weight_adapter.adapters}
    if class_name not in known:
        raise ComfyInputError(f"weight adapter {class_name!r} is not one of ComfyUI's ({', '.join(sorted(known))})")
    return known[class_name](set(), weights)


def missing_digests(entries: Any, held: dict[str, torch.Tensor]) -> list[str]:
    """The tensor digests ``entries`` (``wire.pack_patches`` output) name that ``held`` lacks."""
    missing: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if set(value) == {wire.DIGEST_KEY}:
                if value[wire.DIGEST_KEY] not in held:
                    missing.append(value[wire.DIGEST_KEY])
                return
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(entries)
    return sorted(set(missing))


BACKUP_HEADROOM_BYTES = 8 << 30
"""What a GPU must keep free beside the patched weights' clean copies for them to stay on it (the
forward's activations): at least this, or a tenth of the GPU."""


def backup_device(state: dict[str, torch.Tensor], keys, device: torch.device, offload: torch.device, environ=None) -> torch.device:
    """Where ComfyUI's patcher keeps the clean copy of each weight a LoRA patches (``ModelPatcher.backup``,
    restored when the patches change): ``device`` when the GPU has room for them beside a headroom,
    else ``offload`` (ComfyUI's own choice, the host). A full-size LoRA patches most of the 22B's blocks:
    on the host that is about 40 GB per rank, copied out of the GPU at every new patch set; on an H200
    it fits on the GPU, and the copy is a device copy. Ranks sharing a GPU or capped
    (``MGPU_SHARED_GPU_RANKS``, ``MGPU_MEMORY_FRACTION``) keep ComfyUI's choice."""
    from mgpu_backend.fleet.rank import MEMORY_FRACTION_ENV
    from mgpu_backend.fleet.shared_gpu import SHARED_GPU_RANKS_ENV

    environ = os.environ if environ is None else environ
    if device.type != "cuda" or environ.get(MEMORY_FRACTION_ENV, "").strip() or environ.get(SHARED_GPU_RANKS_ENV, "").strip() not in ("", "1"):
        return offload
    needed = sum(state[key].numel() * state[key].element_size() for key in keys if key in state and state[key].device == device)
    free, total = torch.cuda.mem_get_info(device)
    return device if free - needed >= max(BACKUP_HEADROOM_BYTES, total // 10) else offload


def apply_patches(loaded: LoadedModel, patches: dict[str, list[tuple]], device: torch.device) -> None:
    """Put ``patches`` on the model the way ComfyUI does: restore the unpatched weights, set the
    patcher's patches, load it onto ``device`` (``ModelPatcher.patch_weight_to_device`` computes each
    patched weight with ``comfy.lora.calculate_weight``), its clean copies where ``backup_device`` says."""
    patcher = loaded.patcher
    state = patcher.model.state_dict()
    unknown = sorted(set(patches) - set(state))
    if unknown:
        raise ComfyInputError(f"{len(unknown)} patched weights are not in this model (first: {unknown[0]}); was the LoRA made for it?")
    patcher.unpatch_model(device_to=device, unpatch_weights=True)
    patcher.patches = patches
    patcher.patches_uuid = uuid.uuid4()
    offload = patcher.offload_device
    patcher.offload_device = backup_device(state, patches, device, offload)
    try:
        patcher.patch_model(device_to=device, load_weights=True)
    finally:
        patcher.offload_device = offload  # only the backups of this patching follow the choice
    if patcher.backup:
        placed = {str(entry.weight.device) for entry in patcher.backup.values()}
        log.info("%d clean weights of the patched layers kept on %s", len(patcher.backup), ", ".join(sorted(placed)))
