"""What the MGPU nodes do with the inputs ComfyUI's own LTX-2 nodes make: each either changes the
result as on stock nodes or is refused before any fleet work, in words that name the node and what
to use instead. ComfyUI's CONDITIONING layout both ways (split, and connected where ComfyUI leaves
the connectors to the model, against ltx-core's own prompt encoding of the tiny bundles), and
ComfyUI's audio latent length against ltx-core's at many frame rates. CPU only, no fleet (the
fleet api replaced by recorders, as in test_nodes)."""

from __future__ import annotations

import math

import pytest
import torch
from ltx_core.types import AudioLatentShape, VideoPixelShape

from mgpu_backend.bundles import tiny
from mgpu_backend.fleet.client import FleetError
from mgpu_backend.ltx import api
from mgpu_backend.ltx.loading import ModelLoader
from mgpu_backend.ltx.text import COMFY_CONNECTOR_TOKENS, comfy_connector_rope, connector_widths, contexts_from_comfy

from .fleet_harness import run_job
from .helpers import SAMPLER_INPUTS, UPSCALE_INPUTS, av_latent, layouts, mgpu_conditioning, node, tiny_handle

STOCK_SAMPLER = "use ComfyUI's own sampler with Load Checkpoint (MGPU fleet)"


def with_options(conditioning, **options):
    """What node_helpers.conditioning_set_values makes: the same tensor, the options copied and set."""
    return [[entry[0], {**entry[1], **options}] for entry in conditioning]


@pytest.fixture
def sampled(fake_api):  # noqa: F811
    fake_api["sample"].result = (torch.zeros(1, 128, 2, 2, 3), torch.arange(9.0).view(1, 1, 9, 1).expand(1, 8, 9, 16).clone())
    return fake_api


# --- conditioning options ComfyUI's LTX-2 nodes set --------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"keyframe_idxs": torch.zeros(1, 3, 1, 2), "guide_attention_entries": [{}]}, "a keyframe guide from LTXVAddGuide"),
        ({"ref_audio": {"tokens": torch.zeros(1, 5, 128)}}, "reference audio from LTXVReferenceAudio"),
        ({"start_percent": 0.2}, "a timestep range from ConditioningSetTimestepRange"),
        ({"strength": 0.5}, "a strength from ConditioningSetAreaStrength"),
        ({"mask": torch.ones(1, 8, 8)}, "a mask from ConditioningSetMask"),
        ({"control": object()}, "a ControlNet from the ControlNet apply node"),
    ],
)
def test_sp_sampler_refuses_a_conditioning_option_it_would_drop_naming_node_source_and_alternative(sampled, options, message):
    for input_name, positive, negative in (("positive", with_options(mgpu_conditioning(1), **options), mgpu_conditioning(2)),
                                           ("negative", mgpu_conditioning(1), with_options(mgpu_conditioning(2), **options))):  # fmt: skip
        with pytest.raises(ValueError) as refused:
            node("MGPUSPSampler").sample(tiny_handle(), positive, negative, **SAMPLER_INPUTS)
        text = str(refused.value)
        assert text.startswith(f"SP Sampler: the {input_name} conditioning carries {message}, which SP Sampler does not apply; ")
        assert STOCK_SAMPLER in text and text.endswith(f"or remove {message.split(' from ')[1]}")
    assert sampled["sample"].calls == [], "refused before any fleet work"


def test_guides_cleared_by_ltxv_crop_guides_and_default_options_are_accepted(sampled):
    cleared = with_options(mgpu_conditioning(1), keyframe_idxs=None, guide_attention_entries=None, start_percent=0.0, end_percent=1.0, strength=1.0)
    node("MGPUSPSampler").sample(tiny_handle(), cleared, mgpu_conditioning(2), **SAMPLER_INPUTS)
    assert len(sampled["sample"].calls) == 1


