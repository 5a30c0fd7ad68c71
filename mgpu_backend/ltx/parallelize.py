"""One parallelize entry per LTX-2 stage: the techniques applied to the resident transformer in a
fixed order, one log line each, and undone when the stage ends.

The technique modules (``mgpu_backend/parallel/``) each export an ``apply_*`` (and a ``remove_*``
where the technique changes the model) and know nothing of each other; this module is the one
place that composes them, the way torchtitan's ``parallelize_*`` composes its ``apply_*``.

Weight sharding (``mgpu_backend.parallel.weight_sharding``) is not applied here: it is a residency
level, applied once when the rank builds the transformer (``TransformerWeightTracker``), over the
whole fleet, and it stays. Both entries say when the transformer they get is sharded, and hand the
techniques that give ranks unequal numbers of forwards (guidance groups, TDP tiles) its
``idle_forward``, so that every rank joins every gather. CUDA graphs are not captured from a
sharded transformer (its gathers allocate and free the block weights in every forward), nor are
its blocks compiled (not tested with FSDP's per-block hooks).

Stage 1 (``parallelize_stage1``), in this order:

1. process groups: the plan's guidance groups x SP groups (``build_stage1_groups``);
2. sequence parallel on the transformer (``apply_sequence_parallel``), when the SP degree is above 1;
3. the SP all-to-all: torch.distributed (NCCL, gloo on ranks sharing a GPU), or the CUDA-IPC kernel
   with ``MGPU_ALL_TO_ALL=ipc`` (GPUs, SP degree above 1; installed on the SP group when the group is
   created);
4. compiled blocks (``apply_compiled_blocks``), when asked for;
5. the pass runner: guidance groups (``apply_guidance_parallel``) around the runner of the group's
   own passes, which is batched passes (``apply_batched_passes``), CUDA graphs
   (``apply_cuda_graphs``) or one pass after another.

Stage 2 (``parallelize_stage2``), on a transformer that carries nothing of stage 1: the stage-2
plan's technique (``guidance_parallel.plan_stage2``), either tiled data parallel
(``apply_tiled_data_parallel``) when the job tiles, or sequence parallel over the whole fleet
(``apply_sequence_parallel``, undone when the stage ends), never both.

The exclusions, stated once (``parallelize_stage1`` / ``parallelize_stage2`` enforce them):

- batched passes or CUDA graphs, never both: ltx-core builds the per-sample perturbation masks of a
  batched forward on the host, which graph capture refuses. Both answer launch-bound shards and
  measured about equal on an H200, so batched passes win when both are asked for.
- CUDA graphs never with host-side work inside the forward: not with the CUDA-IPC all-to-all (it
  synchronises the host in every exchange), and not on a CPU rank. A conditioning attention mask
  (image-to-video) is also host-side work, but only the inputs of a call tell, so the captured
  forward runs those calls eagerly by itself.
- TDP never with SP: stage 2 splits by tiles, each tile is the whole transformer on one rank's own
  tokens, so a transformer still sequence-parallel would wait in collectives for peers that run
  other tiles. Stage 2 refuses a transformer that still carries SP (or compiled blocks).

What is undone when stage 1 ends, error or not: SP hooks, compiled block forwards, the RoPE grids
that graph capture moved to the device; the resident transformer is then exactly as ltx-core made
it, so stage 2 (or another job) starts from a clean model. What is kept between jobs, in the
``Stage1Cache`` that lives in the rank's job state: the process groups of each layout with their
all-to-all choice (creating groups is collective and slow), and the ``CapturedForward`` of the
resident transformer (its graphs replay on the next job). Applying and removing on a warm fleet
costs attribute assignments only.

This module never edits ltx-core and never talks to other ranks except through the techniques.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace

import torch

from mgpu_backend.ltx.passes import PassRunner, SequentialPassRunner
from mgpu_backend.parallel.batched_passes import apply_batched_passes
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.compiled_blocks import apply_compiled_blocks, blocks_compiled, remove_compiled_blocks, transformer_blocks
from mgpu_backend.parallel.cuda_graphs import CapturedForward, CapturingPassRunner, apply_cuda_graphs, remove_cuda_graphs
from mgpu_backend.parallel.guidance_parallel import Plan, apply_guidance_parallel, build_stage1_groups
from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel, remove_sequence_parallel, sequence_parallel_degree
from mgpu_backend.parallel.tiled_data_parallel import TileCounts, apply_tiled_data_parallel
from mgpu_backend.parallel.weight_sharding import idle_forward, weight_sharding_comm
from mgpu_kernels import CUDA_IPC, install_fast_all_to_all

log = logging.getLogger("mgpu.ltx.parallelize")

# The names the log lines give the techniques, in the order stage 1 applies them.
PROCESS_GROUPS = "process groups"
SEQUENCE_PARALLEL = "sequence parallel"
SP_ALL_TO_ALL = "SP all-to-all"
COMPILED_BLOCKS = "compiled blocks"
GUIDANCE_PARALLEL = "guidance parallel"
BATCHED_PASSES = "batched passes"
CUDA_GRAPHS = "CUDA graphs"
WEIGHT_SHARDING = "weight sharding"
STAGE1_ORDER = (WEIGHT_SHARDING, PROCESS_GROUPS, SEQUENCE_PARALLEL, SP_ALL_TO_ALL, COMPILED_BLOCKS, GUIDANCE_PARALLEL, BATCHED_PASSES, CUDA_GRAPHS)
TILED_DATA_PARALLEL = "tiled data parallel"

STAGE1_CACHE_KEY = "stage1_parallel"  # the job-state key; dropping it (unload) frees groups and graphs

JobLog = Callable[[str], None]


def _announcer(stage: str, job_log: JobLog | None) -> Callable[..., None]:
    """``say(technique, detail)``: one line to the rank's log and to the job's client log."""

    def say(technique: str, detail: str, applied: bool = True) -> None:
        line = f"{stage}: {technique}: {detail}" if applied else f"{stage}: {technique} not applied: {detail}"
        log.info(line)
        if job_log is not None:
            job_log(line)

    return say


def left_on_transformer(transformer) -> list[str]:
    """The techniques that changed ``transformer`` in place and are still on it (empty: clean)."""
    left = []
    if sequence_parallel_degree(transformer) > 1:
        left.append(SEQUENCE_PARALLEL)
    if blocks_compiled(transformer):
        left.append(COMPILED_BLOCKS)
    return left


def _require_clean(transformer, stage: str, why: str) -> None:
    left = left_on_transformer(transformer)
    if left:
        raise RuntimeError(
            f"{stage} got the resident transformer with {', '.join(left)} still applied ({why}); an earlier stage "
            "did not undo its techniques, which is a bug: unload the model (or restart the fleet) and report it"
        )


# -- stage 1 -------------------------------------------------------------------------------------------


def sp_all_to_all(sp_comm: Comm, device: torch.device) -> str:
    """Which all-to-all the SP exchange uses on GPUs: torch.distributed over the group's own backend
    (NCCL; gloo where ranks share a GPU) unless ``MGPU_ALL_TO_ALL=ipc``.

    The CUDA-IPC kernel is exact, but across two H200s it moved 16 MiB at 150 GB/s against NCCL's
    159 GB/s (docs/BENCHMARKS.md) and it synchronises the host once per exchange, so NCCL stays
    the default until multi-GPU measurements show sizes where the kernel wins.
    """
    if os.environ.get("MGPU_ALL_TO_ALL", "").strip().lower() != "ipc":
        return f"torch.distributed ({sp_comm.backend.upper()}; MGPU_ALL_TO_ALL=ipc selects the CUDA-IPC kernel)"
    return install_fast_all_to_all(sp_comm, device)  # collective; falls back to torch.distributed by itself


@dataclass(frozen=True)
class Stage1Options:
    """The single-rank speed-ups a stage-1 job asked for (already resolved: no "auto" left)."""

    cuda_graphs: bool = False
    batch_passes: bool = False
    compile_blocks: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend; tests use "aot_eager" on CPU


@dataclass
class _Groups:
    sp_comm: Comm
    all_to_all: str | None  # what the SP exchange runs on (GPUs at SP degree above 1), else None


class Stage1Cache:
    """What stage 1 keeps between jobs on one rank: the process groups of each layout (with the
    all-to-all installed on them) and the ``CapturedForward`` of the resident transformer."""

    def __init__(self) -> None:
        self.groups: dict[tuple[int, int], _Groups] = {}
        self._captured: CapturedForward | None = None

    def captured_forward(self, transformer) -> CapturedForward:
        """The captured forward of ``transformer``, kept so its graphs replay in later jobs; the graphs
        of a transformer that is no longer the one asked for are freed."""
        if self._captured is not None and self._captured.model is not transformer:
            self.release_graphs()
        if self._captured is None:
            self._captured = CapturedForward(transformer)
        return self._captured

    def release_graphs(self) -> int:
        """Free the captured graphs and their memory pool; returns how many graphs were held."""
        held = 0
        if self._captured is not None:
            held = len(self._captured.graphs)
            self._captured.release()
            self._captured = None
        return held


def stage1_cache(state: dict) -> Stage1Cache:
    """The ``Stage1Cache`` of a rank's job state (made on first use)."""
    cache = state.get(STAGE1_CACHE_KEY)
    if not isinstance(cache, Stage1Cache):
        cache = state[STAGE1_CACHE_KEY] = Stage1Cache()
    return cache


