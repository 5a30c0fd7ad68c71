"""The tiny LTX-2 bundles (2.0, and 2.3 in the 22B layout): deterministic, in the official layouts, read by
ltx-core and ltx-pipelines unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mgpu_backend.bundles import full_size, gemma_folder, tiny
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from tests.official_reference import needs_ltx_core_gemma


def _hashes(root: str) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(Path(root).rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def loader(bundle) -> ModelLoader:
    spec = ModelSpec(
        bundle.checkpoint_path, bundle.gemma_root, bundle.spatial_upsampler_path, bundle.distilled_lora_path
    )
    return ModelLoader(spec, "cpu", torch.float32)


@pytest.fixture(scope="module")
def bundle_2_3(tiny_bundle_of) -> tiny.TinyBundle:
    return tiny_bundle_of("2.3")


# sha256 of the files of the first tiny bundles (format 1), as the first writer wrote them: caches and
# bundles already on disk stay valid only while these bytes stay the same.
FIRST_TINY_BUNDLE_SHA256 = {
    "gemma-3-tiny/config.json": "795acf2df45445e41e4cb5ff4d9a5c0740c2b125d3c53e9ddd1b772f6df2e030",
    "gemma-3-tiny/generation_config.json": "e59afad6d6be2ba06b3f77ccc9f2be21552329c5afef9ba0c7e0155b815b6029",
    "gemma-3-tiny/model-00001-of-00001.safetensors": "62c1fa95e7ba31165832f9cd06f33a2cd7db05d7820e7f7bb2fa8be859f273b0",
    "gemma-3-tiny/model.safetensors.index.json": "16b026e2b440c289d20407d42d739cfe2dc9111976e8a404efb0894603a0bc4e",
    "gemma-3-tiny/preprocessor_config.json": "f9a428a1e2b8d3254161df0a7d1c4ed3f2ab3c9cf5556fc16c4bbcd9ce44ff0e",
    "gemma-3-tiny/processor_config.json": "2262458bd86a597e38d99893ddee69c27e329b90ab20faeb5b790a12de7ea315",
    "gemma-3-tiny/special_tokens_map.json": "22b18945aa403a32492c406afe5843f9462d147854195029f6aa80406c206604",
    "gemma-3-tiny/tokenizer.json": "6a949cc75378dc4086e92779925cc226e6cc22e090ca72f596345f060cf67b6d",
    "gemma-3-tiny/tokenizer.model": "eb9483bb024993edfb8cf86f72e5dde04d5b11e16f18211e29438d614684e75b",
    "gemma-3-tiny/tokenizer_config.json": "4d8f65120968b6c93a76c3b59fdd294e13ea6af1228b01f3296d1403fd3e12e2",
    "ltx-2-tiny-distilled-lora.safetensors": "d6d7f427bf1afd37394177318707c716b04ee1be1c177cb6159ef49be6d00314",
    "ltx-2-tiny-spatial-upscaler-x2.safetensors": "717c668185a7c887f233ed8ec1396faad6b519f5bcc388319b9c3144ec32acff",
    "ltx-2-tiny.safetensors": "402a173ac96d50ab74caf61e5af5585a32998333b765f37c35031eea9a5d6ed4",
}


def test_two_makes_give_identical_bytes(bundle, tmp_path):
    second = tiny.make_tiny_bundle(tmp_path / "again")
    assert _hashes(bundle.root) == _hashes(second.root)
    assert len(_hashes(bundle.root)) == 15  # 4 model files, 10 Gemma files, the manifest


def test_2_0_files_keep_the_bytes_of_the_first_tiny_bundles(bundle):
    hashes = _hashes(bundle.root)
    changed = sorted(name for name, digest in FIRST_TINY_BUNDLE_SHA256.items() if hashes.get(name) != digest)
    assert not changed, f"the writer changed the bytes of {changed}: bump tiny.BUNDLE_VERSION if that is meant"
    added = sorted(set(hashes) - set(FIRST_TINY_BUNDLE_SHA256))
    assert added == ["ltx-2-tiny-distilled.safetensors", "tiny-bundle.json"], added


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_manifest_names_every_file_by_role_relative_to_the_bundle(version, bundle, bundle_2_3):
    made = {"2.0": bundle, "2.3": bundle_2_3}[version]
    manifest = json.loads((Path(made.root) / "tiny-bundle.json").read_text())
    roles = {role: manifest[role] for role in tiny.ROLES}
    stem = "ltx-2-tiny" if version == "2.0" else "ltx-2.3-tiny"
    assert roles == {
        "checkpoint": f"{stem}.safetensors",
        "distilled_checkpoint": f"{stem}-distilled.safetensors",
        "distilled_lora": f"{stem}-distilled-lora.safetensors",
        "spatial_upsampler": f"{stem}-spatial-upscaler-x2.safetensors",
        "gemma_root": "gemma-3-tiny",
    }
    assert manifest["model_version"] == version
    paths = (made.checkpoint_path, made.distilled_checkpoint_path, made.distilled_lora_path, made.spatial_upsampler_path, made.gemma_root)
    assert [str(Path(made.root) / name) for name in roles.values()] == list(paths)
    assert all(Path(path).exists() for path in paths)
    # The distilled checkpoint: the dev checkpoint's keys, shapes and config, other weights.
    with safe_open(made.checkpoint_path, framework="pt") as dev, safe_open(made.distilled_checkpoint_path, framework="pt") as distilled:
        assert set(dev.keys()) == set(distilled.keys()) and dev.metadata() == distilled.metadata()
        key = "model.diffusion_model.transformer_blocks.0.attn1.to_q.weight"
        assert dev.get_tensor(key).shape == distilled.get_tensor(key).shape
        assert (dev.get_tensor(key).float() - distilled.get_tensor(key).float()).abs().max() > 0.1


def test_make_tiny_command_writes_the_2_3_bundle_the_library_writes(bundle_2_3, tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "mgpu_backend", "make-tiny", str(tmp_path / "cli"), "--version", "2.3"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    assert completed.returncode == 0, completed.stderr
    assert "tiny LTX-2.3 bundle" in completed.stdout and "ltx-2.3-tiny-distilled.safetensors" in completed.stdout
    assert _hashes(str(tmp_path / "cli")) == _hashes(bundle_2_3.root)


def test_an_unknown_version_is_refused_with_the_versions_there_are(tmp_path):
    with pytest.raises(ValueError, match=r"no tiny LTX-2 bundle for version '2\.1'; choose one of 2\.0, 2\.3"):
        tiny.make_tiny_bundle(tmp_path, version="2.1")


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
    assert tiny.default_tiny_bundle().spec().checkpoint_path == bundles[0].checkpoint_path


def test_checkpoint_carries_the_metadata_ltx_core_reads(bundle):
    with safe_open(bundle.checkpoint_path, framework="pt") as f:
        metadata = f.metadata()
    config = json.loads(metadata["config"])
    assert set(config) == {"transformer", "vae", "audio_vae", "vocoder"}
    with safe_open(bundle.spatial_upsampler_path, framework="pt") as f:
        assert json.loads(f.metadata()["config"])["in_channels"] == 128


def test_ltx_pipelines_detects_2_3_in_the_2_3_bundle_and_2_0_in_the_2_0_bundle(bundle, bundle_2_3):
    from ltx_pipelines.utils.constants import (
        LTX_2_3_PARAMS,
        LTX_2_PARAMS,
        detect_params,
    )

    for path in (bundle_2_3.checkpoint_path, bundle_2_3.distilled_checkpoint_path):
        params = detect_params(path)
        assert params == LTX_2_3_PARAMS, path
        assert params.num_inference_steps == 30 and params.video_guider_params.stg_blocks == [28]
    for path in (bundle.checkpoint_path, bundle.distilled_checkpoint_path):
        assert detect_params(path) == LTX_2_PARAMS, path


def test_video_and_audio_head_counts_divide_every_sp_degree(loader):
    config = tiny.TRANSFORMER_CONFIG
    model = loader.transformer().velocity_model
    block = model.transformer_blocks[0]
    for degree in (1, 2, 4, 8):
        assert config["num_attention_heads"] % degree == 0
        assert config["audio_num_attention_heads"] % degree == 0
        assert block.attn1.heads % degree == 0 and block.audio_attn1.heads % degree == 0
    assert model.inner_dim == 8 * 16 and model.audio_inner_dim == 8 * 8


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_every_checkpoint_tensor_lands_in_exactly_the_components_that_read_it(version, request):
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
    from ltx_core.model.transformer import (
        LTXV_MODEL_COMFY_RENAMING_MAP,
        LTXModelConfigurator,
    )
    from ltx_core.model.video_vae import (
        VAE_DECODER_COMFY_KEYS_FILTER,
        VAE_ENCODER_COMFY_KEYS_FILTER,
        VideoDecoderConfigurator,
        VideoEncoderConfigurator,
    )

    bundle = request.getfixturevalue({"2.0": "bundle", "2.3": "bundle_2_3"}[version])
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
    texts = gemma_folder.TOKENIZER_CORPUS.splitlines() + ["Überraschung: a zebra in 3D 🦓!", "  two  spaces  "]
    for text in texts:
        assert fast(text, add_special_tokens=False).input_ids == processor.encode(text), text
    assert fast("a cat").input_ids[0] == fast.bos_token_id == 2
    assert fast.convert_tokens_to_ids("<image_soft_token>") == tiny.GEMMA_CONFIG["image_token_index"]
    assert fast.decode(fast("A fox in the snow.", add_special_tokens=False).input_ids) == "A fox in the snow."


# --- LTX-2.3 -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ledger_2_3(bundle_2_3):
    """ltx-pipelines' own ModelLedger on the tiny 2.3 bundle (ltx-core's Gemma-3 12B configuration
    replaced by the bundle's tiny one, which ltx-core 1.0.0 hard-codes)."""
    from ltx_core.text_encoders.gemma.encoders import encoder_configurator
    from ltx_pipelines.utils import ModelLedger

    gemma = json.loads((Path(bundle_2_3.gemma_root) / "config.json").read_text())
    patch = pytest.MonkeyPatch()
    patch.setattr(encoder_configurator, "GEMMA3_CONFIG_FOR_LTX", full_size.ltx_core_gemma_config(gemma))
    torch.set_num_threads(1)
    yield ModelLedger(
        dtype=torch.float32,
        device=torch.device("cpu"),
        checkpoint_path=bundle_2_3.checkpoint_path,
        gemma_root_path=bundle_2_3.gemma_root,
        spatial_upsampler_path=bundle_2_3.spatial_upsampler_path,
    )
    patch.undo()


