"""The fleet as the denoiser of a stock ComfyUI ``MODEL``: the jobs the ranks run.

ComfyUI's samplers, guiders and LTX nodes run in ComfyUI's process; each call of the LTX diffusion
model is forwarded here (``mgpu_backend.comfy_model.remote`` is the ComfyUI side), and every rank
runs ComfyUI's own ``LTXAVModel``, imported from the ComfyUI that started the fleet and loaded by
its own loader (``runtime``), sequence-parallel over the ranks (``plan``).

Jobs (every one validates its args and refuses bad input with a JobInputError a user can act on):

- ``comfy.load`` {comfy_dir, path, loader, weight_dtype} -> {model_key, comfyui_version,
  model_class, video_heads, audio_heads, sp_degrees, dtype}. One model is resident at a time;
  loading the resident one again is instant.
- ``comfy.patches`` {index} + tensor ``blob`` (``wire.pack_tensor_blob``, each tensor named by its
  ``wire.tensor_digest``, checked on arrival) -> {held: every digest now held}. ``index: []`` with
  an empty blob only lists what is held.
- ``comfy.patch_model`` {model_key, set_digest} + tensor ``entries`` (``wire.entries_tensor``) ->
  {set_digest, patched_weights}: puts
  the patch set on the weights with ComfyUI's ``ModelPatcher``. Missing tensors are refused, with
  their count, before anything changes (upload them with ``comfy.patches`` and retry).
- ``comfy.forward`` {model_key, set_digest, call, count} + tensors t0.. -> {out, count,
  rank_seconds, batch_groups, sp_degree} + tensors t0..: ``out`` is ``wire.pack`` of the
  model's output (a tensor, or ComfyUI's [video, audio] list), its tensors on the CPU.
- ``comfy.text_embeds`` {model_key, set_digest, unprocessed} + tensor ``cross_attn`` -> tensor
  ``out``: ``preprocess_text_embeds`` (what LTXAV.extra_conds runs in ComfyUI's process).
- ``comfy.unload`` -> {unloaded}: drops the model and the patch tensors.

A batched call (cond and uncond in one) is split over groups of ranks (``batch_groups``), each
running its slice sequence-parallel; the outputs come back in batch order.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
import time
from typing import Any

import torch

from mgpu_backend.comfy_model import plan, runtime, wire
from mgpu_backend.comfy_model.captured_blocks import capture_blocks
from mgpu_backend.fleet.jobs import JobContext, JobInputError, job
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.sequence_parallel import valid_sp_degrees

MODELS = "comfy_models"
PATCH_TENSORS = "comfy_patch_tensors"
GROUPS = "comfy_groups"

HONOURED_OPTIONS = frozenset({*plan.MODEL_OPTIONS, "cond_or_uncond", "sigmas", "sample_sigmas", "prefetch_dynamic_vbars"})
"""transformer_options the rank passes to ComfyUI's model. ``prefetch_dynamic_vbars`` is recomputed
from the rank's own patcher (as ``BaseModel._apply_model`` does); the others go through as sent."""
CUDA_GRAPHS_VARIABLE = "MGPU_COMFY_CUDA_GRAPHS"
KEPT = "comfy_kept_tensors"
KEPT_TENSORS = 32
KEPT_BYTES = 2 << 30
CALL_KEYS = frozenset({"x", "timestep", "context", "transformer_options", "kwargs"})


@contextlib.contextmanager
def input_errors():
    """Turn the engine's refusals (and a malformed wire value) into the fleet's JobInputError."""
    try:
        yield
    except (runtime.ComfyInputError, plan.PlanRefused) as exc:
        raise JobInputError(str(exc)) from exc


def _text(args: dict, name: str) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise JobInputError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _choice(args: dict, name: str, choices: tuple[str, ...]) -> str:
    value = args.get(name)
    if value not in choices:
        raise JobInputError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _resident(ctx: JobContext, args: dict) -> runtime.LoadedModel:
    key = _text(args, "model_key")
    loaded = ctx.state.get(MODELS, {}).get(key)
    if loaded is None:
        raise JobInputError(f"model {key!r} is not loaded in the fleet (it restarted or unloaded); run comfy.load again")
    return loaded


