"""The per-process model loader every rank uses: what to load (``ModelSpec``, defined in ``schema``), checks that the files
are what they claim before any heavy work (``validate_model_files``), and ``ModelLoader``, which
builds each LTX-2 component exactly the way ltx-pipelines' ``ModelLedger`` does.

One ``ModelLoader`` per rank process holds ONE ltx-core ``StateDictRegistry`` shared by every
component, so each state dict is read from disk once per process: stage 1 and stage 2 both build
the transformer (without and with the distilled LoRA) from the same cached tensors. As in
``ModelLedger`` with a registry, models are assembled on the CPU from the cached tensors and then
moved to the target device. Once a big component is built and kept (the fleet's resident
transformer, a Gemma kept on its GPUs), its host copy can be dropped with ``drop_host_copy``: at 19B
the registry would otherwise hold ~38 GB (transformer) + ~24 GB (Gemma) of host memory per rank,
which eight ranks on one host cannot afford.

The transformer can also be loaded fp8-cast (``quantization="fp8-cast"``, ltx-core's policy), and
Lightricks' fp8 checkpoint files (fp8 weights with per-tensor scales) load in both modes: see
``mgpu_backend.ltx.fp8``.

Gemma comes from a Hugging Face folder or from ComfyUI's single file (``gemma_file``), and is
built as ``gemma_encoder.GemmaEncoder``: transformers' own Gemma-3 text model, which runs on
transformers 4.52+ and 5.x, where ltx-core 1.0.0's Gemma wrapper needs 4.x. ltx-core 1.0.0
hard-codes the Gemma-3 12B configuration in its Gemma configurator and feature extractor; here the
configuration is the folder's own ``config.json`` (ltx-core's 12B values fill whatever the file
leaves out) or the file's, so the same code serves the real 12B model and the tiny test one.

Never edits ltx-core, never downloads anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps, StateDictRegistry
from ltx_core.loader.primitives import LoraStateDictWithStrength, StateDict
from ltx_core.loader.sd_ops import SDOps
from ltx_core.loader.sft_loader import SafetensorsModelStateDictLoader
from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
from ltx_core.model.audio_vae import (
    AUDIO_VAE_DECODER_COMFY_KEYS_FILTER,
    VOCODER_COMFY_KEYS_FILTER,
    AudioDecoder,
    AudioDecoderConfigurator,
    Vocoder,
    VocoderConfigurator,
)
from ltx_core.model.transformer import LTXModelConfigurator, X0Model
from ltx_core.model.upsampler import LatentUpsampler, LatentUpsamplerConfigurator
from ltx_core.model.video_vae import (
    VAE_DECODER_COMFY_KEYS_FILTER,
    VAE_ENCODER_COMFY_KEYS_FILTER,
    VideoDecoder,
    VideoDecoderConfigurator,
    VideoEncoder,
    VideoEncoderConfigurator,
)

from mgpu_backend.ltx import fp8
from mgpu_backend.ltx.hf_gemma import gemma_folder_config, gemma_folder_files
from mgpu_backend.ltx.recipes import stage_loras
from mgpu_backend.ltx.safetensors_header import SafetensorsHeader, model_version_of, read_header
from mgpu_backend.ltx.schema import ModelFileError, ModelSpec  # noqa: F401 - re-exported: the loader's callers name them here



# --- Checks before any heavy work ------------------------------------------------------------------

# Key prefixes every LTX-2 audio+video checkpoint holds, and what each is for.
_CHECKPOINT_PARTS = {
    "model.diffusion_model.transformer_blocks.": "transformer",
    "model.diffusion_model.video_embeddings_connector.": "video text connector",
    "model.diffusion_model.audio_embeddings_connector.": "audio text connector",
    "text_embedding_projection.": "Gemma feature projection",
    "vae.encoder.": "video VAE encoder",
    "vae.decoder.": "video VAE decoder",
    "vae.per_channel_statistics.": "video latent statistics",
    "audio_vae.decoder.": "audio VAE decoder",
    "vocoder.": "vocoder",
}
_UPSAMPLER_KEYS = ("initial_conv.weight", "final_conv.weight")


def is_gemma_file(gemma_root: str) -> bool:
    """Whether ``gemma_root`` names ComfyUI's single Gemma file rather than a Hugging Face folder."""
    return Path(gemma_root).is_file()


