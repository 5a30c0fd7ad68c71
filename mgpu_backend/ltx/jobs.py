"""LTX-2 job types of the fleet: load, encode, sample (stage 1), upscale (stage 2), decode, unload.

Each job runs on every rank at once. It first checks its inputs (clear ``JobInputError`` before any
heavy work, so the fleet stays as it was), then runs the stage functions of ``stages`` / ``text`` /
``decode`` with the parallel technique of that stage plugged in:

- sample: the stage-1 plan (sequence parallel inside guidance groups) from ``guidance_parallel``;
- upscale: tiled data parallel around the stage-2 transformer;
- decode: the distributed decoder, frames written straight into shared memory on rank 0.

Every job names its model spec; the rank keeps one model resident (``ResidentModel``), so a job with
the same spec reads nothing from disk, and a fleet that restarted reloads on the next job by itself.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from ltx_core.components.guiders import MultiModalGuiderParams
from ltx_core.model.video_vae import SpatialTilingConfig, TemporalTilingConfig, TilingConfig

from mgpu_kernels import install_fast_all_to_all

from mgpu_backend.fleet.jobs import JobContext, JobInputError, job, keep_across_replacement
from mgpu_backend.parallel.batched_passes import batch_passes_wanted, batching_runner
from mgpu_backend.parallel.compiled_blocks import compile_blocks_wanted, compiled_blocks
from mgpu_backend.parallel.cuda_graphs import CapturingPassRunner, cuda_graphs_wanted
from mgpu_backend.parallel.distributed_gemma import GEMMA_MODES, encode_prompts_distributed, last_encode_stats, release_text_encoders
from mgpu_backend.parallel.distributed_decode import decoded_images_shape, distributed_decode_images, last_decode_stats
from mgpu_backend.parallel.guidance_parallel import build_stage1_parallel, plan_stage1
from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel, remove_sequence_parallel, sequence_parallel_degree
from mgpu_backend.parallel.weight_tracker import TransformerWeightTracker
from mgpu_backend.parallel.tiled_data_parallel import DimensionTiling, TileCounts, VideoTilePlan, apply_tiled_data_parallel, balanced_tile_split
from mgpu_backend.ltx.decode import decode_audio
from mgpu_backend.ltx.latents import StageGeometry, job_generator
from mgpu_backend.ltx.loading import ModelFileError, ModelLoader, ModelSpec
from mgpu_backend.ltx.stages import GenerationParams, check_generation_fits, refine_stage2, sample_stage1, transformer_layer_count, upsample_video
from mgpu_backend.ltx.text import TextContext
from mgpu_backend.ltx.validation import TransformerDims, validate_stg_blocks

log = logging.getLogger("mgpu.ltx")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
MAX_PROMPTS = 16
MAX_PROMPT_CHARS = 20_000
VIDEO_LATENT_CHANNELS = 128
OFFICIAL_STG_BLOCK = 29  # ltx-pipelines 1.0.0 default, for the 48-block LTX-2 19B model


@contextmanager
def input_errors():
    """Turn the ValueErrors of input checks into JobInputError: the user's mistake, not a fault."""
    try:
        yield
    except JobInputError:
        raise
    except (ValueError, ModelFileError, FileNotFoundError, TypeError) as exc:
        raise JobInputError(str(exc)) from exc


