"""The weight tracker swaps LoRA sets into a resident transformer exactly as ltx-core fuses them, and
parks it in host memory (storages emptied, Parameters kept) and back bitwise.

Two gloo ranks on the tiny bundle run one scenario each (a cold job, then a warm job on the same
tracker); the tests read its results. References come from a SEPARATE ModelLoader (its own
registry), so they cannot be bent by anything the tracker does to its own loader. Parking runs on
CPU tensors too (``HostParking`` does not care where the storages live), so its mechanism is tested
here on a tiny transformer's forward; the tracker itself parks only on a GPU (a CUDA test below: a
CPU rank's weights are the checkpoint's memory map, which cannot be freed, and nothing to free).
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open

from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.weight_tracker import HostParking, TransformerWeightTracker, clean_shard_on_host, stage_lora_set
from tests.dist_harness import run_ranks
from tests.helpers import build_tiny_model, transformer_inputs

WORLD_SIZE = 2
BUCKET_BYTES = 64 * 1024  # small, so one swap needs several bucket broadcasts per owner


def _spec(bundle: dict) -> ModelSpec:
    return ModelSpec(
        checkpoint_path=bundle["checkpoint_path"],
        gemma_root=bundle["gemma_root"],
        distilled_lora=bundle["distilled_lora_path"],
    )


def _differences(model: torch.nn.Module, reference: torch.nn.Module) -> tuple[int, float]:
    """(keys not bitwise equal, max abs difference over all keys) between two transformers' weights."""
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    unequal = sum(not torch.equal(ours[key], theirs[key]) for key in ours)
    max_diff = max((ours[key].float() - theirs[key].float()).abs().max().item() for key in ours)
    return unequal, max_diff