def gemma_text_config(gemma_root: str) -> dict:
    """The Gemma text config of a folder or of ComfyUI's single file (checked against its weights)."""
    return _gemma_weights(gemma_root).text_config


@dataclass(frozen=True)
class _GemmaWeights:
    """Where Gemma's text-stack weights are and how their keys map to ``GemmaEncoder``'s."""

    gemma_root: str
    paths: tuple[str, ...]
    sd_ops: SDOps
    text_config: dict
    from_comfy_file: bool

    def tokenizer(self):
        from mgpu_backend.ltx.gemma_encoder import folder_tokenizer
        from mgpu_backend.ltx.gemma_file import SentencePieceGemmaTokenizer

        if self.from_comfy_file:
            return SentencePieceGemmaTokenizer.from_file(self.paths[0])
        return folder_tokenizer(self.gemma_root)


def _gemma_weights(gemma_root: str) -> _GemmaWeights:
    if is_gemma_file(gemma_root):
        from mgpu_backend.ltx.gemma_file import COMFY_GEMMA_KEY_OPS, inspect_gemma_file

        text_config = inspect_gemma_file(gemma_root).text_config
        return _GemmaWeights(gemma_root, (str(gemma_root),), COMFY_GEMMA_KEY_OPS, text_config, from_comfy_file=True)
    from mgpu_backend.ltx.gemma_encoder import GEMMA_FOLDER_KEY_OPS

    _, weight_paths = gemma_folder_files(gemma_root)
    text_config = gemma_folder_config(gemma_root)["text_config"]
    return _GemmaWeights(gemma_root, tuple(weight_paths), GEMMA_FOLDER_KEY_OPS, text_config, from_comfy_file=False)


def validate_model_files(spec: ModelSpec) -> None:
    """Raise ModelFileError naming the file and the fix for anything that cannot be loaded.

    Reads only file headers and small configs, so it is cheap enough to run before every load.
    """
    spec.check_files_exist()
    checkpoint = _validate_checkpoint(spec.checkpoint_path)
    _validate_gemma(spec.gemma_root, spec.checkpoint_path, checkpoint)
    if spec.spatial_upsampler_path is not None:
        _validate_upsampler(spec.spatial_upsampler_path, checkpoint)
    loras = [("LoRA", path) for path, _ in spec.loras]
    if spec.distilled_lora is not None:
        loras.append(("distilled LoRA", spec.distilled_lora))
    for role, path in loras:
        _validate_lora(role, path, spec.checkpoint_path, checkpoint)


def _validate_checkpoint(path: str) -> SafetensorsHeader:
    remedy = "Choose the LTX-2 audio+video checkpoint (e.g. ltx-2-19b-dev.safetensors)."
    header = read_header(path, "checkpoint", remedy)
    try:
        config = json.loads(header.metadata.get("config", ""))
    except ValueError:
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("transformer"), dict):
        raise ModelFileError(
            f"checkpoint {path} has no LTX-2 'config' metadata (with a 'transformer' section), so it is not an "
            f"LTX-2 checkpoint. {remedy}"
        )
    missing = [
        part for prefix, part in _CHECKPOINT_PARTS.items() if not any(k.startswith(prefix) for k in header.tensors)
    ]
    if missing:
        raise ModelFileError(
            f"checkpoint {path} lacks the {', '.join(missing)} weights, so it is not a complete LTX-2 audio+video "
            f"checkpoint. {remedy}"
        )
    return header


def _validate_gemma(gemma_root: str, checkpoint_path: str, checkpoint: SafetensorsHeader) -> None:
    text_config = gemma_text_config(gemma_root)
    hidden, layers = text_config["hidden_size"], text_config["num_hidden_layers"]
    projection_inputs = {
        shape[1]
        for name, (_, shape) in checkpoint.tensors.items()
        if name.startswith("text_embedding_projection.") and name.endswith(".weight") and len(shape) == 2
    }
    if projection_inputs and projection_inputs != {hidden * (layers + 1)}:
        raise ModelFileError(
            f"Gemma text encoder {gemma_root} (hidden size {hidden}, {layers} layers) does not fit checkpoint "
            f"{checkpoint_path}, whose text projection reads {sorted(projection_inputs)} features "
            f"(hidden size x (layers + 1)); use the Gemma-3 text encoder released with this checkpoint"
        )


