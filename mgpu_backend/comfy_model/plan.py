"""The fleet's plan for ComfyUI's own LTX-2 audio+video model: what it checks, how it runs sequence-parallel.

Like torchtitan's per-model ``parallelize``, this is the one place that knows the structure of
ComfyUI's ``LTXAVModel`` (comfy/ldm/lightricks/av_model.py). It

- checks the code before any weight is loaded (``check_code``): the model and block classes, the
  signatures the plan hooks into (``inspect.signature``), and, on a block built on the meta device,
  the six attention modules it expects, each a ComfyUI ``CrossAttention`` with the query and key
  widths of its role. Anything else is refused in words naming what differs;
- checks the loaded model the same way (``check_model``);
- applies sequence parallelism to one loaded instance (``apply_plan``), with the model-agnostic
  exchanges of ``mgpu_backend.parallel.sequence_parallel``:

  * around ``LTXAVModel._process_transformer_blocks`` (replaced on the instance only), every
    per-video-token input of the blocks is cut into the rank's shard: the video hidden states
    (guide/keyframe tokens appended by ComfyUI's LTX nodes included), the video timesteps (a
    ``CompressedTimestep`` is expanded first: the per-token values are elementwise the same),
    the audio-video cross-attention video timesteps, the video RoPE and the video cross RoPE.
    Audio, the text context, the text mask and the guide self-attention mask stay whole (after
    the exchange every rank holds every video query). The video output shards are gathered
    after the last block, padding dropped;
  * each attention module of a role that needs an exchange gets a forward pre-hook on the
    instance that puts a role-specific ``optimized_attention_override`` into the
    ``transformer_options`` it is called with (ComfyUI's ``wrap_attn`` hands the override the
    attention kernel it would have run): video self-attention (``attn1``) and audio-from-video
    (``video_to_audio_attn``) always, text (``attn2``) and video-from-audio
    (``audio_to_video_attn``) cross-attention on CPU ranks (``video_query_exchange``: CPU attention
    rounds a query row by the row count of its call);
  * a few blocks (``CANCEL_POINTS``) get a pre-hook that calls the forward's cancel point, so a
    cancelled job stops a call in flight on every rank (each point is one control-group
    all-reduce).

Nothing of ComfyUI is edited: ``remove`` restores the instance. This module must never import
ComfyUI at import time (its functions import it when called, after ``runtime.import_comfy``) and
never talk to other ranks except through ``Comm``.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.sequence_parallel import (
    AttentionExchange,
    ShardedForward,
    VideoContextExchange,
    VideoQueryExchange,
    VideoSelfAttentionExchange,
    VideoTokenShards,
)

log = logging.getLogger(__name__)

SUPPORTED_MODELS = ("LTXAVModel",)
MODEL_OPTIONS = ("run_vx", "run_ax", "a2v_cross_attn", "v2a_cross_attn")
"""The transformer_options ComfyUI's LTX-AV blocks read (which streams and cross-attentions run):
the ComfyUI side sends them as they are, the ranks pass them on, a captured graph bakes them in."""
CANCEL_POINTS = 4
"""Cancel points per forward (spread over the blocks); each costs one control-group all-reduce."""

BLOCK_FORWARD_PARAMETERS = (
    "self", "x", "v_context", "a_context", "attention_mask", "v_timestep", "a_timestep", "v_pe", "a_pe",
    "v_cross_pe", "a_cross_pe", "v_cross_scale_shift_timestep", "a_cross_scale_shift_timestep",
    "v_cross_gate_timestep", "a_cross_gate_timestep", "transformer_options", "self_attention_mask",
    "v_prompt_timestep", "a_prompt_timestep",
)
BLOCKS_PARAMETERS = ("self", "x", "context", "attention_mask", "timestep", "pe", "transformer_options", "self_attention_mask", "kwargs")
ATTENTION_FORWARD_PARAMETERS = ("self", "x", "context", "mask", "pe", "k_pe", "transformer_options")


@dataclass(frozen=True)
class AttentionRole:
    """An attention module a block must hold: its queries and keys, and what SP does with it."""

    name: str
    queries: str  # "video" or "audio"
    keys: str  # "video", "audio" or "text"
    heads: str  # whose head count: "video" or "audio"


ATTENTION_ROLES = (
    AttentionRole("attn1", "video", "video", "video"),
    AttentionRole("attn2", "video", "text", "video"),
    AttentionRole("audio_attn1", "audio", "audio", "audio"),
    AttentionRole("audio_attn2", "audio", "text", "audio"),
    AttentionRole("audio_to_video_attn", "video", "audio", "audio"),
    AttentionRole("video_to_audio_attn", "audio", "video", "audio"),
)
ALWAYS_EXCHANGED = {"attn1": VideoSelfAttentionExchange, "video_to_audio_attn": VideoContextExchange}
QUERY_EXCHANGED = {"attn2": VideoQueryExchange, "audio_to_video_attn": VideoQueryExchange}


class PlanRefused(ValueError):
    """ComfyUI's model is not the one this plan covers; the message says what differs."""


