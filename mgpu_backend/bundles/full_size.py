"""Random-weight LTX-2 bundles at any configuration, written tensor by tensor, for benchmarks.

The tiny bundle (``tiny.py``) is small enough to build in host memory; a full-size bundle is not
(the 19B transformer alone is 37.8 GB in bf16). ``write_bundle`` writes the same official layouts
(the files ltx-core's loaders, ltx-pipelines' ModelLedger and our ModelLoader read) at a GIVEN
configuration, streaming: every component is built on the meta device, its safetensors header is
written from the meta shapes, then the component is given seeded random weights on the target
device (``diagnostics.materialize_random_``, the project's one recipe for random weights) and each
tensor is copied to the host and appended to the file on its own. With a GPU as the device, host
memory holds one tensor at a time and GPU memory one component (at most the 37.8 GB transformer).

A bundle holds:

- the checkpoint: transformer, text embeddings connectors and the Gemma feature projection (sized
  for the bundle's Gemma: ``aggregate_embed`` reads hidden x (layers + 1) features), video VAE
  encoder and decoder, audio VAE encoder and decoder, vocoder, with the ``config`` metadata;
- the distilled LoRA: A/B pairs of ``lora_rank`` on every linear weight of the transformer blocks:
  q/k/v/out of the six attentions (video and audio self- and text cross-attention, audio-to-video
  and video-to-audio) and both layers of the video and audio feed-forwards. Which layers the
  official distilled LoRA adapts could not be checked here (no access to the file): this is the
  tiny bundle's rule; rank 384 on it gives 3.7 B parameters (7.4 GB);
- the spatial x2 upsampler with its ``config`` metadata;
- a Gemma-3 folder: config.json, weights + index, and the tiny bundle's tokenizer and processor
  files (a 640-piece tokenizer: its ids are valid in any Gemma vocabulary; prompts are still
  padded to ltx-core's 1024 tokens, so Gemma's compute per layer is the real one).

``full_size_config`` gives the LTX-2 19B configuration (sources in docs/full-size-config.md) with a
Gemma-3 12B text encoder of FEWER layers than the real 48 (the real one, 23.5 GB, does not fit on a
64 GB benchmark disk beside the rest): its text-encode time is a lower bound. ``tiny_config``
gives the tiny bundle's configuration (same keys and shapes as ``make_tiny_bundle``).

Same seed, configuration and device type: same bytes. This module never downloads anything and
never edits ltx-core.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import struct
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mgpu_backend.ltx.diagnostics import materialize_random_
from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.loading import ModelSpec

RANDOM_BUNDLE_FORMAT = 1
"""Bump whenever the bytes written for a configuration and seed change: old folders are rewritten."""

_MANIFEST = "random-bundle.json"
_DTYPE = torch.bfloat16

CHECKPOINT_NAME = "ltx-2-random.safetensors"
DISTILLED_LORA_NAME = "ltx-2-random-distilled-lora.safetensors"
SPATIAL_UPSAMPLER_NAME = "ltx-2-random-spatial-upscaler-x2.safetensors"
GEMMA_DIR_NAME = "gemma-3-random"

# --- Full-size configuration (docs/full-size-config.md says where each number comes from) ---------

FULL_SIZE_VIDEO_VAE_CONFIG = {
    "_class_name": "CausalVideoAutoencoder",
    "dims": 3,
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 128,
    # ComfyUI's VideoVAE.guess_config(version=2) (comfy/ldm/lightricks/vae/causal_video_autoencoder.py),
    # the encoder of the 1024-channel decoder family below; ltx-core has no default block list.
    "encoder_blocks": [
        ["res_x", {"num_layers": 4}],
        ["compress_space_res", {"multiplier": 2}],
        ["res_x", {"num_layers": 6}],
        ["compress_time_res", {"multiplier": 2}],
        ["res_x", {"num_layers": 6}],
        ["compress_all_res", {"multiplier": 2}],
        ["res_x", {"num_layers": 2}],
        ["compress_all_res", {"multiplier": 2}],
        ["res_x", {"num_layers": 2}],
    ],
    # Listed encoder-side first; the decoder runs them reversed. Same source.
    "decoder_blocks": [
        ["res_x", {"num_layers": 5, "inject_noise": False}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["res_x", {"num_layers": 5, "inject_noise": False}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["res_x", {"num_layers": 5, "inject_noise": False}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["res_x", {"num_layers": 5, "inject_noise": False}],
    ],
    "patch_size": 4,
    "norm_layer": "pixel_norm",
    "latent_log_var": "uniform",
    "use_quant_conv": False,
    "causal_decoder": False,
    "timestep_conditioning": True,
    "decoder_base_channels": 128,
}

FULL_SIZE_AUDIO_VAE_CONFIG = {
    "model": {
        "params": {
            "ddconfig": {
                "ch": 128,
                "out_ch": 2,
                "ch_mult": [1, 2, 4],
                "num_res_blocks": 2,
                "attn_resolutions": [],
                "resolution": 256,
                "z_channels": 8,
                "double_z": True,
                "dropout": 0.0,
                "in_channels": 2,
                "mid_block_add_attention": False,
                "norm_type": "pixel",
                "causality_axis": "height",
                "attn_type": "vanilla",
                "resamp_with_conv": True,
                "mel_bins": 64,
            },
            "sampling_rate": 16000,
        }
    },
    "preprocessing": {
        "stft": {"filter_length": 1024, "hop_length": 160, "causal": True},
        "mel": {"n_mel_channels": 64},
    },
    "variables": {"mel_bins": 64},
}

FULL_SIZE_VOCODER_CONFIG = {
    "resblock": "1",
    "resblock_kernel_sizes": [3, 7, 11],
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    "upsample_rates": [6, 5, 2, 2, 2],
    "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_initial_channel": 1024,
    "stereo": True,
    "output_sampling_rate": 24000,
}

FULL_SIZE_SPATIAL_UPSAMPLER_CONFIG = {
    "_class_name": "LatentUpsampler",
    "in_channels": 128,
    "mid_channels": 512,
    "num_blocks_per_stage": 4,
    "dims": 3,
    "spatial_upsample": True,
    "temporal_upsample": False,
    "spatial_scale": 2.0,
    "rational_resampler": False,
}

FULL_SIZE_LORA_RANK = 384
"""The rank of the official distilled LoRA (ltx-2-19b-distilled-lora-384)."""

DEFAULT_GEMMA_LAYERS = 6
GEMMA_FULL_LAYERS = 48


@dataclass(frozen=True)
class BundleConfig:
    """Everything that decides a bundle's shapes.

    checkpoint: the checkpoint's ``config`` metadata (``transformer``, ``vae``, ``audio_vae``,
    ``vocoder`` sections, as ltx-core's configurators read them); spatial_upsampler: the upsampler
    file's flat ``config``; gemma: the Gemma-3 folder's config.json; lora_rank: the distilled LoRA's.
    """

    checkpoint: dict
    spatial_upsampler: dict
    gemma: dict
    lora_rank: int

    @property
    def gemma_layers(self) -> int:
        return int(self.gemma["text_config"]["num_hidden_layers"])

    def to_json(self) -> dict:
        return copy.deepcopy(asdict(self))


def full_size_config(
    transformer: dict, gemma_layers: int = DEFAULT_GEMMA_LAYERS, lora_rank: int = FULL_SIZE_LORA_RANK
) -> BundleConfig:
    """The LTX-2 19B bundle: ``transformer`` is the ``transformer`` section of
    configs/ltx2-19b-transformer.json; Gemma is the 12B model's configuration (ltx-core's
    ``GEMMA3_CONFIG_FOR_LTX``: hidden 3840, 16 heads of 256, 8 KV heads, vocabulary 262208, the
    SigLIP vision tower) with ``gemma_layers`` of its 48 layers."""
    from ltx_core.text_encoders.gemma.config import GEMMA3_CONFIG_FOR_LTX

    if not 1 <= gemma_layers <= GEMMA_FULL_LAYERS:
        raise ValueError(f"gemma_layers must be 1 to {GEMMA_FULL_LAYERS} (the 12B model's count), got {gemma_layers}")
    if lora_rank < 1:
        raise ValueError(f"lora_rank must be at least 1, got {lora_rank}")
    if transformer.get("caption_channels") != GEMMA3_CONFIG_FOR_LTX.text_config.hidden_size:
        raise ValueError(
            f"the transformer reads captions of width {transformer.get('caption_channels')}, but Gemma-3 12B's "
            f"hidden size is {GEMMA3_CONFIG_FOR_LTX.text_config.hidden_size}; use the 19B transformer configuration"
        )
    gemma = GEMMA3_CONFIG_FOR_LTX.to_dict()
    gemma["text_config"]["num_hidden_layers"] = gemma_layers
    gemma["text_config"]["torch_dtype"] = gemma["vision_config"]["torch_dtype"] = "bfloat16"
    checkpoint = {
        "transformer": copy.deepcopy(transformer),
        "vae": copy.deepcopy(FULL_SIZE_VIDEO_VAE_CONFIG),
        "audio_vae": copy.deepcopy(FULL_SIZE_AUDIO_VAE_CONFIG),
        "vocoder": copy.deepcopy(FULL_SIZE_VOCODER_CONFIG),
    }
    return BundleConfig(checkpoint, copy.deepcopy(FULL_SIZE_SPATIAL_UPSAMPLER_CONFIG), gemma, lora_rank)


def tiny_config() -> BundleConfig:
    """The tiny bundle's configuration (``tiny.py``): the same files, keys and shapes, other values."""
    return BundleConfig(
        copy.deepcopy(tiny.CHECKPOINT_CONFIG),
        copy.deepcopy(tiny.SPATIAL_UPSAMPLER_CONFIG),
        copy.deepcopy(tiny.GEMMA_CONFIG),
        tiny.LORA_RANK,
    )


