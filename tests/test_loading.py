"""ModelLoader builds what ltx-pipelines' ModelLedger builds, reads each file once, and refuses bad files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.loading import ModelFileError, ModelLoader, ModelSpec, validate_model_files
from tests.helpers import PromptEncoder
from tests.official_reference import needs_ltx_core_gemma


@pytest.fixture(scope="module")
def spec(bundle) -> ModelSpec:
    return bundle.spec()


@pytest.fixture
def tiny_gemma_in_ltx_core(monkeypatch):
    """ltx-core 1.0.0 hard-codes Gemma-3 12B; point the reference ModelLedger at the tiny dims."""
    from ltx_core.text_encoders.gemma import config as gemma_config
    from ltx_core.text_encoders.gemma.encoders import encoder_configurator

    text = dict(
        tiny.GEMMA_TEXT_CONFIG, rope_scaling=gemma_config.Gemma3RopeScaling(**tiny.GEMMA_TEXT_CONFIG["rope_scaling"])
    )
    top = {k: v for k, v in tiny.GEMMA_CONFIG.items() if k not in ("text_config", "vision_config")}
    data = gemma_config.Gemma3ConfigData(
        **top,
        text_config=gemma_config.Gemma3TextConfig(**text),
        vision_config=gemma_config.Gemma3VisionConfig(**tiny.GEMMA_VISION_CONFIG),
    )
    monkeypatch.setattr(encoder_configurator, "GEMMA3_CONFIG_FOR_LTX", data)


def _tensor_bytes(path: str, prefix: str = "") -> int:
    with safe_open(path, framework="pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys() if k.startswith(prefix))


def _assert_same_weights(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert ours_sd.keys() == theirs_sd.keys()
    for key in ours_sd:
        assert ours_sd[key].dtype == theirs_sd[key].dtype, key
        assert torch.equal(ours_sd[key], theirs_sd[key]), key


@needs_ltx_core_gemma
def test_every_component_equals_the_one_model_ledger_builds(spec, tiny_gemma_in_ltx_core, monkeypatch):
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps
    from ltx_pipelines.utils import ModelLedger

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
    loader = ModelLoader(spec, "cpu", torch.bfloat16)

    _assert_same_weights(loader.transformer("none"), ledger.transformer())
    _assert_same_weights(loader.transformer("distilled"), stage_2_ledger.transformer())
    _assert_same_weights(loader.video_encoder(), ledger.video_encoder())
    _assert_same_weights(loader.video_decoder(), ledger.video_decoder())
    _assert_same_weights(loader.audio_decoder(), ledger.audio_decoder())
    _assert_same_weights(loader.vocoder(), ledger.vocoder())
    _assert_same_weights(loader.spatial_upsampler(), ledger.spatial_upsampler())
    prompt_encoder = PromptEncoder(loader.gemma(), loader.embeddings_processor())
    # Our Gemma is transformers' text stack alone (no vision tower, no tied lm_head): ltx-core's without the rest.
    # ltx-core also saves its hand-made rotary buffers; the encodings below compare what those compute.
    ours_gemma = dict(prompt_encoder.gemma.model.named_parameters())
    theirs_gemma = dict(ledger.text_encoder().model.model.language_model.named_parameters())
    assert ours_gemma.keys() == theirs_gemma.keys()
    assert all(torch.equal(ours_gemma[key], theirs_gemma[key]) for key in ours_gemma)
    _assert_same_weights(prompt_encoder.embeddings_processor, ledger.gemma_embeddings_processor())

    from ltx_pipelines.utils.helpers import encode_prompts

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)  # encode_prompts syncs CUDA always
    prompts = ["A fox steps through fresh snow at the edge of a pine forest.", ""]
    with torch.inference_mode():
        ours = prompt_encoder.encode(prompts)
        theirs = encode_prompts(prompts, ledger)
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine.video_encoding, reference.video_encoding)
        assert torch.equal(mine.audio_encoding, reference.audio_encoding)
        assert torch.equal(mine.attention_mask, reference.attention_mask)
    assert ours[0].video_encoding.shape == (1, 1024, tiny.GEMMA_TEXT_CONFIG["hidden_size"])
    assert not torch.equal(ours[0].video_encoding, ours[1].video_encoding)


def test_checkpoint_is_read_once_for_both_transformer_builds(spec):
    loader = ModelLoader(spec, "cpu", torch.bfloat16)
    assert loader.bytes_read_from_disk == 0

    stage_1 = loader.transformer("none")
    transformer_bytes = _tensor_bytes(spec.checkpoint_path, "model.diffusion_model.")
    assert loader.bytes_read_from_disk == transformer_bytes

    stage_2 = loader.transformer("distilled")
    assert loader.bytes_read_from_disk == transformer_bytes + _tensor_bytes(spec.distilled_lora)

    before = loader.bytes_read_from_disk
    loader.transformer("none")
    loader.transformer("distilled")
    assert loader.bytes_read_from_disk == before

    # The distilled LoRA changes exactly the linear layers it targets.
    with safe_open(spec.distilled_lora, framework="pt") as f:
        targets = {
            k.removeprefix("diffusion_model.").replace(".lora_A.weight", ".weight") for k in f.keys() if "lora_A" in k
        }
    plain, fused = stage_1.velocity_model.state_dict(), stage_2.velocity_model.state_dict()
    changed = {key for key in plain if not torch.equal(plain[key], fused[key])}
    assert changed == targets


def test_a_warm_second_use_of_every_component_reads_nothing(spec):
    loader = ModelLoader(spec, "cpu", torch.float32)
    builds = [
        "transformer",
        "video_encoder",
        "video_decoder",
        "audio_decoder",
        "vocoder",
        "spatial_upsampler",
        "gemma",
        "embeddings_processor",
    ]
    for name in builds:
        getattr(loader, name)()
    first_use = loader.bytes_read_from_disk
    assert first_use > Path(spec.checkpoint_path).stat().st_size // 2
    for name in builds:
        model = getattr(loader, name)()
        assert all(p.dtype == torch.float32 for p in model.parameters()), name
    assert loader.bytes_read_from_disk == first_use


def test_transformer_runs_and_stage_2_output_differs(spec):
    from ltx_core.model.transformer import Modality

    loader = ModelLoader(spec, "cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    video_tokens, audio_tokens = 12, 5

    def modality(tokens: int, channels: int, position_axes: int, context_width: int) -> Modality:
        return Modality(
            latent=torch.randn(1, tokens, channels, generator=generator),
            sigma=torch.tensor([0.7]),
            timesteps=torch.full((1, tokens, 1), 0.7),
            positions=torch.rand(1, position_axes, tokens, 2, generator=generator) * 4,
            context=torch.randn(1, 8, context_width, generator=generator),
        )

    video = modality(video_tokens, 128, 3, tiny.GEMMA_TEXT_CONFIG["hidden_size"])
    audio = modality(audio_tokens, 128, 1, tiny.GEMMA_TEXT_CONFIG["hidden_size"])
    with torch.inference_mode():
        plain_video, plain_audio = loader.transformer("none")(video=video, audio=audio, perturbations=None)
        lora_video, _ = loader.transformer("distilled")(video=video, audio=audio, perturbations=None)
    assert plain_video.shape == (1, video_tokens, 128) and plain_audio.shape == (1, audio_tokens, 128)
    assert torch.isfinite(plain_video).all() and torch.isfinite(plain_audio).all()
    assert not torch.allclose(plain_video, lora_video)


# --- ModelSpec ---------------------------------------------------------------------------------------


def test_spec_round_trips_through_json(spec, bundle):
    with_loras = ModelSpec(
        **{**spec.__dict__, "loras": ((bundle.distilled_lora_path, 0.5),), "distilled_lora_strength": 0.8}
    )
    data = json.loads(json.dumps(with_loras.to_json()))
    assert ModelSpec.from_wire(data) == with_loras


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"checkpoint_path": 3}, "'checkpoint_path' must be a non-empty path string"),
        ({"distilled_lora_strength": "1"}, "'distilled_lora_strength' must be a number"),
        ({"loras": [["a.safetensors"]]}, "each LoRA must be [path, strength]"),
        ({"sampler": "euler"}, "unknown model spec field(s) ['sampler']"),
        (
            {"spatial_upsampler_path": "/nowhere/up.safetensors"},
            "spatial upsampler file /nowhere/up.safetensors does not exist",
        ),
        ({"gemma_root": "/nowhere/gemma"}, "Gemma folder /nowhere/gemma does not exist"),
    ],
)
def test_spec_file_check_says_what_is_wrong(spec, change, message):
    with pytest.raises(ModelFileError) as error:
        ModelSpec.from_wire({**spec.to_json(), **change}).check_files_exist()
    assert message in str(error.value)


# --- Validation ---------------------------------------------------------------------------------------


def _expect_error(spec: ModelSpec, *fragments: str) -> None:
    with pytest.raises(ModelFileError) as error:
        validate_model_files(spec)
    for fragment in fragments:
        assert fragment in str(error.value)


def test_tiny_spec_validates(spec):
    validate_model_files(spec)


def test_missing_checkpoint_is_named(spec, tmp_path):
    missing = str(tmp_path / "ltx-2-19b-dev.safetensors")
    _expect_error(ModelSpec(**{**spec.__dict__, "checkpoint_path": missing}), missing, "does not exist")


def test_a_file_that_is_not_safetensors_is_refused(spec, tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("this is not a checkpoint")
    _expect_error(ModelSpec(**{**spec.__dict__, "checkpoint_path": str(text)}), str(text), "is not a .safetensors file")


def test_a_random_safetensors_file_is_not_an_ltx_checkpoint(spec, tmp_path):
    other = tmp_path / "some-other-model.safetensors"
    save_file({"encoder.layer.0.weight": torch.randn(4, 4)}, str(other))
    _expect_error(
        ModelSpec(**{**spec.__dict__, "checkpoint_path": str(other)}), str(other), "no LTX-2 'config' metadata"
    )


def test_a_checkpoint_without_transformer_weights_is_refused(spec, tmp_path):
    with safe_open(spec.checkpoint_path, framework="pt") as f:
        vae_only = {k: f.get_tensor(k) for k in f.keys() if k.startswith("vae.")}
        metadata = f.metadata()
    path = tmp_path / "vae-only.safetensors"
    save_file(vae_only, str(path), metadata=metadata)
    _expect_error(ModelSpec(**{**spec.__dict__, "checkpoint_path": str(path)}), str(path), "lacks the transformer")


def test_a_lora_for_another_model_is_refused(spec, tmp_path):
    foreign = tmp_path / "sdxl-style-lora.safetensors"
    save_file(
        {
            "diffusion_model.input_blocks.1.attn.to_q.lora_A.weight": torch.randn(4, 320),
            "diffusion_model.input_blocks.1.attn.to_q.lora_B.weight": torch.randn(320, 4),
        },
        str(foreign),
    )
    _expect_error(
        ModelSpec(**{**spec.__dict__, "loras": ((str(foreign), 1.0),)}),
        str(foreign),
        "does not match the transformer",
        "input_blocks.1.attn.to_q.weight",
    )


def test_a_lora_with_other_shapes_is_refused(spec, tmp_path):
    resized = tmp_path / "wider-lora.safetensors"
    save_file(
        {
            "diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.randn(4, 4096),
            "diffusion_model.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.randn(4096, 4),
        },
        str(resized),
    )
    _expect_error(ModelSpec(**{**spec.__dict__, "distilled_lora": str(resized)}), "distilled LoRA", "other shapes")


def test_a_file_without_lora_pairs_is_refused_as_lora(spec):
    _expect_error(ModelSpec(**{**spec.__dict__, "loras": ((spec.spatial_upsampler_path, 1.0),)}), "holds no LoRA A/B")


def test_an_upsampler_that_is_not_one_is_refused(spec):
    lora_as_upsampler = ModelSpec(**{**spec.__dict__, "spatial_upsampler_path": spec.distilled_lora})
    _expect_error(lora_as_upsampler, spec.distilled_lora, "is not an LTX-2 latent upsampler")


def test_a_gemma_folder_of_another_size_is_refused(spec, tmp_path):
    gemma = tmp_path / "gemma"
    shutil.copytree(spec.gemma_root, gemma)
    config = json.loads((gemma / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 4
    (gemma / "config.json").write_text(json.dumps(config))
    _expect_error(ModelSpec(**{**spec.__dict__, "gemma_root": str(gemma)}), str(gemma), "does not fit checkpoint")


def test_a_gemma_folder_without_tokenizer_is_refused(spec, tmp_path):
    gemma = tmp_path / "gemma"
    shutil.copytree(spec.gemma_root, gemma)
    (gemma / "tokenizer.model").unlink()
    _expect_error(ModelSpec(**{**spec.__dict__, "gemma_root": str(gemma)}), str(gemma), "tokenizer.model")


def test_stage_2_without_a_distilled_lora_says_so(spec):
    loader = ModelLoader(ModelSpec(spec.checkpoint_path, spec.gemma_root), "cpu", torch.bfloat16)
    with pytest.raises(ModelFileError, match="distilled LoRA"):
        loader.transformer("distilled")
    with pytest.raises(ValueError, match="lora_set must be one of"):
        loader.transformer("stage2")
