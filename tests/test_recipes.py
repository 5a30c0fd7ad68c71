"""The recipe declarations (``mgpu_backend.ltx.recipes``): the registry, what the schema, jobs, planner,
CLI, nodes and docs derive from them, and that no product module compares recipe names."""

from __future__ import annotations

import argparse
import ast
import inspect
import types
from dataclasses import fields, replace
from pathlib import Path

import pytest

from mgpu_backend.bundles import tiny
from mgpu_backend.fleet.jobs import JobInputError
from mgpu_backend.ltx import recipes
from mgpu_backend.ltx.jobs import check_recipe_files
from mgpu_backend.ltx.recipes import DISTILLED, HQ, KEYFRAMES, RECIPES, TWO_STAGE, recipe, stage_loras, strength_default_words, strength_defaults
from mgpu_backend.ltx.schema import DEFAULTS, NO_GUIDANCE, ModelFileError, ModelSpec, RequestError, defaults_for, stage2_default_sigmas
from mgpu_backend.parallel.guidance_parallel import plan_stage2
from mgpu_backend.tools import generate

REPO = Path(__file__).resolve().parent.parent
PRODUCT = [*sorted((REPO / "mgpu_backend").rglob("*.py")), *sorted((REPO / "nodes").glob("*.py")), *sorted((REPO / "bench").glob("*.py")), REPO / "workflows" / "make_workflows.py"]


def test_an_unknown_recipe_is_refused_in_words_listing_the_known_ones():
    assert recipe("distilled") is DISTILLED and recipe("two-stage") is TWO_STAGE
    with pytest.raises(ValueError) as raised:
        recipe("lcm")
    assert str(raised.value) == "pipeline must be one of two-stage, distilled, hq, keyframes, got 'lcm'"
    with pytest.raises(RequestError, match="pipeline must be one of two-stage, distilled, hq, keyframes, got 'Distilled'"):
        defaults_for("2.0", "Distilled")


def test_defaults_per_version_and_recipe_are_the_official_values():
    assert list(DEFAULTS) == [("2.0", "two-stage"), ("2.0", "distilled"), ("2.0", "keyframes"), ("2.3", "two-stage"), ("2.3", "distilled"), ("2.3", "hq"), ("2.3", "keyframes")]
    for version, steps, block in (("2.0", 40, 29), ("2.3", 30, 28)):
        guided, distilled = DEFAULTS[(version, "two-stage")], DEFAULTS[(version, "distilled")]
        assert (guided.steps, guided.stage1_sigmas, guided.video_guidance.stg_blocks) == (steps, None, (block,))
        assert (guided.video_guidance.cfg_scale, guided.audio_guidance.cfg_scale, guided.video_guidance.rescale_scale) == (3.0, 7.0, 0.7)
        assert distilled.steps == 8 and distilled.stage1_sigmas == (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0)
        assert distilled.video_guidance == distilled.audio_guidance == NO_GUIDANCE
        for defaults in (guided, distilled):
            assert (defaults.seed, defaults.stage1_height, defaults.stage1_width, defaults.num_frames, defaults.frame_rate) == (10, 512, 768, 121, 24.0)
            assert defaults.stage2_sigmas == (0.909375, 0.725, 0.421875, 0.0)
    assert stage2_default_sigmas("two-stage") == (0.625, 0.4, 0.0) and stage2_default_sigmas("distilled") == (0.909375, 0.725, 0.421875, 0.0)


