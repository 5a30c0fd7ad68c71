"""The drop-in MODEL driven by ComfyUI's own sampling code, against ComfyUI's own model in-process.

``load_fleet_model`` (what *Load Checkpoint (MGPU fleet)* returns) in ComfyUI's CFGGuider with the
LTX-2.3 template's recipe on the tiny bundle: LoraLoaderModelOnly's distilled-LoRA stand-in at 0.5,
ModelSamplingLTXV, LTXVImgToVideoInplace at strength 0.7 (a noise mask), video and audio latents,
cfg 1, the 8 distilled sigmas, euler_ancestral_cfg_pp. The same graph on the stock patcher in this
process is the reference: the whole sampling run is bitwise equal at one rank. Then cfg 3 (a batched
cond+uncond call) on two ranks, split into two guidance groups, and a refusal before sampling.

Needs COMFYUI_DIR and ComfyUI's Python (see tests/comfy_model_cases.py); skips without them.
"""

from __future__ import annotations

import os

import pytest
import torch

from mgpu_backend.comfy_model import remote
from mgpu_backend.ltx import api
from tests import comfy_model_cases as cases

DISTILLED_SIGMAS = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0)  # the template's ManualSigmas


@pytest.fixture(scope="module")
def stock(comfy):
    """ComfyUI's own patcher and VAE of the tiny LTX-2.3 checkpoint (CheckpointLoaderSimple's)."""
    import comfy.sd

    from mgpu_backend.bundles.tiny import default_tiny_bundle

    path = str(default_tiny_bundle("2.3").checkpoint_path)
    patcher, _, vae, _ = comfy.sd.load_checkpoint_guess_config(path, output_vae=True, output_clip=False)
    return path, patcher, vae


def use_fleet(socket_path):
    api.configure(address=str(socket_path))


@pytest.fixture(scope="module")
def fleet_1(fleet_of):
    return fleet_of(1)


@pytest.fixture(scope="module")
def fleet_2(fleet_of):
    return fleet_of(2)


def fleet_model(comfy, path, socket_path):
    use_fleet(socket_path)
    return remote.load_fleet_model(remote.FleetModelSpec(os.path.abspath(cases.COMFYUI_DIR), path))


def sample(comfy, model, vae, cfg: float, lora: dict | None):
    """ComfyUI's LTX-2.3 image-to-video stage 1 as its template wires it, on ``model``: (video, audio)."""
    import comfy.sample
    import comfy.samplers
    import comfy.sd
    from comfy_extras import nodes_lt

    if lora is not None:
        model, _ = comfy.sd.load_lora_for_models(model, None, lora, 0.5, 0)
    model = nodes_lt.ModelSamplingLTXV.execute(model, 2.05, 0.95).result[0]
    diffusion_model = model.model.diffusion_model
    generator = torch.Generator().manual_seed(1)
    width = cases.text_width(diffusion_model)
    positive = [[torch.randn(1, 12, width, generator=generator), {"unprocessed_ltxav_embeds": True, "frame_rate": 25.0}]]
    negative = [[torch.randn(1, 12, width, generator=generator), {"unprocessed_ltxav_embeds": True, "frame_rate": 25.0}]]
    image = torch.rand(1, 64, 96, 3, generator=generator)
    video = nodes_lt.LTXVImgToVideoInplace.execute(vae, image, {"samples": torch.zeros(1, 128, 3, 2, 3)}, 0.7).result[0]
    latent = nodes_lt.LTXVConcatAVLatent.execute(video, {"samples": torch.zeros(1, 8, 13, 16)}).result[0]
    guider = comfy.samplers.CFGGuider(model)
    guider.set_conds(positive, negative)
    guider.set_cfg(cfg)
    noise = comfy.sample.prepare_noise(latent["samples"], 42)
    out = guider.sample(noise, latent["samples"], comfy.samplers.sampler_object("euler_ancestral_cfg_pp"), torch.tensor(DISTILLED_SIGMAS),
                        denoise_mask=latent.get("noise_mask"), disable_pbar=True, seed=42)
    return out.unbind()


def test_the_template_recipe_on_one_rank_is_bitwise_comfyui_in_process(comfy, stock, fleet_1):
    path, patcher, vae = stock
    lora = cases.random_lora(comfy, patcher, seed=3)
    events = []
    model = fleet_model(comfy, path, fleet_1)
    model.fleet_link.on_forward = events.append
    with cases.torch_threads(cases.rank_threads(1)):
        expected = sample(comfy, patcher, vae, 1.0, lora)
        got = sample(comfy, model, vae, 1.0, lora)
    for reference, result in zip(expected, got):
        assert torch.equal(reference, result), (reference - result).abs().max()
    # cfg 1: one pass per step, each a fleet call that reports its step of the 8 and its rank's time
    assert [event["step"] for event in events] == list(range(1, 9)) and {event["total"] for event in events} == {8}
    assert all(len(event["rank_seconds"]) == 1 and event["rank_seconds"][0] > 0 for event in events)
    # the same MODEL without the LoRA gives the stock result without it: the fleet's patches follow the patcher
    with cases.torch_threads(cases.rank_threads(1)):
        plain_expected, plain_got = sample(comfy, patcher, vae, 1.0, None), sample(comfy, model, vae, 1.0, None)
    assert all(torch.equal(a, b) for a, b in zip(plain_expected, plain_got))
    assert not torch.equal(plain_got[0], got[0])


def test_cfg_3_on_two_ranks_runs_cond_and_uncond_on_two_groups(comfy, stock, fleet_2):
    path, patcher, vae = stock
    model = fleet_model(comfy, path, fleet_2)
    events = []
    model.fleet_link.on_forward = events.append
    with cases.torch_threads(cases.rank_threads(2)):
        expected = sample(comfy, patcher, vae, 3.0, None)
        got = sample(comfy, model, vae, 3.0, None)
    for reference, result in zip(expected, got):
        difference = (reference - result).abs().max().item()
        assert difference <= 1e-5 * max(1.0, reference.abs().max().item()), difference
    assert len(events) == 8 and all(len(event["rank_seconds"]) == 2 for event in events)


def test_a_block_replacement_is_refused_before_any_step(comfy, stock, fleet_1):
    path, patcher, vae = stock
    model = fleet_model(comfy, path, fleet_1).clone()
    model.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 0)
    events = []
    model.fleet_link.on_forward = events.append
    with pytest.raises(remote.UnsupportedModelPatch, match=r"'dit' block replacement at \('double_block', 0\)"):
        sample(comfy, model, vae, 1.0, None)
    assert events == []
