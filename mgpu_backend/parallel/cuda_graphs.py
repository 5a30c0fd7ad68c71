"""CUDA-graph capture of the per-rank transformer forward: one graph per input signature, replayed.

What it is: at the shard a rank sees under a high SP degree (~1000-2000 video tokens) an eager
LTX-2 forward is bound by kernel launches and Python, not by the GPU (143-266 ms at 1152 tokens on
an H200, where the arithmetic takes well under 100 ms). ``CapturedForward`` wraps an X0Model-like
callable ``(video, audio, perturbations) -> (video_out, audio_out)``. Per signature (shape, dtype
and device of every tensor of both ``Modality`` inputs, their ``enabled`` flags, which optional
fields are None, the perturbation content) and per ``variant`` (a key the caller names for what it
changed on the model that a graph bakes in: an SP group, compiled blocks) it warms the forward up
eagerly on a side stream, captures one ``torch.cuda.CUDAGraph`` (all graphs of one wrapper share
one memory pool) and from then on replays it: the call's tensors are copied into static input
buffers, the graph is replayed, and clones of the static outputs are returned.

``apply_cuda_graphs(runner, captured, variant, group)`` wraps any ``PassRunner`` so that it calls
the captured forward instead of the model; ``remove_cuda_graphs(model)`` undoes what capturing
changed on the model instance (its RoPE grids). This module keeps no wrapper on the model: whoever
wants graphs to survive across jobs keeps the ``CapturedForward`` (the stage-1 parallelize entry,
``mgpu_backend.ltx.parallelize``, keeps one per resident transformer in the job state).

When it falls back to eager (logged once per reason; results are then exactly the plain call's):
not on CUDA, switched off, autograd on, a conditioning self-attention mask (ltx-core turns it into
a bias with a host-synchronising ``.any()`` and boolean indexing), or a capture that raised (that
signature stays eager; the ranks of the ``group`` handed in agree, so they all replay or all run
eager). Collectives over NCCL inside the forward (SP's all-to-alls and all-gathers) are recorded in
the graph; an exchange that synchronises the host (the CUDA-IPC all-to-all) cannot be, and the
caller must not ask for graphs then.

What it costs: a capture is 2 warm-up forwards + 1 captured + 1 replayed, once per signature; the
shared pool keeps the activation memory of the largest captured forward reserved for as long as
the wrapper lives (``CapturedForward.release`` frees it). Weights changed in place (LoRA swaps of the
weight tracker) are seen by the graphs; parameters replaced by new tensors are not: release first.

ltx-core reads its RoPE frequency grid from a CPU tensor and copies it to the GPU in every forward,
which a graph cannot hold; ``keep_rope_grids_on_device`` makes one model instance read a device copy
instead (same numbers). This module never edits ltx-core, never imports ``ltx_pipelines`` or another
technique module, and never talks to other ranks except through the ``Comm`` it is handed.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Hashable

import torch
from ltx_core.guidance.perturbations import BatchedPerturbationConfig
from ltx_core.model.transformer.modality import Modality
from ltx_core.model.transformer.rope import generate_freq_grid_np, generate_freq_grid_pytorch, precompute_freqs_cis

from mgpu_backend.ltx.passes import PassRunner, SequentialPassRunner
from mgpu_backend.parallel.comm import Comm

log = logging.getLogger(__name__)

WARMUP_CALLS = 2  # eager forwards on the side stream before a capture (cuBLAS/NCCL set-up, lazy init)


# -- signatures ----------------------------------------------------------------------------------


def _modality_signature(modality: Modality | None) -> tuple | None:
    if modality is None:
        return None
    parts = []
    for field in dataclasses.fields(modality):
        value = getattr(modality, field.name)
        if isinstance(value, torch.Tensor):
            parts.append((field.name, tuple(value.shape), value.dtype, value.device))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append((field.name, value))
        else:
            raise TypeError(f"Modality.{field.name} of type {type(value).__name__} has no CUDA-graph signature")
    return tuple(parts)


def _perturbation_signature(perturbations: BatchedPerturbationConfig | None) -> tuple | None:
    if perturbations is None:
        return None
    samples = []
    for sample in perturbations.perturbations:
        if sample.perturbations is None:
            samples.append(None)
        else:
            samples.append(
                tuple(
                    (p.type.value, None if p.blocks is None else tuple(p.blocks)) for p in sample.perturbations
                )
            )
    return tuple(samples)


def forward_signature(
    video: Modality | None, audio: Modality | None, perturbations: BatchedPerturbationConfig | None
) -> tuple:
    """What a captured graph is valid for: equal signatures may replay the same graph.

    Tensor values are not part of it (they are copied into the static inputs); shapes, dtypes,
    devices, ``enabled``, None-ness of optional fields, the perturbation content (which blocks skip
    which attention decides which kernels run) and the autograd mode are.
    """
    return (
        _modality_signature(video),
        _modality_signature(audio),
        _perturbation_signature(perturbations),
        torch.is_inference_mode_enabled(),
        torch.is_grad_enabled(),
    )


def _tensor_fields(modality: Modality | None) -> list[str]:
    if modality is None:
        return []
    return [f.name for f in dataclasses.fields(modality) if isinstance(getattr(modality, f.name), torch.Tensor)]




# -- RoPE grids on the device --------------------------------------------------------------------


def _args_preprocessors(model) -> list:
    velocity = getattr(model, "velocity_model", model)
    found = []
    for name in ("video_args_preprocessor", "audio_args_preprocessor"):
        preprocessor = getattr(velocity, name, None)
        if preprocessor is not None:
            found.append(getattr(preprocessor, "simple_preprocessor", preprocessor))
    return found


def _resident_grid(grids: dict, host_grid, theta: float, max_pos_count: int, dim: int, device: torch.device) -> torch.Tensor:
    key = (host_grid, theta, max_pos_count, dim, device)
    grid = grids.get(key)
    if grid is None:
        # Made outside any capture (the warm-up runs first), so the grid never lives in a graph pool.
        grid = grids[key] = host_grid(theta, max_pos_count, dim).to(device)
    return grid


def _positional_embeddings_from_resident_grid(
    grids, preprocessor, positions, inner_dim, max_pos, use_middle_indices_grid, num_attention_heads, x_dtype
):
    # ltx-core's TransformerArgsPreprocessor._prepare_positional_embeddings with one change: the
    # frequency grid comes from a copy already on the positions' device, not a CPU tensor copied over.
    host_grid = generate_freq_grid_np if preprocessor.double_precision_rope else generate_freq_grid_pytorch
    return precompute_freqs_cis(
        positions,
        dim=inner_dim,
        out_dtype=x_dtype,
        theta=preprocessor.positional_embedding_theta,
        max_pos=max_pos,
        use_middle_indices_grid=use_middle_indices_grid,
        num_attention_heads=num_attention_heads,
        rope_type=preprocessor.rope_type,
        freq_grid_generator=lambda theta, count, dim: _resident_grid(grids, host_grid, theta, count, dim, positions.device),
    )


def keep_rope_grids_on_device(model, grids: dict | None = None) -> None:
    """Make ``model`` (LTXModel or X0Model) read its RoPE frequency grids from device-resident
    copies (same values), removing the host-to-device copy a CUDA graph cannot capture. Idempotent.

    ``grids`` holds the device copies; a captured graph reads them, so they must live as long as
    the graph (``CapturedForward`` hands in its own)."""
    grids = {} if grids is None else grids
    for preprocessor in _args_preprocessors(model):
        if "_prepare_positional_embeddings" not in vars(preprocessor):
            preprocessor._prepare_positional_embeddings = functools.partial(
                _positional_embeddings_from_resident_grid, grids, preprocessor
            )


def restore_host_rope_grids(model) -> bool:
    """Undo ``keep_rope_grids_on_device``: ltx-core's own RoPE preparation again. Returns True when
    something was restored. Graphs captured before keep their device grids and replay unchanged."""
    restored = False
    for preprocessor in _args_preprocessors(model):
        restored = vars(preprocessor).pop("_prepare_positional_embeddings", None) is not None or restored
    return restored


# -- the wrapper ---------------------------------------------------------------------------------


@dataclasses.dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    static_inputs: list[torch.Tensor]  # video tensor fields, then audio ones, in dataclass order
    static_outputs: tuple


class CapturedForward:
    """``model(video=, audio=, perturbations=)`` through CUDA graphs, one per ``variant`` and
    ``forward_signature``.

    Call it like the model. ``variant`` names what the caller changed on the model that a graph
    bakes in (a graph captured under one SP group or with compiled blocks must not serve another);
    ``group`` is the ``Comm`` whose ranks run the forward together (an SP group), so that they all
    replay or all run eagerly. Keep one per model instance for as long as its graphs should live:
    the graphs belong to the model's weights.
    """

    def __init__(self, model, enabled: bool = True, warmup_calls: int = WARMUP_CALLS) -> None:
        self.model = model
        self.enabled = enabled
        self.warmup_calls = warmup_calls
        self.graphs: dict[Hashable, _Graph] = {}
        self.eager_reasons: dict[Hashable, str] = {}  # signature -> why it runs eagerly
        self.capture_seconds: dict[Hashable, float] = {}
        self.captures = 0
        self.replays = 0
        self.eager_calls = 0
        self._pool = None
        self._side_stream: torch.cuda.Stream | None = None
        self._logged: set[str] = set()
        self._rope_grids: dict[tuple, torch.Tensor] = {}  # device RoPE grids the graphs read

    def __call__(
        self,
        video: Modality,
        audio: Modality,
        perturbations: BatchedPerturbationConfig | None = None,
        *,
        variant: Hashable = None,
        group: Comm | None = None,
    ):
        reason = self._reason_for_eager(video, audio)
        if reason is not None:
            return self._eager(reason, video, audio, perturbations)
        key = (variant, forward_signature(video, audio, perturbations))
        if key in self.eager_reasons:
            return self._eager(self.eager_reasons[key], video, audio, perturbations)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, video, audio, perturbations, group)
            if entry is None:
                return self._eager(self.eager_reasons[key], video, audio, perturbations)
        return self._replay(entry, video, audio)

    def summary(self) -> dict:
        """Plain numbers for job results and benchmarks."""
        return {
            "graphs": len(self.graphs),
            "captures": self.captures,
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "capture_seconds": round(sum(self.capture_seconds.values()), 3),
            "eager_reasons": sorted(set(self.eager_reasons.values()) | self._logged),
        }

    def release(self) -> None:
        """Drop every graph and its memory pool (the next call of each signature captures again)."""
        self.graphs.clear()
        self.eager_reasons.clear()
        self.capture_seconds.clear()
        self._rope_grids.clear()
        self._pool = None
        gc.collect()  # a graph's static buffers may sit in reference cycles: free them before returning the pool
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- internals -------------------------------------------------------------------------------

    def _reason_for_eager(self, video: Modality | None, audio: Modality | None) -> str | None:
        if not self.enabled:
            return "CUDA graphs are switched off (cuda_graphs=false)"
        tensors = [getattr(m, name) for m in (video, audio) for name in _tensor_fields(m)]
        devices = {t.device for t in tensors}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return f"inputs on {sorted(map(str, devices))}; CUDA graphs need every input on one CUDA device"
        if torch.is_grad_enabled():
            return "autograd is on; CUDA graphs here serve inference only (run under torch.inference_mode)"
        if any(m is not None and m.attention_mask is not None for m in (video, audio)):
            return (
                "a conditioning self-attention mask is set: ltx-core builds its bias with a host sync "
                "(.any() and boolean indexing), which a CUDA graph cannot hold"
            )
        return None

    def _eager(self, reason: str, video, audio, perturbations):
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("CUDA graphs: running the transformer eagerly: %s", reason)
        self.eager_calls += 1
        return self.model(video=video, audio=audio, perturbations=perturbations)

    def _capture(self, key, video: Modality, audio: Modality, perturbations, group: Comm | None) -> _Graph | None:
        started = time.perf_counter()
        device = video.latent.device if video is not None else audio.latent.device
        keep_rope_grids_on_device(self.model, self._rope_grids)
        static_video, video_buffers = self._static_copy(video)
        static_audio, audio_buffers = self._static_copy(audio)
        call = functools.partial(self.model, video=static_video, audio=static_audio, perturbations=perturbations)

        # Warm-up on a side stream, as the PyTorch CUDA-graphs notes ask: lazy initialisation (cuBLAS
        # handles, NCCL communicators, autotuning, the RoPE grids) happens here, not in the capture.
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device)
        self._side_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side_stream):
            for _ in range(self.warmup_calls):
                call()
        torch.cuda.current_stream(device).wait_stream(self._side_stream)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        error = None
        try:
            # thread_local: only this thread's forward must stay capturable; other threads of the
            # rank (NCCL watchdog, sockets) may keep using CUDA meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = call()
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run this signature eagerly
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        error = self._agree_on_failure(error, device, group)
        if error is not None:
            del graph
            self.eager_reasons[key] = f"capture failed ({error}); this input signature runs eagerly"
            return None
        entry = _Graph(graph, video_buffers + audio_buffers, tuple(outputs))
        self.graphs[key] = entry
        self.captures += 1
        self.capture_seconds[key] = time.perf_counter() - started
        shapes = [tuple(m.latent.shape) for m in (video, audio) if m is not None]
        log.info(
            "CUDA graphs: captured the transformer forward for latents %s (%s) in %.2f s; %d graph(s) held",
            shapes,
            "perturbed" if perturbations is not None else "unperturbed",
            self.capture_seconds[key],
            len(self.graphs),
        )
        return entry

    @staticmethod
    def _agree_on_failure(error: str | None, device: torch.device, group: Comm | None) -> str | None:
        """Ranks of one SP group must all replay or all run eagerly (their collectives pair up)."""
        if group is None or group.world_size == 1:
            return error
        failed = torch.tensor([0.0 if error is None else 1.0], device=device)
        group.all_reduce_max(failed)
        if failed.item() and error is None:
            return "another rank of the SP group could not capture"
        return error

    @staticmethod
    def _static_copy(modality: Modality | None) -> tuple[Modality | None, list[torch.Tensor]]:
        """The modality with every tensor replaced by a buffer of its own (outside the graph pool)."""
        if modality is None:
            return None, []
        buffers = {name: getattr(modality, name).clone(memory_format=torch.contiguous_format) for name in _tensor_fields(modality)}
        return dataclasses.replace(modality, **buffers), list(buffers.values())

    def _replay(self, entry: _Graph, video: Modality | None, audio: Modality | None):
        inputs = [getattr(m, name) for m in (video, audio) for name in _tensor_fields(m)]
        for static, value in zip(entry.static_inputs, inputs, strict=True):
            static.copy_(value)
        entry.graph.replay()
        self.replays += 1
        # Clones: the static outputs are overwritten by the next replay of any graph of the pool.
        return tuple(None if out is None else out.clone() for out in entry.static_outputs)


class CapturingPassRunner:
    """A ``PassRunner`` that runs ``inner`` with the transformer replaced by ``captured`` (the
    ``CapturedForward`` of that transformer), called with this runner's ``variant`` and ``group``."""

    def __init__(self, inner: PassRunner | None, captured: CapturedForward, variant: Hashable = None, group: Comm | None = None) -> None:
        self.inner = SequentialPassRunner() if inner is None else inner
        self.captured, self.variant, self.group = captured, variant, group

    def run(self, transformer, passes):
        if transformer is not self.captured.model:
            raise ValueError("this CUDA-graph runner was made for another transformer; apply CUDA graphs to this one")
        forward = functools.partial(self.captured, variant=self.variant, group=self.group)
        return self.inner.run(forward, passes)

    def summary(self) -> dict:
        return self.captured.summary()