class ResidentModel:
    """One model spec loaded in this rank: one ``ModelLoader`` (one state-dict registry) and every
    component built once and kept, so warm jobs neither read the disk nor rebuild modules.

    It answers the calls the stage functions make of a loader (``transformer(lora_set)``,
    ``video_encoder()``, ...), returning the kept instances.
    """

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, comm) -> None:
        self.spec, self.device, self.dtype = spec, device, dtype
        self.loader = ModelLoader(spec, device, dtype)
        self.components: dict[tuple, torch.nn.Module] = {}
        self.load_seconds = 0.0  # time spent building components from files or the registry
        # One working transformer per rank; a clean copy sharded over the ranks lets stage 1 (no
        # LoRA) and stage 2 (distilled LoRA) swap in place. Without any LoRA, no clean copy is kept.
        self.tracker = TransformerWeightTracker(comm, no_lora_swap=spec.distilled_lora is None and not spec.loras)

    def _kept(self, name: str, *args):
        key = (name, *args)
        if key not in self.components:
            started = time.perf_counter()
            self.components[key] = getattr(self.loader, name)(*args)
            self.load_seconds += time.perf_counter() - started
        return self.components[key]

    def transformer(self, lora_set: str = "none"):
        """The working transformer with the stage's LoRAs fused (collective on a LoRA swap)."""
        started = time.perf_counter()
        model = self.tracker.transformer(self.loader, lora_set)
        self.load_seconds += time.perf_counter() - started
        return model

    def video_encoder(self):
        return self._kept("video_encoder")

    def video_decoder(self):
        return self._kept("video_decoder")

    def audio_decoder(self):
        return self._kept("audio_decoder")

    def vocoder(self):
        return self._kept("vocoder")

    def spatial_upsampler(self):
        return self._kept("spatial_upsampler")

    def gemma(self):
        return self._kept("gemma")

    def embeddings_processor(self):
        return self._kept("embeddings_processor")

    @property
    def bytes_read_from_disk(self) -> int:
        return self.loader.bytes_read_from_disk

    def memory_report(self) -> dict:
        """What this rank holds of the model, for ``status``: transformer working copy, clean shard,
        the other components (VAEs, vocoder, upsampler, connectors), and the host copies its loader
        keeps (LoRA files, the small components; not the resident transformer or Gemma)."""
        tracker = self.tracker.memory_report()
        report = {key: value for key, value in tracker.items() if key.endswith("_bytes")}
        report["clean_shard_device"] = tracker["clean_shard_device"]
        report["other_components_bytes"] = sum(
            tensor.nbytes for module in self.components.values() for tensor in (*module.parameters(), *module.buffers())
        )
        report["host_copies_bytes"] = self.loader.host_copy_bytes
        return report

    def layer_count(self) -> int:
        return transformer_layer_count(self.transformer("none"))

    def attention_heads(self) -> tuple[int, int]:
        velocity_model = self.transformer("none").velocity_model
        block = velocity_model.transformer_blocks[0]
        return block.attn1.heads, block.audio_attn1.heads


# A survivor of a rank replacement keeps its model: the weight tracker brings a rebuilt rank in
# (``TransformerWeightTracker.transformer``), and the other components are built with no collective.
keep_across_replacement("model")


def resident_model(ctx: JobContext, args: dict) -> ResidentModel:
    """The model the job names, loading it (and dropping another) when it is not resident yet."""
    with input_errors():
        if not isinstance(args.get("spec"), dict):
            raise JobInputError("the job needs a model 'spec' object (see ModelSpec.to_json)")
        spec = ModelSpec.from_json(args["spec"])
        dtype_name = args.get("dtype", "bfloat16")
        if dtype_name not in DTYPES:
            raise JobInputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype_name!r}")
        dtype = DTYPES[dtype_name]
        resident = ctx.state.get("model")
        if resident is not None and resident.spec == spec and resident.dtype == dtype:
            return resident
        unload_models(ctx)
        resident = ResidentModel(spec, ctx.device, dtype, ctx.comm)  # validates the files from their headers
    ctx.state["model"] = resident
    return resident


def unload_models(ctx: JobContext) -> None:
    resident = ctx.state.get("model")
    if resident is not None:
        release_text_encoders(resident.loader)
    for key in ("model", "stage1_parallel"):
        ctx.state.pop(key, None)
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


# -- argument checks ---------------------------------------------------------------------------


def _int(args: dict, name: str, default: int | None = None, low: int = 0, high: int = 2**31) -> int:
    value = args.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise JobInputError(f"{name} must be an integer from {low} to {high}, got {value!r}")
    return value


def _float(args: dict, name: str, default: float, low: float = -math.inf, high: float = math.inf) -> float:
    value = args.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise JobInputError(f"{name} must be a number from {low} to {high}, got {value!r}")
    return float(value)


