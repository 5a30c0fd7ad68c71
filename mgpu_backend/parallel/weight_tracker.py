"""Transformer weight residency across jobs and LoRA hot-swap between stages without the disk.

What it is
    Every rank keeps ONE full working copy of the LTX-2 transformer (an ltx-core ``X0Model`` built
    by ``ModelLoader`` without any LoRA). Stage 1 runs it with the user LoRAs only, stage 2 adds
    the distilled LoRA. Instead of rebuilding the transformer for each stage, ``apply(lora_set)``
    turns the working copy into the weights of the requested LoRA set in place:

    - A clean (pre-LoRA) copy is kept SHARDED over the ranks: each state-dict key has exactly one
      owner rank (keys assigned greedily by size to the least-loaded rank, the same on every rank),
      so each rank stores about 1/N of the transformer's bytes.
    - On a change of LoRA set, each owner computes the final value of its keys that the old or the
      new set touches: the clean weight, fused with the new LoRAs by ltx-core's own
      ``ltx_core.loader.fuse_loras.apply_loras`` where the new set touches it. Owners broadcast
      those values in buckets (256 MB by default); every rank copies them into its working copy.
      Fusion work is thus split 1/N over the ranks and every rank ends with bitwise identical
      weights, equal to what ltx-core's loader builds for that LoRA set on the same device.
    - fp8-cast weights (``quantization="fp8-cast"``, ``mgpu_backend.ltx.fp8``) are swapped the same
      way: the clean shard holds the fp8 bytes, LoRAs fuse into them as ltx-core fuses into fp8
      (a scaled fp8 layer from an fp8 checkpoint file is re-quantized with its own scale, a buffer
      every rank's working copy holds and no swap changes), and a reset copies the clean fp8 bytes
      back, so stage 1 after a stage-2 swap computes bitwise what the first stage 1 did.
    - An unchanged LoRA set costs nothing: no broadcast, no fusion (``stats.unchanged`` counts it).
    - LoRA state dicts are read through the loader's per-process registry, so once each file has
      been read, alternating stage 1 and stage 2 (and every later job) reads nothing from disk.

When to use it, and what it costs
    Use it whenever a job alternates LoRA sets (the two-stage graph: stage 1 without, stage 2 with
    the distilled LoRA). Memory per rank: one working copy (the whole transformer: MGPU is a latency
    tool, not a memory tool) plus about 1/N of it for the clean shard, on the working device, or in
    host memory when the two together would take more than 60% of the GPU (``clean_shard_on_host``:
    at 19B one or two 80 GB GPUs; an H200 keeps it on the GPU even alone). Time per swap: the fusion
    of 1/N of the touched layers on this rank's device (a host shard is copied there key by key
    first), plus broadcasts of the touched keys (for LTX-2's distilled LoRA: nearly every linear
    layer of the blocks).
    ``no_lora_swap=True`` keeps no clean shard (saves the 1/N) for runs whose LoRA set never
    changes: the first set may be fused once, any later change raises a clear error.

The checkpoint file as the clean copy
    safetensors maps a checkpoint file into memory and hands out tensors over the mapping: pages of
    the OS's file cache, which every process reading the file shares and the kernel may drop and read
    again. Where a clean shard goes to host memory and the working copy took a file tensor exactly as
    the file holds it (a bf16 checkpoint loaded in bf16, no quantization), the clean shard is a view
    of the file (this rank's rows of it, sharded) instead of a copy: no host memory of its own (35 GiB
    less over the ranks for the 22B in bf16). ``file_backed`` tells such tensors from the rest by the
    process's file mappings; cast weights (fp8-cast, a float32 file) and a CPU rank's whole working
    copy, which is the mapping itself, keep a copy. Replace a checkpoint file by writing a new one,
    not by writing into it, while a fleet runs (as any copy tool does).

Under weight sharding
    With ``shard_weights=True`` (residency ``"sharded"``) the working copy itself is sharded
    (``mgpu_backend.parallel.weight_sharding``): each rank holds 1/N of every parameter, and the
    clean copy is simply this rank's rows of every key (again about 1/N). A swap then needs no
    owners: a key the old set changed goes back to the clean rows locally; a key the new set
    touches is gathered whole from the clean rows of every rank (the working copy is reset to them
    first, so the gather is the weight sharding's own), fused by the same ltx-core function on
    every rank (the same bytes everywhere, and the same as the unsharded tracker's owner makes),
    and each rank keeps its rows. The fusion work is not split (every rank fuses every touched key)
    but needs one full weight at a time beside the shards. The model is built in host memory and
    its blocks moved to the device one shard at a time, the ranks in turns of as many whole builds
    as host memory holds (``sharded_builds_at_once``); parking moves this rank's shard (the
    gathers read the same storages once they are refilled). A rank replaced after a fault takes
    its rows with it, so then every rank builds again (reading the checkpoint).

Device note
    The fusion runs where the clean weights are (the rank's device). On the CPU this is bitwise what
    ``ModelLoader.transformer(lora_set)`` builds. On a GPU it is the same ltx-core function on the
    same inputs, but ``ModelLoader`` assembles on the CPU, so the two may differ by bf16 matmul
    rounding in the LoRA deltas, and for fp8-cast weights by the rounding to fp8 (ltx-core rounds
    stochastically, seed 0, on CUDA and to nearest on the CPU). No drift: every swap starts again
    from the clean weights, and the same swap on the same device gives the same bytes.

Stepping aside for Gemma
    ``park()`` moves the working copy (and the clean shard, when it is on the same device) into one
    host buffer and frees its device memory, so that a GPU too small for the transformer and Gemma
    side by side can still encode (the residency policy's last level, ``mgpu_backend.ltx.residency``);
    ``unpark()`` copies it back, and ``transformer()``, what the stages call, unparks first. The
    Parameters stay the same objects (only their storages are emptied and refilled: ``HostParking``),
    so LoRA swaps and everything holding the model keep working; the weights come back bitwise. Cost:
    host memory equal to the bytes parked (a pinned buffer, kept for later parks), and two copies per
    job over PCIe (18 GB of fp8-cast 22B weights: a few seconds each way). Weights no LoRA has touched
    whose clean rows sit in host memory (a sharded rank's, or a rank's shard moved off the GPU) are
    not copied into that buffer: they come back from those rows, often the checkpoint file's own
    pages, so a sharded 22B with no LoRA fused parks for no host memory at all (the copy back is
    then from pageable memory, slower than from pinned, and from disk if the page cache let the file
    go). Captured CUDA
    graphs replay the old addresses: release them before parking (stage 1 captures again). On a CPU
    rank the host is the device, so parking frees nothing and is a no-op (logged once).

Once the working copy is built, the loader's registry drops its host copy of the transformer (up to
~38 GB of host memory per rank at 19B); a later ``ModelLoader.transformer`` call reads the checkpoint
again. LoRA files stay in the registry: every swap needs them. This module never edits or forks ltx-core, never
imports ltx-pipelines, and never talks to other ranks except through ``Comm``.
"""