def test_sp_sampler_takes_ltxv_conditioning_at_its_own_frame_rate_and_refuses_another(sampled):
    at_25 = with_options(mgpu_conditioning(1), frame_rate=25.0), with_options(mgpu_conditioning(2), frame_rate=25.0)
    node("MGPUSPSampler").sample(tiny_handle(), *at_25, **{**SAMPLER_INPUTS, "frame_rate": 25.0})
    assert sampled["sample"].calls[0][1]["frame_rate"] == 25.0
    with pytest.raises(ValueError) as refused:
        node("MGPUSPSampler").sample(tiny_handle(), *at_25, **{**SAMPLER_INPUTS, "frame_rate": 24.0})
    assert str(refused.value) == (
        "SP Sampler: the positive conditioning carries frame rate 25 from LTXVConditioning, but SP Sampler's frame_rate is 24; "
        "set SP Sampler's frame_rate to 25 (it also sets how long the audio is) or LTXVConditioning's to 24"
    )
    assert len(sampled["sample"].calls) == 1


def test_distilled_sp_sampler_ignores_the_negative_conditioning_entirely(sampled):
    handle = {**tiny_handle(), "pipeline": "distilled"}
    guided_negative = with_options(mgpu_conditioning(2), keyframe_idxs=torch.zeros(1, 3, 1, 2))
    node("MGPUSPSampler").sample(handle, mgpu_conditioning(1), guided_negative, **SAMPLER_INPUTS)
    assert sampled["sample"].calls[0][0][2] is None


def test_tdp_upscale_refuses_a_keyframe_guide_and_a_frame_rate_other_than_the_latents(fake_api):  # noqa: F811
    latent, _, _ = av_latent(frame_rate=24.0)
    guided = with_options(mgpu_conditioning(3), keyframe_idxs=torch.zeros(1, 3, 1, 2))
    with pytest.raises(ValueError, match=r"^TDP Upscale: the positive conditioning carries a keyframe guide from LTXVAddGuide, which TDP Upscale does not apply; "):
        node("MGPUTDPUpscale").upscale(tiny_handle(), latent, guided, **UPSCALE_INPUTS)
    with pytest.raises(ValueError) as refused:
        node("MGPUTDPUpscale").upscale(tiny_handle(), latent, with_options(mgpu_conditioning(3), frame_rate=25.0), **UPSCALE_INPUTS)
    assert str(refused.value) == (
        "TDP Upscale: the positive conditioning carries frame rate 25 from LTXVConditioning, but av_latent is at 24 fps; "
        "set LTXVConditioning's frame_rate to 24 or remove LTXVConditioning"
    )
    assert fake_api["upscale"].calls == []


def test_tdp_upscale_runs_a_native_latent_at_ltxv_conditionings_frame_rate(fake_api):  # noqa: F811
    latent, _, _ = av_latent(frame_rate=None, audio_frames=9)  # 9 frames at 25 fps: 9 audio frames on both sides
    fake_api["upscale"].result = (torch.zeros(1, 128, 2, 4, 6), torch.zeros(1, 8, 9, 16))
    with pytest.raises(ValueError, match="does not record its frame rate"):
        node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(3), **UPSCALE_INPUTS)
    node("MGPUTDPUpscale").upscale(tiny_handle(), latent, with_options(mgpu_conditioning(3), frame_rate=25.0), **UPSCALE_INPUTS)
    assert fake_api["upscale"].calls[0][1]["frame_rate"] == 25.0


def test_tdp_upscale_refuses_a_noise_mask_that_masks_and_takes_one_of_ones(fake_api):  # noqa: F811
    fake_api["upscale"].result = (torch.zeros(1, 128, 2, 4, 6), torch.zeros(1, 8, 9, 16))
    latent, video, audio = av_latent(frame_rate=24.0)
    first_frame_kept = torch.ones(1, 1, 2, 1, 1)
    first_frame_kept[:, :, 0] = 0.0  # what LTXVImgToVideoInplace sets at strength 1
    masked = {**latent, "noise_mask": layouts._nested((first_frame_kept, torch.ones_like(audio)))}
    with pytest.raises(ValueError) as refused:
        node("MGPUTDPUpscale").upscale(tiny_handle(), masked, mgpu_conditioning(3), **UPSCALE_INPUTS)
    text = str(refused.value)
    assert text.startswith("TDP Upscale: av_latent carries a noise mask (from LTXVImgToVideoInplace, LTXVImgToVideo, LTXVAddGuide or SetLatentNoiseMask)")
    assert "connect it to TDP Upscale's image input instead" in text and STOCK_SAMPLER in text
    assert fake_api["upscale"].calls == []
    ones = {**latent, "noise_mask": layouts._nested((torch.ones_like(video), torch.ones_like(audio)))}  # LTXVConcatAVLatent's fill
    node("MGPUTDPUpscale").upscale(tiny_handle(), ones, mgpu_conditioning(3), **UPSCALE_INPUTS)
    assert len(fake_api["upscale"].calls) == 1


