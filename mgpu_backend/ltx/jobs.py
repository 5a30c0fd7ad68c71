"""LTX-2 job types of the fleet: load, encode, sample (stage 1), upscale (stage 2), decode, unload.

Each job runs on every rank at once. It first checks its inputs (clear ``JobInputError`` before any
heavy work, so the fleet stays as it was), then runs the stage functions of ``stages`` / ``text`` /
``decode`` with the parallel techniques of that stage plugged in:

- sample: the stage-1 plan from ``guidance_parallel``, applied by ``parallelize.parallelize_stage1``
  (sequence parallel inside guidance groups, and the single-rank speed-ups), undone after the stage;
- upscale: the stage-2 plan from ``guidance_parallel.plan_stage2``, applied by
  ``parallelize.parallelize_stage2``: tiled data parallel around the stage-2 transformer (audio
  frozen) or sequence parallel inside it (audio denoised);

Every recipe of ``recipes.RECIPES`` runs, as its declaration says: ``two-stage`` (the dev checkpoint;
stage 2 fuses the distilled LoRA) and ``distilled`` (the distilled checkpoint, no LoRA: the working
transformer never swaps; stage 1 one positive-only pass per step over the fixed distilled sigmas, so
the sample job needs no negative prompt) and ``hq`` (the dev checkpoint with the distilled LoRA in
both stages at each stage's strength, two LoRA sets the working transformer swaps between; res_2s
steps in both stages). ``check_recipe_files`` refuses a spec that does not fit the recipe.
- decode: the distributed decoder, frames written straight into shared memory on rank 0.

Every job reads its arguments with the request type of ``schema`` (``SampleRequest.from_wire`` ...),
which also holds every default. Every job names its model spec; the rank keeps one model resident
(``ResidentModel``), so a job with the same spec reads nothing from disk, and a fleet that restarted
reloads on the next job by itself. A spec naming an embedded tiny bundle (``schema.EMBEDDED_TINY`` for
LTX-2.0, ``schema.EMBEDDED_TINY_2_3`` for LTX-2.3) is resolved here, on the ranks: rank 0 writes the
bundle into the cache folder (or finds it there). A job's model version is its checkpoint's.

Prompt encodings stay in the fleet: the encode job keeps each prompt's contexts on every rank by a
content digest (``schema.prompt_digest``, at most ``PROMPT_CACHE_ENTRIES``, least recently used
dropped) and returns them too, in the model's dtype, for the client to keep. Sample and upscale
name the digests; a rank that no longer holds one fails the job on every rank with a
``schema.CONTEXT_MISSING`` error, and the client resends the contexts it kept.

The jobs never compose techniques themselves: the parallelize entries do, in their fixed order.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from ltx_core.components.guiders import MultiModalGuiderParams

from mgpu_backend.fleet.jobs import JobContext, JobInputError, job, keep_across_replacement
from mgpu_backend.parallel.batched_passes import batch_passes_wanted
from mgpu_backend.parallel.compiled_blocks import compile_blocks_wanted
from mgpu_backend.parallel.cuda_graphs import cuda_graphs_wanted
from mgpu_backend.parallel.distributed_gemma import encode_prompts_distributed, last_encode_stats, release_text_encoders
from mgpu_backend.parallel.distributed_decode import decoded_images_shape, distributed_decode_images, last_decode_stats
from mgpu_backend.parallel.guidance_parallel import plan_stage1, plan_stage2
from mgpu_backend.parallel.weight_tracker import TransformerWeightTracker
from mgpu_backend.parallel.tiled_data_parallel import DimensionTiling, TileCounts, VideoTilePlan, balanced_tile_split
from mgpu_backend.ltx.decode import decode_audio, decode_tiling
from mgpu_backend.ltx.latents import StageGeometry, job_generator
from mgpu_backend.ltx.loading import ModelLoader
from mgpu_backend.ltx.parallelize import Stage1Options, parallelize_stage1, parallelize_stage2, stage1_cache
from mgpu_backend.ltx.previews import stage_previews, step_reporter
from mgpu_backend.ltx.recipes import RECIPES, recipe, stage_loras
from mgpu_backend.ltx.schema import CONTEXT_MISSING, PROMPT_CACHE_ENTRIES, VIDEO_LATENT_CHANNELS, DecodeRequest, EncodeRequest, LoadRequest, ModelFileError, ModelSpec, SampleRequest, UnloadRequest, UpscaleRequest, check_image_strengths, model_version_contradiction, pixel_geometry, validate_stg_blocks
from mgpu_backend.ltx.stages import GenerationParams, check_generation_fits, guider_params, refine_stage2, sample_stage1, transformer_layer_count, upsample_video
from mgpu_backend.ltx.residency import component_sizes, device_memory_bytes, plan_residency
from mgpu_backend.ltx.text import TextContext, connector_widths, contexts_from_comfy
from mgpu_backend.ltx.validation import TransformerDims

log = logging.getLogger("mgpu.ltx")

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
EMBEDDED_BUNDLE_FOLDER = "embedded-tiny-ltx2"
EMBEDDED_23_FOLDER = "embedded-tiny-ltx2.3"


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
    ``video_encoder()``, ...), returning the kept instances. What is kept follows the residency
    plan (``mgpu_backend.ltx.residency``, decided from the file headers before anything loads): a
    component the plan does not keep is built from the loader's host copy at each call, for the
    stage that asks, and released when that stage drops it. Under the plan's last level the
    transformer steps aside while Gemma encodes (``park_transformer``) and comes back with the next
    ``transformer`` call.
    """

    def __init__(self, spec: ModelSpec, device: torch.device, dtype: torch.dtype, comm,
                 quantization: str | None = None, residency: str = "auto") -> None:  # fmt: skip
        self.spec, self.device, self.dtype, self.quantization = spec, device, dtype, quantization
        lora_swap = spec.distilled_lora is not None or bool(spec.loras)
        self.loader = ModelLoader(spec, device, dtype, quantization)  # checks the files from their headers
        # Raises (before any weight is read) when the model cannot fit this device at all.
        self.residency = plan_residency(
            component_sizes(spec, dtype), device_memory_bytes(device), comm.world_size, residency, quantization, lora_swap
        )
        self.components: dict[tuple, torch.nn.Module] = {}
        self.load_seconds = 0.0  # time spent building components from files or the registry
        # One working transformer per rank; a clean copy sharded over the ranks lets stage 1 (no
        # LoRA) and stage 2 (distilled LoRA) swap in place. Without any LoRA, no clean copy is kept.
        self.tracker = TransformerWeightTracker(
            comm, no_lora_swap=not lora_swap, clean_on_host=self.residency.clean_shard_on_host, shard_weights=self.residency.shards_weights
        )

    def _kept(self, name: str, *args):
        key = (name, *args)
        if not self.residency.keeps(name):
            started = time.perf_counter()
            component = getattr(self.loader, name)(*args)
            self.load_seconds += time.perf_counter() - started
            return component
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

    def park_transformer(self, state: dict) -> None:
        """Move the transformer working copy to host memory (``TransformerWeightTracker.park``) so that
        Gemma gets its device memory; the next ``transformer`` call copies it back. The stage-1 CUDA
        graphs kept in ``state`` replay the weights' old addresses, so they go first (stage 1 captures
        them again). A CPU rank has nothing to free: the tracker leaves its weights where they are."""
        stage1_cache(state).release_graphs()
        if self.tracker.park() and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks go back to the GPU, for Gemma's allocations of other sizes

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

    # Asked with the LoRA set the caller runs next, so that asking costs no swap (collective, as ``transformer``).
    def layer_count(self, lora_set: str = "none") -> int:
        return transformer_layer_count(self.transformer(lora_set))

    def attention_heads(self, lora_set: str = "none") -> tuple[int, int]:
        velocity_model = self.transformer(lora_set).velocity_model
        block = velocity_model.transformer_blocks[0]
        return block.attn1.heads, block.audio_attn1.heads