def test_hq_defaults_are_ltx_2_3_hq_params_and_ltx_2_0_is_refused_in_words():
    from ltx_pipelines.utils.constants import LTX_2_3_HQ_PARAMS

    hq = DEFAULTS[("2.3", "hq")]
    assert (hq.steps, hq.stage1_height, hq.stage1_width, hq.stage1_sigmas, hq.stage2_sigmas) == (15, 544, 960, None, (0.909375, 0.725, 0.421875, 0.0))
    for ours, official in ((hq.video_guidance, LTX_2_3_HQ_PARAMS.video_guider_params), (hq.audio_guidance, LTX_2_3_HQ_PARAMS.audio_guider_params)):
        assert (ours.cfg_scale, ours.stg_scale, ours.rescale_scale, ours.modality_scale, ours.skip_step, list(ours.stg_blocks)) == (
            official.cfg_scale, official.stg_scale, official.rescale_scale, official.modality_scale, official.skip_step, official.stg_blocks)  # fmt: skip
    assert (hq.steps, hq.stage1_height, hq.stage1_width) == (LTX_2_3_HQ_PARAMS.num_inference_steps, LTX_2_3_HQ_PARAMS.stage_1_height, LTX_2_3_HQ_PARAMS.stage_1_width)
    assert (HQ.stage1.stepper, HQ.stage2.stepper, HQ.stage1.shift_by_tokens, HQ.stage2_policy) == ("res2s", "res2s", True, "sp")
    with pytest.raises(RequestError) as raised:
        defaults_for("2.0", "hq")
    assert str(raised.value) == (
        "the hq pipeline runs LTX-2.3 only (ltx-pipelines has its parameters for no other version), got an LTX-2.0 checkpoint; "
        "use an LTX-2.3 checkpoint, or pipeline 'two-stage' or 'distilled' or 'keyframes'"
    )


def test_lora_sets_fuse_the_user_loras_first_then_the_distilled_lora_at_its_strength():
    spec = ModelSpec("c.safetensors", "g", distilled_lora="d.safetensors", distilled_lora_strength=0.6, loras=(("a.safetensors", 0.5), ("b.safetensors", 1.25)))
    assert stage_loras(spec, "none") == (("a.safetensors", 0.5), ("b.safetensors", 1.25))
    assert stage_loras(spec, "distilled") == (("a.safetensors", 0.5), ("b.safetensors", 1.25), ("d.safetensors", 0.6))
    with pytest.raises(ModelFileError, match="the LoRA set 'distilled' needs the distilled LoRA \\(at distilled_lora_strength 1\\), but the model spec names none; set distilled_lora"):
        stage_loras(ModelSpec("c.safetensors", "g"), "distilled")
    with pytest.raises(ValueError, match="lora_set must be one of 'none' or 'distilled' or 'distilled-stage-1' or 'distilled-stage-2' or 'distilled-stage-1-if-chosen', got 'stage2'"):
        stage_loras(spec, "stage2")
    # The HQ sets: one file at each stage's own strength (hq_2_stage_arg_parser's 0.25 and 0.5 while the spec leaves them unset).
    assert (spec.distilled_lora_strength_stage_1, spec.distilled_lora_strength_stage_2) == (None, None)
    assert stage_loras(spec, "distilled-stage-1")[-1] == ("d.safetensors", 0.25) and stage_loras(spec, "distilled-stage-2")[-1] == ("d.safetensors", 0.5)
    tuned = ModelSpec.from_wire({**spec.to_wire(), "distilled_lora_strength_stage_1": 0.3, "distilled_lora_strength_stage_2": 0.75})
    assert stage_loras(tuned, "distilled-stage-1")[-1] == ("d.safetensors", 0.3) and stage_loras(tuned, "distilled-stage-2")[-1] == ("d.safetensors", 0.75)
    # The two-stage recipe's stage 1: no distilled LoRA unless the spec chooses its strength (ComfyUI's templates: 0.5).
    assert stage_loras(spec, "distilled-stage-1-if-chosen") == stage_loras(spec, "none")
    assert stage_loras(tuned, "distilled-stage-1-if-chosen")[-1] == ("d.safetensors", 0.3)
    # A LoRA at strength 0 is no LoRA, and needs no file.
    assert stage_loras(replace(spec, distilled_lora_strength_stage_2=0.0), "distilled-stage-2") == stage_loras(spec, "none")
    assert stage_loras(ModelSpec("c.safetensors", "g", distilled_lora_strength_stage_1=0.0), "distilled-stage-1") == ()
    with pytest.raises(ModelFileError, match="the LoRA set 'distilled-stage-1-if-chosen' needs the distilled LoRA \\(at distilled_lora_strength_stage_1 0.5\\), "
                                             "but the model spec names none; set distilled_lora, or leave distilled_lora_strength_stage_1 unset"):
        stage_loras(ModelSpec("c.safetensors", "g", distilled_lora_strength_stage_1=0.5), "distilled-stage-1-if-chosen")
    assert [(declared.stage1.lora_set, declared.stage2.lora_set) for declared in RECIPES.values()] == [
        ("distilled-stage-1-if-chosen", "distilled"), ("none", "none"), ("distilled-stage-1", "distilled-stage-2"),
        ("distilled-stage-1-if-chosen", "distilled")]  # fmt: skip
    assert strength_defaults("distilled_lora_strength_stage_1") == {"two-stage": None, "hq": 0.25, "keyframes": None}
    assert strength_default_words("distilled_lora_strength_stage_1") == "two-stage: none unless set; hq: 0.25; keyframes: none unless set"