def _tracker_scenario(bundle: dict) -> dict:
    torch.set_num_threads(1)
    spec = _spec(bundle)
    loader = ModelLoader(spec, "cpu", torch.bfloat16)
    reference_loader = ModelLoader(spec, "cpu", torch.bfloat16)
    clean_reference = reference_loader.transformer("none")
    distilled_reference = reference_loader.transformer("distilled")
    distilled_set = stage_lora_set(spec, "distilled")
    out: dict = {"lora_changes_weights": _differences(distilled_reference, clean_reference)}

    # Cold job: stage 1 (no LoRA), stage 2 (distilled), then stage 1 again (a reset).
    tracker = TransformerWeightTracker(Comm.world(), bucket_bytes=BUCKET_BYTES)
    model = tracker.transformer(loader, "none")
    out["built_equals_clean"] = _differences(model, clean_reference)
    tracker.apply(distilled_set)
    out["first_swap"] = vars(tracker.stats).copy()
    out["fused_equals_ltx_core"] = _differences(model, distilled_reference)
    before = vars(tracker.stats).copy()
    weights_before = {key: value.clone() for key, value in model.state_dict().items()}
    assert tracker.transformer(loader, "distilled") is model
    out["unchanged_before"], out["unchanged_after"] = before, vars(tracker.stats).copy()
    out["unchanged_weights_equal"] = all(torch.equal(weights_before[k], v) for k, v in model.state_dict().items())
    tracker.apply(())
    out["reset_equals_clean"] = _differences(model, clean_reference)
    out["cold_job_bytes"] = loader.bytes_read_from_disk

    # Warm job on the same tracker: both stages again, nothing read from disk.
    for stage in ("none", "distilled"):
        assert tracker.transformer(loader, stage) is model
        out[f"warm_{stage}"] = _differences(model, clean_reference if stage == "none" else distilled_reference)
    tracker.apply(())
    out["warm_job_bytes"] = loader.bytes_read_from_disk - out["cold_job_bytes"]
    out["stats_end"] = vars(tracker.stats).copy()

    # The HQ recipe's two sets: one LoRA file at two strengths (0.25 in stage 1, 0.5 in stage 2), swapped
    # into each other and back as any two sets.
    hq_references = {stage: reference_loader.transformer(stage) for stage in ("distilled-stage-1", "distilled-stage-2")}
    out["hq_sets_differ"] = _differences(hq_references["distilled-stage-1"], hq_references["distilled-stage-2"])
    out["hq_swaps"] = []
    for stage in ("distilled-stage-1", "distilled-stage-2", "distilled-stage-1"):
        assert tracker.transformer(loader, stage) is model
        out["hq_swaps"].append(_differences(model, hq_references[stage]))
    tracker.apply(())
    out["hq_reset_equals_clean"] = _differences(model, clean_reference)

    out["owned_keys"] = list(tracker._clean)  # the clean weights this rank really holds: its shard
    out["key_bytes"] = {key: value.nbytes for key, value in model.velocity_model.state_dict().items()}
    out["memory"] = tracker.memory_report()
    # Parking on a CPU rank frees nothing: a no-op, said once (the weights stay where they were).
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("mgpu_backend.parallel.weight_tracker")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        out["cpu_park_bytes"] = [tracker.park(), tracker.park()]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out["cpu_park_lines"] = [line for line in lines if "not parked" in line]
    out["cpu_parked"] = tracker.parked
    out["cpu_park_keeps_weights"] = _differences(model, clean_reference)
    # The tracker dropped the loader's host copy of the transformer when it built: a later build by
    # the loader reads the checkpoint again, and the LoRA fused in place above did not reach it.
    out["host_copy_dropped"] = loader.drop_host_copy("transformer") == 0
    before_rebuild = loader.bytes_read_from_disk
    out["registry_stays_clean"] = _differences(loader.transformer("none"), clean_reference)
    out["rebuild_bytes"] = loader.bytes_read_from_disk - before_rebuild

    # The clean shard in host memory (what an 80 GB GPU gets at 19B): the same weights after swaps.
    hosted = TransformerWeightTracker(Comm.world(), bucket_bytes=BUCKET_BYTES, clean_on_host=True)
    hosted_model = hosted.transformer(loader, "distilled")
    out["host_shard_fused_equals_ltx_core"] = _differences(hosted_model, distilled_reference)
    hosted.apply(())
    out["host_shard_reset_equals_clean"] = _differences(hosted_model, clean_reference)
    out["host_shard_memory"] = hosted.memory_report()

    # no_lora_swap: one set may be fused once, with no clean shard; a change is refused.
    fixed = TransformerWeightTracker(Comm.world(), no_lora_swap=True)
    fixed_model = fixed.transformer(loader, "distilled")
    out["no_swap_fused_equals_ltx_core"] = _differences(fixed_model, distilled_reference)
    out["no_swap_memory"] = fixed.memory_report()
    try:
        fixed.transformer(loader, "none")
        out["no_swap_error"] = None
    except RuntimeError as error:
        out["no_swap_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def results(bundle) -> list[dict]:
    paths = {name: getattr(bundle, name) for name in ("checkpoint_path", "gemma_root", "distilled_lora_path")}
    return run_ranks(WORLD_SIZE, _tracker_scenario, paths)


def _lora_targets(lora_path: str) -> set[str]:
    """The transformer keys the LoRA file has A/B pairs for, read straight from the file."""
    with safe_open(lora_path, framework="pt") as f:
        names = set(f.keys())
    return {
        name.removeprefix("diffusion_model.").removesuffix(".lora_A.weight") + ".weight"
        for name in names
        if name.endswith(".lora_A.weight") and name.replace(".lora_A.", ".lora_B.") in names
    }


def _file_tensor_bytes(path: str, prefix: str = "") -> int:
    with safe_open(path, framework="pt") as f:
        return sum(f.get_tensor(key).nbytes for key in f.keys() if key.startswith(prefix))


def test_distilled_lora_fused_by_tracker_is_bitwise_ltx_core_fusion_on_every_rank(results, bundle):
    for rank, out in enumerate(results):
        changed, max_change = out["lora_changes_weights"]
        assert changed == len(_lora_targets(bundle.distilled_lora_path)) and max_change > 0, (changed, max_change)
        unequal, max_diff = out["fused_equals_ltx_core"]
        assert unequal == 0, f"rank {rank}: {unequal} keys differ from ltx-core's fusion, max abs diff {max_diff}"
        unequal, max_diff = out["warm_distilled"]
        assert unequal == 0, f"rank {rank}, warm job: {unequal} keys differ, max abs diff {max_diff}"
        unequal, max_diff = out["no_swap_fused_equals_ltx_core"]
        assert unequal == 0, f"rank {rank}, no_lora_swap: {unequal} keys differ, max abs diff {max_diff}"


def test_the_hq_sets_one_lora_at_two_strengths_swap_into_each_other_bitwise_on_every_rank(results):
    for rank, result in enumerate(results):
        unequal, max_diff = result["hq_sets_differ"]
        assert unequal > 0 and max_diff > 0.0, f"rank {rank}: 0.25 and 0.5 must fuse to different weights"
        assert result["hq_swaps"] == [(0, 0.0)] * 3, f"rank {rank}: {result['hq_swaps']}"
        assert result["hq_reset_equals_clean"] == (0, 0.0), f"rank {rank}"


def test_reset_restores_clean_weights_bitwise(results):
    for rank, out in enumerate(results):
        for name in ("built_equals_clean", "reset_equals_clean", "warm_none", "registry_stays_clean"):
            unequal, max_diff = out[name]
            assert unequal == 0, f"rank {rank}, {name}: {unequal} keys differ from clean, max abs diff {max_diff}"


def test_swap_updates_exactly_the_lora_targets_in_several_buckets(results, bundle):
    targets = _lora_targets(bundle.distilled_lora_path)
    key_bytes = results[0]["key_bytes"]
    target_bytes = sum(key_bytes[key] for key in targets)
    assert targets <= key_bytes.keys(), sorted(targets - key_bytes.keys())[:3]
    fused_per_rank = []
    for rank, out in enumerate(results):
        swap = out["first_swap"]
        assert swap["keys_broadcast"] == len(targets), (rank, swap, len(targets))
        assert swap["bytes_broadcast"] == target_bytes, (rank, swap, target_bytes)
        assert swap["broadcasts"] > WORLD_SIZE, f"rank {rank}: {swap['broadcasts']} broadcasts, expected buckets"
        fused_per_rank.append(swap["keys_fused"])
    # Each target is fused by its owner alone.
    assert sum(fused_per_rank) == len(targets), (fused_per_rank, len(targets))


def test_unchanged_lora_set_does_no_work(results):
    for rank, out in enumerate(results):
        before, after = out["unchanged_before"], out["unchanged_after"]
        assert after["unchanged"] == before["unchanged"] + 1, (rank, before, after)
        assert {k: v for k, v in after.items() if k != "unchanged"} == {
            k: v for k, v in before.items() if k != "unchanged"
        }, (rank, before, after)
        assert out["unchanged_weights_equal"], f"rank {rank}: weights changed on an unchanged LoRA set"
        # Cold job: 2 swaps (to distilled, back to none); warm job: 2 more (its first "none" is unchanged).
        assert out["stats_end"]["swaps"] == 4, (rank, out["stats_end"])


def test_clean_copy_is_sharded_once_over_ranks_with_about_half_the_bytes_each(results):
    key_bytes = results[0]["key_bytes"]
    total = sum(key_bytes.values())
    owned = [set(out["owned_keys"]) for out in results]
    assert set.union(*owned) == key_bytes.keys(), "some keys have no owner"
    assert sum(len(keys) for keys in owned) == len(key_bytes), "some keys have several owners"
    for rank, out in enumerate(results):
        memory = out["memory"]
        assert memory["clean_shard_bytes"] == sum(key_bytes[key] for key in owned[rank])
        share = memory["clean_shard_bytes"] / total
        assert abs(share - 1 / WORLD_SIZE) < 0.02, f"rank {rank} holds {share:.4f} of {total} clean bytes"
        assert memory["working_bytes"] == total, (rank, memory, total)
        assert out["no_swap_memory"]["clean_shard_bytes"] == 0, out["no_swap_memory"]


def test_warm_job_reads_nothing_from_disk(results, bundle):
    expected_cold = _file_tensor_bytes(bundle.checkpoint_path, "model.diffusion_model.") + _file_tensor_bytes(
        bundle.distilled_lora_path
    )
    for rank, out in enumerate(results):
        assert out["cold_job_bytes"] == expected_cold, (rank, out["cold_job_bytes"], expected_cold)
        assert out["warm_job_bytes"] == 0, f"rank {rank}: warm job read {out['warm_job_bytes']} bytes"


def test_tracker_drops_the_host_copy_and_a_later_build_reads_the_checkpoint_clean(results, bundle):
    transformer_bytes = _file_tensor_bytes(bundle.checkpoint_path, "model.diffusion_model.")
    for rank, out in enumerate(results):
        assert out["host_copy_dropped"], rank
        assert out["rebuild_bytes"] == transformer_bytes, (rank, out["rebuild_bytes"], transformer_bytes)
        assert out["registry_stays_clean"] == (0, 0.0), (rank, out["registry_stays_clean"])


def test_a_clean_shard_in_host_memory_swaps_to_the_same_weights(results):
    for rank, out in enumerate(results):
        for name in ("host_shard_fused_equals_ltx_core", "host_shard_reset_equals_clean"):
            unequal, max_diff = out[name]
            assert unequal == 0, f"rank {rank}, {name}: {unequal} keys differ, max abs diff {max_diff}"
        assert out["host_shard_memory"]["clean_shard_device"] == "cpu"
        assert out["host_shard_memory"]["clean_shard_bytes"] == out["memory"]["clean_shard_bytes"], "same shard, other place"


def test_clean_shard_goes_to_host_memory_only_when_the_gpu_would_be_too_full():
    gib = 2**30
    transformer = 38 * gib  # LTX-2 19B in bf16
    cuda = torch.device("cuda", 0)
    # One H200 (141 GB) keeps working copy + whole clean copy (76 GiB) on the GPU; one H100 cannot.
    assert not clean_shard_on_host(transformer, transformer, cuda, device_total_bytes=141 * gib)
    assert clean_shard_on_host(transformer, transformer, cuda, device_total_bytes=80 * gib)
    # H100s: two GPUs still host the shard (57 GiB), four keep it on the GPU (47.5 GiB).
    assert clean_shard_on_host(transformer, transformer // 2, cuda, device_total_bytes=80 * gib)
    assert not clean_shard_on_host(transformer, transformer // 4, cuda, device_total_bytes=80 * gib)
    assert not clean_shard_on_host(transformer, transformer, torch.device("cpu"))


def test_no_lora_swap_refuses_a_second_lora_set_with_advice(results):
    for out in results:
        assert out["no_swap_error"] is not None and "no_lora_swap" in out["no_swap_error"], out["no_swap_error"]


def test_unknown_stage_lora_set_is_refused(bundle):
    spec = ModelSpec(checkpoint_path=bundle.checkpoint_path, gemma_root=bundle.gemma_root)
    with pytest.raises(ValueError, match="'none' or 'distilled'"):
        stage_lora_set(spec, "stage2")
    with pytest.raises(ValueError, match="distilled LoRA"):
        stage_lora_set(spec, "distilled")


def test_parking_on_a_cpu_rank_is_a_no_op_said_once(results):
    for rank, out in enumerate(results):
        assert out["cpu_park_bytes"] == [0, 0] and out["cpu_parked"] is False, (rank, out["cpu_park_bytes"])
        assert len(out["cpu_park_lines"]) == 1 and "nothing to free" in out["cpu_park_lines"][0], out["cpu_park_lines"]
        assert out["cpu_park_keeps_weights"] == (0, 0.0), (rank, out["cpu_park_keeps_weights"])


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def _loader_with_distilled_lora(bundle, device) -> ModelLoader:
    spec = ModelSpec(checkpoint_path=bundle.checkpoint_path, gemma_root=bundle.gemma_root, distilled_lora=bundle.distilled_lora_path)
    return ModelLoader(spec, device, torch.bfloat16)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
def test_parking_empties_every_storage_once_and_brings_weights_and_forward_back_bitwise(device):
    model = build_tiny_model(seed=1).to(device)
    video, audio = transformer_inputs(seed=2, device=device)
    with torch.inference_mode():
        expected = model(video=video, audio=audio, perturbations=None)
    weights = _state(model)
    tensors = list(model.velocity_model.state_dict(keep_vars=True).values())
    parameters = list(model.parameters())
    unique_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    # A view of a parameter shares its storage: parked with it, counted once.
    view = parameters[0].detach()[:1]
    parking = HostParking()

    for round_ in range(2):  # the second park reuses the host buffer of the first
        allocated = torch.cuda.memory_allocated(device) if device == "cuda" else None
        moved = parking.park([*tensors, view])
        assert moved == unique_bytes and parking.parked, (moved, unique_bytes)
        assert all(t.untyped_storage().nbytes() == 0 for t in [*tensors, view]), "a storage kept its bytes"
        if allocated is not None:
            assert allocated - torch.cuda.memory_allocated(device) >= unique_bytes, "the GPU memory was not freed"
        assert [p.shape for p in model.parameters()] == [p.shape for p in parameters]
        if round_ == 0:
            buffer = parking._buffer.data_ptr()
            assert parking.buffer_bytes == unique_bytes and parking._buffer.is_pinned() == (device == "cuda")
        else:
            assert parking._buffer.data_ptr() == buffer, "a later park allocated a new host buffer"
        with pytest.raises(RuntimeError, match="parked already; unpark"):
            parking.park(tensors)
        assert parking.unpark() == unique_bytes and not parking.parked
        assert all(a is b for a, b in zip(parameters, model.parameters(), strict=True)), "parking replaced a Parameter"
        assert all(torch.equal(weights[key], value) for key, value in model.state_dict().items())
        with torch.inference_mode():
            got = model(video=video, audio=audio, perturbations=None)
        for name, e, g in zip(("video", "audio"), expected, got, strict=True):
            assert torch.equal(e, g), f"{name} differs after a park and unpark"
    assert parking.unpark() == 0, "unparking twice moved bytes"


def test_parking_refuses_storage_it_cannot_free_before_moving_anything():
    borrowed = torch.frombuffer(bytearray(64), dtype=torch.uint8)  # not resizable: the bytes are Python's
    owned = torch.ones(16)
    parking = HostParking()
    with pytest.raises(RuntimeError, match="1 of the tensors to park live in storage that cannot be freed"):
        parking.park([owned, borrowed])
    assert not parking.parked and owned.untyped_storage().nbytes() == 64 and torch.equal(owned, torch.ones(16))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
def test_parking_takes_weights_held_in_host_memory_already_back_from_there_and_copies_only_the_rest(device):
    whole = torch.arange(64, dtype=torch.bfloat16, device=device)  # its own storage: restorable
    other = torch.ones(32, dtype=torch.float32, device=device)
    backing = torch.arange(40, dtype=torch.float32, device=device)
    part = backing[8:24]  # a view inside a larger storage: parked in the buffer whatever it is offered
    held = whole.cpu() + 1  # not its values: shows that the tensor came back from here, not from a copy of itself
    parking = HostParking()
    freed = parking.park([whole, other, part], restore_from=[(whole, held), (part, part.cpu())])
    assert freed == whole.nbytes + other.nbytes + backing.nbytes, freed
    assert parking.last_restorable_bytes == whole.nbytes
    assert parking.buffer_bytes == other.nbytes + backing.nbytes, "the weights held in host memory were copied again"
    assert all(t.untyped_storage().nbytes() == 0 for t in (whole, other, part))
    assert parking.unpark() == freed and not parking.parked
    assert torch.equal(whole.cpu(), held) and torch.equal(other.cpu(), torch.ones(32))
    assert torch.equal(backing.cpu(), torch.arange(40, dtype=torch.float32))
    # Only copies of the same shape and dtype in host memory qualify; the rest goes to the buffer.
    parking = HostParking()
    parking.park([whole], restore_from=[(whole, held.float())])
    assert parking.last_restorable_bytes == 0 and parking.buffer_bytes == whole.nbytes
    parking.unpark()
    assert torch.equal(whole.cpu(), held)


@gpu
@pytest.mark.gpu
def test_a_tracker_with_its_clean_shard_in_host_memory_parks_only_what_a_lora_touched_into_its_buffer(bundle):
    device = torch.device("cuda", 0)
    loader = _loader_with_distilled_lora(bundle, device)
    tracker = TransformerWeightTracker(Comm.world(), clean_on_host=True)  # one rank: every key's clean rows, in host memory
    model = tracker.transformer(loader, "none")
    clean, report = _state(model), tracker.memory_report()
    before = torch.cuda.memory_allocated(device)
    moved = tracker.park()
    assert moved == report["working_bytes"] and before - torch.cuda.memory_allocated(device) >= moved
    assert tracker._parking.buffer_bytes == 0, "weights equal to the clean shard in host memory were copied again"
    assert tracker.transformer(loader, "none") is model
    assert all(torch.equal(clean[key], value) for key, value in model.state_dict().items())
    distilled = _state(tracker.transformer(loader, "distilled"))
    touched = sum(tracker._working[key].nbytes for key in tracker._touched)
    assert 0 < touched < report["working_bytes"], touched
    tracker.park()
    assert tracker._parking.buffer_bytes == touched and tracker._parking.last_restorable_bytes == report["working_bytes"] - touched
    swapped = tracker.transformer(loader, "distilled")
    assert all(torch.equal(distilled[key], value) for key, value in swapped.state_dict().items())
    tracker.park()
    back = tracker.transformer(loader, "none")  # the LoRA's keys from the buffer, then back to clean from the host rows
    assert all(torch.equal(clean[key], value) for key, value in back.state_dict().items())


def _sharded_parking_on_one_gpu(bundle: dict, device: str = "cuda:0") -> dict:
    """A tracker sharded over the ranks, all on GPU 0: parks with no LoRA and with the distilled one,
    and whether each rank's rows come back bitwise."""
    with torch.inference_mode():  # as a fleet rank runs its jobs
        return _sharded_parking(ModelLoader(_spec(bundle), torch.device(device), torch.bfloat16))


def _sharded_parking(loader: ModelLoader) -> dict:
    from mgpu_backend.parallel.weight_sharding import local_state_dict

    tracker = TransformerWeightTracker(Comm.world(), shard_weights=True, clean_on_host=True)
    model = tracker.transformer(loader, "none")

    def rows() -> dict[str, torch.Tensor]:
        return {key: value.detach().cpu().clone() for key, value in local_state_dict(model).items()}

    def same(expected: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(expected[key], value.cpu()) for key, value in local_state_dict(model).items())

    clean, report = rows(), tracker.memory_report()
    # A parameter whose rows FSDP pads (its first dimension not a multiple of the ranks) owns more bytes than its rows.
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in local_state_dict(model).values()}
    out = {"working": report["working_bytes"], "storages": sum(storages.values()), "clean_on_host": report["clean_shard_device"] == "cpu"}
    out["moved"] = tracker.park()
    out["buffer, no LoRA"], out["restored, no LoRA"] = tracker._parking.buffer_bytes, tracker._parking.last_restorable_bytes
    out["clean back"] = tracker.transformer(loader, "none") is model and same(clean)
    tracker.transformer(loader, "distilled")
    distilled = rows()
    out["touched"] = sum(tracker._working[key].nbytes for key in tracker._touched)
    tracker.park()
    out["buffer, distilled"] = tracker._parking.buffer_bytes
    out["distilled back"] = tracker.transformer(loader, "distilled") is model and same(distilled)
    tracker.park()
    out["clean after a parked swap"] = tracker.transformer(loader, "none") is model and same(clean)
    return out


@gpu
@pytest.mark.gpu
def test_sharded_ranks_on_one_gpu_park_their_rows_for_no_host_memory_and_get_them_back_bitwise(bundle):
    for rank, out in enumerate(run_ranks(WORLD_SIZE, _sharded_parking_on_one_gpu, vars(bundle), timeout=600)):
        assert out["clean_on_host"] and out["moved"] == out["storages"] > 0, (rank, out)
        # Only padded rows (a few small tables) go into the buffer: every other weight comes back from the host rows.
        assert out["buffer, no LoRA"] + out["restored, no LoRA"] == out["moved"], (rank, out)
        assert out["buffer, no LoRA"] <= 0.01 * out["working"], (rank, out)
        assert 0 < out["touched"] < out["working"] and out["buffer, distilled"] == out["buffer, no LoRA"] + out["touched"], (rank, out)
        assert out["clean back"] and out["distilled back"] and out["clean after a parked swap"], (rank, out)


@gpu
@pytest.mark.gpu
def test_a_parked_tracker_frees_the_transformer_on_the_gpu_and_gives_it_back_bitwise_for_the_next_swap(bundle):
    device = torch.device("cuda", 0)
    loader = _loader_with_distilled_lora(bundle, device)
    tracker = TransformerWeightTracker(Comm.world(), clean_on_host=False)  # one rank: the whole clean copy, on the GPU
    distilled = _state(tracker.transformer(loader, "distilled"))
    model = tracker.transformer(loader, "none")
    clean, parameters = _state(model), list(model.parameters())
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    moved = tracker.park()
    freed = before - torch.cuda.memory_allocated(device)
    report = tracker.memory_report()
    assert tracker.parked and report["parked"] and tracker._parking._buffer.is_pinned()
    assert moved == report["working_bytes"] + report["clean_shard_bytes"] and freed >= moved, (moved, freed, report)
    assert tracker.park() == 0, "parking twice moved bytes"
    assert tracker.transformer(loader, "none") is model and not tracker.parked  # what a stage calls: unparks
    assert all(a is b for a, b in zip(parameters, model.parameters(), strict=True))
    assert all(torch.equal(clean[key], value) for key, value in model.state_dict().items())
    tracker.park()
    swapped = tracker.transformer(loader, "distilled")  # a LoRA swap straight after a park: from the clean shard it put back
    assert all(torch.equal(distilled[key], value) for key, value in swapped.state_dict().items())


def test_status_says_how_much_of_a_clean_shard_in_host_memory_is_the_checkpoint_file_itself():
    from mgpu_backend.fleet.client import format_status

    gib = 2**30
    weights = {"working_bytes": 11 * gib, "clean_shard_bytes": 11 * gib, "clean_shard_device": "cpu", "other_components_bytes": gib,
               "host_copies_bytes": 2 * gib}  # fmt: skip
    rank = {"rank": 0, "pid": 1, "device": "cuda:0", "alive": True, "memory": {"allocated": 12 * gib}}
    status = {"server_pid": 1, "address": "a", "devices": "1 GPU", "uptime_seconds": 1, "current_job": None, "queue_length": 0,
              "jobs_completed": 0, "fleet_restarts": 0}  # fmt: skip
    copied = format_status({**status, "ranks": [{**rank, "weights": {**weights, "clean_shard_file_bytes": 0}}]})
    viewed = format_status({**status, "ranks": [{**rank, "weights": {**weights, "clean_shard_file_bytes": 11 * gib}}]})
    assert "clean shard 11.00 GiB in host memory, other components" in copied, copied
    assert "clean shard 11.00 GiB in host memory (11.00 GiB of it the checkpoint file itself, no copy), other" in viewed, viewed
