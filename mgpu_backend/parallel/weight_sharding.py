"""Weight sharding for ltx-core's LTX-2 transformer: each rank holds 1/N of it, gathered block by block.

What it is
    The transformer's blocks (and, as one more unit, the parameters outside the blocks: patchify
    projections, AdaLN, output projections) are sharded over the ranks with PyTorch's FSDP2
    (``torch.distributed.fsdp.fully_shard``): every parameter is cut along its first dimension into N
    shards, one per rank. Before a block runs, its parameters are all-gathered into full tensors;
    after it, they are freed again (``reshard_after_forward``). While block i computes, the
    all-gather of block i+1 is already under way (``set_modules_to_forward_prefetch``), so at most
    two gathered blocks exist at a time. Gathering copies the exact bytes, so a sharded forward
    computes bitwise what the unsharded forward computes: same kernels, same weights.

Which ranks shard
    The weights are sharded over the WHOLE fleet (every rank of the ``Comm`` given, normally the
    world), on a process group of their own. Sequence parallel and guidance groups are applied on
    top, unchanged: an SP group's ranks each compute their token shard with the gathered weights,
    and guidance groups each compute their own pass with them. Sharding over the SP group only
    would keep a full copy per guidance group (memory / SP degree instead of / world size), and
    stage 2 (tiled data parallel or SP over the whole fleet) uses another layout than stage 1, so
    only the world is common to every stage.

    The price: a gather is collective over the whole fleet, so every rank must run the same number
    of forwards. Techniques that hand ranks unequal work (guidance groups when the groups do not
    divide the passes of a step, tiled data parallel when the ranks do not divide the tiles) take an
    ``idle_forward`` callback; the parallelize entry hands them ``idle_forward`` of this module,
    which joins the gathers of one forward without computing anything.

When to use it
    When the transformer does not fit one GPU beside the activations (LTX-2.3 22B: 44 GB in bf16,
    ~23 GB fp8-cast, against 24-32 GB consumer cards). It is a memory tool, not a speed tool: each
    forward moves (N-1)/N of the transformer's bytes into every rank. Costs: see docs/techniques.md
    (bytes gathered per forward and per step, and what that means over PCIe and NVLink).

What it must never do
    Edit or fork ltx-core, import ltx-pipelines, or change the numbers: ``apply_weight_sharding``
    keeps every dtype (bf16, the fp8 bytes of fp8-cast weights and their scales) and no mixed
    precision policy. Removing it is not supported: the full weights no longer exist anywhere.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from mgpu_backend.parallel.comm import Comm

log = logging.getLogger(__name__)

_STATE_ATTRIBUTE = "_mgpu_weight_sharding"
GATHERED_BLOCKS = 4
"""Full block-sized buffers a rank holds at its peak: the computing block's weights, and the
prefetched block's all-gather buffer and weights (FSDP copies out of the buffer into the weights)
with the computing block's buffer not yet freed. Measured: the 22B sharded over 4 and 2 ranks on an
H200 peaked 1.4 GiB (two 22B blocks) above shard + two blocks + activations (docs/BENCHMARKS.md)."""


class _ShardingState:
    def __init__(self, comm: Comm, units: list) -> None:  # FSDP2 modules (fully_shard's)
        self.comm = comm
        self.units = units  # FSDP units in the order a forward gathers them: the root, then each block


def _velocity_model(model: torch.nn.Module) -> torch.nn.Module:
    """The LTXModel inside ``model`` (itself, or the ``velocity_model`` of an X0 wrapper)."""
    inner = getattr(model, "velocity_model", model)
    if not hasattr(inner, "transformer_blocks"):
        raise TypeError(f"weight sharding applies to ltx-core's LTXModel or an X0Model around it; got {type(model).__name__}")
    return inner


def _state(model: torch.nn.Module) -> _ShardingState | None:
    inner = getattr(model, "velocity_model", model)
    return getattr(inner, _STATE_ATTRIBUTE, None)


def weight_sharding_comm(model: torch.nn.Module) -> Comm | None:
    """The Comm whose ranks share ``model``'s weights, or None when it is not sharded."""
    state = _state(model)
    return None if state is None else state.comm


def block_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(largest block, everything outside the blocks) in bytes as full tensors: what a rank holds
    gathered at once besides its shards is ``GATHERED_BLOCKS`` x the first plus the second."""
    velocity = _velocity_model(model)

    def full_bytes(tensors) -> int:
        return sum(math.prod(t.shape) * t.element_size() for t in tensors)

    blocks = [full_bytes(block.parameters()) for block in velocity.transformer_blocks]
    in_blocks = {id(p) for block in velocity.transformer_blocks for p in block.parameters()}
    outside = full_bytes(p for p in velocity.parameters() if id(p) not in in_blocks)
    return max(blocks, default=0), outside


def sharding_mesh(comm: Comm, device: torch.device | str):
    """The device mesh the weights are sharded on: a process group of its own over ``comm``'s ranks,
    so that their gathers never queue behind the SP all-to-alls or the guidance exchange of the same
    ranks. Collective over the world (every rank calls it, even for a subgroup's Comm)."""
    group = dist.new_group(ranks=comm.global_ranks)
    # FSDP2 and DTensor are imported only where weights are sharded: importing them changes how a gloo
    # collective fails when a peer destroys its groups (a job error on one rank then read as a hang).
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, torch.device(device).type)