def test_the_stage2_auto_plan_follows_each_recipes_policy():
    # 8 ranks, 24576 stage-2 tokens (1024x1536x121): 3072 tokens per rank.
    assert plan_stage2(8, 24576, "two-stage").technique == "tdp"
    assert plan_stage2(8, 24576, "distilled").technique == "sp"
    # HQ denoises the audio in stage 2, as its official runner: SP even where the distilled rule takes TDP (48 tokens on 2 ranks).
    assert plan_stage2(2, 48, "distilled").technique == "tdp" and plan_stage2(2, 48, "hq").technique == "sp"
    assert "the hq recipe's stage 2 denoises the audio too, as its official runner" in plan_stage2(2, 48, "hq").reason
    assert plan_stage2(3, 48, "hq").technique == "tdp"  # 3 ranks is no SP degree of 32 heads
    with pytest.raises(ValueError, match="pipeline must be one of two-stage, distilled, hq, keyframes, got 'lcm'"):
        plan_stage2(8, 24576, "lcm")


def _request(pipeline: str, op: str):
    return types.SimpleNamespace(pipeline=pipeline, op=op)


def test_jobs_refuse_a_spec_missing_or_holding_a_file_against_the_recipe():
    full = ModelSpec("c", "g", spatial_upsampler_path="u", distilled_lora="d")
    check_recipe_files(_request("two-stage", "upscale"), full)
    check_recipe_files(_request("two-stage", "sample"), ModelSpec("c", "g"))  # stage 1 opens neither upsampler nor LoRA
    with pytest.raises(JobInputError) as raised:
        check_recipe_files(_request("two-stage", "upscale"), ModelSpec("c", "g", spatial_upsampler_path="u"))
    assert str(raised.value) == "the two-stage pipeline's stage 2 needs the distilled LoRA; set distilled_lora in the model spec, or use pipeline 'distilled'"
    with pytest.raises(JobInputError) as raised:
        check_recipe_files(_request("distilled", "upscale"), ModelSpec("c", "g", distilled_lora="d"))
    assert str(raised.value).startswith("the distilled pipeline's stage 2 needs the spatial upsampler; set spatial_upsampler_path in the model spec")
    with pytest.raises(JobInputError) as raised:
        check_recipe_files(_request("distilled", "sample"), full)
    assert str(raised.value) == (
        "the distilled pipeline runs the distilled checkpoint as it is, with no distilled LoRA; leave distilled_lora out of "
        "the model spec (or use pipeline 'two-stage' or 'hq' or 'keyframes', which takes it)"
    )
    # HQ fuses the distilled LoRA in stage 1 too: the sample job already needs it.
    with pytest.raises(JobInputError) as raised:
        check_recipe_files(_request("hq", "sample"), ModelSpec("c", "g"))
    assert str(raised.value) == "the hq pipeline's stage 1 needs the distilled LoRA; set distilled_lora in the model spec, or use pipeline 'distilled'"


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_generate_parser(parser.add_subparsers())
    return parser.parse_args(["generate", "--prompt", "x", *argv])


def _recipe_flags(declared, bundle) -> list[str]:
    return [word for file in declared.files for word in (file.flag, getattr(bundle, file.tiny_file))]


