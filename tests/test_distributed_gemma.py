"""Gemma on the fleet gives every rank exactly the contexts single-process ``encode_prompts`` gives.

Two gloo ranks on the tiny bundle (CPU: the 'sharded' mode runs Gemma whole on rank 0). Each mode
runs one scenario (encode, encode again from the cache, encode and free, encode after the free);
the tests read its results. The reference is ``mgpu_backend.ltx.text.encode_prompts`` in this
process, with one thread like the ranks, so equality is exact.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.ltx.text import encode_prompts
from mgpu_backend.parallel import distributed_gemma
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.distributed_gemma import (
    encode_prompts_distributed,
    last_encode_stats,
    prompt_owners,
)
from tests.dist_harness import run_ranks

WORLD_SIZE = 2
PROMPTS = [
    "A fox steps through fresh snow at the edge of a pine forest.",
    "",
    "Rain drums on a tin roof while a kettle starts to whistle.",
]
SINGLE_PROMPT = ["A lighthouse beam sweeps across a stormy sea."]


def _spec(bundle: dict) -> ModelSpec:
    return ModelSpec(checkpoint_path=bundle["checkpoint_path"], gemma_root=bundle["gemma_root"])


def _as_lists(contexts) -> list[list[torch.Tensor]]:
    return [[context.video_context, context.audio_context] for context in contexts]


def _fleet_scenario(bundle: dict, mode: str) -> dict:
    torch.set_num_threads(1)
    loader = ModelLoader(_spec(bundle), "cpu", torch.bfloat16)
    comm = Comm.world()
    out = {"contexts": _as_lists(encode_prompts_distributed(loader, PROMPTS, comm, mode))}
    out["first"], out["bytes_first"] = last_encode_stats(), loader.bytes_read_from_disk
    out["again"] = _as_lists(encode_prompts_distributed(loader, PROMPTS, comm, mode))
    out["cached"], out["bytes_cached"] = last_encode_stats(), loader.bytes_read_from_disk
    cached = distributed_gemma._cache.get(id(loader))
    weights = [weakref.ref(tensor) for tensor in cached.gemma.parameters()] if cached is not None else None
    del cached
    gc.disable()  # as a fleet rank between jobs may go on for long: no automatic full collection
    try:
        encode_prompts_distributed(loader, PROMPTS, comm, mode, free_after=True)
        out["gemma_gone_on_release"] = None if weights is None else all(ref() is None for ref in weights)
    finally:
        gc.enable()
    out["freed"] = last_encode_stats()
    # Built to stay, Gemma dropped its host copy: this build reads the disk again, and keeps one.
    out["after_free"] = _as_lists(encode_prompts_distributed(loader, PROMPTS, comm, mode, free_after=True))
    out["rebuilt"], out["bytes_rebuilt"] = last_encode_stats(), loader.bytes_read_from_disk
    encode_prompts_distributed(loader, PROMPTS, comm, mode, free_after=True)
    out["from_host"], out["bytes_end"] = last_encode_stats(), loader.bytes_read_from_disk
    out["single"] = _as_lists(encode_prompts_distributed(loader, SINGLE_PROMPT, comm, mode))
    out["single_stats"] = last_encode_stats()
    return out


@pytest.fixture(scope="module")
def reference(bundle) -> dict[str, list[list[torch.Tensor]]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loader = ModelLoader(_spec(vars(bundle)), "cpu", torch.bfloat16)
        return {
            "prompts": _as_lists(encode_prompts(loader, PROMPTS)),
            "single": _as_lists(encode_prompts(loader, SINGLE_PROMPT)),
        }
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["sharded", "batch_parallel"])
def fleet(request, bundle) -> tuple[str, list[dict]]:
    paths = {"checkpoint_path": bundle.checkpoint_path, "gemma_root": bundle.gemma_root}
    return request.param, run_ranks(WORLD_SIZE, _fleet_scenario, paths, request.param)


def _max_abs_diff(ours: list[list[torch.Tensor]], theirs: list[list[torch.Tensor]]) -> float:
    assert len(ours) == len(theirs)
    worst = 0.0
    for mine, reference in zip(ours, theirs, strict=True):
        for a, b in zip(mine, reference, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst


def _gemma_weight_bytes(gemma_root: str) -> int:
    """Bytes of Gemma's text stack in the folder: what the fleet loads (no vision tower, no lm_head)."""
    total = 0
    for path in Path(gemma_root).rglob("model*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            total += sum(f.get_tensor(key).nbytes for key in f.keys() if key.startswith("language_model.model."))
    return total


def test_every_rank_gets_exactly_the_single_process_contexts(fleet, reference):
    mode, results = fleet
    prompts_differ = _max_abs_diff([reference["prompts"][0]], [reference["prompts"][2]])
    assert prompts_differ > 0, "the reference contexts of different prompts are equal: the comparison proves nothing"
    for rank, out in enumerate(results):
        for name in ("contexts", "again", "after_free"):
            diff = _max_abs_diff(out[name], reference["prompts"])
            assert diff == 0, f"{mode}, rank {rank}, {name}: max abs diff {diff} from encode_prompts"
        diff = _max_abs_diff(out["single"], reference["single"])
        assert diff == 0, f"{mode}, rank {rank}, one prompt: max abs diff {diff} from encode_prompts"


def test_prompts_are_encoded_by_their_owners_only(fleet):
    mode, results = fleet
    owners = prompt_owners(len(PROMPTS), WORLD_SIZE, mode)
    assert owners == ([0, 0, 0] if mode == "sharded" else [0, 1, 0])
    for rank, out in enumerate(results):
        assert out["first"]["encoded_here"] == owners.count(rank), (mode, rank, out["first"])
        assert out["single_stats"]["encoded_here"] == (1 if rank == 0 else 0), (mode, rank, out["single_stats"])
    if mode == "sharded":
        # Rank 1 never builds Gemma or the processor: it reads nothing at all.
        assert results[1]["bytes_end"] == 0, results[1]["bytes_end"]
        assert results[0]["bytes_first"] > 0
    else:
        assert all(out["bytes_first"] > 0 for out in results), [out["bytes_first"] for out in results]


def test_second_encode_reuses_the_cached_gemma_and_free_after_releases_it(fleet, bundle):
    mode, results = fleet
    gemma_bytes = _gemma_weight_bytes(bundle.gemma_root)
    for rank, out in enumerate(results):
        if out["first"]["encoded_here"] == 0:
            assert not out["first"]["gemma_built"] and out["first"]["gemma_placement"] == "", (mode, rank, out["first"])
            assert out["freed"]["released"] == {"gemma_bytes": 0, "device_bytes_returned": 0}, out["freed"]
            continue
        assert out["first"]["gemma_built"] and not out["cached"]["gemma_built"], (mode, rank)
        # Where the weights are, as the encode job logs it: all of Gemma on this CPU rank.
        placement = out["first"]["gemma_placement"]
        assert placement.startswith("cpu ") and "," not in placement and float(placement.split()[1]) > 0, placement
        assert out["bytes_cached"] == out["bytes_first"], (mode, rank, out["bytes_first"], out["bytes_cached"])
        released = out["freed"]["released"]
        # Gone when the release returns, not at the interpreter's next full collection: Gemma's modules sit
        # in reference cycles, and a Gemma left for the collector kept 23.5 GB of a capped GPU from the next job.
        assert out["gemma_gone_on_release"] is True, (mode, rank)
        # Gemma's text-stack weights, plus the small buffers (rotary frequencies, embedding scale) built for it.
        assert gemma_bytes <= released["gemma_bytes"] < 1.05 * gemma_bytes, (mode, rank, released, gemma_bytes)
        assert released["device_bytes_returned"] == 0, released  # CPU ranks
        # The first Gemma was built to stay, so it kept no host copy: the rebuild after the free reads
        # Gemma's files again. That build had free_after, so it kept the host copy, and the next
        # rebuild reads nothing.
        assert out["rebuilt"]["gemma_built"], (mode, rank)
        assert out["bytes_rebuilt"] - out["bytes_first"] == gemma_bytes, (mode, rank, out["bytes_first"], out["bytes_rebuilt"])
        assert out["from_host"]["gemma_built"], (mode, rank)
        assert out["bytes_end"] == out["bytes_rebuilt"], (mode, rank, out["bytes_rebuilt"], out["bytes_end"])


def test_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="'sharded'.*'batch_parallel'"):
        encode_prompts_distributed(None, ["a prompt"], Comm(None), "tensor_parallel")


