"""Every recipe's CLI on real files against its official ltx-pipelines 1.0.0 runner, bitwise.

``python -m mgpu_backend generate --pipeline NAME`` runs on the tiny bundle of each model version,
its files given as the recipe's flags (as a user with downloaded files runs it, not the embedded
default), on one CPU rank, and dumps its latents (``--debug-dump``). The recipe's official runner
(``Recipe.official_runner``: ``TI2VidTwoStagesPipeline``, ``DistilledPipeline``) runs on the same
files, seed and sizes, its denoised latents captured by wrapping ``denoise_audio_video``
(``official_reference``: no-op CUDA calls, Gemma sized to the tiny bundle). The CLI is asked for what
the official runner does where its own defaults differ (stage 2 over the official tail, sequence
parallel so that the audio is denoised too; STG on the tiny model's last block, 3 guided steps), and
for the tiny sizes (real files get a real model's sizes by default).

Gemma: ltx-core 1.0.0 builds its Gemma with transformers 4 code only. Under transformers 4 (CI's
tf4 venv) the official runner encodes its prompts itself; under transformers 5 its ``encode_prompts``
gets the hidden states of the pack's Gemma (proven equal to ltx-core's by
``test_pipeline_parity::test_prompt_encoding_matches_the_official_encode_prompts_bitwise`` under
transformers 4) and runs its own embeddings processor on them.
"""

from __future__ import annotations


import pytest
import torch
from ltx_core.components.guiders import MultiModalGuiderParams
from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps
from ltx_core.model.video_vae import TilingConfig
from safetensors.torch import load_file

from mgpu_backend.bundles import tiny
from mgpu_backend.fleet.rank import cpu_threads
from mgpu_backend.ltx.loading import ModelLoader
from mgpu_backend.ltx.recipes import LORA_FILES, RECIPES, Recipe, strength_defaults
from mgpu_backend.ltx.schema import ModelSpec, defaults_for
from mgpu_backend.tools.generate import DEFAULT_NEGATIVE_PROMPT, TINY_DEFAULTS

from . import official_reference
from .helpers import PROMPT, run_generate

GUIDED_STEPS = 3  # a guided recipe's stage-1 steps here (the official 40 or 30 only repeat the step)
LAST_BLOCK = 1  # the tiny transformer's last block, for STG


def _listed(values) -> str:
    return ",".join(map(str, values))


def cli_flags(declared: Recipe, bundle: tiny.TinyBundle) -> list[str]:
    """The recipe's model files as its flags, and what makes the CLI run what the official runner runs."""
    flags = ["--pipeline", declared.name]
    flags += [word for file in declared.files for word in (file.flag, getattr(bundle, file.tiny_file))]
    flags += ["--height", str(TINY_DEFAULTS["height"]), "--width", str(TINY_DEFAULTS["width"]), "--num-frames", str(TINY_DEFAULTS["num_frames"])]
    flags += ["--stage2-sigmas", _listed(declared.stage2.sigmas), "--stage2-parallel", "sp"]
    if declared.guided:
        flags += ["--num-inference-steps", str(GUIDED_STEPS), "--video-stg-blocks", str(LAST_BLOCK), "--audio-stg-blocks", str(LAST_BLOCK)]
    return flags


def official_runner(declared: Recipe, bundle: tiny.TinyBundle):
    """``build(module)`` for ``official_reference.reference_side``: the runner on the recipe's files,
    each under the keyword its CLI flag follows (a LoRA at strength 1.0, as the CLI's default), and
    its per-stage LoRA strengths (HQ) at the recipe's own, as the CLI leaves them."""
    module_name, class_name = declared.official_runner.rsplit(".", 1)

    def build(module):
        files = {}
        for file in declared.files:
            path = getattr(bundle, file.tiny_file)
            files[file.flag.lstrip("-").replace("-", "_")] = [LoraPathStrengthAndSDOps(path, 1.0, LTXV_LORA_COMFY_RENAMING_MAP)] if file.spec_field in LORA_FILES else path
        # The per-stage strengths the official runner takes (HQ's), at the recipe's own values; a stage-1 strength
        # only a user chooses (two-stage, keyframes: unset, no LoRA there, as their runners) is none of its parameters.
        strengths = {field: strength_defaults(field)[declared.name] for field in declared.stage_strengths if strength_defaults(field)[declared.name] is not None}
        return getattr(module, class_name)(loras=[], device=torch.device("cpu"), **files, **strengths)

    return module_name.removeprefix("ltx_pipelines."), build


def official_call(declared: Recipe, version: str) -> dict:
    defaults = defaults_for(version, declared.name)
    call = dict(prompt=PROMPT, seed=defaults.seed, height=TINY_DEFAULTS["height"], width=TINY_DEFAULTS["width"],
                num_frames=TINY_DEFAULTS["num_frames"], frame_rate=defaults.frame_rate)  # fmt: skip
    if declared.guided:
        guiders = {
            f"{modality}_guider_params": MultiModalGuiderParams(
                cfg_scale=guidance.cfg_scale, stg_scale=guidance.stg_scale, rescale_scale=guidance.rescale_scale,
                modality_scale=guidance.modality_scale, skip_step=guidance.skip_step, stg_blocks=[LAST_BLOCK],
            )  # fmt: skip
            for modality, guidance in (("video", defaults.video_guidance), ("audio", defaults.audio_guidance))
        }
        call.update(negative_prompt=DEFAULT_NEGATIVE_PROMPT, num_inference_steps=GUIDED_STEPS, **guiders)
    return call