def _guider(args: dict, name: str, layer_count: int) -> MultiModalGuiderParams:
    """Guidance parameters; ``stg_blocks: null`` means the official block 29, or the last block of a
    model that has fewer (the tiny test bundle)."""
    guidance = args.get(name, {})
    if not isinstance(guidance, dict):
        raise JobInputError(f"{name} must be an object")
    blocks = guidance.get("stg_blocks")
    if blocks is None:
        blocks = [min(OFFICIAL_STG_BLOCK, layer_count - 1)]
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise JobInputError(f"{name}.stg_blocks must be a list of block indices")
    return MultiModalGuiderParams(
        cfg_scale=_float(guidance, "cfg_scale", 3.0, 0.0, 100.0),
        stg_scale=_float(guidance, "stg_scale", 1.0, 0.0, 100.0),
        rescale_scale=_float(guidance, "rescale_scale", 0.7, 0.0, 1.0),
        modality_scale=_float(guidance, "modality_scale", 3.0, 0.0, 100.0),
        skip_step=_int(guidance, "skip_step", 0, 0, 1000),
        stg_blocks=blocks,
    )


def _context(tensors: dict, prefix: str) -> TextContext:
    names = (f"{prefix}_video_context", f"{prefix}_audio_context")
    missing = [name for name in names if name not in tensors]
    if missing:
        raise JobInputError(f"missing {', '.join(missing)}: encode the prompts with the MGPU text encoder first")
    for name in names:
        if tensors[name].ndim != 3 or tensors[name].shape[0] != 1:
            raise JobInputError(f"{name} must be [1, tokens, dim], got {tuple(tensors[name].shape)}")
    return TextContext(video_context=tensors[names[0]], audio_context=tensors[names[1]])


def _moved(context: TextContext, resident: ResidentModel) -> TextContext:
    to = dict(device=resident.device, dtype=resident.dtype)
    return TextContext(context.video_context.to(**to), context.audio_context.to(**to))


def _image(tensors: dict) -> torch.Tensor | None:
    image = tensors.get("image")
    if image is None:
        return None
    if image.ndim == 4 and image.shape[0] >= 1:
        image = image[0]  # a ComfyUI IMAGE batch: the first frame conditions the video
    if image.ndim != 3 or image.shape[-1] != 3 or not image.is_floating_point():
        raise JobInputError(f"image must be float [height, width, 3] in 0..1, got {image.dtype} {tuple(image.shape)}")
    return image.float()


def _video_latent(tensors: dict, what: str) -> torch.Tensor:
    latent = tensors.get("video_latent")
    if latent is None or latent.ndim != 5 or latent.shape[0] != 1 or latent.shape[1] != VIDEO_LATENT_CHANNELS:
        shape = None if latent is None else tuple(latent.shape)
        raise JobInputError(f"{what} needs one LTX-2 video latent [1, 128, F', H/32, W/32], got {shape}")
    return latent.float()


def _geometry_of(latent: torch.Tensor, frame_rate: float) -> tuple[int, int, int]:
    """Pixel (height, width, frames) of a video latent: 32x spatial, 8x temporal (+1) compression."""
    _, _, latent_frames, latent_height, latent_width = latent.shape
    return latent_height * 32, latent_width * 32, (latent_frames - 1) * 8 + 1


def _progress(ctx: JobContext, stage: str) -> Callable[[int, int], None]:
    return lambda step, total: ctx.step(stage, step, total)


# -- jobs --------------------------------------------------------------------------------------


def ltx_job(name: str):
    """Register an LTX-2 job that reports, in the job log, what it read from disk and how long it
    spent building weights (0 bytes on a warm fleet)."""

    def register(fn):
        @job(name)
        @functools.wraps(fn)
        def run(ctx: JobContext, args: dict, tensors: dict):
            before = ctx.state.get("model")
            bytes_before = before.bytes_read_from_disk if before is not None else 0
            seconds_before = before.load_seconds if before is not None else 0.0
            result = fn(ctx, args, tensors)
            after = ctx.state.get("model")
            if after is not None:
                if after is not before:
                    bytes_before, seconds_before = 0, 0.0
                read = after.bytes_read_from_disk - bytes_before
                ctx.log(f"{name}: {read / 2**20:.1f} MiB read from disk, {after.load_seconds - seconds_before:.2f} s building weights")
            return result

        return run

    return register



@ltx_job("load")
def load(ctx: JobContext, args: dict, tensors: dict):
    """Load every component of the model into this rank (a no-op for the resident model)."""
    started = time.perf_counter()
    resident = resident_model(ctx, args)
    builders = [("transformer", "none"), ("video_encoder",), ("video_decoder",), ("audio_decoder",), ("vocoder",), ("embeddings_processor",)]
    if resident.spec.spatial_upsampler_path is not None:
        builders.append(("spatial_upsampler",))
    for index, (name, *extra) in enumerate(builders, start=1):
        getattr(resident, name)(*extra)
        ctx.step("load", index, len(builders))
    seconds = time.perf_counter() - started
    return {
        "bytes_read": resident.bytes_read_from_disk,
        "load_seconds": seconds,
        "layers": resident.layer_count(),
        "components": sorted({"transformer", *(key[0] for key in resident.components)}),
        "weights": resident.tracker.memory_report(),
    }, {}


