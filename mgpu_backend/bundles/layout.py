"""The one writer of the official LTX-2 file layouts, at any configuration, streaming tensor by tensor.

A bundle holds, at a ``BundleConfig`` (``configs.py``: tiny or full size, LTX-2.0 or 2.3):

- the checkpoint: transformer (``model.diffusion_model.*``), text embeddings connectors
  (``model.diffusion_model.{video,audio}_embeddings_connector.*``), the Gemma feature projection
  (``text_embedding_projection.*``, sized for the bundle's Gemma), video VAE encoder and decoder
  (``vae.{encoder,decoder,per_channel_statistics}.*``), audio VAE (``audio_vae.*``) and vocoder
  (``vocoder.*``), with the ``config`` and ``model_version`` metadata ltx-core and ltx-pipelines read;
- optionally a distilled checkpoint: the same layout, its own weights (the official distilled models
  are full checkpoints of their own);
- the distilled LoRA: A/B pairs (``diffusion_model.<layer>.lora_A.weight`` [rank, in], ``lora_B``
  [out, rank], the ComfyUI key format ltx-core fuses) on every linear weight of the transformer
  blocks: q/k/v/out (and the gates, in 2.3) of the six attentions and both layers of the video and
  audio feed-forwards. Which layers the official distilled LoRA adapts could not be checked here (no
  access to the file); rank 384 on this rule gives 3.7 B parameters (7.4 GB) at 19B;
- the spatial x2 upsampler with its flat ``config`` metadata;
- a Gemma-3 folder as Hugging Face lays it out (``gemma_folder.py``), the weights under the key names
  of Google's released checkpoint (``language_model.model.*``, ``vision_tower.vision_model.*``,
  ``multi_modal_projector.*``; lm_head is tied to the embeddings and not stored).

Every component is built on the meta device from its ltx-core (or transformers) configurator, so
the keys and shapes are by construction the ones the loaders expect. A file's safetensors header is
written from the meta shapes (keys sorted, so the header never depends on build order), then its
tensors are drawn by a recipe and appended one at a time: ``NameSeeded`` draws each on the host from
its own name (the tiny bundles; data in key order), ``DeviceSeeded`` gives each component seeded
weights on a device, one component at a time (full size: host memory holds one tensor, GPU memory
one component, at most the transformer). Same configuration, recipe and seed: same bytes.

This module never downloads anything and never edits ltx-core.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from mgpu_backend.bundles import gemma_folder, random_weights
from mgpu_backend.bundles.configs import BundleConfig, model_version
from mgpu_backend.ltx.schema import ModelSpec

DTYPE = torch.bfloat16
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16"}


class TwoStageFiles:
    """The two-stage model spec of a written bundle's files; the bundles' path records (tiny and full
    size) share it."""

    checkpoint_path: str
    gemma_root: str
    spatial_upsampler_path: str
    distilled_lora_path: str

    def spec(self) -> ModelSpec:
        """Dev checkpoint, Gemma, spatial upsampler and distilled LoRA, as the two-stage recipe loads them."""
        return ModelSpec(
            checkpoint_path=self.checkpoint_path,
            gemma_root=self.gemma_root,
            spatial_upsampler_path=self.spatial_upsampler_path,
            distilled_lora=self.distilled_lora_path,
        )


@dataclass(frozen=True)
class FileNames:
    """Where a bundle's files go, relative to its folder (``distilled_checkpoint`` None: not written)."""

    checkpoint: str
    distilled_checkpoint: str | None
    distilled_lora: str
    spatial_upsampler: str
    gemma_root: str

    @property
    def gemma_weights(self) -> str:
        return f"{self.gemma_root}/{gemma_folder.WEIGHTS_NAME}"


@dataclass(frozen=True)
class Style:
    """What differs between the two families of bundles besides the configuration: file names, and the
    metadata tag every model file carries (the tiny bundle's Gemma weights carry none, as Google's files
    do not; bundles written so far keep their bytes)."""

    names: FileNames
    tag: dict[str, str]
    tag_gemma_weights: bool


