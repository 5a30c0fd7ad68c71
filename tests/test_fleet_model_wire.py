"""What a ComfyUI denoiser call and its weight patches become on the wire, and what the drop-in MODEL
refuses to send: pure functions, no ComfyUI and no fleet needed."""

from __future__ import annotations

import pytest
import torch

from mgpu_backend.comfy_model import remote, wire


def test_a_denoiser_call_round_trips_with_tuples_lists_and_scalars_intact():
    video, audio = torch.randn(1, 128, 2, 3, 4), torch.randn(1, 8, 9, 16)
    call = {
        "x": [video, audio],
        "timestep": (torch.tensor([0.7]), torch.tensor([0.7])),
        "context": torch.randn(1, 5, 192, dtype=torch.bfloat16),
        "transformer_options": {"cond_or_uncond": [0], "run_vx": True},
        "kwargs": {"frame_rate": 25.0, "latent_shapes": [[1, 128, 2, 3, 4], [1, 8, 9, 16]], "keyframe_idxs": None},
    }
    packed, tensors = wire.pack(call)
    assert len(tensors) == 5
    back = wire.unpack(packed, wire.tensors_in_order(wire.tensors_by_name(tensors), len(tensors)))
    assert isinstance(back["x"], list) and isinstance(back["timestep"], tuple)
    assert torch.equal(back["x"][0], video) and torch.equal(back["x"][1], audio)
    assert back["context"].dtype == torch.bfloat16
    assert back["kwargs"] == {"frame_rate": 25.0, "latent_shapes": [[1, 128, 2, 3, 4], [1, 8, 9, 16]], "keyframe_idxs": None}
    assert back["transformer_options"] == {"cond_or_uncond": [0], "run_vx": True}


def test_a_callable_is_refused_with_the_path_where_it_sits():
    with pytest.raises(wire.UnsupportedValue, match=r"kwargs\.patches\[1\] is a .*len from builtins"):
        wire.pack({"kwargs": {"patches": [1, len]}})


def test_a_packed_value_naming_a_tensor_that_did_not_come_is_refused():
    with pytest.raises(ValueError, match="names tensor 3, but 1 came"):
        wire.unpack({"$tensor": 3}, [torch.zeros(1)])
    with pytest.raises(ValueError, match="names tensors"):
        wire.tensors_in_order({"t0": torch.zeros(1)}, 2)


def test_many_tensors_share_one_aligned_buffer_and_come_back_exactly():
    named = {
        "a": torch.arange(7, dtype=torch.float32),
        "b": torch.randn(3, 5).to(torch.bfloat16),
        "c": torch.randn(4, 4).to(torch.float8_e4m3fn),
    }
    index, blob = wire.pack_tensor_blob(named)
    assert blob.dtype == torch.uint8 and all(entry["offset"] % wire.BLOB_ALIGN == 0 for entry in index)
    back = wire.unpack_tensor_blob(index, blob)
    for name, tensor in named.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8))


def test_a_blob_entry_running_past_its_buffer_is_refused():
    index, blob = wire.pack_tensor_blob({"a": torch.zeros(16)})
    index[0]["shape"] = [1 << 20]
    with pytest.raises(ValueError, match="runs past the end"):
        wire.unpack_tensor_blob(index, blob)


def test_patch_tensors_are_named_by_content_so_equal_loras_share_a_digest():
    up, down = torch.randn(8, 2), torch.randn(2, 8)
    patches = {"diffusion_model.a.weight": [(0.5, ("diff", (up @ down,)), 1.0, None, None)]}
    entries, by_digest = wire.pack_patches(patches)
    again, _ = wire.pack_patches({"diffusion_model.a.weight": [(0.5, ("diff", ((up @ down).clone(),)), 1.0, None, None)]})
    assert entries == again and len(by_digest) == 1
    assert wire.patch_set_digest(entries) == wire.patch_set_digest(again)
    rebuilt = wire.unpack_patches(entries, by_digest, make_adapter=None)
    strength, patch, model_strength, offset, function = rebuilt["diffusion_model.a.weight"][0]
    assert (strength, model_strength, offset, function) == (0.5, 1.0, None, None)
    assert patch[0] == "diff" and torch.equal(patch[1][0], up @ down)
    changed, _ = wire.pack_patches({"diffusion_model.a.weight": [(0.25, ("diff", (up @ down,)), 1.0, None, None)]})
    assert wire.patch_set_digest(changed) != wire.patch_set_digest(entries)


