"""torch.compile of the transformer's blocks: fused kernels for the small shards of high SP degrees.

What it is
    ``apply_compiled_blocks(model)`` replaces the ``forward`` of each of ltx-core's
    ``BasicAVTransformerBlock`` instances with ``torch.compile`` of that same forward (Inductor,
    static shapes). Every block runs the same code, so they share compiled graphs: one per input
    shape and perturbation pattern. Inductor fuses the many small element-wise kernels of a block
    (RMS norms, AdaLN shift/scale/gate, RoPE, residual adds) into a few Triton kernels; the matmuls
    and attention stay cuBLAS / SDPA. It combines with CUDA-graph replay
    (``mgpu_backend.parallel.cuda_graphs``), which removes the launch overhead this leaves.
    ``remove_compiled_blocks(model)`` undoes it. The module's parameters and state dict are untouched,
    so LoRA swaps of the weight tracker (in place) are seen by the compiled code.

When to use it, and what it costs
    Measured on one H200 at the LTX-2 19B configuration (bench/graphs.py, docs/BENCHMARKS.md), a
    batch-1 forward replayed from a CUDA graph: 1152 video tokens (a rank's shard at SP degree 8)
    91 -> 72 ms with compiled blocks, 1920 tokens 137 -> 112 ms, 6144 tokens (stage 1 at 768x512
    on one GPU) 418 -> 343 ms. The price: compile time on the first forward of each new shape in a
    process, and results that differ from the eager forward by bf16 rounding (fused kernels round
    differently), not bitwise. So it is off by default: use it on a warm fleet that runs many jobs.
    Compile time depends on the torch version: torch 2.14 traces one graph per shape and
    perturbation pattern, shared by all blocks; torch 2.11 breaks the graph at ltx-core's attention
    call and traces every block on its own (80-100 s per shape for the unperturbed forward at 19B
    on an H200, measured; a stage-1 step also runs an STG and a modality-isolated pass, each its
    own perturbation pattern, so expect a few minutes on a first job; Inductor's cache serves the
    identical graphs).

The stage-1 parallelize entry (``mgpu_backend.ltx.parallelize``) applies it when a job asks and
removes it when the stage ends. This module never edits ltx-core's source or classes (only
attributes of the model instances it is given), never imports another technique module, and never
talks to other ranks.
"""

from __future__ import annotations

import logging

import torch
from ltx_core.guidance.perturbations import BatchedPerturbationConfig, Perturbation, PerturbationConfig, PerturbationType

log = logging.getLogger(__name__)

# Each input shape and perturbation pattern is one more compiled graph of the same block code.
# Dynamo's default limits (8 per code, 256 in all) would silently send the rest back to eager.
RECOMPILE_LIMIT = 512
_COMPILED_ATTRIBUTE = "_mgpu_compiled_blocks"


def transformer_blocks(model) -> list[torch.nn.Module]:
    """The transformer blocks of an ``X0Model`` (or of its velocity model)."""
    velocity_model = getattr(model, "velocity_model", model)
    blocks = getattr(velocity_model, "transformer_blocks", None)
    if blocks is None:
        raise TypeError(f"{type(model).__name__} has no transformer_blocks; pass ltx-core's X0Model or LTXModel")
    return list(blocks)


def blocks_compiled(model) -> bool:
    return bool(vars(model).get(_COMPILED_ATTRIBUTE))


def apply_compiled_blocks(model, backend: str = "inductor") -> bool:
    """Compile each block's forward in place (idempotent). Returns True when this call compiled.

    ``backend`` is torch.compile's: ``inductor`` (the fused kernels, GPU), or ``aot_eager`` for a
    quick check that Dynamo traces the blocks (tests). Nothing is compiled until the first forward.
    """
    if blocks_compiled(model):
        return False
    blocks = transformer_blocks(model)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, RECOMPILE_LIMIT)
    for block in blocks:
        # An instance attribute shadows the class's forward for this block only; deleting it restores it.
        block.forward = _BlockForward(torch.compile(block.forward, backend=backend, dynamic=False), block.idx)
    object.__setattr__(model, _COMPILED_ATTRIBUTE, backend)
    log.info(
        "compiled blocks: %d transformer blocks set to compile with %s on their first forward of each shape",
        len(blocks),
        backend,
    )
    return True


def remove_compiled_blocks(model) -> bool:
    """Give every block back its eager forward. Returns True when something was compiled."""
    if not blocks_compiled(model):
        return False
    for block in transformer_blocks(model):
        vars(block).pop("forward", None)
    vars(model).pop(_COMPILED_ATTRIBUTE)
    log.info("compiled blocks: transformer blocks back to eager")
    return True


class _BlockForward:
    """A compiled block forward that receives the perturbations resolved for its own block.

    Two things go wrong when ltx-core's ``BatchedPerturbationConfig`` enters a compiled block as it
    is (seen with torch 2.14): Dynamo guards the structure of the config (list lengths, ``blocks``
    None or a list) but not the perturbation TYPES, so a graph traced for "skip video
    self-attention" is replayed for "skip audio self-attention" (wrong outputs); and a perturbation
    naming blocks makes it specialise on the block index (one graph per block). So each block is
    handed ``perturbations_for_block``: the same answers for this block, encoded in structure only.
    """

    def __init__(self, compiled, block_index: int) -> None:
        self.compiled, self.block_index = compiled, block_index

    def __call__(self, video, audio, perturbations: BatchedPerturbationConfig | None = None):
        if perturbations is not None:
            perturbations = perturbations_for_block(perturbations, self.block_index)
        return self.compiled(video=video, audio=audio, perturbations=perturbations)


# Never equal to a PerturbationType, so it perturbs nothing and its ``blocks`` are never read.
_FILLER = Perturbation(None, None)  # type: ignore[arg-type]


def perturbations_for_block(perturbations: BatchedPerturbationConfig, block_index: int) -> BatchedPerturbationConfig:
    """``perturbations`` as block ``block_index`` sees it, encoded so that Dynamo's guards tell every
    pattern apart: per sample, the types perturbing this block (for all blocks: ``blocks=None``, so
    the block index is never read), padded with fillers to a length that is unique to that set of
    types (Dynamo guards list lengths, not the types inside)."""
    kinds = list(PerturbationType)
    samples = []
    for sample in perturbations.perturbations:
        perturbed = [kind for kind in kinds if sample.is_perturbed(kind, block_index)]
        code = sum(1 << kinds.index(kind) for kind in perturbed)
        filler = (1 << len(kinds)) + code - len(perturbed)
        samples.append(PerturbationConfig([*(Perturbation(kind, None) for kind in perturbed), *[_FILLER] * filler]))
    return BatchedPerturbationConfig(samples)


def compile_blocks_wanted(value, device: torch.device) -> bool:
    """The ``compile_blocks`` job argument: true/false (absent: false). Only CUDA ranks compile."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"compile_blocks must be true or false, got {value!r}")
    if value and device.type != "cuda":
        log.info("compile_blocks: ranks on %s run the blocks eagerly (compiled blocks pay off on GPUs only)", device)
        return False
    return value