def _validate_upsampler(path: str, checkpoint: SafetensorsHeader) -> None:
    remedy = "Choose the LTX-2 spatial upscaler (e.g. ltx-2-spatial-upscaler-x2-1.0.safetensors)."
    header = read_header(path, "spatial upsampler", remedy)
    try:
        config = json.loads(header.metadata.get("config", ""))
    except ValueError:
        config = None
    if not isinstance(config, dict) or not all(key in header.tensors for key in _UPSAMPLER_KEYS):
        raise ModelFileError(f"{path} is not an LTX-2 latent upsampler (no upsampler config or weights). {remedy}")
    latent_channels = json.loads(checkpoint.metadata["config"]).get("vae", {}).get("latent_channels", 128)
    if config.get("in_channels", 128) != latent_channels:
        raise ModelFileError(
            f"spatial upsampler {path} works on {config.get('in_channels', 128)} latent channels but the checkpoint's "
            f"VAE has {latent_channels}. {remedy}"
        )


# Layers that exist in one transformer layout only: the 22B (LTX-2.3) layout gates every attention
# and scales the text cross-attention by the sigma (prompt AdaLN); the 19B (LTX-2.0) layout projects
# the caption inside the transformer.
_LAYOUT_ONLY_LAYERS = {".to_gate_logits.": "2.3", "prompt_adaln_single.": "2.3", "caption_projection.": "2.0"}
_DISTILLED_LORA_FILES = {"2.0": "ltx-2-19b-distilled-lora-384.safetensors", "2.3": "ltx-2.3-22b-distilled-lora-384-1.1.safetensors"}


def _lora_model_version(role: str, pairs: dict, transformer: dict) -> tuple[str | None, str]:
    """The LTX-2 version a LoRA was made for, from the layers it adapts, and the evidence; None when
    its layers exist in both layouts.

    A layer of one layout only names that version. Beyond that, the distilled LoRA adapts every
    linear layer of the transformer: one that adapts attention but none of the attention gates of a
    gated (LTX-2.3) transformer was made for LTX-2.0. User LoRAs often adapt q/k/v/out only, so that
    second rule is for the distilled LoRA alone."""
    for marker, version in _LAYOUT_ONLY_LAYERS.items():
        layers = sorted(target for target in pairs if marker in target)
        if layers:
            return version, f"it adapts {layers[0].removesuffix('.weight')}, a layer only LTX-{version} has"
    gated = any(".to_gate_logits." in name for name in transformer)
    if role == "distilled LoRA" and gated and any(".to_q." in target for target in pairs):
        return "2.0", "it adapts the attention layers but none of the attention gates LTX-2.3 has"
    return None, ""


def _validate_lora(role: str, path: str, checkpoint_path: str, checkpoint: SafetensorsHeader) -> None:
    remedy = "Use a LoRA trained for this LTX-2 checkpoint, or remove it."
    header = read_header(path, role, remedy)
    transformer = {
        name.removeprefix("model.diffusion_model."): shape
        for name, (_, shape) in checkpoint.tensors.items()
        if name.startswith("model.diffusion_model.")
    }
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, (_, shape) in header.tensors.items():
        key = LTXV_LORA_COMFY_RENAMING_MAP.apply_to_key(name)
        for half in ("lora_A", "lora_B"):
            if key.endswith(f".{half}.weight"):
                pairs.setdefault(key[: -len(f".{half}.weight")] + ".weight", {})[half] = shape
    if not pairs:
        raise ModelFileError(f"{role} {path} holds no LoRA A/B weight pairs (keys '<layer>.lora_A.weight'). {remedy}")
    checkpoint_version = model_version_of(checkpoint.metadata, checkpoint.tensors)
    lora_version, evidence = _lora_model_version(role, pairs, transformer)
    if lora_version is not None and lora_version != checkpoint_version:
        example = f" ({_DISTILLED_LORA_FILES[checkpoint_version]})" if role == "distilled LoRA" else ""
        raise ModelFileError(
            f"{role} {path} is a LoRA for LTX-{lora_version} ({evidence}), but checkpoint {checkpoint_path} is "
            f"LTX-{checkpoint_version}; use the {role} made for LTX-{checkpoint_version}{example}, or a checkpoint of LTX-{lora_version}"
        )
    misfits = []
    for target, halves in sorted(pairs.items()):
        shape = transformer.get(target)
        a, b = halves.get("lora_A"), halves.get("lora_B")
        fits = (
            shape is not None
            and a is not None
            and b is not None
            and len(shape) == 2
            and len(a) == 2
            and len(b) == 2
            and (b[0], a[1]) == tuple(shape)
            and a[0] == b[1]
        )
        if not fits:
            misfits.append(target if shape is None else f"{target} (LoRA {a} x {b}, layer {shape})")
    if misfits:
        shown = ", ".join(misfits[:3]) + (f" and {len(misfits) - 3} more" if len(misfits) > 3 else "")
        raise ModelFileError(
            f"{role} {path} does not match the transformer of {checkpoint_path}: {len(misfits)} of its "
            f"{len(pairs)} layers are missing or have other shapes ({shown}). {remedy}"
        )