# A rank that survives the replacement of a dead peer keeps the resident model: the next job reads
# only what the replacement must load.
keep_across_replacement("model")


def resident_model(ctx: JobContext, request) -> ResidentModel:
    """The model the request names, loading it (and dropping another) when it is not resident yet.

    A request that runs a model version (sample, upscale) must name the checkpoint's: the request
    schema already holds it to the file where the client could read it; here it meets the file loaded."""
    with input_errors():
        spec = request.spec
        if spec.names_embedded:
            spec = spec.resolve_embedded(embedded_bundle(ctx, spec.embedded_version))
        spec.check_files_exist()
        asked = getattr(request, "model_version", None)
        if asked is not None and spec.model_version != asked:
            raise JobInputError(model_version_contradiction(asked, spec.model_version, spec.checkpoint_path))
        dtype = TORCH_DTYPES[request.dtype]
        resident = ctx.state.get("model")
        if resident is not None and resident.spec == spec and resident.dtype == dtype:
            return resident  # the spec names the quantization and residency too
        unload_models(ctx)
        resident = ResidentModel(spec, ctx.device, dtype, ctx.comm, spec.quantization, spec.residency)  # validates the files from their headers
        ctx.log(resident.residency.describe())
    ctx.state["model"] = resident
    return resident


_embedded_bundles: dict[str, object] = {}  # cache folder -> TinyBundle, once this process has seen it complete