@pytest.mark.parametrize("declared", RECIPES.values(), ids=lambda declared: declared.name)
def test_the_cli_builds_each_recipes_spec_from_its_files_given_as_flags(declared, tiny_bundle_of):
    """The distilled CLI with real files opened the distilled LoRA it does not have (None) and died in a TypeError."""
    bundle = tiny_bundle_of(declared.versions[0])
    spec, is_tiny = generate.build_spec(_parsed("--pipeline", declared.name, *_recipe_flags(declared, bundle)))
    assert not is_tiny
    assert spec["checkpoint_path"] == getattr(bundle, declared.checkpoint.tiny_file)
    assert spec["distilled_lora"] == (bundle.distilled_lora_path if declared in (TWO_STAGE, HQ, KEYFRAMES) else None)
    assert (spec["gemma_root"], spec["spatial_upsampler_path"]) == (bundle.gemma_root, bundle.spatial_upsampler_path)


def test_the_cli_takes_hq_stage_strengths_and_refuses_what_the_recipe_does_not_read(tiny_bundle_of, capsys):
    bundle = tiny_bundle_of("2.3")
    assert _recipe_flags(HQ, bundle)[-2:] == ["--distilled-lora", bundle.distilled_lora_path]
    spec, _ = generate.build_spec(_parsed("--pipeline", "hq", *_recipe_flags(HQ, bundle), "--distilled-lora-strength-stage-1", "0.3"))
    assert (spec["distilled_lora_strength_stage_1"], spec["distilled_lora_strength_stage_2"]) == (0.3, None)  # stage 2: the recipe's 0.5
    # The two-stage recipe takes the stage-1 strength (the distilled LoRA in stage 1 as well, as ComfyUI's templates run it).
    spec, _ = generate.build_spec(_parsed("--pipeline", "two-stage", *_recipe_flags(TWO_STAGE, bundle), "0.5", "--distilled-lora-strength-stage-1", "0.5"))
    assert (spec["distilled_lora_strength"], spec["distilled_lora_strength_stage_1"], spec["distilled_lora_strength_stage_2"]) == (0.5, 0.5, None)
    refusals = {
        ("--pipeline", "two-stage", "--distilled-lora-strength-stage-2", "0.6"): (
            "--distilled-lora-strength-stage-2 does not apply to --pipeline two-stage (use --pipeline hq for it; --distilled-lora's "
            "STRENGTH sets its stage-2 strength); drop it"
        ),
        ("--pipeline", "hq", "--model-version", "2.0"): (
            "--model-version: the hq pipeline runs LTX-2.3 only (ltx-pipelines has its parameters for no other version), got an "
            "LTX-2.0 checkpoint; use an LTX-2.3 checkpoint, or pipeline 'two-stage' or 'distilled' or 'keyframes'"
        ),
        ("--pipeline", "hq", *_recipe_flags(HQ, bundle), "0.7"): (  # the distilled LoRA's flag comes last: 0.7 is its STRENGTH
            f"--distilled-lora {bundle.distilled_lora_path} 0.7: --pipeline hq reads no strength there (its stages take "
            "--distilled-lora-strength-stage-1 and --distilled-lora-strength-stage-2); drop 0.7"
        ),
    }
    for argv, message in refusals.items():
        with pytest.raises(SystemExit) as exited:
            generate.build_spec(_parsed(*argv))
        assert exited.value.code == 2 and capsys.readouterr().err.strip() == f"error: {message}", argv
    # Without model flags, hq runs the tiny LTX-2.3 bundle (it runs no 2.0).
    spec, is_tiny = generate.build_spec(_parsed("--pipeline", "hq"))
    assert is_tiny and spec["checkpoint_path"] == "embedded:tiny-2.3" and spec["distilled_lora"] == "embedded:tiny-2.3"


def test_every_declared_file_names_a_spec_field_a_cli_flag_a_loader_input_and_a_tiny_bundle_file():
    from tests.helpers import load_pack

    loader_inputs = load_pack().NODE_CLASS_MAPPINGS["MGPULoadCheckpoint"].INPUT_TYPES()["required"]
    spec_fields = {field.name for field in fields(ModelSpec)}
    cli = _parsed()
    for declared in RECIPES.values():
        module, runner = declared.official_runner.rsplit(".", 1)
        official_keywords = inspect.signature(getattr(__import__(module, fromlist=[runner]), runner)).parameters
        for file in (*declared.files, *(file for file, _why in declared.refused)):
            assert file.spec_field in spec_fields and file.node_input in loader_inputs, file
            assert hasattr(cli, file.flag.lstrip("-").replace("-", "_")) and file.tiny_file in {f.name for f in fields(tiny.TinyBundle)}, file
        for file in declared.files:  # the CLI flags follow the official runner's keywords
            assert file.flag.lstrip("-").replace("-", "_") in official_keywords, (declared.name, file.flag)


