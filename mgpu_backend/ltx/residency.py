"""Which model components stay resident on a rank's device, and which are built for their stage.

What it is
    The fleet keeps everything resident by default: the transformer working copy, the clean LoRA
    shard (about 1/N of the transformer), Gemma, the VAEs, the vocoder and the upsampler. That is
    fastest for warm jobs but, at LTX-2 19B on one GPU, peaks above 100 GiB. ``plan_residency``
    reads the component sizes from the safetensors headers (nothing is loaded) and the device's
    memory, and decides what is kept:

    - ``"all"``: every component resident (the clean shard where the weight tracker's own rule
      puts it);
    - ``"minimal"``: only the transformer working copy stays; Gemma (with the embeddings
      processor), the video VAE encoder and decoder (with the audio decoder and vocoder) and the
      upsampler are built from the loader's host copy for the stage that needs them and released
      after it (no disk read after the first), the clean shard lives in host memory, and the
      transformer steps aside while Gemma encodes: the encode job parks its working copy in host
      memory (``TransformerWeightTracker.park``) before Gemma is built, and the next stage that asks
      for the transformer copies it back;
    - ``"auto"`` (default): start from all and give up residency in this order until the estimated
      peak fits: Gemma, then the VAEs, then the upsampler, then the clean shard to host memory, then
      the transformer itself during the encode (parked), and last Gemma's own layers beyond the
      device's room, which stay in host memory and are streamed to the GPU layer by layer at each
      encode (``distributed_gemma``: slower; the token embeddings and one layer stay on the GPU).

    The peak estimate of a plan is the largest, over the stages, of: the resident bytes + the
    non-resident components that stage builds + its activations (``HEADROOM_BYTES`` for the
    denoising and decoding stages at usual sizes, ``ENCODE_HEADROOM_BYTES`` for Gemma's); with the
    transformer parked, the encode stage counts no transformer (nor a clean shard on the device). So
    building Gemma per stage pays off once the denoising activations no longer sit beside it, and
    parking once Gemma alone is larger than the denoising stage's activations and builds. Parking
    costs host memory (the transformer's bytes, a pinned buffer kept for later jobs) and two copies
    per job over PCIe; stage 1 captures its CUDA graphs again after it. Each
    job still checks its own activations against the free memory before it starts. The device memory is
    ``MGPU_MEMORY_LIMIT_GIB`` when set, else the GPU's total memory times the process's memory
    fraction (``torch.cuda.set_per_process_memory_fraction``). CPU ranks have no limit unless the
    variable is set.

    - ``"sharded"``: the transformer's weights sharded over the fleet's ranks
      (``mgpu_backend.parallel.weight_sharding``): each rank holds 1/N of it plus the gathered
      blocks and their buffers (``GATHERED_BLOCKS`` block sizes) and the weights outside the blocks; the clean LoRA copy is this rank's rows
      (1/N again); the same ladder as ``"auto"`` then applies (per-stage components, clean rows
      to host memory, the shard parked while Gemma encodes), with Gemma counted 1/G per GPU at its
      encode, G the fleet's GPUs (its ``sharded`` mode spreads one copy over the GPUs; ranks that
      share one GPU, ``MGPU_SHARED_GPU_RANKS``, share no Gemma: rank 0 builds it there).
      Needs at least 2 ranks. ``"auto"`` moves to it when no unsharded plan fits and the fleet
      has several ranks.

    A model that does not fit even at ``"minimal"`` (nor, with several ranks, sharded) is refused
    before anything is loaded, naming what would fit: fp8-cast weights (``quantization:
    "fp8-cast"``), sharding over this many or more GPUs, or a GPU with more memory.

    ``job_peaks`` gives one job's estimate per phase (load, encode, stage 1, upscale, decode) under a
    plan, with the activations of that job's sizes in place of the headroom: what the sharded-memory
    benchmark sets beside each rank's measured peak. A sharded transformer counts its gathered blocks
    only in the jobs that run one (stage 1, upscale).

This module reads file headers only; it never loads weights and never talks to other ranks.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import torch

from mgpu_backend.fleet.settings import number_setting
from mgpu_backend.fleet.shared_gpu import shared_gpu_ranks
from mgpu_backend.ltx import fp8
from mgpu_backend.ltx.schema import (
    DECODE_SPATIAL_TILE_PIXELS,
    DECODE_TEMPORAL_TILE_FRAMES,
    VIDEO_LATENT_CHANNELS,
    VIDEO_SPATIAL_COMPRESSION,
    VIDEO_TEMPORAL_COMPRESSION,
    parse_residency,
)
from mgpu_backend.parallel.weight_sharding import GATHERED_BLOCKS

GIB = 2**30
HEADROOM_BYTES = 6 * GIB
"""Activations of a usual denoising or decoding stage (stage 1 at 768x512x121 peaks a few GiB above the weights)."""
ENCODE_HEADROOM_BYTES = 2 * GIB
"""Activations of a Gemma encode: a 1024-token prompt and every layer's hidden states."""
DECODE_TILE_ACTIVATION_BYTES = 1 * GIB
"""The video decoder's activations and output for one tile of the default size (512 pixels, 64 frames),
beside what the rank holds of the video then: 0.7-0.95 GiB on the H100 and the H200 (LTX-2.3's decoder,
bf16: the decode peaks of the ranks other than 0 less their shard, the decoder and the most they held of
the video, docs/BENCHMARKS.md)."""
AUDIO_DECODE_ACTIVATION_BYTES = GIB // 2
"""Activations of the audio decode (audio VAE, then the vocoder) of one clip on rank 0, after the video
decode. Not measured apart: in every GPU run the decode job peaked in the video decode."""
MEMORY_LIMIT_ENV = "MGPU_MEMORY_LIMIT_GIB"