@dataclass(frozen=True)
class RandomBundle:
    """Paths of one written bundle (absolute strings, as ltx-core's loaders take them)."""

    root: str
    checkpoint_path: str
    distilled_lora_path: str
    spatial_upsampler_path: str
    gemma_root: str

    def spec(self) -> ModelSpec:
        return ModelSpec(
            checkpoint_path=self.checkpoint_path,
            gemma_root=self.gemma_root,
            spatial_upsampler_path=self.spatial_upsampler_path,
            distilled_lora=self.distilled_lora_path,
        )


def _bundle_at(root: Path) -> RandomBundle:
    root = root.resolve()
    return RandomBundle(
        root=str(root),
        checkpoint_path=str(root / CHECKPOINT_NAME),
        distilled_lora_path=str(root / DISTILLED_LORA_NAME),
        spatial_upsampler_path=str(root / SPATIAL_UPSAMPLER_NAME),
        gemma_root=str(root / GEMMA_DIR_NAME),
    )


def ltx_core_gemma_config(gemma: dict):
    """ltx-core's ``Gemma3ConfigData`` describing ``gemma`` (a Gemma folder's config.json).

    ltx-core 1.0.0 hard-codes the 12B model (``GEMMA3_CONFIG_FOR_LTX``) where ltx-pipelines'
    ModelLedger builds Gemma and sizes the feature projection. A reference run of ltx-pipelines on a
    bundle with another Gemma patches this object in from the outside (tests and benchmarks do);
    our ModelLoader reads the folder's config.json instead and needs no patch.
    """
    from ltx_core.text_encoders.gemma import config as gemma_config

    text = dict(gemma["text_config"], rope_scaling=gemma_config.Gemma3RopeScaling(**gemma["text_config"]["rope_scaling"]))
    top = {key: value for key, value in gemma.items() if key not in ("text_config", "vision_config")}
    return gemma_config.Gemma3ConfigData(
        **top,
        text_config=gemma_config.Gemma3TextConfig(**text),
        vision_config=gemma_config.Gemma3VisionConfig(**gemma["vision_config"]),
    )