def _file_tensor(path: str, key: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key)


@needs_ltx_core_gemma
def test_model_ledger_builds_every_2_3_component_in_the_22b_layout(ledger_2_3, bundle_2_3):
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps
    from ltx_core.model.audio_vae.vocoder import VocoderWithBWE
    from ltx_core.text_encoders.gemma.feature_extractor import FeatureExtractorV2

    model = ledger_2_3.transformer().velocity_model
    # Text projection in the text encoder, gated attention, cross-attention AdaLN.
    assert not any(key.startswith(("caption_projection.", "audio_caption_projection.")) for key in model.state_dict())
    block = model.transformer_blocks[0]
    assert block.attn1.to_gate_logits.out_features == 8 and block.audio_attn1.to_gate_logits.out_features == 8
    assert model.prompt_adaln_single is not None and model.audio_prompt_adaln_single is not None
    assert len(model.transformer_blocks) == 2  # fewer than the STG block 28 of the 22B model
    # The built weights are the file's bytes.
    key = "transformer_blocks.1.attn2.to_gate_logits.weight"
    assert torch.equal(model.state_dict()[key], _file_tensor(bundle_2_3.checkpoint_path, "model.diffusion_model." + key).float())

    processor = ledger_2_3.gemma_embeddings_processor()
    assert isinstance(processor.feature_extractor, FeatureExtractorV2)
    hidden, layers = tiny.GEMMA_TEXT_CONFIG["hidden_size"], tiny.GEMMA_TEXT_CONFIG["num_hidden_layers"]
    assert processor.feature_extractor.video_aggregate_embed.in_features == hidden * (layers + 1)
    assert processor.feature_extractor.video_aggregate_embed.out_features == 128  # the video stream width
    assert processor.feature_extractor.audio_aggregate_embed.out_features == 64  # the audio stream width
    assert processor.video_connector.inner_dim == 128 and processor.audio_connector.inner_dim == 64
    assert processor.video_connector.transformer_1d_blocks[0].attn1.to_gate_logits is not None

    gemma = ledger_2_3.text_encoder()
    assert gemma.model.config.text_config.hidden_size == hidden

    # Video: 32x spatial, 8x temporal; the 2.3 decoder is not timestep-conditioned.
    encoder, decoder = ledger_2_3.video_encoder(), ledger_2_3.video_decoder()
    video = torch.rand(1, 3, 9, 64, 64) * 2 - 1
    with torch.inference_mode():
        latent = encoder(video)
        assert latent.shape == (1, 128, 2, 2, 2)
        assert decoder(latent).shape == video.shape
        upsampled = ledger_2_3.spatial_upsampler()(latent)
    assert upsampled.shape == (1, 128, 2, 4, 4)

    # Audio: mel at 16 kHz / hop 160, BigVGAN to 16 kHz, bandwidth extension to 48 kHz stereo.
    vocoder = ledger_2_3.vocoder()
    assert isinstance(vocoder, VocoderWithBWE) and vocoder.output_sampling_rate == 48000
    assert ledger_2_3.audio_encoder() is not None
    with torch.inference_mode():
        mel = ledger_2_3.audio_decoder()(torch.randn(1, 8, 10, 16))
        waveform = vocoder(mel)
    assert mel.shape == (1, 2, 4 * 10 - 3, 64)
    assert waveform.shape == (1, 2, (4 * 10 - 3) * 160 * 3), waveform.shape
    assert torch.isfinite(waveform).all() and waveform.abs().max() <= 1

    # The distilled LoRA fuses into the 2.3 transformer, gates included.
    fused = ledger_2_3.with_additional_loras(
        (LoraPathStrengthAndSDOps(bundle_2_3.distilled_lora_path, 1.0, LTXV_LORA_COMFY_RENAMING_MAP),)
    ).transformer().velocity_model
    for name in ("transformer_blocks.0.attn1.to_gate_logits.weight", "transformer_blocks.1.ff.net.0.proj.weight"):
        assert (fused.state_dict()[name] - model.state_dict()[name]).abs().max() > 1e-3, name


