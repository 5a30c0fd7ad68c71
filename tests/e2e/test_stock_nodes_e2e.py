"""ComfyUI's own LTX-2 nodes linked into the pack's nodes in a real ComfyUI: each either changes the
result as on stock nodes or is refused in words that name the pack's node and what to use instead.
And the pack's CONDITIONING in ComfyUI's own sampler, and stock text features through the fleet's
connectors against ComfyUI's model.

One ComfyUI for the module (the harness of test_comfyui_e2e: --cpu, the pack symlinked, the tiny
LTX-2.0 files in models/), small graphs of 64x64 pixels and 9 frames. Runs only with COMFYUI_DIR
(a ComfyUI checkout, v0.20.1 or later) and COMFYUI_PYTHON (its interpreter).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mgpu_backend.tools import comfy_queue

from .comfyui_harness import COMFYUI_DIR, PACK_DIR, START_TIMEOUT_SECONDS, TINY_WORKFLOW, ComfyUI

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "main.py").is_file(), reason="set COMFYUI_DIR to a ComfyUI checkout"),
]

STOCK_SAMPLER = "use ComfyUI's own sampler with Load Checkpoint (MGPU fleet)"
SIZE, FRAMES = 64, 9


@pytest.fixture(scope="module")
def comfyui(tmp_path_factory):
    instance = ComfyUI(tmp_path_factory.mktemp("stock-nodes-base"))
    try:
        instance.wait_ready("/object_info/MGPUSPSampler", timeout=START_TIMEOUT_SECONDS)
        yield instance
    finally:
        instance.stop()


def graph(comfyui: ComfyUI, **nodes) -> dict:
    """The tiny workflow's loader ("1") and text encoder ("2"), ComfyUI's loaders of the same tiny
    checkpoint ("ckpt": MODEL, CLIP, VAE; "audio_vae"), a grey image, and ``nodes``
    (id -> (class_type, inputs))."""
    workflow = json.loads(TINY_WORKFLOW.read_text())
    ckpt = comfyui.model_files["ckpt_name"]
    built = {"1": workflow["1"], "2": workflow["2"]}
    stock = {
        "ckpt": ("CheckpointLoaderSimple", {"ckpt_name": ckpt}),
        "audio_vae": ("LTXVAudioVAELoader", {"ckpt_name": ckpt}),
        "image": ("EmptyImage", {"width": SIZE, "height": SIZE, "batch_size": 1, "color": 0x808080}),
    }
    for node_id, (class_type, inputs) in {**stock, **nodes}.items():
        built[node_id] = {"class_type": class_type, "inputs": inputs}
    return built


def sp_sampler(positive=("2", 0), negative=("2", 1), frame_rate: float = 24.0, seed: int = 5) -> tuple[str, dict]:
    return "MGPUSPSampler", {
        "model": ["1", 0], "positive": list(positive), "negative": list(negative), "width": SIZE, "height": SIZE, "length": FRAMES,
        "frame_rate": frame_rate, "seed": seed, "steps": 2, "video_cfg": 3.0, "audio_cfg": 7.0, "stg_scale": 1.0, "stg_blocks": "",
        "rescale": 0.7, "modality_scale": 3.0, "parallel": "(from loader)", "compile_blocks": False,
    }  # fmt: skip


def tdp_upscale(av_latent, positive=("2", 0), frame_rate: float = 0.0) -> tuple[str, dict]:
    return "MGPUTDPUpscale", {
        "model": ["1", 0], "av_latent": list(av_latent), "positive": list(positive), "seed": 5, "sigmas": "0.625, 0.0",
        "tiles": "auto", "overlap": 1, "frame_rate": frame_rate, "force_from_noise": False, "stage2_parallel": "auto",
    }  # fmt: skip


def decoded_preview(av_latent) -> dict:
    """Distributed VAE Decode of ``av_latent`` into PreviewImage: what makes ComfyUI run the graph."""
    return {
        "decode": ("MGPUDistributedVAEDecode", {"model": ["1", 0], "av_latent": list(av_latent), "seed": 5, "spatial_tile_pixels": 512, "temporal_tile_frames": 64}),
        "preview": ("PreviewImage", {"images": ["decode", 0]}),
    }


def empty_av_latent(frame_rate: int) -> dict:
    """ComfyUI's empty video and audio latents of FRAMES frames at ``frame_rate``, concatenated ("av")."""
    return {
        "video": ("EmptyLTXVLatentVideo", {"width": SIZE, "height": SIZE, "length": FRAMES, "batch_size": 1}),
        "audio": ("LTXVEmptyLatentAudio", {"frames_number": FRAMES, "frame_rate": frame_rate, "batch_size": 1, "audio_vae": ["audio_vae", 0]}),
        "av": ("LTXVConcatAVLatent", {"video_latent": ["video", 0], "audio_latent": ["audio", 0]}),
    }


