"""How a ComfyUI denoiser call and a model's weight patches travel to the fleet, without pickle.

ComfyUI hands its diffusion model nested Python values: tensors, tuples of tensors (LTX-2's video
and audio timesteps), lists of shapes (``latent_shapes``), floats (``frame_rate``), dicts of
options. ``pack`` turns such a value into JSON plus a flat list of tensors, ``unpack`` turns it back;
a tensor's place in the JSON is ``{"$tensor": index}``, a tuple's ``{"$tuple": [...]}``, and every
other value must be JSON itself. Anything else (a function, a module, a custom object) is refused
with the path at which it sits, so a caller can name what the fleet cannot honour.

Weight patches (what ComfyUI's LoRA loaders add to a ``ModelPatcher``) hold thousands of tensors,
more than one message carries (``protocol.MAX_TENSORS``), and the same LoRA is applied graph after
graph. ``pack_tensor_blob`` lays many tensors into one byte buffer with a JSON index (name, dtype,
shape, offset); ``unpack_tensor_blob`` reads them back as views, checking every entry against the
buffer. Patch tensors are named by their content digest (``tensor_digest``), so the fleet keeps
each one once and a graph re-sends only what it has not seen.

This module imports neither ComfyUI nor the fleet: both sides of the call use it.
"""

from __future__ import annotations

import hashlib
import math
import os
import secrets
import weakref
from collections import OrderedDict
from typing import Any

import torch

TENSOR_KEY = "$tensor"
TUPLE_KEY = "$tuple"
DIGEST_KEY = "$digest"
KEEP_KEY = "$keep"
KEPT_KEY = "$kept"
ADAPTER_KEY = "$adapter"
MAX_PACK_DEPTH = 16
MAX_PACKED_TENSORS = 64
"""A denoiser call carries about ten tensors (latent, timesteps, context, masks, keyframe indices);
more than this is not a call of an LTX model."""

BLOB_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
BLOB_DTYPE_NAMES = {dtype: name for name, dtype in BLOB_DTYPES.items()}
BLOB_ALIGN = 64


class UnsupportedValue(TypeError):
    """A value that cannot travel to the fleet; ``path`` says where it sits (e.g. ``patches.attn1_patch[0]``)."""

    def __init__(self, path: str, value: Any) -> None:
        self.path = path
        self.value = value
        what = getattr(value, "__qualname__", None) or type(value).__name__
        module = getattr(value, "__module__", None) or type(value).__module__
        super().__init__(f"{path or 'the value'} is a {what} from {module}, which cannot be sent to the fleet")


def pack(value: Any, path: str = "", kept: KeptTensors | None = None) -> tuple[Any, list[torch.Tensor]]:
    """``value`` as (JSON, tensors). Tensors are sent as they are (device and all): the caller moves them.

    With ``kept``, a tensor the other side already keeps is named (``{"$kept": token}``) instead of
    sent, and one worth keeping is sent once with the token to keep it under (``"$keep"``)."""
    tensors: list[torch.Tensor] = []

    def by_index(tensor: torch.Tensor, where: str) -> dict:
        token, known = kept.token(tensor, where) if kept is not None else (None, False)
        if known:
            return {KEPT_KEY: token}
        if len(tensors) >= MAX_PACKED_TENSORS:
            raise ValueError(f"{where}: more than {MAX_PACKED_TENSORS} tensors in one call")
        tensors.append(tensor)
        return {TENSOR_KEY: len(tensors) - 1} if token is None else {TENSOR_KEY: len(tensors) - 1, KEEP_KEY: token}

    return _pack(value, path, by_index, 0), tensors


