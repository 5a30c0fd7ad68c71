"""Guidance parallelism for LTX-2 stage 1: the guidance passes of a step on separate rank groups.

What it is: a stage-1 step calls the transformer up to four times (conditional, unconditional,
STG-perturbed, modality-isolated), each a batch-1 forward on the same latents. Those calls are
independent, so the world is cut into ``guidance_groups`` groups of ``sp_degree`` ranks
(world = groups x SP degree); each group runs its share of the passes, sequence-parallel inside the
group, and only the pass outputs are exchanged, so every rank returns every output, in order, equal
to running them one after another. This is not in the official LTX-2 multi-GPU code; it is this
project's addition (DESIGN.md section 6).

When to use it: when a step runs several passes and the world is large enough that SP shards get
small. SP shards below ~1500 video tokens are launch-bound (they stop getting faster), and SP pays
an all-to-all in every block, while guidance groups exchange only the outputs once per step.
What it costs: one tiny all-reduce (output shapes) and one all-reduce of all outputs per step
(stage-1 latents are a few MB); a pass count that the groups do not divide leaves some groups idle
for part of the step. Every rank still holds the full weights.

``plan_stage1`` picks groups x SP degree from the world size, the video token count and the active
passes; ``build_stage1_groups`` creates the subgroups (collectively, once per plan) and returns the
SP group to apply ``apply_sequence_parallel`` with; ``apply_guidance_parallel`` gives the pass
runner for the stage-1 loop, around any runner of the group's own passes (sequential, batched,
replayed from CUDA graphs). Passes are assigned to groups per step, so the set of active passes may
change between steps. A step of one pass (the distilled recipe: no guidance) leaves nothing to
split, so the plan is SP over the whole fleet and its reason line says why.

``plan_stage2`` is the planner's other half: stage 2 (one pass per step in both recipes) runs
sequence parallel or tiled data parallel, by a small rule on the tokens per rank (``Stage2Plan``
says which, why, and whether the stage's audio is used). The stage-1 parallelize entry (``mgpu_backend.ltx.parallelize``) composes
these with the other techniques. This module must never import ``ltx_pipelines`` nor talk to other
ranks except through ``Comm``, and knows nothing of the runner it is given.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mgpu_backend.ltx.passes import PASS_NAMES, GuidancePass, PassRunner, SequentialPassRunner
from mgpu_backend.ltx.recipes import recipe
from mgpu_backend.ltx.schema import PARALLEL_PLANS, STAGE2_PLANS
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.sequence_parallel import check_sp_degree, valid_sp_degrees

log = logging.getLogger(__name__)

PLAN_MODES = PARALLEL_PLANS  # the requests' stage-1 plans
GUIDANCE_GROUP_MODES = ("guidance", "hybrid")
"""The modes that split the world into guidance groups: nothing to split when a step runs one pass."""
ONE_PASS_NO_GROUPS = "guidance groups do not apply: one pass per step (no guidance), so every group but one would idle"

# Per-rank video tokens below which a shard stops getting faster: the kernels of a forward are
# launch-bound rather than compute-bound there. ~1500 is the project's planning figure for
# H100/H200-class GPUs in bf16, not a measurement made here; re-tune both numbers from bench/.
LAUNCH_BOUND_SHARD_TOKENS = 1500
# Estimated extra time of a pass per doubling of the SP degree, for its all-to-alls (NVLink).
SP_EXCHANGE_OVERHEAD_PER_DOUBLING = 0.05


@dataclass(frozen=True)
class Plan:
    """How stage 1 spreads over ``world_size`` ranks: ``guidance_groups`` x ``sp_degree``.

    Group ``g`` holds the contiguous ranks ``g * sp_degree ... g * sp_degree + sp_degree - 1``
    (neighbouring GPUs, which usually share the fastest links, do the chatty SP exchange).
    """

    mode: str
    world_size: int
    guidance_groups: int
    sp_degree: int
    video_tokens: int
    planned_passes: int
    reason: str

    @property
    def rank_groups(self) -> list[list[int]]:
        return [
            list(range(group * self.sp_degree, (group + 1) * self.sp_degree)) for group in range(self.guidance_groups)
        ]

    def group_of(self, rank: int) -> int:
        return rank // self.sp_degree

    def assign_passes(self, pass_count: int) -> list[int]:
        """The group that runs each of ``pass_count`` passes: round-robin, so no group runs more
        than one pass above another (3 passes on 2 groups: groups 0, 1, 0)."""
        return [index % self.guidance_groups for index in range(pass_count)]


def _pass_count(active_passes: int | Sequence[str]) -> int:
    if isinstance(active_passes, int):
        count = active_passes
    else:
        unknown = [name for name in active_passes if name not in PASS_NAMES]
        if unknown:
            raise ValueError(f"unknown guidance passes {unknown}; use names from {list(PASS_NAMES)}")
        count = len(active_passes)
    if not 1 <= count <= len(PASS_NAMES):
        raise ValueError(f"a stage-1 step runs 1 to {len(PASS_NAMES)} guidance passes, got {count}")
    return count


def _choices(values) -> str:
    return ", ".join(str(value) for value in sorted(values))


def _counted(count: int, noun: str, plural: str | None = None) -> str:
    """``1 rank``, ``2 ranks``: the reasons are read by people."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def estimated_step_cost(video_tokens: int, pass_count: int, guidance_groups: int, sp_degree: int) -> float:
    """Relative time of one step (in 'video tokens of work on one rank'): rounds of passes per
    group x the time of one pass on an SP shard, which stops shrinking at the launch-bound size and
    pays a little for each doubling of the SP degree."""
    rounds = math.ceil(pass_count / guidance_groups)
    shard_work = max(video_tokens / sp_degree, LAUNCH_BOUND_SHARD_TOKENS)
    return rounds * shard_work * (1 + SP_EXCHANGE_OVERHEAD_PER_DOUBLING * math.log2(sp_degree))