def run(comfyui: ComfyUI, workflow: dict) -> comfy_queue.Outcome:
    return comfy_queue.queue_prompt(comfyui.url, workflow, say=lambda text: None, timeout=600)


def refusal(comfyui: ComfyUI, workflow: dict) -> str:
    with pytest.raises(comfy_queue.QueueError) as failed:
        run(comfyui, workflow)
    return str(failed.value)


def frames_of(comfyui: ComfyUI, outcome: comfy_queue.Outcome, node_id: str = "preview") -> np.ndarray:
    from PIL import Image

    arrays = []
    for entry in outcome.outputs[node_id]["images"]:
        with Image.open(comfyui.base / entry["type"] / entry["subfolder"] / entry["filename"]) as image:
            arrays.append(np.asarray(image.convert("RGB")))
    return np.stack(arrays)


@pytest.fixture(scope="module")
def baseline(comfyui) -> np.ndarray:
    """The frames of the plain graph: MGPU Text Encode -> SP Sampler -> Distributed VAE Decode."""
    return frames_of(comfyui, run(comfyui, graph(comfyui, sp=sp_sampler(), **decoded_preview(("sp", 0)))))


def test_ltxv_conditioning_at_sp_samplers_frame_rate_keeps_the_result_and_another_rate_is_refused(comfyui, baseline):
    same = graph(comfyui, cond=("LTXVConditioning", {"positive": ["2", 0], "negative": ["2", 1], "frame_rate": 24.0}),
                 sp=sp_sampler(("cond", 0), ("cond", 1)), **decoded_preview(("sp", 0)))  # fmt: skip
    assert baseline.shape == (FRAMES, SIZE, SIZE, 3)
    assert (frames_of(comfyui, run(comfyui, same)) == baseline).all()
    other = json.loads(json.dumps(same))
    other["cond"]["inputs"]["frame_rate"] = 25.0
    assert (
        "SP Sampler: the positive conditioning carries frame rate 25 from LTXVConditioning, but SP Sampler's frame_rate is 24; "
        "set SP Sampler's frame_rate to 25 (it also sets how long the audio is) or LTXVConditioning's to 24"
    ) in refusal(comfyui, other)


def test_ltxv_add_guide_is_refused_by_sp_sampler_and_ltxv_crop_guides_gives_the_plain_result(comfyui, baseline):
    guide = {
        "video": ("EmptyLTXVLatentVideo", {"width": SIZE, "height": SIZE, "length": FRAMES, "batch_size": 1}),
        "guide": ("LTXVAddGuide", {"positive": ["2", 0], "negative": ["2", 1], "vae": ["ckpt", 2], "latent": ["video", 0], "image": ["image", 0], "frame_idx": -1, "strength": 1.0}),
    }  # fmt: skip
    guided = graph(comfyui, **guide, sp=sp_sampler(("guide", 0), ("guide", 1)), **decoded_preview(("sp", 0)))
    text = refusal(comfyui, guided)
    assert f"SP Sampler: the positive conditioning carries a keyframe guide from LTXVAddGuide, which SP Sampler does not apply; {STOCK_SAMPLER}, or remove LTXVAddGuide" in text
    cropped = graph(comfyui, **guide, crop=("LTXVCropGuides", {"positive": ["guide", 0], "negative": ["guide", 1], "latent": ["guide", 2]}),
                    sp=sp_sampler(("crop", 0), ("crop", 1)), **decoded_preview(("sp", 0)))  # fmt: skip
    assert (frames_of(comfyui, run(comfyui, cropped)) == baseline).all(), "LTXVCropGuides removes the guide: the plain result"


def test_reference_audio_is_refused_by_sp_sampler(comfyui):
    workflow = graph(
        comfyui,
        silence=("EmptyAudio", {"duration": 1.0, "sample_rate": 16000, "channels": 2}),
        reference=("LTXVReferenceAudio", {"model": ["ckpt", 0], "positive": ["2", 0], "negative": ["2", 1], "reference_audio": ["silence", 0],
                                          "audio_vae": ["audio_vae", 0], "identity_guidance_scale": 0.0, "start_percent": 0.0, "end_percent": 1.0}),
        sp=sp_sampler(("reference", 1), ("reference", 2)),
        **decoded_preview(("sp", 0)),
    )  # fmt: skip
    assert f"SP Sampler: the positive conditioning carries reference audio from LTXVReferenceAudio, which SP Sampler does not apply; {STOCK_SAMPLER}" in refusal(comfyui, workflow)


