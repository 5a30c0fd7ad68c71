"""The ComfyUI nodes without ComfyUI: declarations, the node -> api mapping (api monkeypatched), the AV
LATENT and CONDITIONING layouts, input validation, and how fleet progress, cancel and errors map
onto ComfyUI (fake ComfyUI modules; one test against a real one-rank fleet)."""

from __future__ import annotations

import importlib.util
import logging
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from mgpu_backend.fleet.client import FleetCancelled, FleetError
from mgpu_backend.ltx import api
from tests.helpers import NODES, PACK_DIR, SAMPLER_INPUTS, UPSCALE_INPUTS, FakeComfy, av_latent, contexts, fleet_job, layouts, mgpu_conditioning, node, pack, tiny_handle

CATEGORY = "MGPU/LTX-2"
DISPLAY_NAMES = {
    "Load Checkpoint MGPU", "MGPU Text Encode", "SP Sampler", "TDP Upscale", "Distributed VAE Decode", "MGPU Fleet Control",
    "Load Checkpoint (MGPU fleet)", "Load Diffusion Model (MGPU fleet)",
}  # fmt: skip
WIDGET_KINDS = {"INT", "FLOAT", "STRING", "BOOLEAN"}


model_nodes = sys.modules["comfyui_mgpu_pack.nodes.model_nodes"]
sampling_nodes = sys.modules["comfyui_mgpu_pack.nodes.sampling_nodes"]


def test_pack_entry_imported_as_a_plain_module_registers_nothing_and_does_not_fail():
    # What pytest does to the checkout's __init__.py when the folder name is not a Python
    # identifier (e.g. a clone named comfyui-mgpu): no package, so no relative imports.
    spec = importlib.util.spec_from_file_location("__init__", PACK_DIR / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.NODE_CLASS_MAPPINGS == {} and module.NODE_DISPLAY_NAME_MAPPINGS == {}
    assert len(NODES) == len(DISPLAY_NAMES), "as ComfyUI's package the pack still registers every node"


# --- declarations ----------------------------------------------------------------------------------


def test_pack_exports_six_nodes_with_the_issue_display_names_and_web_directory():
    assert set(pack.NODE_DISPLAY_NAME_MAPPINGS.values()) == DISPLAY_NAMES
    assert set(pack.NODE_DISPLAY_NAME_MAPPINGS) == set(NODES)
    assert pack.WEB_DIRECTORY == "./web"
    scripts = sorted(path.name for path in (PACK_DIR / "web").glob("*.js"))
    assert scripts, "WEB_DIRECTORY holds no JavaScript extension"


def test_nodes_package_is_not_shipped_in_the_wheel():
    # ComfyUI has a top-level module 'nodes': the wheel must not install ours under that name.
    import tomllib
    from setuptools import find_packages

    config = tomllib.loads((PACK_DIR / "pyproject.toml").read_text())
    shipped = find_packages(str(PACK_DIR), **config["tool"]["setuptools"]["packages"]["find"])
    assert "mgpu_backend" in shipped and not [name for name in shipped if name.split(".")[0] in ("nodes", "tests")], shipped


@pytest.mark.parametrize("name", sorted(NODES))
def test_every_input_has_a_tooltip_and_every_widget_a_default_and_range(name):
    node_class = NODES[name]
    assert node_class.CATEGORY == CATEGORY
    assert callable(getattr(node_class, node_class.FUNCTION))
    assert len(node_class.RETURN_TYPES) == len(getattr(node_class, "OUTPUT_TOOLTIPS", ())), "each output needs a tooltip"
    declared = node_class.INPUT_TYPES()
    inputs = {**declared["required"], **declared.get("optional", {})}
    for input_name, spec in inputs.items():
        options = spec[1] if len(spec) > 1 else {}
        tooltip = options.get("tooltip", "")
        assert len(tooltip) >= 20, f"{name}.{input_name}: tooltip {tooltip!r} is missing or too short to act on"
        kind = spec[0]
        if isinstance(kind, list):
            assert options.get("default") in kind, f"{name}.{input_name}: combo default {options.get('default')!r} not among {kind}"
        elif kind in WIDGET_KINDS:
            assert "default" in options, f"{name}.{input_name}: widget without default"
            if kind in ("INT", "FLOAT"):
                assert options["min"] <= options["default"] <= options["max"], f"{name}.{input_name}: default outside [min, max]"
                if kind == "FLOAT":
                    assert options.get("step", 0) > 0, f"{name}.{input_name}: FLOAT without a step"


def test_sampler_widget_defaults_are_the_official_ltx_2_values():
    from ltx_pipelines.utils.constants import LTX_2_PARAMS as official

    required = NODES["MGPUSPSampler"].INPUT_TYPES()["required"]
    defaults = {name: spec[1]["default"] for name, spec in required.items() if len(spec) > 1 and "default" in spec[1]}
    video, audio = official.video_guider_params, official.audio_guider_params
    expected = {"width": official.stage_1_width, "height": official.stage_1_height, "length": official.num_frames,
                "frame_rate": official.frame_rate, "seed": official.seed, "steps": official.num_inference_steps,
                "video_cfg": video.cfg_scale, "audio_cfg": audio.cfg_scale, "stg_scale": video.stg_scale,
                "rescale": video.rescale_scale, "modality_scale": video.modality_scale}  # fmt: skip
    assert {name: defaults[name] for name in expected} == expected
    assert (expected["width"], expected["audio_cfg"]) == (768, 7.0)
    upscale = NODES["MGPUTDPUpscale"].INPUT_TYPES()["required"]
    assert upscale["sigmas"][1]["default"] == "" and upscale["force_from_noise"][1]["default"] is False
    assert sampling_nodes.parse_sigmas("", False) == (0.625, 0.4, 0.0) == sampling_nodes.parse_sigmas("", False, "two-stage")
    assert sampling_nodes.parse_sigmas(" ", False, "distilled") == official_stage_2_sigmas()
    assert upscale["tiles"][1]["default"] == "auto" and upscale["overlap"][1]["default"] == 4


def test_loader_lists_the_embedded_bundles_of_both_versions_first_outside_comfyui():
    required = NODES["MGPULoadCheckpoint"].INPUT_TYPES()["required"]
    for input_name in ("ckpt_name", "distilled_lora", "spatial_upsampler", "gemma"):
        assert required[input_name][0][:2] == ["(embedded tiny LTX-2, random weights)", "(embedded tiny LTX-2.3, random weights)"], input_name
        assert required[input_name][1]["default"] == model_nodes.EMBEDDED
    assert required["gemma_mode"][0] == ["sharded", "batch_parallel"]
    assert required["parallel"][0] == ["auto", "sp", "guidance", "hybrid"]


# --- node -> api mapping ----------------------------------------------------------------------------


def test_loader_names_the_embedded_bundle_and_returns_a_self_describing_handle(fake_api):
    from mgpu_backend.ltx.schema import EMBEDDED_TINY, ModelSpec

    fake_api["load"].result = {"seconds": 0.1}
    (handle,) = node("MGPULoadCheckpoint").load(
        model_nodes.EMBEDDED, model_nodes.EMBEDDED, 0.8, model_nodes.NO_FILE, model_nodes.EMBEDDED,
        " 1, 0 ", "batch_parallel", "hybrid", "float32", unique_id="4",
    )  # fmt: skip
    expected_spec = ModelSpec(EMBEDDED_TINY, EMBEDDED_TINY, None, EMBEDDED_TINY, 0.8).to_wire()
    assert handle == {"spec": expected_spec, "dtype": "float32", "gemma_mode": "batch_parallel", "parallel": "hybrid", "gpus": "1,0", "pipeline": "two-stage"}
    assert fake_api["configure"].calls == [((), {"gpus": "1,0"})]
    ((args, kwargs),) = fake_api["load"].calls
    assert args == (expected_spec,) and kwargs["dtype"] == "float32"
    assert callable(kwargs["progress"]) and callable(kwargs["should_cancel"])
    assert ModelSpec.from_wire(handle["spec"]) == ModelSpec.embedded_tiny(spatial_upsampler=False, distilled_lora_strength=0.8)


def test_text_encode_returns_two_conditionings_carrying_both_contexts_and_their_digest(fake_api):
    positive, negative = api.PromptEncoding(*contexts(1), "1" * 64), api.PromptEncoding(*contexts(2), "2" * 64)
    fake_api["encode"].result = [positive, negative]
    handle = tiny_handle()
    positive_cond, negative_cond = node("MGPUTextEncode").encode(handle, "a fox in snow", "", unique_id="2")
    ((args, kwargs),) = fake_api["encode"].calls
    assert args == (handle["spec"], ["a fox in snow", ""]) and kwargs["dtype"] == "float32" and kwargs["gemma_mode"] == "sharded"
    assert kwargs["free_gemma"] is False
    node("MGPUTextEncode").encode(handle, "a fox in snow", "", free_gemma=True, unique_id="2")
    assert fake_api["encode"].calls[1][1]["free_gemma"] is True
    for conditioning, encoding, prompt in ((positive_cond, positive, "a fox in snow"), (negative_cond, negative, "")):
        ((context, options),) = conditioning
        # ComfyUI's LTX-2 layout: [1, 5, 32 video + 16 audio], what a stock sampler's LTXAV model reads
        assert context.shape == (1, 5, 48)
        assert torch.equal(context[..., :32], encoding.video_context) and torch.equal(context[..., 32:], encoding.audio_context)
        assert options == {"mgpu_prompt": prompt, "mgpu_prompt_digest": encoding.digest, "mgpu_digested_context": context}
        got = layouts.conditioning_contexts(conditioning, "x")
        assert isinstance(got, api.StackedContext) and got.context is context and not got.unprocessed
        assert got.digest == encoding.digest


def test_a_conditioning_whose_video_context_a_native_node_replaced_loses_its_digest():
    positive = mgpu_conditioning(1)
    averaged = [[positive[0][0] * 0.5, dict(positive[0][1])]]  # what ConditioningAverage makes: new tensor, options copied
    assert layouts.conditioning_contexts(positive, "positive").digest == f"{1:064x}"
    got = layouts.conditioning_contexts(averaged, "positive")
    assert got.digest is None, "the fleet's contexts of the digest are not this tensor: send the tensor itself"
    assert got.context is averaged[0][0]


def test_sp_sampler_maps_every_input_onto_api_sample_and_returns_a_concat_av_latent(fake_api):
    video = torch.randn(1, 128, 2, 2, 3)
    audio = torch.randn(1, 8, 9, 16, dtype=torch.bfloat16)
    fake_api["sample"].result = (video, audio)
    positive, negative = mgpu_conditioning(1), mgpu_conditioning(2)
    image = torch.rand(2, 64, 96, 4)
    (latent,) = node("MGPUSPSampler").sample(tiny_handle(), positive, negative, **SAMPLER_INPUTS, image=image, unique_id="5")
    ((args, kwargs),) = fake_api["sample"].calls
    assert args[0] == tiny_handle()["spec"]
    for encoding, conditioning in ((args[1], positive), (args[2], negative)):
        assert encoding.context is conditioning[0][0] and encoding.digest == conditioning[0][1]["mgpu_prompt_digest"]
    expected = {"width": 96, "height": 64, "num_frames": 9, "frame_rate": 25.0, "seed": 7, "steps": 3, "parallel": "sp", "dtype": "float32", "compile_blocks": False}
    assert {key: kwargs[key] for key in expected} == expected
    assert kwargs["video_guidance"] == api.Guidance(cfg_scale=3.5, stg_scale=1.0, rescale_scale=0.5, modality_scale=2.0, stg_blocks=(1,))
    assert kwargs["audio_guidance"] == api.Guidance(cfg_scale=6.0, stg_scale=1.0, rescale_scale=0.5, modality_scale=2.0, stg_blocks=(1,))
    assert kwargs["image"].shape == (64, 96, 3) and torch.equal(kwargs["image"], image[0, :, :, :3])
    got_video, got_audio = latent["samples"].unbind()
    assert torch.equal(got_video, video) and got_video.dtype == torch.float32
    assert torch.equal(got_audio, audio.float()) and got_audio.dtype == torch.float32
    assert latent["sample_rate"] == 16000 and latent["type"] == "audio" and latent["frame_rate"] == 25.0 and latent["mgpu_stages"] == 1


def test_sp_sampler_explicit_parallel_plan_and_compile_blocks_reach_the_job_and_empty_stg_blocks_means_default(fake_api):
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 9, 16))
    node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **{**SAMPLER_INPUTS, "parallel": "guidance", "stg_blocks": " "}, compile_blocks=True)
    kwargs = fake_api["sample"].calls[0][1]
    assert kwargs["parallel"] == "guidance" and kwargs["image"] is None and kwargs["compile_blocks"] is True
    assert kwargs["video_guidance"].stg_blocks is None and kwargs["audio_guidance"].stg_blocks is None