# --- Building ---------------------------------------------------------------------------------------


class _CountingLoader(SafetensorsModelStateDictLoader):
    """ltx-core's safetensors loader, counting the tensor bytes it reads from disk."""

    def __init__(self, weight_loader=None) -> None:
        super().__init__(weight_loader)
        self.bytes_read = 0

    def load(self, path: str | list[str], sd_ops: SDOps | None = None, device: torch.device | None = None) -> StateDict:
        state_dict = super().load(path, sd_ops, device)
        # Key operations may return one tensor under two names (Gemma's tied lm_head): count it once.
        unique = {tensor.data_ptr(): tensor.nbytes for tensor in state_dict.sd.values()}
        self.bytes_read += sum(unique.values())
        return state_dict


def _embeddings_processor_configurator(gemma_text_config: dict) -> type:
    """ltx-core's EmbeddingsProcessorConfigurator, with a feature extractor sized for this Gemma."""
    from ltx_core.text_encoders.gemma import EmbeddingsProcessorConfigurator
    from ltx_core.text_encoders.gemma.feature_extractor import FeatureExtractorV1, FeatureExtractorV2

    hidden = gemma_text_config["hidden_size"]
    features = hidden * (gemma_text_config["num_hidden_layers"] + 1)  # embeddings + every layer

    class SizedEmbeddingsProcessorConfigurator:
        @classmethod
        def from_config(cls, config: dict):
            processor = EmbeddingsProcessorConfigurator.from_config(config)
            extractor = processor.feature_extractor
            if isinstance(extractor, FeatureExtractorV1):
                processor.feature_extractor = FeatureExtractorV1(
                    aggregate_embed=torch.nn.Linear(features, hidden, bias=False), is_av=extractor.is_av
                )
            else:
                assert isinstance(extractor, FeatureExtractorV2), type(extractor)
                audio = extractor.audio_aggregate_embed
                processor.feature_extractor = FeatureExtractorV2(
                    video_aggregate_embed=torch.nn.Linear(features, extractor.video_aggregate_embed.out_features),
                    embedding_dim=hidden,
                    audio_aggregate_embed=None if audio is None else torch.nn.Linear(features, audio.out_features),
                )
            return processor

    return SizedEmbeddingsProcessorConfigurator