# --- The components, each built on the meta device ---------------------------------------------------


@dataclass(frozen=True)
class _Part:
    """One component of a file: how to build it (on the meta device) and where its state-dict
    entries go in the file (``file_key`` returns None for entries the file does not hold)."""

    name: str  # also seeds the component's weights
    build: Callable[[], torch.nn.Module]
    file_key: Callable[[str], str | None]


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


# The inverse of ltx-core's EMBEDDINGS_PROCESSOR_KEY_OPS (V1 feature extractor).
_EMBEDDINGS_PROCESSOR_KEYS = (
    ("feature_extractor.", "text_embedding_projection."),
    ("video_connector.", "model.diffusion_model.video_embeddings_connector."),
    ("audio_connector.", "model.diffusion_model.audio_embeddings_connector."),
)
# The inverse of ltx-core's GEMMA_LLM_KEY_OPS: the key names of Google's released checkpoint.
# lm_head is tied to the embeddings and not stored.
_GEMMA_KEYS = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)


def _checkpoint_parts(config: BundleConfig) -> list[_Part]:
    from ltx_core.model.audio_vae import AudioDecoderConfigurator, AudioEncoderConfigurator, VocoderConfigurator
    from ltx_core.model.transformer import LTXModelConfigurator
    from ltx_core.model.video_vae import VideoDecoderConfigurator, VideoEncoderConfigurator

    from mgpu_backend.ltx.loading import _embeddings_processor_configurator

    checkpoint = config.checkpoint
    embeddings_processor = _embeddings_processor_configurator(config.gemma["text_config"])
    return [
        _Part("transformer", lambda: LTXModelConfigurator.from_config(checkpoint), _prefixed("model.diffusion_model.")),
        _Part("embeddings_processor", lambda: embeddings_processor.from_config(checkpoint), _renamed(_EMBEDDINGS_PROCESSOR_KEYS)),
        # The encoder carries the video latent statistics the decoder shares, as in the official files.
        _Part("video_encoder", lambda: VideoEncoderConfigurator.from_config(checkpoint), _prefixed("vae.encoder.", "vae.")),
        _Part("video_decoder", lambda: VideoDecoderConfigurator.from_config(checkpoint), _prefixed("vae.decoder.")),
        _Part("audio_encoder", lambda: AudioEncoderConfigurator.from_config(checkpoint), _prefixed("audio_vae.encoder.")),
        _Part("audio_decoder", lambda: AudioDecoderConfigurator.from_config(checkpoint), _prefixed("audio_vae.decoder.", "audio_vae.")),
        _Part("vocoder", lambda: VocoderConfigurator.from_config(checkpoint), _prefixed("vocoder.")),
    ]  # fmt: skip