def _refuse(what: str) -> PlanRefused:
    return PlanRefused(
        f"this ComfyUI's LTX model has {what}, which the fleet's plan does not cover; supported: "
        f"{', '.join(SUPPORTED_MODELS)} of ComfyUI v0.20.1 (comfy/ldm/lightricks/av_model.py)"
    )


def _parameters(function) -> tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def _check_signature(where: str, function, expected: tuple[str, ...]) -> None:
    found = _parameters(function)
    if found != expected:
        raise _refuse(f"{where}({', '.join(found)}) where the plan expects ({', '.join(expected)})")


def check_code() -> None:
    """Refuse ComfyUI LTX code the plan does not cover, before any weight is loaded."""
    import comfy.ldm.lightricks.av_model as av_model
    import comfy.ldm.lightricks.model as ltx_model
    import comfy.ldm.modules.attention as attention
    import comfy.ops

    model_class = getattr(av_model, "LTXAVModel", None)
    block_class = getattr(av_model, "BasicAVTransformerBlock", None)
    if model_class is None or block_class is None or not hasattr(av_model, "CompressedTimestep"):
        raise _refuse("no LTXAVModel, BasicAVTransformerBlock or CompressedTimestep in comfy.ldm.lightricks.av_model")
    if not issubclass(model_class, ltx_model.LTXVModel):
        raise _refuse(f"an LTXAVModel that is not an LTXVModel ({model_class.__mro__[1].__name__})")
    _check_signature("LTXAVModel._process_transformer_blocks", model_class._process_transformer_blocks, BLOCKS_PARAMETERS)
    _check_signature("BasicAVTransformerBlock.forward", block_class.forward, BLOCK_FORWARD_PARAMETERS)
    _check_signature("CrossAttention.forward", ltx_model.CrossAttention.forward, ATTENTION_FORWARD_PARAMETERS)
    if not hasattr(attention, "wrap_attn") or not hasattr(attention.optimized_attention, "__wrapped__"):
        raise _refuse("an attention kernel that does not honour transformer_options['optimized_attention_override']")
    try:
        block = block_class(
            v_dim=16, a_dim=8, v_heads=2, a_heads=2, vd_head=8, ad_head=4, v_context_dim=16, a_context_dim=8,
            device="meta", operations=comfy.ops.disable_weight_init,
        )
    except TypeError as exc:
        raise _refuse(f"a BasicAVTransformerBlock built otherwise ({exc})") from exc
    check_block(block, ltx_model.CrossAttention, {"video": 16, "audio": 8}, {"video": 2, "audio": 2}, "the block class")


