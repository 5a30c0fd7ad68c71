"""ComfyUI's own LTX-2 against the fleet at world 1, on the same random checkpoint and identical inputs.

Python packages ``import comfy`` needs for the parts this bench imports (``comfy.cli_args``,
``comfy.model_management``, ``comfy.nested_tensor``, ``comfy.samplers``, ``comfy.sd``, ``comfy.utils``;
``comfy.sd`` pulls in every model family's code), besides torch and this project's own dependencies
(ltx-core with numpy, scipy, einops, safetensors, torchaudio; transformers with tokenizers,
huggingface-hub, regex, pyyaml, tqdm; av): torchvision (matching torch: 0.26.0 for torch 2.11, whose
PyPI wheel is the cu130 build), torchsde with trampoline, sentencepiece, psutil, Pillow.
comfy-kitchen is optional (without it ComfyUI logs that fp8/fp4 are off); kornia, spandrel, aiohttp,
SQLAlchemy, alembic and the frontend packages are not imported. Of the checkout only ``comfy/``,
``comfy_api/``, ``comfy_execution/``, ``comfy_config/``, ``utils/`` and the top-level ``*.py`` files are
read, and not the tokenizer data (``comfy/sd1_tokenizer``, ``comfy/text_encoders/*_tokenizer``, 12 MB).
``python bench/comfy_native.py --comfyui-dir DIR --check-imports`` imports those parts in a fresh
interpreter and prints every installed top-level module they loaded: run it on a new machine first.

What runs on each side, on one bundle written by ``mgpu_backend.bundles.full_size`` in the official
single-file layout (LTX-2.0 19B, or the 22B with ``--model 2.3``; with ``--tiny``, the configuration of
``mgpu_backend.bundles.tiny``), carrying the official ``causal_temporal_positioning`` metadata that
ComfyUI reads and ltx-core does not (the pinned tiny files lack it: ComfyUI would place the first
latent frame otherwise and differ by about 1%):

- ComfyUI: ``comfy.sd.load_checkpoint_guess_config`` on the checkpoint (its model detection reads
  the dims from the state dict and the ``config`` metadata; the weight dtype is ComfyUI's own
  choice, ``comfy.model_management.unet_dtype``: bf16 on an H200, fp32 on the CPU), loaded with
  ``comfy.model_management.load_models_gpu``. ``--gpu-only`` is set in ``comfy.cli_args`` before
  ``comfy.model_management`` is imported (``--cpu`` with ``--tiny``), so ComfyUI keeps every weight
  on the GPU and never offloads. The denoiser is ``BaseModel.apply_model`` (what ComfyUI's samplers
  call); the stage-1 step is ``comfy.samplers.CFGGuider`` with the ``euler`` sampler, i.e. what
  ComfyUI's LTX-2 template runs (SamplerCustomAdvanced + CFGGuider cfg 4: two passes, conditional and
  unconditional, no STG; the template's ``euler_ancestral`` only adds noise between steps, so
  ``euler`` is used to keep the two sides comparable).
- fleet: one rank (``mgpu_backend.ltx.api``, the jobs the ComfyUI nodes run) on the same checkpoint.
  A denoiser forward is a ``sample`` job with one positive-only step (LTX2Scheduler's one-step
  schedule, sigmas 0.1 -> 0, from the noise: the step's result is the denoised output); its time is
  the median of the per-step times a job of ``--repeats`` more such steps reports. The stage-1 step is a ``sample`` job with CFG 4 on both
  modalities and nothing else (no STG, no modality guidance, no rescale): the same two passes.

Inputs are identical: the noise is the fleet's own (its seeded generator, drawn here the same way on
the same device), the text contexts are seeded random tensors of the shape the embeddings processor
returns (1024 tokens; ComfyUI takes the video and audio contexts concatenated, as its LTX-2 text
encoder hands them over), the sigmas are the fleet's LTX2Scheduler schedule, frame rate 24.

The whole two-stage graph through ComfyUI's nodes and HTTP API is ``bench/comfy_graph.py``: ComfyUI's
LTX-2 text encoder takes the released 48-layer Gemma-3 12B from one file only, so that bench writes
the bundle with it.

``--profile`` adds where each side's forward spends its device time, at the largest size: one
forward of each under ``torch.profiler`` (ComfyUI's ``apply_model``; ltx-core's ``X0Model``, the
module the fleet's rank runs, built in this process with random weights of the same configuration
and given the same noise and contexts), its kernels summed into attention, matrix products,
normalization and the rest (elementwise, copies, RoPE), with the kernel count (launches) and the
largest kernels. On the CPU the same is done over the aten operators. The fleet replays stage 1 as
CUDA graphs, so its measured forward pays no launch overhead that the eager profile shows.

``--compile-blocks`` adds the fleet's forward and CFG step at the largest size with the transformer
blocks compiled (the ``compile_blocks`` job option: Inductor fuses the element-wise work; off by
default, since it is not bitwise equal to ltx-core), against ComfyUI and the default fleet; the first
compiled job's step, compile and capture included, is noted. On CPU ranks the blocks run eagerly.

``--multi-gpu`` with 2+ GPUs visible also runs the template's CFG steps on the fleet over all of them
(the planner's guidance plan: the two passes side by side) and sets them against ComfyUI on one GPU
and against the fleet's world-1 latents. It says whether this ComfyUI has MultiGPU work-unit nodes (its
own CFG split; the January 2026 checkout has none, and this bench does not drive them); with fewer
than 2 GPUs it says it needs them and skips.

    python bench/comfy_native.py --comfyui-dir ~/ComfyUI --tiny                     # CPU smoke run
    python bench/comfy_native.py --comfyui-dir ~/ComfyUI --bundle-dir /data/b19 --profile --compile-blocks --out FILE   # one H200

It prints one markdown table and notes (with ``--out``: appended under the command, machine and date).
Before a full-size bundle is written (checked against the free disk: 56 GB for 2.0), ComfyUI loads the
tiny bundle of the same version, so a ComfyUI that lacks the version (LTX-2.3 in January 2026) stops
in seconds. It never downloads anything; it writes only into ``--bundle-dir`` (default: a temporary
folder) and a temporary folder for that probe.
"""