def plan_stage1(
    world_size: int,
    video_tokens: int,
    active_passes: int | Sequence[str],
    mode: str = "auto",
    *,
    attention_heads: int = 32,
    audio_attention_heads: int | None = 32,
) -> Plan:
    """Choose guidance groups x SP degree for stage 1.

    ``active_passes`` is the largest set of passes a step will run (names from ``PASS_NAMES``, or a
    count); steps that run fewer simply leave groups idle. Modes: ``sp`` = all ranks one SP group;
    ``guidance`` = one group per pass as far as the world allows (the fewest groups that give every
    pass its own group, SP inside each); ``hybrid`` = several groups of several ranks; ``auto`` =
    the cheapest by ``estimated_step_cost`` (ties go to the smaller SP degree), one group when a step
    runs one pass.
    """
    if mode not in PLAN_MODES:
        raise ValueError(f"stage-1 parallel mode must be one of {', '.join(PLAN_MODES)}, got {mode!r}")
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if video_tokens < 1:
        raise ValueError(f"video token count must be at least 1, got {video_tokens}")
    pass_count = _pass_count(active_passes)
    sp_choices = set(valid_sp_degrees(attention_heads, audio_attention_heads))
    # Every split of the world into equal groups whose size is a usable SP degree.
    layouts = [
        (world_size // sp_degree, sp_degree)
        for sp_degree in range(1, world_size + 1)
        if world_size % sp_degree == 0 and sp_degree in sp_choices
    ]

    def cost(layout: tuple[int, int]) -> float:
        return estimated_step_cost(video_tokens, pass_count, *layout)

    def by_cost(layout: tuple[int, int]) -> tuple[float, int]:
        return cost(layout), layout[1]

    if mode == "sp":
        check_sp_degree(world_size, attention_heads, audio_attention_heads)
        chosen = (1, world_size)
        why = f"all {_counted(world_size, 'rank')} in one SP group"
    elif mode == "guidance":
        own_group_each = [layout for layout in layouts if layout[0] >= pass_count]
        chosen = min(own_group_each) if own_group_each else max(layouts)
        why = (
            f"one group per pass ({chosen[0] - pass_count} idle)"
            if chosen[0] >= pass_count
            else f"fewer ranks ({world_size}) than passes: {chosen[0]} groups take turns"
        )
    elif mode == "hybrid":
        hybrid = [layout for layout in layouts if layout[0] > 1 and layout[1] > 1]
        if not hybrid:
            raise ValueError(
                f"hybrid mode needs at least 2 groups of at least 2 ranks; world size {world_size} cannot be "
                f"split that way (with SP degrees {_choices(sp_choices)}); use mode sp or guidance"
            )
        chosen = min(hybrid, key=by_cost)
        why = "cheapest split with both groups and SP"
    else:
        # One pass per step leaves nothing for a second group: only one group would ever work.
        one_group = [layout for layout in layouts if layout[0] == 1]
        candidates = one_group if pass_count == 1 and one_group else layouts
        chosen = min(candidates, key=by_cost)
        runner_up = sorted((layout for layout in candidates if layout != chosen), key=by_cost)[:1]
        why = "estimated cheapest"
        if runner_up:
            other = runner_up[0]
            why += f"; next {other[0]} groups x SP {other[1]} at {cost(other) / cost(chosen):.2f}x"
    guidance_groups, sp_degree = chosen
    if pass_count == 1 and mode != "guidance":
        why += f"; {ONE_PASS_NO_GROUPS}"
    shard_tokens = math.ceil(video_tokens / sp_degree)
    launch_bound = sp_degree > 1 and shard_tokens < LAUNCH_BOUND_SHARD_TOKENS
    launch_note = f" (below the launch-bound ~{LAUNCH_BOUND_SHARD_TOKENS})" if launch_bound else ""
    reason = (
        f"stage-1 plan ({mode}): {guidance_groups} guidance groups x SP degree {sp_degree} on {_counted(world_size, 'rank')} for "
        f"{_counted(pass_count, 'pass', 'passes')} and {video_tokens} video tokens, {shard_tokens} tokens per shard{launch_note}; {why}"
    )
    return Plan(mode, world_size, guidance_groups, sp_degree, video_tokens, pass_count, reason)


STAGE2_MODES = STAGE2_PLANS
# Stage 2 runs SP while each rank's share of the video tokens stays at or above this size; below it
# SP shards are launch-bound (they stop getting faster) and still pay an all-to-all in every block,
# while TDP tiles exchange once per step. The stage-1 planning figure, not a stage-2 measurement:
# re-tune it from bench/ once multi-GPU numbers of both techniques exist.
STAGE2_SP_MIN_SHARD_TOKENS = LAUNCH_BOUND_SHARD_TOKENS


@dataclass(frozen=True)
class Stage2Plan:
    """How stage 2 spreads over ``world_size`` ranks: ``technique`` "sp" (sequence parallel over the
    whole fleet at ``sp_degree``; ``sp_degree`` 1 is one rank running the whole latent) or "tdp"
    (tiled data parallel: each tile the whole transformer on one rank)."""

    mode: str
    world_size: int
    technique: str
    sp_degree: int
    video_tokens: int
    reason: str

    @property
    def denoises_audio(self) -> bool:
        """Whether stage 2's audio output is used: under SP every rank sees the whole video and audio,
        so the re-denoised audio is the official one; a TDP tile's audio saw one tile only."""
        return self.technique == "sp"


def plan_stage2(
    world_size: int,
    video_tokens: int,
    pipeline: str,
    mode: str = "auto",
    *,
    tiles_given: bool = False,
    attention_heads: int = 32,
    audio_attention_heads: int | None = 32,
    guiding_latents: int = 0,
) -> Stage2Plan:
    """Choose sequence parallel or tiled data parallel for stage 2.

    ``auto`` follows the recipe's ``stage2_policy``: ``tdp`` (two-stage) keeps its TDP Upscale (the
    graph's upscaler, audio frozen); ``sp`` (HQ) takes SP wherever the world is a usable SP degree;
    ``planned`` (distilled, whose stage 2 is part of the recipe) takes SP when the shards per rank stay at
    or above ``STAGE2_SP_MIN_SHARD_TOKENS`` and the world is a usable SP degree, TDP otherwise; one
    rank runs the whole latent (SP degree 1). Tiles given by the user mean TDP.

    ``guiding_latents`` (the image latents appended to the video: the last image's, or every image's under
    the keyframes conditioning) rule TDP out, since a tile cannot hold them: ``auto`` takes SP (the whole
    latent on one rank), and ``tdp``, tiles, or a world that is no usable SP degree are refused in words.
    """
    if mode not in STAGE2_MODES:
        raise ValueError(f"stage-2 parallel mode must be one of {', '.join(STAGE2_MODES)}, got {mode!r}")
    if world_size < 1 or video_tokens < 1:
        raise ValueError(f"stage 2 needs at least one rank and one video token, got {world_size} ranks, {video_tokens} tokens")
    shard_tokens = math.ceil(video_tokens / world_size)
    usable_sp = world_size in set(valid_sp_degrees(attention_heads, audio_attention_heads))
    if guiding_latents and mode != "sp":
        appended = f"{_counted(guiding_latents, 'image latent')} appended to the video (the last image's, or every image's under the keyframes conditioning)"
        if mode == "tdp" or tiles_given:
            raise ValueError(f"stage 2 cannot run tiled data parallel with {appended}: no tile can hold them; leave the tiles out and use parallel 'auto' or 'sp'")
        if world_size > 1 and not usable_sp:
            degrees = ", ".join(map(str, valid_sp_degrees(attention_heads, audio_attention_heads)))
            raise ValueError(
                f"stage 2 must run sequence parallel with {appended}, but {world_size} ranks is no usable SP degree for "
                f"{attention_heads} attention heads; run a fleet of {degrees} ranks"
            )
    if mode == "sp":
        check_sp_degree(world_size, attention_heads, audio_attention_heads)
        technique, why = "sp", "asked for"
    elif mode == "tdp":
        technique, why = "tdp", "asked for"
    elif tiles_given:
        technique, why = "tdp", "tiles were given"
    elif guiding_latents:
        technique, why = "sp", f"{_counted(guiding_latents, 'image latent')} appended to the video, which tiles cannot hold"
    elif recipe(pipeline).stage2_policy == "tdp":
        technique, why = "tdp", f"the {pipeline} graph's stage 2 is TDP Upscale"
    elif world_size == 1:
        technique, why = "sp", "one rank: the whole latent on it"
    elif not usable_sp:
        technique, why = "tdp", f"{world_size} ranks is no usable SP degree for {attention_heads} attention heads"
    elif recipe(pipeline).stage2_policy == "sp":
        technique, why = "sp", f"the {pipeline} recipe's stage 2 denoises the audio too, as its official runner"
    elif shard_tokens >= STAGE2_SP_MIN_SHARD_TOKENS:
        technique, why = "sp", f"{shard_tokens} tokens per rank, at or above the launch-bound ~{STAGE2_SP_MIN_SHARD_TOKENS}"
    else:
        technique, why = "tdp", f"{shard_tokens} tokens per rank would be below the launch-bound ~{STAGE2_SP_MIN_SHARD_TOKENS}"
    sp_degree = world_size if technique == "sp" else 1
    audio = "audio denoised in stage 2 (as the official pipelines)" if technique == "sp" else "audio frozen (the stage-1 audio)"
    what = f"SP degree {sp_degree}" if technique == "sp" else "tiled data parallel"
    reason = (
        f"stage-2 plan ({mode}, {pipeline}): {what} on {_counted(world_size, 'rank')} for {video_tokens} video tokens; {why}; {audio}"
    )
    return Stage2Plan(mode, world_size, technique, sp_degree, video_tokens, reason)


# Output dtypes that can travel; the exchange sends every output in one buffer of a common type.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_NDIM = 6


class GuidanceParallelRunner:
    """Runs each pass of a step on its group and gives every rank all outputs (``PassRunner``).

    ``comm`` spans the whole stage-1 world; the transformer handed to ``run`` must already be
    sequence-parallel over this rank's group (``build_stage1_groups`` returns that group).
    ``local_runner`` runs the group's own share of a step: one pass after another by default, or
    any other ``PassRunner`` (batched, replayed from CUDA graphs). ``idle_forward(transformer)``, when
    given, runs once for each pass this group runs fewer than the busiest group in a step, before
    the exchange: a transformer whose forwards are collective over the whole world (its weights
    sharded) needs every rank to run as many of them.
    """

    def __init__(self, comm: Comm, plan: Plan, local_runner: PassRunner | None = None,
                 idle_forward: Callable[[object], None] | None = None) -> None:  # fmt: skip
        if comm.world_size != plan.world_size:
            raise ValueError(f"plan is for {plan.world_size} ranks but the group has {comm.world_size}")
        self.comm = comm
        self.plan = plan
        self.local_runner = SequentialPassRunner() if local_runner is None else local_runner
        self.idle_forward = idle_forward
        self.group = plan.group_of(comm.rank)
        # One rank per group contributes to the exchange; its SP peers hold the same outputs.
        self.is_group_leader = comm.rank == plan.rank_groups[self.group][0]

    def run(self, transformer, passes: list[GuidancePass]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not passes:
            return []
        owners = self.plan.assign_passes(len(passes))
        mine = [index for index, owner in enumerate(owners) if owner == self.group]
        outputs = self.local_runner.run(transformer, [passes[index] for index in mine])
        if self.idle_forward is not None:
            for _ in range(max(owners.count(group) for group in set(owners)) - len(mine)):
                self.idle_forward(transformer)
        local: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = dict(zip(mine, outputs, strict=True))
        return self._exchange(local, len(passes), passes[0].video.latent.device)

    def _exchange(self, local: dict, pass_count: int, device: torch.device) -> list[tuple]:
        """Every rank receives every pass's (video, audio) outputs, exactly as its group computed them.

        First the shapes and dtypes (non-owners do not know them), then all outputs in one buffer:
        the owning group's leader writes its outputs, everyone else zeros, and a sum all-reduce
        delivers them (adding zeros is exact in every float format).
        """
        meta = torch.zeros(pass_count, 2, 2 + _MAX_NDIM, dtype=torch.int64, device=device)
        if self.is_group_leader:
            for index, outputs in local.items():
                for slot, tensor in enumerate(outputs):
                    if tensor is not None:
                        assert tensor.dtype in _DTYPES and tensor.ndim <= _MAX_NDIM, (tensor.dtype, tensor.shape)
                        meta[index, slot, 0] = _DTYPES.index(tensor.dtype) + 1
                        meta[index, slot, 1] = tensor.ndim
                        meta[index, slot, 2 : 2 + tensor.ndim] = torch.tensor(tensor.shape)
        self.comm.all_reduce_max(meta)

        layout = []  # per (pass, slot): None or (dtype, shape, offset, numel)
        transport_dtype, offset = None, 0
        for row in meta.tolist():
            for dtype_code, ndim, *dims in row:
                if dtype_code == 0:
                    layout.append(None)
                    continue
                dtype, shape = _DTYPES[dtype_code - 1], tuple(dims[:ndim])
                numel = math.prod(shape)
                layout.append((dtype, shape, offset, numel))
                offset += numel
                transport_dtype = dtype if transport_dtype is None else torch.promote_types(transport_dtype, dtype)

        buffer = torch.zeros(offset, dtype=transport_dtype or torch.float32, device=device)
        if self.is_group_leader:
            for index, outputs in local.items():
                for slot, tensor in enumerate(outputs):
                    if tensor is not None:
                        _, _, start, numel = layout[2 * index + slot]
                        buffer[start : start + numel] = tensor.reshape(-1)
        self.comm.all_reduce_sum(buffer)

        results = []
        for index in range(pass_count):
            pair = []
            for slot in range(2):
                entry = layout[2 * index + slot]
                if entry is None:
                    pair.append(None)
                else:
                    dtype, shape, start, numel = entry
                    pair.append(buffer[start : start + numel].view(shape).to(dtype))
            results.append(tuple(pair))
        return results


def build_stage1_groups(comm: Comm, plan: Plan) -> Comm:
    """Create the plan's rank groups and return this rank's SP group (every rank of ``comm`` must call
    this, with the same plan: creating subgroups is collective).

    Apply ``apply_sequence_parallel(transformer, sp_comm)`` with the result. Creating process groups
    is slow on a large fleet, so callers keep the result per layout (the stage-1 parallelize entry
    does); the groups hold no state of a job.
    """
    if comm.world_size != plan.world_size:
        raise ValueError(f"plan is for {plan.world_size} ranks but the group has {comm.world_size}")
    if plan.sp_degree == 1:
        sp_comm = Comm(None, [comm.global_ranks[comm.rank]])
    elif plan.guidance_groups == 1:
        sp_comm = comm
    else:
        sp_comm = comm.split([[comm.global_ranks[rank] for rank in ranks] for ranks in plan.rank_groups])
    log.info("%s; this rank: group %d, SP ranks %s", plan.reason, plan.group_of(comm.rank), sp_comm.global_ranks)
    return sp_comm


def apply_guidance_parallel(comm: Comm, plan: Plan, local_runner: PassRunner | None = None,
                            idle_forward: Callable[[object], None] | None = None) -> PassRunner:  # fmt: skip
    """The pass runner of the stage-1 loop under ``plan``: a ``GuidanceParallelRunner`` over ``comm``
    that runs this rank's group's share of each step through ``local_runner`` (sequential by default),
    or ``local_runner`` itself when the plan has one group (all passes are this group's).

    Nothing is patched and no collective runs here; there is nothing to remove afterwards.
    """
    if comm.world_size != plan.world_size:
        raise ValueError(f"plan is for {plan.world_size} ranks but the group has {comm.world_size}")
    local_runner = SequentialPassRunner() if local_runner is None else local_runner
    if plan.guidance_groups == 1:
        return local_runner
    return GuidanceParallelRunner(comm, plan, local_runner=local_runner, idle_forward=idle_forward)
