"""A complete tiny LTX-2 bundle with random weights, in the official file layouts.

No real LTX-2 weights exist on the machines this project is built and tested on. This module writes
a bundle that ltx-core's own loaders read unchanged, so the real loading and inference code runs on
it end to end:

- ``ltx-2-tiny.safetensors``: the main checkpoint. Transformer (``model.diffusion_model.*``), the
  text embeddings connectors (``model.diffusion_model.{video,audio}_embeddings_connector.*``), the
  Gemma feature-extractor projection (``text_embedding_projection.*``), the video VAE
  (``vae.{encoder,decoder,per_channel_statistics}.*``), the audio VAE (``audio_vae.*``) and the
  vocoder (``vocoder.*``), with the ``config`` metadata JSON every ltx-core configurator reads.
- ``ltx-2-tiny-distilled-lora.safetensors``: LoRA A/B pairs (``diffusion_model.<layer>.lora_A``)
  for every linear layer of the transformer blocks, in the ComfyUI key format ltx-core fuses.
- ``ltx-2-tiny-spatial-upscaler-x2.safetensors``: the latent upsampler with its flat ``config``.
- ``gemma-3-tiny/``: a Gemma-3 folder as Hugging Face lays it out (config.json, sharded-style
  safetensors with index, tokenizer.model + tokenizer.json + configs, preprocessor config). The
  tokenizer is a SentencePiece BPE model trained here on the embedded text below.

What is kept from the real model because the pipeline code assumes it: 128 video latent channels,
the VAE's 32x spatial / 8x temporal compression, audio latents of 8 channels x 16 mel bins (64 mel
bins decoded, stereo), the vocoder's 24 kHz output from 16 kHz / hop 160 mel frames, the 2x spatial
upsampler, V1 ("19B") text conditioning. Attention head counts are 8 for video and audio so every
sequence-parallel degree 1, 2, 4, 8 divides them. Everything else is as small as ltx-core allows.

Which checkpoint tensors depend on the Gemma config: ``text_embedding_projection.aggregate_embed``
is ``[hidden, hidden * (layers + 1)]``; both connectors work at width ``hidden`` (their heads x
head dim) and hold ``[128, hidden]`` learnable registers; the transformer's ``caption_projection``
and ``audio_caption_projection`` read ``caption_channels = hidden``.

Bytes are deterministic: every tensor is drawn from a generator seeded by its own name, and the
safetensors files are serialised here with sorted keys (the safetensors library writes metadata in
hash order). This module must never download anything.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import tempfile
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

BUNDLE_VERSION = 1
"""Bump whenever any byte of the bundle changes: caches are kept per version."""

_MANIFEST = "tiny-bundle.json"
_SEED = 0x17C2

CHECKPOINT_NAME = "ltx-2-tiny.safetensors"
DISTILLED_LORA_NAME = "ltx-2-tiny-distilled-lora.safetensors"
SPATIAL_UPSAMPLER_NAME = "ltx-2-tiny-spatial-upscaler-x2.safetensors"
GEMMA_DIR_NAME = "gemma-3-tiny"
GEMMA_WEIGHTS_NAME = "model-00001-of-00001.safetensors"

# --- Gemma-3 text encoder (the 12B model's architecture, shrunk) ---------------------------------

GEMMA_TEXT_CONFIG = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "cache_implementation": "hybrid",
    "final_logit_softcapping": None,
    "head_dim": 32,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "model_type": "gemma3_text",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 32,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "rope_theta": 1000000,
    "sliding_window": 512,
    # Layer 0 uses sliding-window attention, layer 1 full attention, as the real model alternates.
    "sliding_window_pattern": 2,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 1024,
}

GEMMA_VISION_CONFIG = {
    "attention_dropout": 0.0,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 32,
    "image_size": 28,
    "intermediate_size": 64,
    "layer_norm_eps": 1e-06,
    "model_type": "siglip_vision_model",
    "num_attention_heads": 2,
    "num_channels": 3,
    "num_hidden_layers": 1,
    "patch_size": 14,
    "torch_dtype": "bfloat16",
    "vision_use_head": False,
}

# SentencePiece ids of the Gemma special tokens in the tiny vocabulary (Gemma's own order for the
# first four; the trainer places user-defined symbols right after them).
_SPECIAL_PIECES = ("<pad>", "<eos>", "<bos>", "<unk>")
_USER_SYMBOLS = (
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
_TOKEN_ID = {piece: i for i, piece in enumerate(_SPECIAL_PIECES + _USER_SYMBOLS)}
TOKENIZER_VOCAB_SIZE = 640

GEMMA_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": _TOKEN_ID["<start_of_image>"],
    "eoi_token_index": _TOKEN_ID["<end_of_image>"],
    "eos_token_id": [_TOKEN_ID["<eos>"], _TOKEN_ID["<end_of_turn>"]],
    "image_token_index": _TOKEN_ID["<image_soft_token>"],
    "initializer_range": 0.02,
    # (image_size / patch_size)^2 = 4 patches, pooled to 4 tokens.
    "mm_tokens_per_image": 4,
    "model_type": "gemma3",
    "text_config": GEMMA_TEXT_CONFIG,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "vision_config": GEMMA_VISION_CONFIG,
}

_GEMMA_HIDDEN = GEMMA_TEXT_CONFIG["hidden_size"]
_GEMMA_LAYERS = GEMMA_TEXT_CONFIG["num_hidden_layers"]

# --- The main checkpoint's ``config`` metadata -----------------------------------------------------

# The fixed architecture options of every LTX-2 checkpoint, which ltx-core's LTXModelConfigurator
# checks; any LTX-2 transformer configuration (tiny, test or full size) includes them.
LTX2_TRANSFORMER_ARCHITECTURE = {
    "dropout": 0.0,
    "attention_bias": True,
    "num_vector_embeds": None,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000,
    "use_linear_projection": False,
    "only_cross_attention": False,
    "cross_attention_norm": True,
    "double_self_attention": False,
    "upcast_attention": False,
    "standardization_norm": "rms_norm",
    "norm_elementwise_affine": False,
    "qk_norm": "rms_norm",
    "positional_embedding_type": "rope",
    "use_audio_video_cross_attention": True,
    "share_ff": False,
    "av_cross_ada_norm": True,
    "use_middle_indices_grid": True,
}

TRANSFORMER_CONFIG = {
    "num_layers": 2,
    "num_attention_heads": 8,
    "attention_head_dim": 16,
    "audio_num_attention_heads": 8,
    "audio_attention_head_dim": 8,
    "in_channels": 128,
    "out_channels": 128,
    # 8 audio latent channels x 16 latent mel bins, patchified per time step.
    "audio_in_channels": 128,
    "audio_out_channels": 128,
    # Cross-attention runs at the stream width, as 4096 = 32 x 128 does in the 19B model.
    "cross_attention_dim": 128,
    "audio_cross_attention_dim": 64,
    "caption_channels": _GEMMA_HIDDEN,
    "connector_num_attention_heads": 4,
    "connector_attention_head_dim": _GEMMA_HIDDEN // 4,
    "connector_num_layers": 1,
    "norm_eps": 1e-06,
    "positional_embedding_theta": 10000.0,
    "positional_embedding_max_pos": [20, 2048, 2048],
    "audio_positional_embedding_max_pos": [20],
    "timestep_scale_multiplier": 1000,
    "av_ca_timestep_scale_multiplier": 1,
    "rope_type": "interleaved",
    **LTX2_TRANSFORMER_ARCHITECTURE,
}

VIDEO_VAE_CONFIG = {
    "_class_name": "CausalVideoAutoencoder",
    "dims": 3,
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 128,
    # patch 4 x (space, time, all, all) = 32x spatial, 8x temporal, as in the real encoder; the
    # multiplier 1 keeps every stage at the 128 latent channels.
    "encoder_blocks": [
        ["compress_space_res", {"multiplier": 1}],
        ["compress_time_res", {"multiplier": 1}],
        ["compress_all_res", {"multiplier": 1}],
        ["compress_all_res", {"multiplier": 1}],
        ["res_x", {"num_layers": 1}],
    ],
    # Listed encoder-side first, as the real config does; ltx-core builds them reversed.
    # 3 x compress_all (8x time, 8x space) and the 4x unpatchify give the 32x / 8x expansion.
    "decoder_blocks": [
        ["res_x", {"num_layers": 1, "inject_noise": False}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["res_x", {"num_layers": 1, "inject_noise": False}],
    ],
    "patch_size": 4,
    "norm_layer": "pixel_norm",
    "latent_log_var": "uniform",
    "use_quant_conv": False,
    "encoder_spatial_padding_mode": "zeros",
    "decoder_spatial_padding_mode": "reflect",
    "causal_decoder": False,
    "timestep_conditioning": True,
    # 8 x 8 = 64 channels after the decoder's conv_in (1024 in the real model).
    "decoder_base_channels": 8,
}

AUDIO_VAE_CONFIG = {
    "model": {
        "params": {
            "ddconfig": {
                # ch is also the width of the latent statistics: 8 channels x 16 mel bins = 128.
                "ch": 128,
                "out_ch": 2,
                # Three resolutions = two 2x steps: 16 latent mel bins <-> 64 mel bins.
                "ch_mult": [1, 1, 1],
                "num_res_blocks": 1,
                "attn_resolutions": [],
                "resolution": 256,
                "z_channels": 8,
                "double_z": True,
                "dropout": 0.0,
                "in_channels": 2,
                "mid_block_add_attention": True,
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

VOCODER_CONFIG = {
    "resblock": "1",
    "resblock_kernel_sizes": [3],
    "resblock_dilation_sizes": [[1, 3, 5]],
    # 6 * 5 * 2 * 2 * 2 = 240 samples per mel frame: 100 frames/s -> 24 kHz, as in the real model.
    "upsample_rates": [6, 5, 2, 2, 2],
    "upsample_kernel_sizes": [16, 15, 8, 4, 4],
    "upsample_initial_channel": 64,
    "stereo": True,
    "output_sampling_rate": 24000,
}

CHECKPOINT_CONFIG = {
    "transformer": TRANSFORMER_CONFIG,
    "vae": VIDEO_VAE_CONFIG,
    "audio_vae": AUDIO_VAE_CONFIG,
    "vocoder": VOCODER_CONFIG,
}

SPATIAL_UPSAMPLER_CONFIG = {
    "_class_name": "LatentUpsampler",
    "in_channels": 128,
    # GroupNorm(32, mid_channels) needs a multiple of 32.
    "mid_channels": 32,
    "num_blocks_per_stage": 1,
    "dims": 3,
    "spatial_upsample": True,
    "temporal_upsample": False,
    "spatial_scale": 2.0,
    "rational_resampler": False,
}

LORA_RANK = 4

# Prompt-like text the tokenizer is trained on.
_TOKENIZER_CORPUS = """\
A slow camera push toward a lighthouse on a rocky coast at dusk, waves breaking against the stones.
A woman in a red coat walks through a crowded market, the camera tracking her from behind.
Close-up of a cat sleeping on a windowsill while rain runs down the glass.
An aerial shot of a winding mountain road with a single car driving through the autumn forest.
A chef chops vegetables in a busy kitchen; steam rises from the pots and a pan sizzles.
Two children laugh as they run across a green field chasing a kite in the wind.
The city skyline at night, traffic lights streaking below, distant sirens and a low hum of engines.
A musician plays an acoustic guitar on a small stage under warm yellow light.
A drone flies over a calm lake at sunrise, mist drifting over the water and birds calling.
An old man reads a newspaper on a park bench as pigeons gather at his feet.
A train crosses a long bridge over a river valley, the sound of wheels on the rails.
Snow falls softly on a quiet village street lined with wooden houses and glowing windows.
A dog shakes water off its fur on the beach, then sprints toward the waves.
A scientist looks through a microscope in a bright laboratory filled with glass bottles.
Fireworks explode over a harbor, reflections shimmering on the dark water, the crowd cheering.
A dancer spins in an empty studio, her shadow stretching across the polished floor.
Heavy rain on a tin roof, thunder rolling in the distance, a lamp flickering inside.
A close shot of hands kneading bread dough on a floured wooden table.
A cyclist rides down a narrow street in the old town, bells ringing from a church tower.
A sailboat glides across the open sea, the sail filling with wind under a clear blue sky.
The camera slowly pans across a desert at noon; heat waves rise from the sand dunes.
A barista pours milk into a cup of coffee, drawing a leaf pattern in the foam.
Leaves fall from tall trees in a quiet park while a jogger passes along the path.
A robot arm assembles small parts on a factory line with precise and steady movements.
A family shares dinner around a long table, talking and passing plates of food.
Lightning flashes over a wheat field as dark clouds roll across the horizon.
A fox steps carefully through fresh snow at the edge of a pine forest.
A young man plays the piano in a dim room; the melody is soft and slow.
Waves of people cross a wide street at a busy intersection in the morning.
A hot air balloon rises above green hills, its burner roaring at regular intervals.
Static camera, medium shot: a woman speaks to the camera and smiles, saying hello and welcome.
Wide shot, golden hour: horses gallop across an open plain, dust rising behind them.
Handheld camera follows a skateboarder down a concrete ramp; wheels clatter and scrape.
Macro shot of a bee landing on a purple flower, wings buzzing in the warm sunlight.
A candle burns on a wooden table; the flame moves gently in a light draft.
A street performer juggles three red balls while a small crowd claps along.
An astronaut floats inside a space station, looking out of a round window at the earth.
A waterfall pours into a clear pool surrounded by moss covered rocks and ferns.
The camera dollies forward through a library with tall shelves full of old books.
A painter adds bright strokes of blue and orange to a large canvas in a sunny studio.
Numbers and time: 1 2 3 4 5 6 7 8 9 0, 24 frames per second, 1080p, 4K, 16:9.
Sound: birds singing, wind blowing, water flowing, footsteps on gravel, a door closing.
"""

_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyBundle:
    """Paths of one tiny LTX-2 bundle (all absolute strings, as ltx-core's loaders take them)."""

    root: str
    checkpoint_path: str
    distilled_lora_path: str
    spatial_upsampler_path: str
    gemma_root: str

    def __str__(self) -> str:
        return "\n".join(
            [
                f"tiny LTX-2 bundle v{BUNDLE_VERSION} in {self.root}",
                f"  checkpoint:        {self.checkpoint_path}",
                f"  distilled LoRA:    {self.distilled_lora_path}",
                f"  spatial upsampler: {self.spatial_upsampler_path}",
                f"  gemma root:        {self.gemma_root}",
            ]
        )


def _bundle_at(root: Path) -> TinyBundle:
    root = root.resolve()
    return TinyBundle(
        root=str(root),
        checkpoint_path=str(root / CHECKPOINT_NAME),
        distilled_lora_path=str(root / DISTILLED_LORA_NAME),
        spatial_upsampler_path=str(root / SPATIAL_UPSAMPLER_NAME),
        gemma_root=str(root / GEMMA_DIR_NAME),
    )


# --- Deterministic files ---------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serialise to the safetensors format with sorted keys, so equal inputs give equal bytes."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(sorted(metadata.items()))
    blobs = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        blob = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    return struct.pack("<Q", len(header_bytes)) + header_bytes + b"".join(blobs)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


# --- Random weights --------------------------------------------------------------------------------


def _random_tensor(name: str, shape: tuple[int, ...], rule: str) -> torch.Tensor:
    """One tensor, seeded by its own name so adding a tensor never changes the others.

    rule: "weight" N(0, 1/fan_in), "bias" and "small" N(0, 0.02^2), "one" 1 + N(0, 0.02^2),
    "lora_b" N(0, 0.05^2), "positive" U(0.5, 1.5), "uniform" U(-1, 1).
    """
    generator = torch.Generator().manual_seed(_SEED ^ zlib.crc32(name.encode("utf-8")))
    if rule == "positive":
        values = 0.5 + torch.rand(shape, generator=generator)
    elif rule == "uniform":
        values = torch.rand(shape, generator=generator) * 2.0 - 1.0
    else:
        values = torch.randn(shape, generator=generator)
        if rule == "weight":
            fan_in = 1
            for size in shape[1:]:
                fan_in *= size
            values = values / fan_in**0.5
        elif rule in ("bias", "small"):
            values = values * 0.02
        elif rule == "lora_b":
            values = values * 0.05
        elif rule == "one":
            values = 1.0 + values * 0.02
        else:
            raise AssertionError(rule)
    return values.to(torch.bfloat16)


def _ltx_rule(key: str, shape: tuple[int, ...]) -> str:
    if key.endswith("std-of-means"):
        return "positive"
    if key.endswith("learnable_registers"):
        return "uniform"
    if len(shape) >= 2:
        return "weight"
    if key.endswith(".weight") and "norm" in key.split(".")[-2]:
        return "one"
    return "bias" if key.endswith("bias") else "small"


def _ltx_component(
    prefix: str, model: torch.nn.Module, skip: tuple[str, ...] = (), only: tuple[str, ...] = ("",)
) -> dict[str, torch.Tensor]:
    """Random weights for the state-dict entries of an ltx-core model built on the meta device
    (those starting with one of ``only`` and none of ``skip``)."""
    tensors = {}
    for key, meta in model.state_dict().items():
        if key.startswith(skip) or not key.startswith(only):
            continue
        full = prefix + key
        tensors[full] = _random_tensor(full, tuple(meta.shape), _ltx_rule(key, tuple(meta.shape)))
    return tensors


def _connector_skeleton() -> torch.nn.Module:
    """A module with the parameters of ltx-core's Embeddings1DConnector at the tiny config.

    Built from the same Attention and FeedForward classes that connector uses, because importing
    ``ltx_core.text_encoders`` imports transformers, which alone takes longer than making the bundle.
    """
    from ltx_core.model.transformer.attention import Attention
    from ltx_core.model.transformer.feed_forward import FeedForward

    heads, head_dim = (
        TRANSFORMER_CONFIG["connector_num_attention_heads"],
        TRANSFORMER_CONFIG["connector_attention_head_dim"],
    )
    width = heads * head_dim
    connector = torch.nn.Module()
    connector.transformer_1d_blocks = torch.nn.ModuleList(
        torch.nn.ModuleDict(
            {
                "attn1": Attention(query_dim=width, heads=heads, dim_head=head_dim),
                "ff": FeedForward(width, dim_out=width),
            }
        )
        for _ in range(TRANSFORMER_CONFIG["connector_num_layers"])
    )
    # ltx-core's connector replaces padded text tokens with 128 learnable registers.
    connector.learnable_registers = torch.nn.Parameter(torch.empty(128, width))
    return connector


def _checkpoint_tensors() -> dict[str, torch.Tensor]:
    from ltx_core.model.audio_vae import AudioDecoderConfigurator, AudioEncoderConfigurator, VocoderConfigurator
    from ltx_core.model.transformer import LTXModelConfigurator
    from ltx_core.model.video_vae import VideoDecoderConfigurator, VideoEncoderConfigurator

    config = CHECKPOINT_CONFIG
    with torch.device("meta"):
        transformer = LTXModelConfigurator.from_config(config)
        connector = _connector_skeleton()
        video_encoder = VideoEncoderConfigurator.from_config(config)
        video_decoder = VideoDecoderConfigurator.from_config(config)
        audio_encoder = AudioEncoderConfigurator.from_config(config)
        audio_decoder = AudioDecoderConfigurator.from_config(config)
        vocoder = VocoderConfigurator.from_config(config)

    stats = ("per_channel_statistics.",)
    tensors: dict[str, torch.Tensor] = {}
    tensors.update(_ltx_component("model.diffusion_model.", transformer))
    tensors.update(_ltx_component("model.diffusion_model.video_embeddings_connector.", connector))
    tensors.update(_ltx_component("model.diffusion_model.audio_embeddings_connector.", connector))
    tensors.update(_ltx_component("vae.encoder.", video_encoder, skip=stats))
    tensors.update(_ltx_component("vae.decoder.", video_decoder, skip=stats + ("timestep_scale_multiplier",)))
    # Encoder and decoder share one copy of the latent statistics.
    tensors.update(_ltx_component("vae.", video_encoder, only=stats))
    tensors.update(_ltx_component("audio_vae.encoder.", audio_encoder, skip=stats))
    tensors.update(_ltx_component("audio_vae.decoder.", audio_decoder, skip=stats))
    tensors.update(_ltx_component("audio_vae.", audio_decoder, only=stats))
    tensors.update(_ltx_component("vocoder.", vocoder))
    # The real decoder scales its timestep by 1000 (a parameter stored in the checkpoint).
    tensors["vae.decoder.timestep_scale_multiplier"] = torch.tensor(1000.0, dtype=torch.bfloat16)
    # V1 feature extractor: all Gemma hidden states (embeddings + every layer) -> Gemma width.
    projection = "text_embedding_projection.aggregate_embed.weight"
    tensors[projection] = _random_tensor(projection, (_GEMMA_HIDDEN, _GEMMA_HIDDEN * (_GEMMA_LAYERS + 1)), "weight")
    return tensors


def _lora_tensors(transformer_keys: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """Rank-4 A/B pairs for every linear weight inside the transformer blocks."""
    tensors = {}
    for key, shape in transformer_keys:
        layer = key[: -len(".weight")]
        out_features, in_features = shape
        a_key = f"diffusion_model.{layer}.lora_A.weight"
        b_key = f"diffusion_model.{layer}.lora_B.weight"
        tensors[a_key] = _random_tensor(a_key, (LORA_RANK, in_features), "weight")
        # Trained LoRA B matrices are small but not zero: about a tenth of the base weight's scale.
        tensors[b_key] = _random_tensor(b_key, (out_features, LORA_RANK), "lora_b")
    return tensors


def _upsampler_tensors() -> dict[str, torch.Tensor]:
    from ltx_core.model.upsampler import LatentUpsamplerConfigurator

    with torch.device("meta"):
        upsampler = LatentUpsamplerConfigurator.from_config(SPATIAL_UPSAMPLER_CONFIG)
    return _ltx_component("", upsampler)


def _gemma_tensors() -> dict[str, torch.Tensor]:
    """Gemma-3 weights under the key names of Google's released checkpoint (``language_model.model.*``,
    ``vision_tower.vision_model.*``, ``multi_modal_projector.*``; lm_head is tied to the embeddings)."""
    text, vision = GEMMA_TEXT_CONFIG, GEMMA_VISION_CONFIG
    hidden, inter, head_dim = text["hidden_size"], text["intermediate_size"], text["head_dim"]
    q_dim, kv_dim = text["num_attention_heads"] * head_dim, text["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "language_model.model.embed_tokens.weight": ((text["vocab_size"], hidden), "weight"),
        "language_model.model.norm.weight": ((hidden,), "small"),
    }
    for layer in range(text["num_hidden_layers"]):
        p = f"language_model.model.layers.{layer}."
        shapes.update(
            {
                # Gemma's RMSNorm multiplies by (1 + weight): weights near zero.
                p + "input_layernorm.weight": ((hidden,), "small"),
                p + "post_attention_layernorm.weight": ((hidden,), "small"),
                p + "pre_feedforward_layernorm.weight": ((hidden,), "small"),
                p + "post_feedforward_layernorm.weight": ((hidden,), "small"),
                p + "self_attn.q_proj.weight": ((q_dim, hidden), "weight"),
                p + "self_attn.k_proj.weight": ((kv_dim, hidden), "weight"),
                p + "self_attn.v_proj.weight": ((kv_dim, hidden), "weight"),
                p + "self_attn.o_proj.weight": ((hidden, q_dim), "weight"),
                p + "self_attn.q_norm.weight": ((head_dim,), "small"),
                p + "self_attn.k_norm.weight": ((head_dim,), "small"),
                p + "mlp.gate_proj.weight": ((inter, hidden), "weight"),
                p + "mlp.up_proj.weight": ((inter, hidden), "weight"),
                p + "mlp.down_proj.weight": ((hidden, inter), "weight"),
            }
        )
    v_hidden, v_inter, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    patches = (vision["image_size"] // patch) ** 2
    v = "vision_tower.vision_model."
    shapes.update(
        {
            v + "embeddings.patch_embedding.weight": ((v_hidden, vision["num_channels"], patch, patch), "weight"),
            v + "embeddings.patch_embedding.bias": ((v_hidden,), "bias"),
            v + "embeddings.position_embedding.weight": ((patches, v_hidden), "weight"),
            v + "post_layernorm.weight": ((v_hidden,), "one"),
            v + "post_layernorm.bias": ((v_hidden,), "bias"),
            "multi_modal_projector.mm_input_projection_weight": ((v_hidden, hidden), "weight"),
            "multi_modal_projector.mm_soft_emb_norm.weight": ((v_hidden,), "small"),
        }
    )
    for layer in range(vision["num_hidden_layers"]):
        p = f"{v}encoder.layers.{layer}."
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[p + norm + ".weight"] = ((v_hidden,), "one")
            shapes[p + norm + ".bias"] = ((v_hidden,), "bias")
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[p + f"self_attn.{proj}.weight"] = ((v_hidden, v_hidden), "weight")
            shapes[p + f"self_attn.{proj}.bias"] = ((v_hidden,), "bias")
        shapes[p + "mlp.fc1.weight"] = ((v_inter, v_hidden), "weight")
        shapes[p + "mlp.fc1.bias"] = ((v_inter,), "bias")
        shapes[p + "mlp.fc2.weight"] = ((v_hidden, v_inter), "weight")
        shapes[p + "mlp.fc2.bias"] = ((v_hidden,), "bias")
    return {key: _random_tensor("gemma:" + key, shape, rule) for key, (shape, rule) in shapes.items()}


# --- Tokenizer -------------------------------------------------------------------------------------


def _train_sentencepiece() -> bytes:
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_TOKENIZER_CORPUS.splitlines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=TOKENIZER_VOCAB_SIZE,
        hard_vocab_limit=False,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        user_defined_symbols=list(_USER_SYMBOLS),
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def _tokenizer_json(sentencepiece_model: bytes) -> bytes:
    """The fast-tokenizer twin of the SentencePiece model, laid out as Gemma's tokenizer.json is
    (normalizer space -> "▁", BPE with byte fallback, merges ranked by the merged piece's id, <bos> first)."""
    import sentencepiece
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    processor = sentencepiece.SentencePieceProcessor(model_proto=sentencepiece_model)
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    merges = []
    for piece, piece_id in vocab.items():
        if not processor.is_control(piece_id) and not processor.is_byte(piece_id):
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    merges.append((piece_id, vocab[left], vocab[right], left, right))
    merges.sort()
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=[(left, right) for *_, left, right in merges],
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1", special_tokens=[("<bos>", _TOKEN_ID["<bos>"])]
    )
    tokenizer.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in _TOKEN_ID])
    return tokenizer.to_str(pretty=True).encode("utf-8")


