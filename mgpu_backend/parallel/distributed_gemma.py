"""Gemma prompt encoding on the fleet: one copy sharded over the GPUs, or one replica per rank.

What it is
    LTX-2 conditions on Gemma-3 12B hidden states turned into video and audio text contexts by the
    checkpoint's small embeddings processor (``mgpu_backend.ltx.text``). Here the fleet encodes the
    prompts of a job and EVERY rank ends with every prompt's ``TextContext``, identical on all
    ranks, in prompt order. The rank that encodes a prompt (its owner) also runs the embeddings
    processor on it and broadcasts the final contexts (shapes first, then tensors), so the processor
    never runs twice and no rank needs Gemma's hidden states of another rank.

The two modes, what each costs, and when to use it
    ``sharded``
        ONE copy of Gemma, loaded by rank 0 and split layer-wise over all the fleet's GPUs with
        Accelerate (``infer_auto_device_map`` over a balanced memory budget, then ``dispatch_model``).
        Memory: about 1/N of Gemma per GPU (12B in bf16 is about 24 GB: 6 GB each on four GPUs), all
        of it owned by rank 0's process (which also opens a CUDA context on every GPU). Time: rank 0 runs every prompt through the GPUs one after the
        other (a pipeline with no overlap: no faster than one GPU, plus a hop per GPU boundary); the
        other ranks wait for the broadcast. Use it when GPU memory is tight, e.g. when Gemma stays
        cached next to the resident transformer. On CPU ranks there is nothing to shard: rank 0 runs
        Gemma whole (logged).
    ``batch_parallel``
        A full Gemma replica on every rank that owns a prompt; prompts are dealt round-robin
        (prompt i -> rank i % N) and encoded at the same time. Memory: a whole Gemma per such rank.
        Time: about ceil(prompts / N) prompt encodes instead of ``prompts``. Use it when memory is
        plentiful and a job has several prompts (positive + negative is already two); with one
        prompt it is the sharded mode's time with a whole replica's memory.

    Caching: the built Gemma stays in a per-process cache keyed by the loader, so a second encode
    with the same loader and mode builds no Gemma (the small processor is rebuilt from the registry
    each time). ``free_after=True`` (or ``release_text_encoders``) drops Gemma after encoding,
    empties the CUDA cache and reports the memory returned (``last_encode_stats()["released"]``).
    Host memory: a Gemma built by an encode with ``free_after=True`` keeps its host copy in the
    loader's registry, so the next encode rebuilds it without reading the disk; a Gemma built to
    stay (``free_after=False``) drops it (~24 GB of host memory per building rank at 12B), and is
    read from disk again if it is freed later. Traffic: per prompt, a small shape header and the two contexts (a few
    MB at full size) from its owner.

Every rank of ``comm`` must call ``encode_prompts_distributed`` with the same prompts and mode. This
module never edits or forks ltx-core, never imports ltx-pipelines, and never talks to other ranks
except through ``Comm``.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from dataclasses import dataclass

import torch

from mgpu_backend.ltx.loading import storage_bytes
from mgpu_backend.ltx.residency import ENCODE_HEADROOM_BYTES
from mgpu_backend.ltx.text import TextContext, contexts_from_gemma, gemma_hidden_states
from mgpu_backend.parallel.comm import Comm

log = logging.getLogger(__name__)

GEMMA_MODES = ("sharded", "batch_parallel")
STREAMED = "host (streamed)"
"""``gemma_placement``'s name for the layers kept in host memory and streamed to the GPU at each encode."""

# Contexts cross the fleet as a header (dtype code, number of dims, shape), then the tensor itself.
_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_DIMS = 4

_last_stats: dict = {}


def last_encode_stats() -> dict:
    """What the last ``encode_prompts_distributed`` call did on this rank (mode, prompts it encoded,
    whether it built Gemma, seconds, and the ``released`` memory report when Gemma was freed)."""
    return dict(_last_stats)


def prompt_owners(prompt_count: int, world_size: int, mode: str) -> list[int]:
    """The rank that encodes each prompt: rank 0 for all (sharded) or round-robin (batch_parallel)."""
    _check_mode(mode)
    if mode == "sharded":
        return [0] * prompt_count
    return [index % world_size for index in range(prompt_count)]