@ltx_job("encode")
def encode(ctx: JobContext, args: dict, tensors: dict):
    """Video and audio text contexts of each prompt (Gemma + the checkpoint's connectors)."""
    prompts = args.get("prompts")
    if not isinstance(prompts, list) or not 0 < len(prompts) <= MAX_PROMPTS or not all(isinstance(p, str) for p in prompts):
        raise JobInputError(f"prompts must be a list of 1 to {MAX_PROMPTS} strings")
    if any(len(prompt) > MAX_PROMPT_CHARS for prompt in prompts):
        raise JobInputError(f"a prompt is longer than {MAX_PROMPT_CHARS} characters; shorten it")
    gemma_mode = args.get("gemma_mode", "sharded")
    if gemma_mode not in GEMMA_MODES:
        raise JobInputError(f"gemma_mode must be one of {', '.join(GEMMA_MODES)}, got {gemma_mode!r}")
    resident = resident_model(ctx, args)
    contexts = encode_prompts_distributed(resident.loader, prompts, ctx.comm, gemma_mode, free_after=bool(args.get("free_gemma", False)))
    stats = last_encode_stats()
    where = f", Gemma on {stats['gemma_placement']}" if stats.get("gemma_placement") else ""
    ctx.log(f"text encode ({gemma_mode}): {stats.get('encoded_here', 0)} prompt(s) on this rank in {stats.get('seconds', 0):.2f} s{where}")
    ctx.step("encode", 1, 1)
    out = {}
    for index, context in enumerate(contexts):
        out[f"video_context_{index}"] = context.video_context.float().cpu()
        out[f"audio_context_{index}"] = context.audio_context.float().cpu()
    return {"prompts": len(prompts)}, out


def active_passes(video: MultiModalGuiderParams, audio: MultiModalGuiderParams) -> list[str]:
    """The guidance passes a step runs at most (the planner sizes the groups for them)."""
    passes = ["conditional"]
    if video.cfg_scale != 1.0 or audio.cfg_scale != 1.0:
        passes.append("unconditional")
    if video.stg_scale != 0.0 or audio.stg_scale != 0.0:
        passes.append("perturbed")
    if video.modality_scale != 1.0 or audio.modality_scale != 1.0:
        passes.append("isolated")
    return passes


def sp_all_to_all(sp_comm, device: torch.device) -> str:
    """Which all-to-all the SP exchange uses on GPUs: NCCL unless ``MGPU_ALL_TO_ALL=ipc``.

    The CUDA-IPC kernel is exact, but across two H200s it moved 16 MiB at 150 GB/s against NCCL's
    159 GB/s (docs/BENCHMARKS.md) and it synchronises the host once per exchange, so NCCL stays
    the default until multi-GPU measurements show sizes where the kernel wins (issue 11).
    """
    if os.environ.get("MGPU_ALL_TO_ALL", "").strip().lower() != "ipc":
        return "torch.distributed (NCCL; MGPU_ALL_TO_ALL=ipc selects the CUDA-IPC kernel)"
    return install_fast_all_to_all(sp_comm, device)  # collective; falls back to torch.distributed by itself


def stage1_parallel(ctx: JobContext, resident: ResidentModel, video_tokens: int, passes: list[str], mode: str):
    """Plan stage 1 over the fleet, build its groups (once per layout) and put SP on the transformer."""
    video_heads, audio_heads = resident.attention_heads()
    with input_errors():
        plan = plan_stage1(ctx.world_size, video_tokens, passes, mode, attention_heads=video_heads, audio_attention_heads=audio_heads)
    layouts = ctx.state.setdefault("stage1_parallel", {})
    layout = (plan.guidance_groups, plan.sp_degree)
    if layout not in layouts:
        sp_comm, runner = build_stage1_parallel(ctx.comm, plan)
        if ctx.device.type == "cuda" and sp_comm.world_size > 1:
            ctx.log(f"sequence-parallel all-to-all: {sp_all_to_all(sp_comm, ctx.device)}")
        layouts[layout] = sp_comm, runner
    sp_comm, runner = layouts[layout]
    transformer = resident.transformer("none")
    if sp_comm.world_size > 1:
        apply_sequence_parallel(transformer, sp_comm)
    elif sequence_parallel_degree(transformer) > 1:
        remove_sequence_parallel(transformer)
    ctx.log(plan.reason)
    return plan, runner