def _gemma_folder_files() -> dict[str, bytes]:
    sentencepiece_model = _train_sentencepiece()
    weights = _gemma_tensors()
    weights_bytes = safetensors_bytes(weights, {"format": "pt"})
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    extra_special = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    added_tokens_decoder = {
        str(token_id): {
            "content": piece,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for piece, token_id in _TOKEN_ID.items()
    }
    tokenizer_config = {
        "tokenizer_class": "GemmaTokenizer",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False,
        "model_max_length": 1000000000000000019884624838656,
        "padding_side": "left",
        "added_tokens_decoder": added_tokens_decoder,
        "extra_special_tokens": extra_special,
        "chat_template": _CHAT_TEMPLATE,
        "processor_class": "Gemma3Processor",
        **special,
        **extra_special,
    }
    image_size = GEMMA_VISION_CONFIG["image_size"]
    preprocessor_config = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_seq_length": GEMMA_CONFIG["mm_tokens_per_image"],
        "resample": 2,
        "rescale_factor": 1 / 255,
        "size": {"height": image_size, "width": image_size},
    }
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in weights.values())},
        "weight_map": {key: GEMMA_WEIGHTS_NAME for key in sorted(weights)},
    }
    return {
        "config.json": _json_bytes(GEMMA_CONFIG),
        "generation_config.json": _json_bytes(
            {"bos_token_id": _TOKEN_ID["<bos>"], "eos_token_id": GEMMA_CONFIG["eos_token_id"], "pad_token_id": 0}
        ),
        GEMMA_WEIGHTS_NAME: weights_bytes,
        "model.safetensors.index.json": _json_bytes(index),
        "tokenizer.model": sentencepiece_model,
        "tokenizer.json": _tokenizer_json(sentencepiece_model),
        "tokenizer_config.json": _json_bytes(tokenizer_config),
        "special_tokens_map.json": _json_bytes({**special, **extra_special}),
        "preprocessor_config.json": _json_bytes(preprocessor_config),
        "processor_config.json": _json_bytes(
            {"image_seq_length": GEMMA_CONFIG["mm_tokens_per_image"], "processor_class": "Gemma3Processor"}
        ),
    }