def test_a_conditioning_a_stock_node_rewrote_reaches_the_fleet_and_changes_the_result(comfyui, baseline):
    # ConditioningZeroOut makes a new tensor and copies the options: the fleet gets the stacked
    # contexts themselves (no digest fits them) and splits them.
    workflow = graph(comfyui, zero=("ConditioningZeroOut", {"conditioning": ["2", 0]}), sp=sp_sampler(("zero", 0)), **decoded_preview(("sp", 0)))
    frames = frames_of(comfyui, run(comfyui, workflow))
    assert frames.shape == baseline.shape and (frames != baseline).any(), "a zeroed prompt gave the prompt's video"


def test_a_noise_mask_from_ltxv_img_to_video_inplace_or_ltxv_img_to_video_is_refused_by_tdp_upscale(comfyui):
    inplace = graph(
        comfyui,
        sp=sp_sampler(),
        split=("LTXVSeparateAVLatent", {"av_latent": ["sp", 0]}),
        first=("LTXVImgToVideoInplace", {"vae": ["ckpt", 2], "image": ["image", 0], "latent": ["split", 0], "strength": 1.0, "bypass": False}),
        av=("LTXVConcatAVLatent", {"video_latent": ["first", 0], "audio_latent": ["split", 1]}),
        tdp=tdp_upscale(("av", 0)),
        **decoded_preview(("tdp", 0)),
    )
    expected = "TDP Upscale: av_latent carries a noise mask (from LTXVImgToVideoInplace, LTXVImgToVideo, LTXVAddGuide or SetLatentNoiseMask)"
    text = refusal(comfyui, inplace)
    assert expected in text and "connect it to TDP Upscale's image input instead" in text and STOCK_SAMPLER in text
    img_to_video = graph(
        comfyui,
        i2v=("LTXVImgToVideo", {"positive": ["2", 0], "negative": ["2", 1], "vae": ["ckpt", 2], "image": ["image", 0], "width": SIZE, "height": SIZE,
                                "length": FRAMES, "batch_size": 1, "strength": 1.0}),
        audio=("LTXVEmptyLatentAudio", {"frames_number": FRAMES, "frame_rate": 24, "batch_size": 1, "audio_vae": ["audio_vae", 0]}),
        av=("LTXVConcatAVLatent", {"video_latent": ["i2v", 2], "audio_latent": ["audio", 0]}),
        tdp=tdp_upscale(("av", 0), positive=("i2v", 0), frame_rate=24.0),
        **decoded_preview(("tdp", 0)),
    )  # fmt: skip
    assert expected in refusal(comfyui, img_to_video)


@pytest.mark.parametrize("frame_rate", [24, 50])
def test_stock_empty_av_latent_at_comfyuis_audio_length_runs_through_tdp_upscale_at_ltxv_conditionings_rate(comfyui, frame_rate):
    # 9 frames: ComfyUI's audio latent is 10 frames at 24 fps and 5 at 50 fps, ltx-core's 9 and 4.
    workflow = graph(
        comfyui,
        **empty_av_latent(frame_rate),
        cond=("LTXVConditioning", {"positive": ["2", 0], "negative": ["2", 1], "frame_rate": float(frame_rate)}),
        tdp=tdp_upscale(("av", 0), positive=("cond", 0)),  # frame_rate 0: the latent has none, LTXVConditioning's is taken
        **decoded_preview(("tdp", 0)),
    )
    frames = frames_of(comfyui, run(comfyui, workflow))
    assert frames.shape == (FRAMES, 2 * SIZE, 2 * SIZE, 3)