def apply_cuda_graphs(
    runner: PassRunner | None, captured: CapturedForward, variant: Hashable = None, group: Comm | None = None
) -> CapturingPassRunner:
    """``runner`` (sequential when None) made to call ``captured`` instead of its transformer.

    ``variant`` and ``group`` as for ``CapturedForward``. The model itself is changed only when a
    graph is captured (its RoPE grids, see ``keep_rope_grids_on_device``); ``remove_cuda_graphs``
    undoes that."""
    if not isinstance(captured, CapturedForward):
        raise TypeError(f"apply_cuda_graphs needs a CapturedForward of the transformer, got {type(captured).__name__}")
    return CapturingPassRunner(runner, captured, variant, group)


def remove_cuda_graphs(model) -> bool:
    """Give ``model`` back what capturing changed on it (the RoPE grids read from the device); the
    ``CapturedForward`` and its graphs stay valid for a later ``apply_cuda_graphs``. Returns True
    when something was restored."""
    return restore_host_rope_grids(model)


def cuda_graphs_wanted(value, device: torch.device) -> bool:
    """The ``cuda_graphs`` job argument: true/false, or absent for 'on when the device is CUDA'."""
    if value is None:
        return device.type == "cuda"
    if not isinstance(value, bool):
        raise ValueError(f"cuda_graphs must be true or false, got {value!r}; leave it out for 'on with CUDA'")
    return value