from __future__ import annotations

import bisect
import gc
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from ltx_core.loader import LoraStateDictWithStrength
from ltx_core.model.transformer import X0Model

from mgpu_backend.ltx import fp8
from mgpu_backend.ltx.recipes import stage_loras
from mgpu_backend.parallel import weight_sharding
from mgpu_backend.parallel.comm import Comm

log = logging.getLogger(__name__)

LoraSet = tuple[tuple[str, float], ...]
"""LoRAs to fuse, in order: ``((path, strength), ...)``. The empty tuple is the clean transformer."""

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
# ltx-core fuses into bf16 and fp8 weights. A scaled fp8 weight's scale is a buffer of its layer in
# every rank's working copy and never changes, so its owner always has it at hand.
_FUSABLE_DTYPES = (torch.bfloat16, fp8.FP8_DTYPE)


def stage_lora_set(spec, lora_set: str) -> LoraSet:
    """The LoRA set ``ModelLoader.transformer(lora_set)`` fuses, as ``(path, strength)`` pairs in
    the same order (``recipes.stage_loras``, the one mapping of both)."""
    return stage_loras(spec, lora_set)


def _normalised(lora_set) -> LoraSet:
    """``lora_set`` as a tuple of (str, float); all-zero strengths mean no LoRA, as in ltx-core's builder."""
    try:
        pairs = tuple((str(path), float(strength)) for path, strength in lora_set)
    except (TypeError, ValueError) as error:
        raise ValueError(f"a LoRA set is a sequence of (path, strength) pairs, got {lora_set!r}") from error
    if all(strength == 0 for _, strength in pairs):
        return ()
    return pairs


@dataclass
class SwapStats:
    """What ``apply`` has done on this rank since the tracker was built."""

    swaps: int = 0  # LoRA-set changes carried out
    unchanged: int = 0  # apply() calls that found the set already in place and did nothing
    keys_fused: int = 0  # keys this rank fused (its own keys only)
    keys_broadcast: int = 0  # keys received (all owners) into the working copy
    bytes_broadcast: int = 0
    broadcasts: int = 0  # bucket broadcasts issued


# The clean shard stays on the GPU while the working copy and the shard together take at most this
# share of the GPU's memory; beyond it (one or two 80 GB GPUs at 19B) it is kept in host memory.
CLEAN_SHARD_DEVICE_SHARE = 0.6


def clean_shard_on_host(working_bytes: int, shard_bytes: int, device: torch.device, device_total_bytes: int | None = None) -> bool:
    """Where the clean shard goes: host memory when the working copy plus the shard would take more
    than ``CLEAN_SHARD_DEVICE_SHARE`` of the GPU (the rest is for Gemma, the VAEs and activations).
    On a CPU rank the host is the device."""
    if torch.device(device).type != "cuda":
        return False
    if device_total_bytes is None:
        device_total_bytes = torch.cuda.get_device_properties(device).total_memory
    return working_bytes + shard_bytes > CLEAN_SHARD_DEVICE_SHARE * device_total_bytes