def test_a_lora_loaded_under_inference_mode_is_digested_again_and_again_and_an_edited_tensor_gets_a_new_digest():
    # ComfyUI runs its nodes under inference_mode: the LoRA's tensors have no version counter, and
    # the second sampler of a graph digests the same tensor objects a second time.
    with torch.inference_mode():
        lora = torch.randn(8, 8)
    patches = {"diffusion_model.a.weight": [(0.5, ("diff", (lora,)), 1.0, None, None)]}
    first, _ = wire.pack_patches(patches)
    assert wire.pack_patches(patches)[0] == first
    weight = torch.randn(4, 4)
    before = wire.tensor_digest(weight)
    assert wire.tensor_digest(weight) == before
    weight.add_(1.0)
    assert wire.tensor_digest(weight) != before


def test_a_patch_function_is_refused_naming_the_weight():
    with pytest.raises(wire.UnsupportedValue, match="patch function of diffusion_model.a.weight"):
        wire.pack_patches({"diffusion_model.a.weight": [(1.0, ("diff", (torch.zeros(1),)), 1.0, None, abs)]})


def test_transformer_options_keep_what_the_ranks_honour_and_drop_what_stays_in_comfyui():
    options = {"cond_or_uncond": [1, 0], "run_ax": False, "sigmas": torch.tensor([0.5]), "uuids": ["u"], "wrappers": {}}
    assert remote.transformer_options_to_send(options) == {"cond_or_uncond": [1, 0], "run_ax": False}


def my_block_patch(args, extra):
    return args


def test_a_block_replacement_is_refused_naming_its_origin():
    options = {"patches_replace": {"dit": {("double_block", 3): my_block_patch}}}
    with pytest.raises(remote.UnsupportedModelPatch, match=r"'dit' block replacement at \('double_block', 3\) by my_block_patch \(from [\w.]*test_fleet_model_wire\)"):
        remote.transformer_options_to_send(options)


def test_an_unknown_transformer_option_and_an_attention_override_are_refused():
    with pytest.raises(remote.UnsupportedModelPatch, match="transformer option 'my_cache'"):
        remote.transformer_options_to_send({"my_cache": object()})
    with pytest.raises(remote.UnsupportedModelPatch, match="attention function is replaced by my_block_patch"):
        remote.transformer_options_to_send({"optimized_attention_override": my_block_patch})


def test_an_object_patch_inside_the_diffusion_model_is_refused_but_model_sampling_is_not():
    remote.check_model_options({}, {"model_sampling": object()})
    with pytest.raises(remote.UnsupportedModelPatch, match="'diffusion_model.transformer_blocks.0' replaced"):
        remote.check_model_options({}, {"diffusion_model.transformer_blocks.0": my_block_patch})


def test_the_denoise_step_is_read_from_the_schedule():
    options = {"sample_sigmas": torch.tensor([1.0, 0.9, 0.4, 0.0]), "sigmas": torch.tensor([0.4])}
    assert remote.denoise_step(options) == (3, 3)
    assert remote.denoise_step({}) == (0, 0)