def test_tdp_upscale_passes_the_input_audio_through_unchanged(fake_api):
    latent, video, audio = av_latent(frame_rate=24.0)
    refined = torch.randn(1, 128, 2, 4, 6)
    fake_api["upscale"].result = (refined, audio.to(torch.bfloat16).float() + 1.0)  # a fleet that changed the audio
    positive = mgpu_conditioning(3)
    (result,) = node("MGPUTDPUpscale").upscale(tiny_handle(), latent, positive, **{**UPSCALE_INPUTS, "tiles": "2x3"}, unique_id="6")
    ((args, kwargs),) = fake_api["upscale"].calls
    assert args[1] is video and args[2] is audio and args[3].context is positive[0][0] and args[3].digest == f"{3:064x}"
    expected = {"frame_rate": 24.0, "seed": 11, "sigmas": (0.625, 0.4, 0.0), "tiles": (2, 3), "overlap": 2, "force_from_noise": False, "image": None}
    assert {key: kwargs[key] for key in expected} == expected
    out_video, out_audio = result["samples"].unbind()
    assert torch.equal(out_video, refined)
    max_diff = (out_audio - audio).abs().max().item()
    assert max_diff == 0.0, f"stage 2 changed the audio latent: max abs difference {max_diff}"
    assert result["frame_rate"] == 24.0 and result["mgpu_stages"] == 2