def check_block(block: torch.nn.Module, attention_class: type, widths: dict[str, int], heads: dict[str, int], where: str) -> None:
    """Refuse a block whose attention modules are not the six roles the plan exchanges."""
    for role in ATTENTION_ROLES:
        module = getattr(block, role.name, None)
        if module is None:
            raise _refuse(f"no {role.name} ({role.queries} queries, {role.keys} keys) in {where}")
        if type(module) is not attention_class:
            raise _refuse(f"a {type(module).__name__} as {role.name} in {where}, not ComfyUI's CrossAttention")
        query_width = module.to_q.in_features
        key_width = module.to_k.in_features
        if module.heads != heads[role.heads] or query_width != widths[role.queries]:
            raise _refuse(
                f"{role.name} with {module.heads} heads over {query_width}-wide queries in {where}, where the plan expects "
                f"{role.queries} queries ({widths[role.queries]} wide) on the {heads[role.heads]} {role.heads} heads"
            )
        if role.keys != "text" and key_width != widths[role.keys]:
            raise _refuse(f"{role.name} with {key_width}-wide keys in {where}, where the plan expects {role.keys} keys ({widths[role.keys]} wide)")
    known = {role.name for role in ATTENTION_ROLES}
    extra = sorted(name for name, child in block.named_children() if isinstance(child, attention_class) and name not in known)
    if extra:
        raise _refuse(f"attention modules {', '.join(extra)} in {where}")


def check_model(diffusion_model: torch.nn.Module) -> None:
    """Refuse a loaded diffusion model the plan does not cover (another model family, other blocks)."""
    import comfy.ldm.lightricks.av_model as av_model
    import comfy.ldm.lightricks.model as ltx_model

    if type(diffusion_model) is not av_model.LTXAVModel:
        raise _refuse(f"a {type(diffusion_model).__name__} as its diffusion model")
    widths = {"video": diffusion_model.inner_dim, "audio": diffusion_model.audio_inner_dim}
    heads = {"video": diffusion_model.num_attention_heads, "audio": diffusion_model.audio_num_attention_heads}
    for index, block in enumerate(diffusion_model.transformer_blocks):
        if type(block) is not av_model.BasicAVTransformerBlock:
            raise _refuse(f"a {type(block).__name__} as block {index}")
        check_block(block, ltx_model.CrossAttention, widths, heads, f"block {index}")


def head_counts(diffusion_model: torch.nn.Module) -> tuple[int, int]:
    return diffusion_model.num_attention_heads, diffusion_model.audio_num_attention_heads


# -- applying it ----------------------------------------------------------------------------------


@dataclass
class AppliedPlan:
    """The hooks this plan put on one model instance; ``remove`` takes them off."""

    model: torch.nn.Module
    comm: Comm
    forward: ShardedForward
    handles: list = field(default_factory=list)
    cancel_point: Callable[[int, int], None] | None = None  # set by the job around each call

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.model.__dict__.pop("_process_transformer_blocks", None)


def _attention_override(exchange: AttentionExchange):
    """An ``optimized_attention_override`` running ``exchange`` around the kernel ComfyUI chose."""

    def override(kernel, q, k, v, heads, mask=None, **kwargs):
        def attend(q, k, v, heads, mask):
            return kernel(q, k, v, heads, mask=mask, **kwargs)

        return exchange(attend, q, k, v, heads, mask)

    return override


def _override_hook(forward: ShardedForward, override):
    def hook(module, args, kwargs):
        if forward.active_shards is None:
            return None
        kwargs["transformer_options"] = {**kwargs.get("transformer_options", {}), "optimized_attention_override": override}
        return args, kwargs

    return hook


def _token_dim_of_rope(rope: tuple) -> int:
    """ComfyUI's RoPE is (cos, sin, split): split cos/sin are (B, heads, T, D/2), interleaved (B, T, D)."""
    return 2 if rope[2] else 1


def _shard_rope(rope: tuple, shards: VideoTokenShards, rank: int) -> tuple:
    dim = _token_dim_of_rope(rope)
    return (shards.shard(rope[0], dim, rank), shards.shard(rope[1], dim, rank), *rope[2:])