def test_the_docs_recipe_sections_are_the_declarations_rendered():
    text = (REPO / "docs" / "techniques.md").read_text(encoding="utf-8")
    assert recipes.with_recipes_markdown(text) == text, "docs/techniques.md drifted: run python -m mgpu_backend.ltx.recipes docs/techniques.md"
    rendered = recipes.recipes_markdown()
    assert "LTX-2.0: 160, LTX-2.3: 120 stage-1 forwards" in rendered and "LTX-2.0: 8, LTX-2.3: 8 stage-1 forwards" in rendered
    assert rendered.count("\n### ") == len(RECIPES)


def _name_comparisons(path: Path) -> list[str]:
    names = set(RECIPES)
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            constants = [c.value for operand in operands for c in ast.walk(operand) if isinstance(c, ast.Constant)]
            if names & set(constants):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_no_product_module_compares_recipe_names():
    assert len(PRODUCT) > 50
    found = [where for path in PRODUCT if path.name != "recipes.py" for where in _name_comparisons(path)]
    assert found == []
    # The scan finds one where there is one: this file's first test compares recipe("distilled") with DISTILLED.
    assert f"tests/test_recipes.py:{inspect.getsourcelines(test_an_unknown_recipe_is_refused_in_words_listing_the_known_ones)[1] + 1}" in _name_comparisons(Path(__file__))


ADDED_RECIPE = '''
from dataclasses import replace
import json

from mgpu_backend.ltx import recipes

# A new recipe is one more declaration: the distilled one with TDP Upscale for its stage 2.
added = replace(recipes.DISTILLED, name="distilled-tdp", label="Distilled, TDP stage 2", stage2_policy="tdp", upscale_sigmas=(0.625, 0.4, 0.0))
recipes.RECIPES[added.name] = added
recipes.RECIPE_NAMES = tuple(recipes.RECIPES)

import argparse
import types

from mgpu_backend.ltx import schema
from mgpu_backend.ltx.jobs import JobInputError, check_recipe_files
from mgpu_backend.parallel.guidance_parallel import plan_stage2
from mgpu_backend.tools import generate
import importlib.util
import sys

# The pack as ComfyUI imports it (tests.helpers would import the workflow generator, which rightly
# asserts that every recipe ships its workflows).
package = importlib.util.spec_from_file_location("comfyui_mgpu_pack", "__init__.py", submodule_search_locations=["."])
pack = sys.modules["comfyui_mgpu_pack"] = importlib.util.module_from_spec(package)
package.loader.exec_module(pack)

parser = argparse.ArgumentParser()
generate.add_generate_parser(parser.add_subparsers())
spec, is_tiny = generate.build_spec(parser.parse_args(["generate", "--prompt", "x", "--pipeline", "distilled-tdp", "--model-version", "2.3"]))
request = schema.UpscaleRequest.from_wire({"spec": spec, "pipeline": "distilled-tdp"})
try:
    check_recipe_files(types.SimpleNamespace(pipeline="distilled-tdp", op="sample"), replace(schema.ModelSpec.from_wire(spec), distilled_lora="d"))
    refusal = None
except JobInputError as error:
    refusal = str(error)
print(json.dumps({
    "pipelines": list(schema.PIPELINES),
    "steps": schema.defaults_for("2.3", "distilled-tdp").steps,
    "unguided": schema.defaults_for("2.3", "distilled-tdp").video_guidance == schema.NO_GUIDANCE,
    "spec": [spec["checkpoint_path"], spec["distilled_lora"], is_tiny],
    "upscale_sigmas": list(request.sigmas),
    "stage2": plan_stage2(8, 24576, "distilled-tdp").technique,
    "refusal": refusal,
    "loader_choices": pack.NODE_CLASS_MAPPINGS["MGPULoadCheckpoint"].INPUT_TYPES()["required"]["pipeline"][0],
    "ignored": importlib.import_module("comfyui_mgpu_pack.nodes.sampling_nodes").ignored_inputs("distilled-tdp"),
    "docs_sections": recipes.recipes_markdown().count("\\n### "),
}))
'''


