"""Shared-memory segments for results too large for the socket (decoded frames: gigabytes).

A segment is a file in /dev/shm named ``mgpu-<uid>-<creator pid>-<random>``, created 0600 by the
process that fills it (ranks name theirs after the server). Its space is reserved when it is created
(``posix_fallocate``), so a full /dev/shm is a clear error naming the size needed, never a SIGBUS
while a mapped result is written. Its name travels in a message header; the reader maps it, copies or keeps the
tensor, and unlinks it. The server also unlinks every segment of a job when the job's client goes
away, and sweeps segments left by server processes that no longer exist, so a crash of either side
never leaks memory. Only the owner's uid can open a segment.

A mapping of a file that another process shortens faults (SIGBUS) at the first page past the new
end, so no fleet process ever maps a segment a client can still change: the server copies each
input segment into one of its own with ``take_segment`` (system calls, no mapping: a shortened
segment is an error there) and the ranks map only that copy. Every open refuses what is not a
regular file (a directory, a FIFO that would block the reader) before reading anything.

This module never unpickles; a segment holds raw tensor bytes described by a validated descriptor.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import secrets
import stat
from pathlib import Path

import torch

from mgpu_backend.fleet import protocol
from mgpu_backend.fleet.protocol import DTYPE_NAMES, ProtocolError, bytes_to_tensor

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^mgpu-(\d+)-(\d+)-[0-9a-f]{16}$")


INLINE_LIMIT_BYTES = 1 << 20  # tensors above this travel through shared memory in both directions
COPY_CHUNK_BYTES = 16 << 20  # what take_segment reads at once where copy_file_range is not available


class SharedMemoryFull(OSError):
    """/dev/shm has no room for a segment; the message says how much was needed."""


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def is_segment_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.match(name) is not None


def segment_creator(name: str) -> int:
    """The pid of the process that created segment ``name`` (a valid name)."""
    return int(_NAME.match(name).group(2))


def segment_path(name: str) -> Path:
    if not is_segment_name(name):
        raise ProtocolError(f"invalid shared-memory segment name {name!r}")
    return SHM_DIR / name


def _reserve(fd: int, path: Path, nbytes: int) -> None:
    """Claim the segment's pages now, so that writing it later can never fail half-way."""
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        size = f"{nbytes / 2**20:.1f} MiB"
        if exc.errno == errno.EFBIG:
            raise SharedMemoryFull(
                exc.errno, f"a file-size limit (ulimit -f) forbids a {size} shared-memory segment in {SHM_DIR}; raise or lift it"
            ) from None
        try:
            free = os.statvfs(SHM_DIR)
            free_text = f"{free.f_bavail * free.f_frsize / 2**20:.1f} MiB free"
        except OSError:
            free_text = "free space unknown"
        raise SharedMemoryFull(
            exc.errno,
            f"{SHM_DIR} has no room for a {size} shared-memory segment ({free_text}); "
            f"free space in {SHM_DIR} (old mgpu-* segments, other programs) or enlarge it, "
            f"e.g. 'sudo mount -o remount,size=64G {SHM_DIR}' (Docker: --shm-size)",
        ) from None


def new_segment_name(owner_pid: int | None = None) -> str:
    pid = os.getpid() if owner_pid is None else owner_pid
    return f"mgpu-{os.getuid()}-{pid}-{secrets.token_hex(8)}"


def split_for_transfer(tensors: dict[str, torch.Tensor], owner_pid: int | None = None) -> tuple[dict, list[dict]]:
    """Keep small tensors inline; put large ones into segments. Returns (inline, descriptors)."""
    inline, shared = {}, []
    try:
        for name, tensor in tensors.items():
            tensor = tensor.detach().cpu()
            if tensor.numel() * tensor.element_size() > INLINE_LIMIT_BYTES and available():
                shared.append(write_tensor(name, tensor, owner_pid))
            else:
                inline[name] = tensor
    except BaseException:  # no half-made transfer leaves segments behind
        for descriptor in shared:
            unlink_segment(descriptor["segment"])
        raise
    return inline, shared


def write_tensor(name: str, tensor: torch.Tensor, owner_pid: int | None = None) -> dict:
    """Copy ``tensor`` into a new segment; return its descriptor (with the segment name)."""
    segment = new_segment_name(owner_pid)
    path = SHM_DIR / segment
    data = protocol.tensor_bytes(tensor)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=True) as file:
            _reserve(fd, path, len(data))
            file.write(data)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    descriptor = protocol.tensor_descriptor(name, tensor)
    descriptor["segment"] = segment
    return descriptor


