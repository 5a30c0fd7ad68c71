"""The LTX-2 operations of the fleet as plain Python calls: what the ComfyUI nodes and the CLI use.

Each function submits one job (``load``, ``encode``, ``sample``, ``upscale``, ``decode``) to the
fleet and returns tensors in ComfyUI's layouts: video latent ``[B,128,F',H/32,W/32]``, audio latent
``[B,8,T,16]``, IMAGE ``[frames,H,W,3]`` float32 in 0..1, waveform ``[B,C,T]``. Every job carries the
model spec, so a fleet that restarted reloads the model on its own. ``progress`` receives the
fleet's progress events; ``should_cancel`` is polled while a job runs (ComfyUI's interrupt).

The connection is shared by the whole process and serialised with a lock: the fleet runs one job
at a time anyway. Nothing here imports ComfyUI.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mgpu_backend.fleet.client import FleetClient, FleetError, FleetUnavailable

Progress = Callable[[dict], None] | None
ShouldCancel = Callable[[], bool] | None

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
    try:
        client.status()
        return True
    except (OSError, Exception):  # noqa: BLE001 - any failure means reconnect
        return False


def run(op: str, args: dict, tensors: dict | None = None, progress: Progress = None, should_cancel: ShouldCancel = None, log: Callable[[str], None] | None = None):
    with _lock:
        client = fleet()
        try:
            return client.run(op, args, tensors or {}, on_progress=progress, on_log=log, should_cancel=should_cancel)
        except (OSError, ConnectionError) as exc:
            raise FleetUnavailable(f"lost the connection to the fleet server: {exc}") from exc


@dataclass(frozen=True)
class Guidance:
    """Multimodal guidance of one modality, as ltx-core's MultiModalGuiderParams."""

    cfg_scale: float
    stg_scale: float = 1.0
    rescale_scale: float = 0.7
    modality_scale: float = 3.0
    skip_step: int = 0
    stg_blocks: tuple[int, ...] | None = None  # None: the official block 29 (the last block of a smaller model)

    def to_json(self) -> dict:
        return {**self.__dict__, "stg_blocks": None if self.stg_blocks is None else list(self.stg_blocks)}


VIDEO_GUIDANCE = Guidance(cfg_scale=3.0)  # ltx-pipelines 1.0.0 LTX-2.0 defaults
AUDIO_GUIDANCE = Guidance(cfg_scale=7.0)


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
    return run("load", {"spec": spec, "dtype": dtype}, progress=progress, should_cancel=should_cancel).fields