# --- ComfyUI's audio latent length -------------------------------------------------------------------


@pytest.mark.parametrize("frame_rate", [24, 25, 30, 48, 50, 60, 23.976, 29.97])
def test_audio_latent_lengths_are_ltx_cores_rounded_and_comfyuis_ceiled_at_every_frame_rate(frame_rate):
    differ = 0
    for frames in range(1, 258, 8):
        ltx = AudioLatentShape.from_video_pixel_shape(VideoPixelShape(1, frames, 64, 64, frame_rate)).frames
        comfy = math.ceil((float(frames) / frame_rate) * 25.0)  # comfy/ldm/lightricks/vae/audio_vae.py num_of_latents_from_frames
        assert api.fleet_audio_frames(frames, frame_rate) == ltx and api.comfy_audio_frames(frames, frame_rate) == comfy
        assert comfy - ltx in (0, 1)
        differ += comfy != ltx
    assert differ > 0, f"at {frame_rate} fps some frame count must give ComfyUI one audio frame more"


def test_comfy_length_audio_is_trimmed_for_the_fleet_and_padded_back_with_the_last_frame():
    video = torch.zeros(1, 128, 16, 2, 3)  # 121 frames
    fleet = torch.randn(1, 8, 126, 16)  # 121 frames at 24 fps: ltx-core 126, ComfyUI 127
    comfy = api.audio_latent_for_comfy(fleet, 121, 24.0)
    assert comfy.shape == (1, 8, 127, 16) and torch.equal(comfy[:, :, :126], fleet) and torch.equal(comfy[:, :, 126], fleet[:, :, 125])
    assert torch.equal(api.audio_latent_for_fleet(comfy, video, 24.0), fleet)
    assert api.audio_latent_for_fleet(fleet, video, 24.0) is fleet
    at_25 = torch.randn(1, 8, 121, 16)  # 121 frames at 25 fps: 121 on both sides
    assert api.audio_latent_for_comfy(at_25, 121, 25.0) is at_25 and api.audio_latent_for_fleet(at_25, video, 25.0) is at_25
    api.check_audio_latent_length(comfy, video, 24.0, "TDP Upscale")
    with pytest.raises(ValueError) as refused:
        api.check_audio_latent_length(torch.zeros(1, 8, 125, 16), video, 24.0, "TDP Upscale")
    assert str(refused.value).startswith("TDP Upscale: the audio latent has 125 frames, but 121 video frames at 24 fps take 126 or 127; ")


def test_sp_sampler_returns_comfyuis_audio_length_and_tdp_upscale_takes_it_back(sampled):
    (latent,) = node("MGPUSPSampler").sample(tiny_handle(), mgpu_conditioning(1), mgpu_conditioning(2), **{**SAMPLER_INPUTS, "frame_rate": 24.0})
    video, audio = latent["samples"].unbind()
    assert audio.shape == (1, 8, 10, 16), "9 frames at 24 fps: ComfyUI's LTXVEmptyLatentAudio makes 10 audio frames"
    assert torch.equal(audio[:, :, 9], audio[:, :, 8])
    sampled["upscale"].result = (torch.zeros(1, 128, 2, 4, 6), torch.zeros(1, 8, 9, 16))
    (refined,) = node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(3), **UPSCALE_INPUTS)
    sent = sampled["upscale"].calls[0][0][2]
    assert sent.shape == (1, 8, 9, 16) and torch.equal(sent, audio[:, :, :9]), "the fleet runs at ltx-core's length"
    assert refined["samples"].unbind()[1] is audio, "TDP passes the input audio through, at the length it came"
    sampled["decode"].result = (torch.rand(9, 64, 96, 3), torch.zeros(1, 2, 100), 24000)
    node("MGPUDistributedVAEDecode").decode(tiny_handle(), refined, 3, 256, 32)
    assert torch.equal(sampled["decode"].calls[0][0][2], audio[:, :, :9])