def _check_mode(mode: str) -> None:
    if mode not in GEMMA_MODES:
        raise ValueError(
            f"Gemma mode must be one of {GEMMA_MODES}, got {mode!r}: 'sharded' splits one copy over the GPUs "
            "(least memory), 'batch_parallel' puts a replica on each rank (fastest with several prompts)"
        )


# --- Per-process cache -----------------------------------------------------------------------------


@dataclass
class _CachedEncoder:
    """The Gemma this process built for one loader and mode."""

    loader_ref: weakref.ref
    mode: str
    gemma: torch.nn.Module


_cache: dict[int, _CachedEncoder] = {}


def _cached(loader, mode: str) -> _CachedEncoder | None:
    entry = _cache.get(id(loader))
    if entry is None:
        return None
    if entry.mode != mode:
        release_text_encoders(loader)
        return None
    return entry


def release_text_encoders(loader=None) -> dict:
    """Drop the Gemma this process cached for ``loader`` (all loaders if None).

    Returns ``{"gemma_bytes": weight bytes the dropped Gemma held, "device_bytes_returned": CUDA
    memory freed (allocated bytes before minus after, over the GPUs it used; 0 on CPU)}``. A host
    copy in the loader's registry stays where there is one (it makes the next build disk-free).
    """
    keys = list(_cache) if loader is None else [id(loader)]
    entries = [_cache.pop(key) for key in keys if key in _cache]
    tensors = [t for entry in entries for t in (*entry.gemma.parameters(), *entry.gemma.buffers())]
    gemma_bytes = storage_bytes(tensors)
    cuda_devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
    before = sum(torch.cuda.memory_allocated(device) for device in cuda_devices)
    del tensors, entries
    gc.collect()  # Accelerate's dispatch hooks hold reference cycles to the modules
    after = sum(torch.cuda.memory_allocated(device) for device in cuda_devices)
    if cuda_devices:
        torch.cuda.empty_cache()
    return {"gemma_bytes": gemma_bytes, "device_bytes_returned": before - after}


def _build(loader, mode: str, rank: int, keep_host_copy: bool) -> _CachedEncoder:
    if loader.device.type == "cuda":
        gemma = _gemma_on_gpus(loader, mode, rank)
    else:
        if mode == "sharded":
            log.info("Gemma 'sharded' on CPU ranks: nothing to shard, rank %d runs Gemma whole on %s", rank, loader.device)
        gemma = loader.gemma()
    if not keep_host_copy:
        dropped = loader.drop_host_copy("gemma")
        log.info("Gemma built on rank %d to stay: its host copy (%.1f MB) dropped", rank, dropped / 1e6)
    # The entry goes when its loader does, so an id reused by a later loader never finds a stale Gemma.
    key = id(loader)
    entry = _CachedEncoder(weakref.ref(loader, lambda _: _cache.pop(key, None)), mode, gemma)
    _cache[key] = entry
    return entry