# What gives up residency first, in order; then the clean shard (to host memory), and last the
# transformer itself for the encode stage (parked in host memory while Gemma encodes).
EVICTION_ORDER: tuple[tuple[str, ...], ...] = (
    ("gemma", "embeddings_processor"),
    ("video_encoder", "video_decoder", "audio_decoder", "vocoder"),
    ("spatial_upsampler",),
)
CLEAN_SHARD = "clean_shard"
# The components each stage builds together; a stage's non-resident ones coexist at its peak.
STAGE_COMPONENTS: dict[str, tuple[str, ...]] = {
    "encode": ("gemma", "embeddings_processor"),
    "sample": ("video_encoder",),
    "upscale": ("video_encoder", "spatial_upsampler"),
    "decode": ("video_decoder", "audio_decoder", "vocoder"),
}


class ResidencyError(ValueError):
    """The model cannot fit the device even with the minimal residency; the message says what would."""


# --- Sizes from headers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComponentSizes:
    """Device bytes of each component in the load dtype: the transformer in bf16 and fp8-cast, and
    the rest by ``ResidentModel`` builder name; for weight sharding also the transformer's largest
    block and its weights outside the blocks (bf16, fp8-cast)."""

    transformer_bytes: int
    transformer_fp8_bytes: int
    components: dict[str, int] = field(default_factory=dict)
    largest_block_bytes: tuple[int, int] = (0, 0)
    outside_blocks_bytes: tuple[int, int] = (0, 0)
    gemma_streamed_bytes: int = 0  # Gemma's GPU bytes with every layer it can stream left in host memory

    def transformer(self, quantization: str | None) -> int:
        return self.transformer_fp8_bytes if quantization == "fp8-cast" else self.transformer_bytes

    def sharded_transformer(self, quantization: str | None, world_size: int) -> int:
        """One rank's bytes of the transformer sharded over ``world_size`` ranks at its peak: its
        shard, ``GATHERED_BLOCKS`` block-sized gather buffers and weights, the rest gathered."""
        fp8_cast = quantization == "fp8-cast"
        return (
            math.ceil(self.transformer(quantization) / world_size)
            + GATHERED_BLOCKS * self.largest_block_bytes[fp8_cast]
            + self.outside_blocks_bytes[fp8_cast]
        )

    def sharded_transformer_at_rest(self, quantization: str | None, world_size: int) -> int:
        """One rank's bytes of the sharded transformer between forwards (a job that runs none: the
        encode, the decode), as the planner counts them: its shard, and the weights outside the blocks
        as if gathered. FSDP frees those after each forward too (``reshard_after_forward`` is set on
        the root unit as well; the H100's decode peaks show them gone), so they stand as the margin for
        what no estimate counts beside a decode or an encode (the latent, masks: about 0.1 GiB measured)."""
        return math.ceil(self.transformer(quantization) / world_size) + self.outside_blocks_bytes[quantization == "fp8-cast"]


