"""The one communication interface every parallel technique uses.

A ``Comm`` wraps a torch.distributed process group (NCCL on GPUs, gloo on CPU) and offers the few
collectives the techniques need. Keeping them behind one small class lets ``mgpu_kernels/`` supply a
faster all-to-all without touching any technique. It never creates processes or process groups of
the default world itself; ``Comm.split`` makes subgroups collectively.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist


def eager_over_gloo(collective):
    """Run ``collective`` outside any torch.compile graph when the Comm's group is gloo.

    Traced by Dynamo, torch.distributed's collectives become functional collectives inside the
    compiled graph; over gloo with CUDA tensors (ranks sharing one GPU) those crashed the ranks
    (SIGSEGV inside Inductor's code at the first exchange, torch 2.11, H200). Over gloo the
    collective is a host round trip anyway, so a graph break around it costs nothing that matters;
    NCCL groups keep their collectives inside the graph."""
    eager = torch.compiler.disable(collective)

    @functools.wraps(collective)
    def run(self, *args, **kwargs):
        if self.over_gloo and torch.compiler.is_compiling():
            return eager(self, *args, **kwargs)
        return collective(self, *args, **kwargs)

    return run


class Comm:
    """Collectives over one process group. A ``Comm`` of world size 1 needs no torch.distributed."""

    def __init__(self, group: dist.ProcessGroup | None = None, ranks: list[int] | None = None) -> None:
        self.group = group
        if group is None:
            self.rank, self.world_size = 0, 1
            self.global_ranks = [0] if ranks is None else list(ranks)
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.global_ranks = list(ranks) if ranks is not None else list(range(self.world_size))
        self._all_to_all_exchange: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
        self.over_gloo = group is not None and self.world_size > 1 and str(dist.get_backend(group)) == "gloo"

    @classmethod
    def world(cls) -> Comm:
        """The default group, or a single-rank Comm when torch.distributed is not initialised."""
        if not dist.is_available() or not dist.is_initialized():
            return cls(None)
        return cls(dist.group.WORLD, list(range(dist.get_world_size())))

    @property
    def backend(self) -> str:
        return "none" if self.group is None else str(dist.get_backend(self.group))

    def split(self, groups: list[list[int]]) -> Comm:
        """Collectively create one subgroup per list of global ranks; return the one holding this rank.

        Every rank of this Comm must call it with the same ``groups``.
        """
        if self.group is None:
            assert groups == [[0]] or groups == [self.global_ranks], groups
            return self
        me = dist.get_rank()
        mine = None
        for ranks in groups:
            group = dist.new_group(ranks=ranks)
            if me in ranks:
                mine = Comm(group, ranks)
        assert mine is not None, f"rank {me} is in none of {groups}"
        return mine

    def use_all_to_all(self, exchange: Callable[[torch.Tensor, int, int], torch.Tensor] | None) -> None:
        """Route this Comm's ``all_to_all`` through ``exchange(tensor, scatter_dim, gather_dim)``, or back
        to torch.distributed with ``None``.

        The hook through which ``mgpu_kernels/`` installs its CUDA-IPC all-to-all on one Comm (subgroups
        made by ``split`` start without one). Every rank of the group must make the same choice, or
        the ranks wait on different collectives: use ``mgpu_mgpu_kernels.install_fast_all_to_all``, which agrees
        on it collectively, rather than calling this directly.
        """
        self._all_to_all_exchange = exchange

    @eager_over_gloo
    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split ``tensor`` into world_size chunks along ``scatter_dim``, send chunk i to rank i, and
        concatenate the received chunks along ``gather_dim``."""
        if self.world_size == 1:
            return tensor
        if self._all_to_all_exchange is not None:
            return self._all_to_all_exchange(tensor, scatter_dim, gather_dim)
        return self.torch_all_to_all(tensor, scatter_dim, gather_dim)

    @eager_over_gloo
    def torch_all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """``all_to_all`` through torch.distributed, whatever exchange is installed (its fallback)."""
        if self.world_size == 1:
            return tensor
        # all_to_all_single on chunks stacked along a new first dim: gloo of torch 2.11 has no list
        # all_to_all, and both backends take the single-tensor form.
        inputs = torch.stack(tensor.chunk(self.world_size, dim=scatter_dim))
        outputs = torch.empty_like(inputs)
        dist.all_to_all_single(outputs, inputs, group=self.group)
        return torch.cat(outputs.unbind(0), dim=gather_dim)

    @eager_over_gloo
    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on all ranks) along ``dim``, in rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(outputs, tensor, group=self.group)
        return torch.cat(outputs, dim=dim)

    @eager_over_gloo
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place and return it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    @eager_over_gloo
    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor

    @eager_over_gloo
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with the one on group rank ``src``."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=self.global_ranks[src], group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