def embedded_bundle_folder(version: str = "2.0") -> str:
    """Where the embedded tiny LTX-``version`` bundle lives: ``$MGPU_CACHE_DIR``, else ~/.cache/comfyui-mgpu."""
    name = {"2.0": EMBEDDED_BUNDLE_FOLDER, "2.3": EMBEDDED_23_FOLDER}[version]
    return str(Path(os.environ.get("MGPU_CACHE_DIR") or Path.home() / ".cache" / "comfyui-mgpu") / name)


def embedded_bundle(ctx: JobContext, version: str = "2.0"):
    """The embedded tiny LTX-``version`` bundle in this host's cache folder (``embedded_bundle_folder``),
    written by rank 0 on first use while the other ranks wait.

    Collective: every rank calls it for a job whose spec names the embedded bundle."""
    from mgpu_backend.bundles.tiny import make_tiny_bundle

    folder = embedded_bundle_folder(version)
    failure = ""
    if ctx.rank == 0 and folder not in _embedded_bundles:
        try:
            _embedded_bundles[folder] = make_tiny_bundle(folder, version)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait below: every failure must reach them
            failure = f"{type(exc).__name__}: {exc}"
    failed = ctx.control.all_reduce_max(torch.tensor([int(bool(failure))], dtype=torch.int64))
    if failed.item():
        raise JobInputError(
            f"could not write the embedded tiny LTX-{version} bundle to {folder} ({failure or 'on rank 0'}); "
            "set MGPU_CACHE_DIR to a writable folder, or choose real model files"
        )
    if folder not in _embedded_bundles:
        _embedded_bundles[folder] = make_tiny_bundle(folder, version)  # complete since rank 0 wrote it: only checked
    return _embedded_bundles[folder]


def unload_models(ctx: JobContext) -> None:
    resident = ctx.state.get("model")
    if resident is not None:
        release_text_encoders(resident.loader)
    for key in ("model", "stage1_parallel"):
        ctx.state.pop(key, None)
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


# -- arguments and prompt contexts --------------------------------------------------------------


def stage1_params(request: SampleRequest, layer_count: int) -> GenerationParams:
    """The stage-1 generation a sample request asks for, on a model of ``layer_count`` blocks."""
    official, stage1 = request.defaults, recipe(request.pipeline).stage1
    return GenerationParams(
        height=request.height, width=request.width, num_frames=request.num_frames, frame_rate=request.frame_rate,
        seed=request.seed, num_inference_steps=request.steps,
        video_guider=guider_params(request.video_guidance, official.video_guidance, layer_count),
        audio_guider=guider_params(request.audio_guidance, official.audio_guidance, layer_count),
        two_stage=False, stage1_sigmas=request.stage1_sigmas, shift_sigmas_by_tokens=stage1.shift_by_tokens and request.sigmas is None,
        stepper=request.sampler or stage1.stepper, **image_params(request),
    )  # fmt: skip


def image_params(request) -> dict:
    """The ``GenerationParams`` fields of a stage request's images: their strengths and the recipe's conditioning."""
    return dict(image_strength=request.image_strength, last_image_strength=request.last_image_strength, conditioning=recipe(request.pipeline).conditioning)


