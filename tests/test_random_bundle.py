"""Random-weight bundles at a given configuration: official layouts, loadable by ltx-core's ModelLedger
and our ModelLoader, deterministic per seed, and the full-size plan within the benchmark machine's disk."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mgpu_backend.bundles import full_size as random_bundle
from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.loading import ModelLoader, validate_model_files
from tests.helpers import PromptEncoder

REPO = Path(__file__).resolve().parent.parent


def _hashes(root: str) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(Path(root).rglob("*"))
        if path.is_file()
    }


def _layout(path: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """key -> (dtype, shape) of a safetensors file, and its metadata."""
    with safe_open(path, framework="pt") as f:
        return {key: (str(f.get_slice(key).get_dtype()), tuple(f.get_slice(key).get_shape())) for key in f.keys()}, f.metadata()


def _file_tensor(path: str, key: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key)


def _small_config() -> random_bundle.BundleConfig:
    """The tiny configuration with a 3-layer Gemma (so the feature projection has another width
    than the tiny bundle's) and a rank-8 LoRA."""
    config = random_bundle.tiny_config()
    gemma = copy.deepcopy(config.gemma)
    gemma["text_config"]["num_hidden_layers"] = 3
    return random_bundle.BundleConfig(config.checkpoint, config.spatial_upsampler, gemma, lora_rank=8)


@pytest.fixture(scope="module")
def tiny_layout_bundle(tmp_path_factory) -> random_bundle.RandomBundle:
    return random_bundle.write_bundle(tmp_path_factory.mktemp("random-tiny"), random_bundle.tiny_config(), "cpu", seed=1)


@pytest.fixture(scope="module")
def small_bundle(tmp_path_factory) -> random_bundle.RandomBundle:
    return random_bundle.write_bundle(tmp_path_factory.mktemp("random-small"), _small_config(), "cpu", seed=3)


def test_tiny_configuration_writes_the_tiny_bundles_keys_shapes_and_configs(tiny_layout_bundle, tmp_path):
    reference = tiny.make_tiny_bundle(tmp_path / "tiny")
    files = (
        ("checkpoint", tiny_layout_bundle.checkpoint_path, reference.checkpoint_path),
        ("distilled LoRA", tiny_layout_bundle.distilled_lora_path, reference.distilled_lora_path),
        ("spatial upsampler", tiny_layout_bundle.spatial_upsampler_path, reference.spatial_upsampler_path),
        (
            "Gemma weights",
            str(Path(tiny_layout_bundle.gemma_root) / tiny.GEMMA_WEIGHTS_NAME),
            str(Path(reference.gemma_root) / tiny.GEMMA_WEIGHTS_NAME),
        ),
    )
    for what, ours_path, reference_path in files:
        (ours, our_metadata), (expected, expected_metadata) = _layout(ours_path), _layout(reference_path)
        assert ours.keys() == expected.keys(), (
            f"{what}: {len(ours.keys() - expected.keys())} extra keys {sorted(ours.keys() - expected.keys())[:3]}, "
            f"{len(expected.keys() - ours.keys())} missing {sorted(expected.keys() - ours.keys())[:3]}"
        )
        wrong = [key for key in ours if ours[key] != expected[key]]
        assert not wrong, f"{what}: {len(wrong)} tensors of other dtype/shape, e.g. {wrong[0]}: {ours[wrong[0]]} vs {expected[wrong[0]]}"
        assert our_metadata.get("config") == expected_metadata.get("config"), what
    assert _layout(tiny_layout_bundle.checkpoint_path)[1]["model_version"] == "2.0.0"
    # Every file of the Gemma folder but the weights is byte-identical to the tiny bundle's.
    ours, expected = _hashes(tiny_layout_bundle.gemma_root), _hashes(reference.gemma_root)
    assert ours.keys() == expected.keys()
    differing = sorted(name for name in ours if ours[name] != expected[name])
    assert differing == [tiny.GEMMA_WEIGHTS_NAME], differing


def test_same_seed_gives_identical_bytes_and_another_seed_other_weights(tiny_layout_bundle, tmp_path):
    again = random_bundle.write_bundle(tmp_path / "again", random_bundle.tiny_config(), "cpu", seed=1)
    first_hashes = _hashes(tiny_layout_bundle.root)
    assert first_hashes == _hashes(again.root)

    other = random_bundle.write_bundle(tmp_path / "other", random_bundle.tiny_config(), "cpu", seed=2)
    other_hashes = _hashes(other.root)
    differing = sorted(name for name in first_hashes if first_hashes[name] != other_hashes[name])
    weight_files = [
        random_bundle.CHECKPOINT_NAME,
        random_bundle.DISTILLED_LORA_NAME,
        random_bundle.SPATIAL_UPSAMPLER_NAME,
        f"{random_bundle.GEMMA_DIR_NAME}/{tiny.GEMMA_WEIGHTS_NAME}",
    ]
    assert differing == sorted(weight_files + ["random-bundle.json"]), differing
    key = "model.diffusion_model.transformer_blocks.0.attn1.to_q.weight"
    first, second = (_file_tensor(b.checkpoint_path, key).float() for b in (tiny_layout_bundle, other))
    difference = (first - second).abs().max().item()
    assert difference > 0.1, f"seeds 1 and 2 gave nearly the same {key}: max abs diff {difference}"
    # The random-weight rules: matrices N(0, 1/fan_in), latent statistics in 0.5..1.5.
    std = first.std().item()
    assert abs(std - first.shape[1] ** -0.5) < 0.25 * first.shape[1] ** -0.5, f"{key} std {std}, fan_in {first.shape[1]}"
    stds = _file_tensor(tiny_layout_bundle.checkpoint_path, "vae.per_channel_statistics.std-of-means").float()
    assert 0.5 <= stds.min().item() and stds.max().item() <= 1.5, (stds.min().item(), stds.max().item())


def test_a_complete_bundle_is_reused_and_a_changed_seed_rewrites_it(tmp_path):
    config = random_bundle.tiny_config()
    first = random_bundle.write_bundle(tmp_path, config, "cpu", seed=5)
    checkpoint = Path(first.checkpoint_path)
    written_at = checkpoint.stat().st_mtime_ns
    assert random_bundle.write_bundle(tmp_path, config, "cpu", seed=5) == first
    assert checkpoint.stat().st_mtime_ns == written_at, "a complete bundle of the same seed was rewritten"
    before = _file_tensor(first.checkpoint_path, "model.diffusion_model.patchify_proj.weight")
    random_bundle.write_bundle(tmp_path, config, "cpu", seed=6)
    after = _file_tensor(first.checkpoint_path, "model.diffusion_model.patchify_proj.weight")
    assert not torch.equal(before, after), "another seed must rewrite the weights"
    assert not list(tmp_path.rglob("*.tmp")), "staging files were left behind"


def test_gemma_dir_keeps_gemma_elsewhere_with_the_same_bytes_and_a_complete_bundle(tiny_layout_bundle, tmp_path):
    gemma_dir = tmp_path / "elsewhere"
    bundle = random_bundle.write_bundle(tmp_path / "bundle", random_bundle.tiny_config(), "cpu", seed=1, gemma_dir=gemma_dir)
    link = Path(bundle.gemma_root)
    assert link.is_symlink() and link.resolve() == gemma_dir.resolve()
    assert (gemma_dir / tiny.GEMMA_WEIGHTS_NAME).is_file()
    files = {**_hashes(bundle.root), **{f"{random_bundle.GEMMA_DIR_NAME}/{name}": digest for name, digest in _hashes(gemma_dir).items()}}
    assert files == _hashes(tiny_layout_bundle.root), "the bytes must not depend on where Gemma lives"
    assert random_bundle.is_complete(bundle.root, random_bundle.tiny_config(), "cpu", seed=1)
    validate_model_files(bundle.spec())
    # A bundle folder whose Gemma is a real folder is not silently replaced by a link.
    with pytest.raises(FileExistsError, match="is a folder of its own"):
        random_bundle.write_bundle(tiny_layout_bundle.root, random_bundle.tiny_config(), "cpu", seed=1, gemma_dir=gemma_dir)


def test_small_bundle_loads_through_model_loader_and_model_ledger_with_the_same_weights(small_bundle, monkeypatch):
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps
    from ltx_core.text_encoders.gemma.encoders import encoder_configurator
    from ltx_pipelines.utils import ModelLedger

    torch.set_num_threads(1)
    spec = small_bundle.spec()
    loader = ModelLoader(spec, "cpu", torch.bfloat16)  # validates the files: Gemma fits the projection

    # ltx-core hard-codes Gemma-3 12B for the reference ledger's feature extractor: give it this Gemma.
    gemma = json.loads((Path(small_bundle.gemma_root) / "config.json").read_text())
    monkeypatch.setattr(encoder_configurator, "GEMMA3_CONFIG_FOR_LTX", random_bundle.ltx_core_gemma_config(gemma))
    ledger = ModelLedger(
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
        checkpoint_path=spec.checkpoint_path,
        gemma_root_path=spec.gemma_root,
        spatial_upsampler_path=spec.spatial_upsampler_path,
    )
    stage_2_ledger = ledger.with_additional_loras(
        (LoraPathStrengthAndSDOps(spec.distilled_lora, 1.0, LTXV_LORA_COMFY_RENAMING_MAP),)
    )
    pairs = (
        ("stage-1 transformer", loader.transformer("none"), ledger.transformer()),
        ("stage-2 transformer", loader.transformer("distilled"), stage_2_ledger.transformer()),
        ("embeddings processor", loader.embeddings_processor(), ledger.gemma_embeddings_processor()),
        ("video decoder", loader.video_decoder(), ledger.video_decoder()),
        ("spatial upsampler", loader.spatial_upsampler(), ledger.spatial_upsampler()),
        ("vocoder", loader.vocoder(), ledger.vocoder()),
    )
    for what, ours, theirs in pairs:
        ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
        assert ours_sd.keys() == theirs_sd.keys(), what
        worst = max((ours_sd[k].float() - theirs_sd[k].float()).abs().max().item() for k in ours_sd)
        assert worst == 0.0, f"{what}: ModelLoader and ModelLedger differ by up to {worst}"

    # The loaded weights are the file's bytes, and the LoRA is laid out as A [rank, in], B [out, rank].
    layer = "transformer_blocks.1.ff.net.0.proj"
    base = _file_tensor(spec.checkpoint_path, f"model.diffusion_model.{layer}.weight")
    lora_a = _file_tensor(spec.distilled_lora, f"diffusion_model.{layer}.lora_A.weight")
    lora_b = _file_tensor(spec.distilled_lora, f"diffusion_model.{layer}.lora_B.weight")
    assert lora_a.shape == (8, base.shape[1]) and lora_b.shape == (base.shape[0], 8), (lora_a.shape, lora_b.shape)
    clean = pairs[0][1].velocity_model.state_dict()[f"{layer}.weight"]
    fused = pairs[1][1].velocity_model.state_dict()[f"{layer}.weight"]
    assert torch.equal(clean, base)
    expected = base.float() + lora_b.float() @ lora_a.float()
    difference = (fused.float() - expected).abs().max().item()
    assert difference < 0.02 * expected.abs().max().item(), f"fused LoRA differs from W + B @ A by {difference}"
    assert (fused.float() - base.float()).abs().max().item() > 0.01, "the LoRA changed nothing"

    # The feature projection reads hidden x (layers + 1) features of THIS Gemma, and the prompt
    # encoder turns a prompt into [1, 1024, hidden] contexts through it.
    hidden = gemma["text_config"]["hidden_size"]
    assert pairs[2][1].feature_extractor.aggregate_embed.in_features == hidden * (3 + 1)
    (context,) = PromptEncoder(loader.gemma(), loader.embeddings_processor()).encode(["a red fox runs through fresh snow"])
    assert tuple(context.video_encoding.shape) == (1, 1024, hidden), context.video_encoding.shape
    assert torch.isfinite(context.video_encoding.float()).all() and context.video_encoding.float().std() > 0.01


def test_full_size_plan_is_the_19b_model_and_fits_the_benchmark_disk():
    transformer = json.loads((REPO / "configs" / "ltx2-19b-transformer.json").read_text())["transformer"]
    config = random_bundle.full_size_config(transformer, gemma_layers=6)
    sizes = random_bundle.planned_bytes(config)
    gemma_weights = f"{random_bundle.GEMMA_DIR_NAME}/{tiny.GEMMA_WEIGHTS_NAME}"
    total = sum(sizes.values())
    # 18.88 B transformer parameters (docs/full-size-config.md) = 37.8 GB of the checkpoint's 42.1 GB.
    assert 41.5e9 < sizes[random_bundle.CHECKPOINT_NAME] < 42.5e9, sizes
    # Rank 384 on every linear of the 48 blocks: 3.7 B parameters.
    assert 7.0e9 < sizes[random_bundle.DISTILLED_LORA_NAME] < 7.8e9, sizes
    # Gemma-3 12B: 1.0 B embeddings, 6 layers of 0.23 B, 0.4 B vision tower.
    assert 5.0e9 < sizes[gemma_weights] < 6.0e9, sizes
    assert total < 0.9 * 64 * 2**30, f"full-size bundle {total / 1e9:.1f} GB does not fit a 64 GiB disk with room to spare"
    assert config.gemma["text_config"]["hidden_size"] == 3840 and config.gemma_layers == 6
    # What a reference ltx-pipelines run patches into ltx-core for this Gemma.
    patched = random_bundle.ltx_core_gemma_config(config.gemma)
    assert (patched.text_config.hidden_size, patched.text_config.num_hidden_layers) == (3840, 6)
    assert patched.to_dict()["vision_config"] == config.gemma["vision_config"]
    with pytest.raises(ValueError, match="gemma_layers must be 1 to 48"):
        random_bundle.full_size_config(transformer, gemma_layers=0)


# --- LTX-2.3 (22B layout) ------------------------------------------------------------------------------


def test_2_3_configuration_writes_the_22b_layout_that_model_ledger_builds(tmp_path, monkeypatch):
    from ltx_core.model.audio_vae.vocoder import VocoderWithBWE
    from ltx_core.text_encoders.gemma.encoders import encoder_configurator
    from ltx_core.text_encoders.gemma.feature_extractor import FeatureExtractorV2
    from ltx_pipelines.utils import ModelLedger
    from ltx_pipelines.utils.constants import LTX_2_3_PARAMS, detect_params

    torch.set_num_threads(1)
    config = random_bundle.tiny_config("2.3")
    bundle = random_bundle.write_bundle(tmp_path / "random-2.3", config, "cpu", seed=4)
    reference = tiny.make_tiny_bundle(tmp_path / "tiny-2.3", version="2.3")
    # The same keys and shapes as the tiny 2.3 bundle (the other writer's entry point), other weights.
    (ours, metadata), (expected, _) = _layout(bundle.checkpoint_path), _layout(reference.checkpoint_path)
    assert ours == expected
    assert metadata["model_version"] == "2.3.0" and detect_params(bundle.checkpoint_path) == LTX_2_3_PARAMS
    assert any(key.endswith("attn1.to_gate_logits.weight") for key in ours)
    assert "text_embedding_projection.video_aggregate_embed.weight" in ours and "text_embedding_projection.aggregate_embed.weight" not in ours

    gemma = json.loads((Path(bundle.gemma_root) / "config.json").read_text())
    monkeypatch.setattr(encoder_configurator, "GEMMA3_CONFIG_FOR_LTX", random_bundle.ltx_core_gemma_config(gemma))
    ledger = ModelLedger(dtype=torch.bfloat16, device=torch.device("cpu"), checkpoint_path=bundle.checkpoint_path, gemma_root_path=bundle.gemma_root)
    transformer = ledger.transformer().velocity_model
    key = "transformer_blocks.0.audio_attn2.to_gate_logits.weight"
    assert torch.equal(transformer.state_dict()[key], _file_tensor(bundle.checkpoint_path, "model.diffusion_model." + key))
    assert isinstance(ledger.gemma_embeddings_processor().feature_extractor, FeatureExtractorV2)
    assert isinstance(ledger.vocoder(), VocoderWithBWE)


def test_full_size_2_3_plan_is_the_22b_model_and_fits_the_benchmark_disk():
    transformer = json.loads((REPO / "configs" / "ltx2.3-22b-transformer.json").read_text())["transformer"]
    config = random_bundle.full_size_config(transformer, gemma_layers=6)
    assert config.checkpoint["vocoder"]["bwe"]["output_sampling_rate"] == 48000
    assert config.checkpoint["vae"]["timestep_conditioning"] is False
    sizes = random_bundle.planned_bytes(config)
    # 18.99 B transformer parameters + 2.18 B text projection and 8-layer connectors + 0.9 B VAEs and
    # vocoder (docs/full-size-config.md): 22.1 B, 44.2 GB in bf16.
    assert 43.5e9 < sizes[random_bundle.CHECKPOINT_NAME] < 45.0e9, sizes
    # Rank 384 on every linear of the 48 blocks, the per-head gates included.
    assert 7.6e9 < sizes[random_bundle.DISTILLED_LORA_NAME] < 8.5e9, sizes
    total = sum(sizes.values())
    assert total < 0.9 * 64 * 2**30, f"full-size 2.3 bundle {total / 1e9:.1f} GB does not fit a 64 GiB disk with room to spare"
    # The 19B configuration keeps the plain (HiFi-GAN) vocoder.
    transformer_19b = json.loads((REPO / "configs" / "ltx2-19b-transformer.json").read_text())["transformer"]
    assert "bwe" not in random_bundle.full_size_config(transformer_19b).checkpoint["vocoder"]