from __future__ import annotations  # noqa: I001 - one-line imports, _common first: it puts the repository on sys.path

import contextlib
import gc
import importlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from _common import append_out, log, markdown_table, median, synchronize
from e2e import check_space
from mgpu_backend.bundles import full_size, tiny
from mgpu_backend.bundles.configs import OFFICIAL_TRANSFORMER_METADATA, BundleConfig
from mgpu_backend.ltx import api
from mgpu_backend.ltx.diagnostics import MODEL_CONFIGS, bench_config, random_contexts
from mgpu_backend.ltx.latents import StageGeometry, initial_state, job_generator, state_to_comfy
from mgpu_backend.ltx.recipes import TWO_STAGE
from mgpu_backend.ltx.schema import Guidance, ModelSpec, SampleRequest

FRAME_RATE = 24.0
SEED = 10
TEMPLATE_CFG = 4.0  # ComfyUI's LTX-2 template: CFGGuider cfg 4 in stage 1
POSITIVE_ONLY = Guidance(cfg_scale=1.0, stg_scale=0.0, rescale_scale=0.0, modality_scale=1.0, skip_step=0, stg_blocks=())
TEMPLATE_GUIDANCE = Guidance(cfg_scale=TEMPLATE_CFG, stg_scale=0.0, rescale_scale=0.0, modality_scale=1.0, skip_step=0, stg_blocks=())
TINY_SIZES = "96x64x9,192x128x17"
COMFY_MODULES = ("comfy.model_management", "comfy.nested_tensor", "comfy.samplers", "comfy.sd", "comfy.utils")
"""The parts of ComfyUI this bench imports (after ``comfy.cli_args``), in this order."""
MULTIGPU_MARKERS = ("MultiGPU", "WorkUnit", "work_unit")  # how ComfyUI's MultiGPU work-unit nodes are named in its source


@dataclass
class Inputs:
    """One size's identical inputs: noise in ComfyUI's layout (video [1,128,F',H/32,W/32], audio
    [1,8,T,16]) and the positive and negative (video, audio) contexts."""

    size: tuple[int, int, int]
    video_noise: torch.Tensor
    audio_noise: torch.Tensor
    positive: tuple[torch.Tensor, torch.Tensor]
    negative: tuple[torch.Tensor, torch.Tensor]
    sigmas: torch.Tensor  # the stage-1 schedule of the timed steps (float32)
    forward_sigma: float  # the sigma of a one-step sample job (LTX2Scheduler's one-step schedule starts at 0.1)

    @property
    def video_tokens(self) -> int:
        return math.prod(self.video_noise.shape[2:])

    @property
    def audio_tokens(self) -> int:
        return self.audio_noise.shape[2]


@dataclass
class SideResult:
    """What one side measured at one size."""

    forward_ms: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    denoised: tuple[torch.Tensor, torch.Tensor] | None = None  # one forward's output, (video, audio), float32 CPU
    stepped: tuple[torch.Tensor, torch.Tensor] | None = None  # the latents after the timed CFG steps
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------


def parse_sizes(text: str) -> list[tuple[int, int, int]]:
    sizes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(part.isdigit() for part in parts):
            raise SystemExit(f"error: --sizes takes WxHxF items separated by commas (768x512x121), got {item!r}")
        width, height, frames = (int(part) for part in parts)
        if width % 32 or height % 32 or (frames - 1) % 8:
            raise SystemExit(f"error: a stage-1 size needs width and height multiples of 32 and 8k+1 frames, got {item!r}")
        sizes.append((width, height, frames))
    return sizes


def bundle_config(version: str, tiny_size: bool) -> BundleConfig:
    """The full-size configuration of ``version``, or the tiny bundle's (``mgpu_backend.bundles.tiny``)
    with the official transformer metadata ComfyUI reads added: the pinned tiny files predate it, and
    without it ComfyUI positions the video tokens otherwise than ltx-core does."""
    if not tiny_size:
        return full_size.full_size_config(bench_config(version)["transformer"])
    base = tiny.tiny_config(version)
    checkpoint = {**base.checkpoint, "transformer": {**base.checkpoint["transformer"], **OFFICIAL_TRANSFORMER_METADATA}}
    return replace(base, checkpoint=checkpoint)


def checkpoint_transformer_config(checkpoint_path: str) -> dict:
    """The ``transformer`` section of the checkpoint's ``config`` metadata (what both sides read)."""
    from safetensors import safe_open

    with safe_open(checkpoint_path, "pt") as handle:
        metadata = handle.metadata() or {}
    return json.loads(metadata["config"])["transformer"]


def make_inputs(size: tuple[int, int, int], transformer_config: dict, steps: int, device: torch.device, dtype: torch.dtype) -> Inputs:
    """The fleet's stage-1 noise for ``SEED`` at ``size``, drawn as its sample job draws it (same
    generator, same order: video tokens, then audio), and seeded contexts."""
    from ltx_core.components.noisers import GaussianNoiser
    from ltx_core.components.schedulers import LTX2Scheduler

    width, height, frames = size
    geometry = StageGeometry(height, width, frames, FRAME_RATE)
    noiser = GaussianNoiser(generator=job_generator(SEED, device, dtype))
    noise = []
    for tools in (geometry.video_tools(), geometry.audio_tools()):
        state = initial_state(tools, [], noiser, 1.0, dtype, device)
        noise.append(state_to_comfy(state, tools).to(dtype).cpu())
    positive, negative = random_contexts(transformer_config, device, dtype, SEED)
    sigmas = LTX2Scheduler().execute(steps=steps).to(torch.float32)
    forward_sigma = float(LTX2Scheduler().execute(steps=1)[0])
    return Inputs(size, noise[0], noise[1], (positive.video_context.cpu(), positive.audio_context.cpu()),
                  (negative.video_context.cpu(), negative.audio_context.cpu()), sigmas, forward_sigma)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# ComfyUI, imported from --comfyui-dir and run as ComfyUI runs it