def test_distributed_decode_returns_comfy_image_and_audio(fake_api):
    latent, video, audio = av_latent()
    frames = torch.rand(9, 64, 96, 3)
    waveform = torch.randn(1, 2, 9000)
    fake_api["decode"].result = (frames, waveform, 24000)
    latent["mgpu_stages"] = 2
    images, sound = node("MGPUDistributedVAEDecode").decode(tiny_handle(), latent, 3, 256, 32)
    ((args, kwargs),) = fake_api["decode"].calls
    assert args[1] is video and args[2] is audio
    assert (kwargs["seed"], kwargs["spatial_tile_pixels"], kwargs["temporal_tile_frames"]) == (3, 256, 32)
    assert (kwargs["frame_rate"], kwargs["after_stages"]) == (24.0, 2), "the decoder noise must follow the stages that made the latent"
    assert images.shape == (9, 64, 96, 3) and images.dtype == torch.float32 and torch.equal(images, frames)
    assert sound["sample_rate"] == 24000 and torch.equal(sound["waveform"], waveform)


def test_distributed_decode_takes_a_video_only_latent_and_returns_no_audio(fake_api):
    video = torch.randn(1, 128, 2, 2, 3)
    fake_api["decode"].result = (torch.rand(9, 64, 96, 3), None, None)
    images, sound = node("MGPUDistributedVAEDecode").decode(tiny_handle(), {"samples": video}, 10, 512, 64)
    assert fake_api["decode"].calls[0][0][2] is None and sound is None and images.shape == (9, 64, 96, 3)
    assert (fake_api["decode"].calls[0][1]["frame_rate"], fake_api["decode"].calls[0][1]["after_stages"]) == (24.0, 0)


# --- AV LATENT layout ---------------------------------------------------------------------------------


@pytest.fixture
def comfy_nested_tensor(monkeypatch):
    """ComfyUI's own comfy.nested_tensor (only that module) when COMFYUI_DIR names a checkout."""
    import os

    comfy_dir = os.environ.get("COMFYUI_DIR")
    path = Path(comfy_dir or "/nonexistent") / "comfy" / "nested_tensor.py"
    if not path.is_file():
        pytest.skip("set COMFYUI_DIR to a ComfyUI checkout to test against its NestedTensor")
    spec = importlib.util.spec_from_file_location("comfy.nested_tensor", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.nested_tensor", module)
    return module


def test_av_latent_is_comfy_nested_tensor_that_native_separate_unbinds(comfy_nested_tensor):
    latent, video, audio = av_latent()
    assert isinstance(latent["samples"], comfy_nested_tensor.NestedTensor)
    # What LTXVSeparateAVLatent does with it:
    parts = latent["samples"].unbind()
    assert parts[0] is not None and torch.equal(parts[0], video) and torch.equal(parts[1], audio)
    # A latent built by native LTXVConcatAVLatent parses back into the same tensors.
    native = {"samples": comfy_nested_tensor.NestedTensor((video, audio)), "sample_rate": 16000, "type": "audio"}
    got_video, got_audio = layouts.split_latent(native, "av_latent")
    assert got_video is video and got_audio is audio


def test_av_latent_outside_comfyui_uses_the_stand_in_with_the_same_surface():
    latent, video, audio = av_latent()
    samples = latent["samples"]
    assert samples.is_nested and samples.shape == video.shape
    assert torch.equal(samples.unbind()[0], video) and torch.equal(samples.unbind()[1], audio)
    got_video, got_audio = layouts.split_latent(latent, "av_latent")
    assert torch.equal(got_video, video) and torch.equal(got_audio, audio)
    assert set(latent) == {"samples", "sample_rate", "type", "frame_rate"}


def test_split_latent_refuses_batches_audio_only_and_foreign_latents():
    video, audio = torch.zeros(2, 128, 2, 2, 3), torch.zeros(1, 8, 5, 16)
    with pytest.raises(ValueError, match="batch of 2.*batch_size 1"):
        layouts.split_latent(layouts.make_av_latent(video, audio, 24), "av_latent")
    with pytest.raises(ValueError, match="audio-only LATENT"):
        layouts.split_latent({"samples": audio}, "av_latent")
    with pytest.raises(ValueError, match=r"not an LTX-2 latent: samples \[1, 4, 64, 64\]"):
        layouts.split_latent({"samples": torch.zeros(1, 4, 64, 64)}, "av_latent")
    with pytest.raises(ValueError, match=r"\[1, 16, 2, 2, 3\], not LTX-2's"):
        layouts.split_latent({"samples": torch.zeros(1, 16, 2, 2, 3)}, "av_latent")


# --- validation before any work ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"length": 120}, r"frames must be 8k\+1.*got 120; use 121"),
        ({"width": 100}, r"width must be a multiple of 32.*got 100; use 96"),
        ({"height": 48}, r"height must be a multiple of 32.*got 48; use 64"),
        ({"stg_blocks": "29a"}, r"stg_blocks must be transformer block indices"),
    ],
)
def test_sp_sampler_refuses_bad_inputs_before_calling_the_fleet(fake_api, overrides, message):
    with pytest.raises(ValueError, match=message):
        node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **{**SAMPLER_INPUTS, **overrides})
    assert fake_api["sample"].calls == []


def test_stock_conditioning_reaches_the_fleet_in_comfyuis_layout_and_combined_ones_are_refused(fake_api):
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 9, 16))
    stock = [[torch.zeros(1, 5, 48), {"pooled_output": None, "unprocessed_ltxav_embeds": True}]]
    node("MGPUSPSampler").sample(tiny_handle(), stock, mgpu_conditioning(2), **SAMPLER_INPUTS)
    assert fake_api["sample"].calls[0][0][1] == api.StackedContext(stock[0][0], unprocessed=True, digest=None)
    combined = mgpu_conditioning(1) + mgpu_conditioning(2)
    with pytest.raises(ValueError, match="holds 2 conditionings"):
        node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), combined, **SAMPLER_INPUTS)
    assert len(fake_api["sample"].calls) == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sigmas": "1.0, 0.5, 0.0"}, r"start at 1.0 \(pure noise\).*force_from_noise"),
        ({"sigmas": "0.4, 0.625, 0.0"}, r"decrease strictly"),
        ({"sigmas": "0.6, abc"}, r"numbers separated by commas"),
        ({"sigmas": "0.5"}, r"at least two values"),
        ({"tiles": "3"}, r"tiles must be 'auto' or HxW"),
        ({"tiles": "0x2"}, r"tiles must be 'auto' or HxW"),
        ({"frame_rate": 25.0}, r"sampled at 24.0 fps but frame_rate is 25.0"),
    ],
)
def test_tdp_upscale_refuses_bad_inputs_before_calling_the_fleet(fake_api, overrides, message):
    latent, _, _ = av_latent(frame_rate=24.0)
    with pytest.raises(ValueError, match=message):
        node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(1), **{**UPSCALE_INPUTS, **overrides})
    assert fake_api["upscale"].calls == []


def test_tdp_upscale_from_noise_runs_only_when_forced(fake_api):
    latent, video, audio = av_latent()
    fake_api["upscale"].result = (video, audio)
    node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(1), **{**UPSCALE_INPUTS, "sigmas": "1.0, 0.0", "force_from_noise": True})
    assert fake_api["upscale"].calls[0][1]["sigmas"] == (1.0, 0.0) and fake_api["upscale"].calls[0][1]["force_from_noise"] is True