class KeptTensors:
    """The sender's record of the tensors the other side keeps between calls, so that a denoiser call
    sends the text context, masks and guide indices once per sampling run instead of every step.

    A tensor is known by its content, not its object: ComfyUI's sampler builds the conditioning anew
    at every step (``cond_cat`` concatenates even a single prompt into a new tensor), with the same
    values. So the sender keeps its own copy of each tensor it sent for keeping (on the tensor's
    device: a GPU compares 12.6 MB in microseconds) and names a later tensor by that copy's token when
    dtype, shape and every bit agree. The copies are private, so a tensor changed in place after it
    was sent is never mistaken for what the other side holds. Only tensors of at least ``min_bytes``,
    and none under the ``skip`` paths (the latent and timesteps: new every step), are kept; at most
    ``max_tensors`` copies and ``max_bytes`` in all, the least recently used dropped first (the other
    side then gets that tensor again under a new token). ``forget`` is for when the other side lost them."""

    def __init__(self, min_bytes: int = 1 << 16, skip: tuple[str, ...] = (), max_tensors: int = 16, max_bytes: int = 256 << 20) -> None:
        self.min_bytes, self.skip = min_bytes, skip
        self.max_tensors, self.max_bytes = max_tensors, max_bytes
        self._copies: OrderedDict[str, torch.Tensor] = OrderedDict()

    def token(self, tensor: torch.Tensor, path: str = "") -> tuple[str | None, bool]:
        """(token, already kept over there); (None, False) for a tensor not worth keeping."""
        size = tensor.numel() * tensor.element_size()
        if size < self.min_bytes or size > self.max_bytes or path.startswith(self.skip):
            return None, False
        for token, copy in self._copies.items():
            if same_bits(copy, tensor):
                self._copies.move_to_end(token)
                return token, True
        token = secrets.token_hex(8)
        self._copies[token] = tensor.detach().clone()
        while len(self._copies) > self.max_tensors or sum(copy.numel() * copy.element_size() for copy in self._copies.values()) > self.max_bytes:
            self._copies.popitem(last=False)
        return token, False

    def forget(self) -> None:
        self._copies.clear()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one device hold the same dtype, shape and bits (NaNs and signed zeros
    included: a float compare would call 0.0 and -0.0 equal)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if bits is None:
            return False
        a, b = a.view(bits), b.view(bits)
    return torch.equal(a, b)


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; 0 for an inference tensor, which has none and cannot be
    changed outside inference mode (ComfyUI loads LoRAs and runs its nodes under inference_mode)."""
    return 0 if tensor.is_inference() else tensor._version


class TensorMemo:
    """A value remembered per tensor object while it lives and is not changed in place (its version
    counter). Keyed by identity: a tensor's ``==`` compares elements, so it cannot key a dict itself."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, int, Any]] = {}

    def get(self, tensor: torch.Tensor) -> Any:
        entry = self._entries.get(id(tensor))
        if entry is None or entry[0]() is not tensor or entry[1] != _version(tensor):
            return None
        return entry[2]

    def put(self, tensor: torch.Tensor, value: Any) -> None:
        key = id(tensor)
        entries = self._entries
        self._entries[key] = (weakref.ref(tensor, lambda _, key=key: entries.pop(key, None)), _version(tensor), value)


def _pack(value: Any, path: str, tensor_ref, depth: int) -> Any:
    if depth > MAX_PACK_DEPTH:
        raise UnsupportedValue(path, value)
    if isinstance(value, torch.Tensor):
        return tensor_ref(value, path)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnsupportedValue(path, value)
        return float(value)
    if isinstance(value, torch.Size):
        return {TUPLE_KEY: [int(size) for size in value]}
    if isinstance(value, tuple):
        return {TUPLE_KEY: [_pack(item, f"{path}[{index}]", tensor_ref, depth + 1) for index, item in enumerate(value)]}
    if isinstance(value, list):
        return [_pack(item, f"{path}[{index}]", tensor_ref, depth + 1) for index, item in enumerate(value)]
    if isinstance(value, dict):
        packed = {}
        for key, item in value.items():
            if not isinstance(key, str) or key in (TENSOR_KEY, TUPLE_KEY):
                raise UnsupportedValue(f"{path}[{key!r}]", key)
            packed[key] = _pack(item, f"{path}.{key}" if path else key, tensor_ref, depth + 1)
        return packed
    if _is_weight_adapter(value):
        # Not its loaded_keys: ComfyUI's LoRA loader hands every adapter of a file the same set (all the
        # file's keys, thousands for a full-size LoRA), read only while loading the file, never to compute.
        return {ADAPTER_KEY: type(value).__name__, "weights": _pack(value.weights, f"{path}.weights", tensor_ref, depth + 1)}
    raise UnsupportedValue(path, value)