_CHECKPOINT_COMPONENTS = {
    "embeddings_processor": ("model.diffusion_model.video_embeddings_connector.", "model.diffusion_model.audio_embeddings_connector.", "text_embedding_projection."),
    "video_encoder": ("vae.encoder.", "vae.per_channel_statistics."),
    "video_decoder": ("vae.decoder.", "vae.per_channel_statistics."),
    "audio_decoder": ("audio_vae.decoder.", "audio_vae.per_channel_statistics."),
    "vocoder": ("vocoder.",),
}
_SAFETENSORS_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def transformer_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]], dtype: torch.dtype, quantization: str | None) -> int:
    """Device bytes of the transformer built from checkpoint tensors ``{name: (safetensors dtype, shape)}``
    (model naming or the file's ``model.diffusion_model.`` naming), as ``fp8.module_tensors`` builds it."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, (stored, shape) in tensors.items():
        key = name.removeprefix("model.diffusion_model.")
        if "_embeddings_connector." in key or key.endswith(fp8.INPUT_SCALE_SUFFIX):
            continue
        if key.endswith(fp8.WEIGHT_SCALE_SUFFIX):
            total += 4 if quantization is not None else 0
            continue
        fp8_kept = quantization is not None and (stored.startswith("F8") or fp8.downcast_by_policy(key, quantization))
        total += math.prod(shape) * (1 if fp8_kept else item)
    return total


Headers = dict[str, tuple[str, tuple[int, ...]]]
"""A safetensors file's tensors: ``{name: (safetensors dtype, shape)}``."""


def sizes_from_headers(checkpoint: Headers, upsampler: Headers | None, gemma: Headers, dtype: torch.dtype = torch.bfloat16) -> ComponentSizes:
    """Every component's device bytes from the tensors of the checkpoint, the upsampler file and the
    Gemma weight files (every component is built in ``dtype``; the transformer also fp8-cast)."""
    item = torch.empty((), dtype=dtype).element_size()

    def numel(headers: Headers, prefixes) -> int:
        return sum(math.prod(shape) for name, (_, shape) in headers.items() if name.startswith(prefixes))

    components = {name: numel(checkpoint, prefixes) * item for name, prefixes in _CHECKPOINT_COMPONENTS.items()}
    if upsampler is not None:
        components["spatial_upsampler"] = numel(upsampler, "") * item
    components["gemma"] = numel(gemma, "") * item
    gemma_layers: dict[str, int] = {}
    for name, (_, shape) in gemma.items():
        if (match := re.search(r"(?:^|\.)layers\.\d+\.", name)) is not None:
            layer = name[: match.end()]
            gemma_layers[layer] = gemma_layers.get(layer, 0) + math.prod(shape) * item
    embeddings = sum(math.prod(shape) for name, (_, shape) in gemma.items() if "embed_tokens" in name) * item
    transformer_tensors = {name: entry for name, entry in checkpoint.items() if name.startswith("model.diffusion_model.")}
    blocks: dict[str, Headers] = {}
    outside: Headers = {}
    for name, entry in transformer_tensors.items():
        key = name.removeprefix("model.diffusion_model.")
        if key.startswith("transformer_blocks."):
            blocks.setdefault(key.split(".")[1], {})[name] = entry
        else:
            outside[name] = entry

    def both(tensors: Headers) -> tuple[int, int]:
        return transformer_bytes(tensors, dtype, None), transformer_bytes(tensors, dtype, "fp8-cast")

    block_sizes = [both(tensors) for tensors in blocks.values()] or [(0, 0)]
    return ComponentSizes(
        transformer_bytes=transformer_bytes(transformer_tensors, dtype, None),
        transformer_fp8_bytes=transformer_bytes(transformer_tensors, dtype, "fp8-cast"),
        components=components,
        largest_block_bytes=(max(size[0] for size in block_sizes), max(size[1] for size in block_sizes)),
        outside_blocks_bytes=both(outside),
        # streamed, Gemma keeps its token embeddings, one layer and the buffer its streamed layers pass through
        gemma_streamed_bytes=embeddings + 2 * max(gemma_layers.values(), default=0),
    )