@ltx_job("sample")
def sample(ctx: JobContext, args: dict, tensors: dict):
    """Stage 1: full-frame generation from noise, sequence/guidance parallel (faithful)."""
    resident = resident_model(ctx, args)
    layers = resident.layer_count()
    with input_errors():
        params = GenerationParams(
            height=_int(args, "height", 512, 32, 8192),
            width=_int(args, "width", 768, 32, 8192),
            num_frames=_int(args, "num_frames", 121, 1, 100_000),
            frame_rate=_float(args, "frame_rate", 24.0, 1.0, 240.0),
            seed=_int(args, "seed", 10, 0, 2**63 - 1),
            num_inference_steps=_int(args, "steps", 40, 1, 1000),
            video_guider=_guider(args, "video_guidance", layers),
            audio_guider=_guider(args, "audio_guidance", layers),
            two_stage=False,
        )
        params.validate()
        validate_stg_blocks(params.video_guider, layers, "video")
        validate_stg_blocks(params.audio_guider, layers, "audio")
        positive, negative = _context(tensors, "positive"), _context(tensors, "negative")
        image = _image(tensors)
        mode = args.get("parallel", "auto")
        dims = TransformerDims.from_checkpoint(resident.spec.checkpoint_path)
        cuda_graphs = cuda_graphs_wanted(args.get("cuda_graphs"), ctx.device)
        compile_blocks = compile_blocks_wanted(args.get("compile_blocks"), ctx.device)
    batch_passes = args.get("batch_passes", "auto")
    return run_stage1(ctx, resident, params, positive, negative, image, mode, dims, cuda_graphs, batch_passes, compile_blocks)


def run_stage1(ctx: JobContext, resident, params: GenerationParams, positive: TextContext, negative: TextContext,
               image: torch.Tensor | None, mode: str, dims: TransformerDims, cuda_graphs: bool = True,
               batch_passes: str | bool = "auto", compile_blocks: bool = False):  # fmt: skip
    """Plan, memory check and the stage-1 loop: shared by ``sample`` and the benchmark job."""
    passes = active_passes(params.video_guider, params.audio_guider)
    plan, runner = stage1_parallel(ctx, resident, params.stage1.video_tokens, passes, mode)
    with input_errors():
        batched = batch_passes_wanted(batch_passes, plan, ctx.device)
    # Two answers to launch-bound shards, measured about equal on an H200: a group's passes as one
    # batched forward, or each pass replayed from a CUDA graph. They do not combine: ltx-core builds
    # per-sample perturbation masks on the host, which graph capture refuses.
    if batched:
        runner = batching_runner(runner)
    elif cuda_graphs and ctx.device.type == "cuda":
        runner = CapturingPassRunner(runner)
    with input_errors():
        check_generation_fits(params, ctx.device, dims, resident.dtype, sp_degree=plan.sp_degree, weights_resident=True)
    with compiled_blocks(resident.transformer("none"), compile_blocks):
        video, audio = sample_stage1(
            resident, params, _moved(positive, resident), _moved(negative, resident), image, pass_runner=runner, on_step=_progress(ctx, "stage1")
        )
    fields = {"plan": plan.reason, "sp_degree": plan.sp_degree, "guidance_groups": plan.guidance_groups, "batch_passes": batched, "compile_blocks": compile_blocks}
    if isinstance(runner, CapturingPassRunner):
        fields["cuda_graphs"] = runner.summary()
    return fields, {"video_latent": video.cpu(), "audio_latent": audio.cpu()}