def create_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, owner_pid: int | None = None) -> tuple[torch.Tensor, dict]:
    """A new tensor that lives in a segment, so a result can be built in place and handed over
    without any copy. Returns the tensor and its descriptor."""
    segment = new_segment_name(owner_pid)
    path = SHM_DIR / segment
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    descriptor = {"name": name, "dtype": DTYPE_NAMES[dtype], "shape": list(shape), "nbytes": nbytes, "segment": segment}
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        _reserve(fd, path, nbytes)  # also sets the size: never a sparse file that SIGBUSes when full
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype), descriptor
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return bytes_to_tensor(memoryview(mapping), dtype, shape), descriptor


def _open_segment(path: Path, flags: int, nbytes: int) -> int:
    """Open segment ``path`` and check it is this user's regular file of ``nbytes``; returns the fd.

    O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever; O_NOFOLLOW:
    a link is never followed out of /dev/shm.
    """
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ProtocolError(f"segment {path.name} is not a regular file (a directory, FIFO or device); name a segment made by shm.write_tensor")
        if info.st_uid != os.getuid():
            raise ProtocolError(f"segment {path.name} is not owned by this user")
        if info.st_size != nbytes:
            raise ProtocolError(f"segment {path.name} holds {info.st_size} bytes, expected {nbytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _copy_bytes(source_fd: int, target_fd: int, nbytes: int, source_name: str) -> None:
    """Copy ``nbytes`` with system calls (never a mapping of the source): a source shortened
    meanwhile ends the copy early, which is an error here rather than a SIGBUS."""
    copied = 0
    use_copy_file_range = hasattr(os, "copy_file_range")
    while copied < nbytes:
        count = 0
        if use_copy_file_range:
            try:
                count = os.copy_file_range(source_fd, target_fd, nbytes - copied, copied, copied)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_copy_file_range = False
                continue
        else:
            chunk = os.pread(source_fd, min(COPY_CHUNK_BYTES, nbytes - copied), copied)
            count = len(chunk) and os.pwrite(target_fd, chunk, copied)
        if count == 0:
            raise ProtocolError(f"segment {source_name} was shortened while it was read ({copied} of {nbytes} bytes); submit again and leave it alone until the job ends")
        copied += count


def take_segment(descriptor: dict, target: str) -> None:
    """Copy the (client's) segment a descriptor names into a new segment named ``target`` (from
    ``new_segment_name``: the server's); the original is left in place."""
    _, _, _, nbytes = protocol.validate_descriptor(descriptor)
    source = segment_path(descriptor["segment"])
    source_fd = _open_segment(source, os.O_RDONLY, nbytes)
    path = segment_path(target)
    try:
        target_fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            _reserve(target_fd, path, nbytes)
            _copy_bytes(source_fd, target_fd, nbytes, source.name)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(target_fd)
    finally:
        os.close(source_fd)


def read_tensor(descriptor: dict, unlink: bool = True, shared: bool = False) -> torch.Tensor:
    """Map the segment a descriptor names and return its tensor; unlink the segment by default.

    The returned tensor keeps the mapping alive (no copy); the memory is freed when it is dropped.
    ``shared`` maps it MAP_SHARED, so writes to the tensor land in the segment (a rank can then
    hand an input back as a result by name); otherwise writes stay private to this process.
    """
    name, dtype, shape, nbytes = protocol.validate_descriptor(descriptor)
    path = segment_path(descriptor["segment"])
    try:
        fd = _open_segment(path, os.O_RDWR if shared else os.O_RDONLY, nbytes)
    except BaseException:
        if unlink:
            unlink_segment(descriptor["segment"])
        raise
    try:
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
    """Remove a segment if it exists. A name that is not a segment's is ignored: names come from
    untrusted headers, and cleaning up after a job must never fail."""
    if not is_segment_name(segment):
        return
    try:
        (SHM_DIR / segment).unlink()
    except OSError:  # gone already, or a directory under a segment's name: never ours to remove
        pass


def segments_of(owner_pid: int) -> set[str]:
    """The names of this user's segments named after ``owner_pid`` (a server names the segments its
    ranks create after itself, so that they outlive the rank that made them)."""
    if not SHM_DIR.is_dir():
        return set()
    return {path.name for path in SHM_DIR.glob(f"mgpu-{os.getuid()}-{owner_pid}-*") if is_segment_name(path.name)}


def unlink_created_by(pid: int) -> list[str]:
    """Unlink this user's segments that process ``pid`` created (the server at exit: its own and its
    ranks'). Returns the names removed."""
    removed = sorted(segments_of(pid))
    for name in removed:
        (SHM_DIR / name).unlink(missing_ok=True)
    return removed


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