def test_tdp_upscale_needs_upsampler_lora_audio_and_a_known_frame_rate(fake_api):
    latent, video, _ = av_latent()
    with pytest.raises(ValueError, match="needs spatial_upsampler and distilled_lora"):
        node("MGPUTDPUpscale").upscale(tiny_handle(spatial_upsampler_path=None, distilled_lora=None), latent, mgpu_conditioning(1), **UPSCALE_INPUTS)
    with pytest.raises(ValueError, match="has no audio"):
        node("MGPUTDPUpscale").upscale(tiny_handle(), {"samples": video}, mgpu_conditioning(1), **UPSCALE_INPUTS)
    native, _, _ = av_latent(frame_rate=None)
    with pytest.raises(ValueError, match="does not record its frame rate.*e.g. 24"):
        node("MGPUTDPUpscale").upscale(tiny_handle(), native, mgpu_conditioning(1), **UPSCALE_INPUTS)
    assert fake_api["upscale"].calls == []


@pytest.mark.parametrize(
    ("files", "message"),
    [
        (("(embedded tiny LTX-2, random weights)", "(none)", "(none)", "gemma-3-12b"), "only works with its own text encoder"),
        (("(embedded tiny LTX-2, random weights)", "real-lora.safetensors", "(none)", "(embedded tiny LTX-2, random weights)"), "does not fit the embedded tiny checkpoint"),
        (("ltx-2-19b-dev.safetensors", "(none)", "(none)", "(embedded tiny LTX-2, random weights)"), "the tiny bundle is one set"),
        (("(embedded tiny LTX-2.3, random weights)", "(none)", "(none)", "(embedded tiny LTX-2, random weights)"),
         "only works with its own text encoder: set gemma to '\\(embedded tiny LTX-2.3, random weights\\)'"),
        (("(embedded tiny LTX-2.3, random weights)", "(embedded tiny LTX-2, random weights)", "(none)", "(embedded tiny LTX-2.3, random weights)"),
         "distilled_lora '\\(embedded tiny LTX-2, random weights\\)' does not fit the embedded tiny checkpoint '\\(embedded tiny LTX-2.3"),
        (("(embedded tiny LTX-2, random weights)", "(none)", "(embedded tiny LTX-2.3, random weights)", "(embedded tiny LTX-2, random weights)"),
         "spatial_upsampler .* does not fit the embedded tiny checkpoint"),
    ],
)
def test_loader_refuses_mixing_the_tiny_bundle_with_real_files(fake_api, files, message):
    ckpt, lora, upsampler, gemma = files
    with pytest.raises(ValueError, match=message):
        node("MGPULoadCheckpoint").load(ckpt, lora, 1.0, upsampler, gemma, "all", "sharded", "auto", "bfloat16")
    assert fake_api["load"].calls == []


@pytest.mark.parametrize("text", ["0,0", "gpu0", "1;2", "-1"])
def test_loader_refuses_malformed_gpu_lists(fake_api, text):
    with pytest.raises(ValueError, match="gpus must be 'all' or a list of distinct GPU indices like 0,1"):
        node("MGPULoadCheckpoint").load(model_nodes.EMBEDDED, model_nodes.EMBEDDED, 1.0, model_nodes.EMBEDDED, model_nodes.EMBEDDED, text, "sharded", "auto", "bfloat16")
    assert fake_api["configure"].calls == [] and fake_api["load"].calls == []


def test_nodes_refuse_a_model_input_that_is_not_an_mgpu_handle(fake_api):
    with pytest.raises(ValueError, match="must come from 'Load Checkpoint MGPU'"):
        node("MGPUTextEncode").encode(object(), "a fox", "")


# --- progress, cancel and errors ----------------------------------------------------------------------


def scripted_job(steps: int, cancel_at_poll: int | None = None, interrupt_after_step: int | None = None, comfy=None):
    """A fake api function: emits progress, polls should_cancel like the client, cancels like the fleet."""

    def run(*, progress, should_cancel):
        polls = 0
        for step in range(1, steps + 1):
            progress({"stage": "stage1", "step": step, "total": steps, "seconds": 0.5, "rank_seconds": [0.5, 0.75]})
            if comfy is not None and interrupt_after_step == step:
                comfy.interrupted = True
            polls += 1
            if should_cancel():
                raise FleetCancelled(f"cancelled at step {step}", "cancelled")
        return f"finished {steps} steps after {polls} polls"

    return run


def test_progress_drives_the_comfy_bar_per_rank_text_and_panel_events(monkeypatch):
    comfy = FakeComfy(monkeypatch)
    job = fleet_job.FleetJob("12", "SP Sampler")
    assert job.call(scripted_job(3)) == "finished 3 steps after 3 polls"
    assert comfy.bar_updates == [("12", 1, 3), ("12", 2, 3), ("12", 3, 3)]
    assert comfy.texts[0] == ("12", "stage1 1/3 · 0.50 s/step · rank 0 0.50 s | rank 1 0.75 s")
    assert comfy.texts[-1][1].startswith("stage1 3/3")  # the last step is never throttled away
    assert [event for event, _ in comfy.events] == ["mgpu.status"] * 3
    assert comfy.events[-1][1] == {"node": "12", "title": "SP Sampler", "stage": "stage1", "step": 3, "total": 3, "seconds": 0.5, "rank_seconds": [0.5, 0.75]}


def test_comfy_interrupt_becomes_a_fleet_cancel_then_comfys_interrupt_exception(monkeypatch):
    comfy = FakeComfy(monkeypatch)
    job = fleet_job.FleetJob("5", "SP Sampler")
    with pytest.raises(FakeComfy.InterruptProcessingException):
        job.call(scripted_job(10, interrupt_after_step=2, comfy=comfy))
    assert job.cancel_requested
    assert comfy.bar_updates[-1] == ("5", 2, 10), "the job went on after the interrupt"
    assert comfy.interrupted is False, "ComfyUI's interrupt flag must be cleared for the next prompt"


def test_interrupt_raised_by_the_progress_hook_does_not_escape_mid_job(monkeypatch):
    comfy = FakeComfy(monkeypatch)
    job = fleet_job.FleetJob("5", "TDP Upscale")
    comfy.interrupted = True  # set before the first progress event: the bar's hook raises it
    with pytest.raises(FakeComfy.InterruptProcessingException):
        job.call(scripted_job(10))
    assert job.cancel_requested and comfy.bar_updates == [("5", 1, 10)]


def test_fleet_error_becomes_runtime_error_with_the_fleet_message_and_logged_traceback(monkeypatch, caplog):
    FakeComfy(monkeypatch)

    def failing(*, progress, should_cancel):
        raise FleetError("out of memory on cuda:2", rank=2, traceback="Traceback...\nOutOfMemoryError: CUDA out of memory")

    with caplog.at_level(logging.ERROR, logger="comfyui-mgpu"), pytest.raises(RuntimeError) as raised:
        fleet_job.FleetJob("7", "Distributed VAE Decode").call(failing)
    assert str(raised.value) == "Distributed VAE Decode: out of memory on cuda:2 (rank 2)"
    assert "OutOfMemoryError: CUDA out of memory" in caplog.text


def test_cancel_without_comfyui_surfaces_as_fleet_cancelled():
    job = fleet_job.FleetJob(None, "SP Sampler")
    job.cancel_requested = True
    with pytest.raises(FleetCancelled):
        job.call(scripted_job(3))


@pytest.fixture
def one_rank_fleet(tmp_path, monkeypatch):
    from .fleet_harness import api_fleet

    yield from api_fleet(tmp_path, monkeypatch)