@dataclass
class Stage1Parallel:
    """What ``parallelize_stage1`` gives the stage-1 loop: the pass runner, and what it applied."""

    plan: Plan
    options: Stage1Options
    runner: PassRunner
    applied: list[str] = field(default_factory=list)  # technique names, in the order applied
    graphs: CapturingPassRunner | None = None

    def fields(self) -> dict:
        """The job result's fields about the parallel layout and the speed-ups."""
        fields = {
            "plan": self.plan.reason,
            "sp_degree": self.plan.sp_degree,
            "guidance_groups": self.plan.guidance_groups,
            "batch_passes": self.options.batch_passes,
            "compile_blocks": self.options.compile_blocks,
        }
        if self.graphs is not None:
            fields["cuda_graphs"] = self.graphs.summary()
        return fields


def _groups_for(plan: Plan, comm: Comm, device: torch.device, cache: Stage1Cache) -> tuple[_Groups, bool]:
    layout = (plan.guidance_groups, plan.sp_degree)
    groups = cache.groups.get(layout)
    if groups is not None:
        return groups, False
    sp_comm = build_stage1_groups(comm, plan)  # collective
    all_to_all = sp_all_to_all(sp_comm, device) if device.type == "cuda" and sp_comm.world_size > 1 else None
    groups = cache.groups[layout] = _Groups(sp_comm, all_to_all)
    return groups, True