# --- The components, each built on the meta device ---------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """One component of a file: how to build it (on the meta device), where its state-dict entries go
    in the file (``file_key`` returns None for entries the file does not hold), and the namespace its
    weights are seeded in (``name`` for ``DeviceSeeded``, ``seed_prefix`` + file key for ``NameSeeded``)."""

    name: str
    build: Callable[[], torch.nn.Module]
    file_key: Callable[[str], str | None]
    seed_prefix: str = ""


def _prefixed(prefix: str, statistics_prefix: str | None = None) -> Callable[[str], str | None]:
    """``prefix + key``; the latent statistics go under ``statistics_prefix`` (or are left out, for
    the half of a VAE that shares the other half's copy)."""
    statistics = "per_channel_statistics."

    def file_key(key: str) -> str | None:
        if key.startswith(statistics):
            return None if statistics_prefix is None else statistics_prefix + key
        return prefix + key

    return file_key


def _renamed(prefixes: tuple[tuple[str, str], ...]) -> Callable[[str], str | None]:
    def file_key(key: str) -> str | None:
        for module_prefix, file_prefix in prefixes:
            if key.startswith(module_prefix):
                return file_prefix + key[len(module_prefix) :]
        return None

    return file_key


def _identity(key: str) -> str:
    return key


# The inverse of ltx-core's EMBEDDINGS_PROCESSOR_KEY_OPS (V1 and V2 feature extractors alike).
_EMBEDDINGS_PROCESSOR_KEYS = (
    ("feature_extractor.", "text_embedding_projection."),
    ("video_connector.", "model.diffusion_model.video_embeddings_connector."),
    ("audio_connector.", "model.diffusion_model.audio_embeddings_connector."),
)
# The inverse of ltx-core's GEMMA_LLM_KEY_OPS: the key names of Google's released checkpoint.
_GEMMA_KEYS = (
    ("model.language_model.", "language_model.model."),
    # transformers 4 names the SigLIP tower's modules vision_model.*, transformers 5 drops that level:
    # the file keeps the released checkpoint's names under either.
    ("model.vision_tower.vision_model.", "vision_tower.vision_model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _checkpoint_parts(config: BundleConfig, namespace: str = "") -> list[_Part]:
    """The checkpoint's components; ``namespace`` seeds a second checkpoint of the same layout apart."""
    from ltx_core.model import audio_vae, video_vae
    from ltx_core.model.transformer import LTXModelConfigurator

    from mgpu_backend.ltx.loading import _embeddings_processor_configurator

    checkpoint = config.checkpoint
    embeddings_processor = _embeddings_processor_configurator(config.gemma["text_config"])
    seed_prefix = f"{namespace}:" if namespace else ""
    parts = [
        ("transformer", lambda: LTXModelConfigurator.from_config(checkpoint), _prefixed("model.diffusion_model.")),
        ("embeddings_processor", lambda: embeddings_processor.from_config(checkpoint), _renamed(_EMBEDDINGS_PROCESSOR_KEYS)),
        # The encoder carries the video latent statistics the decoder shares, as in the official files.
        ("video_encoder", lambda: video_vae.VideoEncoderConfigurator.from_config(checkpoint), _prefixed("vae.encoder.", "vae.")),
        ("video_decoder", lambda: video_vae.VideoDecoderConfigurator.from_config(checkpoint), _prefixed("vae.decoder.")),
        ("audio_encoder", lambda: audio_vae.AudioEncoderConfigurator.from_config(checkpoint), _prefixed("audio_vae.encoder.")),
        ("audio_decoder", lambda: audio_vae.AudioDecoderConfigurator.from_config(checkpoint), _prefixed("audio_vae.decoder.", "audio_vae.")),
        ("vocoder", lambda: audio_vae.VocoderConfigurator.from_config(checkpoint), _prefixed("vocoder.")),
    ]  # fmt: skip
    return [_Part(f"{namespace}/{name}" if namespace else name, build, file_key, seed_prefix) for name, build, file_key in parts]


def lora_targets(transformer: torch.nn.Module) -> list[tuple[str, tuple[int, int]]]:
    """(layer, (out_features, in_features)) of every linear weight inside the transformer blocks:
    what the distilled LoRA adapts."""
    return [
        (key[: -len(".weight")], tuple(tensor.shape))
        for key, tensor in transformer.state_dict().items()
        if key.startswith("transformer_blocks.") and key.endswith(".weight") and tensor.ndim == 2
    ]


def _lora_module(checkpoint: dict, rank: int) -> torch.nn.Module:
    """LoRA pairs as modules, so that their state-dict keys are the ComfyUI LoRA keys ltx-core fuses."""
    from ltx_core.model.transformer import LTXModelConfigurator

    root = torch.nn.Module()
    for layer, (out_features, in_features) in lora_targets(LTXModelConfigurator.from_config(checkpoint)):
        holder = root
        for name in ("diffusion_model." + layer).split("."):
            if not hasattr(holder, name):
                holder.add_module(name, torch.nn.Module())
            holder = getattr(holder, name)
        holder.lora_A = torch.nn.Linear(in_features, rank, bias=False)
        holder.lora_B = torch.nn.Linear(rank, out_features, bias=False)
    return root


def _gemma_module(gemma: dict) -> torch.nn.Module:
    from transformers import Gemma3Config
    from transformers.models.gemma3 import Gemma3ForConditionalGeneration

    # Without the dtypes: given one, transformers switches torch's process-wide default dtype while it
    # builds the sub-models, which races with any other thread (several callers may make bundles at
    # once). The shapes do not depend on it and every tensor is written in bf16 anyway.
    gemma = {key: value for key, value in gemma.items() if key != "torch_dtype"}
    for section in ("text_config", "vision_config"):
        gemma[section] = {key: value for key, value in gemma[section].items() if key != "torch_dtype"}
    return Gemma3ForConditionalGeneration(Gemma3Config.from_dict(gemma))


def weight_files(config: BundleConfig, style: Style) -> dict[str, tuple[list[_Part], dict[str, str]]]:
    """Every safetensors file of a bundle: relative path -> (its parts, its metadata)."""
    from ltx_core.model.upsampler import LatentUpsamplerConfigurator

    config = BundleConfig(**config.to_json())  # a copy: configurators add keys to the dicts they read
    names, tag = style.names, style.tag
    # "2.3..." makes ltx-pipelines pick its LTX-2.3 defaults for this checkpoint, anything else 2.0's.
    checkpoint_metadata = {"config": json.dumps(config.checkpoint), "model_version": model_version(config.checkpoint), **tag}
    files = {names.checkpoint: (_checkpoint_parts(config), checkpoint_metadata)}
    if names.distilled_checkpoint is not None:
        files[names.distilled_checkpoint] = (_checkpoint_parts(config, "distilled"), checkpoint_metadata)
    files[names.distilled_lora] = ([_Part("distilled_lora", lambda: _lora_module(config.checkpoint, config.lora_rank), _identity)], dict(tag))
    files[names.spatial_upsampler] = (
        [_Part("spatial_upsampler", lambda: LatentUpsamplerConfigurator.from_config(config.spatial_upsampler), _identity)],
        {"config": json.dumps(config.spatial_upsampler), **tag},
    )
    # "gemma:" keeps a Gemma key from ever sharing a name seed with a checkpoint key.
    files[names.gemma_weights] = (
        [_Part("gemma", lambda: _gemma_module(config.gemma), _renamed(_GEMMA_KEYS), "gemma:")],
        {"format": "pt", **(tag if style.tag_gemma_weights else {})},
    )  # fmt: skip
    return files


# --- Streaming safetensors writer ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    key: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPE.itemsize


@dataclass(frozen=True)
class _Planned:
    """One tensor of a file: which part holds it, under which state-dict key, as which file entry."""

    part: int
    state_key: str
    entry: _Entry


def _file_entries(module: torch.nn.Module, part: _Part, index: int) -> list[_Planned]:
    """Every tensor of ``module`` the file holds, in state-dict order."""
    planned = []
    for key, tensor in module.state_dict().items():
        file_key = part.file_key(key)
        if file_key is None:
            continue
        if not tensor.is_floating_point():
            raise AssertionError(f"{part.name}: {key} is {tensor.dtype}; only floating-point weights are written")
        planned.append(_Planned(index, key, _Entry(file_key, tuple(tensor.shape))))
    return planned


def _header_bytes(entries: list[_Entry], metadata: dict[str, str]) -> bytes:
    """The safetensors header; data in ``entries`` order, keys listed sorted (so the header is the same
    whatever the data order)."""
    offsets, position = {}, 0
    for entry in entries:
        offsets[entry.key] = (position, position + entry.nbytes)
        position += entry.nbytes
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    for entry in sorted(entries, key=lambda e: e.key):
        header[entry.key] = {"dtype": _SAFETENSORS_DTYPES[DTYPE], "shape": list(entry.shape), "data_offsets": list(offsets[entry.key])}
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


class NameSeeded:
    """Host recipe: each tensor drawn from a generator seeded by its own file key (in its part's seed
    namespace), data in key order. Adding a tensor never changes another; one tensor is in memory at a time."""

    def order(self, planned: list[_Planned]) -> list[_Planned]:
        return sorted(planned, key=lambda p: p.entry.key)

    def tensors(self, parts: list[_Part], modules: list[torch.nn.Module], ordered: list[_Planned]) -> Iterator[torch.Tensor]:
        for item in ordered:
            entry = item.entry
            name = parts[item.part].seed_prefix + entry.key
            yield random_weights.named_random_tensor(name, entry.shape, random_weights.weight_rule(entry.key, entry.shape), DTYPE)


class DeviceSeeded:
    """Device recipe: each component filled on ``device`` from its own seed (derived from ``seed`` and the
    part's name), data component after component. The same seed draws other numbers on a GPU than on the CPU."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device, self.seed = torch.device(device), seed

    def order(self, planned: list[_Planned]) -> list[_Planned]:
        return list(planned)

    def part_seed(self, part: _Part) -> int:
        return int.from_bytes(hashlib.sha256(f"{self.seed}:{part.name}".encode()).digest()[:8], "little") & (2**63 - 1)

    def tensors(self, parts: list[_Part], modules: list[torch.nn.Module], ordered: list[_Planned]) -> Iterator[torch.Tensor]:
        current, state = None, {}
        for item in ordered:
            if item.part != current:
                state = {}
                self._release(modules, current)
                current = item.part
                modules[current] = random_weights.materialize_random_(modules[current], self.device, DTYPE, self.part_seed(parts[current]))
                state = modules[current].state_dict()
            yield state[item.state_key]
        self._release(modules, current)

    def _release(self, modules: list, index: int | None) -> None:
        if index is not None:
            modules[index] = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()


Recipe = NameSeeded | DeviceSeeded


def _plan(parts: list[_Part]) -> tuple[list[torch.nn.Module], list[_Planned]]:
    with torch.device("meta"):
        modules = [part.build() for part in parts]
    planned = [item for index, (module, part) in enumerate(zip(modules, parts)) for item in _file_entries(module, part, index)]
    if len({item.entry.key for item in planned}) != len(planned):
        raise AssertionError(f"two components of {[part.name for part in parts]} write the same key")
    return modules, planned


def write_weight_file(path: Path, parts: list[_Part], metadata: dict[str, str], recipe: Recipe) -> dict[str, int]:
    """Write one safetensors file tensor by tensor, under a temporary name renamed into place;
    returns each tensor's byte count (key -> bytes)."""
    modules, planned = _plan(parts)
    ordered = recipe.order(planned)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(staging, "wb") as file:
            file.write(_header_bytes([item.entry for item in ordered], metadata))
            for tensor in recipe.tensors(parts, modules, ordered):
                # One tensor at a time on the host: a full-size component never is.
                file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return {item.entry.key: item.entry.nbytes for item in ordered}


def planned_shapes(config: BundleConfig, style: Style) -> dict[str, dict[str, tuple[int, ...]]]:
    """The tensors each weight file of a bundle will hold (file name -> key -> shape, all in ``DTYPE``),
    from meta shapes: nothing is allocated or written."""
    return {name: {item.entry.key: item.entry.shape for item in _plan(parts)[1]} for name, (parts, _) in weight_files(config, style).items()}


def planned_bytes(config: BundleConfig, style: Style) -> dict[str, int]:
    """Tensor bytes of each weight file of a bundle (from meta shapes: nothing is allocated), so a caller
    can check the disk before writing tens of gigabytes."""
    return {name: sum(item.entry.nbytes for item in _plan(parts)[1]) for name, (parts, _) in weight_files(config, style).items()}


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_files(root: Path, config: BundleConfig, style: Style, recipe: Recipe, log: Callable[[str], None] | None = None) -> dict[str, int]:
    """Write every file of a bundle into ``root``: the weight files, their tensors drawn by ``recipe``,
    then the Gemma folder's other files. Returns relative path -> size."""
    sizes: dict[str, int] = {}
    gemma_tensors: dict[str, int] = {}
    for name, (parts, metadata) in weight_files(config, style).items():
        if log:
            log(f"writing {name} ({', '.join(part.name for part in parts)}) ...")
        tensors = write_weight_file(root / name, parts, metadata, recipe)
        if name == style.names.gemma_weights:
            gemma_tensors = tensors
        sizes[name] = (root / name).stat().st_size
    side_files = gemma_folder.side_files(config.gemma)
    side_files["model.safetensors.index.json"] = gemma_folder.index_bytes(gemma_tensors)
    for name, data in side_files.items():
        write_atomic(root / style.names.gemma_root / name, data)
        sizes[f"{style.names.gemma_root}/{name}"] = len(data)
    return sizes