def test_a_recipe_added_as_one_declaration_is_served_by_the_schema_cli_jobs_planner_and_nodes():
    import json
    import subprocess
    import sys

    script = "import importlib\n" + ADDED_RECIPE
    completed = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    served = json.loads(completed.stdout.strip().splitlines()[-1])
    assert served == {
        "pipelines": ["two-stage", "distilled", "hq", "keyframes", "distilled-tdp"],
        "steps": 8,
        "unguided": True,
        "spec": ["embedded:tiny-2.3-distilled", None, True],
        "upscale_sigmas": [0.625, 0.4, 0.0],
        "stage2": "tdp",
        "refusal": (
            "the distilled-tdp pipeline runs the distilled checkpoint as it is, with no distilled LoRA; leave distilled_lora out of "
            "the model spec (or use pipeline 'two-stage' or 'hq' or 'keyframes', which takes it)"
        ),
        "loader_choices": ["two-stage", "distilled", "hq", "keyframes", "distilled-tdp"],
        "ignored": ["steps", "video_cfg", "audio_cfg", "stg_scale", "stg_blocks", "rescale", "audio_rescale", "modality_scale", "negative"],
        "docs_sections": 5,
    }


def test_each_recipes_conditioning_is_the_image_helper_its_official_runner_calls():
    import importlib

    helpers = {"first-frame": "combined_image_conditionings(", "keyframes": "image_conditionings_by_adding_guiding_latent("}
    for declared in RECIPES.values():
        module, runner = declared.official_runner.rsplit(".", 1)
        source = inspect.getsource(getattr(importlib.import_module(module), runner))
        called = {conditioning for conditioning, helper in helpers.items() if helper in source}
        assert called == {declared.conditioning}, (declared.name, called)
    assert [declared.conditioning for declared in RECIPES.values()] == ["first-frame", "first-frame", "first-frame", "keyframes"]
    # Stage 1 fuses no LoRA unless the spec chooses a stage-1 strength (as two-stage: ComfyUI's first/last-frame graphs run the LoRA in both stages).
    assert (KEYFRAMES.stage1.lora_set, KEYFRAMES.stage2.lora_set, KEYFRAMES.guidance, KEYFRAMES.stage2_policy, KEYFRAMES.versions) == ("distilled-stage-1-if-chosen", "distilled", "multimodal", "sp", ("2.0", "2.3"))
    # A first image replaces the first latent frame under first-frame; every other image is a guiding latent (one latent frame each).
    assert (recipes.appended_frames("first-frame", [0]), recipes.appended_frames("first-frame", [0, 120]), recipes.appended_frames("keyframes", [0, 120])) == (0, 1, 2)


def test_a_guiding_latent_makes_stage_2_sequence_parallel_and_tiling_is_refused_in_words():
    assert plan_stage2(8, 24576, "two-stage").technique == "tdp"
    with_last = plan_stage2(8, 24576, "two-stage", guiding_latents=1)
    assert (with_last.technique, with_last.sp_degree) == ("sp", 8) and "1 image latent appended to the video, which tiles cannot hold" in with_last.reason
    assert (plan_stage2(1, 24576, "keyframes", guiding_latents=2).technique, plan_stage2(2, 48, "distilled", guiding_latents=1).technique) == ("sp", "sp")
    assert plan_stage2(3, 48, "keyframes").technique == "tdp"  # no image: 3 ranks is no SP degree, tiles as before
    for mode, tiles_given in (("tdp", False), ("auto", True)):
        with pytest.raises(ValueError) as raised:
            plan_stage2(4, 24576, "two-stage", mode, tiles_given=tiles_given, guiding_latents=1)
        assert str(raised.value) == (
            "stage 2 cannot run tiled data parallel with 1 image latent appended to the video (the last image's, or every image's under the "
            "keyframes conditioning): no tile can hold them; leave the tiles out and use parallel 'auto' or 'sp'"
        )
    with pytest.raises(ValueError) as raised:
        plan_stage2(3, 48, "keyframes", guiding_latents=2)
    assert str(raised.value).endswith("but 3 ranks is no usable SP degree for 32 attention heads; run a fleet of 1, 2, 4, 8, 16, 32 ranks")