# --------------------------------------------------------------------------------------------------


def import_comfy(comfyui_dir: str, device: torch.device):
    """Import ComfyUI's ``comfy`` from ``comfyui_dir`` with its memory settings chosen first: ``--gpu-only``
    on a GPU (every weight stays there, nothing is offloaded), ``--cpu`` on the CPU."""
    root = Path(comfyui_dir).expanduser().resolve()
    if not (root / "comfy" / "model_management.py").is_file():
        raise SystemExit(f"error: --comfyui-dir {comfyui_dir} holds no ComfyUI checkout (no comfy/model_management.py); point it at the ComfyUI folder")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        import comfy.cli_args  # parses no command line unless asked to: only its defaults
    except ImportError as exc:
        raise SystemExit(f"error: importing ComfyUI from {root} failed ({exc}); install its requirements (see this script's docstring)") from None
    if "comfy.model_management" in sys.modules:
        raise SystemExit("error: comfy.model_management was imported before the memory settings were made")
    settings = comfy.cli_args.args
    if device.type == "cuda":
        settings.gpu_only = True
        settings.cuda_device = None
        if device.index is not None:
            torch.cuda.set_device(device)
    else:
        settings.cpu = True
    try:
        for name in COMFY_MODULES:
            importlib.import_module(name)
    except ImportError as exc:
        raise SystemExit(f"error: importing ComfyUI from {root} failed ({exc}); install its requirements (see this script's docstring)") from None
    return comfy