def test_a_kept_tensor_is_sent_once_then_named_and_the_keeper_holds_it():
    kept_here = wire.KeptTensors(min_bytes=16, skip=("x",))
    kept_there: dict[str, torch.Tensor] = {}
    context, latent = torch.randn(1, 8, 4), torch.randn(1, 8, 4)
    first, first_tensors = wire.pack({"x": latent, "context": context}, kept=kept_here)
    assert len(first_tensors) == 2 and "$keep" in first["context"] and "$keep" not in first["x"]
    assert torch.equal(wire.unpack(first, first_tensors, kept=kept_there)["context"], context)
    second, second_tensors = wire.pack({"x": torch.randn(1, 8, 4), "context": context}, kept=kept_here)
    assert len(second_tensors) == 1 and set(second["context"]) == {"$kept"}
    assert torch.equal(wire.unpack(second, second_tensors, kept=kept_there)["context"], context)
    context.add_(1)  # changed in place: a new tensor as far as keeping goes
    third, third_tensors = wire.pack({"x": latent, "context": context}, kept=kept_here)
    assert len(third_tensors) == 2


def test_a_sampler_s_new_tensor_with_the_sent_values_is_named_as_kept_and_bits_decide():
    # ComfyUI's sampler concatenates the conditioning anew at every step: same values, new tensor.
    kept_here = wire.KeptTensors(min_bytes=16, skip=("x",))
    kept_there: dict[str, torch.Tensor] = {}
    context = torch.randn(1, 8, 4)
    first, tensors = wire.pack({"x": torch.randn(2), "context": torch.cat([context])}, kept=kept_here)
    wire.unpack(first, tensors, kept=kept_there)
    again, tensors = wire.pack({"x": torch.randn(2), "context": torch.cat([context])}, kept=kept_here)
    assert len(tensors) == 1 and set(again["context"]) == {"$kept"}
    assert torch.equal(wire.unpack(again, tensors, kept=kept_there)["context"], context)
    zeros = torch.zeros(1, 8, 4)
    wire.pack({"context": zeros}, kept=kept_here)
    negative_zeros, tensors = wire.pack({"context": -zeros}, kept=kept_here)  # equal as floats, not as bits
    assert len(tensors) == 1 and "$keep" in negative_zeros["context"]
    as_other_dtype, tensors = wire.pack({"context": context.double()}, kept=kept_here)
    assert len(tensors) == 1


def test_the_sender_keeps_private_copies_so_an_in_place_change_after_sending_is_seen():
    kept_here = wire.KeptTensors(min_bytes=16)
    context = torch.randn(1, 8, 4)
    original = context.clone()
    wire.pack({"context": context}, kept=kept_here)
    context.mul_(2)  # ComfyUI's tensors under inference mode carry no version counter: only the bits tell
    changed, tensors = wire.pack({"context": context}, kept=kept_here)
    assert len(tensors) == 1 and "$keep" in changed["context"]
    back, tensors = wire.pack({"context": original}, kept=kept_here)
    assert len(tensors) == 0 and set(back["context"]) == {"$kept"}


def test_the_sender_s_copies_are_bounded_least_recently_used_first():
    kept_here = wire.KeptTensors(min_bytes=16, max_tensors=2, max_bytes=1 << 20)
    a, b, c = (torch.full((64,), float(value)) for value in range(3))
    for tensor in (a, b, a, c):  # a used again after b: b is the least recently used when c arrives
        wire.pack({"t": tensor}, kept=kept_here)
    assert len(wire.pack({"t": a}, kept=kept_here)[1]) == 0
    assert len(wire.pack({"t": b}, kept=kept_here)[1]) == 1
    too_large = wire.KeptTensors(min_bytes=16, max_bytes=128)
    assert too_large.token(torch.zeros(64), "t") == (None, False)  # 256 bytes: never kept, always sent


def test_a_call_naming_a_tensor_the_keeper_lost_raises_missing_kept_tensor():
    kept_here = wire.KeptTensors(min_bytes=16)
    context = torch.randn(1, 8, 4)
    wire.pack({"context": context}, kept=kept_here)
    again, tensors = wire.pack({"context": context}, kept=kept_here)
    with pytest.raises(wire.MissingKeptTensor):
        wire.unpack(again, tensors, kept={})
    kept_here.forget()
    resent, tensors = wire.pack({"context": context}, kept=kept_here)
    assert len(tensors) == 1