def apply_weight_sharding(model: torch.nn.Module, comm: Comm, device: torch.device | str, mesh=None) -> torch.nn.Module:
    """Shard ``model``'s (X0Model or LTXModel) weights over the ranks of ``comm`` and move them to
    ``device`` (each block as it is sharded, so a model built in host memory never sits whole on the
    device; a model built on the meta device stays there, for ``to_empty`` and an initialisation). Collective: every rank of ``comm`` calls it with the same model layout. Afterwards every
    rank must run every forward (or ``idle_forward``) together. Returns ``model``.

    The weights are sharded on ``mesh`` (``sharding_mesh(comm, device)``, made here when not given:
    then the call is collective). Given a mesh, sharding itself talks to no other rank, so ranks may
    shard one after another (the weight tracker builds in turns when host memory holds fewer whole
    transformers than there are ranks).
    """
    velocity = _velocity_model(model)
    if _state(model) is not None:
        raise RuntimeError("the transformer's weights are sharded already; a model is sharded once, when it is built")
    if comm.world_size < 2:
        raise ValueError("weight sharding needs at least 2 ranks; one rank holds the whole transformer (residency 'all' or 'minimal')")
    device = torch.device(device)
    mesh = sharding_mesh(comm, device) if mesh is None else mesh
    from torch.distributed.fsdp import fully_shard
    blocks = list(velocity.transformer_blocks)
    # Only the velocity model's own parameters (not a wrapper's) are ever moved; buffers (the RoPE
    # tables, fp8 scales) stay whole on every rank, as FSDP keeps them.
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Inference only: FSDP asks trainable parameters for one dtype per block, and fp8-cast blocks
    # hold float8 weights beside bfloat16 biases and norms.
    velocity.requires_grad_(False)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(velocity, mesh=mesh, reshard_after_forward=True)
    # The gathers overlap the compute of the block before: the root prefetches block 0 while it
    # embeds the inputs, each block the next one.
    chain = [velocity, *blocks]
    for current, following in zip(chain, chain[1:]):
        current.set_modules_to_forward_prefetch([following])
    setattr(velocity, _STATE_ATTRIBUTE, _ShardingState(comm, chain))
    largest, outside = block_bytes(model)
    local = sum(_local(p).nbytes for p in velocity.parameters())
    log.info(
        "weight sharding: %d blocks + the rest sharded over %d ranks %s; %.1f MB of weights on this rank, each block "
        "gathered before it runs (the next one prefetched, at most about %.1f MB of gathered weights and buffers at once)",
        len(blocks), comm.world_size, comm.global_ranks, local / 1e6, (GATHERED_BLOCKS * largest + outside) / 1e6,
    )  # fmt: skip
    return model


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def local_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The velocity model's state dict as this rank holds it: a sharded parameter's local shard
    (a tensor sharing its storage: writing into it changes the weights), buffers whole."""
    velocity = _velocity_model(model)
    return {key: _local(tensor.detach()) for key, tensor in velocity.state_dict(keep_vars=True).items()}


def full_tensor(model: torch.nn.Module, key: str) -> torch.Tensor:
    """The full value of ``key`` of the velocity model: gathered when sharded (collective: every rank
    asks for the same keys in the same order), itself otherwise."""
    tensor = _velocity_model(model).state_dict(keep_vars=True)[key].detach()
    if not _is_dtensor(tensor):
        return tensor
    return gather_rows(tensor.to_local(), tuple(tensor.shape), weight_sharding_comm(model))


def gather_rows(local: torch.Tensor, shape: tuple[int, ...], comm: Comm) -> torch.Tensor:
    """The full tensor of ``shape`` from every rank's ``local`` rows (``torch.chunk`` over the first
    dimension, as the parameters are sharded; a rank past the last chunk holds none), in one eager
    all-gather of ``comm``. DTensor's own ``full_tensor`` goes through functional collectives, which
    crash (SIGSEGV) on CUDA tensors over gloo, as on ranks sharing a GPU; this works on every backend.
    The rows travel as bytes, so float8 weights gather as they are."""
    counts = [len(chunk) for chunk in torch.chunk(torch.empty(shape[0], device="meta"), comm.world_size)]
    counts += [0] * (comm.world_size - len(counts))
    most = max(counts)
    padded = local.new_zeros((most, *shape[1:]))
    padded[: local.shape[0]] = local
    gathered = comm.all_gather(padded.reshape(most, -1).view(torch.uint8), dim=0)
    gathered = gathered.view(local.dtype).reshape(comm.world_size, most, *shape[1:])
    return torch.cat([gathered[rank, :count] for rank, count in enumerate(counts)])


def shard_rows(model: torch.nn.Module, key: str, value: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``value`` (a full tensor of ``key``), cut as the key's parameter is sharded
    (``torch.chunk`` over the first dimension; a rank past the last chunk holds none)."""
    tensor = _velocity_model(model).state_dict(keep_vars=True)[key]
    if not _is_dtensor(tensor):
        return value
    comm = weight_sharding_comm(model)
    chunks = torch.chunk(value, comm.world_size, dim=0)
    return chunks[comm.rank] if comm.rank < len(chunks) else value[:0]


def idle_forward(model: torch.nn.Module) -> None:
    """Join the weight gathers of one forward without computing: what a rank with no pass (or tile)
    left in a round runs while the others compute, so that every rank issues the same gathers in
    the same order. A no-op for a model whose weights are not sharded."""
    state = _state(model)
    if state is None:
        return
    for unit in state.units:
        unit.unshard()
        unit.reshard()


def _is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a sharded parameter), told by its type so that nothing of
    torch's DTensor package is imported where no weight is sharded."""
    return type(tensor).__name__ == "DTensor" and type(tensor).__module__.startswith("torch.distributed.tensor")