def component_sizes(spec, dtype: torch.dtype = torch.bfloat16) -> ComponentSizes:
    """``sizes_from_headers`` for the files of a model spec (headers only: nothing is loaded)."""
    from mgpu_backend.ltx.gemma_file import text_stack_tensors
    from mgpu_backend.ltx.hf_gemma import gemma_folder_files
    from mgpu_backend.ltx.loading import is_gemma_file
    from mgpu_backend.ltx.safetensors_header import read_header

    checkpoint = read_header(spec.checkpoint_path, "checkpoint", "Choose the LTX-2 audio+video checkpoint.").tensors
    upsampler = None
    if spec.spatial_upsampler_path is not None:
        upsampler = read_header(spec.spatial_upsampler_path, "spatial upsampler", "Choose the LTX-2 spatial upscaler.").tensors
    gemma: Headers = {}
    if is_gemma_file(spec.gemma_root):  # ComfyUI's single file: its text stack, dequantized as it loads
        gemma = text_stack_tensors(spec.gemma_root)
    else:
        for path in gemma_folder_files(spec.gemma_root)[1]:
            gemma.update(read_header(path, "Gemma weights", "Restore the Gemma folder from the release.").tensors)
    return sizes_from_headers(checkpoint, upsampler, gemma, dtype)


# --- Device memory -----------------------------------------------------------------------------------


def gib_setting(environ, name: str, when_unset: str) -> int | None:
    """The bytes of a positive number of GiB in ``environ[name]``; None when unset or empty. Anything
    else is refused, naming the variable and what unsetting it does (``when_unset``)."""
    value = number_setting(environ, name, float, lambda gib: 0 < gib < math.inf, "a positive number of GiB", f"to {when_unset}")
    return None if value is None else int(value * GIB)


def device_memory_bytes(device: torch.device) -> int | None:
    """The memory this rank may use on ``device``: ``MGPU_MEMORY_LIMIT_GIB`` when set, else a GPU's
    total memory times this process's memory fraction; None (no limit) for a CPU rank."""
    limit = gib_setting(os.environ, MEMORY_LIMIT_ENV, "use the GPU's memory")
    if limit is not None:
        return limit
    device = torch.device(device)
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = torch.cuda.get_per_process_memory_fraction(device) if hasattr(torch.cuda, "get_per_process_memory_fraction") else 1.0
    return int(total * fraction)


def gpu_room_bytes(index: int) -> int:
    """The bytes this process may still take on GPU ``index``: the GPU's free memory, and no more than
    its limit (``device_memory_bytes``) less what this process already holds (reserved by its allocator).
    Ranks that share a GPU each see their own cap here, not the GPU's free memory alone."""
    device = torch.device("cuda", index)
    free = torch.cuda.mem_get_info(index)[0]
    return max(0, min(free, device_memory_bytes(device) - torch.cuda.memory_reserved(device)))


# --- The decision ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResidencyPlan:
    """What stays resident; ``keeps(name)`` answers for a ``ResidentModel`` component."""

    policy: str
    per_stage: frozenset[str]  # components built for their stage and released after it
    clean_shard_on_host: bool | None  # None: the weight tracker decides (its own rule)
    peak_bytes: int  # estimated peak of this plan
    budget_bytes: int | None
    quantization: str | None = None
    transformer_parked_for_encode: bool = False  # the working copy waits in host memory while Gemma encodes
    sharded_over: int = 1  # ranks the transformer's weights are sharded over (1: a whole copy per rank)
    gemma_split: int = 1  # GPUs a sharded plan's Gemma is spread over at its encode
    clean_device_bytes: int = 0  # the clean LoRA copy's bytes this plan counts on the device
    gemma_streamed: bool = False  # Gemma's layers beyond the device's room stay in host memory, streamed at the encode

    @property
    def shards_weights(self) -> bool:
        return self.sharded_over > 1

    def keeps(self, component: str) -> bool:
        return component not in self.per_stage

    def describe(self) -> str:
        budget = "no device limit" if self.budget_bytes is None else f"{self.budget_bytes / GIB:.1f} GiB device memory"
        per_stage = ", ".join(sorted(self.per_stage)) or "none"
        shard = {None: "by the tracker's rule", True: "in host memory", False: "on the device"}[self.clean_shard_on_host]
        weights = self.quantization or "unquantized"
        return (
            f"residency {self.policy}: estimated peak {self.peak_bytes / GIB:.1f} GiB of {budget} ({weights} transformer); "
            f"built per stage: {per_stage}; clean LoRA shard {shard}"
            + ("; transformer parked in host memory while Gemma encodes" if self.transformer_parked_for_encode else "")
            + (f"; transformer weights sharded over {self.sharded_over} ranks, gathered block by block" if self.shards_weights else "")
            + ("; Gemma's layers beyond the device's room streamed from host memory at the encode" if self.gemma_streamed else "")
        )