def _is_weight_adapter(value: Any) -> bool:
    """One of ComfyUI's weight adapters (comfy.weight_adapter: LoRA, LoHa, LoKr, ...), told by its
    module, so that this module needs no ComfyUI to pack one."""
    return type(value).__module__.startswith("comfy.weight_adapter") and hasattr(value, "weights") and hasattr(value, "loaded_keys")


KEPT_MISSING = "kept tensor missing"
"""The words of a fleet error when a call names a tensor the ranks no longer keep: the sender then
forgets what it believed kept and sends the call again whole."""


class MissingKeptTensor(KeyError):
    """A call names a kept tensor this side no longer holds (the fleet restarted or dropped it)."""


def unpack(packed: Any, tensors: list[torch.Tensor] | dict[str, torch.Tensor], depth: int = 0, make_adapter=None,
           kept: dict[str, torch.Tensor] | None = None) -> Any:  # fmt: skip
    """The value ``pack`` (``tensors``: a list) or ``pack_patches`` (``tensors``: by digest) was given,
    from its JSON and tensors, checked: a bad reference is a ValueError. ``make_adapter(class name,
    weights)`` rebuilds a weight adapter; without it an adapter is refused. ``kept``: the
    tensors this side keeps by token; a ``"$keep"`` tensor is added to it, a ``"$kept"`` one read from it
    (``MissingKeptTensor`` when absent)."""
    if depth > MAX_PACK_DEPTH:
        raise ValueError("packed value nested too deeply")
    if isinstance(packed, list):
        return [unpack(item, tensors, depth + 1, make_adapter, kept) for item in packed]
    if isinstance(packed, dict):
        if set(packed) == {KEPT_KEY}:
            token = packed[KEPT_KEY]
            if kept is None or not isinstance(token, str) or token not in kept:
                raise MissingKeptTensor(token)
            return kept[token]
        if set(packed) == {TENSOR_KEY, KEEP_KEY}:
            token = packed[KEEP_KEY]
            if kept is None or not isinstance(token, str) or not 0 < len(token) <= 64:
                raise ValueError(f"a tensor to keep needs a token of at most 64 characters, got {token!r}")
            kept[token] = unpack({TENSOR_KEY: packed[TENSOR_KEY]}, tensors, depth + 1)
            return kept[token]  # as the keeper stores it (it may move it to its device)
        if set(packed) == {DIGEST_KEY}:
            digest = packed[DIGEST_KEY]
            if not isinstance(tensors, dict) or not isinstance(digest, str) or digest not in tensors:
                raise ValueError(f"packed value names tensor digest {digest!r}, which the fleet does not hold")
            return tensors[digest]
        if set(packed) == {ADAPTER_KEY, "weights"}:
            if make_adapter is None:
                raise ValueError("a weight adapter came where none is expected")
            return make_adapter(packed[ADAPTER_KEY], unpack(packed["weights"], tensors, depth + 1, make_adapter, kept))
        if set(packed) == {TENSOR_KEY}:
            index = packed[TENSOR_KEY]
            if not isinstance(tensors, list) or not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(tensors):
                raise ValueError(f"packed value names tensor {index!r}, but {len(tensors)} came")
            return tensors[index]
        if set(packed) == {TUPLE_KEY}:
            items = packed[TUPLE_KEY]
            if not isinstance(items, list):
                raise ValueError("a packed tuple must hold a list")
            return tuple(unpack(item, tensors, depth + 1, make_adapter, kept) for item in items)
        return {key: unpack(item, tensors, depth + 1, make_adapter, kept) for key, item in packed.items()}
    if packed is None or isinstance(packed, (bool, int, float, str)):
        return packed
    raise ValueError(f"packed value holds a {type(packed).__name__}")


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it (lists, tuples, dicts) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: to_device(item, device) for key, item in value.items()}
    return value


def tensors_by_name(tensors: list[torch.Tensor], prefix: str = "t") -> dict[str, torch.Tensor]:
    """The flat tensor list as a message's named tensors (``t0``, ``t1`` ...)."""
    return {f"{prefix}{index}": tensor for index, tensor in enumerate(tensors)}