def _modality(tokens: int, position_axes: int, context_width: int, generator: torch.Generator):
    from ltx_core.model.transformer import Modality

    return Modality(
        latent=torch.randn(1, tokens, 128, generator=generator),
        sigma=torch.tensor([0.7]),
        timesteps=torch.full((1, tokens, 1), 0.7),
        positions=torch.rand(1, position_axes, tokens, 2, generator=generator) * 4,
        context=torch.randn(1, 8, context_width, generator=generator),
    )


def test_2_3_transformer_forward_takes_stream_width_contexts_and_distilled_weights_differ(ledger_2_3, bundle_2_3):
    from ltx_pipelines.utils import ModelLedger

    generator = torch.Generator().manual_seed(0)
    video_tokens, audio_tokens = 12, 5
    # 22B layout: the contexts arrive already projected to the stream widths (128 video, 64 audio).
    video, audio = _modality(video_tokens, 3, 128, generator), _modality(audio_tokens, 1, 64, generator)
    distilled = ModelLedger(dtype=torch.float32, device=torch.device("cpu"), checkpoint_path=bundle_2_3.distilled_checkpoint_path)
    with torch.inference_mode():
        dev_video, dev_audio = ledger_2_3.transformer()(video=video, audio=audio, perturbations=None)
        distilled_video, _ = distilled.transformer()(video=video, audio=audio, perturbations=None)
    assert dev_video.shape == (1, video_tokens, 128) and dev_audio.shape == (1, audio_tokens, 128)
    assert torch.isfinite(dev_video).all() and torch.isfinite(dev_audio).all()
    assert dev_video.std() > 0.01
    assert (dev_video - distilled_video).abs().max() > 1e-3