def _headroom(headroom: int) -> dict[str, int]:
    """The planner's activations per stage: ``headroom``, and at most ``ENCODE_HEADROOM_BYTES`` for the encode."""
    return {stage: min(headroom, ENCODE_HEADROOM_BYTES) if stage == "encode" else headroom for stage in STAGE_COMPONENTS}


def _stage_peaks(sizes: ComponentSizes, quantization, per_stage: set[str], shard_bytes: int, activations: dict[str, int],
                 parked: bool = False, sharded_over: int = 1, gemma_split: int = 1,
                 gemma_streamed_under: int | None = None) -> dict[str, int]:  # fmt: skip
    """Each stage's estimated device bytes: what stays resident + what the stage builds + its activations.
    A transformer parked for the encode (with its clean shard, when that is on the device) is not there then.
    Sharded over several ranks, the transformer counts its shard and gathered blocks in the stages that
    run it, its shard at rest in the others (encode, decode), and a Gemma built for the encode
    1/``gemma_split`` (one copy spread over that many GPUs). A Gemma built for the encode is gone before the
    embeddings processor is built, so the encode counts the larger of the two. With ``gemma_streamed_under``
    (a device budget), that Gemma takes what the budget leaves beside the rest of the encode, and at least
    its streamed floor (``ComponentSizes.gemma_streamed_bytes``): the rest stays in host memory."""
    if sharded_over > 1:
        running = sizes.sharded_transformer(quantization, sharded_over) + shard_bytes
        at_rest = sizes.sharded_transformer_at_rest(quantization, sharded_over) + shard_bytes
    else:
        running = at_rest = sizes.transformer(quantization) + shard_bytes
    transformer = {"encode": 0 if parked else at_rest, "sample": running, "upscale": running, "decode": at_rest}

    def built(name: str) -> int:
        size = sizes.components.get(name, 0)
        return math.ceil(size / gemma_split) if name == "gemma" and sharded_over > 1 else size

    others = sum(size for name, size in sizes.components.items() if name not in per_stage)
    peaks = {
        stage: transformer[stage] + others + sum(built(name) for name in names if name in per_stage) + activations[stage]
        for stage, names in STAGE_COMPONENTS.items()
    }
    if "gemma" in per_stage:
        # A Gemma built for the encode is released before the embeddings processor is built
        # (``distributed_gemma``): the stage peaks with the larger of the two, not both.
        processor = built("embeddings_processor") if "embeddings_processor" in per_stage else 0
        base = peaks["encode"] - built("gemma") - processor
        gemma = built("gemma")
        if gemma_streamed_under is not None:
            gemma = min(gemma, max(sizes.gemma_streamed_bytes, gemma_streamed_under - base))
        peaks["encode"] = base + max(gemma, processor)
    return peaks


def _peak(sizes: ComponentSizes, quantization, per_stage: set[str], shard_bytes: int, headroom: int, parked: bool = False,
          sharded_over: int = 1, gemma_split: int = 1, gemma_streamed_under: int | None = None) -> int:  # fmt: skip
    peaks = _stage_peaks(sizes, quantization, per_stage, shard_bytes, _headroom(headroom), parked, sharded_over, gemma_split, gemma_streamed_under)
    return max(peaks.values())