def test_comfy_interrupt_cancels_a_real_fleet_job_which_keeps_serving(monkeypatch, one_rank_fleet):
    comfy = FakeComfy(monkeypatch)
    job = fleet_job.FleetJob("9", "SP Sampler")
    real_progress = job.progress

    def progress_then_press_cancel(event):
        real_progress(event)
        if event["step"] == 2:
            comfy.interrupted = True

    job.progress = progress_then_press_cancel
    with pytest.raises(FakeComfy.InterruptProcessingException):
        job.call(api.run, "count", {"steps": 200, "seconds_per_step": 0.02})
    stopped_at = comfy.bar_updates[-1][1]
    assert 2 <= stopped_at < 200, f"cancel did not stop the job early: last step {stopped_at}"
    result = fleet_job.FleetJob("9", "SP Sampler").call(api.run, "count", {"steps": 3})
    assert result.fields == {"steps": 3, "total": 3.0}, result.fields
    status = api.status()
    assert status["jobs_completed"] >= 1 and status["current_job"] is None and math.isclose(len(status["ranks"]), 1)


def test_fleet_control_shows_unloads_and_stops_a_real_fleet(one_rank_fleet):
    control = node("MGPUFleetControl")
    assert math.isnan(NODES["MGPUFleetControl"].IS_CHANGED("status")), "a cached status would be stale"
    (text,) = control.control("status")["result"]
    assert text.startswith("server pid ") and "1 CPU rank(s)" in text.splitlines()[0] and "rank 0: pid " in text and "cpu alive" in text and "current job: none" in text, text
    (text,) = control.control("unload models")["result"]
    assert text.startswith("models unloaded; the next MGPU node reloads its model"), text
    (text,) = control.control("restart fleet")["result"]
    assert text.startswith("fleet stopped; it was started by hand (MGPU_SOCKET is set)") and "fleet not running" in text, text
    (text,) = control.control("status")["result"]
    assert text.startswith("fleet not running: no fleet server answers at"), text


def test_loader_warns_on_the_node_when_the_running_fleet_has_other_gpus(fake_api, monkeypatch, caplog):
    comfy = FakeComfy(monkeypatch)
    monkeypatch.delenv("MGPU_CPU_RANKS", raising=False)
    monkeypatch.setattr(model_nodes, "status_snapshot", lambda: {"running": True, "devices": "GPUs 0,1,2,3"})
    with caplog.at_level(logging.WARNING, logger="comfyui-mgpu"):
        node("MGPULoadCheckpoint").load(model_nodes.EMBEDDED, model_nodes.EMBEDDED, 1.0, model_nodes.EMBEDDED, model_nodes.EMBEDDED, "0,1", "sharded", "auto", "bfloat16", unique_id="1")
    expected = "the fleet already runs on GPUs 0,1,2,3, not GPUs 0,1; press Restart in the MGPU panel to apply gpus=0,1"
    assert ("1", expected) in comfy.texts and expected in caplog.text


# --- the ComfyUI process stays light ------------------------------------------------------------------

COMFY_SIDE_SCRIPT = r"""
import importlib.util, json, os, sys, types
from pathlib import Path

import torch

pack_dir = Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("comfyui_mgpu_pack", pack_dir / "__init__.py", submodule_search_locations=[str(pack_dir)])
pack = importlib.util.module_from_spec(spec)
sys.modules["comfyui_mgpu_pack"] = pack
spec.loader.exec_module(pack)
for node_class in pack.NODE_CLASS_MAPPINGS.values():
    node_class.INPUT_TYPES()

from mgpu_backend.ltx import api

sent = []

def fleet_run(op, args, tensors=None, progress=None, should_cancel=None, log=None, preview=None):
    # The transport alone is replaced: requests are built and checked by the real api and schema.
    sent.append((op, json.loads(json.dumps(args)), sorted(tensors or {})))
    video, audio = torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 9, 16)
    if op == "encode":
        return types.SimpleNamespace(fields={"digests": ["d" * 64, "e" * 64]}, tensors={
            "video_context_0": torch.zeros(1, 4, 8), "audio_context_0": torch.zeros(1, 4, 4),
            "video_context_1": torch.ones(1, 4, 8), "audio_context_1": torch.ones(1, 4, 4)})
    if op == "decode":
        return types.SimpleNamespace(fields={"sample_rate": 24000}, tensors={"frames": torch.zeros(9, 64, 96, 3), "waveform": torch.zeros(1, 2, 10)})
    return types.SimpleNamespace(fields={"bytes_read": 0}, tensors={"video_latent": video, "audio_latent": audio})

api.run = fleet_run
nodes = {name: cls() for name, cls in pack.NODE_CLASS_MAPPINGS.items()}
model_nodes = sys.modules["comfyui_mgpu_pack.nodes.model_nodes"]
E = model_nodes.EMBEDDED
(handle,) = nodes["MGPULoadCheckpoint"].load(E, E, 1.0, E, E, "all", "sharded", "auto", "bfloat16")
positive, negative = nodes["MGPUTextEncode"].encode(handle, "a fox", "blurry")
refusals = []
for call in (
    lambda: nodes["MGPUSPSampler"].sample(handle, positive, negative, 96, 64, 120, 24.0, 7, 3, 3.0, 7.0, 1.0, "", 0.7, 3.0, "auto"),
    lambda: nodes["MGPUSPSampler"].sample(handle, positive, negative, 100, 64, 9, 24.0, 7, 3, 3.0, 7.0, 1.0, "", 0.7, 3.0, "auto"),
):
    try:
        call()
    except ValueError as exc:
        refusals.append(str(exc))
(latent,) = nodes["MGPUSPSampler"].sample(handle, positive, negative, 96, 64, 9, 24.0, 7, 3, 3.0, 7.0, 1.0, "", 0.7, 3.0, "auto")
for sigmas in ("1.0, 0.5, 0.0", "0.4, 0.625, 0.0"):
    try:
        nodes["MGPUTDPUpscale"].upscale(handle, latent, positive, 7, sigmas, "auto", 4, 0.0, False)
    except ValueError as exc:
        refusals.append(str(exc))
(upscaled,) = nodes["MGPUTDPUpscale"].upscale(handle, latent, positive, 7, "0.625, 0.4, 0.0", "auto", 4, 0.0, False)
nodes["MGPUDistributedVAEDecode"].decode(handle, upscaled, 7, 512, 64)
E23 = model_nodes.EMBEDDED_2_3
(handle_2_3,) = nodes["MGPULoadCheckpoint"].load(E23, E23, 1.0, E23, E23, "all", "sharded", "auto", "bfloat16")
nodes["MGPUSPSampler"].sample(handle_2_3, positive, negative, 96, 64, 9, 24.0, 7, 40, 3.0, 7.0, 1.0, "29", 0.7, 3.0, "auto")
cache = Path(os.environ["MGPU_CACHE_DIR"])
print(json.dumps({
    "heavy_modules": sorted(m for m in sys.modules if m.split(".")[0] in ("ltx_core", "ltx_pipelines", "sentencepiece", "transformers")
                            or m in ("mgpu_backend.ltx.loading", "mgpu_backend.ltx.validation", "mgpu_backend.ltx.jobs", "mgpu_backend.bundles.tiny")),
    "files_written": sorted(str(p) for p in cache.rglob("*")) if cache.exists() else [],
    "sent": sent,
    "refusals": refusals,
}))
"""