def _sharding_line(transformer) -> str | None:
    """The log line of a transformer whose weights are sharded (the loader sharded it once), or None."""
    comm = weight_sharding_comm(transformer)
    if comm is None:
        return None
    return (f"weights sharded over all {comm.world_size} ranks {comm.global_ranks} (residency 'sharded'), each block "
            "gathered before it runs with the next one prefetched; ranks with fewer passes or tiles join the gathers idle")  # fmt: skip


def _why_no_cuda_graphs(options: Stage1Options, device: torch.device, groups: _Groups, transformer=None) -> str | None:
    """Why CUDA graphs asked for cannot be applied (the exclusions of the module docstring), or None."""
    if transformer is not None and weight_sharding_comm(transformer) is not None:
        return "the transformer's weights are sharded: its gathers allocate and free the block weights in every forward"
    if options.batch_passes:
        return "the passes run batched, and a batched forward builds its perturbation masks on the host"
    if device.type != "cuda":
        return f"the ranks run on {device.type}; CUDA graphs need CUDA devices"
    if groups.sp_comm.world_size > 1 and groups.sp_comm.backend == "gloo":
        return "the SP group runs over gloo (ranks sharing a GPU), whose host-side collectives a CUDA graph cannot hold"
    if groups.all_to_all == CUDA_IPC:
        return (
            "the SP group uses the CUDA-IPC all-to-all (MGPU_ALL_TO_ALL=ipc), which synchronises the host in every "
            "exchange; unset MGPU_ALL_TO_ALL to capture with NCCL"
        )
    return None