def _gemma_on_gpus(loader, mode: str, rank: int) -> torch.nn.Module:
    """Gemma assembled on the CPU, then placed: whole on the rank's GPU when it has room, else split
    layer-wise by Accelerate over the GPUs (every visible one in ``sharded`` mode, the rank's own in
    ``batch_parallel``), the layers no GPU has room for left in host memory and streamed to the GPU
    for each encode (slower, logged)."""
    from accelerate import dispatch_model

    from mgpu_backend.ltx.loading import ModelLoader
    from mgpu_backend.ltx.residency import gpu_room_bytes

    # A CPU loader over the SAME registry: Gemma's weights are still read from disk once per process,
    # and the whole model never lands on one GPU before it is split.
    cpu_loader = ModelLoader(loader.spec, "cpu", loader.dtype, registry=loader.registry)
    gemma = cpu_loader.gemma()
    own_gpu = loader.device.index if loader.device.index is not None else torch.cuda.current_device()
    gpus = list(range(torch.cuda.device_count())) if mode == "sharded" else [own_gpu]
    room = {index: max(0, gpu_room_bytes(index) - ENCODE_HEADROOM_BYTES) for index in gpus}
    if len(gpus) == 1 and storage_bytes([*gemma.parameters(), *gemma.buffers()]) <= room[own_gpu]:
        if mode == "sharded":
            log.info("Gemma 'sharded' on a single visible GPU: nothing to shard, rank %d runs Gemma whole on %s", rank, loader.device)
        return gemma.to(loader.device)
    language_model = gemma.model  # Gemma's text stack: no lm_head, so no tied copy for Accelerate to place twice
    device_map = gemma_device_map(language_model, room, loader.dtype)
    gemma.model = dispatch_model(language_model, device_map=device_map, main_device=gpus[0])
    streamed = gemma_placement(gemma).get(STREAMED, 0)
    if streamed:
        log.warning(
            "Gemma does not fit the room rank %d has (%s): %.2f GB of its layers stay in host memory and are "
            "streamed to the GPU at each encode, which is slower; free GPU memory or add GPUs to keep it all on the GPUs",
            rank, _room_text(room), streamed / 1e9,
        )  # fmt: skip
    log.info("Gemma placed by rank %d: %s", rank, placement_text(gemma))
    return gemma


def _room_text(room: dict[int, int]) -> str:
    return ", ".join(f"cuda:{index} {size / 1e9:.2f} GB" for index, size in room.items())