def check_recipe_files(request, spec: ModelSpec) -> None:
    """Refuse a spec that cannot run the request's recipe (``recipes.Recipe.files`` / ``refused``),
    naming the file to add or drop."""
    declared = recipe(request.pipeline)
    for file in declared.files_for(request.op):
        if getattr(spec, file.spec_field) is None:
            others = [other.name for other in RECIPES.values() if not other.takes(file)]
            instead = f", or use pipeline {' or '.join(map(repr, others))}" if others else ""
            raise JobInputError(f"the {declared.name} pipeline's stage {2 if file.needed_from == 'upscale' else 1} needs the {file.words}; set {file.spec_field} in the model spec{instead}")
    for file, _why in declared.refused:
        if getattr(spec, file.spec_field) is not None:
            takers = [other.name for other in RECIPES.values() if other.takes(file)]
            raise JobInputError(
                f"the {declared.name} pipeline runs the {declared.checkpoint.words} as it is, with no {file.words}; leave "
                f"{file.spec_field} out of the model spec (or use pipeline {' or '.join(map(repr, takers))}, which takes it)"
            )
    stage = declared.stage1 if request.op == "sample" else declared.stage2
    try:  # a LoRA the spec chooses for this stage (the two-stage recipe's stage 1) needs its file here
        stage_loras(spec, stage.lora_set)
    except ModelFileError as error:
        raise JobInputError(f"the {declared.name} pipeline's stage {1 if stage is declared.stage1 else 2}: {error}") from None


class PromptCache:
    """Prompt contexts of this rank by digest; past ``entries`` the least recently used go first."""

    def __init__(self, entries: int = PROMPT_CACHE_ENTRIES) -> None:
        self.entries = entries
        self.contexts: OrderedDict[str, TextContext] = OrderedDict()

    def put(self, digest: str, context: TextContext) -> None:
        self.contexts[digest] = context
        self.contexts.move_to_end(digest)
        while len(self.contexts) > self.entries:
            self.contexts.popitem(last=False)

    def get(self, digest: str) -> TextContext | None:
        context = self.contexts.get(digest)
        if context is not None:
            self.contexts.move_to_end(digest)
        return context


def prompt_cache(ctx: JobContext) -> PromptCache:
    return ctx.state.setdefault("prompt_contexts", PromptCache())


COMFY_CONTEXT_KINDS = {"stacked": False, "unprocessed": True}
"""A prompt sent in ComfyUI's layout, ``{prefix}_stacked_context`` or ``{prefix}_unprocessed_context``
(before the embeddings connectors): ``text.contexts_from_comfy`` makes the two contexts of it."""


def _sent_context(tensors: dict, prefix: str, resident: ResidentModel) -> TextContext | None:
    for kind, unprocessed in COMFY_CONTEXT_KINDS.items():
        if f"{prefix}_{kind}_context" in tensors:
            widths = connector_widths(resident.spec.checkpoint_path)
            return contexts_from_comfy(tensors[f"{prefix}_{kind}_context"], unprocessed, prefix, widths, resident.embeddings_processor)
    names = (f"{prefix}_video_context", f"{prefix}_audio_context")
    if not any(name in tensors for name in names):
        return None
    missing = [name for name in names if name not in tensors]
    if missing:
        raise JobInputError(f"missing {', '.join(missing)}: send both contexts of the {prefix} prompt (MGPU Text Encode makes them)")
    for name in names:
        if tensors[name].ndim != 3 or tensors[name].shape[0] != 1:
            raise JobInputError(f"{name} must be [1, tokens, dim], got {tuple(tensors[name].shape)}")
    return TextContext(video_context=tensors[names[0]], audio_context=tensors[names[1]])


def prompt_contexts(ctx: JobContext, tensors: dict, wanted: list[tuple[str, str | None]], resident: ResidentModel) -> list[TextContext]:
    """The contexts of the prompts a job names as (``positive``/``negative``, digest or None);
    contexts sent in ComfyUI's layout are split by, or connected with, ``resident``'s checkpoint.

    Contexts sent with the job are used (and kept under their digest); otherwise the digest is looked
    up in this rank's cache. Collective when anything is looked up: a digest missing on any rank
    fails the job on every rank with the ``CONTEXT_MISSING`` error the client answers by resending."""
    cache, contexts, missing, looked_up = prompt_cache(ctx), [], [], False
    for prefix, digest in wanted:
        context = _sent_context(tensors, prefix, resident)
        if context is not None:
            if digest is not None:  # a copy: the job's inputs may live in a shared-memory segment of this job
                cache.put(digest, TextContext(context.video_context.clone(), context.audio_context.clone()))
        elif digest is not None:
            looked_up = True
            context = cache.get(digest)
            if context is None:
                missing.append(prefix)
        else:
            raise JobInputError(f"missing {prefix}_video_context, {prefix}_audio_context: encode the prompts with the MGPU text encoder first")
        contexts.append(context)
    if looked_up:
        missing_anywhere = ctx.control.all_reduce_max(torch.tensor([len(missing)], dtype=torch.int64))
        if missing_anywhere.item():
            raise JobInputError(
                f"{CONTEXT_MISSING}: the fleet no longer holds the encoded {' and '.join(missing) or 'prompts'} prompt "
                "(it restarted, or kept newer prompts); send the contexts with the job, or encode the prompts again"
            )
    return contexts