@contextmanager
def parallelize_stage1(
    transformer,
    plan: Plan,
    comm: Comm,
    device: torch.device,
    options: Stage1Options,
    cache: Stage1Cache,
    job_log: JobLog | None = None,
) -> Iterator[Stage1Parallel]:
    """Apply stage 1's techniques to ``transformer`` in the module's order; undo them on exit.

    Collective: every rank of ``comm`` enters together with the same plan and options. Yields the
    ``Stage1Parallel`` whose ``runner`` the stage-1 loop runs its passes with. ``job_log`` receives
    the plan line and one line per technique (``stage 1: <technique>: ...``).
    """
    if comm.world_size != plan.world_size:
        raise ValueError(f"the stage-1 plan is for {plan.world_size} ranks but the fleet has {comm.world_size}")
    _require_clean(transformer, "stage 1", "stage 1 applies them itself, for its own plan")
    say = _announcer("stage 1", job_log)
    log.info(plan.reason)
    if job_log is not None:
        job_log(plan.reason)
    applied: list[str] = []

    def applying(technique: str, detail: str) -> None:
        applied.append(technique)
        say(technique, detail)

    with ExitStack() as undo:
        sharding = _sharding_line(transformer)
        if sharding is not None:
            applying(WEIGHT_SHARDING, sharding)
            if options.compile_blocks:  # not tested: FSDP's per-block hooks around compiled forwards
                say(COMPILED_BLOCKS, "the transformer's weights are sharded; compiled blocks are not run sharded", applied=False)
                options = replace(options, compile_blocks=False)
        groups, created = _groups_for(plan, comm, device, cache)
        sp_comm = groups.sp_comm
        layout = ", ".join(str(ranks) for ranks in plan.rank_groups)
        applying(PROCESS_GROUPS, f"{plan.guidance_groups} guidance group(s) x SP degree {plan.sp_degree}: ranks {layout} "
                                 f"({'created' if created else 'kept from an earlier job'})")  # fmt: skip

        if sp_comm.world_size > 1:
            apply_sequence_parallel(transformer, sp_comm)
            undo.callback(remove_sequence_parallel, transformer)
            applying(SEQUENCE_PARALLEL, f"video tokens split {plan.sp_degree} ways, about "
                                        f"{-(-plan.video_tokens // plan.sp_degree)} per rank, all-to-all around attention")  # fmt: skip
        if groups.all_to_all is not None:
            applying(SP_ALL_TO_ALL, groups.all_to_all)

        if options.compile_blocks:
            apply_compiled_blocks(transformer, options.compile_backend)
            undo.callback(remove_compiled_blocks, transformer)
            applying(COMPILED_BLOCKS, f"{len(transformer_blocks(transformer))} transformer blocks through torch.compile "
                                      f"({options.compile_backend}), compiled on their first forward of each shape")  # fmt: skip

        # The runner of this rank's (its group's) own passes; guidance groups go around it.
        local_runner: PassRunner = SequentialPassRunner()
        graphs = None
        no_graphs = _why_no_cuda_graphs(options, device, groups, transformer) if options.cuda_graphs else None
        if options.batch_passes:
            local_runner = apply_batched_passes(local_runner)
        elif options.cuda_graphs and no_graphs is None:
            # A graph bakes in the SP group's collectives and the compiled kernels: those name the variant.
            variant = (sp_comm if sp_comm.world_size > 1 else None, options.compile_backend if options.compile_blocks else None)
            graphs = apply_cuda_graphs(local_runner, cache.captured_forward(transformer), variant=variant, group=sp_comm)
            undo.callback(remove_cuda_graphs, transformer)
            local_runner = graphs
        runner = apply_guidance_parallel(comm, plan, local_runner, idle_forward if sharding is not None else None)

        if plan.guidance_groups > 1:
            applying(GUIDANCE_PARALLEL, f"each step's passes round-robin over {plan.guidance_groups} groups, "
                                        "outputs exchanged once per step")  # fmt: skip
        if options.batch_passes:
            applying(BATCHED_PASSES, "each group's passes of a step as one batched forward")
        if graphs is not None:
            captured = graphs.captured
            applying(CUDA_GRAPHS, f"forwards replayed from graphs captured once per input shape ({len(captured.graphs)} "
                                  "graph(s) already held)")  # fmt: skip
        elif no_graphs is not None:
            say(CUDA_GRAPHS, no_graphs, applied=False)

        yield Stage1Parallel(plan, options, runner, applied, graphs)
    undone = [name for name in (SEQUENCE_PARALLEL, COMPILED_BLOCKS) if name in applied]
    if undone:
        log.info("stage 1: undone on the transformer: %s", ", ".join(undone))