def gemma_device_map(language_model: torch.nn.Module, room: dict[int, int], dtype: torch.dtype) -> dict[str, int | str]:
    """Where Accelerate puts each module of Gemma's text stack given ``room`` (GPU index -> bytes it
    may take): balanced over the GPUs when they hold it all, else filling them in layer order with
    the rest in host memory ("cpu", streamed at each forward; Accelerate then keeps a GPU buffer for
    the largest streamed layer). Raises when not even the token embeddings, which every encode starts
    from, fit a GPU."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes, get_balanced_memory

    no_split = list(getattr(language_model, "_no_split_modules", None) or [])
    sizes = compute_module_sizes(language_model, dtype=dtype)
    if sum(room.values()) >= sizes[""]:
        budget = get_balanced_memory(language_model, max_memory=dict(room), no_split_module_classes=no_split, dtype=dtype)
    else:
        budget = dict(room)
    device_map = infer_auto_device_map(
        language_model, max_memory={**budget, "cpu": 2 * sizes[""]}, no_split_module_classes=no_split, dtype=dtype
    )
    if not isinstance(device_map.get("embed_tokens", device_map.get("")), int):
        raise RuntimeError(
            f"Gemma cannot run here: its token embeddings ({sizes['embed_tokens'] / 1e9:.2f} GB) and one layer do not fit "
            f"the GPU memory this rank has left ({_room_text(room)}, after {ENCODE_HEADROOM_BYTES / 2**30:.0f} GiB for the encode's "
            "activations); free GPU memory (unload other models first) or run the fleet on GPUs with more memory"
        )
    return device_map


def gemma_placement(gemma: torch.nn.Module) -> dict[str, int]:
    """Weight bytes of ``gemma`` per device (a tied tensor counted once); ``STREAMED`` for the weights
    Accelerate keeps in host memory and moves to the GPU at each forward (their parameters are left on
    the meta device)."""
    bytes_per_device: dict[str, int] = {}
    seen = set()
    for tensor in gemma.parameters():
        if tensor.device.type != "meta":
            if tensor.untyped_storage().data_ptr() in seen:
                continue
            seen.add(tensor.untyped_storage().data_ptr())
        where = STREAMED if tensor.device.type == "meta" else str(tensor.device)
        bytes_per_device[where] = bytes_per_device.get(where, 0) + tensor.nbytes
    return dict(sorted(bytes_per_device.items()))


def placement_text(gemma: torch.nn.Module) -> str:
    return ", ".join(
        f"{device} {size / 1e9:.2f} GB" if size >= 1e9 else f"{device} {size / 1e6:.1f} MB"
        for device, size in gemma_placement(gemma).items()
    )


# --- Encoding --------------------------------------------------------------------------------------


def encode_prompts_distributed(
    loader, prompts: list[str], comm: Comm, mode: str, free_after: bool = False
) -> list[TextContext]:
    """Encode ``prompts`` on the fleet; every rank returns all ``TextContext``s, in order, on
    ``loader.device``, equal to what ``mgpu_backend.ltx.text.encode_prompts`` gives on one process."""
    _check_mode(mode)
    if not prompts:
        raise ValueError("no prompts to encode; pass at least one (an empty string is a valid prompt)")
    started = time.perf_counter()
    owners = prompt_owners(len(prompts), comm.world_size, mode)
    mine = [index for index, owner in enumerate(owners) if owner == comm.rank]
    released = None
    if mine:
        gemma_outputs, placement, built = _gemma_here(loader, mode, comm.rank, [prompts[index] for index in mine], free_after)
        if free_after:  # before the embeddings processor is built: the two never sit side by side
            released = release_text_encoders(loader)
        local = dict(zip(mine, contexts_from_gemma(loader, gemma_outputs), strict=True))
        del gemma_outputs
    else:
        local, placement, built = {}, "", False
    contexts = _share_contexts(comm, owners, local, loader.device)
    if free_after and released is None:  # a rank that owns no prompt this time may still hold Gemma from an earlier call
        released = release_text_encoders(loader)
    if released is not None and released["gemma_bytes"]:
        log.info(
            "Gemma freed on rank %d: %.1f MB of weights dropped, %.1f MB of GPU memory returned",
            comm.rank,
            released["gemma_bytes"] / 1e6,
            released["device_bytes_returned"] / 1e6,
        )
    _last_stats.clear()
    _last_stats.update(
        mode=mode,
        prompts=len(prompts),
        encoded_here=len(mine),
        gemma_built=built,
        gemma_placement=placement,  # where this rank's Gemma weights are ("" when it encoded nothing)
        seconds=time.perf_counter() - started,
        released=released,
    )
    return contexts


def _gemma_here(loader, mode: str, rank: int, prompts: list[str], free_after: bool):
    """This rank's prompts through its (cached or new) Gemma: ``(hidden states per prompt, placement, built)``.

    A function of its own so that no frame of the caller holds Gemma once it returns: Gemma's modules
    sit in reference cycles, and ``release_text_encoders`` can only collect them when the cache's
    entry is the last reference (a caller still holding it kept 23.5 GB alive on the GPU until the
    interpreter's next full collection, and a warm job under a memory cap ran out of memory)."""
    entry, built = _cached(loader, mode), False
    if entry is None:
        entry, built = _build(loader, mode, rank, keep_host_copy=free_after), True
    return gemma_hidden_states(loader, entry.gemma, prompts), placement_text(entry.gemma), built


def _share_contexts(comm: Comm, owners: list[int], local: dict[int, TextContext], device) -> list[TextContext]:
    """Every prompt's contexts from its owner to every rank, in prompt order."""
    contexts = []
    with torch.inference_mode():
        for index, owner in enumerate(owners):
            mine = local.get(index)
            video = _broadcast_tensor(comm, None if mine is None else mine.video_context, owner, device)
            audio = _broadcast_tensor(comm, None if mine is None else mine.audio_context, owner, device)
            contexts.append(TextContext(video_context=video, audio_context=audio))
    return contexts


def _broadcast_tensor(comm: Comm, tensor: torch.Tensor | None, src: int, device) -> torch.Tensor:
    """``tensor`` (given on rank ``src`` only) on every rank: its dtype and shape first, then its values."""
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    if comm.rank == src:
        assert tensor is not None and tensor.dtype in _WIRE_DTYPES and tensor.dim() <= _MAX_DIMS, tensor
        header[0], header[1] = _WIRE_DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    comm.broadcast(header, src=src)
    dtype_code, dims, *shape = header.tolist()
    if comm.rank == src:
        values = tensor.to(device).contiguous()
    else:
        values = torch.empty(shape[:dims], dtype=_WIRE_DTYPES[dtype_code], device=device)
    return comm.broadcast(values, src=src)