def _moved(context: TextContext, resident: ResidentModel) -> TextContext:
    to = dict(device=resident.device, dtype=resident.dtype)
    return TextContext(context.video_context.to(**to), context.audio_context.to(**to))


def _image(tensors: dict, name: str = "image") -> torch.Tensor | None:
    image = tensors.get(name)
    if image is None:
        return None
    if image.ndim == 4 and image.shape[0] >= 1:
        image = image[0]  # a ComfyUI IMAGE batch: its first frame conditions the video
    if image.ndim != 3 or image.shape[-1] != 3 or not image.is_floating_point():
        raise JobInputError(f"{name} must be float [height, width, 3] in 0..1, got {image.dtype} {tuple(image.shape)}")
    return image.float()


def _images(tensors: dict, request) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The first-frame and last-frame images a stage job got (``image``, ``last_image``); a strength set
    for an image that did not come is refused."""
    image, last_image = _image(tensors), _image(tensors, "last_image")
    check_image_strengths(request.image_strength, request.last_image_strength, image is not None, last_image is not None)
    return image, last_image


def _video_latent(tensors: dict, what: str) -> torch.Tensor:
    latent = tensors.get("video_latent")
    if latent is None or latent.ndim != 5 or latent.shape[0] != 1 or latent.shape[1] != VIDEO_LATENT_CHANNELS:
        shape = None if latent is None else tuple(latent.shape)
        raise JobInputError(f"{what} needs one LTX-2 video latent [1, 128, F', H/32, W/32], got {shape}")
    return latent.float()


def _progress(ctx: JobContext, stage: str) -> Callable[..., None]:
    """Progress and cancel only; it also serves as a stage's ``on_step`` (which adds the step's x0)."""
    return lambda step, total, video_x0=None: ctx.step(stage, step, total)


def _stage_steps(ctx: JobContext, resident, stage: str, preview_every: int):
    """A denoising stage's step callback: progress and cancel, plus live previews when asked for."""
    return step_reporter(ctx, stage, stage_previews(ctx, resident, preview_every), preview_every)


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
    with input_errors():
        request = LoadRequest.from_wire(args)
    resident = resident_model(ctx, request)
    builders = [("transformer", "none"), ("video_encoder",), ("video_decoder",), ("audio_decoder",), ("vocoder",), ("embeddings_processor",)]
    if resident.spec.spatial_upsampler_path is not None:
        builders.append(("spatial_upsampler",))
    for index, (name, *extra) in enumerate(builders, start=1):
        if name == "embeddings_processor" and ctx.comm.rank != 0 and not resident.residency.keeps(name):
            # Built per stage, the processor is only ever built where prompts are encoded: rank 0 in the
            # default Gemma mode. Building it here would leave this rank a host copy it never uses (5.9 GiB at 22B).
            ctx.log(f"embeddings processor not built at load on rank {ctx.comm.rank}: built per stage, it is read when this rank first encodes a prompt")
        else:
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
    """Video and audio text contexts of each prompt (Gemma + the checkpoint's connectors), kept on every
    rank by digest and returned in the model's dtype (the dtype the stages use them in)."""
    with input_errors():
        request = EncodeRequest.from_wire(args)
    resident = resident_model(ctx, request)
    if not resident.residency.keeps("gemma"):
        # Memory is tight when Gemma is built per stage: the stage-1 CUDA graphs' pool (1.6 GiB at 19B,
        # 768x512x121) must not sit beside it; the next stage 1 captures again (about 6 s at that size).
        released = stage1_cache(ctx.state).release_graphs()
        if released:
            ctx.log(f"stage-1 CUDA graphs released ({released}) before Gemma is built: residency {resident.residency.policy} builds Gemma per stage")
    if resident.residency.transformer_parked_for_encode:
        resident.park_transformer(ctx.state)  # Gemma and the transformer do not fit side by side
    contexts = encode_prompts_distributed(resident.loader, list(request.prompts), ctx.comm, request.gemma_mode, free_after=request.free_gemma or not resident.residency.keeps("gemma"))
    stats = last_encode_stats()
    where = f", Gemma on {stats['gemma_placement']}" if stats.get("gemma_placement") else ""
    ctx.log(f"text encode ({request.gemma_mode}): {stats.get('encoded_here', 0)} prompt(s) on this rank in {stats.get('seconds', 0):.2f} s{where}")
    ctx.step("encode", 1, 1)
    cache, digests, out = prompt_cache(ctx), request.digests(), {}
    for index, (digest, context) in enumerate(zip(digests, contexts, strict=True)):
        kept = TextContext(context.video_context.to(resident.dtype).cpu(), context.audio_context.to(resident.dtype).cpu())
        cache.put(digest, kept)
        out[f"video_context_{index}"], out[f"audio_context_{index}"] = kept.video_context, kept.audio_context
    return {"prompts": len(request.prompts), "digests": digests}, out


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