def _file_scenario(bundle: dict, mode: str) -> list[list[torch.Tensor]]:
    torch.set_num_threads(1)
    loader = ModelLoader(_spec(bundle), "cpu", torch.bfloat16)
    return _as_lists(encode_prompts_distributed(loader, PROMPTS, Comm.world(), mode))


def test_comfyui_single_file_gemma_on_the_fleet_gives_the_folder_contexts(bundle, reference, tmp_path):
    from mgpu_backend.ltx.gemma_file import gemma_folder_to_comfy_file

    comfy_file = gemma_folder_to_comfy_file(bundle.gemma_root, str(tmp_path / "gemma_3_tiny.safetensors"))
    paths = {"checkpoint_path": bundle.checkpoint_path, "gemma_root": comfy_file}
    for rank, contexts in enumerate(run_ranks(WORLD_SIZE, _file_scenario, paths, "batch_parallel")):
        diff = _max_abs_diff(contexts, reference["prompts"])
        assert diff == 0, f"rank {rank}: max abs diff {diff} from the folder's encode_prompts"


def _text_stack_and_sizes(bundle):
    from accelerate.utils import compute_module_sizes

    gemma = ModelLoader(_spec(vars(bundle)), "cpu", torch.bfloat16).gemma()
    return gemma, compute_module_sizes(gemma.model, dtype=torch.bfloat16)