def upscale_tiling(ctx: JobContext, args: dict, video_grid: tuple[int, int, int]) -> TileCounts | None:
    """The TDP tiling of the stage-2 latent grid, or None for the untiled (one-rank) stage 2.

    Tiles are (height, width) counts; with none given, a balanced split over the fleet. When the
    grid is too small for the requested overlap, the overlap shrinks to what fits (logged).
    """
    tiles, overlap = args.get("tiles"), _int(args, "overlap", 4, 0, 64)
    if tiles is None:
        if ctx.world_size == 1:
            return None
        tiles = list(balanced_tile_split(ctx.world_size))
    if not isinstance(tiles, list) or len(tiles) != 2 or not all(isinstance(t, int) and t >= 1 for t in tiles):
        raise JobInputError(f"tiles must be [height_tiles, width_tiles] of positive integers, got {tiles!r}")
    if tiles == [1, 1]:
        return None
    last_error = None
    for tried in range(overlap, -1, -1):
        tiling = TileCounts(height=DimensionTiling(tiles[0], tried), width=DimensionTiling(tiles[1], tried))
        try:
            VideoTilePlan(tiling, video_grid)  # raises when the tiles do not fit the grid
        except ValueError as exc:
            if args.get("tiles") is not None:  # the user's own tiling: say so rather than change it
                raise JobInputError(f"tiling {tiles[0]}x{tiles[1]} with overlap {tried} does not fit the {video_grid[1]}x{video_grid[2]} latent: {exc}") from exc
            last_error = exc
            continue
        if tried != overlap:
            ctx.log(f"TDP overlap reduced from {overlap} to {tried} latent cells to fit the {video_grid[1]}x{video_grid[2]} latent")
        return tiling
    raise JobInputError(f"the {video_grid[1]}x{video_grid[2]} latent is too small for {tiles[0]}x{tiles[1]} tiles: {last_error}")


@ltx_job("upscale")
def upscale(ctx: JobContext, args: dict, tensors: dict):
    """Stage 2: spatial 2x, then the distilled-LoRA refinement over TDP tiles; audio stays frozen."""
    resident = resident_model(ctx, args)
    with input_errors():
        video_latent = _video_latent(tensors, "TDP Upscale")
        audio_latent = tensors.get("audio_latent")
        if audio_latent is None:
            raise JobInputError("TDP Upscale needs the stage-1 audio latent too (the video attends to it)")
        frame_rate = _float(args, "frame_rate", 24.0, 1.0, 240.0)
        height, width, frames = _geometry_of(video_latent, frame_rate)
        sigmas = args.get("sigmas", [0.625, 0.4, 0.0])
        if not isinstance(sigmas, list) or len(sigmas) < 2 or not all(isinstance(s, (int, float)) for s in sigmas):
            raise JobInputError(f"sigmas must be a list of at least two numbers ending in 0, got {sigmas!r}")
        if sigmas[0] >= 1.0 and not args.get("force_from_noise", False):
            raise JobInputError(
                f"TDP refuses to start from pure noise (first sigma {sigmas[0]}): each tile would denoise on its own and the "
                "tiles would not agree on one video. Generate stage 1 with the SP Sampler and upscale that "
                "(default sigmas 0.625, 0.4, 0.0); set force_from_noise only to study the failure"
            )
        params = GenerationParams(
            height=height * 2, width=width * 2, num_frames=frames, frame_rate=frame_rate,
            seed=_int(args, "seed", 10, 0, 2**63 - 1), two_stage=True,
        )  # fmt: skip
        params.validate()
        positive = _context(tensors, "positive")
        image = _image(tensors)
        stage2_grid = (video_latent.shape[2], video_latent.shape[3] * 2, video_latent.shape[4] * 2)
        tiling = upscale_tiling(ctx, args, stage2_grid)
        dims = TransformerDims.from_checkpoint(resident.spec.checkpoint_path)
        check_generation_fits(params, ctx.device, dims, resident.dtype, weights_resident=True)
    upsampled = upsample_video(resident, video_latent)
    ctx.step("upsample", 1, 1)
    stage2_transformer = resident.transformer("distilled")  # the same working copy stage 1 used
    if sequence_parallel_degree(stage2_transformer) > 1:
        remove_sequence_parallel(stage2_transformer)  # stage 2 splits by tiles, not by tokens
    wrapper = None
    if tiling is not None:
        wrapper = lambda model: apply_tiled_data_parallel(model, ctx.comm, tiling, stage2_grid)  # noqa: E731
    video, audio = refine_stage2(
        resident, params, upsampled, audio_latent.float(), _moved(positive, resident), image,
        sigmas=sigmas, transformer_wrapper=wrapper, on_step=_progress(ctx, "stage2"),
    )  # fmt: skip
    tiles = "untiled" if tiling is None else tiling.describe()
    return {"tiling": tiles}, {"video_latent": video.cpu(), "audio_latent": audio.cpu()}