@ltx_job("sample")
def sample(ctx: JobContext, args: dict, tensors: dict):
    """Stage 1: full-frame generation from noise, sequence/guidance parallel (faithful)."""
    with input_errors():
        request = SampleRequest.from_wire(args)
        check_recipe_files(request, request.spec)
    resident = resident_model(ctx, request)
    lora_set = recipe(request.pipeline).stage1.lora_set
    layers = resident.layer_count(lora_set)
    with input_errors():
        params = stage1_params(request, layers)
        params.validate()
        validate_stg_blocks(params.video_guider, layers, "video")
        validate_stg_blocks(params.audio_guider, layers, "audio")
        image, last_image = _images(tensors, request)
        dims = TransformerDims.from_checkpoint(resident.spec.checkpoint_path)
        cuda_graphs = cuda_graphs_wanted(request.cuda_graphs, ctx.device)
        compile_blocks = compile_blocks_wanted(request.compile_blocks, ctx.device)
        wanted = [("positive", request.positive_digest)]
        if "unconditional" in active_passes(params.video_guider, params.audio_guider):
            wanted.append(("negative", request.negative_digest))
        positive, *rest = prompt_contexts(ctx, tensors, wanted, resident)
        negative = rest[0] if rest else None  # no unconditional pass (the distilled recipe): no negative prompt
    return run_stage1(ctx, resident, params, positive, negative, image, request.parallel, dims, cuda_graphs, request.batch_passes, compile_blocks,
                      request.preview_every, lora_set, last_image=last_image)  # fmt: skip


def run_stage1(ctx: JobContext, resident, params: GenerationParams, positive: TextContext, negative: TextContext | None,
               image: torch.Tensor | None, mode: str, dims: TransformerDims, cuda_graphs: bool = True,
               batch_passes: str | bool = "auto", compile_blocks: bool = False, preview_every: int = 0, lora_set: str = "none",
               last_image: torch.Tensor | None = None):  # fmt: skip
    """Plan, memory check and the stage-1 loop under ``parallelize_stage1``, with the recipe's stage-1
    ``lora_set`` fused: shared by ``sample`` and the benchmark job."""
    passes = active_passes(params.video_guider, params.audio_guider)
    video_heads, audio_heads = resident.attention_heads(lora_set)
    with input_errors():
        plan = plan_stage1(ctx.world_size, params.stage1.video_tokens, passes, mode, attention_heads=video_heads, audio_attention_heads=audio_heads)
        batched = batch_passes_wanted(batch_passes, plan, ctx.device)
        options = Stage1Options(cuda_graphs=cuda_graphs, batch_passes=batched, compile_blocks=compile_blocks)
        check_generation_fits(params, ctx.device, dims, resident.dtype, sp_degree=plan.sp_degree, weights_resident=True)
    transformer = resident.transformer(lora_set)
    on_step = _stage_steps(ctx, resident, "stage1", preview_every)
    with parallelize_stage1(transformer, plan, ctx.comm, ctx.device, options, stage1_cache(ctx.state), ctx.log) as stage:
        video, audio = sample_stage1(
            resident, params, _moved(positive, resident), negative and _moved(negative, resident), image, pass_runner=stage.runner,
            on_step=on_step, lora_set=lora_set, last_image=last_image,
        )
    return stage.fields(), {"video_latent": video.cpu(), "audio_latent": audio.cpu()}


