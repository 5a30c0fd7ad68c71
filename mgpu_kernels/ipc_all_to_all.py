"""The CUDA-IPC all-to-all of one process group: peer receive buffers, one push kernel per exchange.

What it is: each rank of the group allocates one receive buffer on its GPU and exports it with CUDA
IPC; every peer opens it once. An exchange is one kernel launch per rank that writes the rank's
chunk for peer p straight into p's buffer, already where p's gathered output needs it, then one
device-to-device copy out of the own buffer. The ranks meet through flags in each other's memory
(system-scope release/acquire), so no host round trip or NCCL call is on the path. Against NCCL's
all-to-all it saves the packing of chunks before sending and the concatenation after receiving;
on one GPU shared by several processes (which NCCL refuses) it is the only GPU-side exchange.

What it costs: one receive buffer per rank, as large as the largest exchange so far (it grows,
collectively, when a larger exchange comes), and a host synchronisation per exchange, because
that is when a peer that never arrived is noticed and raised as ``AllToAllTimeout`` rather than
hanging the rank.

It must never be installed on some ranks of a group and not on others (``mgpu_kernels.install`` agrees
on it collectively), never talk to the other ranks except through the group's torch.distributed
calls during setup and through the peer buffers, and never return a view of its receive buffer.
"""

from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mgpu_kernels.build import KernelUnavailable

log = logging.getLogger(__name__)

_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
_BUFFER_GRANULE = 2 << 20
_logged_once: set[str] = set()


def log_once(message: str, *args) -> None:
    """Log ``message`` at info level the first time this process sees it (which path ran, and why)."""
    text = message % args if args else message
    if text not in _logged_once:
        _logged_once.add(text)
        log.info(text)


class AllToAllTimeout(RuntimeError):
    """A peer of the CUDA-IPC all-to-all did not reach the exchange in time."""


@dataclass(frozen=True)
class ExchangeLayout:
    """How one all-to-all moves a tensor, in elements: the input seen as ``[outer, world, inner]``
    (chunk i is ``[:, i, :]``), the output as ``[gather_outer, world, gather_inner]`` (the chunk from
    rank j is ``[:, j, :]``). Chunk element f sits at row ``f // inner`` of the input and row
    ``f // gather_inner`` of the output; the kernel copies it from one place to the other."""

    shape: tuple[int, ...]
    scatter_dim: int
    gather_dim: int
    world_size: int

    @classmethod
    def of(cls, shape: tuple[int, ...], scatter_dim: int, gather_dim: int, world_size: int) -> ExchangeLayout:
        """Validate the dims of an exchange of a tensor of ``shape`` over ``world_size`` ranks."""
        ndim = len(shape)
        for name, dim in (("scatter_dim", scatter_dim), ("gather_dim", gather_dim)):
            if not -ndim <= dim < ndim:
                raise ValueError(f"all-to-all {name} {dim} is out of range for a tensor of shape {tuple(shape)}")
        scatter_dim, gather_dim = scatter_dim % ndim, gather_dim % ndim
        size = shape[scatter_dim]
        if size % world_size:
            padded = -(-size // world_size) * world_size
            raise ValueError(
                f"all-to-all splits dim {scatter_dim} of shape {tuple(shape)} into {world_size} equal chunks, but "
                f"its size {size} does not divide by {world_size}; pad it to {padded}"
            )
        return cls(tuple(shape), scatter_dim, gather_dim, world_size)

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.scatter_dim] //= self.world_size
        return tuple(shape)

    @property
    def output_shape(self) -> tuple[int, ...]:
        shape = list(self.chunk_shape)
        shape[self.gather_dim] *= self.world_size
        return tuple(shape)

    @property
    def chunk_numel(self) -> int:
        return math.prod(self.chunk_shape)

    @property
    def inner(self) -> int:
        """Elements of one input row of one chunk: the chunk's part of the scatter dim and all after it."""
        return math.prod(self.chunk_shape[self.scatter_dim :])

    @property
    def gather_inner(self) -> int:
        """Elements of one output row from one source rank: the chunk's gather dim and all after it."""
        return math.prod(self.chunk_shape[self.gather_dim :])


