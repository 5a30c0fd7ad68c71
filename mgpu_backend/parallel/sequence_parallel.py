"""Sequence parallelism (SP) for ltx-core's LTX-2 audio+video transformer: one forward on N ranks.

What it is: the video token sequence of one transformer call is cut into ``sp_degree`` equal,
contiguous shards, one per rank of the SP group. Every per-token operation (patchify projection,
timestep AdaLN, RoPE, feed-forward, output projection, text cross-attention, audio-to-video
cross-attention) runs on the local shard only. The two places where a video token needs every other
video token are exchanged Ulysses-style, head-parallel:

- video self-attention: Q/K/V go from token shards to head shards with one all-to-all, each rank
  runs full-sequence attention on ``heads / sp_degree`` heads, and one all-to-all brings the result
  back to token shards;
- audio-from-video cross-attention (audio queries, video keys/values): the video K/V take the same
  exchange, each rank attends its slice of audio heads over all video tokens, and the audio output
  (replicated, it is short) is all-gathered over the heads.

Audio tokens and the text context are replicated on every rank, so audio self-attention and audio
text cross-attention need no exchange. The padding that makes the shards equal is cut off before
attention, so padded tokens are never keys; the conditioning attention mask
(``Modality.attention_mask``) stays whole because after the exchange every rank holds every query.
The output tokens are gathered at the end of the forward, so every rank of the group returns the
full result, equal to the single-GPU forward up to float rounding.

The two attentions whose queries are video tokens and whose keys are replicated (text
cross-attention, video-from-audio cross-attention) need no exchange for correctness: each rank can
attend its own query tokens. On CPU ranks they are exchanged anyway (``video_query_exchange``): the
video queries go from token shards to head shards, each rank attends ALL video queries on its
``heads / sp_degree`` heads (keys and values sliced to those heads locally), and the output comes
back to token shards. The reason is PyTorch's CPU attention kernel: in bfloat16 the result of a
query row depends on how many query rows the call holds (a call of 2 or 3 rows, or a block tail of
that size, rounds differently from the same rows inside a longer call), so local shards of a few
tokens broke the bitwise equality with one process (the tiny LTX-2.0 bundle at SP degree 4: 3
video tokens per rank; both stage-1 latents 0.03 off after the 8 distilled steps, up to ~0.2 after
the 40 guided steps of the two-stage defaults). Per head the kernel is exact, so
the head-parallel call with the full query sequence is bitwise by construction. The per-token
linear layers need oneDNN below AMX for the same reason (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``,
as the tests set it): the AMX bf16 matmul picks its kernel by the row count, so a shard's rows round
differently from the same rows in the full sequence. GPU kernels keep the local shards (no extra
all-to-all); there SP equals one GPU within bf16 noise.

When to use it: stage 1 (full-frame denoising) of a single generation, to cut its latency. What it
costs: two all-to-alls per block for self-attention and, with audio, one all-to-all plus one small
all-gather per block (on CPU ranks two more for each video-query cross-attention); shards below
~1500 video tokens stop getting faster (see the stage-1 planner in ``guidance_parallel``). It is
not a memory tool: every rank holds the full weights.

The exchanges are a model-agnostic core (``ShardedForward``, ``VideoTokenShards`` and the
``AttentionExchange`` classes take Q/K/V flattened over heads, a head count and a mask, around any
attention kernel): ltx-core's transformer (below) and ComfyUI's own LTX model
(``mgpu_backend.comfy_model.plan``) both run on it. ltx-core is imported only by the functions that
apply SP to ltx-core's model.

How it is applied: from outside, to one model instance. The model's ``forward`` and the
``attention_function`` of the attention modules that need an exchange are replaced on that instance;
parameters, their names and the state dict are untouched, and ``remove_sequence_parallel`` restores
the instance (the stage-1 parallelize entry, ``mgpu_backend.ltx.parallelize``, removes it when
stage 1 ends, so the resident transformer never carries SP into stage 2). This module must never edit or fork ltx-core code, never import ``ltx_pipelines``, and
never talk to other ranks except through ``Comm``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from mgpu_backend.parallel.comm import Comm

if TYPE_CHECKING:
    from ltx_core.model.transformer.modality import Modality
    from ltx_core.model.transformer.model import LTXModel

log = logging.getLogger(__name__)

_STATE_ATTRIBUTE = "_mgpu_sequence_parallel"


def valid_sp_degrees(video_heads: int, audio_heads: int | None = None) -> list[int]:
    """SP degrees that split both head counts evenly (the video heads, and the audio heads if any)."""
    heads = video_heads if audio_heads is None else math.gcd(video_heads, audio_heads)
    return [degree for degree in range(1, heads + 1) if heads % degree == 0]


def _spoken_list(values: list[int]) -> str:
    words = [str(value) for value in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def check_sp_degree(sp_degree: int, video_heads: int, audio_heads: int | None = None) -> None:
    """Refuse an SP degree that does not split the attention heads evenly (head-parallel attention
    gives every rank ``heads / sp_degree`` whole heads)."""
    choices = _spoken_list(valid_sp_degrees(video_heads, audio_heads))
    if sp_degree < 1:
        raise ValueError(f"SP degree must be at least 1, got {sp_degree}; use {choices}")
    if video_heads % sp_degree:
        raise ValueError(f"SP degree {sp_degree} does not divide the {video_heads} attention heads; use {choices}")
    if audio_heads is not None and audio_heads % sp_degree:
        raise ValueError(
            f"SP degree {sp_degree} does not divide the {audio_heads} audio attention heads; use {choices}"
        )


@dataclass(frozen=True)
class VideoTokenShards:
    """How ``video_tokens`` tokens are cut into ``sp_degree`` equal contiguous shards.

    The sequence is padded at its end to a multiple of the degree, so the last shard(s) may hold
    padding. Padding repeats the last real token: any finite value would do, because padded tokens
    are never attended to and their outputs are dropped, and a real token keeps them in range.
    """

    video_tokens: int
    sp_degree: int

    @property
    def shard_tokens(self) -> int:
        return -(-self.video_tokens // self.sp_degree)

    @property
    def padded_tokens(self) -> int:
        return self.shard_tokens * self.sp_degree

    @property
    def padding(self) -> int:
        return self.padded_tokens - self.video_tokens

    def bounds(self, rank: int) -> tuple[int, int]:
        """Token interval ``[start, stop)`` of ``rank``'s shard in the padded sequence."""
        return rank * self.shard_tokens, (rank + 1) * self.shard_tokens

    def shard(self, tensor: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """``rank``'s shard of ``tensor`` along its token dimension ``dim``."""
        assert tensor.shape[dim] == self.video_tokens, (tuple(tensor.shape), dim, self.video_tokens)
        start, stop = self.bounds(rank)
        real_start, real_stop = min(start, self.video_tokens), min(stop, self.video_tokens)
        shard = tensor.narrow(dim, real_start, real_stop - real_start)
        missing = self.shard_tokens - (real_stop - real_start)
        if missing:
            repeats = [1] * tensor.ndim
            repeats[dim] = missing
            last_token = tensor.narrow(dim, self.video_tokens - 1, 1)
            shard = torch.cat([shard, last_token.repeat(*repeats)], dim=dim)
        return shard

    def shard_modality(self, video: Modality, rank: int) -> Modality:
        """The video ``Modality`` as ``rank`` sees it: its tokens, timesteps and positions.

        The per-token timesteps (denoise mask x sigma, zero for clean conditioning tokens) and the
        positions (``(B, dims, T, 2)``) are cut exactly like the latent tokens. The conditioning
        attention mask ``(B, T, T)`` stays whole: after the all-to-all every rank attends with all
        queries and all keys.
        """
        timesteps = video.timesteps
        if timesteps.ndim >= 2 and timesteps.shape[1] == self.video_tokens:
            timesteps = self.shard(timesteps, 1, rank)
        return replace(
            video,
            latent=self.shard(video.latent, 1, rank),
            timesteps=timesteps,
            positions=self.shard(video.positions, 2, rank),
        )

    def gather(self, local_tokens: torch.Tensor, comm: Comm) -> torch.Tensor:
        """Every rank's output shard, concatenated in token order, padding removed."""
        full = comm.all_gather(local_tokens.contiguous(), dim=1)
        return full[:, : self.video_tokens]


class ShardedForward:
    """What the exchanges of one model share: the group, and the shards of the running forward
    (None outside a sequence-parallel forward, where every exchange is plain attention).

    Model-agnostic: the ltx-core application below and the ComfyUI plan
    (``mgpu_backend.comfy_model.plan``) both set ``active_shards`` around their forward.
    """

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.active_shards: VideoTokenShards | None = None


class AttentionExchange:
    """The layout change one attention role needs under SP, around any attention kernel.

    Called as ``exchange(attend, q, k, v, heads, mask)`` with ``attend(q, k, v, heads, mask)`` the
    model's own kernel and Q/K/V flattened over heads, (B, tokens, heads * D), as both ltx-core's
    ``attention_function`` and ComfyUI's ``optimized_attention`` take them. Outside a
    sequence-parallel forward it is the kernel itself.
    """

    def __init__(self, forward: ShardedForward) -> None:
        self.forward = forward

    def __call__(self, attend, q, k, v, heads: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        shards = self.forward.active_shards
        if shards is None:
            return attend(q, k, v, heads, mask)
        return self.exchanged(attend, q, k, v, heads, mask, shards)

    def exchanged(self, attend, q, k, v, heads: int, mask, shards: VideoTokenShards) -> torch.Tensor:
        raise NotImplementedError


def _head_shards_to_tokens(out: torch.Tensor, shards: VideoTokenShards, comm: Comm, local_tokens: int) -> torch.Tensor:
    """An attention output over every video token for this rank's heads, (B, tokens, local heads, D),
    back to this rank's token shard for all heads, flattened: (B, local tokens, heads * D)."""
    batch, _, local_heads, head_dim = out.shape
    out = F.pad(out, (0, 0, 0, 0, 0, shards.padding))
    out = comm.all_to_all(out, scatter_dim=1, gather_dim=2)  # (B, local tokens, heads, D)
    return out.reshape(batch, local_tokens, local_heads * comm.world_size * head_dim)


class VideoSelfAttentionExchange(AttentionExchange):
    """Video self-attention: token shards -> head shards -> back.

    Receives Q, K, V of the local video tokens (projected, normed, RoPE applied) for all heads and
    returns the attention output of the local tokens for all heads, like the kernel it wraps.
    """

    def exchanged(self, attend, q, k, v, heads: int, mask, shards: VideoTokenShards) -> torch.Tensor:
        comm = self.forward.comm
        batch, local_tokens, inner_dim = q.shape
        head_dim = inner_dim // heads
        local_heads = heads // comm.world_size

        qkv = torch.stack([q, k, v]).view(3, batch, local_tokens, heads, head_dim)
        qkv = comm.all_to_all(qkv, scatter_dim=3, gather_dim=2)  # (3, B, padded tokens, heads/N, D)
        # Dropping the padding here (rather than masking it) keeps the attention call the same shape
        # as on one GPU, and lets the conditioning mask (B, 1, T, T) apply unchanged.
        qkv = qkv[:, :, : shards.video_tokens]
        q, k, v = (t.reshape(batch, shards.video_tokens, local_heads * head_dim) for t in qkv.unbind(0))

        out = attend(q, k, v, local_heads, mask).view(batch, shards.video_tokens, local_heads, head_dim)
        return _head_shards_to_tokens(out, shards, comm, local_tokens)


class VideoContextExchange(AttentionExchange):
    """Audio-from-video cross-attention: audio queries (replicated), video keys/values (token shards).

    Each rank attends its slice of the heads over all video tokens, and the outputs are gathered
    over heads so every rank returns the same full audio result.
    """

    def exchanged(self, attend, q, k, v, heads: int, mask, shards: VideoTokenShards) -> torch.Tensor:
        assert mask is None, "audio-from-video cross-attention under SP takes no mask"
        comm = self.forward.comm
        batch, audio_tokens, inner_dim = q.shape
        head_dim = inner_dim // heads
        local_heads = heads // comm.world_size
        first_head = comm.rank * local_heads

        q = q.view(batch, audio_tokens, heads, head_dim)[:, :, first_head : first_head + local_heads]
        q = q.reshape(batch, audio_tokens, local_heads * head_dim)
        kv = torch.stack([k, v]).view(2, batch, k.shape[1], heads, head_dim)
        kv = comm.all_to_all(kv, scatter_dim=3, gather_dim=2)[:, :, : shards.video_tokens]
        k, v = (t.reshape(batch, shards.video_tokens, local_heads * head_dim) for t in kv.unbind(0))

        out = attend(q, k, v, local_heads, None).view(batch, audio_tokens, local_heads, head_dim)
        out = comm.all_gather(out, dim=2)
        return out.reshape(batch, audio_tokens, heads * head_dim)


class VideoQueryExchange(AttentionExchange):
    """An attention whose queries are the local video tokens and whose keys/values are replicated
    (text cross-attention, video-from-audio cross-attention), where the call must see every video
    query (``video_query_exchange``, see the module docstring).

    The queries go from token shards to head shards; each rank attends all video queries with its
    slice of the heads over the whole (replicated) context, and the output returns to token shards.
    """

    def exchanged(self, attend, q, k, v, heads: int, mask, shards: VideoTokenShards) -> torch.Tensor:
        # A context mask broadcasts over the queries ((B, 1, 1, S)); one per query row would need its rows exchanged too.
        assert mask is None or mask.shape[-2] == 1, f"video-query attention under SP takes a query-broadcast mask, got {tuple(mask.shape)}"
        comm = self.forward.comm
        batch, local_tokens, inner_dim = q.shape
        head_dim = inner_dim // heads
        local_heads = heads // comm.world_size
        first_head = comm.rank * local_heads

        q = comm.all_to_all(q.reshape(batch, local_tokens, heads, head_dim), scatter_dim=2, gather_dim=1)
        q = q[:, : shards.video_tokens].reshape(batch, shards.video_tokens, local_heads * head_dim)
        k, v = (
            t.reshape(batch, t.shape[1], heads, head_dim)[:, :, first_head : first_head + local_heads].reshape(batch, t.shape[1], local_heads * head_dim)
            for t in (k, v)
        )
        out = attend(q, k, v, local_heads, mask).view(batch, shards.video_tokens, local_heads, head_dim)
        return _head_shards_to_tokens(out, shards, comm, local_tokens)


class _ExchangedAttentionFunction:
    """An ltx-core ``attention_function``: an exchange around the function it replaced."""

    def __init__(self, exchange: AttentionExchange, inner) -> None:
        self.exchange = exchange
        self.inner = inner

    def __call__(self, q, k, v, heads: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.exchange(self.inner, q, k, v, heads, mask)


class _SequenceParallelState(ShardedForward):
    """ltx-core's application: the shared forward state, plus what ``remove_sequence_parallel`` restores."""

    def __init__(self, comm: Comm, original_forward, instance_forward, patched_attention: list) -> None:
        super().__init__(comm)
        self.original_forward = original_forward
        self.instance_forward = instance_forward  # a forward set on the instance before SP, if any
        self.patched_attention = patched_attention  # (Attention module, its original attention_function)


def _velocity_model(model: torch.nn.Module) -> LTXModel:
    """The ``LTXModel`` inside ``model`` (itself, or the ``velocity_model`` of an X0 wrapper)."""
    from ltx_core.model.transformer.model import LTXModel

    inner = getattr(model, "velocity_model", model)
    if not isinstance(inner, LTXModel):
        raise TypeError(
            f"sequence parallelism applies to ltx-core's LTXModel or a wrapper with a .velocity_model "
            f"(X0Model); got {type(model).__name__}"
        )
    return inner


def apply_sequence_parallel(model: torch.nn.Module, comm: Comm, video_query_exchange: bool | None = None) -> torch.nn.Module:
    """Make ``model`` (LTXModel or X0Model) run each forward sequence-parallel over ``comm``.

    Afterwards every rank of ``comm`` must call the model together, with the same full (replicated)
    inputs; each returns the full outputs. Applying it again replaces the previous group. Returns
    ``model`` itself (patched in place).

    ``video_query_exchange``: run the text and video-from-audio cross-attentions head-parallel over
    all video queries (see the module docstring); None (the default) does so where the model's
    weights are on the CPU, whose attention kernel needs it for bitwise results.
    """
    velocity = _velocity_model(model)
    if not velocity.model_type.is_video_enabled():
        raise ValueError("sequence parallelism splits the video tokens; this model has no video stream")
    audio_heads = velocity.audio_num_attention_heads if velocity.model_type.is_audio_enabled() else None
    check_sp_degree(comm.world_size, velocity.num_attention_heads, audio_heads)
    remove_sequence_parallel(model)

    if comm.world_size == 1:
        log.info("sequence parallel: SP degree 1, model left as it is")
        return model

    if video_query_exchange is None:
        video_query_exchange = next(velocity.parameters()).device.type == "cpu"
    exchanges = {"attn1": VideoSelfAttentionExchange, "video_to_audio_attn": VideoContextExchange}
    if video_query_exchange:
        exchanges.update(attn2=VideoQueryExchange, audio_to_video_attn=VideoQueryExchange)
    patched = [
        (getattr(block, name), exchange)
        for block in velocity.transformer_blocks
        for name, exchange in exchanges.items()
        if getattr(block, name, None) is not None
    ]
    state = _SequenceParallelState(
        comm, velocity.forward, velocity.__dict__.get("forward"), [(a, a.attention_function) for a, _ in patched]
    )
    for attention, exchange in patched:
        attention.attention_function = _ExchangedAttentionFunction(exchange(state), attention.attention_function)

    def sequence_parallel_forward(video, audio, perturbations):
        if video is None or video.latent.shape[1] == 0:
            return state.original_forward(video, audio, perturbations)
        shards = VideoTokenShards(video.latent.shape[1], comm.world_size)
        state.active_shards = shards
        try:
            video_out, audio_out = state.original_forward(
                shards.shard_modality(video, comm.rank), audio, perturbations
            )
        finally:
            state.active_shards = None
        return (shards.gather(video_out, comm) if video_out is not None else None), audio_out

    velocity.forward = sequence_parallel_forward
    setattr(velocity, _STATE_ATTRIBUTE, state)
    audio_note = (
        f", {audio_heads} audio heads -> {audio_heads // comm.world_size} per rank" if audio_heads is not None else ""
    )
    query_note = (
        "; text and video-from-audio cross-attention head-parallel over all video queries too (CPU attention rounds "
        "a query row by the row count of its call: local shards would not be bitwise)"
        if video_query_exchange
        else "; text and video-from-audio cross-attention on the local shards"
    )
    log.info(
        "sequence parallel: SP degree %d over ranks %s; %d video heads -> %d per rank%s; "
        "all-to-all around video self-attention and audio-from-video cross-attention in %d blocks%s",
        comm.world_size,
        comm.global_ranks,
        velocity.num_attention_heads,
        velocity.num_attention_heads // comm.world_size,
        audio_note,
        len(velocity.transformer_blocks),
        query_note,
    )
    return model


def remove_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``apply_sequence_parallel`` on ``model`` (no-op if it was not applied)."""
    velocity = _velocity_model(model)
    state: _SequenceParallelState | None = velocity.__dict__.pop(_STATE_ATTRIBUTE, None)
    if state is None:
        return model
    for attention, inner in state.patched_attention:
        attention.attention_function = inner
    if state.instance_forward is None:
        velocity.__dict__.pop("forward", None)
    else:
        velocity.forward = state.instance_forward
    return model


def sequence_parallel_comm(model: torch.nn.Module) -> Comm | None:
    """The Comm of the SP group ``model`` runs with, or None when SP is not applied."""
    state = getattr(_velocity_model(model), _STATE_ATTRIBUTE, None)
    return None if state is None else state.comm


def sequence_parallel_degree(model: torch.nn.Module) -> int:
    """The SP degree ``model`` currently runs with (1 when SP is not applied)."""
    comm = sequence_parallel_comm(model)
    return 1 if comm is None else comm.world_size