def _shard_timestep(timestep, shards: VideoTokenShards, rank: int, compressed_type: type):
    """A per-video-token timestep (tensor or CompressedTimestep) as this rank's shard; one broadcast
    over all tokens (B, 1, D) stays as it is."""
    if isinstance(timestep, compressed_type):
        timestep = timestep.expand()
    if timestep.shape[1] == 1:
        return timestep
    assert timestep.shape[1] == shards.video_tokens, (tuple(timestep.shape), shards.video_tokens)
    return shards.shard(timestep, 1, rank)


def apply_plan(diffusion_model: torch.nn.Module, comm: Comm, video_query_exchange: bool) -> AppliedPlan:
    """Hook ``diffusion_model`` (checked by ``check_model``) to run each forward sequence-parallel over
    ``comm`` (every rank of it calls the model together with the same inputs) and to call the
    applied plan's ``cancel_point`` at ``CANCEL_POINTS`` blocks."""
    import comfy.ldm.lightricks.av_model as av_model

    forward = ShardedForward(comm)
    applied = AppliedPlan(diffusion_model, comm, forward)
    blocks = list(diffusion_model.transformer_blocks)
    stride = max(1, math.ceil(len(blocks) / CANCEL_POINTS))
    points = list(range(0, len(blocks), stride))
    for number, index in enumerate(points, start=1):
        def cancel_hook(module, args, _number=number, _total=len(points)):
            # Not while a CUDA graph records the blocks: a cancel point synchronises the device. Every
            # rank of the group records at once, so they all skip alike; a replay runs no hook at all.
            if applied.cancel_point is not None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                applied.cancel_point(_number, _total)

        applied.handles.append(blocks[index].register_forward_pre_hook(cancel_hook))
    if comm.world_size == 1:
        return applied

    exchanges = dict(ALWAYS_EXCHANGED)
    if video_query_exchange:
        exchanges.update(QUERY_EXCHANGED)
    for block in blocks:
        for name, exchange in exchanges.items():
            hook = _override_hook(forward, _attention_override(exchange(forward)))
            applied.handles.append(getattr(block, name).register_forward_pre_hook(hook, with_kwargs=True))

    original = diffusion_model._process_transformer_blocks
    compressed = av_model.CompressedTimestep

    def sharded_blocks(x, context, attention_mask, timestep, pe, transformer_options={}, self_attention_mask=None, **kwargs):
        vx, ax = x
        shards = VideoTokenShards(vx.shape[1], comm.world_size)
        rank = comm.rank
        v_timestep, a_timestep, cross_timesteps, v_prompt_timestep, a_prompt_timestep = timestep
        if cross_timesteps:
            audio_ss, video_ss, a2v_gate, v2a_gate = cross_timesteps
            cross_timesteps = [audio_ss, _shard_timestep(video_ss, shards, rank, compressed), _shard_timestep(a2v_gate, shards, rank, compressed), v2a_gate]
        (v_pe, v_cross_pe), audio_pe = pe
        local = (
            [shards.shard(vx, 1, rank), ax],
            context,
            attention_mask,
            [_shard_timestep(v_timestep, shards, rank, compressed), a_timestep, cross_timesteps, v_prompt_timestep, a_prompt_timestep],
            [(_shard_rope(v_pe, shards, rank), _shard_rope(v_cross_pe, shards, rank)), audio_pe],
        )
        forward.active_shards = shards
        try:
            vx_out, ax_out = original(*local, transformer_options=transformer_options, self_attention_mask=self_attention_mask, **kwargs)
        finally:
            forward.active_shards = None
        return [shards.gather(vx_out, comm), ax_out]

    diffusion_model._process_transformer_blocks = sharded_blocks
    video_heads, audio_heads = head_counts(diffusion_model)
    log.info(
        "ComfyUI LTX plan: SP degree %d over ranks %s; %d video heads -> %d, %d audio heads -> %d per rank; "
        "exchanged: %s in %d blocks; %d cancel points per forward",
        comm.world_size, comm.global_ranks, video_heads, video_heads // comm.world_size, audio_heads,
        audio_heads // comm.world_size, ", ".join(exchanges), len(blocks), len(points),
    )
    return applied