def _check(library: ctypes.CDLL, code: int, doing: str) -> None:
    if code != 0:
        message = library.mgpu_a2a_error_string(code).decode(errors="replace")
        raise RuntimeError(f"CUDA IPC all-to-all: {doing} failed: {message} (CUDA error {code})")


class IpcAllToAll:
    """The all-to-all of one ``Comm``'s group over CUDA IPC peer buffers on ``device``.

    Construct it on every rank, then call ``connect`` on every rank (collective). Afterwards it is the
    ``exchange`` callable ``Comm.use_all_to_all`` expects: every rank calls it with tensors of the
    same shape and dtype. Tensors it cannot move (not on ``device``, larger than
    ``max_buffer_bytes``) go through ``comm.torch_all_to_all``; that choice depends only on what
    every rank shares (shape, dtype, device type), so all ranks take the same path.
    """

    def __init__(
        self,
        comm,
        library: ctypes.CDLL,
        device: torch.device,
        timeout_s: float = 30.0,
        buffer_bytes: int = 16 << 20,
        max_buffer_bytes: int = 2 << 30,
    ) -> None:
        if comm.world_size > library.mgpu_a2a_max_ranks():
            raise KernelUnavailable(
                f"the CUDA IPC all-to-all serves at most {library.mgpu_a2a_max_ranks()} ranks (one machine); "
                f"this group has {comm.world_size}"
            )
        if timeout_s <= 0:
            raise ValueError(f"the all-to-all timeout must be positive, got {timeout_s} s")
        self.comm = comm
        self.library = library
        device = torch.device(device)
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self.device_index)
        self.timeout_s = float(timeout_s)
        self.max_buffer_bytes = int(max_buffer_bytes)
        self.capacity = self._rounded(min(buffer_bytes, max_buffer_bytes))
        self.epoch = 0  # exchanges run by this group: the same on every rank, carried in the flags
        self.failure: str | None = None
        self._own_base = ctypes.c_void_p()
        self._peer_bases: list[int] = []
        self._opened: list[int] = []
        self._status_host = ctypes.POINTER(ctypes.c_int)()
        self._status_device = ctypes.POINTER(ctypes.c_int)()

    @staticmethod
    def _rounded(nbytes: int) -> int:
        return max(_BUFFER_GRANULE, -(-nbytes // _BUFFER_GRANULE) * _BUFFER_GRANULE)

    # --- setup: local steps (may fail on one rank) and the collective ones around them -------------

    def allocate(self) -> bytes:
        """Allocate this rank's flags, receive buffer and status word; return the IPC handle (local)."""
        lib = self.library
        if not self._status_host:
            _check(lib, lib.mgpu_a2a_allocate_status(
                self.device_index, ctypes.byref(self._status_host), ctypes.byref(self._status_device)
            ), "allocating the status word")
        handle = ctypes.create_string_buffer(_HANDLE_BYTES)
        _check(lib, lib.mgpu_a2a_allocate(
            self.device_index, self.capacity, ctypes.byref(self._own_base), handle
        ), f"allocating a {self.capacity >> 20} MiB receive buffer on cuda:{self.device_index}")
        return handle.raw

    def open_peers(self, handles: list[bytes]) -> None:
        """Open every peer's buffer from its handle (local; ``close_peers`` undoes a partial open)."""
        lib = self.library
        bases = []
        for peer, handle in enumerate(handles):
            if peer == self.comm.rank:
                bases.append(self._own_base.value)
                continue
            base = ctypes.c_void_p()
            _check(lib, lib.mgpu_a2a_open(self.device_index, handle, ctypes.byref(base)),
                   f"opening the receive buffer of peer {peer}")
            self._opened.append(base.value)
            bases.append(base.value)
        self._peer_bases = bases

    def close_peers(self) -> None:
        for base in self._opened:
            self.library.mgpu_a2a_close(self.device_index, base)
        self._opened, self._peer_bases = [], []

    def free_own(self) -> None:
        if self._own_base.value:
            self.library.mgpu_a2a_free(self.device_index, self._own_base)
            self._own_base = ctypes.c_void_p()

    def connect(self) -> None:
        """Collective: allocate, exchange handles with every rank of the group, open the peers."""
        handles = self._gather(self.allocate())
        self.open_peers(handles)

    def release_local(self) -> None:
        """Free the own buffer and status word (local: only once no peer maps the buffer)."""
        self.free_own()
        if self._status_host:
            self.library.mgpu_a2a_free_status(self._status_host)
            self._status_host = ctypes.POINTER(ctypes.c_int)()

    def close(self) -> None:
        """Collective: unmap the peers, wait until every rank has done so, then free the own buffer."""
        self.close_peers()
        self.comm.barrier()
        self.release_local()

    def _gather(self, value):
        gathered = [None] * self.comm.world_size
        dist.all_gather_object(gathered, value, group=self.comm.group)
        return gathered

    def _grow(self, nbytes: int) -> None:
        """Collective (every rank sees the same exchange sizes): replace every buffer with a larger one.

        A peer's buffer may only be freed once nobody maps it: unmap, meet, then free and re-open.
        """
        new_capacity = min(self._rounded(max(nbytes, 2 * self.capacity)), self._rounded(self.max_buffer_bytes))
        log.info(
            "CUDA IPC all-to-all: receive buffer %d MiB -> %d MiB for a %.1f MiB exchange",
            self.capacity >> 20, new_capacity >> 20, nbytes / 2**20,
        )
        self.close_peers()
        self.comm.barrier()
        self.free_own()
        self.capacity = new_capacity
        self.connect()

    # --- the exchange ------------------------------------------------------------------------------

    def __call__(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        if self.failure is not None:
            raise RuntimeError(
                f"the CUDA IPC all-to-all is out of service after an earlier failure ({self.failure}); "
                f"restart the fleet"
            )
        layout = ExchangeLayout.of(tuple(tensor.shape), scatter_dim, gather_dim, self.comm.world_size)
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device != self.device:
            log_once("all-to-all of %s tensors: torch.distributed (the CUDA IPC kernel serves %s)",
                     tensor.device.type, self.device)
            return self.comm.torch_all_to_all(tensor, scatter_dim, gather_dim)
        if nbytes > self.max_buffer_bytes:
            log_once("all-to-all above %d MiB: torch.distributed (the CUDA IPC buffer is capped there)",
                     self.max_buffer_bytes >> 20)
            return self.comm.torch_all_to_all(tensor, scatter_dim, gather_dim)
        if nbytes == 0:
            return tensor.new_empty(layout.output_shape)
        if nbytes > self.capacity:
            self._grow(nbytes)
        try:
            return self._exchange(tensor, layout, nbytes)
        except AllToAllTimeout as timeout:
            self.failure = str(timeout)
            raise

    def _exchange(self, tensor: torch.Tensor, layout: ExchangeLayout, nbytes: int) -> torch.Tensor:
        source = tensor.contiguous()
        if source.data_ptr() % 16:
            # A fresh allocation is aligned; alignment must not differ between ranks' kernels.
            source = source.clone()
        element = tensor.element_size()
        output = torch.empty(layout.output_shape, dtype=tensor.dtype, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        bases = (ctypes.c_ulonglong * len(self._peer_bases))(*self._peer_bases)
        self.epoch += 1
        lib = self.library
        _check(lib, lib.mgpu_a2a_launch(
            self.device_index, stream, source.data_ptr(), bases, self.comm.rank, self.comm.world_size,
            self.epoch, layout.inner * element, layout.gather_inner * element, layout.chunk_numel * element,
            int(self.timeout_s * 1e9), self._status_device,
        ), "launching the all-to-all kernel")
        _check(lib, lib.mgpu_a2a_copy_out(self.device_index, stream, output.data_ptr(), self._own_base, nbytes),
               "copying the received chunks out")
        # The one host wait per exchange: it is what turns a missing peer into an exception here.
        torch.cuda.current_stream(self.device).synchronize()
        status = self._status_host[0]
        if status:
            peer, phase = status % 256 - 1, status // 256 - 1
            raise AllToAllTimeout(
                f"all-to-all peer {peer} did not arrive within {self.timeout_s:.1f} s (rank {self.comm.rank} "
                f"waited at the {'start' if phase == 0 else 'end'} of exchange {self.epoch}); that rank has "
                f"stopped or fallen behind: look at its log, then restart the fleet"
            )
        log_once("all-to-all on cuda:%d: CUDA IPC kernel over %d ranks", self.device_index, self.comm.world_size)
        return output