def lora_targets(transformer: torch.nn.Module) -> list[tuple[str, tuple[int, int]]]:
    """(layer, (out_features, in_features)) of every linear weight inside the transformer blocks:
    what the distilled LoRA adapts (the same rule as the tiny bundle's LoRA)."""
    return [
        (key[: -len(".weight")], tuple(tensor.shape))
        for key, tensor in transformer.state_dict().items()
        if key.startswith("transformer_blocks.") and key.endswith(".weight") and tensor.ndim == 2
    ]


def _lora_module(checkpoint: dict, rank: int) -> torch.nn.Module:
    """LoRA pairs as modules, so that their state-dict keys are the ComfyUI LoRA keys ltx-core fuses
    (``diffusion_model.<layer>.lora_A.weight`` [rank, in], ``...lora_B.weight`` [out, rank])."""
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

    return Gemma3ForConditionalGeneration(Gemma3Config.from_dict(gemma))


def _weight_files(config: BundleConfig) -> dict[str, tuple[list[_Part], dict[str, str]]]:
    """Every safetensors file of the bundle: relative path -> (its parts, its metadata)."""
    from ltx_core.model.upsampler import LatentUpsamplerConfigurator

    config = BundleConfig(**config.to_json())  # a copy: configurators add keys to the dicts they read
    identity = lambda key: key  # noqa: E731
    return {
        CHECKPOINT_NAME: (
            _checkpoint_parts(config),
            # Not "2.3...": ltx-pipelines then picks its LTX-2.0 defaults for this checkpoint.
            {"config": json.dumps(config.checkpoint), "model_version": "2.0.0"},
        ),
        DISTILLED_LORA_NAME: ([_Part("distilled_lora", lambda: _lora_module(config.checkpoint, config.lora_rank), identity)], {}),
        SPATIAL_UPSAMPLER_NAME: (
            [_Part("spatial_upsampler", lambda: LatentUpsamplerConfigurator.from_config(config.spatial_upsampler), identity)],
            {"config": json.dumps(config.spatial_upsampler)},
        ),
        f"{GEMMA_DIR_NAME}/{tiny.GEMMA_WEIGHTS_NAME}": ([_Part("gemma", lambda: _gemma_module(config.gemma), _renamed(_GEMMA_KEYS))], {"format": "pt"}),
    }  # fmt: skip


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
        return count * _DTYPE.itemsize


def _file_entries(module: torch.nn.Module, part: _Part) -> list[tuple[str, _Entry]]:
    """(state-dict key, file entry) of every tensor of ``module`` the file holds, in state-dict order."""
    entries = []
    for key, tensor in module.state_dict().items():
        file_key = part.file_key(key)
        if file_key is None:
            continue
        if not tensor.is_floating_point():
            raise AssertionError(f"{part.name}: {key} is {tensor.dtype}; only floating-point weights are written")
        entries.append((key, _Entry(file_key, tuple(tensor.shape))))
    return entries


