"""The LTX-2 operations of the fleet as plain Python calls: what the ComfyUI nodes and the CLI use.

Each function submits one job (``load``, ``encode``, ``sample``, ``upscale``, ``decode``) to the
fleet and returns tensors in ComfyUI's layouts: video latent ``[B,128,F',H/32,W/32]``, audio latent
``[B,8,T,16]``, IMAGE ``[frames,H,W,3]`` float32 in 0..1, waveform ``[B,C,T]``. Each builds its job's
request with ``schema`` (which checks it and fills the official defaults: a keyword left as None
means "the schema's default"). Every job carries the model spec, so a fleet that restarted reloads
the model on its own; prompts travel by digest, their contexts resent only when the fleet lost them. ``progress`` receives the
fleet's progress events; ``should_cancel`` is polled while a job runs (ComfyUI's interrupt);
``preview(fields, frames)`` receives the denoising stages' live previews (``ltx.previews``: uint8
``[n, h, w, 3]`` strips of the current x0, with the stage, step and total in ``fields``).

The connection is shared by the whole process and serialised with a lock: the fleet runs one job
at a time anyway. Nothing here imports ComfyUI.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mgpu_backend.fleet.client import FleetClient, FleetError, FleetUnavailable
from mgpu_backend.ltx.recipes import DEFAULT_RECIPE
from mgpu_backend.ltx.schema import (
    CONTEXT_MISSING,
    IMAGE_STRENGTH,
    PREVIEW_EVERY,
    DecodeRequest,
    EncodeRequest,
    Guidance,
    LoadRequest,
    SampleRequest,
    UpscaleRequest,
    check_image_strengths,
    pixel_geometry,
)

Progress = Callable[[dict], None] | None
ShouldCancel = Callable[[], bool] | None
Preview = Callable[[dict, torch.Tensor], None] | None

_lock = threading.RLock()
_client: FleetClient | None = None
_settings: dict = {"address": None, "gpus": None, "cpu_ranks": None}


def configure(address: str | None = None, gpus: str | None = None, cpu_ranks: int | None = None) -> None:
    """Where the fleet is (socket) and, if this process starts it, on which devices.

    Defaults come from MGPU_SOCKET, MGPU_GPUS ('all' or '0,1,...') and MGPU_CPU_RANKS.
    """
    global _client
    with _lock:
        _settings.update(address=address, gpus=gpus, cpu_ranks=cpu_ranks)
        if _client is not None:
            _client.close()
            _client = None


def fleet() -> FleetClient:
    """The process-wide connection, (re)connecting and starting a server when needed."""
    global _client
    with _lock:
        if _client is not None and _alive(_client):
            return _client
        if _client is not None:
            _client.close()
        gpus = _settings["gpus"] or os.environ.get("MGPU_GPUS") or None
        cpu_ranks = _settings["cpu_ranks"] or int(os.environ.get("MGPU_CPU_RANKS", "0")) or None
        _client = FleetClient.connect(_settings["address"], gpus=gpus, cpu_ranks=cpu_ranks)
        return _client


def _alive(client: FleetClient) -> bool:
    """Connected and answering. Without a round trip when nothing is waiting on the socket; else
    (a closed or dying server leaves an end-of-stream or its farewell there) by asking for its status."""
    if client.seems_connected():
        return True
    try:
        client.status()
        return True
    except (OSError, Exception):  # noqa: BLE001 - any failure means reconnect
        return False


def run(op: str, args: dict, tensors: dict | None = None, progress: Progress = None, should_cancel: ShouldCancel = None, log: Callable[[str], None] | None = None,
        preview: Preview = None):  # fmt: skip
    with _lock:
        client = fleet()
        try:
            return client.run(op, args, tensors or {}, on_progress=progress, on_log=log, should_cancel=should_cancel, on_preview=preview)
        except (OSError, ConnectionError) as exc:
            raise FleetUnavailable(f"lost the connection to the fleet server: {exc}") from exc


@dataclass(frozen=True)
class PromptEncoding:
    """One prompt as the encode job returned it: its video and audio contexts, in the model's dtype,
    and the digest the fleet keeps them under (None: contexts made elsewhere, always sent)."""

    video_context: torch.Tensor
    audio_context: torch.Tensor
    digest: str | None = None


@dataclass(frozen=True)
class StackedContext:
    """One prompt in ComfyUI's LTX-2 layout: the video and audio contexts concatenated on the last dim,
    as ComfyUI's LTX-2 text encoder makes it (and MGPU Text Encode's CONDITIONING holds it). The fleet
    splits it by the model's context widths. ``unprocessed`` is ComfyUI's ``unprocessed_ltxav_embeds``:
    text features before the checkpoint's embeddings connectors, which the fleet then runs
    (``text.contexts_from_comfy``). ``digest`` as in ``PromptEncoding``."""

    context: torch.Tensor
    unprocessed: bool = False
    digest: str | None = None


Prompt = PromptEncoding | StackedContext | tuple[torch.Tensor, torch.Tensor]


def _encoding(prompt: Prompt) -> PromptEncoding | StackedContext:
    return prompt if isinstance(prompt, (PromptEncoding, StackedContext)) else PromptEncoding(prompt[0], prompt[1])


def _context_tensors(prefix: str, encoding: PromptEncoding | StackedContext) -> dict[str, torch.Tensor]:
    if isinstance(encoding, StackedContext):
        return {f"{prefix}_{'unprocessed' if encoding.unprocessed else 'stacked'}_context": encoding.context}
    return {f"{prefix}_video_context": encoding.video_context, f"{prefix}_audio_context": encoding.audio_context}


def _given(**fields) -> dict:
    """The keyword arguments the caller set: the others take the schema's defaults."""
    return {name: value for name, value in fields.items() if value is not None}