class _KeyReport(logging.Handler):
    """Collects the lines ComfyUI logs about checkpoint keys its model did not take or did not find."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(("unet unexpected", "unet missing", "left over keys")):
            self.lines.append(message)


def unused_transformer_keys(lines: list[str]) -> list[str]:
    """Transformer weights ComfyUI's model left out or lacked. The embeddings connectors are expected:
    ComfyUI runs them in its text encoder, not in the diffusion model."""
    import ast

    unused = []
    for line in lines:
        kind, _, listed = line.partition(":")
        try:
            keys = ast.literal_eval(listed.strip())
        except (ValueError, SyntaxError):
            keys = [listed.strip()]
        unused += [f"{kind.split()[-1]} {key}" for key in keys if "embeddings_connector." not in str(key)]
    return unused


def refuse_model(detail: str) -> None:
    raise SystemExit(
        f"error: ComfyUI's LTX-2 model (LTXAVModel) does not match this checkpoint's transformer: {detail}; this ComfyUI does not "
        "implement this model version (LTX-2.3's gated attention and cross-attention AdaLN need a newer ComfyUI); use --model 2.0"
    )


class ComfyNative:
    """ComfyUI's LTX-2 (LTXAV) model loaded from the checkpoint by ComfyUI's own loader."""

    def __init__(self, comfy, checkpoint_path: str, device: torch.device) -> None:
        self.comfy, self.device = comfy, device
        report = _KeyReport()
        logging.getLogger().addHandler(report)
        try:
            patcher, *_ = comfy.sd.load_checkpoint_guess_config(checkpoint_path, output_vae=False, output_clip=False, output_clipvision=False)
        except RuntimeError as exc:
            if "size mismatch" not in str(exc):
                raise
            mismatches = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
            refuse_model(f"{len(mismatches)} weights of another shape (first: {mismatches[0]})")
        finally:
            logging.getLogger().removeHandler(report)
        unused = unused_transformer_keys(report.lines)
        if unused:
            refuse_model(f"{len(unused)} weights unused or missing (first: {', '.join(unused[:3])})")
        self.patcher = patcher
        comfy.model_management.load_models_gpu([patcher], force_full_load=True)
        model = patcher.model
        self.dtype = model.get_dtype()
        attention = comfy.ldm.modules.attention.optimized_attention
        self.description = (
            f"ComfyUI {type(model).__name__} / {type(model.diffusion_model).__name__}, weights {str(self.dtype).removeprefix('torch.')}"
            f" (manual cast {model.manual_cast_dtype}), on {patcher.load_device}, vram state "
            f"{comfy.model_management.vram_state.name}, attention {getattr(attention, '__name__', attention)}"
        )

    @classmethod
    def wrapping(cls, comfy, patcher, device: torch.device, description: str) -> ComfyNative:
        """The same calls on a ModelPatcher loaded elsewhere (the drop-in loader's, whose model runs on the fleet)."""
        native = cls.__new__(cls)
        native.comfy, native.device, native.patcher, native.description = comfy, device, patcher, description
        native.dtype = patcher.model.get_dtype()
        return native

    def _packed(self, video: torch.Tensor, audio: torch.Tensor):
        # float32, as ComfyUI's samplers hold latents (apply_model casts to the weights' dtype itself)
        return self.comfy.utils.pack_latents([video.to(self.device, torch.float32), audio.to(self.device, torch.float32)])

    def _context(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # ComfyUI's LTX-2 text encoder hands the diffusion model [video context | audio context] on the last axis.
        return torch.cat(pair, dim=-1).to(self.device)

    def forward_call(self, inputs: Inputs, sigma: float):
        """A call of ``apply_model`` on ``inputs``' noise at ``sigma`` with the positive context (its inputs
        packed once), and the latent shapes to unpack its output with."""
        packed, shapes = self._packed(inputs.video_noise, inputs.audio_noise)
        sigma_tensor = torch.full((1,), sigma, device=self.device, dtype=torch.float32)
        context = self._context(inputs.positive)

        def call() -> torch.Tensor:
            with torch.inference_mode():
                # A new context tensor each call, as ComfyUI's sampler makes one every step (cond_cat's torch.cat).
                return self.patcher.model.apply_model(packed, sigma_tensor, c_crossattn=torch.cat([context]), frame_rate=FRAME_RATE, latent_shapes=shapes)

        return call, shapes

    def forward(self, inputs: Inputs, sigma: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``apply_model`` once on the noise at ``sigma``, positive context: the denoised (video, audio)."""
        call, shapes = self.forward_call(inputs, sigma)
        video, audio = self.comfy.utils.unpack_latents(call(), shapes)
        return video.float().cpu(), audio.float().cpu()

    def time_forward(self, inputs: Inputs, warmup: int, repeats: int) -> list[float]:
        call, _ = self.forward_call(inputs, inputs.forward_sigma)
        times = []
        for index in range(warmup + repeats):
            synchronize(self.device)
            started = time.perf_counter()
            call()
            synchronize(self.device)
            if index >= warmup:
                times.append((time.perf_counter() - started) * 1e3)
        return times

    def cfg_steps(self, inputs: Inputs) -> tuple[list[float], tuple[torch.Tensor, torch.Tensor], list[int]]:
        """The template's stage-1 sampling (CFGGuider cfg 4, sampler euler) over ``inputs.sigmas``
        from the noise: per-step milliseconds, the final latents, and the batch size of each model call."""
        comfy = self.comfy
        guider = comfy.samplers.CFGGuider(self.patcher)
        # CONDITIONING as ComfyUI's LTX-2 text encoder and LTXVConditioning (frame rate) make it.
        positive, negative = ([[self._context(pair), {"frame_rate": FRAME_RATE}]] for pair in (inputs.positive, inputs.negative))
        guider.set_conds(positive, negative)
        guider.set_cfg(TEMPLATE_CFG)
        batches: list[int] = []

        def counting_wrapper(apply_model, call):  # ComfyUI's own model-call hook: counts passes per call
            batches.append(len(call["cond_or_uncond"]))
            return apply_model(call["input"], call["timestep"], **call["c"])

        guider.model_options = {**guider.model_options, "model_function_wrapper": counting_wrapper}
        nested = comfy.nested_tensor.NestedTensor
        noise = nested([inputs.video_noise.float(), inputs.audio_noise.float()])
        latent = nested([torch.zeros_like(inputs.video_noise, dtype=torch.float32), torch.zeros_like(inputs.audio_noise, dtype=torch.float32)])
        marks: list[float] = []

        def on_step(step, denoised, x, total):
            synchronize(self.device)
            marks.append(time.perf_counter())

        synchronize(self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            sampler = comfy.samplers.sampler_object("euler")
            output = guider.sample(noise, latent, sampler, inputs.sigmas.clone(), callback=on_step, disable_pbar=True, seed=SEED)
        video, audio = output.unbind()
        boundaries = [started, *marks]
        return [(b - a) * 1e3 for a, b in zip(boundaries, boundaries[1:])], (video.float().cpu(), audio.float().cpu()), batches

    def free(self) -> None:
        self.comfy.model_management.unload_all_models()
        del self.patcher
        gc.collect()
        self.comfy.model_management.soft_empty_cache()


def run_comfy(comfy, checkpoint_path: str, inputs_per_size: list[Inputs], device: torch.device, warmup: int, repeats: int,
              profile: bool = False):  # fmt: skip
    """ComfyUI's side at every size, and with ``profile`` the profile of one forward at the last size."""
    log("ComfyUI: loading the checkpoint with comfy.sd.load_checkpoint_guess_config ...")
    started = time.perf_counter()
    native = ComfyNative(comfy, checkpoint_path, device)
    log(f"ComfyUI: loaded in {time.perf_counter() - started:.1f} s: {native.description}")
    results = []
    for inputs in inputs_per_size:
        result = SideResult()
        log(f"ComfyUI {inputs.size}: one forward, then {warmup} + {repeats} timed ...")
        result.denoised = native.forward(inputs, inputs.forward_sigma)
        result.forward_ms = native.time_forward(inputs, warmup, repeats)
        log(f"ComfyUI {inputs.size}: {len(inputs.sigmas) - 1} CFG steps ...")
        result.step_ms, result.stepped, batches = native.cfg_steps(inputs)
        per_step = len(batches) // max(1, len(result.step_ms))
        result.notes.append(f"ComfyUI ran {per_step} model call(s) per step, batch {'/'.join(str(b) for b in sorted(set(batches)))}")
        results.append(result)
    forward_profile = None
    if profile:
        inputs = inputs_per_size[-1]
        log(f"ComfyUI {inputs.size}: one forward under torch.profiler ...")
        forward_profile = profile_forward(native.forward_call(inputs, inputs.forward_sigma)[0], device)
    description = native.description
    native.free()
    return results, description, forward_profile


# --------------------------------------------------------------------------------------------------
# The fleet at world 1
# --------------------------------------------------------------------------------------------------


def fleet_sample(spec: ModelSpec, inputs: Inputs, dtype: str, steps: int, guidance: Guidance, compile_blocks: bool = False):
    """One ``sample`` job on the fleet with ``inputs``' contexts: (fields, video, audio, step ms)."""
    step_seconds: list[float] = []

    def progress(fields: dict) -> None:
        if fields.get("stage") == "stage1" and "seconds" in fields:
            step_seconds.append(fields["seconds"])

    width, height, frames = inputs.size
    request = SampleRequest.from_wire({
        "spec": spec.to_wire(), "dtype": dtype, "pipeline": TWO_STAGE.name, "width": width, "height": height, "num_frames": frames,
        "frame_rate": FRAME_RATE, "seed": SEED, "steps": steps, "video_guidance": guidance.to_wire(), "audio_guidance": guidance.to_wire(),
        "compile_blocks": compile_blocks,
    })  # fmt: skip
    prompts = {"positive": api.PromptEncoding(*inputs.positive)}
    if guidance.cfg_scale != 1.0:
        prompts["negative"] = api.PromptEncoding(*inputs.negative)
    result = api.run_naming_prompts(request, {}, prompts, progress, None)
    return result.fields, result.tensors["video_latent"], result.tensors["audio_latent"], [s * 1e3 for s in step_seconds]


def run_fleet(spec: ModelSpec, inputs_per_size: list[Inputs], dtype: str, repeats: int, socket_dir: str, gpus: str | None,
              cpu_ranks: int | None = None, forwards: bool = True, compile_blocks: bool = False) -> list[SideResult]:  # fmt: skip
    """The fleet's side at every size, on ``gpus`` (or ``cpu_ranks`` gloo ranks): one forward and its
    timing (``forwards``), then the template's CFG steps under the planner's choice for that world;
    with ``compile_blocks``, every job compiles the transformer blocks (the first one at each size
    pays the compilation: ``SideResult.notes`` says how long that job's step took)."""
    # A socket of its own per fleet: the previous one may still be shutting down on the old address.
    address = Path(socket_dir) / f"fleet-{(gpus or f'{cpu_ranks}cpu').replace(',', '-')}{'-compiled' if compile_blocks else ''}.sock"
    api.configure(address=str(address), gpus=gpus, cpu_ranks=cpu_ranks)
    results = []
    try:
        for inputs in inputs_per_size:
            result = SideResult()
            if forwards:
                log(f"fleet {inputs.size}: one forward (one positive-only step, sigma {inputs.forward_sigma:g} -> 0) ...")
                _fields, video, audio, first_ms = fleet_sample(spec, inputs, dtype, 1, POSITIVE_ONLY, compile_blocks)
                result.denoised = (video.float(), audio.float())
                if compile_blocks:
                    result.notes.append(f"the first compiled forward at {inputs.video_tokens} video tokens (compile + capture): {first_ms[0] / 1e3:.1f} s")
                log(f"fleet {inputs.size}: {repeats} timed forwards after one untimed ...")
                _fields, _video, _audio, step_ms = fleet_sample(spec, inputs, dtype, 1 + repeats, POSITIVE_ONLY, compile_blocks)
                result.forward_ms = step_ms[1:]
            steps = len(inputs.sigmas) - 1
            log(f"fleet {inputs.size}: {steps} CFG steps ...")
            fields, video, audio, result.step_ms = fleet_sample(spec, inputs, dtype, steps, TEMPLATE_GUIDANCE, compile_blocks)
            result.stepped = (video.float(), audio.float())
            result.notes.insert(0,
                f"fleet plan: {fields.get('plan')}; passes batched: {fields.get('batch_passes')}; CUDA graphs: {fields.get('cuda_graphs', 'off')}"
                + (f"; compiled blocks: {fields.get('compile_blocks')}" if compile_blocks else "")
            )  # fmt: skip
            results.append(result)
        api.unload()
    finally:
        with contextlib.suppress(Exception):
            api.fleet().shutdown()
        api.configure()
        time.sleep(2)  # the ranks give their GPU memory back
    return results


# --------------------------------------------------------------------------------------------------
# Where a forward spends its device time (--profile)
# --------------------------------------------------------------------------------------------------

KERNEL_GROUPS = (
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "softmax")),
    ("matrix products", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")),
    ("normalization", ("norm",)),
)
"""Kernel (CUDA) or aten operator (CPU) names by the words that mark them; the rest is "other"."""


@dataclass
class ForwardProfile:
    """One profiled forward: milliseconds per group, kernel count, the largest kernels, wall time, and
    the "other" kernels' time by the aten operator that launched them (name -> (ms, calls))."""

    group_ms: dict[str, float]
    kernels: int
    largest: list[tuple[str, float]]
    wall_ms: float
    other_by_operator: dict[str, tuple[float, int]]

    @property
    def total_ms(self) -> float:
        return sum(self.group_ms.values())


def kernel_group(name: str) -> str:
    lowered = name.lower()
    return next((group for group, words in KERNEL_GROUPS if any(word in lowered for word in words)), "other")


def profile_forward(call, device: torch.device) -> ForwardProfile:
    """``call`` once to warm up, then once under ``torch.profiler``: the device kernels it ran (on the
    CPU: the aten operators' own time), grouped by ``kernel_group``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        started = time.perf_counter()
        call()
        synchronize(device)
        wall_ms = (time.perf_counter() - started) * 1e3
    if device.type == "cuda":
        timed = [(event.name, event.time_range.elapsed_us() / 1e3) for event in profiler.events() if event.device_type == DeviceType.CUDA]
    else:
        timed = [(event.name, event.self_cpu_time_total / 1e3) for event in profiler.events() if event.name.startswith("aten::")]
    group_ms = {group: 0.0 for group, _ in KERNEL_GROUPS} | {"other": 0.0}
    by_name: dict[str, float] = {}
    for name, ms in timed:
        group_ms[kernel_group(name)] += ms
        by_name[name] = by_name.get(name, 0.0) + ms
    largest = sorted(by_name.items(), key=lambda item: -item[1])[:5]
    # The operators' own device time (CPU: own time), for those whose kernels fall in "other".
    own_ms = (lambda event: event.self_device_time_total) if device.type == "cuda" else (lambda event: event.self_cpu_time_total)
    other_by_operator = {
        event.key: (own_ms(event) / 1e3, event.count) for event in profiler.key_averages()
        if event.key.startswith("aten::") and own_ms(event) > 0 and kernel_group(event.key) == "other"
    }  # fmt: skip
    return ForwardProfile(group_ms, len(timed), largest, wall_ms, other_by_operator)


def ltx_core_forward(config: dict, inputs: Inputs, device: torch.device, dtype: torch.dtype):
    """A call running ltx-core's X0Model (the fleet rank's module, random weights of ``config``) once
    on ``inputs``' noise and positive contexts at the forward sigma, and the model (to free)."""
    from mgpu_backend.ltx.diagnostics import random_transformer
    from mgpu_backend.ltx.stages import modality_input

    model = random_transformer(config, device, dtype, SEED)
    width, height, frames = inputs.size
    geometry = StageGeometry(height, width, frames, FRAME_RATE)
    sigma = torch.full((1,), inputs.forward_sigma, device=device, dtype=torch.float32)
    modalities = []
    for tools, noise, context in zip((geometry.video_tools(), geometry.audio_tools()), (inputs.video_noise, inputs.audio_noise), inputs.positive):
        state = tools.create_initial_state(device, dtype, noise.to(device, dtype))
        modalities.append(modality_input(state, context.to(device, dtype), sigma))

    def call():
        with torch.inference_mode():
            return model(video=modalities[0], audio=modalities[1], perturbations=None)

    return call, model


def profile_lines(inputs: Inputs, comfy_profile: ForwardProfile, core_profile: ForwardProfile, device: torch.device) -> list[str]:
    """The ``--profile`` tables (ms per kind on both sides; the "other" kind by aten operator) and each
    side's largest kernels."""
    width, height, frames = inputs.size
    unit = "kernels" if device.type == "cuda" else "aten operators"
    where = "device" if device.type == "cuda" else "CPU"

    def row(name: str, comfy: float, core: float, digits: str = ".1f") -> list[str]:
        return [name, format(comfy, digits), format(core, digits), format(comfy - core, "+" + digits)]

    rows = [row(group, comfy_profile.group_ms[group], core_profile.group_ms[group]) for group in comfy_profile.group_ms]
    rows.append(row("**total**", comfy_profile.total_ms, core_profile.total_ms))
    rows.append(row(f"{unit} run", comfy_profile.kernels, core_profile.kernels, "d"))
    rows.append(row("profiled forward, wall ms", comfy_profile.wall_ms, core_profile.wall_ms))
    lines = [
        f"Where one forward spends its {where} time at {width}x{height}x{frames} (torch.profiler, eager, one forward after one warm-up):",
        "",
        markdown_table([unit, "ComfyUI ms", "ltx-core (fleet) ms", "ComfyUI - ltx-core"], rows),
        "",
    ]
    for side, profile in (("ComfyUI", comfy_profile), ("ltx-core", core_profile)):
        largest = "; ".join(f"{name[:90]} {ms:.1f} ms" for name, ms in profile.largest)
        lines.append(f"- {side}'s largest {unit}: {largest}")

    def own(profile: ForwardProfile, name: str) -> tuple[float, int]:
        return profile.other_by_operator.get(name, (0.0, 0))

    operators = sorted(
        set(comfy_profile.other_by_operator) | set(core_profile.other_by_operator),
        key=lambda name: -max(own(comfy_profile, name)[0], own(core_profile, name)[0]),
    )[:10]
    cells = [[name, *("{:.1f} ({})".format(*own(profile, name)) for profile in (comfy_profile, core_profile))] for name in operators]
    lines += [
        "",
        f'The "other" time by aten operator (its own {where} time; calls in brackets), the largest ten:',
        "",
        markdown_table(["aten operator", "ComfyUI ms (calls)", "ltx-core ms (calls)"], cells),
    ]
    return lines


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def difference(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, the same relative to the reference's largest magnitude)."""
    absolute = float((reference.float() - other.float()).abs().max())
    return absolute, absolute / max(float(reference.float().abs().max()), 1e-30)


def timed_median(values: list[float]) -> float:
    """Median of the timed steps: the first one carries each side's set-up, so it is left out when
    there are others."""
    return median(values[1:] or values)


def report_rows(inputs_per_size: list[Inputs], comfy_results: list[SideResult], fleet_results: list[SideResult]) -> list[list[str]]:
    rows = []
    for inputs, native, fleet in zip(inputs_per_size, comfy_results, fleet_results):
        width, height, frames = inputs.size
        forward = (median(native.forward_ms), median(fleet.forward_ms))
        step = (timed_median(native.step_ms), timed_median(fleet.step_ms))
        video_diff = difference(fleet.denoised[0], native.denoised[0])
        audio_diff = difference(fleet.denoised[1], native.denoised[1])
        stepped_video = difference(fleet.stepped[0], native.stepped[0])
        stepped_audio = difference(fleet.stepped[1], native.stepped[1])
        rows.append([
            f"{width}x{height}x{frames}", f"{inputs.video_tokens} + {inputs.audio_tokens}",
            f"{forward[0]:.1f}", f"{forward[1]:.1f}", f"{forward[0] / forward[1]:.3f}",
            f"{step[0]:.1f}", f"{step[1]:.1f}", f"{step[0] / step[1]:.3f}",
            f"{video_diff[0]:.3g} ({video_diff[1]:.2g})", f"{audio_diff[0]:.3g} ({audio_diff[1]:.2g})",
            f"{stepped_video[0]:.3g} / {stepped_audio[0]:.3g}",
        ])  # fmt: skip
    return rows


HEADERS = [
    "stage-1 size (WxHxF)", "video + audio tokens", "forward ms ComfyUI", "forward ms fleet", "ComfyUI / fleet",
    "CFG step ms ComfyUI", "CFG step ms fleet", "ComfyUI / fleet", "forward max abs diff video (rel)",
    "forward max abs diff audio (rel)", "max abs diff after the steps video / audio",
]  # fmt: skip


def multigpu_code(comfyui_dir: str) -> list[str]:
    """ComfyUI's files that mention its MultiGPU work units (none in the January 2026 checkout)."""
    root = Path(comfyui_dir).expanduser().resolve()
    return sorted(
        str(path.relative_to(root)) for folder in ("comfy", "comfy_extras") for path in (root / folder).rglob("*.py")
        if any(marker in path.read_text(errors="replace") for marker in MULTIGPU_MARKERS)
    )  # fmt: skip


def multi_gpu_lines(found: list[str], gpus: int, inputs_per_size: list[Inputs], comfy_results: list[SideResult],
                    world_1: list[SideResult], world_n: list[SideResult] | None) -> list[str]:  # fmt: skip
    """The ``--multi-gpu`` notes: the fleet's guidance plan on every visible GPU against ComfyUI on one
    (and, when this ComfyUI has them, a pointer to its MultiGPU nodes, which this bench does not drive)."""
    nodes = f"this ComfyUI has MultiGPU work-unit code in {', '.join(found)}" if found else "this ComfyUI has no MultiGPU work-unit nodes"
    if world_n is None:
        return [f"- --multi-gpu: skipped, it needs at least 2 GPUs ({gpus} visible); {nodes}"]
    lines = [f"- --multi-gpu on {gpus} GPUs: {nodes}" + (" (not driven by this bench: compare them by hand)" if found else "; ComfyUI runs on one")]
    for inputs, native, single, multi in zip(inputs_per_size, comfy_results, world_1, world_n):
        world_ms, comfy_ms = timed_median(multi.step_ms), timed_median(native.step_ms)
        video, audio = (difference(single.stepped[index], multi.stepped[index])[0] for index in (0, 1))
        width, height, frames = inputs.size
        lines.append(
            f"  - {width}x{height}x{frames}: fleet world {gpus} CFG step {world_ms:.1f} ms ({multi.notes[0].removeprefix('fleet plan: ')}), "
            f"ComfyUI on one GPU {comfy_ms:.1f} ms: {comfy_ms / world_ms:.2f}x; latents vs fleet world 1: max abs diff {video:.3g} / {audio:.3g}"
        )
    return lines


def compiled_lines(inputs: Inputs, native: SideResult, eager: SideResult, compiled: SideResult) -> list[str]:
    """The ``--compile-blocks`` table: the fleet with compiled blocks against ComfyUI and the default fleet."""
    width, height, frames = inputs.size
    forward = (median(native.forward_ms), median(eager.forward_ms), median(compiled.forward_ms))
    step = (timed_median(native.step_ms), timed_median(eager.step_ms), timed_median(compiled.step_ms))
    video, audio = (difference(compiled.denoised[index], native.denoised[index]) for index in (0, 1))
    row = [
        f"{width}x{height}x{frames}", f"{forward[0]:.1f}", f"{forward[1]:.1f}", f"{forward[2]:.1f}", f"{forward[0] / forward[2]:.3f}",
        f"{step[0]:.1f}", f"{step[1]:.1f}", f"{step[2]:.1f}", f"{step[0] / step[2]:.3f}",
        f"{video[0]:.3g} ({video[1]:.2g}) / {audio[0]:.3g} ({audio[1]:.2g})",
    ]  # fmt: skip
    headers = [
        "stage-1 size (WxHxF)", "forward ms ComfyUI", "forward ms fleet", "forward ms fleet compiled", "ComfyUI / compiled",
        "CFG step ms ComfyUI", "CFG step ms fleet", "CFG step ms fleet compiled", "ComfyUI / compiled",
        "forward max abs diff compiled vs ComfyUI video / audio (rel)",
    ]  # fmt: skip
    return [
        "The fleet with compiled blocks (`compile_blocks`, off by default: not bitwise equal to ltx-core), same inputs:",
        "",
        markdown_table(headers, [row]),
        "",
        *(f"- {note}" for note in compiled.notes),
    ]


def check_imports(comfyui_dir: str) -> None:
    """Import the parts of ComfyUI this bench uses in a fresh interpreter (nothing of this project
    loaded) and print every third-party top-level module they loaded, torch included."""
    import subprocess

    root = str(Path(comfyui_dir).expanduser().resolve())
    code = (
        "import importlib, sys\n"
        f"sys.path.insert(0, {root!r})\n"
        "import comfy.cli_args\n"
        "comfy.cli_args.args.cpu = True\n"
        f"for name in {COMFY_MODULES!r}: importlib.import_module(name)\n"
        "installed = lambda m: any(part in (getattr(m, '__file__', None) or '') for part in ('site-packages', 'dist-packages'))\n"
        "names = {n.split('.')[0] for n, m in list(sys.modules.items()) if installed(m)}\n"
        "print(', '.join(sorted(n for n in names if not n.startswith('_'))))\n"
    )
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    if completed.returncode:
        raise SystemExit(f"error: importing ComfyUI from {root} failed:\n{completed.stderr[-2000:]}")
    print(f"third-party modules that ComfyUI's {', '.join(COMFY_MODULES)} import: {completed.stdout.strip()}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui-dir", required=True, help="a ComfyUI checkout; its comfy package is imported from there")
    parser.add_argument("--model", choices=tuple(MODEL_CONFIGS), default="2.0", help="2.0 (19B) or 2.3 (22B); default 2.0")
    parser.add_argument("--bundle-dir", help="the random bundle both sides load (written if missing; default: a temporary folder)")
    parser.add_argument("--sizes", default="768x512x121,1536x1024x121", help="WxHxF stage-1 sizes (default: 6144 and 24576 video tokens)")
    parser.add_argument("--steps", type=int, default=4, help="stage-1 CFG steps per size; the first is not timed (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed ComfyUI forwards before the timed ones (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per side; the median is reported (default 5)")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available; cpu with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="the tiny bundle on the CPU, small sizes, fp32 (the smoke run)")
    parser.add_argument("--multi-gpu", action="store_true", help="also the fleet's guidance plan on every GPU (2+) against ComfyUI on one")
    parser.add_argument("--compile-blocks", action="store_true", help="also the fleet with compiled blocks at the largest size (GPUs; compiles for minutes)")
    parser.add_argument("--profile", action="store_true", help="also profile one forward of each side at the largest size (kernel time by kind)")
    parser.add_argument("--check-imports", action="store_true", help="only import ComfyUI's parts used here and list the packages they loaded")
    parser.add_argument("--out", help="append the table, with command, machine and date, to this file")
    args = parser.parse_args()
    if args.check_imports:
        check_imports(args.comfyui_dir)
        return
    if args.steps < 2 or args.repeats < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 2, --repeats >= 1 and --warmup >= 0, got {args.steps}, {args.repeats}, {args.warmup}")
    if args.tiny:
        args.device = args.device or "cpu"
        if args.sizes == parser.get_default("sizes"):
            args.sizes = TINY_SIZES
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {args.device} asked for, but torch sees no CUDA device; use --tiny on the CPU")
    sizes = parse_sizes(args.sizes)
    # bf16 on a GPU, as ComfyUI picks for LTX-2 there; fp32 on the CPU, where ComfyUI picks fp32 too.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")

    comfy = import_comfy(args.comfyui_dir, device)  # before anything touches CUDA memory settings
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        bundle_dir = args.bundle_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-comfy-native-"))
        started = time.perf_counter()
        if not args.tiny:  # a ComfyUI without this model version refuses in seconds, before tens of GB are written
            probe_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-comfy-native-probe-"))
            probe = full_size.write_bundle(probe_dir, bundle_config(args.model, True), "cpu", 0)
            ComfyNative(comfy, probe.checkpoint_path, device).free()
            log(f"ComfyUI holds the LTX-{args.model} layout (checked on the tiny bundle)")
        config = bundle_config(args.model, args.tiny)
        planned = sum(full_size.planned_bytes(config).values())
        Path(bundle_dir).mkdir(parents=True, exist_ok=True)
        if not full_size.is_complete(bundle_dir, config, device, 0):
            check_space(Path(bundle_dir), planned + (1 << 30), "the random bundle", "point --bundle-dir at a larger disk")
        log(f"random bundle: {planned / 1e9:.2f} GB in {bundle_dir}, drawn on {device} ...")
        bundle = full_size.write_bundle(bundle_dir, config, device, 0, log=log)
        spec = bundle.spec()
        if args.tiny:
            spec = replace(spec, distilled_lora=None)  # stage 1 only, in fp32: ltx-core fuses LoRAs into bf16 weights only
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        log(f"bundle ready in {time.perf_counter() - started:.1f} s: {bundle.checkpoint_path}")
        transformer_config = checkpoint_transformer_config(bundle.checkpoint_path)
        inputs_per_size = [make_inputs(size, transformer_config, args.steps, device, dtype) for size in sizes]
        comfy_results, comfy_description, comfy_profile = run_comfy(
            comfy, bundle.checkpoint_path, inputs_per_size, device, args.warmup, args.repeats, args.profile
        )
        socket_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-comfy-native-fleet-"))
        os.chmod(socket_dir, 0o700)
        gpus = str(device.index or 0) if device.type == "cuda" else None
        fleet_results = run_fleet(spec, inputs_per_size, dtype_name, args.repeats, socket_dir, gpus, None if gpus else 1)
        visible = torch.cuda.device_count() if device.type == "cuda" else 0
        multi_results = None
        if args.multi_gpu and visible >= 2:
            log(f"--multi-gpu: the fleet on all {visible} GPUs ...")
            all_gpus = ",".join(str(index) for index in range(visible))
            multi_results = run_fleet(spec, inputs_per_size, dtype_name, args.repeats, socket_dir, all_gpus, forwards=False)
        if args.profile:  # after the fleet has given its memory back
            log(f"ltx-core {inputs_per_size[-1].size}: one forward under torch.profiler ...")
            call, model = ltx_core_forward({"transformer": transformer_config}, inputs_per_size[-1], device, dtype)
            core_profile = profile_forward(call, device)
            del call, model
            gc.collect()
        compiled_results = None
        if args.compile_blocks:
            log(f"the fleet with compiled blocks at {inputs_per_size[-1].size} ...")
            compiled_results = run_fleet(spec, inputs_per_size[-1:], dtype_name, args.repeats, socket_dir, gpus, None if gpus else 1, compile_blocks=True)

    table = markdown_table(HEADERS, report_rows(inputs_per_size, comfy_results, fleet_results))
    notes = [
        f"- LTX-{args.model} random bundle ({'tiny' if args.tiny else 'full size'}), {dtype_name} on both sides; forward: one video+audio "
        f"denoiser call at sigma {inputs_per_size[0].forward_sigma:g}, median of {args.repeats}; CFG step: cfg {TEMPLATE_CFG:g} (conditional + unconditional), "
        f"median of steps 2-{args.steps}; diffs: the fleet's output minus ComfyUI's, relative to the fleet's largest value",
        f"- {comfy_description}",
        *(f"- {note}" for note in dict.fromkeys(note for result in comfy_results + fleet_results for note in result.notes)),
    ]
    if args.multi_gpu:
        notes += multi_gpu_lines(multigpu_code(args.comfyui_dir), visible, inputs_per_size, comfy_results, fleet_results, multi_results)
    if compiled_results:
        notes += ["", *compiled_lines(inputs_per_size[-1], comfy_results[-1], fleet_results[-1], compiled_results[0])]
    if args.profile:
        notes += ["", *profile_lines(inputs_per_size[-1], comfy_profile, core_profile, device)]
    text = table + "\n\n" + "\n".join(notes)
    print(text, flush=True)
    if args.out:
        append_out(text, device, args.out)


if __name__ == "__main__":
    main()