def encode(
    spec: dict,
    prompts: list[str],
    dtype: str = "bfloat16",
    gemma_mode: str = "sharded",
    free_gemma: bool = False,
    progress: Progress = None,
    should_cancel: ShouldCancel = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(video_context, audio_context) for each prompt, from the Gemma text encoder on the fleet.

    ``gemma_mode``: 'sharded' (one copy split over the GPUs, loaded by rank 0) or 'batch_parallel'
    (a copy per GPU, prompts split); ``free_gemma`` gives Gemma's memory back after encoding.
    """
    args = {"spec": spec, "dtype": dtype, "prompts": list(prompts), "gemma_mode": gemma_mode, "free_gemma": free_gemma}
    result = run("encode", args, progress=progress, should_cancel=should_cancel)
    return [(result.tensors[f"video_context_{i}"], result.tensors[f"audio_context_{i}"]) for i in range(len(prompts))]


def sample(
    spec: dict,
    positive: tuple[torch.Tensor, torch.Tensor],
    negative: tuple[torch.Tensor, torch.Tensor],
    *,
    width: int,
    height: int,
    num_frames: int,
    frame_rate: float = 24.0,
    seed: int = 10,
    steps: int = 40,
    video_guidance: Guidance = VIDEO_GUIDANCE,
    audio_guidance: Guidance = AUDIO_GUIDANCE,
    image: torch.Tensor | None = None,
    parallel: str = "auto",
    cuda_graphs: bool = True,
    compile_blocks: bool = False,
    dtype: str = "bfloat16",
    progress: Progress = None,
    should_cancel: ShouldCancel = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: full-frame generation from noise at width x height (sequence/guidance parallel).

    ``cuda_graphs`` replays each pass's forward from a captured CUDA graph on GPU ranks (equal to
    eager within bf16 noise; it pays off on the small shards of high SP degrees). ``compile_blocks``
    also compiles the transformer blocks with torch.compile for this job (GPU ranks; a compile of
    tens of seconds per new shape, then fused kernels: worth it on a warm fleet at SP degree 4+)."""
    args = {
        "spec": spec, "dtype": dtype, "width": width, "height": height, "num_frames": num_frames,
        "frame_rate": frame_rate, "seed": seed, "steps": steps, "parallel": parallel, "cuda_graphs": cuda_graphs,
        "compile_blocks": compile_blocks,
        "video_guidance": video_guidance.to_json(), "audio_guidance": audio_guidance.to_json(),
    }  # fmt: skip
    tensors = {
        "positive_video_context": positive[0], "positive_audio_context": positive[1],
        "negative_video_context": negative[0], "negative_audio_context": negative[1],
    }  # fmt: skip
    if image is not None:
        tensors["image"] = image
    result = run("sample", args, tensors, progress=progress, should_cancel=should_cancel)
    return result.tensors["video_latent"], result.tensors["audio_latent"]


def upscale(
    spec: dict,
    video_latent: torch.Tensor,
    audio_latent: torch.Tensor,
    positive: tuple[torch.Tensor, torch.Tensor],
    *,
    frame_rate: float = 24.0,
    seed: int = 10,
    sigmas: tuple[float, ...] = (0.625, 0.4, 0.0),
    tiles: tuple[int, int] | None = None,
    overlap: int = 4,
    image: torch.Tensor | None = None,
    force_from_noise: bool = False,
    dtype: str = "bfloat16",
    progress: Progress = None,
    should_cancel: ShouldCancel = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: 2x spatial upsample, then tiled data parallel refinement with the distilled LoRA.

    Returns the refined video latent and the stage-1 audio latent unchanged (frozen by design).
    ``tiles`` is (height tiles, width tiles); None picks a balanced split over the fleet.
    """
    args = {
        "spec": spec, "dtype": dtype, "frame_rate": frame_rate, "seed": seed, "sigmas": list(sigmas),
        "tiles": list(tiles) if tiles else None, "overlap": overlap, "force_from_noise": force_from_noise,
    }  # fmt: skip
    tensors = {
        "video_latent": video_latent, "audio_latent": audio_latent,
        "positive_video_context": positive[0], "positive_audio_context": positive[1],
    }  # fmt: skip
    if image is not None:
        tensors["image"] = image
    result = run("upscale", args, tensors, progress=progress, should_cancel=should_cancel)
    return result.tensors["video_latent"], result.tensors["audio_latent"]


def decode(
    spec: dict,
    video_latent: torch.Tensor,
    audio_latent: torch.Tensor | None,
    *,
    seed: int = 10,
    frame_rate: float = 24.0,
    after_stages: int = 2,
    spatial_tile_pixels: int = 512,
    temporal_tile_frames: int = 64,
    dtype: str = "bfloat16",
    progress: Progress = None,
    should_cancel: ShouldCancel = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int | None]:
    """Distributed VAE decode: IMAGE frames [F,H,W,3] in 0..1 (via shared memory) and the audio
    waveform [B,C,T] with its sample rate (None, None without an audio latent).

    ``seed``, ``frame_rate`` and ``after_stages`` (how many stages drew noise from the job's
    generator before the decoder) reproduce the official pipeline's decoder noise exactly.
    """
    args = {
        "spec": spec, "dtype": dtype, "seed": seed, "frame_rate": frame_rate, "after_stages": after_stages,
        "spatial_tile_pixels": spatial_tile_pixels, "temporal_tile_frames": temporal_tile_frames,
    }  # fmt: skip
    tensors = {"video_latent": video_latent}
    if audio_latent is not None:
        tensors["audio_latent"] = audio_latent
    result = run("decode", args, tensors, progress=progress, should_cancel=should_cancel)
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