def test_the_comfyui_side_imports_no_model_code_and_writes_no_bundle(tmp_path):
    """The pack imported as ComfyUI imports it, every node's INPUT_TYPES, their input checks and a whole
    two-stage graph built into fleet requests (the transport replaced), in a fresh interpreter."""
    import json
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(PACK_DIR), "MGPU_CACHE_DIR": str(tmp_path / "cache")}
    completed = subprocess.run([sys.executable, "-c", COMFY_SIDE_SCRIPT, str(PACK_DIR)], env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["heavy_modules"] == [] and report["files_written"] == []
    assert [op for op, _, _ in report["sent"]] == ["load", "encode", "sample", "upscale", "decode", "load", "sample"]
    assert report["refusals"][0].startswith("frames must be 8k+1") and "multiple of 32" in report["refusals"][1]
    assert "refuses to start from pure noise" in report["refusals"][2] and "decrease strictly" in report["refusals"][3]
    load, encode, sample, upscale, _, load_2_3, sample_2_3 = (args for _, args, _ in report["sent"])
    assert load_2_3["spec"]["checkpoint_path"] == "embedded:tiny-2.3" == sample_2_3["spec"]["gemma_root"] and sample_2_3["steps"] == 40
    assert load["spec"]["checkpoint_path"] == "embedded:tiny" == encode["spec"]["gemma_root"]
    # Prompts travel by digest: no context tensor goes with the jobs that name one.
    assert (sample["positive_digest"], sample["negative_digest"], upscale["positive_digest"]) == ("d" * 64, "e" * 64, "d" * 64)
    assert [tensors for op, _, tensors in report["sent"] if op in ("sample", "upscale")] == [[], ["audio_latent", "video_latent"], []]
    assert sample["audio_guidance"]["cfg_scale"] == 7.0 and sample["steps"] == 3


# --- the distilled recipe -------------------------------------------------------------------------


def official_stage_2_sigmas():
    from ltx_pipelines.utils.constants import STAGE_2_DISTILLED_SIGMA_VALUES

    return tuple(STAGE_2_DISTILLED_SIGMA_VALUES)


def distilled_handle(**overrides):
    handle = tiny_handle(distilled_lora=None, **overrides)
    return {**handle, "pipeline": "distilled"}


def test_loader_pipeline_choice_builds_the_distilled_spec_and_the_handle_carries_it(fake_api):
    from mgpu_backend.ltx.schema import EMBEDDED_TINY, EMBEDDED_TINY_DISTILLED, ModelSpec

    required = NODES["MGPULoadCheckpoint"].INPUT_TYPES()["required"]
    assert required["pipeline"][0] == ["two-stage", "distilled", "hq", "keyframes"] and required["pipeline"][1]["default"] == "two-stage"
    fake_api["load"].result = {"seconds": 0.1}
    (handle,) = node("MGPULoadCheckpoint").load(
        model_nodes.EMBEDDED, model_nodes.NO_FILE, 1.0, model_nodes.EMBEDDED, model_nodes.EMBEDDED,
        "all", "sharded", "auto", "bfloat16", pipeline="distilled", unique_id="4",
    )  # fmt: skip
    assert handle["pipeline"] == "distilled"
    assert ModelSpec.from_wire(handle["spec"]) == ModelSpec(EMBEDDED_TINY_DISTILLED, EMBEDDED_TINY, EMBEDDED_TINY) == ModelSpec.embedded_tiny_for("distilled")
    assert fake_api["load"].calls[0][0] == (handle["spec"],)
    with pytest.raises(ValueError, match="the distilled pipeline runs the distilled checkpoint with no distilled LoRA.*set distilled_lora to '\\(none\\)'"):
        node("MGPULoadCheckpoint").load(model_nodes.EMBEDDED, model_nodes.EMBEDDED, 1.0, model_nodes.EMBEDDED, model_nodes.EMBEDDED,
                                        "all", "sharded", "auto", "bfloat16", pipeline="distilled")  # fmt: skip
    assert len(fake_api["load"].calls) == 1


def test_loader_hq_choice_carries_the_per_stage_strengths_and_refuses_an_ltx_2_0_checkpoint_before_loading(fake_api):
    from mgpu_backend.ltx.schema import EMBEDDED_TINY_2_3, ModelSpec

    optional = NODES["MGPULoadCheckpoint"].INPUT_TYPES()["optional"]
    # -1: the recipe's own strength (hq: 0.25 and 0.5, as its official runner; two-stage: no LoRA in stage 1).
    assert {name: value[1]["default"] for name, value in optional.items()} == {"distilled_lora_strength_stage_1": -1.0, "distilled_lora_strength_stage_2": -1.0}
    assert optional["distilled_lora_strength_stage_1"][1]["tooltip"].startswith(
        "The two-stage, hq and keyframes pipelines only: the distilled LoRA's strength in stage 1. -1: the recipe's own (two-stage: none unless set; "
        "hq: 0.25; keyframes: none unless set, as their official runners); 0: no distilled LoRA there."
    )
    (default,) = node("MGPULoadCheckpoint").load(model_nodes.EMBEDDED_2_3, model_nodes.EMBEDDED_2_3, 1.0, model_nodes.EMBEDDED_2_3, model_nodes.EMBEDDED_2_3,
                                                 "all", "sharded", "auto", "bfloat16", pipeline="hq", distilled_lora_strength_stage_1=-1.0, distilled_lora_strength_stage_2=-1.0)  # fmt: skip
    assert (default["spec"]["distilled_lora_strength_stage_1"], default["spec"]["distilled_lora_strength_stage_2"]) == (None, None)
    fake_api["load"].result = {"seconds": 0.1}
    files = (model_nodes.EMBEDDED_2_3, model_nodes.EMBEDDED_2_3, 1.0, model_nodes.EMBEDDED_2_3, model_nodes.EMBEDDED_2_3)
    (handle,) = node("MGPULoadCheckpoint").load(*files, "all", "sharded", "auto", "bfloat16", pipeline="hq", unique_id="4",
                                                distilled_lora_strength_stage_1=0.3, distilled_lora_strength_stage_2=0.6)  # fmt: skip
    spec = ModelSpec.from_wire(handle["spec"])
    assert (handle["pipeline"], spec.checkpoint_path, spec.distilled_lora) == ("hq", EMBEDDED_TINY_2_3, EMBEDDED_TINY_2_3)
    assert (spec.distilled_lora_strength_stage_1, spec.distilled_lora_strength_stage_2) == (0.3, 0.6)
    old = (model_nodes.EMBEDDED, model_nodes.EMBEDDED, 1.0, model_nodes.EMBEDDED, model_nodes.EMBEDDED)
    with pytest.raises(ValueError, match=r"the hq pipeline runs LTX-2.3 only \(ltx-pipelines has its parameters for no other version\), got an LTX-2.0 checkpoint"):
        node("MGPULoadCheckpoint").load(*old, "all", "sharded", "auto", "bfloat16", pipeline="hq")
    assert len(fake_api["load"].calls) == 2


def test_sp_sampler_sends_the_audio_its_own_rescale_as_the_hq_recipe_has_it(fake_api):
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 7, 16))
    inputs = {**SAMPLER_INPUTS, "rescale": 0.45}
    node("MGPUSPSampler").sample({**tiny_handle(), "pipeline": "hq"}, mgpu_conditioning(1), mgpu_conditioning(2), **inputs, audio_rescale=1.0)
    node("MGPUSPSampler").sample({**tiny_handle(), "pipeline": "hq"}, mgpu_conditioning(1), mgpu_conditioning(2), **inputs)
    (_args, own), (_args2, same) = fake_api["sample"].calls
    assert own["pipeline"] == "hq" and (own["video_guidance"].rescale_scale, own["audio_guidance"].rescale_scale) == (0.45, 1.0)
    assert (same["video_guidance"].rescale_scale, same["audio_guidance"].rescale_scale) == (0.45, 0.45)  # -1 (the default): the same as rescale