def _header_bytes(entries: list[_Entry], metadata: dict[str, str]) -> bytes:
    """The safetensors header; data in ``entries`` order (components are written one after the
    other), keys listed sorted so the header is the same whatever the build order."""
    offsets, position = {}, 0
    for entry in entries:
        offsets[entry.key] = (position, position + entry.nbytes)
        position += entry.nbytes
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    dtype_name = tiny._SAFETENSORS_DTYPES[_DTYPE]
    for entry in sorted(entries, key=lambda e: e.key):
        header[entry.key] = {"dtype": dtype_name, "shape": list(entry.shape), "data_offsets": list(offsets[entry.key])}
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _part_seed(seed: int, part: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{part}".encode()).digest()[:8], "little") & (2**63 - 1)


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _write_weight_file(path: Path, parts: list[_Part], metadata: dict[str, str], device: torch.device, seed: int) -> int:
    """Write one safetensors file component by component, tensor by tensor; returns its size."""
    with torch.device("meta"):
        modules = [part.build() for part in parts]
    planned = [_file_entries(module, part) for module, part in zip(modules, parts)]
    entries = [entry for part_entries in planned for _, entry in part_entries]
    if len({entry.key for entry in entries}) != len(entries):
        raise AssertionError(f"{path.name}: two components write the same key")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(staging, "wb") as file:
            file.write(_header_bytes(entries, metadata))
            for index, (part, module) in enumerate(zip(parts, modules)):
                module = materialize_random_(module, device, _DTYPE, _part_seed(seed, part.name))
                state = module.state_dict()
                for key, entry in planned[index]:
                    tensor = state[key]
                    # One tensor at a time on the host: a full-size component never is.
                    file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
                del module, state
                modules[index] = None
                _release(device)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path.stat().st_size


def _gemma_folder_side_files(gemma: dict) -> dict[str, bytes]:
    """The Gemma folder's files besides the weights: config, index, and the tiny bundle's tokenizer
    and processor files, the image sizes adjusted to this Gemma's vision tower."""
    tiny_files = tiny._gemma_folder_files()
    files = {
        name: tiny_files[name]
        for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
    }
    image_size, image_tokens = gemma["vision_config"]["image_size"], gemma["mm_tokens_per_image"]
    preprocessor = json.loads(tiny_files["preprocessor_config.json"])
    preprocessor.update(size={"height": image_size, "width": image_size}, image_seq_length=image_tokens)
    processor = json.loads(tiny_files["processor_config.json"])
    processor["image_seq_length"] = image_tokens
    files["preprocessor_config.json"] = tiny._json_bytes(preprocessor)
    files["processor_config.json"] = tiny._json_bytes(processor)
    files["config.json"] = tiny._json_bytes(gemma)
    return files


def _gemma_index(config: BundleConfig) -> bytes:
    (parts, _) = _weight_files(config)[f"{GEMMA_DIR_NAME}/{tiny.GEMMA_WEIGHTS_NAME}"]
    with torch.device("meta"):
        entries = [entry for _, entry in _file_entries(parts[0].build(), parts[0])]
    return tiny._json_bytes(
        {
            "metadata": {"total_size": sum(entry.nbytes for entry in entries)},
            "weight_map": {entry.key: tiny.GEMMA_WEIGHTS_NAME for entry in sorted(entries, key=lambda e: e.key)},
        }
    )


def planned_bytes(config: BundleConfig) -> dict[str, int]:
    """Tensor bytes of each weight file of a bundle at ``config`` (from meta shapes: nothing is
    allocated), so a caller can check the disk before writing tens of gigabytes."""
    sizes = {}
    for name, (parts, _) in _weight_files(config).items():
        with torch.device("meta"):
            sizes[name] = sum(entry.nbytes for part in parts for _, entry in _file_entries(part.build(), part))
    return sizes


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
    sizes: dict[str, int] = {}
    for name, (parts, metadata) in _weight_files(config).items():
        if log:
            log(f"writing {name} ({', '.join(part.name for part in parts)}) on {device} ...")
        sizes[name] = _write_weight_file(root / name, parts, {**metadata, "mgpu_random_bundle": str(RANDOM_BUNDLE_FORMAT)}, device, seed)
    side_files = _gemma_folder_side_files(config.gemma)
    side_files["model.safetensors.index.json"] = _gemma_index(config)
    for name, data in side_files.items():
        tiny._write_atomic(root / GEMMA_DIR_NAME / name, data)
        sizes[f"{GEMMA_DIR_NAME}/{name}"] = len(data)
    tiny._write_atomic(root / _MANIFEST, tiny._json_bytes({**identity, "files": dict(sorted(sizes.items()))}))
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