def decode_tiling(args: dict) -> TilingConfig:
    spatial = _int(args, "spatial_tile_pixels", 512, 64, 8192)
    temporal = _int(args, "temporal_tile_frames", 64, 16, 4096)
    if spatial % 32 or temporal % 8:
        raise JobInputError(f"decode tiles must be multiples of 32 pixels and 8 frames, got {spatial} px and {temporal} frames")
    return TilingConfig(
        spatial_config=SpatialTilingConfig(tile_size_in_pixels=spatial, tile_overlap_in_pixels=min(64, spatial // 4 // 32 * 32)),
        temporal_config=TemporalTilingConfig(tile_size_in_frames=temporal, tile_overlap_in_frames=min(24, temporal // 8 * 3)),
    )


def noise_history(after_stages, height: int, width: int, frames: int, frame_rate: float) -> tuple[StageGeometry, ...]:
    """The stages whose noise the job's generator drew before the decoder's own draws.

    The official pipeline decodes with the job's one generator after both stages drew from it;
    a latent decoded straight after stage 1 (``after_stages=1``) saw only that stage's draws.
    """
    if after_stages == 2:
        return (StageGeometry(height // 2, width // 2, frames, frame_rate), StageGeometry(height, width, frames, frame_rate))
    if after_stages == 1:
        return (StageGeometry(height, width, frames, frame_rate),)
    if after_stages == 0:
        return ()
    raise JobInputError(f"after_stages must be 0, 1 or 2, got {after_stages!r}")


@ltx_job("decode")
def decode(ctx: JobContext, args: dict, tensors: dict):
    """Distributed VAE decode of the video (frames to the client through shared memory) + audio."""
    resident = resident_model(ctx, args)
    with input_errors():
        video_latent = _video_latent(tensors, "Distributed VAE Decode")
        audio_latent = tensors.get("audio_latent")
        if audio_latent is not None and (audio_latent.ndim != 4 or audio_latent.shape[1] != 8):
            raise JobInputError(f"the audio latent must be [B, 8, T, 16], got {tuple(audio_latent.shape)}")
        tiling = decode_tiling(args)
        height, width, frames = _geometry_of(video_latent, 24.0)
        seed = _int(args, "seed", 10, 0, 2**63 - 1)
        frame_rate = _float(args, "frame_rate", 24.0, 1.0, 240.0)
        stages_before = noise_history(args.get("after_stages", 2), height, width, frames, frame_rate)
    generator = job_generator(seed, ctx.device, resident.dtype, stages_before=stages_before)
    decoder = resident.video_decoder()
    out = ctx.shared_output("frames", decoded_images_shape(decoder, video_latent.shape)) if ctx.rank == 0 else None
    with torch.inference_mode():
        frames_out = distributed_decode_images(decoder, video_latent.to(ctx.device, resident.dtype), tiling, ctx.comm, generator, out=out)
    stats = last_decode_stats()
    if stats is not None:
        peak = stats.device_peak_bytes if stats.device_peak_bytes is not None else stats.assembly_peak_bytes
        ctx.log(
            f"decode: {stats.tiles_decoded}/{stats.tiles_total} tiles on this rank, {stats.decode_seconds:.2f} s decoding, "
            f"{stats.reduce_seconds:.2f} s blending, peak {peak / 2**20:.1f} MiB"
        )
    ctx.step("decode", 1, 2)
    result, out_tensors = {"frames": int(frames_out.shape[0]) if frames_out is not None else 0}, {}
    if ctx.rank == 0:
        out_tensors["frames"] = frames_out
        if audio_latent is not None:
            waveform, sample_rate = decode_audio(resident, audio_latent.float())
            out_tensors["waveform"] = waveform.cpu()
            result["sample_rate"] = sample_rate
    ctx.step("decode", 2, 2)
    return result, out_tensors


@ltx_job("unload")
def unload(ctx: JobContext, args: dict, tensors: dict):
    """Drop the resident model and its parallel groups' state; the fleet stays up."""
    had = ctx.state.get("model") is not None
    unload_models(ctx)
    ctx.step("unload", 1, 1)
    return {"unloaded": had}, {}