class _SizedRegistry(StateDictRegistry):
    """ltx-core's registry, also counting the host bytes it holds (each storage once)."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes: dict[str, int] = {}

    def add(self, paths, sd_ops, state_dict: StateDict) -> str:
        key = super().add(paths, sd_ops, state_dict)
        self._bytes[key] = storage_bytes(state_dict.sd.values())
        return key

    def pop(self, paths, sd_ops) -> StateDict | None:
        self._bytes.pop(self._generate_id(paths, sd_ops), None)
        return super().pop(paths, sd_ops)

    def clear(self) -> None:
        super().clear()
        self._bytes.clear()

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (tied or aliased tensors share one)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@dataclass
class ModelLoader:
    """Builds every LTX-2 component of ``spec`` on ``device`` in ``dtype``, as ModelLedger does.

    Each method returns a new model instance (built from the shared registry, so only the first
    build of a component reads the disk); callers keep the instances they want to reuse.
    ``quantization`` (None or ``"fp8-cast"``, see ``mgpu_backend.ltx.fp8``) applies to the
    transformer only, as ModelLedger's ``quantization`` does.
    """

    spec: ModelSpec
    device: torch.device | str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    quantization: str | None = None
    registry: StateDictRegistry = field(default_factory=_SizedRegistry)
    _disk: _CountingLoader = field(default_factory=_CountingLoader, init=False, repr=False)
    _gemma_file_disk: _CountingLoader = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from mgpu_backend.ltx.gemma_file import GemmaFileWeights

        self.device = torch.device(self.device)
        self.quantization = fp8.parse_quantization(self.quantization)
        validate_model_files(self.spec)
        self._gemma_file_disk = _CountingLoader(GemmaFileWeights(self.dtype))

    @property
    def bytes_read_from_disk(self) -> int:
        """Tensor bytes read from model files by this loader so far (fp8 weights: as dequantized)."""
        return self._disk.bytes_read + self._gemma_file_disk.bytes_read

    def _builder(self, path, configurator, sd_ops=None, loras=(), module_ops=(), disk=None) -> SingleGPUModelBuilder:
        return SingleGPUModelBuilder(
            model_path=path,
            model_class_configurator=configurator,
            model_sd_ops=sd_ops,
            module_ops=tuple(module_ops),
            loras=tuple(loras),
            model_loader=disk or self._disk,
            registry=self.registry,
        )

    def _build(self, builder: SingleGPUModelBuilder) -> torch.nn.Module:
        # As ModelLedger with a registry: assemble on the CPU (the registry keeps CPU tensors), then move.
        return builder.build(device=torch.device("cpu"), dtype=self.dtype).to(self.device).eval()

    def _loras(self, lora_set: str) -> tuple[LoraPathStrengthAndSDOps, ...]:
        return tuple(LoraPathStrengthAndSDOps(path, strength, LTXV_LORA_COMFY_RENAMING_MAP) for path, strength in stage_loras(self.spec, lora_set))

    @property
    def host_copy_bytes(self) -> int:
        """Host bytes of the state dicts the registry holds (LoRAs, small components; not what was dropped)."""
        return getattr(self.registry, "nbytes", 0)

    def drop_host_copy(self, component: str) -> int:
        """Forget the registry's host copy of ``component`` (``"transformer"``: the checkpoint's
        transformer weights without LoRAs; ``"gemma"``: Gemma's weights) and return its tensor bytes
        (0 when none was held). Call it once the built model is the only copy needed: a later build
        of that component reads its files again. On the CPU the built model aliases that copy, so
        nothing is freed, but nothing else can see the model's in-place changes either."""
        if component == "transformer":
            paths, sd_ops = [self.spec.checkpoint_path], fp8.transformer_sd_ops(self.quantization)
        elif component == "gemma":
            weights = _gemma_weights(self.spec.gemma_root)
            paths, sd_ops = list(weights.paths), weights.sd_ops
        else:
            raise ValueError(f"component must be 'transformer' or 'gemma', got {component!r}")
        state_dict = self.registry.pop(paths, sd_ops)
        return 0 if state_dict is None else storage_bytes(state_dict.sd.values())

    def transformer(self, lora_set: str = "none") -> X0Model:
        """The denoiser with a LoRA set of ``recipes.LORA_SETS`` fused (a recipe's stage says which)."""
        return self.build_transformer(tuple((lora.path, lora.strength) for lora in self._loras(lora_set)))

    def build_transformer(self, loras: tuple[tuple[str, float], ...] = (), device: torch.device | str | None = None) -> X0Model:
        """The denoiser with ``loras`` (``(path, strength)`` pairs, in order) fused, in ``dtype`` and
        ``quantization``, on ``device`` (the loader's by default; weight sharding builds in host
        memory and moves each block's shard itself). ltx-core's builder steps (meta model with the policy's module ops, state
        dict through the registry, assign), with the tensors prepared by ``fp8.module_tensors`` so
        that fp8 checkpoint files (weights with scales) load too, and LoRAs fused key by key by
        ltx-core's ``apply_loras`` (``fp8.fuse_loras_into``): for a bf16 checkpoint without
        quantization, bitwise what ``SingleGPUModelBuilder.build`` makes."""
        builder = self._builder(self.spec.checkpoint_path, LTXModelConfigurator, fp8.transformer_sd_ops(self.quantization))
        # Assembled on the CPU (the registry keeps CPU tensors), then moved, as ModelLedger with a registry.
        loaded = builder.load_sd([self.spec.checkpoint_path], self.registry, torch.device("cpu"), builder.model_sd_ops)
        tensors, scales = fp8.module_tensors(loaded.sd, self.dtype, self.quantization)
        lora_state_dicts = [LoraStateDictWithStrength(self.lora_state_dict(path), strength) for path, strength in loras]
        if any(strength != 0 for _, strength in loras):
            targets = fp8.lora_targets(tensors, lora_state_dicts)
            for key, value in tensors.items():
                if key not in targets:
                    tensors[key] = value.clone()  # as ltx-core's fusion: every weight of a fused model is new
                    continue
                # Fused from the loaded tensor into the module's dtype, as ltx-core's builder fuses.
                scale = loaded.sd.get(key.removesuffix(".weight") + fp8.WEIGHT_SCALE_SUFFIX)
                tensors[key] = fp8.fuse_loras_into(key, loaded.sd[key], lora_state_dicts, value.dtype, scale)
        module_ops = () if fp8.policy(self.quantization) is None else fp8.policy(self.quantization).module_ops
        velocity_model = builder.meta_model(builder.model_config(), module_ops)
        velocity_model.load_state_dict(tensors, strict=False, assign=True)
        fp8.attach_scaled_upcast(velocity_model, scales)
        missing = [name for name, tensor in (*velocity_model.named_parameters(), *velocity_model.named_buffers()) if tensor.is_meta]
        if missing:
            raise ModelFileError(
                f"checkpoint {self.spec.checkpoint_path} lacks {len(missing)} transformer weights (e.g. {missing[:3]}); "
                "use a complete LTX-2 checkpoint"
            )
        return X0Model(velocity_model).to(self.device if device is None else torch.device(device)).eval()

    def lora_state_dict(self, path: str) -> StateDict:
        """One LoRA file's state dict, read through the registry (once per process)."""
        builder = self._builder(path, LTXModelConfigurator)
        return builder.load_sd(
            [path], registry=self.registry, device=builder.lora_load_device, sd_ops=LTXV_LORA_COMFY_RENAMING_MAP
        )

    def video_encoder(self) -> VideoEncoder:
        return self._build(
            self._builder(self.spec.checkpoint_path, VideoEncoderConfigurator, VAE_ENCODER_COMFY_KEYS_FILTER)
        )

    def video_decoder(self) -> VideoDecoder:
        return self._build(
            self._builder(self.spec.checkpoint_path, VideoDecoderConfigurator, VAE_DECODER_COMFY_KEYS_FILTER)
        )

    def audio_decoder(self) -> AudioDecoder:
        return self._build(
            self._builder(self.spec.checkpoint_path, AudioDecoderConfigurator, AUDIO_VAE_DECODER_COMFY_KEYS_FILTER)
        )

    def vocoder(self) -> Vocoder:
        return self._build(self._builder(self.spec.checkpoint_path, VocoderConfigurator, VOCODER_COMFY_KEYS_FILTER))

    def spatial_upsampler(self) -> LatentUpsampler:
        if self.spec.spatial_upsampler_path is None:
            raise ModelFileError("the model spec names no spatial upsampler; set spatial_upsampler_path")
        return self._build(self._builder(self.spec.spatial_upsampler_path, LatentUpsamplerConfigurator))

    def gemma(self):
        """Gemma's text stack and tokenizer (``gemma_encoder.GemmaEncoder``), from a folder or ComfyUI's file."""
        from mgpu_backend.ltx.gemma_encoder import encoder_configurator, encoder_module_ops

        weights = _gemma_weights(self.spec.gemma_root)
        builder = self._builder(
            weights.paths,
            encoder_configurator(weights.text_config),
            weights.sd_ops,
            module_ops=encoder_module_ops(weights.tokenizer),
            disk=self._gemma_file_disk if weights.from_comfy_file else None,
        )
        return self._build(builder)

    def embeddings_processor(self):
        """ltx-core's EmbeddingsProcessor (feature extractor + video/audio connectors)."""
        from ltx_core.text_encoders.gemma import EMBEDDINGS_PROCESSOR_KEY_OPS

        configurator = _embeddings_processor_configurator(gemma_text_config(self.spec.gemma_root))
        return self._build(self._builder(self.spec.checkpoint_path, configurator, EMBEDDINGS_PROCESSOR_KEY_OPS))
