"""The fleet (one CPU rank) as the denoiser of ComfyUI's own LTX-2.3 model: each call, run by ComfyUI's
own model code in a real rank process, is bitwise what ComfyUI's in-process diffusion model returns,
LoRA included; what the fleet cannot honour is refused in words.

Needs COMFYUI_DIR and ComfyUI's Python (see tests/comfy_model_cases.py); skips without them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mgpu_backend.comfy_model import wire
from mgpu_backend.fleet.client import FleetError
from tests import comfy_model_cases as cases
from tests.fleet_harness import module_fleet, run_job


@pytest.fixture(scope="module")
def tiny(comfy):
    return cases.load_tiny(comfy)


CASES = ("plain", "image_to_video", "keyframes", "padded")


@pytest.fixture(scope="module")
def calls(comfy, tiny):
    """The calls the fleet gets, and ComfyUI's in-process output of each at the threads of the rank of
    a 1-rank fleet (made before any LoRA touches the weights)."""
    _, patcher = tiny
    made = {case: cases.make_call(comfy, patcher, case, seed) for seed, case in enumerate(CASES)}
    expected = {case: cases.in_process(patcher, made[case], cases.rank_threads(1)) for case in CASES}
    return made, expected


@pytest.fixture(scope="module")
def lora_case(comfy, tiny, calls):
    """(patch entries, their tensors, the LoRA'd in-process output of the 'plain' call) at strength 0.5."""
    import comfy.model_management
    import comfy.sd

    _, patcher = tiny
    made, expected = calls
    lora_patcher, _ = comfy.sd.load_lora_for_models(patcher, None, cases.random_lora(comfy, patcher, seed=11), 0.5, 0)
    entries, tensors = wire.pack_patches(lora_patcher.patches)
    try:
        with cases.torch_threads(cases.rank_threads(1)):
            comfy.model_management.load_models_gpu([lora_patcher])  # ComfyUI computes the patched weights
        output = cases.in_process(patcher, made["plain"], cases.rank_threads(1))
    finally:
        comfy.model_management.unload_all_models()
    assert not torch.equal(output[0], expected["plain"][0]), "the LoRA changed nothing: the test would prove nothing"
    return entries, tensors, output


@pytest.fixture(scope="module")
def fleet_1(fleet_of, comfy):
    return fleet_of(1)


def test_load_reports_the_tiny_ltx23_model_as_comfyui_loads_it(fleet_1, tiny):
    fields = cases.load_in_fleet(fleet_1, tiny[0])
    assert fields["comfyui_version"] == "0.20.1"
    assert fields["model_class"] == "LTXAVModel"
    assert (fields["video_heads"], fields["audio_heads"]) == (8, 8)
    assert fields["sp_degrees"] == [1, 2, 4, 8]
    assert fields["dtype"] == "float32"
    assert cases.load_in_fleet(fleet_1, tiny[0])["model_key"] == fields["model_key"]  # resident: the same model, not a second one


@pytest.mark.parametrize("case", CASES)
def test_world_1_call_is_bitwise_comfyui_in_process(fleet_1, tiny, calls, case):
    key = cases.load_in_fleet(fleet_1, tiny[0])["model_key"]
    out, fields = cases.forward_in_fleet(fleet_1, key, calls[0][case])
    cases.assert_same(out, calls[1][case])
    assert len(fields["rank_seconds"]) == 1 and fields["rank_seconds"][0] > 0
    assert (fields["batch_groups"], fields["sp_degree"]) == (1, 1)


def test_world_1_lora_at_half_strength_is_bitwise_comfyui_in_process(fleet_1, tiny, calls, lora_case):
    entries, tensors, expected = lora_case
    key = cases.load_in_fleet(fleet_1, tiny[0])["model_key"]
    set_digest = wire.patch_set_digest(entries)
    with pytest.raises(FleetError, match=rf"{len(tensors)} patch tensors are not in the fleet; upload them with comfy.patches"):
        run_job(fleet_1, "comfy.patch_model", {"model_key": key, "set_digest": set_digest}, {"entries": wire.entries_tensor(entries)})
    index, blob = wire.pack_tensor_blob(tensors)
    assert set(run_job(fleet_1, "comfy.patches", {"index": index}, {"blob": blob}).fields["held"]) >= set(tensors)
    patched = run_job(fleet_1, "comfy.patch_model", {"model_key": key, "set_digest": set_digest}, {"entries": wire.entries_tensor(entries)}).fields
    assert patched == {"set_digest": set_digest, "patched_weights": 4}
    made, unpatched = calls
    try:
        with pytest.raises(FleetError, match="stale weight patches"):
            cases.forward_in_fleet(fleet_1, key, made["plain"], set_digest="")
        out, _ = cases.forward_in_fleet(fleet_1, key, made["plain"], set_digest)
        cases.assert_same(out, expected)
    finally:
        run_job(fleet_1, "comfy.patch_model", {"model_key": key, "set_digest": ""}, {"entries": wire.entries_tensor([])})
    out, _ = cases.forward_in_fleet(fleet_1, key, made["plain"])  # the patches came off: the unpatched weights are back, bitwise
    cases.assert_same(out, unpatched["plain"])


def test_text_embeds_are_the_in_process_connectors_output(fleet_1, tiny):
    key = cases.load_in_fleet(fleet_1, tiny[0])["model_key"]
    model = tiny[1].model.diffusion_model
    cross_attn = torch.randn(1, cases.TEXT_TOKENS, cases.text_width(model), generator=torch.Generator().manual_seed(3))
    result = run_job(fleet_1, "comfy.text_embeds", {"model_key": key, "set_digest": "", "unprocessed": True}, {"cross_attn": cross_attn})
    with cases.torch_threads(cases.rank_threads(1)), torch.inference_mode():
        expected = model.preprocess_text_embeds(cross_attn, unprocessed=True)
    assert expected.shape == (1, 1024, cases.text_width(model))  # the connectors' learnable registers fill 1024 tokens
    cases.assert_same(result.tensors["out"], expected)


def test_a_transformer_option_the_fleet_does_not_honour_is_refused_by_name(fleet_1, tiny, calls):
    key = cases.load_in_fleet(fleet_1, tiny[0])["model_key"]
    call = calls[0]["plain"]
    odd = cases.Call(call.x, call.timestep, call.context, {**call.transformer_options, "rope_options": {"shift_t": 1.0}}, call.kwargs)
    with pytest.raises(FleetError, match=r"transformer option\(s\) rope_options are not honoured by the fleet's denoiser"):
        cases.forward_in_fleet(fleet_1, key, odd)


def test_a_patch_set_the_weights_do_not_carry_is_refused(fleet_1, tiny, calls):
    key = cases.load_in_fleet(fleet_1, tiny[0])["model_key"]
    with pytest.raises(FleetError, match="stale weight patches: the call expects patch set 'deadbeef', the fleet's weights carry 'none'"):
        cases.forward_in_fleet(fleet_1, key, calls[0]["plain"], set_digest="deadbeef")


def test_a_comfyui_older_than_the_tested_releases_is_refused_before_anything_is_imported(fleet_1, tiny, tmp_path):
    other = tmp_path / "ComfyUI-0.19.0"
    other.mkdir()
    (other / "comfy").symlink_to(Path(cases.COMFYUI_DIR).resolve() / "comfy")
    (other / "comfyui_version.py").write_text('__version__ = "0.19.0"\n')
    with pytest.raises(FleetError, match=r"ComfyUI 0.19.0 is older than v0.20.1, the first release the fleet's engine was checked against"):
        run_job(fleet_1, "comfy.load", {"comfy_dir": str(other), "path": tiny[0], "loader": "checkpoint", "weight_dtype": "default"})


def test_a_cancel_stops_a_call_in_flight_at_its_next_cancel_point(fleet_1, comfy, tiny, calls):
    """The tiny model has 2 blocks, so a forward has 2 cancel points (its only ones); a cancel sent once
    the first is reported stops the call there or at the second (a block of 1280 tokens takes far
    longer than the cancel's way to the rank), and the fleet then serves the next call bitwise."""
    from mgpu_backend.fleet.client import FleetCancelled, FleetClient

    key = cases.load_in_fleet(fleet_1, tiny[0])["model_key"]
    seen: list[dict] = []
    args, tensors = cases.make_call(comfy, tiny[1], "long", seed=5).wire_args(key)
    with FleetClient.connect(str(fleet_1), autostart=False) as client:
        with pytest.raises(FleetCancelled, match=r"cancelled at comfy.forward step [12]/2"):
            client.run("comfy.forward", args, tensors, on_progress=seen.append, should_cancel=lambda: bool(seen))
    assert [event["stage"] for event in seen][:1] == ["comfy.forward"]
    out, _ = cases.forward_in_fleet(fleet_1, key, calls[0]["plain"])
    cases.assert_same(out, calls[1]["plain"])


@pytest.mark.slow
def test_a_newer_comfyui_whose_ltx_code_the_plan_covers_runs(tmp_path_factory, tiny):
    """A release after the tested ones is not refused by its number: the plan's structural checks decide
    (here ComfyUI v0.20.1's own code under a newer version file)."""
    newer = tmp_path_factory.mktemp("comfyui-newer")
    for entry in Path(cases.COMFYUI_DIR).resolve().iterdir():
        if entry.name != "comfyui_version.py":
            (newer / entry.name).symlink_to(entry)
    (newer / "comfyui_version.py").write_text('__version__ = "0.44.0"\n')
    for fleet in module_fleet(tmp_path_factory, "comfy-engine-newer", 1):
        fields = run_job(fleet, "comfy.load", {"comfy_dir": str(newer), "path": tiny[0], "loader": "checkpoint", "weight_dtype": "default"}).fields
        assert fields["comfyui_version"] == "0.44.0" and fields["model_class"] == "LTXAVModel"
