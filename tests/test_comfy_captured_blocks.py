"""CUDA-graph replay of ComfyUI's LTX transformer blocks: what a graph is keyed by, and (on a GPU) that
replaying it gives the eager blocks' results bit for bit, re-keyed when a shape changes."""

from __future__ import annotations

import pytest
import torch

from mgpu_backend.comfy_model import captured_blocks


class Compressed:
    """A stand-in with ComfyUI's CompressedTimestep's shape: slots, one of them a tensor."""

    __slots__ = ("data", "patches_per_frame")

    def __init__(self, data, patches_per_frame):
        self.data, self.patches_per_frame = data, patches_per_frame


def test_arguments_flatten_to_their_tensors_and_rebuild_with_others_in_their_place():
    video, audio, step = torch.randn(1, 6, 4), torch.randn(1, 3, 4), torch.randn(1, 2, 4)
    arguments = {"x": [video, audio], "timestep": [Compressed(step, 3), None], "pe": ((video, audio), (audio, video)), "kwargs": {"frames": 2}}
    tensors: list[torch.Tensor] = []
    structure = captured_blocks._flatten(arguments, tensors)
    assert len(tensors) == 7
    replacements = [tensor + 1 for tensor in tensors]
    rebuilt = captured_blocks._rebuild(structure, replacements)
    assert isinstance(rebuilt["x"], list) and isinstance(rebuilt["pe"][0], tuple)
    assert torch.equal(rebuilt["x"][0], video + 1) and rebuilt["kwargs"] == {"frames": 2}
    assert isinstance(rebuilt["timestep"][0], Compressed) and torch.equal(rebuilt["timestep"][0].data, step + 1)
    assert rebuilt["timestep"][0].patches_per_frame == 3


def test_a_graph_is_keyed_by_shapes_structure_and_the_options_the_blocks_read():
    def key(video, options):
        tensors: list[torch.Tensor] = []
        structure = captured_blocks._flatten({"x": [video]}, tensors)
        return captured_blocks._signature(structure, tensors, options)

    base = key(torch.zeros(1, 6, 4), {"run_vx": True, "sigmas": torch.ones(1)})
    assert base == key(torch.ones(1, 6, 4), {"run_vx": True, "sigmas": torch.zeros(1)})  # values and unread options do not count
    assert base != key(torch.zeros(1, 7, 4), {"run_vx": True})
    assert base != key(torch.zeros(1, 6, 4, dtype=torch.bfloat16), {"run_vx": True})
    assert base != key(torch.zeros(1, 6, 4), {"run_vx": False})


def test_an_unknown_argument_type_cannot_be_captured():
    with pytest.raises(TypeError, match="called with a object"):
        captured_blocks._flatten({"x": object()}, [])


def on_cuda(call):
    from dataclasses import fields, replace

    def move(value):
        if isinstance(value, torch.Tensor):
            return value.cuda()
        if isinstance(value, (list, tuple)):
            return type(value)(move(item) for item in value)
        if isinstance(value, dict):
            return {key: move(item) for key, item in value.items()}
        return value

    return replace(call, **{field.name: move(getattr(call, field.name)) for field in fields(call)})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_blocks_equal_eager_blocks_bitwise_on_the_gpu():
    from tests import comfy_model_cases as cases

    comfy = cases.import_comfy_or_skip(device=torch.device("cuda", 0))
    import comfy.model_management

    _, patcher = cases.load_tiny(comfy)
    calls = {case: on_cuda(cases.make_call(comfy, patcher, case, seed=5, device=torch.device("cuda", 0))) for case in ("plain", "keyframes")}
    comfy.model_management.load_models_gpu([patcher], force_full_load=True)
    diffusion_model = patcher.model.diffusion_model
    outputs = {}
    for case, call in calls.items():
        eager = cases.in_process(patcher, call, torch.get_num_threads())
        wrapper = captured_blocks.capture_blocks(diffusion_model, None)
        try:
            first = cases.in_process(patcher, call, torch.get_num_threads())
            second = cases.in_process(patcher, call, torch.get_num_threads())
            assert wrapper.replays == 2 and len(wrapper.graphs) == 1
        finally:
            wrapper.remove()
        cases.assert_same(first, eager)
        cases.assert_same(second, eager)
        outputs[case] = eager
    assert "_process_transformer_blocks" not in diffusion_model.__dict__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_lora_on_a_gpu_rank_keeps_its_clean_weights_on_the_gpu_and_replays_them_patched_then_restored():
    """The rank's patch path (``runtime.apply_patches``) on a GPU with room: the clean copies of the patched
    weights stay on the GPU (not ~40 GB of host memory per rank at full size), the patched weights are ComfyUI's
    own (``patch_weight_to_device``, in-process), a captured forward equals the eager one, and taking the
    patches off restores the loaded weights bitwise."""
    from mgpu_backend.comfy_model import runtime
    from tests import comfy_model_cases as cases

    device = torch.device("cuda", 0)
    comfy = cases.import_comfy_or_skip(device=device)
    path, reference = cases.load_tiny(comfy)
    patcher = runtime.load_model(path, "checkpoint", "default", device)
    loaded = runtime.LoadedModel("gpu-lora", patcher)
    clean = {key: value.clone() for key, value in patcher.model.state_dict().items()}
    lora = cases.random_lora(comfy, reference, seed=3)
    patched_reference, _ = comfy.sd.load_lora_for_models(reference, None, lora, 0.5, 0)
    runtime.apply_patches(loaded, dict(patched_reference.patches), device)
    assert patcher.backup and {entry.weight.device for entry in patcher.backup.values()} == {device}
    expected = {key: patched_reference.patch_weight_to_device(key, device_to=device, return_weight=True) for key in patched_reference.patches}
    for key, weight in expected.items():
        assert torch.equal(patcher.model.state_dict()[key], weight.to(clean[key].dtype)), key
    call = on_cuda(cases.make_call(comfy, patcher, "plain", seed=5, device=device))
    eager = cases.in_process(patcher, call, torch.get_num_threads())
    wrapper = captured_blocks.capture_blocks(patcher.model.diffusion_model, None)
    try:
        replayed = [cases.in_process(patcher, call, torch.get_num_threads()) for _ in range(2)]
        assert wrapper.replays == 2
    finally:
        wrapper.remove()
    for output in replayed:
        cases.assert_same(output, eager)
    runtime.apply_patches(loaded, {}, device)
    assert not patcher.backup
    for key, value in patcher.model.state_dict().items():
        assert torch.equal(value, clean[key]), key