def upscale_tiling(ctx: JobContext, request: UpscaleRequest, video_grid: tuple[int, int, int]) -> TileCounts | None:
    """The TDP tiling of the stage-2 latent grid, or None for the untiled (one-rank) stage 2.

    Tiles are (height, width) counts; with none given, a balanced split over the fleet. When the
    grid is too small for the requested overlap, the overlap shrinks to what fits (logged).
    """
    tiles, overlap = request.tiles, request.overlap
    if tiles is None:
        if ctx.world_size == 1:
            return None
        tiles = tuple(balanced_tile_split(ctx.world_size))
    if tuple(tiles) == (1, 1):
        return None
    last_error = None
    for tried in range(overlap, -1, -1):
        tiling = TileCounts(height=DimensionTiling(tiles[0], tried), width=DimensionTiling(tiles[1], tried))
        try:
            VideoTilePlan(tiling, video_grid)  # raises when the tiles do not fit the grid
        except ValueError as exc:
            if request.tiles is not None:  # the user's own tiling: say so rather than change it
                raise JobInputError(f"tiling {tiles[0]}x{tiles[1]} with overlap {tried} does not fit the {video_grid[1]}x{video_grid[2]} latent: {exc}") from exc
            last_error = exc
            continue
        if tried != overlap:
            ctx.log(f"TDP overlap reduced from {overlap} to {tried} latent cells to fit the {video_grid[1]}x{video_grid[2]} latent")
        return tiling
    raise JobInputError(f"the {video_grid[1]}x{video_grid[2]} latent is too small for {tiles[0]}x{tiles[1]} tiles: {last_error}")


STAGE2_AUDIO = {
    True: "denoised in stage 2 (every rank saw the whole video and audio, as the official pipelines)",
    False: "the stage-1 audio, unchanged (kept by design under TDP, where a tile's audio sees one tile of the video)",
}
"""The upscale result's ``audio`` field: what the returned audio latent is."""