def gemma_gpus(world_size: int, environ: dict | None = None) -> int:
    """The GPUs a fleet of ``world_size`` ranks spreads one sharded Gemma over: one per rank, or
    ``world_size / MGPU_SHARED_GPU_RANKS`` when ranks share GPUs (ranks on one GPU share no Gemma:
    rank 0's process builds it there, whole on a single GPU)."""
    return max(1, world_size // shared_gpu_ranks(environ))


def _sharded_levels(sizes: ComponentSizes, budget_bytes, world_size: int, quantization, lora_swap: bool,
                    headroom: int, name: str, gemma_split: int | None = None) -> list[ResidencyPlan]:  # fmt: skip
    """The sharded plans over ``world_size`` ranks, least evicted first: the unsharded ladder's
    per-stage components, then the clean rows in host memory, then the shard parked while Gemma encodes,
    then (under a budget) Gemma's layers beyond it streamed from host memory.
    Gemma spreads over ``gemma_split`` GPUs (default: one per rank)."""
    gemma_split = world_size if gemma_split is None else gemma_split
    shard = math.ceil(sizes.transformer(quantization) / world_size) if lora_swap else 0
    plans = []
    for per_stage, on_host, parked, streamed in _ladder(budget_bytes):
        clean = 0 if on_host else shard
        peak = _peak(sizes, quantization, per_stage, clean, headroom, parked, world_size, gemma_split, budget_bytes if streamed else None)
        plans.append(ResidencyPlan(name, frozenset(per_stage), on_host, peak, budget_bytes, quantization, parked, world_size, gemma_split, clean, streamed))
    return plans


def _ladder(budget_bytes: int | None) -> list[tuple[set[str], bool, bool, bool]]:
    """The residency levels, least given up first: ``(built per stage, clean shard on host, transformer
    parked for the encode, Gemma streamed)``: ``EVICTION_ORDER``'s groups one after the other, then the
    clean shard to host memory, then the transformer parked, then (only under a budget, which sets how
    much of Gemma stays on the device) Gemma's other layers streamed from host memory."""
    evicted: set[str] = set()
    per_stage = [set()] + [evicted := evicted | set(group) for group in EVICTION_ORDER]
    levels = [(level, False, False, False) for level in per_stage]
    levels += [(per_stage[-1], True, False, False), (per_stage[-1], True, True, False)]
    if budget_bytes is not None:
        levels.append((per_stage[-1], True, True, True))
    return levels


def plan_residency(
    sizes: ComponentSizes,
    budget_bytes: int | None,
    world_size: int = 1,
    policy: str = "auto",
    quantization: str | None = None,
    lora_swap: bool = True,
    headroom_bytes: int = HEADROOM_BYTES,
    gemma_split: int | None = None,
) -> ResidencyPlan:
    """The plan for ``policy``; raises ``ResidencyError`` when even the minimal plan exceeds the budget.
    ``gemma_split``: the GPUs a sharded plan spreads Gemma over (default ``gemma_gpus(world_size)``)."""
    policy = parse_residency(policy)
    quantization = fp8.parse_quantization(quantization)
    gemma_split = gemma_gpus(world_size) if gemma_split is None else gemma_split
    if policy == "sharded":
        if world_size < 2:
            raise ResidencyError(
                "residency 'sharded' spreads the transformer over the fleet's ranks, but this fleet has 1 rank; "
                "start the fleet on 2 or more GPUs, or choose residency 'auto'"
            )
        levels = _sharded_levels(sizes, budget_bytes, world_size, quantization, lora_swap, headroom_bytes, "sharded", gemma_split)
        for plan in levels:
            if budget_bytes is None or plan.peak_bytes <= budget_bytes:
                return plan
        raise ResidencyError(_does_not_fit(sizes, quantization, budget_bytes, levels[-1], headroom_bytes, min(world_size, gemma_split)))
    shard = math.ceil(sizes.transformer(quantization) / world_size) if lora_swap else 0
    levels = _ladder(budget_bytes)

    def plan_at(level: int, name: str) -> ResidencyPlan:
        per_stage, on_host, parked, streamed = levels[level]
        clean = 0 if on_host else shard
        peak = _peak(sizes, quantization, per_stage, clean, headroom_bytes, parked, gemma_streamed_under=budget_bytes if streamed else None)
        return ResidencyPlan(name, frozenset(per_stage), on_host, peak, budget_bytes, quantization, parked, clean_device_bytes=clean, gemma_streamed=streamed)

    # The lightest level that fits; Gemma is streamed only where the level before it does not fit.
    minimal = plan_at(len(levels) - 1, "minimal")
    if minimal.gemma_streamed and (unstreamed := plan_at(len(levels) - 2, "minimal")).peak_bytes <= budget_bytes:
        minimal = unstreamed
    if budget_bytes is not None and minimal.peak_bytes > budget_bytes:
        if policy == "auto" and world_size > 1:
            for plan in _sharded_levels(sizes, budget_bytes, world_size, quantization, lora_swap, headroom_bytes, "auto", gemma_split):
                if plan.peak_bytes <= budget_bytes:
                    return plan
        raise ResidencyError(_does_not_fit(sizes, quantization, budget_bytes, minimal, headroom_bytes, min(world_size, gemma_split)))
    if policy == "minimal":
        return minimal
    if policy == "all":
        plan = plan_at(0, "all")
        return ResidencyPlan("all", plan.per_stage, None, plan.peak_bytes, budget_bytes, quantization, clean_device_bytes=plan.clean_device_bytes)
    for level in range(len(levels)):
        plan = plan_at(level, "auto")
        if budget_bytes is None or plan.peak_bytes <= budget_bytes:
            return plan
    return minimal  # unreachable: the minimal level fits (checked above)


JOB_PHASES = ("load", "encode", "stage 1", "upscale", "decode")
"""The jobs of one whole job, as the fleet runs them (``upscale``: the upsampler, then stage 2)."""
_PHASE_STAGES = {"encode": "encode", "stage 1": "sample", "upscale": "upscale", "decode": "decode"}


def video_decode_activation_bytes(width: int, height: int, frames: int, world_size: int,
                                  spatial_tile_pixels: int = DECODE_SPATIAL_TILE_PIXELS,
                                  temporal_tile_frames: int = DECODE_TEMPORAL_TILE_FRAMES) -> int:  # fmt: skip
    """The most one rank holds beside the weights while the video of ``width`` x ``height`` x ``frames``
    decodes over ``world_size`` ranks in bf16 with the decode's tiles: its weighted tiles, a temporal
    group's buffer, rank 0's frame window and hand-outs as images (``distributed_decode.assembly_peak_estimate``,
    the decode's own schedule), and ``DECODE_TILE_ACTIVATION_BYTES`` while a tile decodes."""
    from mgpu_backend.ltx.decode import decode_tiling
    from mgpu_backend.parallel.distributed_decode import assembly_peak_estimate

    tiling = decode_tiling(spatial_tile_pixels, temporal_tile_frames)
    latent_shape = (1, VIDEO_LATENT_CHANNELS, (frames - 1) // VIDEO_TEMPORAL_COMPRESSION + 1,
                    height // VIDEO_SPATIAL_COMPRESSION, width // VIDEO_SPATIAL_COMPRESSION)  # fmt: skip
    element_size = torch.empty((), dtype=torch.bfloat16).element_size()
    return max(
        assembly_peak_estimate(latent_shape, tiling, world_size, rank, element_size, tile_activation_bytes=DECODE_TILE_ACTIVATION_BYTES)
        for rank in range(world_size)
    )


def job_peaks(sizes: ComponentSizes, plan: ResidencyPlan, stage1_activation_bytes: int, stage2_activation_bytes: int,
              video_decode_bytes: int) -> dict[str, int]:  # fmt: skip
    """One rank's estimated peak in each job of a whole job (``JOB_PHASES``) under ``plan``: the plan's
    stages with this job's activations in place of the headroom (stage 1's and stage 2's transformer
    activations per rank, ``validation.estimate_memory_bytes``; the encode's ``ENCODE_HEADROOM_BYTES``;
    the video decode's ``video_decode_bytes``, ``video_decode_activation_bytes``). The load job holds the
    transformer at rest (a sharded one: its shard, nothing gathered) and builds every component once, a
    per-stage one released before the next is built, Gemma not at all. The decode job decodes the video
    first, with the video decoder alone built, then the audio with the audio decoder and vocoder beside
    it; it peaks in the larger of the two."""
    activations = {"encode": ENCODE_HEADROOM_BYTES, "sample": stage1_activation_bytes, "upscale": stage2_activation_bytes,
                   "decode": 0}  # fmt: skip
    peaks = _stage_peaks(sizes, plan.quantization, set(plan.per_stage), plan.clean_device_bytes, activations,
                         plan.transformer_parked_for_encode, plan.sharded_over, plan.gemma_split,
                         plan.budget_bytes if plan.gemma_streamed else None)  # fmt: skip
    audio_built = sum(sizes.components.get(name, 0) for name in ("audio_decoder", "vocoder") if name in plan.per_stage)
    peaks["decode"] = max(peaks["decode"] - audio_built + video_decode_bytes, peaks["decode"] + AUDIO_DECODE_ACTIVATION_BYTES)
    at_rest = math.ceil(sizes.transformer(plan.quantization) / plan.sharded_over)
    resident = sum(size for name, size in sizes.components.items() if name not in plan.per_stage)
    built_at_load = max((size for name, size in sizes.components.items() if name in plan.per_stage and name != "gemma"), default=0)
    return {"load": at_rest + plan.clean_device_bytes + resident + built_at_load, **{phase: peaks[stage] for phase, stage in _PHASE_STAGES.items()}}


SHARDING_WORLD_SIZES = (2, 4, 8)
"""The fleet sizes a refusal looks at when it says over how many GPUs sharding would fit."""


def _sharded_peak(sizes: ComponentSizes, quantization, world_size: int, headroom: int, budget: int, gemma_split: int | None = None) -> int:
    """The lightest sharded plan's peak over ``world_size`` ranks under ``budget`` (everything per stage, clean
    rows on host, Gemma streamed beyond the budget), Gemma spread over ``gemma_split`` GPUs (default: one per rank)."""
    return _sharded_levels(sizes, budget, world_size, quantization, False, headroom, "sharded", gemma_split)[-1].peak_bytes


def _sharding_advice(sizes: ComponentSizes, quantization, budget: int, headroom: int, fleet_size: int, at_least: int = 2) -> str:
    """Over how many GPUs (``at_least`` or more) residency 'sharded' would fit, in the weights asked
    for or else fp8-cast, fewest GPUs first; or that it would not."""
    worlds = sorted({fleet_size, *SHARDING_WORLD_SIZES} - {1})
    candidates = [world for world in worlds if world >= at_least] or [at_least]
    for world in candidates:
        for weights in dict.fromkeys([quantization, "fp8-cast"]):
            peak = _sharded_peak(sizes, weights, world, headroom, budget)
            if peak <= budget:
                where = "on this fleet's" if world == fleet_size else "on"
                cast = " with quantization 'fp8-cast'" if weights != quantization else ""
                return f"shard the transformer over the GPUs (residency 'sharded'{cast}: about {peak / GIB:.1f} GiB per GPU {where} {world} GPUs)"
    peak = _sharded_peak(sizes, "fp8-cast", candidates[-1], headroom, budget)
    return f"sharding the transformer over {candidates[-1]} GPUs would still need about {peak / GIB:.1f} GiB per GPU (fp8-cast)"


def _does_not_fit(sizes: ComponentSizes, quantization, budget: int, minimal: ResidencyPlan, headroom: int, gpus: int = 1) -> str:
    """Why the lightest plan does not fit and what would; ``gpus``: the fleet's GPUs (fewer than its ranks
    when ranks share GPUs)."""
    if minimal.shards_weights:
        ranks, gpus = minimal.sharded_over, minimal.gemma_split
        advice = _sharding_advice(sizes, quantization, budget, headroom, ranks, 2 * ranks)
        if quantization is None:
            fp8_peak = _sharded_peak(sizes, "fp8-cast", ranks, headroom, budget, gpus)
            if fp8_peak <= budget:
                advice = f"load it with quantization 'fp8-cast' (estimated peak {fp8_peak / GIB:.1f} GiB sharded), or {advice}"
        return (
            f"this model needs about {minimal.peak_bytes / GIB:.1f} GiB per GPU even with its transformer sharded over "
            f"{ranks} ranks and every other component built per stage, but the device has {budget / GIB:.1f} GiB; "
            f"{advice}, or use GPUs with more memory"
        )
    parked, streamed_under = minimal.transformer_parked_for_encode, budget if minimal.gemma_streamed else None
    peaks = _stage_peaks(sizes, quantization, set(minimal.per_stage), 0, _headroom(headroom), parked, gemma_streamed_under=streamed_under)
    stage = max(peaks, key=peaks.get)  # the stage that sets the peak
    names = [name for name in STAGE_COMPONENTS[stage] if name in minimal.per_stage]
    built = sum(sizes.components.get(name, 0) for name in names)
    if parked and stage == "encode":
        needed = (
            f"the encode stage builds {', '.join(names)}: {built / GIB:.1f} GiB, with the transformer parked in host memory, "
            "plus activations"
        )
    else:
        needed = (
            f"the transformer alone is {sizes.transformer(quantization) / GIB:.1f} GiB, and the {stage} stage builds "
            f"{', '.join(names) or 'nothing'} beside it: {built / GIB:.1f} GiB, plus activations"
        )
    if quantization is None:
        fp8_peak = _peak(sizes, "fp8-cast", set(minimal.per_stage), 0, headroom, parked, gemma_streamed_under=streamed_under)
        if fp8_peak <= budget:
            advice = (
                f"load it with quantization 'fp8-cast' (transformer {sizes.transformer('fp8-cast') / GIB:.1f} GiB, "
                f"estimated peak {fp8_peak / GIB:.1f} GiB), or use a GPU with more memory"
            )
        else:
            advice = f"even fp8-cast weights would need about {fp8_peak / GIB:.1f} GiB; use a GPU with more memory"
    else:
        advice = "use a GPU with more memory"
    return (
        f"this model needs about {minimal.peak_bytes / GIB:.1f} GiB per GPU even with residency 'minimal' ({needed}), "
        f"but the device has {budget / GIB:.1f} GiB; {advice}. Otherwise "
        f"{_sharding_advice(sizes, quantization, budget, headroom, gpus)}"
    )
