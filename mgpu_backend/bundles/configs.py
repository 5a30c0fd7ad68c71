"""The configurations of every bundle: the tiny ones (tests, ``generate``'s embedded default) and the
full-size ones (benchmarks), for LTX-2.0 (19B layout) and LTX-2.3 (22B layout).

A ``BundleConfig`` holds what decides a bundle's shapes, in the form ltx-core reads it: the
checkpoint's ``config`` metadata, the spatial upsampler's flat ``config``, the Gemma folder's
config.json and the distilled LoRA's rank. ``layout.py`` writes any of them.

The tiny configurations keep from the real model what the pipeline code assumes: 128 video latent
channels, the VAE's 32x spatial / 8x temporal compression, audio latents of 8 channels x 16 mel bins
(64 mel bins decoded, stereo), 16 kHz / hop 160 mel frames, the 2x spatial upsampler. Attention head
counts are 8 for video and audio so every sequence-parallel degree 1, 2, 4, 8 divides them.
Everything else is as small as ltx-core allows. Which checkpoint tensors depend on the Gemma config:
the text projection reads hidden x (layers + 1) features (all hidden states: embeddings and every
layer); in the 19B layout both connectors work at the Gemma width and the transformer's caption
projections read ``caption_channels = hidden``; in the 22B layout the projection maps straight to the
video and audio stream widths and the connectors work at those.

The full-size configurations follow the official models; docs/full-size-config.md says where each
number comes from. The 2.3 ("22B") layout differs from 2.0 by the keys ltx-core 1.0.0 reads:
``caption_proj_before_connector`` and its companions (the text projection moves from the
transformer into the text encoder: ``FeatureExtractorV2``), ``apply_gated_attention`` and
``connector_apply_gated_attention`` (per-head gates), ``cross_attention_adaln`` (text
cross-attention modulated by the timestep), separate audio connector dimensions, and a vocoder with
bandwidth extension (a nested ``vocoder`` + ``bwe`` section). ltx-pipelines tells the versions apart
by the checkpoint's ``model_version`` metadata (``detect_params``): ``model_version`` here.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

from mgpu_backend.bundles.gemma_folder import TOKEN_ID

VERSIONS = ("2.0", "2.3")
"""The LTX-2 model versions a bundle can be written for (ltx-core / ltx-pipelines 1.0.0 know these two)."""

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

GEMMA_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": TOKEN_ID["<start_of_image>"],
    "eoi_token_index": TOKEN_ID["<end_of_image>"],
    "eos_token_id": [TOKEN_ID["<eos>"], TOKEN_ID["<end_of_turn>"]],
    "image_token_index": TOKEN_ID["<image_soft_token>"],
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

def _video_vae(encoder_blocks: list, decoder_blocks: list, decoder_base_channels: int, **padding: str) -> dict:
    """A ``vae`` section: 3-channel video <-> 128 latent channels, patch 4 (block lists encoder-side first,
    as the real configs list them; ltx-core builds the decoder's reversed)."""
    return {
        "_class_name": "CausalVideoAutoencoder",
        "dims": 3,
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 128,
        "encoder_blocks": encoder_blocks,
        "decoder_blocks": decoder_blocks,
        "patch_size": 4,
        "norm_layer": "pixel_norm",
        "latent_log_var": "uniform",
        "use_quant_conv": False,
        **padding,
        "causal_decoder": False,
        "timestep_conditioning": True,
        "decoder_base_channels": decoder_base_channels,
    }


def _audio_vae(ch_mult: list[int], num_res_blocks: int, mid_block_add_attention: bool) -> dict:
    """An ``audio_vae`` section: 16 kHz stereo mel spectrograms (64 bins, hop 160) <-> 8 latent channels x 16
    mel bins; ``ch`` is also the width of the latent statistics: 8 channels x 16 mel bins = 128."""
    ddconfig = {
        "ch": 128,
        "out_ch": 2,
        "ch_mult": ch_mult,
        "num_res_blocks": num_res_blocks,
        "attn_resolutions": [],
        "resolution": 256,
        "z_channels": 8,
        "double_z": True,
        "dropout": 0.0,
        "in_channels": 2,
        "mid_block_add_attention": mid_block_add_attention,
        "norm_type": "pixel",
        "causality_axis": "height",
        "attn_type": "vanilla",
        "resamp_with_conv": True,
        "mel_bins": 64,
    }
    return {
        "model": {"params": {"ddconfig": ddconfig, "sampling_rate": 16000}},
        "preprocessing": {
            "stft": {"filter_length": 1024, "hop_length": 160, "causal": True},
            "mel": {"n_mel_channels": 64},
        },
        "variables": {"mel_bins": 64},
    }


VIDEO_VAE_CONFIG = _video_vae(
    # patch 4 x (space, time, all, all) = 32x spatial, 8x temporal, as in the real encoder; the
    # multiplier 1 keeps every stage at the 128 latent channels.
    encoder_blocks=[
        ["compress_space_res", {"multiplier": 1}],
        ["compress_time_res", {"multiplier": 1}],
        ["compress_all_res", {"multiplier": 1}],
        ["compress_all_res", {"multiplier": 1}],
        ["res_x", {"num_layers": 1}],
    ],
    # 3 x compress_all (8x time, 8x space) and the 4x unpatchify give the 32x / 8x expansion.
    decoder_blocks=[
        ["res_x", {"num_layers": 1, "inject_noise": False}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["res_x", {"num_layers": 1, "inject_noise": False}],
    ],
    # 8 x 8 = 64 channels after the decoder's conv_in (1024 in the real model).
    decoder_base_channels=8,
    encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect",
)

# Three resolutions = two 2x steps: 16 latent mel bins <-> 64 mel bins.
AUDIO_VAE_CONFIG = _audio_vae(ch_mult=[1, 1, 1], num_res_blocks=1, mid_block_add_attention=True)

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

# --- The tiny LTX-2.3 ("22B" layout) checkpoint: the 2.0 sizes where the layout allows ----------------

TRANSFORMER_CONFIG_2_3 = {
    **TRANSFORMER_CONFIG,
    # The text projection lives in the text encoder (FeatureExtractorV2): Gemma's stacked hidden
    # states go straight to the video (128) and audio (64) stream widths; ltx-core accepts exactly
    # these four values and no caption projection is built in the transformer.
    "caption_proj_before_connector": True,
    "caption_projection_first_linear": False,
    "caption_proj_input_norm": False,
    "caption_projection_second_linear": False,
    # So the connectors run at the stream widths: video 4 x 32 = 128, audio 4 x 16 = 64.
    "connector_num_attention_heads": 4,
    "connector_attention_head_dim": 32,
    "audio_connector_num_attention_heads": 4,
    "audio_connector_attention_head_dim": 16,
    "audio_connector_num_layers": 1,
    "apply_gated_attention": True,
    "connector_apply_gated_attention": True,
    "cross_attention_adaln": True,
}

def _vocoder_with_bandwidth_extension(vocoder: dict, bwe: dict) -> dict:
    """A 2.3 ``vocoder`` section at the given generator sizes: BigVGAN v2 (AMP1 blocks, snakebeta, no final
    tanh or bias) makes 16 kHz stereo from the 16 kHz / hop 160 mel frames; the bandwidth extension
    re-analyses that waveform (hop 80, 512-point STFT, 64 mel bins) and a second generator adds the
    band up to 48 kHz, so its upsampling must multiply to 80 x 48 / 16 = 240."""
    bigvgan = {"resblock": "AMP1", "activation": "snakebeta", "stereo": True, "use_tanh_at_final": False, "use_bias_at_final": False}
    resampling = {"input_sampling_rate": 16000, "output_sampling_rate": 48000, "hop_length": 80, "n_fft": 512, "num_mels": 64}
    return {"vocoder": {**bigvgan, **vocoder}, "bwe": {**bigvgan, **bwe, "apply_final_activation": False, **resampling}}


VOCODER_CONFIG_2_3 = _vocoder_with_bandwidth_extension(
    # 5 * 4 * 2 * 2 * 2 = 160 samples per mel frame; 6 * 5 * 2 * 2 * 2 = 240.
    {"resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]], "upsample_rates": [5, 4, 2, 2, 2], "upsample_kernel_sizes": [11, 8, 4, 4, 4], "upsample_initial_channel": 64},
    {"resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]], "upsample_rates": [6, 5, 2, 2, 2], "upsample_kernel_sizes": [12, 11, 4, 4, 4], "upsample_initial_channel": 32},
)  # fmt: skip

# The 2.3 decoder is not timestep-conditioned (it adds no noise before decoding).
VIDEO_VAE_CONFIG_2_3 = {**VIDEO_VAE_CONFIG, "timestep_conditioning": False}

CHECKPOINT_CONFIG_2_3 = {
    "transformer": TRANSFORMER_CONFIG_2_3,
    "vae": VIDEO_VAE_CONFIG_2_3,
    "audio_vae": AUDIO_VAE_CONFIG,
    "vocoder": VOCODER_CONFIG_2_3,
}

# --- Full-size configuration (docs/full-size-config.md says where each number comes from) ---------

FULL_SIZE_VIDEO_VAE_CONFIG = _video_vae(
    # ComfyUI's VideoVAE.guess_config(version=2) (comfy/ldm/lightricks/vae/causal_video_autoencoder.py),
    # the encoder of the 1024-channel decoder family below; ltx-core has no default block list.
    encoder_blocks=[
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
    # Same source.
    decoder_blocks=[
        ["res_x", {"num_layers": 5, "inject_noise": False}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["res_x", {"num_layers": 5, "inject_noise": False}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["res_x", {"num_layers": 5, "inject_noise": False}],
        ["compress_all", {"residual": True, "multiplier": 2}],
        ["res_x", {"num_layers": 5, "inject_noise": False}],
    ],
    decoder_base_channels=128,
)

FULL_SIZE_AUDIO_VAE_CONFIG = _audio_vae(ch_mult=[1, 2, 4], num_res_blocks=2, mid_block_add_attention=False)

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

# LTX-2.3's video VAE and vocoder (the audio VAE and the upsampler's shapes are 2.0's): the checkpoint
# metadata as reported by third-party readers of ltx-2.3-22b-dev (docs/full-size-config.md).
def _interleaved(res_layers: list[int], compressions: list[tuple[str, int]]) -> list:
    """A VAE block list: res_x stages of ``res_layers`` layers with the (block, multiplier) compressions between."""
    blocks: list = [["res_x", {"num_layers": res_layers[0]}]]
    for layers, (block, multiplier) in zip(res_layers[1:], compressions, strict=True):
        blocks += [[block, {"multiplier": multiplier}], ["res_x", {"num_layers": layers}]]
    return blocks


FULL_SIZE_VIDEO_VAE_CONFIG_2_3 = {
    **_video_vae(
        _interleaved([4, 6, 4, 2, 2], [("compress_space_res", 2), ("compress_time_res", 2), ("compress_all_res", 2), ("compress_all_res", 1)]),
        _interleaved([4, 6, 4, 2, 2], [("compress_space", 2), ("compress_time", 2), ("compress_all", 1), ("compress_all", 2)]),
        decoder_base_channels=128,
        spatial_padding_mode="zeros",
    ),
    "timestep_conditioning": False,
}  # fmt: skip

_BIGVGAN_BLOCKS = {"resblock_kernel_sizes": [3, 7, 11], "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]]}
FULL_SIZE_VOCODER_CONFIG_2_3 = _vocoder_with_bandwidth_extension(
    {**_BIGVGAN_BLOCKS, "upsample_rates": [5, 2, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 4, 4, 4, 4, 4], "upsample_initial_channel": 1536},
    {**_BIGVGAN_BLOCKS, "upsample_rates": [6, 5, 2, 2, 2], "upsample_kernel_sizes": [12, 11, 4, 4, 4], "upsample_initial_channel": 512},
)  # fmt: skip

FULL_SIZE_LORA_RANK = 384
"""The rank of the official distilled LoRAs (ltx-2-19b-distilled-lora-384, ltx-2.3-22b-distilled-lora-384-1.1)."""

DEFAULT_GEMMA_LAYERS = 6
GEMMA_FULL_LAYERS = 48

OFFICIAL_TRANSFORMER_METADATA = {"causal_temporal_positioning": True}
"""Transformer metadata of the official checkpoints that ltx-core 1.0.0 does not read (it always places
the first latent frame causally, at pixel frame 0 alone) but ComfyUI's LTX-2 does: without it ComfyUI
spans that frame over 8 pixel frames and its video RoPE differs. Full-size bundles carry it; the tiny
bundles predate it and keep their pinned bytes."""


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




def model_version(checkpoint: dict) -> str:
    """The ``model_version`` metadata of a checkpoint with this ``config``: "2.3.0" for the 22B layout
    (ltx-pipelines then picks its LTX-2.3 defaults: 30 steps, STG block 28), "2.0.0" for the 19B one."""
    return "2.3.0" if checkpoint["transformer"].get("caption_proj_before_connector") else "2.0.0"


def tiny_config(version: str = "2.0") -> BundleConfig:
    """The tiny bundle's configuration for LTX-``version`` (one of ``VERSIONS``)."""
    checkpoint = {"2.0": CHECKPOINT_CONFIG, "2.3": CHECKPOINT_CONFIG_2_3}.get(version)
    if checkpoint is None:
        raise ValueError(f"no tiny LTX-2 bundle for version {version!r}; choose one of {', '.join(VERSIONS)}")
    return BundleConfig(copy.deepcopy(checkpoint), copy.deepcopy(SPATIAL_UPSAMPLER_CONFIG), copy.deepcopy(GEMMA_CONFIG), LORA_RANK)


def full_size_config(
    transformer: dict, gemma_layers: int = DEFAULT_GEMMA_LAYERS, lora_rank: int = FULL_SIZE_LORA_RANK
) -> BundleConfig:
    """The LTX-2 19B or LTX-2.3 22B bundle: ``transformer`` is the ``transformer`` section of
    configs/ltx2-19b-transformer.json or configs/ltx2.3-22b-transformer.json (its layout picks the
    version's video VAE and vocoder); Gemma is the 12B model's configuration (ltx-core's
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
            f"hidden size is {GEMMA3_CONFIG_FOR_LTX.text_config.hidden_size}; use configs/ltx2-19b-transformer.json or configs/ltx2.3-22b-transformer.json"
        )
    gemma = GEMMA3_CONFIG_FOR_LTX.to_dict()
    gemma["text_config"]["num_hidden_layers"] = gemma_layers
    gemma["text_config"]["torch_dtype"] = gemma["vision_config"]["torch_dtype"] = "bfloat16"
    is_2_3 = model_version({"transformer": transformer}).startswith("2.3")
    checkpoint = {
        "transformer": {**copy.deepcopy(transformer), **OFFICIAL_TRANSFORMER_METADATA},
        "vae": copy.deepcopy(FULL_SIZE_VIDEO_VAE_CONFIG_2_3 if is_2_3 else FULL_SIZE_VIDEO_VAE_CONFIG),
        "audio_vae": copy.deepcopy(FULL_SIZE_AUDIO_VAE_CONFIG),
        "vocoder": copy.deepcopy(FULL_SIZE_VOCODER_CONFIG_2_3 if is_2_3 else FULL_SIZE_VOCODER_CONFIG),
    }
    return BundleConfig(checkpoint, copy.deepcopy(FULL_SIZE_SPATIAL_UPSAMPLER_CONFIG), gemma, lora_rank)