@ltx_job("upscale")
def upscale(ctx: JobContext, args: dict, tensors: dict):
    """Stage 2: spatial 2x, then the recipe's refinement over TDP tiles (audio frozen) or sequence
    parallel (audio denoised, as the official pipelines), as ``plan_stage2`` decides."""
    with input_errors():
        request = UpscaleRequest.from_wire(args)
        check_recipe_files(request, request.spec)
    resident = resident_model(ctx, request)
    with input_errors():
        video_latent = _video_latent(tensors, "TDP Upscale")
        audio_latent = tensors.get("audio_latent")
        if audio_latent is None:
            raise JobInputError("TDP Upscale needs the stage-1 audio latent too (the video attends to it)")
        height, width, frames = pixel_geometry(*video_latent.shape[2:])
        sigmas = list(request.sigmas)
        stage2 = recipe(request.pipeline).stage2
        params = GenerationParams(
            height=height * 2, width=width * 2, num_frames=frames, frame_rate=request.frame_rate, seed=request.seed, two_stage=True,
            stepper=request.sampler or stage2.stepper, **image_params(request),
        )  # fmt: skip
        params.validate()
        image, last_image = _images(tensors, request)
        stage2_grid = (video_latent.shape[2], video_latent.shape[3] * 2, video_latent.shape[4] * 2)
        dims = TransformerDims.from_checkpoint(resident.spec.checkpoint_path)
        # Heads from the checkpoint's header: asking the transformer would swap its LoRA set back and forth.
        plan = plan_stage2(ctx.world_size, math.prod(stage2_grid), request.pipeline, request.parallel, tiles_given=request.tiles is not None,
                           attention_heads=dims.video_heads, audio_attention_heads=dims.audio_heads,
                           guiding_latents=params.guiding_frames(image, last_image))  # fmt: skip
        ctx.log(plan.reason)
        tiling = upscale_tiling(ctx, request, stage2_grid) if plan.technique == "tdp" else None
        check_generation_fits(params, ctx.device, dims, resident.dtype, sp_degree=plan.sp_degree, weights_resident=True)
        (positive,) = prompt_contexts(ctx, tensors, [("positive", request.positive_digest)], resident)
    upsampled = upsample_video(resident, video_latent)
    ctx.step("upsample", 1, 1)
    lora_set = stage2.lora_set
    stage2_transformer = resident.transformer(lora_set)  # the same working copy stage 1 used, clean again
    sequence_parallel = plan.technique == "sp"
    on_step = _stage_steps(ctx, resident, "stage2", request.preview_every)
    with parallelize_stage2(stage2_transformer, ctx.comm, tiling, stage2_grid, ctx.log, sequence_parallel=sequence_parallel) as wrapper:
        video, audio = refine_stage2(
            resident, params, upsampled, audio_latent.float(), _moved(positive, resident), image,
            sigmas=sigmas, transformer_wrapper=wrapper, on_step=on_step,
            lora_set=lora_set, denoise_audio=plan.denoises_audio, last_image=last_image,
        )  # fmt: skip
    fields = {
        "tiling": "untiled" if tiling is None else tiling.describe(),
        "stage2_parallel": plan.technique,
        "sp_degree": plan.sp_degree,
        "plan": plan.reason,
        "audio": STAGE2_AUDIO[plan.denoises_audio],
    }
    return fields, {"video_latent": video.cpu(), "audio_latent": audio.cpu()}





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
    with input_errors():
        request = DecodeRequest.from_wire(args)
    resident = resident_model(ctx, request)
    with input_errors():
        video_latent = _video_latent(tensors, "Distributed VAE Decode")
        audio_latent = tensors.get("audio_latent")
        if audio_latent is not None and (audio_latent.ndim != 4 or audio_latent.shape[1] != 8):
            raise JobInputError(f"the audio latent must be [B, 8, T, 16], got {tuple(audio_latent.shape)}")
        tiling = decode_tiling(request.spatial_tile_pixels, request.temporal_tile_frames)
        height, width, frames = pixel_geometry(*video_latent.shape[2:])
        stages_before = noise_history(request.after_stages, height, width, frames, request.frame_rate)
    generator = job_generator(request.seed, ctx.device, resident.dtype, stages_before=stages_before, guiding_frames=request.guiding_frames)
    decoder = resident.video_decoder()
    out = ctx.shared_output("frames", decoded_images_shape(decoder, video_latent.shape)) if ctx.rank == 0 else None
    with torch.inference_mode():
        # One progress step per decoded tile, counted over all ranks (also the cancel point).
        frames_out = distributed_decode_images(
            decoder, video_latent.to(ctx.device, resident.dtype), tiling, ctx.comm, generator, out=out, on_tiles=_progress(ctx, "decode")
        )
    stats = last_decode_stats()
    if stats is not None:
        peak = stats.device_peak_bytes if stats.device_peak_bytes is not None else stats.assembly_peak_bytes
        ctx.log(
            f"decode: {stats.tiles_decoded}/{stats.tiles_total} tiles on this rank, {stats.decode_seconds:.2f} s decoding, "
            f"{stats.reduce_seconds:.2f} s blending, peak {peak / 2**20:.1f} MiB"
        )
    result, out_tensors = {"frames": int(frames_out.shape[0]) if frames_out is not None else 0}, {}
    if ctx.rank == 0:
        out_tensors["frames"] = frames_out
        if audio_latent is not None:
            waveform, sample_rate = decode_audio(resident, audio_latent.float(), video_frames=frames, frame_rate=request.frame_rate)
            out_tensors["waveform"] = waveform.cpu()
            result["sample_rate"] = sample_rate
    if audio_latent is not None:
        ctx.step("audio decode", 1, 1)
    return result, out_tensors


@ltx_job("unload")
def unload(ctx: JobContext, args: dict, tensors: dict):
    """Drop the resident model and its parallel groups' state; the fleet stays up."""
    with input_errors():
        UnloadRequest.from_wire(args)
    had = ctx.state.get("model") is not None
    unload_models(ctx)
    ctx.step("unload", 1, 1)
    return {"unloaded": had}, {}