def test_sp_sampler_with_a_distilled_model_sends_the_recipe_defaults_and_no_negative(fake_api, monkeypatch):
    notes = []
    monkeypatch.setattr(sampling_nodes, "node_note", lambda node_id, text: notes.append((node_id, text)))
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 7, 16))
    node("MGPUSPSampler").sample(distilled_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **SAMPLER_INPUTS, unique_id="9")
    ((args, kwargs),) = fake_api["sample"].calls
    assert args[2] is None, "the distilled recipe runs no unconditional pass: no negative prompt goes to the fleet"
    assert kwargs["pipeline"] == "distilled" and kwargs["steps"] is None
    assert kwargs["video_guidance"] is None and kwargs["audio_guidance"] is None
    assert (kwargs["width"], kwargs["height"], kwargs["seed"]) == (96, 64, 7)
    assert notes == [("9", "distilled pipeline: 8 fixed distilled steps, one unguided pass each; steps, video_cfg, audio_cfg, "
                           "stg_scale, stg_blocks, rescale, audio_rescale, modality_scale, negative are ignored")]  # fmt: skip


def test_tdp_upscale_with_a_distilled_model_needs_no_lora_runs_the_official_tail_and_keeps_sp_audio(fake_api, monkeypatch):
    monkeypatch.setattr(sampling_nodes, "node_note", lambda node_id, text: None)
    latent, video, audio = av_latent(frame_rate=24.0)
    refined_video, refined_audio = torch.randn(1, 128, 2, 4, 6), audio + 0.5

    def fleet_upscale(*args, fields=None, parallel="auto", **kwargs):
        fields.update(stage2_parallel="sp" if parallel == "sp" else "tdp", plan="stage-2 plan", audio="...")
        return refined_video, refined_audio

    fake_api["upscale"].result = fleet_upscale
    inputs = {**UPSCALE_INPUTS, "sigmas": ""}
    (sp_result,) = node("MGPUTDPUpscale").upscale(distilled_handle(), latent, mgpu_conditioning(3), **inputs, stage2_parallel="sp")
    kwargs = fake_api["upscale"].calls[0][1]
    assert kwargs["pipeline"] == "distilled" and kwargs["parallel"] == "sp" and kwargs["sigmas"] == official_stage_2_sigmas()
    sp_audio = sp_result["samples"].unbind()[1]
    assert torch.equal(sp_audio[:, :, :9], refined_audio), "under SP the fleet's re-denoised audio is the result"
    assert sp_audio.shape[2] == 10 and torch.equal(sp_audio[:, :, 9], refined_audio[:, :, 8]), "at ComfyUI's length: 9 frames at 24 fps take 10"
    (tdp_result,) = node("MGPUTDPUpscale").upscale(distilled_handle(), latent, mgpu_conditioning(3), **inputs, stage2_parallel="tdp")
    assert torch.equal(tdp_result["samples"].unbind()[1], audio), "under TDP the stage-1 audio passes through"
    with pytest.raises(ValueError, match="needs spatial_upsampler;"):
        node("MGPUTDPUpscale").upscale(distilled_handle(spatial_upsampler_path=None), latent, mgpu_conditioning(3), **inputs)
    with pytest.raises(ValueError, match="tiles '2x2' apply to stage2_parallel tdp only"):
        node("MGPUTDPUpscale").upscale(distilled_handle(), latent, mgpu_conditioning(3), **{**inputs, "tiles": "2x2"}, stage2_parallel="sp")
    assert len(fake_api["upscale"].calls) == 2


# --- model versions -------------------------------------------------------------------------------


@pytest.mark.parametrize(("pipeline", "lora"), [("two-stage", "(embedded tiny LTX-2.3, random weights)"), ("distilled", "(none)")])
def test_loader_embedded_2_3_entry_builds_the_tiny_2_3_spec_of_the_pipeline_and_names_the_version(fake_api, monkeypatch, pipeline, lora):
    from mgpu_backend.ltx.schema import EMBEDDED_TINY_2_3, EMBEDDED_TINY_2_3_DISTILLED, ModelSpec

    notes = []
    monkeypatch.setattr(model_nodes, "node_note", lambda node_id, text: notes.append((node_id, text)))
    fake_api["load"].result = {"seconds": 0.1}
    entry = model_nodes.EMBEDDED_2_3
    (handle,) = node("MGPULoadCheckpoint").load(entry, lora, 1.0, entry, entry, "all", "sharded", "auto", "bfloat16", pipeline=pipeline, unique_id="3")
    spec = ModelSpec.from_wire(handle["spec"])
    assert spec == ModelSpec.embedded_tiny_for(pipeline, "2.3") and spec.model_version == "2.3"
    assert spec.checkpoint_path == (EMBEDDED_TINY_2_3_DISTILLED if pipeline == "distilled" else EMBEDDED_TINY_2_3)
    assert fake_api["load"].calls[0][0] == (handle["spec"],)
    expected = {"two-stage": "LTX-2.3 checkpoint: official defaults 30 steps, STG block 28",
                "distilled": "LTX-2.3 checkpoint, distilled pipeline: 8 fixed distilled steps, then the 3-step tail"}  # fmt: skip
    assert notes == [("3", expected[pipeline])]


def checkpoint_with_version(path: Path, model_version: str | None) -> str:
    """A real safetensors file whose header names an LTX-2 model version (one tiny tensor)."""
    import json
    import struct

    header = {"model.diffusion_model.patchify_proj.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    if model_version is not None:
        header["__metadata__"] = {"model_version": model_version}
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"\0\0\0\0")
    return str(path)


@pytest.mark.parametrize(
    ("file_version", "steps", "stg_blocks", "note"),
    [
        ("2.3.0", 40, "29", "the checkpoint is LTX-2.3, but steps 40 and stg_blocks 29 are LTX-2.0's official values; "
                            "LTX-2.3's are steps 30 and stg_blocks 28 (or empty)"),
        ("2.3.0", 40, "", "the checkpoint is LTX-2.3, but steps 40 is LTX-2.0's official value; LTX-2.3's are steps 30 and stg_blocks 28 (or empty)"),
        ("2.3.0", 30, "28", None),
        ("2.3.0", 12, "29", "the checkpoint is LTX-2.3, but stg_blocks 29 is LTX-2.0's official value; LTX-2.3's are steps 30 and stg_blocks 28 (or empty)"),
        (None, 30, "28", "the checkpoint is LTX-2.0, but steps 30 and stg_blocks 28 are LTX-2.3's official values; "
                         "LTX-2.0's are steps 40 and stg_blocks 29 (or empty)"),
        (None, 40, "", None),
    ],
)
def test_sp_sampler_notes_when_steps_or_stg_blocks_hold_the_other_versions_official_values(fake_api, monkeypatch, tmp_path, file_version, steps, stg_blocks, note):
    notes = []
    monkeypatch.setattr(sampling_nodes, "node_note", lambda node_id, text: notes.append((node_id, text)))
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 9, 16))
    handle = tiny_handle(checkpoint_path=checkpoint_with_version(tmp_path / "ckpt.safetensors", file_version))
    node("MGPUSPSampler").sample(handle, mgpu_conditioning(1), mgpu_conditioning(2), **{**SAMPLER_INPUTS, "steps": steps, "stg_blocks": stg_blocks}, unique_id="6")
    assert notes == ([] if note is None else [("6", note)])
    kwargs = fake_api["sample"].calls[0][1]
    assert kwargs["steps"] == steps, "the widget's steps are sent as set: the note never changes them"
    assert kwargs["video_guidance"].stg_blocks == (tuple(int(block) for block in stg_blocks.split(",")) if stg_blocks else None)