def test_tdp_upscale_refuses_an_audio_latent_of_another_length_before_the_fleet(fake_api):  # noqa: F811
    latent, _, _ = av_latent(frame_rate=24.0, audio_frames=7)
    with pytest.raises(ValueError, match=r"^TDP Upscale: the audio latent has 7 frames, but 9 video frames at 24 fps take 9 or 10; .*LTXVEmptyLatentAudio with frames_number 9 and frame_rate 24"):
        node("MGPUTDPUpscale").upscale(tiny_handle(), latent, mgpu_conditioning(3), **UPSCALE_INPUTS)
    assert fake_api["upscale"].calls == []


# --- CONDITIONING in ComfyUI's layout ------------------------------------------------------------------


def test_earlier_pack_conditioning_with_the_audio_context_apart_is_still_read():
    video, audio = torch.randn(1, 5, 32), torch.randn(1, 5, 16)
    earlier = [[video, {"mgpu_audio_context": audio, "mgpu_prompt": "p", "mgpu_prompt_digest": "d" * 64, "mgpu_digested_video_context": video}]]
    got = layouts.conditioning_contexts(earlier, "positive")
    assert got == api.PromptEncoding(video, audio, "d" * 64)


def test_api_sends_a_stacked_context_under_its_kind(monkeypatch):
    sent = []
    monkeypatch.setattr(api, "run", lambda op, wire, tensors, **kwargs: sent.append(tensors) or type("R", (), {"tensors": {"video_latent": 1, "audio_latent": 2}})())
    stacked, unprocessed = api.StackedContext(torch.zeros(1, 5, 48)), api.StackedContext(torch.zeros(1, 5, 32), unprocessed=True)
    api.sample(tiny_handle()["spec"], stacked, unprocessed, width=64, height=64, num_frames=9, steps=1)
    assert set(sent[0]) == {"positive_stacked_context", "negative_unprocessed_context"}
    assert sent[0]["positive_stacked_context"] is stacked.context


@pytest.fixture(scope="module", params=["2.0", "2.3"])
def processor(request):
    bundle = tiny.default_tiny_bundle(request.param)
    processor = ModelLoader(bundle.spec(), device="cpu", dtype=torch.bfloat16).embeddings_processor()
    processor.widths = connector_widths(bundle.checkpoint_path)
    assert processor.widths == (processor.video_connector.inner_dim, processor.audio_connector.inner_dim)
    assert processor.widths == {"2.0": (64, 64), "2.3": (128, 64)}[request.param]
    return processor


def gemma_like(real_tokens: int, seed: int = 5):
    """Gemma-shaped hidden states at ltx-core's padded length, left padding (the official tokenizer's)."""
    generator = torch.Generator().manual_seed(seed)
    text = tiny.GEMMA_TEXT_CONFIG
    hidden = tuple(torch.randn(1, COMFY_CONNECTOR_TOKENS, text["hidden_size"], generator=generator).to(torch.bfloat16) for _ in range(text["num_hidden_layers"] + 1))
    mask = torch.zeros(1, COMFY_CONNECTOR_TOKENS, dtype=torch.int64)
    mask[:, -real_tokens:] = 1
    return hidden, mask


def test_unprocessed_comfy_features_connect_to_ltx_cores_own_contexts_bitwise(processor):
    # ComfyUI's text encoder keeps the prompt's tokens only (it trims Gemma's padding) and leaves the
    # connectors to the model; run here, they must give what ltx-core's prompt encoding of the padded
    # prompt gives with the same connector settings (ComfyUI's RoPE settings: see COMFY_CONNECTOR_ROPE).
    hidden, mask = gemma_like(real_tokens=37)
    with comfy_connector_rope(processor):
        reference = processor.process_hidden_states(hidden, mask)
    assert processor.video_connector.double_precision_rope is False, "the connectors' own settings are back (the tiny config's)"
    with torch.inference_mode():
        video_features, audio_features = processor.feature_extractor(hidden, mask, "left")
    video_width, audio_width = processor.video_connector.inner_dim, processor.audio_connector.inner_dim
    if video_width == audio_width and torch.equal(video_features, audio_features):
        stock = video_features[:, -37:]  # LTX-2.0: one feature both connectors read (ComfyUI's single_linear)
    else:
        stock = torch.cat([video_features, audio_features], dim=-1)[:, -37:]  # LTX-2.3: ComfyUI's dual_linear
    got = contexts_from_comfy(stock.float(), True, "positive", processor.widths, lambda: processor)
    assert got.video_context.shape == reference.video_encoding.shape == (1, COMFY_CONNECTOR_TOKENS, video_width)
    assert torch.equal(got.video_context, reference.video_encoding), f"video max abs diff {(got.video_context.float() - reference.video_encoding.float()).abs().max():.3e}"
    assert torch.equal(got.audio_context, reference.audio_encoding), f"audio max abs diff {(got.audio_context.float() - reference.audio_encoding.float()).abs().max():.3e}"