def _check_set(loaded: runtime.LoadedModel, args: dict) -> None:
    wanted = _text(args, "set_digest")
    if wanted == wire.patch_set_digest([]):
        wanted = ""
    if wanted != loaded.set_digest:
        raise JobInputError(
            f"stale weight patches: the call expects patch set {wanted or 'none'!r}, the fleet's weights carry "
            f"{loaded.set_digest or 'none'!r}; send the patch set with comfy.patch_model"
        )


@job("comfy.load")
def load(ctx: JobContext, args: dict, tensors: dict):
    """Load a model with ComfyUI's loader into every rank (instant for the resident one)."""
    comfy_dir = _text(args, "comfy_dir")
    path = _text(args, "path")
    loader = _choice(args, "loader", runtime.LOADERS)
    weight_dtype = _choice(args, "weight_dtype", runtime.WEIGHT_DTYPES)
    if not os.path.isabs(path) or not os.path.isfile(path):
        raise JobInputError(f"model file {path!r} is not an absolute path to a file the fleet can read")
    with input_errors():
        _, version = runtime.import_comfy(comfy_dir, ctx.device)
        plan.check_code()
        key = runtime.model_file_key(path, loader, weight_dtype)
        models = ctx.state.setdefault(MODELS, {})
        loaded = models.get(key)
        if loaded is None:
            models.clear()  # one resident model: drop the previous one before reading the next
            patcher = runtime.load_model(path, loader, weight_dtype, ctx.device)
            plan.check_model(patcher.model.diffusion_model)
            loaded = models[key] = runtime.LoadedModel(key, patcher)
    ctx.step("comfy.load", 1, 1)
    video_heads, audio_heads = plan.head_counts(loaded.diffusion_model)
    return {
        "model_key": key,
        "comfyui_version": version,
        "model_class": type(loaded.diffusion_model).__name__,
        "video_heads": video_heads,
        "audio_heads": audio_heads,
        "sp_degrees": valid_sp_degrees(video_heads, audio_heads),
        "dtype": str(loaded.patcher.model.get_dtype_inference()).removeprefix("torch."),
    }, {}


@job("comfy.patches")
def patches(ctx: JobContext, args: dict, tensors: dict):
    """Keep weight-patch tensors (named by content digest) on every rank, on the CPU."""
    blob = tensors.get("blob", torch.empty(0, dtype=torch.uint8))
    try:
        arrived = wire.unpack_tensor_blob(args.get("index"), blob)
    except ValueError as exc:
        raise JobInputError(f"the patch tensor blob is malformed: {exc}") from exc
    held = ctx.state.setdefault(PATCH_TENSORS, {})
    new = [digest for digest in arrived if digest not in held]
    with torch.inference_mode(False):  # normal tensors: wire.tensor_digest reads their version counters
        copies = [arrived[digest].clone() for digest in new]
    for digest, tensor, found in zip(new, copies, wire.tensor_digests(copies), strict=True):
        if found != digest:
            raise JobInputError(f"patch tensor {digest!r} arrived with other contents than its digest names; resend it")
        held[digest] = tensor
    return {"held": sorted(held)}, {}


@job("comfy.patch_model")
def patch_model(ctx: JobContext, args: dict, tensors: dict):
    """Put a weight patch set (LoRAs) on the resident model, as ComfyUI's ModelPatcher does."""
    loaded = _resident(ctx, args)
    try:
        entries = wire.entries_from_tensor(tensors.get("entries"))
    except ValueError as exc:
        raise JobInputError(str(exc)) from None
    set_digest = "" if not entries else _text(args, "set_digest")
    if entries and set_digest != wire.patch_set_digest(entries):
        raise JobInputError("set_digest is not wire.patch_set_digest(entries); send the digest of these entries")
    held = ctx.state.setdefault(PATCH_TENSORS, {})
    missing = runtime.missing_digests(entries, held)
    if missing:
        raise JobInputError(f"{len(missing)} patch tensors are not in the fleet; upload them with comfy.patches and retry")
    with input_errors():
        try:
            rebuilt = wire.unpack_patches(entries, held, runtime.make_adapter)
        except ValueError as exc:
            raise runtime.ComfyInputError(f"the weight patches are malformed: {exc}") from exc
        if set_digest != loaded.set_digest:
            loaded.set_digest = ""  # half-patched weights match no set until this one is on
            # ComfyUI's patching puts new weight tensors in place: graphs recorded on the old ones must go
            release_parallelism(loaded)
            runtime.apply_patches(loaded, rebuilt, ctx.device)
            loaded.set_digest = set_digest
    ctx.step("comfy.patch_model", 1, 1)
    return {"set_digest": loaded.set_digest, "patched_weights": len(rebuilt)}, {}