def test_sp_sampler_adds_no_version_note_for_the_distilled_recipe_or_a_checkpoint_it_cannot_read(fake_api, monkeypatch, tmp_path):
    notes = []
    monkeypatch.setattr(sampling_nodes, "node_note", lambda node_id, text: notes.append(text))
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 9, 16))
    inputs = {**SAMPLER_INPUTS, "steps": 40, "stg_blocks": "29"}
    checkpoint = checkpoint_with_version(tmp_path / "ckpt.safetensors", "2.3.0")
    node("MGPUSPSampler").sample(distilled_handle(checkpoint_path=checkpoint), mgpu_conditioning(1), mgpu_conditioning(2), **inputs)
    assert len(notes) == 1 and notes[0].startswith("distilled pipeline: 8 fixed distilled steps"), notes
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    node("MGPUSPSampler").sample(tiny_handle(checkpoint_path=str(tmp_path / "garbage.safetensors")), mgpu_conditioning(1), mgpu_conditioning(2), **inputs)
    assert len(notes) == 1 and len(fake_api["sample"].calls) == 2


def test_sampler_tooltips_name_each_versions_official_steps_and_stg_block():
    required = NODES["MGPUSPSampler"].INPUT_TYPES()["required"]
    assert "LTX-2.0: 40 steps, STG block 29, LTX-2.3: 30 steps, STG block 28" in required["steps"][1]["tooltip"]
    assert "LTX-2.0: 29, LTX-2.3: 28" in required["stg_blocks"][1]["tooltip"]


def test_sp_sampler_takes_a_sigmas_input_as_the_stage1_schedule_and_the_steps_it_holds(fake_api, monkeypatch):
    """ComfyUI's ManualSigmas (a SIGMAS tensor) replaces the recipe's schedule; the steps widget is not read, and the node says so."""
    notes = []
    monkeypatch.setattr(sampling_nodes, "node_note", lambda node_id, text: notes.append((node_id, text)))
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 7, 16))
    template = torch.tensor([1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0])  # the LTX-2.3 templates' ManualSigmas
    node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **SAMPLER_INPUTS, sigmas=template, sampler="res2s", unique_id="5")
    ((_args, kwargs),) = fake_api["sample"].calls
    assert kwargs["sigmas"] == tuple(template.tolist()) and kwargs["steps"] == 8 and kwargs["sampler"] == "res2s"
    assert notes == [("5", f"the sigmas input sets 8 steps ({', '.join(f'{sigma:g}' for sigma in template.tolist())}); the steps widget is not read")]
    node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **SAMPLER_INPUTS)
    assert (fake_api["sample"].calls[1][1]["sigmas"], fake_api["sample"].calls[1][1]["sampler"]) == (None, None)  # the recipe's
    for bad, words in ((torch.tensor([0.9, 0.5, 0.0]), "stage-1 sigmas must run from 1.0 (stage 1 starts from pure noise) down to 0.0"),
                       (torch.tensor([1.0, 0.5, 0.6, 0.0]), "sigmas must decrease strictly")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(words)):
            node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **SAMPLER_INPUTS, sigmas=bad)
    assert len(fake_api["sample"].calls) == 2, "a bad schedule is refused before the fleet is asked"


def test_tdp_upscale_sends_the_sampler_chosen_and_none_for_the_recipes(fake_api, monkeypatch):
    monkeypatch.setattr(sampling_nodes, "node_note", lambda node_id, text: None)
    latent, _video, audio = av_latent(frame_rate=24.0)

    def fleet_upscale(*args, fields=None, **kwargs):
        fields.update(stage2_parallel="tdp", plan="stage-2 plan", audio="...")
        return torch.randn(1, 128, 2, 4, 6), audio

    fake_api["upscale"].result = fleet_upscale
    node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(3), **UPSCALE_INPUTS, sampler="res2s")
    node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(3), **UPSCALE_INPUTS)
    assert [kwargs["sampler"] for _args, kwargs in fake_api["upscale"].calls] == ["res2s", None]
def test_sp_sampler_and_tdp_upscale_send_the_image_strength_and_the_last_frame_image(fake_api):
    for name in ("MGPUSPSampler", "MGPUTDPUpscale"):
        optional = NODES[name].INPUT_TYPES()["optional"]
        assert optional["last_image"][0] == "IMAGE"
        for strength in ("image_strength", "last_image_strength"):
            assert optional[strength][0] == "FLOAT" and {key: optional[strength][1][key] for key in ("default", "min", "max")} == {"default": 1.0, "min": 0.0, "max": 1.0}
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.zeros(1, 8, 9, 16))
    first, last = torch.rand(1, 64, 96, 3), torch.rand(2, 40, 72, 4)
    (sampled,) = node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **SAMPLER_INPUTS, image=first, image_strength=0.7,
                                              last_image=last, last_image_strength=0.85)  # fmt: skip
    kwargs = fake_api["sample"].calls[0][1]
    assert sampled["mgpu_guiding_frames"] == 1, "two-stage appends the last image only: the first replaces the first latent frame"
    assert (kwargs["image_strength"], kwargs["last_image_strength"]) == (0.7, 0.85)
    assert kwargs["last_image"].shape == (40, 72, 3) and torch.equal(kwargs["last_image"], last[0, :, :, :3])
    latent, _video, audio = av_latent(frame_rate=24.0)
    fake_api["upscale"].result = (torch.randn(1, 128, 2, 4, 6), audio)
    (upscaled,) = node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(3), **UPSCALE_INPUTS, last_image=last)
    kwargs = fake_api["upscale"].calls[0][1]
    assert kwargs["image"] is None and (kwargs["image_strength"], kwargs["last_image_strength"]) == (1.0, 1.0)
    assert torch.equal(kwargs["last_image"], last[0, :, :, :3])
    assert upscaled["mgpu_guiding_frames"] == 1
    fake_api["decode"].result = (torch.rand(9, 64, 96, 3), None, None)
    node("MGPUDistributedVAEDecode").decode(tiny_handle(), upscaled, 3, 256, 32)
    assert fake_api["decode"].calls[0][1]["guiding_frames"] == 1, "the decoder noise must follow the guiding latents' draws too"


def test_sp_sampler_refuses_a_strength_without_its_image_before_calling_the_fleet(fake_api):
    with pytest.raises(ValueError) as raised:
        node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **SAMPLER_INPUTS, last_image_strength=0.5)
    assert str(raised.value) == (
        "last_image_strength is 0.5 but no last_image was given: it is the strength of the last frame image; "
        "give the last_image too, or leave last_image_strength at 1.0"
    )
    latent, _video, _audio = av_latent(frame_rate=24.0)
    with pytest.raises(ValueError, match="image_strength is 0.7 but no image was given: it is the strength of the first frame image"):
        node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(3), **UPSCALE_INPUTS, image_strength=0.7)
    assert fake_api["sample"].calls == [] and fake_api["upscale"].calls == []