def _bundle_files() -> dict[str, bytes]:
    """Every file of the bundle, relative path -> bytes."""
    checkpoint = _checkpoint_tensors()
    block_linears = [
        (key.removeprefix("model.diffusion_model."), tuple(t.shape))
        for key, t in checkpoint.items()
        if key.startswith("model.diffusion_model.transformer_blocks.") and key.endswith(".weight") and t.ndim == 2
    ]
    checkpoint_metadata = {
        "config": json.dumps(CHECKPOINT_CONFIG),
        # Not "2.3...": ltx-pipelines then picks its LTX-2.0 defaults for this checkpoint.
        "model_version": "2.0.0",
        "mgpu_tiny_bundle": str(BUNDLE_VERSION),
    }
    files = {
        CHECKPOINT_NAME: safetensors_bytes(checkpoint, checkpoint_metadata),
        DISTILLED_LORA_NAME: safetensors_bytes(_lora_tensors(block_linears), {"mgpu_tiny_bundle": str(BUNDLE_VERSION)}),
        SPATIAL_UPSAMPLER_NAME: safetensors_bytes(
            _upsampler_tensors(),
            {"config": json.dumps(SPATIAL_UPSAMPLER_CONFIG), "mgpu_tiny_bundle": str(BUNDLE_VERSION)},
        ),
    }
    for name, data in _gemma_folder_files().items():
        files[f"{GEMMA_DIR_NAME}/{name}"] = data
    return files


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_complete(root: Path) -> bool:
    """True when ``root`` holds every file of a bundle of this version, unchanged since it was made."""
    try:
        manifest = json.loads((root / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("version") != BUNDLE_VERSION:
        return False
    files = manifest.get("files", {})
    return bool(files) and all(
        (root / name).is_file() and _sha256_file(root / name) == digest for name, digest in files.items()
    )


def make_tiny_bundle(directory: str | os.PathLike) -> TinyBundle:
    """Write the tiny bundle into ``directory`` (created if needed) and return its paths.

    Deterministic: the same bytes every time. A directory that already holds a complete bundle of
    this version is reused as it is. Each file is written atomically and the manifest last, so a
    directory interrupted half-way is never taken for a complete bundle.
    """
    root = Path(directory)
    if _is_complete(root):
        return _bundle_at(root)
    files = _bundle_files()
    for name, data in files.items():
        _write_atomic(root / name, data)
    manifest = {
        "version": BUNDLE_VERSION,
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in sorted(files.items())},
    }
    _write_atomic(root / _MANIFEST, _json_bytes(manifest))
    return _bundle_at(root)


def cache_dir() -> Path:
    """``$MGPU_CACHE_DIR``, or ``~/.cache/comfyui-mgpu``."""
    return Path(os.environ.get("MGPU_CACHE_DIR") or Path.home() / ".cache" / "comfyui-mgpu")


def default_tiny_bundle() -> TinyBundle:
    """The tiny bundle in the cache, made on first use.

    Safe against several processes making it at once: each builds in a private folder and renames
    it into place; a process that loses the race drops its copy and uses the winner's.
    """
    final = cache_dir() / f"tiny-ltx2-v{BUNDLE_VERSION}"
    if _is_complete(final):
        return _bundle_at(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_tiny_bundle(staging)
        if final.exists() and not _is_complete(final):
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
            if not _is_complete(final):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _bundle_at(final)


def main_make_tiny(argv: list[str] | None = None) -> int:
    """``python -m mgpu_backend make-tiny [DIR]``: write the bundle (to the cache if no DIR)."""
    import argparse

    parser = argparse.ArgumentParser(prog="make-tiny", description=main_make_tiny.__doc__)
    parser.add_argument("directory", nargs="?", help="where to write it (default: the cache folder)")
    args = parser.parse_args(argv)
    bundle = make_tiny_bundle(args.directory) if args.directory else default_tiny_bundle()
    print(bundle)
    return 0