def run_official(declared: Recipe, bundle: tiny.TinyBundle, version: str, images: tuple = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The official runner's (video, audio) latents after each denoising: stage 1, then stage 2; ``images``:
    its ``ImageConditioningInput`` fields ``(path, frame_idx, strength)``.

    It runs at the torch thread count of the CLI's one CPU rank (``rank.cpu_threads``): on a CPU with AMX, torch's
    bf16 matmuls (oneDNN) split their sums over the threads where the output has fewer blocks than threads, so their
    rounding follows the thread count (on an AMX Xeon, LTX-2.3's text-connector feed-forward of 1024 tokens from 11
    threads, its stage-2 feed-forward from 4); and both sides resize the images with thread-dependent float rounding."""
    module_name, build = official_runner(declared, bundle)
    denoised = []
    for side in official_reference.reference_side(bundle, module_name, build):
        torch.set_num_threads(cpu_threads(1))
        module = side.module
        original_denoise, original_encode = module.denoise_audio_video, module.encode_prompts
        pack_gemma = ModelLoader(ModelSpec(bundle.checkpoint_path, bundle.gemma_root), "cpu", torch.bfloat16).gemma() if official_reference.TRANSFORMERS_5 else None

        def encode_with_the_packs_gemma(prompts, model_ledger, **_enhancement):
            processor = model_ledger.gemma_embeddings_processor()
            return [processor.process_hidden_states(*pack_gemma.encode(prompt)) for prompt in prompts]

        def capturing_denoise(*args, **kwargs):
            video_state, audio_state = original_denoise(*args, **kwargs)
            denoised.append((video_state.latent.clone(), audio_state.latent.clone()))
            return video_state, audio_state

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "denoise_audio_video", capturing_denoise)
            patch.setattr(module, "encode_prompts", encode_with_the_packs_gemma if pack_gemma is not None else original_encode)
            try:
                with torch.inference_mode():
                    conditioning = [module.ImageConditioningInput(*image) for image in images]
                    video_chunks, _audio = side.pipeline(images=conditioning, tiling_config=TilingConfig.default(), **official_call(declared, version))
                    torch.cat(list(video_chunks))  # the runner decodes while its chunks are read
            finally:
                torch.set_num_threads(1)
    return denoised


RUNS = [
    pytest.param(declared, version, id=f"{declared.name}-{official_reference.version_id(version)}")
    for declared in RECIPES.values() for version in tiny.VERSIONS if version in declared.versions
]  # fmt: skip
"""Every recipe on the tiny bundle of each model version its official runner supports."""


@pytest.mark.slow
@pytest.mark.parametrize("declared, version", RUNS)
def test_each_recipes_cli_on_real_files_matches_its_official_runner_bitwise(declared, version, tiny_bundle_of, tmp_path):
    bundle = tiny_bundle_of(version)
    completed = run_generate(tmp_path, "cli", *cli_flags(declared, bundle))
    assert "embedded tiny" not in completed.stderr, "the CLI must run the files given as flags"
    assert f"stage-2 plan (sp, {declared.name}): SP degree 1 on 1 rank" in completed.stderr
    dump = load_file(str(tmp_path / "cli.safetensors"))
    (stage1_video, stage1_audio), (stage2_video, stage2_audio) = run_official(declared, bundle, version)
    assert dump["stage1_video"].shape == (1, 128, 2, 2, 3) and dump["stage2_video"].shape == (1, 128, 2, 4, 6)
    official_reference.assert_bitwise(dump["stage1_video"], stage1_video, f"{declared.name} LTX-{version} stage-1 video latent")
    official_reference.assert_bitwise(dump["stage1_audio"], stage1_audio, f"{declared.name} LTX-{version} stage-1 audio latent")
    official_reference.assert_bitwise(dump["stage2_video"], stage2_video, f"{declared.name} LTX-{version} stage-2 video latent")
    official_reference.assert_bitwise(dump["stage2_audio"], stage2_audio, f"{declared.name} LTX-{version} stage-2 audio latent")
    assert not torch.equal(dump["stage2_audio"], dump["stage1_audio"])  # stage 2 denoised the audio, as the official runner


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["keyframes", "two-stage"])
def test_the_cli_with_a_first_and_a_last_image_matches_the_official_runner_bitwise(pipeline, tiny_bundle_of, tmp_path):
    """--image at --image-strength 0.7 and --last-image: the official runner's ``--image PATH 0 0.7`` and ``--image PATH 8 1.0``."""
    from .test_keyframes_fleet import last_frame_image

    declared, bundle = RECIPES[pipeline], tiny_bundle_of("2.0")
    (first, _), (last, _) = official_reference.first_frame_image(tmp_path), last_frame_image(tmp_path)
    completed = run_generate(tmp_path, "cli", *cli_flags(declared, bundle), "--image", first, "--image-strength", "0.7", "--last-image", last)
    assert f"stage-2 plan (sp, {pipeline}): SP degree 1 on 1 rank" in completed.stderr
    dump = load_file(str(tmp_path / "cli.safetensors"))
    denoised = run_official(declared, bundle, "2.0", ((first, 0, 0.7), (last, TINY_DEFAULTS["num_frames"] - 1, 1.0)))
    for stage, (video, audio) in enumerate(denoised, start=1):
        official_reference.assert_bitwise(dump[f"stage{stage}_video"], video, f"{pipeline} CLI with first and last images: stage-{stage} video latent")
        official_reference.assert_bitwise(dump[f"stage{stage}_audio"], audio, f"{pipeline} CLI with first and last images: stage-{stage} audio latent")