def test_processed_stacked_contexts_split_back_exactly_and_a_foreign_width_is_refused(processor):
    video_width, audio_width = processor.video_connector.inner_dim, processor.audio_connector.inner_dim
    video, audio = torch.randn(1, 7, video_width), torch.randn(1, 7, audio_width)
    got = contexts_from_comfy(torch.cat([video, audio], dim=-1), False, "positive", processor.widths, embeddings_processor=None)  # not built to split
    assert torch.equal(got.video_context, video) and torch.equal(got.audio_context, audio)
    with pytest.raises(ValueError) as refused:
        contexts_from_comfy(torch.zeros(1, 7, video_width + audio_width + 1), False, "negative", processor.widths, embeddings_processor=None)
    assert str(refused.value).startswith(
        f"the negative conditioning is {video_width + audio_width + 1} wide, but this checkpoint's text contexts are "
        f"{video_width} (video) + {audio_width} (audio) wide: it was encoded for another model; "
    )


# --- the fleet takes ComfyUI's layout ----------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(fleet_of):
    return fleet_of(1)


@pytest.mark.slow
def test_fleet_samples_stacked_and_unprocessed_contexts_as_their_two_contexts_and_refuses_a_foreign_width(fleet):
    spec = tiny.default_tiny_bundle("2.3").spec().to_json()
    encoded = run_job(fleet, "encode", {"spec": spec, "prompts": ["a fox in snow", "blurry"]})
    contexts = {f"{prefix}_{kind}_context": encoded.tensors[f"{kind}_context_{index}"] for index, prefix in enumerate(("positive", "negative")) for kind in ("video", "audio")}  # fmt: skip
    stacked = {f"{prefix}_stacked_context": torch.cat([contexts[f"{prefix}_video_context"], contexts[f"{prefix}_audio_context"]], dim=-1) for prefix in ("positive", "negative")}  # fmt: skip
    args = {"spec": spec, "width": 64, "height": 64, "num_frames": 9, "seed": 3, "steps": 2}
    apart, together = run_job(fleet, "sample", args, contexts), run_job(fleet, "sample", args, stacked)
    for name in ("video_latent", "audio_latent"):
        assert torch.equal(together.tensors[name], apart.tensors[name]), name
    # ComfyUI's unprocessed text features: the fleet connects them as this process does
    bundle = tiny.default_tiny_bundle("2.3")
    features = torch.randn(1, 20, 192, generator=torch.Generator().manual_seed(20))
    processor = ModelLoader(bundle.spec(), device="cpu", dtype=torch.bfloat16).embeddings_processor()
    expected = contexts_from_comfy(features, True, "positive", connector_widths(bundle.checkpoint_path), lambda: processor)
    negative = {name: tensor for name, tensor in contexts.items() if name.startswith("negative")}
    connected = run_job(fleet, "sample", args, {"positive_unprocessed_context": features, **negative})
    by_contexts = run_job(fleet, "sample", args, {"positive_video_context": expected.video_context, "positive_audio_context": expected.audio_context, **negative})
    for name in ("video_latent", "audio_latent"):
        assert torch.equal(connected.tensors[name], by_contexts.tensors[name]), name
    foreign = {**stacked, "positive_stacked_context": torch.zeros(1, 7, 100)}
    with pytest.raises(FleetError, match=r"the positive conditioning is 100 wide, but this checkpoint's text contexts are 128 \(video\) \+ 64 \(audio\) wide") as refused:
        run_job(fleet, "sample", args, foreign)
    assert refused.value.kind == "input_error"