def test_weights_follow_the_recipe_gemma_gains_near_0_layer_norm_gains_near_1_lora_b_small(bundle):
    """Gemma's RMSNorm applies (1 + weight), SigLIP's LayerNorm the weight itself: both then scale by about 1."""
    gemma_weights = str(Path(bundle.gemma_root) / tiny.GEMMA_WEIGHTS_NAME)
    rms_gain = _file_tensor(gemma_weights, "language_model.model.layers.0.input_layernorm.weight").float()
    layer_norm_gain = _file_tensor(gemma_weights, "vision_tower.vision_model.encoder.layers.0.layer_norm1.weight").float()
    assert rms_gain.abs().max() < 0.1 and 0.005 < rms_gain.std() < 0.04, (rms_gain.abs().max(), rms_gain.std())
    assert (layer_norm_gain - 1).abs().max() < 0.1 and 0.005 < layer_norm_gain.std() < 0.04
    lora_b = _file_tensor(bundle.distilled_lora_path, "diffusion_model.transformer_blocks.0.ff.net.2.lora_B.weight").float()
    assert 0.03 < lora_b.std() < 0.07, lora_b.std()
    scale = _file_tensor(bundle.checkpoint_path, "vae.decoder.timestep_scale_multiplier").float()
    assert scale.item() == 1000.0
    registers = _file_tensor(bundle.checkpoint_path, "model.diffusion_model.video_embeddings_connector.learnable_registers").float()
    assert -1 <= registers.min() < -0.9 and 0.9 < registers.max() <= 1