def test_gemma_placed_on_gpus_short_of_room_keeps_its_later_layers_in_host_memory(bundle):
    gemma, sizes = _text_stack_and_sizes(bundle)
    layers = sorted(name for name in sizes if name.count(".") == 1 and name.startswith("layers."))
    assert len(layers) >= 2, layers
    # Room for the token embeddings and two layers: Accelerate keeps one layer's room as the buffer the
    # streamed layers pass through, so the embeddings and the first layer stay on GPU 0, the rest in host memory.
    room = sizes["embed_tokens"] + 2 * sizes[layers[0]]
    device_map = distributed_gemma.gemma_device_map(gemma.model, {0: room}, torch.bfloat16)
    assert device_map["embed_tokens"] == 0 and device_map["layers.0"] == 0, device_map
    assert device_map[layers[-1]] == "cpu", device_map
    # Room for all of it on two GPUs: spread over both, nothing in host memory.
    device_map = distributed_gemma.gemma_device_map(gemma.model, {0: sizes[""], 1: sizes[""]}, torch.bfloat16)
    assert set(device_map.values()) == {0, 1}, device_map


def test_gemma_is_refused_in_words_when_not_even_its_token_embeddings_fit(bundle):
    gemma, sizes = _text_stack_and_sizes(bundle)
    with pytest.raises(RuntimeError, match=r"Gemma cannot run here: its token embeddings \(.* GB\) and one layer do not fit"):
        distributed_gemma.gemma_device_map(gemma.model, {0: sizes["embed_tokens"] // 2}, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemma_streamed_from_host_memory_gives_the_contexts_of_gemma_whole_on_the_gpu(bundle, monkeypatch):
    from mgpu_backend.ltx.residency import ENCODE_HEADROOM_BYTES, GIB, MEMORY_LIMIT_ENV

    loader = ModelLoader(_spec(vars(bundle)), "cuda", torch.bfloat16)
    whole = _as_lists(encode_prompts(loader, PROMPTS))
    _, sizes = _text_stack_and_sizes(bundle)
    layer = max(size for name, size in sizes.items() if name.count(".") == 1 and name.startswith("layers."))
    torch.cuda.empty_cache()
    # This process's limit leaves the encode's activations, the embeddings and two layers beside what it holds.
    limit = torch.cuda.memory_reserved() + ENCODE_HEADROOM_BYTES + sizes["embed_tokens"] + 2 * layer
    monkeypatch.setenv(MEMORY_LIMIT_ENV, str(limit / GIB))
    streamed = distributed_gemma._gemma_on_gpus(loader, "batch_parallel", rank=0)
    placement = distributed_gemma.gemma_placement(streamed)
    assert placement.get(distributed_gemma.STREAMED, 0) > 0 and placement.get("cuda:0", 0) > 0, placement
    diff = _max_abs_diff(_as_lists(encode_prompts(loader, PROMPTS, gemma=streamed)), whole)
    assert diff == 0, f"Gemma streamed from host memory: max abs diff {diff} from Gemma whole on the GPU"