def preview_rate(preview: Preview, preview_every: int | None) -> int:
    """The request's ``preview_every``: none without a callback to show them, else the caller's
    rate (0: off) or the schema's ``PREVIEW_EVERY``."""
    if preview is None:
        return 0
    return PREVIEW_EVERY if preview_every is None else preview_every


def run_naming_prompts(request, tensors: dict, prompts: dict[str, PromptEncoding | StackedContext], progress: Progress, should_cancel: ShouldCancel,
                       preview: Preview = None):  # fmt: skip
    """Run a job whose request names its prompts by digest, sending only the contexts without one.

    When the fleet no longer holds a digest (it restarted, or kept newer prompts), the job fails on
    every rank before any work with the ``CONTEXT_MISSING`` error; it is then sent once more with
    the contexts this process kept."""
    wire, sent = request.to_wire(), dict(tensors)
    for prefix, encoding in prompts.items():
        if encoding.digest is None:
            sent.update(_context_tensors(prefix, encoding))
    try:
        return run(request.op, wire, sent, progress=progress, should_cancel=should_cancel, preview=preview)
    except FleetError as exc:
        if exc.kind != "input_error" or CONTEXT_MISSING not in str(exc):
            raise
    for prefix, encoding in prompts.items():
        sent.update(_context_tensors(prefix, encoding))
    return run(request.op, wire, sent, progress=progress, should_cancel=should_cancel, preview=preview)


# --- The audio latent's length: ltx-core's and ComfyUI's ---------------------------------------------

AUDIO_LATENTS_PER_SECOND = 16000 / 160 / 4
"""Audio latent frames per second: the audio VAE's 16 kHz input, mel hop 160, 4x downsampling in time."""


def fleet_audio_frames(num_frames: int, frame_rate: float) -> int:
    """The audio latent length the fleet (ltx-core, ``AudioLatentShape.from_video_pixel_shape``) uses
    for ``num_frames`` video frames: seconds x 25, rounded to nearest (ties to even)."""
    return round(float(num_frames) / float(frame_rate) * AUDIO_LATENTS_PER_SECOND)


def comfy_audio_frames(num_frames: int, frame_rate: float) -> int:
    """The audio latent length of ComfyUI's LTXVEmptyLatentAudio: the same seconds x 25, rounded up,
    so one more than ``fleet_audio_frames`` wherever rounding to nearest goes down (24 fps, 121
    frames: 127 against 126; 50 fps, 121 frames: 61 against 60)."""
    return math.ceil(float(num_frames) / float(frame_rate) * AUDIO_LATENTS_PER_SECOND)


def audio_latent_for_comfy(audio_latent: torch.Tensor, num_frames: int, frame_rate: float) -> torch.Tensor:
    """A fleet audio latent ``[B, 8, T, 16]`` at ComfyUI's length: where ComfyUI's is one frame longer,
    the last latent frame repeated (the fleet drops it again on the way in, so it never changes a
    fleet result; a stock audio decoder hears it as 40 ms more of the last sound)."""
    extra = comfy_audio_frames(num_frames, frame_rate) - audio_latent.shape[2]
    if extra <= 0:
        return audio_latent
    return torch.cat([audio_latent, audio_latent[:, :, -1:].expand(-1, -1, extra, -1)], dim=2)