# -- stage 2 -------------------------------------------------------------------------------------------


@contextmanager
def parallelize_stage2(
    transformer,
    comm: Comm,
    tiling: TileCounts | None,
    video_grid: tuple[int, int, int],
    job_log: JobLog | None = None,
    sequence_parallel: bool = False,
) -> Iterator[Callable | None]:
    """Apply stage 2's technique: tiled data parallel over ``comm`` when ``tiling`` is given, or
    sequence parallel over all of ``comm`` with ``sequence_parallel`` (then ``tiling`` must be None).

    Yields the ``transformer_wrapper`` for ``refine_stage2`` (None when untiled or SP: the model
    itself runs). ``transformer`` must carry nothing of stage 1 (TDP never with SP, see the module
    docstring). TDP wraps the model without changing it, so there is nothing to undo; SP is removed
    when the stage ends, error or not.
    """
    _require_clean(transformer, "stage 2", "stage 2 applies TDP or SP itself: each TDP tile is the whole transformer on one rank")
    say = _announcer("stage 2", job_log)
    sharding = _sharding_line(transformer)
    if sharding is not None:
        say(WEIGHT_SHARDING, sharding)
    if sequence_parallel:
        if tiling is not None:
            raise ValueError("stage 2 runs tiled data parallel or sequence parallel, not both; drop the tiling for SP")
        if comm.world_size == 1:
            say(SEQUENCE_PARALLEL, "one rank runs the whole latent", applied=False)
            yield None
            return
        apply_sequence_parallel(transformer, comm)
        try:
            say(SEQUENCE_PARALLEL, f"video tokens split {comm.world_size} ways, about "
                                   f"{-(-math.prod(video_grid) // comm.world_size)} per rank, all-to-all around attention")  # fmt: skip
            yield None
        finally:
            remove_sequence_parallel(transformer)
            log.info("stage 2: undone on the transformer: %s", SEQUENCE_PARALLEL)
        return
    if tiling is None:
        say(TILED_DATA_PARALLEL, "untiled, every rank runs the whole latent", applied=False)
        yield None
        return
    tiled = apply_tiled_data_parallel(transformer, comm, tiling, video_grid, idle_forward=idle_forward if sharding is not None else None)
    grid = "x".join(map(str, video_grid))
    say(TILED_DATA_PARALLEL, f"{tiling.describe()} = {tiled.plan.num_tiles} tiles of the {grid} latent, "
                             f"round-robin over {comm.world_size} ranks")  # fmt: skip

    def wrapper(model):
        if model is not transformer:
            raise RuntimeError("stage 2 was parallelized for another transformer than the one it runs")
        return tiled

    yield wrapper