def _lora_adapter_class():
    """A stand-in for ComfyUI's LoRAAdapter, from a module of the name ComfyUI's adapters live in."""
    return type("LoRAAdapter", (), {"__module__": "comfy.weight_adapter.lora", "__init__": lambda self, keys, weights: setattr(self, "loaded_keys", keys) or setattr(self, "weights", weights)})


def test_adapters_sharing_the_lora_files_key_set_pack_to_entries_the_size_of_their_weights():
    # ComfyUI's LoRA loader gives every adapter of a file one set of all the file's keys: a 22B LoRA's
    # patch set once packed that set per weight (392 MB of JSON on the H200) and the send was refused.
    adapter = _lora_adapter_class()
    shared = {f"diffusion_model.transformer_blocks.{block}.attn{index}.lora_{half}.weight" for block in range(48) for index in range(40) for half in "AB"}
    up, down = torch.randn(64, 4), torch.randn(4, 64)
    patches = {f"diffusion_model.layer_{index}.weight": [(0.5, adapter(shared, (up, down, None, None, None, None)), 1.0, None, None)] for index in range(2000)}
    entries, by_digest = wire.pack_patches(patches)
    data = wire.entries_tensor(entries)
    assert len(by_digest) == 2
    assert data.numel() < 2000 * 400, data.numel()  # ~300 bytes per patched weight, whatever the file's key count
    assert wire.entries_from_tensor(data) == entries
    rebuilt = wire.unpack_patches(entries, by_digest, make_adapter=lambda name, weights: (name, weights))
    assert rebuilt["diffusion_model.layer_7.weight"][0][1] == ("LoRAAdapter", (up, down, None, None, None, None))


@pytest.mark.parametrize(("tensor", "words"), [
    (torch.zeros(3, dtype=torch.float32), "one-dimensional uint8 tensor of JSON"),
    (torch.frombuffer(bytearray(b"[{]"), dtype=torch.uint8), "not JSON"),
    (torch.frombuffer(bytearray(b'{"key": 1}'), dtype=torch.uint8), "must be the list"),
    (None, "one-dimensional uint8 tensor of JSON"),
])  # fmt: skip
def test_malformed_patch_entries_are_refused_in_words(tensor, words):
    with pytest.raises(ValueError, match=words):
        wire.entries_from_tensor(tensor)


def test_the_patched_weights_clean_copies_stay_on_a_gpu_with_room_else_on_the_host(monkeypatch):
    """A full-size LoRA patches about 40 GB of the 22B's weights: their clean copies (ComfyUI's
    ``ModelPatcher.backup``) stay on a GPU that keeps its headroom beside them, else on ComfyUI's host."""
    import types

    from mgpu_backend.comfy_model import runtime

    gpu, host, gib = torch.device("cuda", 0), torch.device("cpu"), 1 << 30
    weight = types.SimpleNamespace(numel=lambda: 20 * gib, element_size=lambda: 2, device=gpu)  # 40 GiB of bf16
    state = {"blocks.0.attn.to_q.weight": weight, "blocks.0.ff.weight": types.SimpleNamespace(numel=lambda: 1, element_size=lambda: 2, device=host)}
    free = {"bytes": 100 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 141 * gib))
    assert runtime.backup_device(state, state, gpu, host, environ={}) == gpu  # 100 - 40 = 60 GiB left, above a tenth of 141
    free["bytes"] = 50 * gib
    assert runtime.backup_device(state, state, gpu, host, environ={}) == host  # 10 GiB left: under 14.1 GiB
    free["bytes"] = 100 * gib
    assert runtime.backup_device(state, state, gpu, host, environ={"MGPU_MEMORY_FRACTION": "0.25"}) == host  # a capped rank
    assert runtime.backup_device(state, state, gpu, host, environ={"MGPU_SHARED_GPU_RANKS": "4"}) == host
    assert runtime.backup_device(state, state, host, host, environ={}) == host  # CPU ranks: ComfyUI's own choice