def tensors_in_order(named: dict[str, torch.Tensor], count: int, prefix: str = "t") -> list[torch.Tensor]:
    """The inverse of ``tensors_by_name`` for ``count`` tensors; a missing one is a ValueError."""
    missing = [f"{prefix}{index}" for index in range(count) if f"{prefix}{index}" not in named]
    if missing:
        raise ValueError(f"the call names tensors {missing} that did not come")
    return [named[f"{prefix}{index}"] for index in range(count)]


# -- weight patches -------------------------------------------------------------------------------

def pack_patches(patches: dict[str, list[tuple]]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """A ``ModelPatcher.patches`` dict (weight name -> [(strength_patch, patch, strength_model,
    offset, function)]) as (JSON entries, tensors by content digest). A patch function (a Python
    callable) or a patch of an unknown kind raises ``UnsupportedValue`` naming the weight."""
    found: list[tuple[torch.Tensor, dict]] = []

    def by_content(tensor: torch.Tensor, where: str) -> dict:
        reference: dict = {}  # its digest is filled in below, once every tensor's is known
        found.append((tensor, reference))
        return reference

    entries = []
    for key in sorted(patches):
        for strength_patch, patch, strength_model, offset, function in patches[key]:
            if function is not None:
                raise UnsupportedValue(f"patch function of {key}", function)
            entries.append({
                "key": key,
                "strength_patch": float(strength_patch),
                "strength_model": float(strength_model),
                "offset": _pack(offset, f"offset of {key}", by_content, 0),
                "patch": _pack(patch, key, by_content, 0),
            })
    by_digest: dict[str, torch.Tensor] = {}
    for (tensor, reference), digest in zip(found, tensor_digests([tensor for tensor, _ in found]), strict=True):  # in parallel
        reference[DIGEST_KEY] = digest
        by_digest[digest] = tensor
    return entries, by_digest


def unpack_patches(entries: Any, tensors: dict[str, torch.Tensor], make_adapter) -> dict[str, list[tuple]]:
    """The ``ModelPatcher.patches`` dict ``pack_patches`` was given, in its order."""
    if not isinstance(entries, list):
        raise ValueError("weight patches come as a list")
    patches: dict[str, list[tuple]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise ValueError("a weight patch entry names its weight")
        strengths = entry.get("strength_patch"), entry.get("strength_model")
        if not all(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) for value in strengths):
            raise ValueError(f"weight patch of {entry['key']}: strengths must be numbers")
        offset = unpack(entry.get("offset"), tensors, make_adapter=make_adapter)
        patch = unpack(entry.get("patch"), tensors, make_adapter=make_adapter)
        patches.setdefault(entry["key"], []).append((float(strengths[0]), patch, float(strengths[1]), offset, None))
    return patches


MAX_PATCH_ENTRIES_BYTES = 64 << 20
"""Bound of a patch set's JSON entries (about 350 bytes per patched weight: a full-size LoRA's ~2000
weights take under 1 MB, so this holds dozens of stacked LoRAs)."""


def entries_tensor(entries: list[dict]) -> torch.Tensor:
    """A patch set's entries as UTF-8 JSON in a uint8 tensor: they travel as data beside the patch
    tensors, not in a message header (whose bound a few stacked full-size LoRAs would pass)."""
    import json

    data = json.dumps(entries, separators=(",", ":")).encode()
    if len(data) > MAX_PATCH_ENTRIES_BYTES:
        raise UnsupportedValue(f"a patch set of {len(entries)} weights ({len(data)} bytes of entries)", entries)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def entries_from_tensor(tensor: Any) -> list:
    """``entries_tensor``'s entries, or ValueError saying what is wrong with the tensor or its JSON."""
    import json

    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError("the patch entries come as a one-dimensional uint8 tensor of JSON")
    if tensor.numel() > MAX_PATCH_ENTRIES_BYTES:
        raise ValueError(f"the patch entries take {tensor.numel()} bytes, over the bound of {MAX_PATCH_ENTRIES_BYTES}")
    try:
        entries = json.loads(bytes(tensor.cpu().numpy()).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"the patch entries are not JSON: {exc}") from None
    if not isinstance(entries, list):
        raise ValueError("the patch entries must be the list wire.pack_patches made")
    return entries


def patch_set_digest(entries: list[dict]) -> str:
    """One name for a whole patch set (its JSON, which names every tensor by digest)."""
    import json

    return hashlib.blake2b(json.dumps(entries, sort_keys=True).encode(), digest_size=20).hexdigest()


# -- content digests -------------------------------------------------------------------------------

_digests = TensorMemo()


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest of the tensor's dtype, shape and bytes. Remembered per tensor object (and its
    version counter), so a LoRA that stays loaded in ComfyUI is hashed once, not every graph."""
    known = _digests.get(tensor)
    if known is not None:
        return known
    # SHA-256: CPUs hash it in hardware (SHA extensions), twice blake2b's speed on the project's machines.
    hasher = hashlib.sha256()
    hasher.update(f"{BLOB_DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))}{tuple(tensor.shape)}".encode())
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    if flat.numel():
        hasher.update(flat.view(torch.uint8).numpy())  # the bytes in place (hashlib reads the buffer, no copy)
    digest = hasher.hexdigest()[:40]
    _digests.put(tensor, digest)
    return digest


def tensor_digests(tensors: list[torch.Tensor]) -> list[str]:
    """``tensor_digest`` of each, computed on several threads (hashlib lets go of the GIL while it
    hashes a large buffer): a full-size LoRA is thousands of tensors and gigabytes."""
    if len(tensors) < 2:
        return [tensor_digest(tensor) for tensor in tensors]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(DIGEST_THREADS, len(tensors))) as pool:
        return list(pool.map(tensor_digest, tensors))


DIGEST_THREADS = min(8, os.cpu_count() or 1)


# -- many tensors in one buffer --------------------------------------------------------------------

def pack_tensor_blob(named: dict[str, torch.Tensor]) -> tuple[list[dict], torch.Tensor]:
    """(index, uint8 buffer) holding every tensor of ``named`` at an aligned offset."""
    index: list[dict] = []
    offset = 0
    for name, tensor in named.items():
        if tensor.dtype not in BLOB_DTYPE_NAMES:
            raise UnsupportedValue(name, tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        index.append({"name": name, "dtype": BLOB_DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "offset": offset})
        offset += -(-nbytes // BLOB_ALIGN) * BLOB_ALIGN
    blob = torch.empty(offset, dtype=torch.uint8)
    for entry, tensor in zip(index, named.values()):
        flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        blob[entry["offset"] : entry["offset"] + flat.numel()] = flat
    return index, blob


def unpack_tensor_blob(index: Any, blob: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``pack_tensor_blob``, checked entry by entry against the buffer (views into it)."""
    if blob.dtype != torch.uint8 or blob.ndim != 1:
        raise ValueError(f"a tensor blob is a flat uint8 tensor, got {blob.dtype} {list(blob.shape)}")
    if not isinstance(index, list):
        raise ValueError("a tensor blob's index is a list")
    out: dict[str, torch.Tensor] = {}
    for entry in index:
        if not isinstance(entry, dict):
            raise ValueError("a tensor blob's index holds dicts")
        name, dtype_name, shape, offset = entry.get("name"), entry.get("dtype"), entry.get("shape"), entry.get("offset")
        if not isinstance(name, str) or dtype_name not in BLOB_DTYPES:
            raise ValueError(f"tensor blob entry {name!r}: unknown dtype {dtype_name!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(isinstance(size, int) and 0 <= size < 1 << 32 for size in shape):
            raise ValueError(f"tensor blob entry {name!r}: bad shape {shape!r}")
        if not isinstance(offset, int) or offset < 0 or offset % BLOB_ALIGN:
            raise ValueError(f"tensor blob entry {name!r}: bad offset {offset!r}")
        dtype = BLOB_DTYPES[dtype_name]
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > blob.numel():
            raise ValueError(f"tensor blob entry {name!r} runs past the end of its buffer")
        out[name] = blob[offset : offset + nbytes].view(dtype).reshape(shape)
    return out
