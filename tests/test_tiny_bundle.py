"""The embedded tiny LTX-2 bundle: deterministic, in the official layouts, read by ltx-core unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec


def _hashes(root: str) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(Path(root).rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tiny.TinyBundle:
    return tiny.make_tiny_bundle(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def loader(bundle) -> ModelLoader:
    spec = ModelSpec(
        bundle.checkpoint_path, bundle.gemma_root, bundle.spatial_upsampler_path, bundle.distilled_lora_path
    )
    return ModelLoader(spec, "cpu", torch.float32)


def test_two_makes_give_identical_bytes(bundle, tmp_path):
    started = time.perf_counter()
    second = tiny.make_tiny_bundle(tmp_path / "again")
    assert time.perf_counter() - started < 10
    assert _hashes(bundle.root) == _hashes(second.root)
    assert len(_hashes(bundle.root)) == 14  # 3 model files, 10 Gemma files, the manifest


def test_make_reuses_a_complete_bundle_and_repairs_a_damaged_one(tmp_path):
    first = tiny.make_tiny_bundle(tmp_path)
    checkpoint = Path(first.checkpoint_path)
    written_at = checkpoint.stat().st_mtime_ns
    assert tiny.make_tiny_bundle(tmp_path) == first
    assert checkpoint.stat().st_mtime_ns == written_at

    tokenizer = Path(first.gemma_root) / "tokenizer.json"
    tokenizer.write_text("{}")
    tiny.make_tiny_bundle(tmp_path)
    assert json.loads(tokenizer.read_text()) != {}


def test_default_bundle_is_made_once_in_the_cache_even_by_concurrent_callers(tmp_path, monkeypatch):
    monkeypatch.setenv("MGPU_CACHE_DIR", str(tmp_path))
    with ThreadPoolExecutor(max_workers=3) as pool:
        bundles = list(pool.map(lambda _: tiny.default_tiny_bundle(), range(3)))
    assert len(set(bundles)) == 1
    assert Path(bundles[0].root) == tmp_path / f"tiny-ltx2-v{tiny.BUNDLE_VERSION}"
    # Nothing left behind but the bundle itself (staging folders are removed).
    assert [p.name for p in tmp_path.iterdir()] == [f"tiny-ltx2-v{tiny.BUNDLE_VERSION}"]
    assert ModelSpec.tiny().checkpoint_path == bundles[0].checkpoint_path


def test_checkpoint_carries_the_metadata_ltx_core_reads(bundle):
    with safe_open(bundle.checkpoint_path, framework="pt") as f:
        metadata = f.metadata()
    config = json.loads(metadata["config"])
    assert set(config) == {"transformer", "vae", "audio_vae", "vocoder"}
    assert not metadata["model_version"].startswith("2.3")
    with safe_open(bundle.spatial_upsampler_path, framework="pt") as f:
        assert json.loads(f.metadata()["config"])["in_channels"] == 128


def test_video_and_audio_head_counts_divide_every_sp_degree(loader):
    config = tiny.TRANSFORMER_CONFIG
    model = loader.transformer().velocity_model
    block = model.transformer_blocks[0]
    for degree in (1, 2, 4, 8):
        assert config["num_attention_heads"] % degree == 0
        assert config["audio_num_attention_heads"] % degree == 0
        assert block.attn1.heads % degree == 0 and block.audio_attn1.heads % degree == 0
    assert model.inner_dim == 8 * 16 and model.audio_inner_dim == 8 * 8


def test_every_checkpoint_tensor_lands_in_exactly_the_components_that_read_it(bundle):
    """The official key layout: each ltx-core component finds all of its weights, and no key is stray."""
    from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
    from ltx_core.model.audio_vae import (
        AUDIO_VAE_DECODER_COMFY_KEYS_FILTER,
        AUDIO_VAE_ENCODER_COMFY_KEYS_FILTER,
        VOCODER_COMFY_KEYS_FILTER,
        AudioDecoderConfigurator,
        AudioEncoderConfigurator,
        VocoderConfigurator,
    )
    from ltx_core.model.transformer import LTXV_MODEL_COMFY_RENAMING_MAP, LTXModelConfigurator
    from ltx_core.model.video_vae import (
        VAE_DECODER_COMFY_KEYS_FILTER,
        VAE_ENCODER_COMFY_KEYS_FILTER,
        VideoDecoderConfigurator,
        VideoEncoderConfigurator,
    )

    with safe_open(bundle.checkpoint_path, framework="pt") as f:
        keys = set(f.keys())
    components = [
        (LTXModelConfigurator, LTXV_MODEL_COMFY_RENAMING_MAP),
        (VideoEncoderConfigurator, VAE_ENCODER_COMFY_KEYS_FILTER),
        (VideoDecoderConfigurator, VAE_DECODER_COMFY_KEYS_FILTER),
        (AudioEncoderConfigurator, AUDIO_VAE_ENCODER_COMFY_KEYS_FILTER),
        (AudioDecoderConfigurator, AUDIO_VAE_DECODER_COMFY_KEYS_FILTER),
        (VocoderConfigurator, VOCODER_COMFY_KEYS_FILTER),
    ]
    used = set()
    for configurator, sd_ops in components:
        builder = SingleGPUModelBuilder(model_path=bundle.checkpoint_path, model_class_configurator=configurator)
        expected = set(builder.meta_model(builder.model_config(), ()).state_dict())
        provided = {}
        for key in keys:
            renamed = sd_ops.apply_to_key(key)
            if renamed is not None:
                for result in sd_ops.apply_to_key_value(renamed, torch.empty(0)):
                    provided[result.new_key] = key
        assert expected <= set(provided), (configurator.__name__, sorted(expected - set(provided))[:5])
        used |= {provided[k] for k in expected}
    text_keys = {
        k
        for k in keys
        if k.startswith(
            ("text_embedding_projection.", "model.diffusion_model.video_emb", "model.diffusion_model.audio_emb")
        )
    }
    assert keys - used == text_keys


def test_video_vae_keeps_32x_spatial_and_8x_temporal_compression_with_128_channels(loader):
    encoder, decoder = loader.video_encoder(), loader.video_decoder()
    video = torch.rand(1, 3, 17, 64, 96) * 2 - 1
    with torch.inference_mode():
        latent = encoder(video)
        decoded = decoder(latent, generator=torch.Generator().manual_seed(0))
    assert latent.shape == (1, 128, 3, 2, 3)
    assert decoded.shape == video.shape
    assert torch.isfinite(decoded).all()


def test_audio_latent_is_8_channels_by_16_mel_bins_and_decodes_to_24khz_stereo(loader):
    assert tiny.TRANSFORMER_CONFIG["audio_in_channels"] == 8 * 16
    decoder, vocoder = loader.audio_decoder(), loader.vocoder()
    latent = torch.randn(1, 8, 25, 16)  # 25 latent frames = 1 s at 25 latent frames/s
    with torch.inference_mode():
        mel = decoder(latent)
        waveform = vocoder(mel)
    assert mel.shape == (1, 2, 4 * 25 - 3, 64)
    assert waveform.shape == (1, 2, (4 * 25 - 3) * 240)
    assert vocoder.output_sampling_rate == 24000
    assert torch.isfinite(waveform).all() and waveform.abs().max() <= 1


def test_spatial_upsampler_doubles_height_and_width(loader):
    latent = torch.randn(1, 128, 2, 3, 4)
    with torch.inference_mode():
        upsampled = loader.spatial_upsampler()(latent)
    assert upsampled.shape == (1, 128, 2, 6, 8)


def test_fast_tokenizer_matches_the_sentencepiece_model(bundle):
    import sentencepiece
    from transformers import AutoTokenizer

    processor = sentencepiece.SentencePieceProcessor(model_file=os.path.join(bundle.gemma_root, "tokenizer.model"))
    fast = AutoTokenizer.from_pretrained(bundle.gemma_root, local_files_only=True)
    texts = tiny._TOKENIZER_CORPUS.splitlines() + ["Überraschung: a zebra in 3D 🦓!", "  two  spaces  "]
    for text in texts:
        assert fast(text, add_special_tokens=False).input_ids == processor.encode(text), text
    assert fast("a cat").input_ids[0] == fast.bos_token_id == 2
    assert fast.convert_tokens_to_ids("<image_soft_token>") == tiny.GEMMA_CONFIG["image_token_index"]
    assert fast.decode(fast("A fox in the snow.", add_special_tokens=False).input_ids) == "A fox in the snow."