HOST_MEMORY_ENV = "MGPU_HOST_MEMORY_GIB"
HOST_BUILD_SHARE = 0.9
"""Of the host memory available, the share that whole-transformer builds of sharded ranks may take at once."""


def host_memory_bytes(environ=None) -> int | None:
    """The host memory a sharded build may count on: ``MGPU_HOST_MEMORY_GIB`` when set (a host shared
    with other work), else the kernel's MemAvailable; None where neither is known (not Linux)."""
    from mgpu_backend.ltx.residency import gib_setting
    from mgpu_backend.ltx.validation import host_available_bytes

    limit = gib_setting(os.environ if environ is None else environ, HOST_MEMORY_ENV, "use what the host has free")
    return limit if limit is not None else host_available_bytes()


def sharded_builds_at_once(build_bytes: int, available_bytes: int | None, world_size: int) -> int:
    """How many ranks may build the whole transformer in host memory at once (at least one: a single
    build that does not fit fails as it would without turns)."""
    if available_bytes is None:
        return world_size
    return max(1, min(world_size, int(available_bytes * HOST_BUILD_SHARE) // max(1, build_bytes)))


def _layout(state: dict[str, torch.Tensor]) -> str:
    """A whole (unsharded) state dict's keys, shapes and dtypes: what every rank must agree on."""
    return "\n".join(f"{key}:{tuple(t.shape)}:{t.dtype}" for key, t in state.items())


def _owners_by_bytes(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Each key -> one rank, largest keys first onto the least-loaded rank: about 1/N of the bytes
    each, and the same answer on every rank (ties broken by key name and rank index)."""
    loads = [0] * world_size
    owners = {}
    for key in sorted(sizes, key=lambda name: (-sizes[name], name)):
        rank = min(range(world_size), key=lambda index: (loads[index], index))
        owners[key] = rank
        loads[rank] += sizes[key]
    return owners


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole of ``storage`` (whatever the dtypes and views of its tensors)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(storages: Iterable[torch.UntypedStorage]) -> None:
    for device in {storage.device for storage in storages if storage.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory, pinned when asked and the system grants it (else pageable: slower
    copies, same bytes)."""
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as error:
            log.warning("could not pin %.1f MB of host memory to park the transformer (%s); using pageable memory", nbytes / 1e6, error)
    return torch.empty(nbytes, dtype=torch.uint8)


def _restorable(tensor: torch.Tensor, copy: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage can come back whole from ``copy`` in host memory: the tensor is
    the whole of its storage, contiguous, and the copy has its shape and dtype."""
    storage = tensor.untyped_storage()
    return (
        copy.device.type == "cpu" and copy.dtype == tensor.dtype and copy.shape == tensor.shape and copy.is_contiguous()
        and tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.nbytes == storage.nbytes()
    )  # fmt: skip


class HostParking:
    """The storages of a set of tensors moved into one host buffer and back; the tensors stay.

    ``park(tensors)`` copies every distinct storage once (tensors sharing one, as views or tied
    weights do, are copied together) into the host buffer, then empties it with
    ``untyped_storage().resize_(0)``: the tensors, and the Parameters that hold them, remain the
    same Python objects with the same shapes but own no memory until ``unpark()`` gives every
    storage its bytes back (at a new address) and copies them in. The buffer is pinned when a
    storage is on a GPU (fast, asynchronous copies; pageable if the system refuses to pin that
    much) and allocated once: a later park of no more bytes reuses it. Device-agnostic: it runs
    the same on CPU tensors (it frees nothing there, as the host is the device; the tests use it so).

    A tensor whose bytes host memory holds already (``restore_from``: a clean copy of weights no
    LoRA has touched, often a view of the checkpoint file) is not copied at all: its storage is
    freed, and ``unpark`` copies it back from that copy. The buffer then holds only the rest, so a
    rank whose clean shard sits in host memory parks its untouched weights for no host memory.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        # (storage, offset in the buffer or None, bytes, the host copy it comes back from or None)
        self._parked: list[tuple[torch.UntypedStorage, int | None, int, torch.Tensor | None]] = []
        self.last_restorable_bytes = 0  # of the last park, the bytes left to come back from ``restore_from``

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    @property
    def buffer_bytes(self) -> int:
        """Host bytes held by the buffer (kept between parks)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def park(self, tensors: Iterable[torch.Tensor], restore_from: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> int:
        """Free the storages of ``tensors`` (and of the first tensor of each ``restore_from`` pair),
        their bytes kept in host memory; returns the bytes freed. ``restore_from``: (tensor, host copy
        of exactly its values) pairs, the caller's word that the two are equal; such a tensor covering
        its whole storage is not copied but comes back from its host copy (one that does not is parked
        in the buffer like the rest)."""
        if self._parked:
            raise RuntimeError("these tensors are parked already; unpark() them before parking again")
        restore_from = list(restore_from)
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in [*tensors, *(tensor for tensor, _ in restore_from)]:
            storage = tensor.untyped_storage()
            if storage.nbytes() > 0:
                storages.setdefault(storage.data_ptr(), storage)
        fixed = [storage for storage in storages.values() if not storage.resizable()]
        if fixed:  # checked before anything moves: a half-parked model would be unusable
            raise RuntimeError(
                f"{len(fixed)} of the tensors to park live in storage that cannot be freed (memory-mapped or borrowed); "
                "parking needs tensors the process allocated itself (a model built on its device)"
            )
        sources = {tensor.untyped_storage().data_ptr(): copy for tensor, copy in restore_from if _restorable(tensor, copy)}
        buffered = [storage for pointer, storage in storages.items() if pointer not in sources]
        needed = sum(storage.nbytes() for storage in buffered)
        if needed and (self._buffer is None or self._buffer.numel() < needed):
            self._buffer = None  # the old buffer goes before a larger one is allocated
            self._buffer = _host_buffer(needed, any(storage.device.type == "cuda" for storage in buffered))
        pin = self._buffer is not None and self._buffer.is_pinned()
        parked, offset = [], 0
        for pointer, storage in storages.items():
            nbytes = storage.nbytes()
            if pointer in sources:
                parked.append((storage, None, nbytes, sources[pointer]))
                continue
            self._buffer[offset : offset + nbytes].copy_(_storage_bytes(storage), non_blocking=pin)
            parked.append((storage, offset, nbytes, None))
            offset += nbytes
        _synchronize(storages.values())  # every copy has landed before any storage is freed
        for storage, *_ in parked:
            storage.resize_(0)
        self._parked = parked
        self.last_restorable_bytes = sum(nbytes for _, offset, nbytes, _ in parked if offset is None)
        return sum(nbytes for _, _, nbytes, _ in parked)

    def unpark(self) -> int:
        """Give every parked storage its bytes back and copy them in; returns the bytes moved."""
        total = 0
        for storage, offset, nbytes, source in self._parked:
            storage.resize_(nbytes)
            if source is None:
                _storage_bytes(storage).copy_(self._buffer[offset : offset + nbytes], non_blocking=self._buffer.is_pinned())
            else:
                _storage_bytes(storage).copy_(source.reshape(-1).view(torch.uint8))
            total += nbytes
        _synchronize(storage for storage, *_ in self._parked)  # the buffer may be written again by the next park
        self._parked = []
        return total

    def release(self) -> None:
        """Forget what is parked and drop the host buffer (for a model that is being dropped)."""
        self._parked, self._buffer = [], None


def file_mapped_ranges() -> list[tuple[int, int]]:
    """The address ranges where this process maps files (``/proc/self/maps``, each mapping's adjacent
    pieces joined), sorted; empty where the kernel does not say (not Linux)."""
    pieces = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or fields[4] == "0" or fields[5].startswith("["):  # anonymous, stack, heap...
                    continue
                start, end = (int(value, 16) for value in fields[0].split("-"))
                pieces.append((start, end, fields[3], fields[4]))
    except OSError:
        return []
    ranges: list[tuple[int, int]] = []
    previous = None
    for start, end, device, inode in sorted(pieces):
        if ranges and previous == (device, inode) and start == ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
        previous = (device, inode)
    return ranges


def file_backed(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether ``tensor``'s whole storage lies in one file mapping of ``ranges`` (``file_mapped_ranges``):
    safetensors maps a checkpoint into memory and hands out tensors over it, pages of the OS's file
    cache that every process reading the file shares and the kernel may drop and read again."""
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu" or storage.nbytes() == 0:
        return False
    start = storage.data_ptr()
    index = bisect.bisect_right(ranges, (start, math.inf)) - 1
    return index >= 0 and start + storage.nbytes() <= ranges[index][1]


class TransformerWeightTracker:
    """One working transformer per rank, a clean copy sharded over the ranks, LoRA sets swapped in place.

    Collective: every rank of ``comm`` calls ``build``/``apply``/``transformer`` together with the
    same arguments. Keep one tracker per process for the lifetime of the loaded model; a warm job
    then builds nothing and reads nothing from disk.
    """

    def __init__(
        self, comm: Comm, no_lora_swap: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES, clean_on_host: bool | None = None,
        shard_weights: bool = False,
    ) -> None:  # fmt: skip
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.comm = comm
        self.no_lora_swap = no_lora_swap
        self.bucket_bytes = bucket_bytes
        self.clean_on_host = clean_on_host  # None: decided at build time by clean_shard_on_host
        self.shard_weights = shard_weights and comm.world_size > 1
        self.stats = SwapStats()
        self._loader = None
        self._model: X0Model | None = None
        self._working: dict[str, torch.Tensor] = {}  # velocity-model key -> tensor sharing the parameter's storage
        self._working_bytes = 0
        self._owners: dict[str, int] = {}
        self._clean: dict[str, torch.Tensor] = {}  # this rank's shard of the pre-LoRA weights (device or host)
        self._applied: LoraSet = ()
        self._touched: frozenset[str] = frozenset()  # keys where the working copy differs from clean
        self._parking = HostParking()
        self._said_nothing_to_park = False

    # --- Building -----------------------------------------------------------------------------------

    @property
    def model(self) -> X0Model:
        if self._model is None:
            raise RuntimeError("the weight tracker holds no transformer yet; call build(loader) first")
        return self._model

    @property
    def applied(self) -> LoraSet:
        """The LoRA set fused into the working copy now."""
        return self._applied

    def build(self, loader) -> X0Model:
        """Build the working copy and the clean shard from ``loader`` (once; later calls with the same
        loader return the same model). A different loader replaces the model."""
        if self._model is not None and loader is self._loader:
            return self._model
        self._drop()
        if self.shard_weights:
            model, layout, dropped, from_file = self._build_sharded(loader)
            working = weight_sharding.local_state_dict(model)
        else:
            model, layout, dropped, from_file = self._build_whole(loader, None)
            working = {key: tensor.detach() for key, tensor in model.velocity_model.state_dict(keep_vars=True).items()}
        self._check_same_model_on_every_rank(layout, loader.device)
        owners = _owners_by_bytes({key: tensor.nbytes for key, tensor in working.items()}, self.comm.world_size)
        clean = {}
        if not self.no_lora_swap:
            # Sharded, every rank's clean copy is its own rows of every key.
            mine = list(working) if self.shard_weights else [key for key in working if owners[key] == self.comm.rank]
            working_bytes = sum(tensor.nbytes for tensor in working.values())
            on_host = self.clean_on_host
            if on_host is None:
                on_host = clean_shard_on_host(working_bytes, sum(working[key].nbytes for key in mine), loader.device)
            where = torch.device("cpu") if on_host else loader.device
            ranges = file_mapped_ranges()
            clean = {key: self._clean_copy(model, key, working[key], where, from_file.get(key), ranges) for key in mine}
        self._loader, self._model, self._working, self._owners, self._clean = loader, model, working, owners, clean
        # Counted now: a parked working copy's storages are empty (and all at address 0).
        self._working_bytes = sum({tensor.untyped_storage().data_ptr(): tensor.nbytes for tensor in working.values()}.values())
        self._applied, self._touched, self.stats = (), frozenset(), SwapStats()
        report = self.memory_report()
        log.info(
            "weight tracker on rank %d/%d: working copy %.1f MB, clean shard %.1f MB (%d of %d keys%s)%s; "
            "host copy dropped (%.1f MB)",
            self.comm.rank,
            self.comm.world_size,
            report["working_bytes"] / 1e6,
            report["clean_shard_bytes"] / 1e6,
            report["clean_shard_keys"],
            len(working),
            f"; {report['clean_shard_file_bytes'] / 1e6:.1f} MB of it read from the checkpoint file as it is, no host copy"
            if report["clean_shard_file_bytes"] else "",
            ", no LoRA swap" if self.no_lora_swap else "",
            dropped / 1e6,
        )
        return model

    def _clean_copy(self, model, key: str, working: torch.Tensor, where: torch.device, file_tensor: torch.Tensor | None,
                    ranges: list[tuple[int, int]]) -> torch.Tensor:  # fmt: skip
        """This rank's clean weights of ``key``, in ``where``: in host memory, a view of the checkpoint
        file itself when the working copy got that file tensor as it is (``file_tensor``: bf16 in a bf16
        file, no quantization) and is not that mapping itself (a CPU rank's whole model is, and LoRAs
        fuse into it in place), so the clean copy takes no host memory of its own (the file's cached
        pages, shared by the ranks); else a copy of the working weights."""
        if file_tensor is not None and where.type == "cpu" and not file_backed(working, ranges):
            rows = weight_sharding.shard_rows(model, key, file_tensor) if self.shard_weights else file_tensor
            if rows.shape == working.shape and rows.dtype == working.dtype:
                return rows
        return working.to(where, copy=True)

    @staticmethod
    def _build_whole(loader, device) -> tuple[X0Model, str, int, dict[str, torch.Tensor]]:
        """The whole transformer on ``device`` (the loader's when None), its layout, the bytes of the
        registry's host copy dropped, and the weights the model took from the checkpoint as they are
        there (file-backed tensors: views of the mapped file, no host memory of their own) by key. The
        working copy and the clean shard are all this rank needs from now on: dropping the registry's
        host copy frees it on a GPU rank, and on a CPU rank (where the built model aliases it) keeps
        LoRA fusion in place from reaching anything else built by the loader."""
        model = loader.build_transformer((), device="cpu")
        ranges = file_mapped_ranges()
        from_file = {
            key: tensor.detach() for key, tensor in model.velocity_model.state_dict(keep_vars=True).items() if file_backed(tensor, ranges)
        }  # fmt: skip
        model = model.to(loader.device if device is None else torch.device(device))
        dropped = loader.drop_host_copy("transformer")
        return model, _layout(model.velocity_model.state_dict(keep_vars=True)), dropped, from_file

    def _build_sharded(self, loader) -> tuple[X0Model, str, int, dict[str, torch.Tensor]]:
        """Built whole in host memory, then each block moved to the device as this rank's shard. The
        whole transformer sits in host memory only while its rank shards it, so the ranks build in
        turns of as many as host memory holds (``sharded_builds_at_once``): 4 ranks of a 22B in bf16
        would otherwise need 4 x 41 GiB of host memory at once."""
        mesh = weight_sharding.sharding_mesh(self.comm, loader.device)  # collective: before the turns
        at_once = self._builds_at_once(loader)
        turns = math.ceil(self.comm.world_size / at_once)
        model = layout = dropped = from_file = None
        for turn in range(turns):
            if self.comm.rank // at_once == turn:
                started = time.perf_counter()
                model, layout, dropped, from_file = self._build_whole(loader, "cpu")
                weight_sharding.apply_weight_sharding(model, self.comm, loader.device, mesh=mesh)
                gc.collect()  # the whole host copy goes now, before the next turn's ranks build theirs
                if turns > 1:
                    log.info("rank %d built the transformer in host memory and sharded it in turn %d of %d (%d rank(s) at a time, "
                             "as host memory holds): %.1f s", self.comm.rank, turn + 1, turns, at_once, time.perf_counter() - started)
            if turns > 1:
                self.comm.barrier()
        return model, layout, dropped, from_file

    def _builds_at_once(self, loader) -> int:
        """How many ranks build the whole transformer in host memory at once: rank 0's reading of the
        host memory (``host_memory_bytes``), against one build's bytes, agreed by every rank."""
        decided = torch.zeros(1, dtype=torch.int64, device=loader.device)
        if self.comm.rank == 0:
            from mgpu_backend.ltx.residency import component_sizes

            sizes = component_sizes(loader.spec, loader.dtype)
            build_bytes = sizes.transformer_bytes + (sizes.transformer_fp8_bytes if loader.quantization == "fp8-cast" else 0)
            decided[0] = sharded_builds_at_once(build_bytes, host_memory_bytes(), self.comm.world_size)
        return int(self.comm.broadcast(decided).item())

    def _drop(self) -> None:
        self._loader, self._model = None, None
        self._working, self._owners, self._clean, self._working_bytes = {}, {}, {}, 0
        self._parking.release()

    def _check_same_model_on_every_rank(self, layout: str, device) -> None:
        """Ownership is computed locally from the key list: all ranks must hold the same keys and shapes
        (``layout``: the whole model's keys, shapes and dtypes)."""
        fingerprint = int.from_bytes(hashlib.sha256(layout.encode()).digest()[:7], "little")
        mine = torch.tensor([fingerprint], dtype=torch.int64, device=device)
        everyone = self.comm.all_gather(mine, dim=0)
        if not bool((everyone == mine).all()):
            raise RuntimeError(
                "the ranks built transformers with different keys or shapes; every rank must load the same "
                "checkpoint (same model spec on every rank)"
            )

    # --- Parking ---------------------------------------------------------------------------------------

    @property
    def parked(self) -> bool:
        """True while the working copy waits in host memory (``park``) and holds no device memory."""
        return self._parking.parked

    def park(self) -> int:
        """Move the working copy (and the clean shard when it is on the same device) to host memory
        and free its device memory, keeping every Parameter object; returns the bytes moved. The next
        ``transformer``/``apply``/``unpark`` copies it back. Not collective. Release captured CUDA
        graphs of the model first: they hold the old addresses. A no-op when nothing is built, when
        it is parked already, and on a CPU rank (logged once: nothing to free there)."""
        if self._model is None or self.parked:
            return 0
        device = next(iter(self._working.values())).device
        if device.type == "cpu":
            if not self._said_nothing_to_park:
                log.info("transformer not parked on rank %d: on a CPU rank the host is the device, nothing to free", self.comm.rank)
                self._said_nothing_to_park = True
            return 0
        started = time.perf_counter()
        # The clean rows of keys no LoRA has touched are those weights already: where they are in host memory, they come back from there.
        untouched = [(self._working[key], clean) for key, clean in self._clean.items() if key not in self._touched]
        moved = self._parking.park([*self._working.values(), *(tensor for tensor in self._clean.values() if tensor.device == device)], untouched)
        self._log_move("parked in host memory", moved, time.perf_counter() - started)
        return moved

    def unpark(self) -> int:
        """Copy a parked working copy back to its device (a no-op when not parked); returns the bytes moved."""
        if not self.parked:
            return 0
        started = time.perf_counter()
        moved = self._parking.unpark()
        self._log_move("back on the device", moved, time.perf_counter() - started)
        return moved

    def _log_move(self, what: str, moved: int, seconds: float) -> None:
        restorable = self._parking.last_restorable_bytes
        log.info(
            "transformer %s on rank %d: %.1f MB in %.2f s (%.1f GB/s; host buffer %.1f MB%s)",
            what, self.comm.rank, moved / 1e6, seconds, moved / 1e9 / max(seconds, 1e-9), self._parking.buffer_bytes / 1e6,
            f"; {restorable / 1e6:.1f} MB of it come back from the clean shard in host memory, not copied" if restorable else "",
        )  # fmt: skip

    # --- Swapping -------------------------------------------------------------------------------------

    def transformer(self, loader, lora_set: str) -> X0Model:
        """The working transformer with the stage's LoRA set (``recipes.LORA_SETS``) fused:
        what ``loader.transformer(lora_set)`` builds, without building anything after the first call
        (a parked working copy comes back from host memory first)."""
        self.unpark()
        fresh = self._model is None or loader is not self._loader
        if self.comm.world_size > 1:
            # A rank that replaced a dead one builds while the survivors kept theirs: they agree on
            # it here, so that all of them run the same collectives from now on.
            flags = self.comm.all_gather(torch.tensor([int(fresh)], dtype=torch.int64, device=loader.device), dim=0).tolist()
            if 0 < sum(flags) < len(flags):
                if self.shard_weights:  # the lost rank's rows are gone with it: every rank builds again
                    self._drop()
                else:
                    self._rejoin(loader, fresh, survivor=flags.index(0))
        self.build(loader)
        return self.apply(stage_lora_set(loader.spec, lora_set))

    def _rejoin(self, loader, fresh: bool, survivor: int) -> None:
        """Collective, when some ranks build their transformer and the others kept theirs: the kept
        ones run the layout check the builders run, then every rank takes the survivors' LoRA set
        and goes back to the clean weights together (from the owners' clean shards: the builders'
        shards are clean from the file), so that the next ``apply`` is the same on every rank."""
        if fresh:
            self.build(loader)
        else:
            self._check_same_model_on_every_rank(_layout(self._working), loader.device)
        applied = json.dumps([[path, strength] for path, strength in self._applied]).encode()
        length = self.comm.broadcast(torch.tensor([len(applied)], dtype=torch.int64, device=loader.device), src=survivor)
        buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=loader.device)
        if self.comm.rank == survivor:
            buffer.copy_(torch.frombuffer(bytearray(applied), dtype=torch.uint8))
        kept_set = _normalised([(path, strength) for path, strength in json.loads(bytes(self.comm.broadcast(buffer, src=survivor).cpu().tolist()))])
        if not kept_set:
            return
        if self.no_lora_swap:  # no clean copy to go back to: the survivors build theirs again
            if not fresh:
                self._drop()
                self.build(loader)
            else:
                self._check_same_model_on_every_rank(_layout(self._working), loader.device)
            return
        if fresh:
            loras = [LoraStateDictWithStrength(self._loader.lora_state_dict(path), strength) for path, strength in kept_set]
            self._applied, self._touched = kept_set, frozenset(fp8.lora_targets(self._working, loras))
        self.apply(())

    def apply(self, lora_set) -> X0Model:
        """Make the working copy hold the clean weights with ``lora_set`` fused; return the model."""
        model = self.model
        self.unpark()
        lora_set = _normalised(lora_set)
        if lora_set == self._applied:
            self.stats.unchanged += 1
            return model
        if self.no_lora_swap and self._applied:
            raise RuntimeError(
                f"this transformer was loaded with no_lora_swap=True and already has the LoRAs {list(self._applied)} "
                f"fused, so it cannot switch to {list(lora_set)}: no clean copy was kept. Load the model "
                "without no_lora_swap to alternate LoRA sets (costs about 1/N of the transformer per GPU)"
            )
        loras = [
            LoraStateDictWithStrength(self._loader.lora_state_dict(path), strength) for path, strength in lora_set
        ]
        new_touched = fp8.lora_targets(self._working, loras)
        bad = sorted({str(self._working[key].dtype) for key in new_touched} - {str(d) for d in _FUSABLE_DTYPES})
        if bad:
            raise ValueError(
                f"LoRAs fuse into bfloat16 or float8_e4m3fn weights (as in ltx-core), but this transformer holds "
                f"{', '.join(bad)} weights; load the model in bfloat16 (optionally with quantization fp8-cast) to use LoRAs"
            )
        # Keys the old set changed go back to clean; keys the new set touches get fused from clean.
        keys = [key for key in self._working if key in self._touched or key in new_touched]
        with torch.inference_mode():
            if self.shard_weights:
                self._fuse_sharded(keys, new_touched, loras)
            else:
                self._broadcast_final_values(keys, new_touched, loras)
        self.stats.swaps += 1
        log.info(
            "LoRA swap on rank %d: %s -> %s, %d keys updated",
            self.comm.rank,
            [path for path, _ in self._applied] or "no LoRA",
            [path for path, _ in lora_set] or "no LoRA",
            len(keys),
        )
        self._applied, self._touched = lora_set, frozenset(new_touched)
        return model

    def _final_value(self, key: str, fuse: bool, loras: list[LoraStateDictWithStrength]) -> torch.Tensor:
        """The value the owner of ``key`` broadcasts: the clean weight, or it fused by ltx-core."""
        clean = (self._working if self.no_lora_swap else self._clean)[key]  # no_lora_swap: working is still clean
        # A shard kept in host memory is fused where the working copy is, as it would be on the device.
        clean = clean.to(self._working[key].device)
        if not fuse:
            return clean
        self.stats.keys_fused += 1
        scale = self._working.get(key.removesuffix(".weight") + fp8.WEIGHT_SCALE_SUFFIX)
        return fp8.fuse_loras_into(key, clean, loras, clean.dtype, scale)

    def _fuse_sharded(self, keys: list[str], fused_keys: set[str], loras) -> None:
        """Sharded working copy: every key back to this rank's clean rows; a key in ``fused_keys``
        then gathered whole (collective, in key order, the same on every rank), fused, and its rows
        kept."""
        for key in keys:
            target = self._working[key]
            clean = (self._working if self.no_lora_swap else self._clean)[key]
            if clean is not target:
                target.copy_(clean)
            if key not in fused_keys:
                continue
            self.stats.keys_fused += 1
            full = weight_sharding.full_tensor(self._model, key)
            scale = self._working.get(key.removesuffix(".weight") + fp8.WEIGHT_SCALE_SUFFIX)
            fused = fp8.fuse_loras_into(key, full, loras, full.dtype, scale)
            target.copy_(weight_sharding.shard_rows(self._model, key, fused))
            self.stats.keys_broadcast += 1
            self.stats.bytes_broadcast += full.nbytes - target.nbytes

    def _broadcast_final_values(self, keys: list[str], fused_keys: set[str], loras) -> None:
        """Owners send their keys' final values in buckets of at most ``bucket_bytes`` (a larger key
        goes alone); every rank copies them into its working copy. Ranks agree on the buckets
        because they hold the same keys, shapes and owners."""
        device = next(iter(self._working.values())).device
        for owner in range(self.comm.world_size):
            owned = [key for key in keys if self._owners[key] == owner]
            for bucket in _buckets(owned, self._working, self.bucket_bytes):
                total = sum(self._working[key].nbytes for key in bucket)
                buffer = torch.empty(total, dtype=torch.uint8, device=device)
                offset = 0
                if owner == self.comm.rank:
                    for key in bucket:
                        value = self._final_value(key, key in fused_keys, loras).contiguous()
                        buffer[offset : offset + value.nbytes].copy_(value.reshape(-1).view(torch.uint8))
                        offset += value.nbytes
                    offset = 0
                self.comm.broadcast(buffer, src=owner)
                for key in bucket:
                    target = self._working[key]
                    target.copy_(buffer[offset : offset + target.nbytes].view(target.dtype).view(target.shape))
                    offset += target.nbytes
                self.stats.broadcasts += 1
                self.stats.keys_broadcast += len(bucket)
                self.stats.bytes_broadcast += total

    # --- Reporting ------------------------------------------------------------------------------------

    def memory_report(self) -> dict:
        """Bytes held on this rank, for ``status``: the working copy and the clean shard."""
        ranges = file_mapped_ranges() if self._clean else []
        return {
            "rank": self.comm.rank,
            "world_size": self.comm.world_size,
            "working_bytes": self._working_bytes,
            "clean_shard_bytes": sum(tensor.nbytes for tensor in self._clean.values()),
            "clean_shard_device": str(next(iter(self._clean.values())).device) if self._clean else None,
            "clean_shard_keys": len(self._clean),
            # Of the clean shard, the bytes that are views of the checkpoint file (no host memory of their own).
            "clean_shard_file_bytes": sum(tensor.nbytes for tensor in self._clean.values() if file_backed(tensor, ranges)),
            "transformer_keys": len(self._working),
            "no_lora_swap": self.no_lora_swap,
            "weights_sharded": self.shard_weights,
            "parked": self.parked,
            "lora_set": [[path, strength] for path, strength in self._applied],
        }


def _buckets(keys: list[str], tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    buckets: list[list[str]] = []
    size = 0
    for key in keys:
        nbytes = tensors[key].nbytes
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(key)
        size += nbytes
    return buckets