def _batch_slice(value: Any, batch: int, start: int, stop: int) -> Any:
    """``value`` with every batched tensor (first dim ``batch``) cut to samples [start, stop)."""
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.ndim and value.shape[0] == batch else value
    if isinstance(value, tuple):
        return tuple(_batch_slice(item, batch, start, stop) for item in value)
    if isinstance(value, list):
        return [_batch_slice(item, batch, start, stop) for item in value]
    if isinstance(value, dict):
        return {key: _batch_slice(item, batch, start, stop) for key, item in value.items()}
    return value


def batch_groups(batch: int, world_size: int, sp_degrees: list[int]) -> int:
    """How many groups of ranks share a call of ``batch`` samples: the most that divide both the batch
    and the fleet while each group's rank count is a valid SP degree."""
    for groups in range(min(batch, world_size), 0, -1):
        if batch % groups == 0 and world_size % groups == 0 and world_size // groups in sp_degrees:
            return groups
    raise JobInputError(
        f"a fleet of {world_size} ranks cannot run this model sequence-parallel (SP degrees {sp_degrees} split its "
        "attention heads); start the fleet with a rank count among them"
    )


def batch_coupling_agrees(call: dict, batch: int, groups: int) -> bool:
    """Whether each group's slice of the batch sees what the whole batch would: ComfyUI's LTX-AV model
    couples the samples of a call through the largest video and audio timestep of the whole batch
    (its audio-video cross-attention timesteps) and reads the denoise mask of the first sample only
    (spatial-mask and keyframe grid checks). A cond + uncond batch of one step agrees; anything
    else runs unsplit."""
    share = batch // groups
    timesteps = call["timestep"] if isinstance(call["timestep"], (tuple, list)) else (call["timestep"],)
    for timestep in timesteps:
        if isinstance(timestep, torch.Tensor) and timestep.ndim and timestep.shape[0] == batch:
            peak = timestep.max()
            if any(not torch.equal(timestep[group * share : (group + 1) * share].max(), peak) for group in range(groups)):
                return False
    mask = call["kwargs"].get("denoise_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim and mask.shape[0] == batch:
        if any(not torch.equal(mask[group * share], mask[0]) for group in range(groups)):
            return False
    return True


def _group_comms(ctx: JobContext, groups: int) -> tuple[Comm, Comm]:
    """(this rank's SP group, the ranks holding the same shard in every group), made once per layout.
    Groups are contiguous rank blocks: group g holds ranks g*S .. g*S+S-1."""
    cache = ctx.state.setdefault(GROUPS, {})
    if groups not in cache:
        size = ctx.world_size // groups
        sp = [[group * size + index for index in range(size)] for group in range(groups)]
        across = [[group * size + index for group in range(groups)] for index in range(size)]
        sp_comm = ctx.comm if groups == 1 else (Comm(None, [ctx.rank]) if size == 1 else ctx.comm.split(sp))
        across_comm = Comm(None, [ctx.rank]) if groups == 1 else (ctx.comm if size == 1 else ctx.comm.split(across))
        cache[groups] = (sp_comm, across_comm)
    return cache[groups]


def _gathered_batch(value: Any, comm: Comm) -> Any:
    if isinstance(value, torch.Tensor):
        return comm.all_gather(value, dim=0)
    if isinstance(value, (list, tuple)):
        return type(value)(_gathered_batch(item, comm) for item in value)
    raise TypeError(f"ComfyUI's model returned a {type(value).__name__}")


class KeptOnDevice(OrderedDict):
    """The tensors a ComfyUI process asked the ranks to keep between denoiser calls (its text context,
    masks, guide indices: the same every step), on the rank's device, the least recently used dropped
    beyond ``KEPT_TENSORS`` entries or ``KEPT_BYTES``. Stored as copies: never views of an input segment."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __setitem__(self, token: str, tensor: torch.Tensor) -> None:
        super().__setitem__(token, tensor.to(self.device, copy=True))
        while len(self) > KEPT_TENSORS or (len(self) > 1 and sum(kept.numel() * kept.element_size() for kept in self.values()) > KEPT_BYTES):
            self.popitem(last=False)

    def __getitem__(self, token: str) -> torch.Tensor:
        self.move_to_end(token)
        return super().__getitem__(token)


def _kept(ctx: JobContext) -> KeptOnDevice:
    kept = ctx.state.get(KEPT)
    if kept is None:
        kept = ctx.state[KEPT] = KeptOnDevice(ctx.device)
    return kept


def _call(args: dict, tensors: dict, kept: KeptOnDevice) -> dict:
    count = args.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= wire.MAX_PACKED_TENSORS:
        raise JobInputError(f"count must be the number of call tensors (0 to {wire.MAX_PACKED_TENSORS}), got {count!r}")
    try:
        call = wire.unpack(args.get("call"), wire.tensors_in_order(tensors, count), kept=kept)
    except wire.MissingKeptTensor:
        raise JobInputError(f"{wire.KEPT_MISSING}: the call names a tensor the fleet no longer keeps; send it again") from None
    except ValueError as exc:
        raise JobInputError(f"the denoiser call is malformed: {exc}") from exc
    if not isinstance(call, dict) or set(call) != CALL_KEYS:
        raise JobInputError(f"a denoiser call holds exactly {', '.join(sorted(CALL_KEYS))}")
    options, kwargs = call["transformer_options"], call["kwargs"]
    if not isinstance(options, dict) or not isinstance(kwargs, dict):
        raise JobInputError("transformer_options and kwargs of a denoiser call must be dicts")
    refused = sorted(set(options) - HONOURED_OPTIONS)
    if refused:
        raise JobInputError(
            f"transformer option(s) {', '.join(refused)} are not honoured by the fleet's denoiser; "
            f"it honours {', '.join(sorted(HONOURED_OPTIONS))}. Remove the node that sets them, or run this model in ComfyUI"
        )
    clashing = sorted(set(kwargs) & {"x", "timestep", "context", "control", "transformer_options"})
    if clashing:
        raise JobInputError(f"kwargs of a denoiser call must not repeat {', '.join(clashing)}")
    if not isinstance(call["x"], (torch.Tensor, list)):
        raise JobInputError("x of a denoiser call is a tensor or ComfyUI's [video, audio] list")
    return call


def _batch_size(x: Any) -> int:
    return (x[0] if isinstance(x, list) else x).shape[0]


def cuda_graphs_on() -> bool:
    """CUDA-graph replay of the blocks on GPU ranks: on unless MGPU_COMFY_CUDA_GRAPHS=0."""
    return os.environ.get(CUDA_GRAPHS_VARIABLE, "1").strip() != "0"


def release_parallelism(loaded: runtime.LoadedModel) -> None:
    """Take the captured blocks and the SP plan off the model instance, outermost first."""
    if loaded.captured is not None:
        loaded.captured.remove()
        loaded.captured = None
    if loaded.plan is not None:
        loaded.plan.remove()
        loaded.plan = None


@job("comfy.forward")
def forward(ctx: JobContext, args: dict, tensors: dict):
    """One call of ComfyUI's diffusion model, sequence-parallel over the fleet (split by batch over groups)."""
    entered = time.perf_counter()
    loaded = _resident(ctx, args)
    _check_set(loaded, args)
    call = _call(args, tensors, _kept(ctx))
    model = loaded.diffusion_model
    video_heads, audio_heads = plan.head_counts(model)
    batch = _batch_size(call["x"])
    sp_degrees = valid_sp_degrees(video_heads, audio_heads)
    groups = batch_groups(batch, ctx.world_size, sp_degrees)
    if groups > 1 and not batch_coupling_agrees(call, batch, groups):
        groups = batch_groups(1, ctx.world_size, sp_degrees)
    sp_comm, across_comm = _group_comms(ctx, groups)
    if loaded.plan is None or loaded.plan.comm is not sp_comm:
        release_parallelism(loaded)
        loaded.plan = plan.apply_plan(model, sp_comm, video_query_exchange=ctx.device.type == "cpu")
        if ctx.device.type == "cuda" and cuda_graphs_on():
            loaded.captured = capture_blocks(model, sp_comm)

    group = ctx.rank // (ctx.world_size // groups)
    share = batch // groups
    call = wire.to_device(_batch_slice(call, batch, group * share, (group + 1) * share), ctx.device)
    options = {**call["transformer_options"], "prefetch_dynamic_vbars": loaded.patcher.is_dynamic()}
    if groups > 1 and isinstance(options.get("cond_or_uncond"), list) and len(options["cond_or_uncond"]) == batch:
        options["cond_or_uncond"] = options["cond_or_uncond"][group * share : (group + 1) * share]  # one entry per sample
    loaded.plan.cancel_point = lambda step, total: ctx.step("comfy.forward", step, total)
    replays = loaded.captured.replays if loaded.captured is not None else 0
    started = time.perf_counter()
    try:
        out = model(call["x"], call["timestep"], context=call["context"], control=None, transformer_options=options, **call["kwargs"])
    finally:
        loaded.plan.cancel_point = None
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - started
    out = _gathered_batch(out, across_comm)
    rank_seconds = ctx.control.all_gather(torch.tensor([seconds], dtype=torch.float64), dim=0)
    packed, out_tensors = wire.pack(wire.to_device(out, torch.device("cpu")))
    return {
        "out": packed,
        "count": len(out_tensors),
        "rank_seconds": [round(value, 6) for value in rank_seconds.tolist()],
        "job_seconds": round(time.perf_counter() - entered, 6),  # this rank's whole job: inputs in, forward, output out
        "batch_groups": groups,
        "sp_degree": sp_comm.world_size,
        "blocks": "cuda graph" if loaded.captured is not None and loaded.captured.replays > replays else "eager",
    }, wire.tensors_by_name(out_tensors)


@job("comfy.text_embeds")
def text_embeds(ctx: JobContext, args: dict, tensors: dict):
    """``preprocess_text_embeds`` of the resident model (LTXAV.extra_conds runs it in ComfyUI's process)."""
    loaded = _resident(ctx, args)
    _check_set(loaded, args)
    unprocessed = args.get("unprocessed")
    if not isinstance(unprocessed, bool):
        raise JobInputError("unprocessed must be true or false (ComfyUI's unprocessed_ltxav_embeds)")
    cross_attn = tensors.get("cross_attn")
    if cross_attn is None or cross_attn.ndim != 3:
        raise JobInputError("comfy.text_embeds takes the tensor cross_attn, (batch, tokens, features)")
    if ctx.rank != 0:  # replicated work: rank 0's answer is the job's
        return {}, {}
    dtype = loaded.patcher.model.get_dtype_inference()
    out = loaded.diffusion_model.preprocess_text_embeds(cross_attn.to(device=ctx.device, dtype=dtype), unprocessed=unprocessed)
    return {}, {"out": out.cpu()}


@job("comfy.unload")
def unload(ctx: JobContext, args: dict, tensors: dict):
    """Drop the ComfyUI model and the weight-patch tensors; the fleet stays up."""
    models = ctx.state.pop(MODELS, {})
    for loaded in models.values():
        release_parallelism(loaded)
    held = ctx.state.pop(PATCH_TENSORS, {})
    ctx.state.pop(KEPT, None)
    ctx.step("comfy.unload", 1, 1)
    return {"unloaded": len(models), "patch_tensors_dropped": len(held)}, {}