def test_the_packs_conditioning_runs_in_comfyuis_own_sampler(comfyui):
    workflow = graph(
        comfyui,
        **empty_av_latent(24),
        guider=("CFGGuider", {"model": ["ckpt", 0], "positive": ["2", 0], "negative": ["2", 1], "cfg": 3.0}),
        noise=("RandomNoise", {"noise_seed": 5}),
        sampler=("KSamplerSelect", {"sampler_name": "euler"}),
        sigmas=("BasicScheduler", {"model": ["ckpt", 0], "scheduler": "simple", "steps": 2, "denoise": 1.0}),
        sample=("SamplerCustomAdvanced", {"noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["sampler", 0], "sigmas": ["sigmas", 0], "latent_image": ["av", 0]}),
        split=("LTXVSeparateAVLatent", {"av_latent": ["sample", 0]}),
        decode=("VAEDecode", {"samples": ["split", 0], "vae": ["ckpt", 2]}),
        preview=("PreviewImage", {"images": ["decode", 0]}),
    )  # fmt: skip
    frames = frames_of(comfyui, run(comfyui, workflow))
    assert frames.shape == (FRAMES, SIZE, SIZE, 3)


COMPARE_CONNECTORS = """
import sys, os, json
comfyui, pack = sys.argv[1], sys.argv[2]
sys.path[:0] = [comfyui, pack]
os.chdir(comfyui)
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import comfy.sd, torch
from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.loading import ModelLoader
from mgpu_backend.ltx.text import connector_widths, contexts_from_comfy
out = {}
for version in ("2.0", "2.3"):
    bundle = tiny.default_tiny_bundle(version)
    model = comfy.sd.load_checkpoint_guess_config(bundle.checkpoint_path, output_vae=False, output_clip=False)[0].model.diffusion_model
    processor = ModelLoader(bundle.spec(), device="cpu", dtype=torch.float32).embeddings_processor()
    video_width, audio_width = processor.video_connector.inner_dim, processor.audio_connector.inner_dim
    width = video_width if version == "2.0" else video_width + audio_width  # ComfyUI's single_linear / dual_linear features
    for tokens in (37, 1100):
        features = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            comfy_context = model.preprocess_text_embeds(features, unprocessed=True).float()
        ours = contexts_from_comfy(features, True, "positive", connector_widths(bundle.checkpoint_path), lambda: processor)
        ours = torch.cat([ours.video_context, ours.audio_context], dim=-1).float()
        out[f"{version}/{tokens}"] = [list(comfy_context.shape), list(ours.shape), (comfy_context - ours).abs().max().item()]
print(json.dumps(out))
"""


def test_stock_unprocessed_text_features_connect_in_the_fleet_as_in_comfyuis_model():
    # ComfyUI's LTX-2 text encoder leaves the connectors to the model (unprocessed_ltxav_embeds);
    # ComfyUI's text encoder itself is Gemma 3 12B only, so its features are drawn here.
    python = os.environ.get("COMFYUI_PYTHON", sys.executable)
    done = subprocess.run([python, "-c", COMPARE_CONNECTORS, COMFYUI_DIR, str(PACK_DIR)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for case, (comfy_shape, our_shape, max_diff) in results.items():
        assert comfy_shape == our_shape, case
        assert max_diff < 1e-4, f"{case}: the fleet's contexts differ from ComfyUI's model's by {max_diff:.3e}"
    assert {case: shape[1] for case, (shape, _, _) in results.items()} == {"2.0/37": 1024, "2.0/1100": 1152, "2.3/37": 1024, "2.3/1100": 1152}


def sound_of(comfyui: ComfyUI, outcome: comfy_queue.Outcome, node_id: str) -> np.ndarray:
    """The samples of the audio file a PreviewAudio node wrote."""
    import av

    (entry,) = outcome.outputs[node_id]["audio"]
    with av.open(str(comfyui.base / entry["type"] / entry["subfolder"] / entry["filename"])) as container:
        return np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=-1)


def test_audio_encoded_by_ltxv_audio_vae_encode_passes_through_tdp_upscale_unchanged(comfyui):
    # The sound of a stage-1 run, decoded and encoded again by ComfyUI's audio VAE, as the audio of
    # TDP Upscale's input: TDP keeps the audio it is given (the video's context), so its output
    # decodes to the same sound as its input.
    decode = {"model": ["1", 0], "seed": 5, "spatial_tile_pixels": 512, "temporal_tile_frames": 64}
    workflow = graph(
        comfyui,
        sp=sp_sampler(),
        first=("MGPUDistributedVAEDecode", {**decode, "av_latent": ["sp", 0]}),
        encoded=("LTXVAudioVAEEncode", {"audio": ["first", 1], "audio_vae": ["audio_vae", 0]}),
        split=("LTXVSeparateAVLatent", {"av_latent": ["sp", 0]}),
        av=("LTXVConcatAVLatent", {"video_latent": ["split", 0], "audio_latent": ["encoded", 0]}),
        tdp=tdp_upscale(("av", 0)),
        **decoded_preview(("tdp", 0)),
        given=("MGPUDistributedVAEDecode", {**decode, "av_latent": ["av", 0]}),
        heard_given=("PreviewAudio", {"audio": ["given", 1]}),
        heard_refined=("PreviewAudio", {"audio": ["decode", 1]}),
    )  # fmt: skip
    outcome = run(comfyui, workflow)
    assert frames_of(comfyui, outcome).shape == (FRAMES, 2 * SIZE, 2 * SIZE, 3)
    given, refined = sound_of(comfyui, outcome, "heard_given"), sound_of(comfyui, outcome, "heard_refined")
    assert given.size > 0 and given.shape == refined.shape and (given == refined).all()
