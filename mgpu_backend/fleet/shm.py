"""Shared-memory segments for results too large for the socket (decoded frames: gigabytes).

A segment is a file in /dev/shm named ``mgpu-<uid>-<server pid>-<random>``, created 0600 by the
process that fills it. Its name travels in a message header; the reader maps it, copies or keeps the
tensor, and unlinks it. The server also unlinks every segment of a job when the job's client goes
away, and sweeps segments left by server processes that no longer exist, so a crash of either side
never leaks memory. Only the owner's uid can open a segment.

This module never unpickles; a segment holds raw tensor bytes described by a validated descriptor.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import secrets
from pathlib import Path

import torch

from mgpu_backend.fleet.protocol import DTYPE_NAMES, ProtocolError, bytes_to_tensor, tensor_bytes, tensor_descriptor, validate_descriptor

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^mgpu-(\d+)-(\d+)-[0-9a-f]{16}$")


INLINE_LIMIT_BYTES = 1 << 20  # tensors above this travel through shared memory in both directions


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def segment_path(name: str) -> Path:
    if not _NAME.match(name):
        raise ProtocolError(f"invalid shared-memory segment name {name!r}")
    return SHM_DIR / name


def _new_segment_name(owner_pid: int | None) -> str:
    pid = os.getpid() if owner_pid is None else owner_pid
    return f"mgpu-{os.getuid()}-{pid}-{secrets.token_hex(8)}"


def split_for_transfer(tensors: dict[str, torch.Tensor], owner_pid: int | None = None) -> tuple[dict, list[dict]]:
    """Keep small tensors inline; put large ones into segments. Returns (inline, descriptors)."""
    inline, shared = {}, []
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        if tensor.numel() * tensor.element_size() > INLINE_LIMIT_BYTES and available():
            shared.append(write_tensor(name, tensor, owner_pid))
        else:
            inline[name] = tensor
    return inline, shared


def write_tensor(name: str, tensor: torch.Tensor, owner_pid: int | None = None) -> dict:
    """Copy ``tensor`` into a new segment; return its descriptor (with the segment name)."""
    segment = _new_segment_name(owner_pid)
    path = SHM_DIR / segment
    data = tensor_bytes(tensor)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=True) as file:
            file.write(data)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    descriptor = tensor_descriptor(name, tensor)
    descriptor["segment"] = segment
    return descriptor


def create_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, owner_pid: int | None = None) -> tuple[torch.Tensor, dict]:
    """A new tensor that lives in a segment, so a result can be built in place and handed over
    without any copy. Returns the tensor and its descriptor."""
    segment = _new_segment_name(owner_pid)
    path = SHM_DIR / segment
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    descriptor = {"name": name, "dtype": DTYPE_NAMES[dtype], "shape": list(shape), "nbytes": nbytes, "segment": segment}
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype), descriptor
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return bytes_to_tensor(memoryview(mapping), dtype, shape), descriptor


def read_tensor(descriptor: dict, unlink: bool = True, shared: bool = False) -> torch.Tensor:
    """Map the segment a descriptor names and return its tensor; unlink the segment by default.

    The returned tensor keeps the mapping alive (no copy); the memory is freed when it is dropped.
    ``shared`` maps it MAP_SHARED, so writes to the tensor land in the segment (a rank can then
    hand an input back as a result by name); otherwise writes stay private to this process.
    """
    name, dtype, shape, nbytes = validate_descriptor(descriptor)
    path = segment_path(descriptor["segment"])
    fd = os.open(path, (os.O_RDWR if shared else os.O_RDONLY) | os.O_NOFOLLOW)
    try:
        stat = os.fstat(fd)
        if stat.st_uid != os.getuid():
            raise ProtocolError(f"segment {path.name} is not owned by this user")
        if stat.st_size != nbytes:
            raise ProtocolError(f"segment {path.name} holds {stat.st_size} bytes, expected {nbytes}")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        flags = mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE
        mapping = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ | mmap.PROT_WRITE, flags=flags)
    finally:
        os.close(fd)
        if unlink:
            unlink_segment(descriptor["segment"])
    return bytes_to_tensor(memoryview(mapping), dtype, shape)


def unlink_segment(segment: str) -> None:
    try:
        segment_path(segment).unlink()
    except FileNotFoundError:
        pass


def segments_of(owner_pid: int) -> set[str]:
    """The names of this user's segments named after ``owner_pid`` (a server names the segments its
    ranks create after itself, so that they outlive the rank that made them)."""
    if not SHM_DIR.is_dir():
        return set()
    return {path.name for path in SHM_DIR.glob(f"mgpu-{os.getuid()}-{owner_pid}-*") if _NAME.match(path.name)}


def sweep_orphans() -> list[str]:
    """Unlink this user's segments whose creating process is gone. Returns the names removed."""
    removed = []
    if not SHM_DIR.is_dir():
        return removed
    uid = os.getuid()
    for path in SHM_DIR.glob(f"mgpu-{uid}-*"):
        match = _NAME.match(path.name)
        if not match:
            continue
        pid = int(match.group(2))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        except PermissionError:
            pass
    return removed