def _audio_lengths(video_latent: torch.Tensor, frame_rate: float) -> tuple[int, int, int]:
    """(video frames, the fleet's audio length, ComfyUI's) for a video latent ``[B, 128, F', h, w]``."""
    num_frames = pixel_geometry(video_latent.shape[2], video_latent.shape[3], video_latent.shape[4])[2]
    return num_frames, fleet_audio_frames(num_frames, frame_rate), comfy_audio_frames(num_frames, frame_rate)


def audio_latent_for_fleet(audio_latent: torch.Tensor, video_latent: torch.Tensor, frame_rate: float) -> torch.Tensor:
    """The audio latent a fleet job runs on: an audio latent of ComfyUI's length (one frame more than
    the fleet's) less its last frame; any other as given."""
    _, fleet_length, comfy_length = _audio_lengths(video_latent, frame_rate)
    if audio_latent.shape[2] == comfy_length != fleet_length:
        return audio_latent[:, :, :fleet_length]
    return audio_latent


def check_audio_latent_length(audio_latent: torch.Tensor, video_latent: torch.Tensor, frame_rate: float, node: str) -> None:
    """Refuse, in words that name ``node``, an audio latent whose length is neither the fleet's nor
    ComfyUI's for the video latent at ``frame_rate``."""
    num_frames, fleet_length, comfy_length = _audio_lengths(video_latent, frame_rate)
    length = audio_latent.shape[2]
    if length in (fleet_length, comfy_length):
        return
    lengths = f"{fleet_length}" if fleet_length == comfy_length else f"{fleet_length} or {comfy_length}"
    raise ValueError(
        f"{node}: the audio latent has {length} frames, but {num_frames} video frames at {frame_rate:g} fps take "
        f"{lengths}; make the audio latent for the same frame count and rate (LTXVEmptyLatentAudio with frames_number "
        f"{num_frames} and frame_rate {frame_rate:g}), or set {node}'s frame_rate to the rate the latent was made at"
    )


def parse_tiles(text: str) -> tuple[int, int] | None:
    """'auto' -> None (the fleet balances tiles over its ranks); '2x3' -> (2 height tiles, 3 width tiles)."""
    cleaned = text.strip().lower().replace(" ", "")
    if cleaned in ("", "auto"):
        return None
    height_tiles, separator, width_tiles = cleaned.partition("x")
    if not separator or not height_tiles.isdigit() or not width_tiles.isdigit() or int(height_tiles) < 1 or int(width_tiles) < 1:
        raise ValueError(f"tiles must be 'auto' or HxW tile counts like 2x2 (height x width); got {text!r}")
    return int(height_tiles), int(width_tiles)


def load(spec: dict, dtype: str = "bfloat16", progress: Progress = None, should_cancel: ShouldCancel = None) -> dict:
    """Validate the model files and load every component into every rank. Returns load figures."""
    request = LoadRequest.from_wire({"spec": spec, "dtype": dtype})
    return run(request.op, request.to_wire(), progress=progress, should_cancel=should_cancel).fields


def encode(
    spec: dict,
    prompts: list[str],
    dtype: str = "bfloat16",
    gemma_mode: str = "sharded",
    free_gemma: bool = False,
    progress: Progress = None,
    should_cancel: ShouldCancel = None,
) -> list[PromptEncoding]:
    """Each prompt's (video_context, audio_context) from the Gemma text encoder on the fleet, with the
    digest the fleet keeps them under: later jobs name the digest instead of sending the tensors.

    ``gemma_mode``: 'sharded' (one copy split over the GPUs, loaded by rank 0) or 'batch_parallel'
    (a copy per GPU, prompts split); ``free_gemma`` gives Gemma's memory back after encoding.
    """
    request = EncodeRequest.from_wire({"spec": spec, "dtype": dtype, "prompts": list(prompts), "gemma_mode": gemma_mode, "free_gemma": free_gemma})
    result = run(request.op, request.to_wire(), progress=progress, should_cancel=should_cancel)
    digests = result.fields["digests"]
    return [PromptEncoding(result.tensors[f"video_context_{i}"], result.tensors[f"audio_context_{i}"], digests[i]) for i in range(len(prompts))]


def _image_tensors(request, image: torch.Tensor | None, last_image: torch.Tensor | None) -> dict:
    """The conditioning images a stage job sends (``image``, ``last_image``), after refusing a strength set without its image."""
    check_image_strengths(request.image_strength, request.last_image_strength, image is not None, last_image is not None)
    return {name: tensor for name, tensor in (("image", image), ("last_image", last_image)) if tensor is not None}


def sample(
    spec: dict,
    positive: Prompt,
    negative: Prompt | None,
    *,
    width: int | None = None,
    height: int | None = None,
    num_frames: int | None = None,
    frame_rate: float | None = None,
    seed: int | None = None,
    steps: int | None = None,
    video_guidance: Guidance | None = None,
    audio_guidance: Guidance | None = None,
    image: torch.Tensor | None = None,
    parallel: str = "auto",
    cuda_graphs: bool | None = None,
    compile_blocks: bool = False,
    model_version: str | None = None,
    pipeline: str = DEFAULT_RECIPE,
    dtype: str = "bfloat16",
    progress: Progress = None,
    should_cancel: ShouldCancel = None,
    preview: Preview = None,
    preview_every: int | None = None,
    sigmas: tuple[float, ...] | None = None,
    sampler: str | None = None,
    image_strength: float = IMAGE_STRENGTH,
    last_image: torch.Tensor | None = None,
    last_image_strength: float = IMAGE_STRENGTH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: full-frame generation from noise at width x height (sequence/guidance parallel).

    ``pipeline`` "distilled" runs the distilled recipe's stage 1 (8 fixed sigmas, one positive-only
    pass per step): ``negative`` may then be None, and steps and guidance default to the recipe's.

    Arguments left as None take the schema's official defaults of the checkpoint's model version
    (``model_version`` None; a version given must agree with the checkpoint); a guidance's
    fields left as None too. ``cuda_graphs`` replays each pass's forward from a captured CUDA graph
    on GPU ranks (None: on with CUDA; equal to eager within bf16 noise; it pays off on the small
    shards of high SP degrees). ``compile_blocks`` also compiles the transformer blocks with
    torch.compile for this job (GPU ranks; a compile of tens of seconds per new shape, then fused
    kernels: worth it on a warm fleet at SP degree 4+). ``preview`` gets a live preview every
    ``preview_every`` steps (None: ``schema.PREVIEW_EVERY``; 0: none); previews never change the result.
    ``sigmas``: the stage-1 schedule, from 1.0 down to 0.0 (None: the recipe's; ``steps`` then follows
    it); ``sampler``: one of ``recipes.STEPPERS`` (None: the recipe's).
    ``image`` ([H, W, 3] in 0..1) conditions the first frame at ``image_strength``, ``last_image`` the last
    frame at ``last_image_strength``, as the recipe's conditioning says (``recipes.CONDITIONINGS``); a
    strength other than 1.0 without its image is refused."""
    prompts = {"positive": _encoding(positive)}
    if negative is not None:
        prompts["negative"] = _encoding(negative)
    request = SampleRequest.from_wire({
        "spec": spec, "dtype": dtype, "model_version": model_version, "pipeline": pipeline, "parallel": parallel,
        "compile_blocks": compile_blocks, "positive_digest": prompts["positive"].digest,
        "negative_digest": prompts["negative"].digest if "negative" in prompts else None,
        "preview_every": preview_rate(preview, preview_every),
        **_given(width=width, height=height, num_frames=num_frames, frame_rate=frame_rate, seed=seed, steps=steps, cuda_graphs=cuda_graphs),
        **_given(video_guidance=video_guidance and video_guidance.to_wire(), audio_guidance=audio_guidance and audio_guidance.to_wire()),
        **_given(sigmas=None if sigmas is None else [float(sigma) for sigma in sigmas], sampler=sampler),
        "image_strength": image_strength, "last_image_strength": last_image_strength,
    })  # fmt: skip
    tensors = _image_tensors(request, image, last_image)
    result = run_naming_prompts(request, tensors, prompts, progress, should_cancel, preview)
    return result.tensors["video_latent"], result.tensors["audio_latent"]


def upscale(
    spec: dict,
    video_latent: torch.Tensor,
    audio_latent: torch.Tensor,
    positive: Prompt,
    *,
    frame_rate: float | None = None,
    seed: int | None = None,
    sigmas: tuple[float, ...] | None = None,
    tiles: tuple[int, int] | None = None,
    overlap: int | None = None,
    image: torch.Tensor | None = None,
    force_from_noise: bool = False,
    model_version: str | None = None,
    pipeline: str = DEFAULT_RECIPE,
    parallel: str = "auto",
    dtype: str = "bfloat16",
    progress: Progress = None,
    should_cancel: ShouldCancel = None,
    fields: dict | None = None,
    preview: Preview = None,
    preview_every: int | None = None,
    sampler: str | None = None,
    image_strength: float = IMAGE_STRENGTH,
    last_image: torch.Tensor | None = None,
    last_image_strength: float = IMAGE_STRENGTH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: 2x spatial upsample, then the recipe's refinement (two-stage: the distilled LoRA;
    distilled: the distilled checkpoint as it is), tiled data parallel or sequence parallel.

    Returns the refined video latent and the audio latent: the stage-1 audio unchanged under TDP
    (frozen by design), the re-denoised audio under SP (``parallel`` "sp", or the planner's choice
    for the distilled recipe: ``schema.STAGE2_PLANS``). ``tiles`` is (height tiles, width tiles), TDP
    only; None picks a balanced split over the fleet. Arguments left as None take the schema's
    defaults (sigmas ``schema.stage2_default_sigmas(pipeline)``). ``fields``, when given, receives
    the job's result fields (the plan, and what the audio is). ``preview``, ``preview_every``,
    ``sampler``, the images and their strengths as in ``sample`` (the same images stage 1 had: a
    guiding latent makes stage 2 sequence parallel, since tiles cannot hold it).
    """
    prompts = {"positive": _encoding(positive)}
    request = UpscaleRequest.from_wire({
        "spec": spec, "dtype": dtype, "model_version": model_version, "pipeline": pipeline, "parallel": parallel,
        "force_from_noise": force_from_noise, "positive_digest": prompts["positive"].digest, "preview_every": preview_rate(preview, preview_every),
        **_given(frame_rate=frame_rate, seed=seed, sigmas=sigmas and list(sigmas), tiles=tiles and list(tiles), overlap=overlap, sampler=sampler),
        "image_strength": image_strength, "last_image_strength": last_image_strength,
    })  # fmt: skip
    tensors = {"video_latent": video_latent, "audio_latent": audio_latent, **_image_tensors(request, image, last_image)}
    result = run_naming_prompts(request, tensors, prompts, progress, should_cancel, preview)
    if fields is not None:
        fields.update(result.fields)
    return result.tensors["video_latent"], result.tensors["audio_latent"]


def decode(
    spec: dict,
    video_latent: torch.Tensor,
    audio_latent: torch.Tensor | None,
    *,
    seed: int | None = None,
    frame_rate: float | None = None,
    after_stages: int = 2,
    spatial_tile_pixels: int | None = None,
    temporal_tile_frames: int | None = None,
    dtype: str = "bfloat16",
    progress: Progress = None,
    should_cancel: ShouldCancel = None,
    guiding_frames: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, int | None]:
    """Distributed VAE decode: IMAGE frames [F,H,W,3] in 0..1 (via shared memory) and the audio
    waveform [B,C,T] with its sample rate (None, None without an audio latent).

    ``seed``, ``frame_rate`` and ``after_stages`` (how many stages drew noise from the job's
    generator before the decoder) reproduce the official pipeline's decoder noise exactly, with
    ``guiding_frames`` the image latents each of those stages appended (``recipes.Recipe.guiding_frames``).
    Arguments left as None take the schema's defaults.
    """
    request = DecodeRequest.from_wire({
        "spec": spec, "dtype": dtype, "after_stages": after_stages, "guiding_frames": guiding_frames,
        **_given(seed=seed, frame_rate=frame_rate, spatial_tile_pixels=spatial_tile_pixels, temporal_tile_frames=temporal_tile_frames),
    })  # fmt: skip
    tensors = {"video_latent": video_latent}
    if audio_latent is not None:
        tensors["audio_latent"] = audio_latent
    result = run(request.op, request.to_wire(), tensors, progress=progress, should_cancel=should_cancel)
    waveform = result.tensors.get("waveform")
    return result.tensors["frames"], waveform, result.fields.get("sample_rate") if waveform is not None else None


def unload(progress: Progress = None) -> dict:
    """Drop every loaded model from the ranks (the fleet stays up)."""
    return run("unload", {}, progress=progress).fields


def restart() -> None:
    """Stop the fleet server; the next call starts a fresh one (models reload on demand)."""
    global _client
    with _lock:
        try:
            fleet().shutdown()
        except FleetError:
            pass
        _client = None


def status() -> dict:
    with _lock:
        return fleet().status()
