"""Fleet jobs for benchmarks and ``doctor``: the real stage-1 path on a random full-size transformer.

No LTX-2 weights exist on the machines this project is measured on, and compute does not depend on
the weights' values: ``random_transformer`` builds ltx-core's LTXModel at a given configuration
(the 19B or the 22B one in configs/) directly on the device with seeded random weights, so
two processes that build it with the same seed hold the same weights. ``bench_stage1`` runs the
fleet's own stage-1 code on it (``jobs.run_stage1``: the plan, the techniques applied and undone by
``parallelize.parallelize_stage1``, the guidance passes, progress and cancel points).

Nothing here is used by the user-facing jobs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from ltx_core.model.transformer import LTXModelConfigurator, X0Model

from mgpu_backend.bundles.configs import model_version
from mgpu_backend.bundles.random_weights import materialize_random_
from mgpu_backend.fleet.jobs import JobContext, JobInputError, job
from mgpu_backend.ltx.jobs import active_passes, input_errors, run_stage1
from mgpu_backend.ltx.safetensors_header import model_version_of
from mgpu_backend.ltx.recipes import DEFAULT_RECIPE
from mgpu_backend.ltx.schema import MAX_FRAMES, MAX_SIDE, MAX_STEPS, OFFICIAL, Guidance, defaults_for, integer_field, number_field
from mgpu_backend.ltx.stages import GenerationParams, guider_params, transformer_layer_count
from mgpu_backend.ltx.text import TextContext
from mgpu_backend.ltx.validation import TransformerDims
from mgpu_backend.parallel.compiled_blocks import compile_blocks_wanted
from mgpu_backend.parallel.cuda_graphs import cuda_graphs_wanted

BENCH_STEPS = 4  # a few stage-1 steps time a step; the official 40 would only repeat them

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODEL_CONFIGS = {"2.0": CONFIGS / "ltx2-19b-transformer.json", "2.3": CONFIGS / "ltx2.3-22b-transformer.json"}
"""The full-size transformer configuration of each model version: LTX-2.0 19B, LTX-2.3 22B."""
# Tiny dimensions for CPU smoke runs of the benchmarks; either layout keeps its own structure (the
# 22B one: gates, cross-attention AdaLN, contexts at the cross-attention widths 128 and 64).
TINY_OVERRIDES = {
    "num_layers": 2, "num_attention_heads": 8, "attention_head_dim": 16, "audio_num_attention_heads": 8,
    "audio_attention_head_dim": 8, "cross_attention_dim": 128, "audio_cross_attention_dim": 64, "caption_channels": 64,
}  # fmt: skip


def bench_config(model_version: str = "2.0", path: str | None = None, tiny: bool = False) -> dict:
    """``{"transformer": ...}`` for a benchmark: the file at ``path``, else the full-size
    configuration of ``model_version``; ``tiny`` shrinks it to ``TINY_OVERRIDES``."""
    source = Path(path) if path else MODEL_CONFIGS[model_version]
    config = {"transformer": json.loads(source.read_text())["transformer"]}
    if tiny:
        config["transformer"].update(TINY_OVERRIDES)
    return config


def random_transformer(config: dict, device: torch.device, dtype: torch.dtype, seed: int) -> X0Model:
    """ltx-core's X0Model(LTXModel) at ``config`` with seeded random weights, built on ``device``."""
    with torch.device("meta"):
        velocity_model = LTXModelConfigurator.from_config(config)
    return X0Model(materialize_random_(velocity_model, device, dtype, seed)).eval()


def context_widths(transformer_config: dict) -> tuple[int, int]:
    """(video, audio) width of the text contexts the embeddings processor hands this transformer.

    The 19B (LTX-2.0) layout projects the caption inside the transformer, so both contexts come at
    the Gemma width (``caption_channels``, 3840); the 22B (LTX-2.3) layout projects it in the text
    encoder, so the transformer takes contexts already at its cross-attention widths (4096 and 2048)."""
    if transformer_config.get("caption_proj_before_connector"):
        return transformer_config.get("cross_attention_dim", 4096), transformer_config.get("audio_cross_attention_dim", 2048)
    return transformer_config["caption_channels"], transformer_config["caption_channels"]


def transformer_version(transformer_config: dict) -> str:
    """The model version of a transformer configuration, as its checkpoint's metadata would say it."""
    return model_version_of({"model_version": model_version({"transformer": transformer_config})})


def random_contexts(transformer_config: dict, device: torch.device, dtype: torch.dtype, seed: int, tokens: int = 1024) -> tuple[TextContext, TextContext]:
    """Positive and negative text contexts of the shapes the embeddings processor returns for this transformer."""
    video_width, audio_width = context_widths(transformer_config)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    make = lambda width: torch.randn(1, tokens, width, device=device, dtype=dtype, generator=generator)  # noqa: E731
    return TextContext(make(video_width), make(audio_width)), TextContext(make(video_width), make(audio_width))


class RandomModel:
    """Stands in for ``ResidentModel`` where only the stage-1 transformer is needed."""

    def __init__(self, config: dict, device: torch.device, dtype: torch.dtype, seed: int) -> None:
        self.config, self.device, self.dtype = config, device, dtype
        self.model = random_transformer(config, device, dtype, seed)

    def transformer(self, lora_set: str = "none") -> X0Model:
        return self.model

    # The resident model's interface: ``lora_set`` names the fused LoRAs there; a random model has none.
    def layer_count(self, lora_set: str = "none") -> int:
        return transformer_layer_count(self.model)

    def attention_heads(self, lora_set: str = "none") -> tuple[int, int]:
        block = self.model.velocity_model.transformer_blocks[0]
        return block.attn1.heads, block.audio_attn1.heads


@job("bench_stage1")
def bench_stage1(ctx: JobContext, args: dict, tensors: dict):
    """Stage 1 of the fleet on a random transformer; returns step times and the latents.

    ``pipeline`` (default two-stage) picks the recipe's stage 1: two-stage runs ``steps`` (default
    ``BENCH_STEPS``) of LTX2Scheduler's schedule with the guidance asked for; distilled runs its fixed
    sigmas (all of their steps) with no guidance unless asked, one pass per step."""
    config = args.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("transformer"), dict):
        raise JobInputError("bench_stage1 needs 'config' with a 'transformer' section (shared/configs/*.json)")
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.get("dtype", "bfloat16")]
    with input_errors():
        seed = integer_field(args, "seed", OFFICIAL.seed, 0, 2**31)
    key = ("random_model", json_key(config), dtype, seed)
    if ctx.state.get("bench_key") != key:
        ctx.state.pop("bench_model", None)
        ctx.state["bench_model"] = RandomModel(config, ctx.device, dtype, seed)
        ctx.state["bench_key"] = key
    model = ctx.state["bench_model"]
    layers = model.layer_count()
    with input_errors():
        # STG on block 28 for 2.3, 29 for 2.0; the distilled recipe: no guidance over its fixed sigmas
        official = defaults_for(transformer_version(config["transformer"]), args.get("pipeline", DEFAULT_RECIPE))
        video, audio = (Guidance.from_wire(args.get(f"{m}_guidance"), f"{m}_guidance", getattr(official, f"{m}_guidance")) for m in ("video", "audio"))
        fixed_steps = None if official.stage1_sigmas is None else len(official.stage1_sigmas) - 1
        params = GenerationParams(
            height=integer_field(args, "height", OFFICIAL.stage1_height, 32, MAX_SIDE),
            width=integer_field(args, "width", OFFICIAL.stage1_width, 32, MAX_SIDE),
            num_frames=integer_field(args, "num_frames", OFFICIAL.num_frames, 1, MAX_FRAMES),
            frame_rate=number_field(args, "frame_rate", OFFICIAL.frame_rate, 1.0, 240.0),
            seed=seed, num_inference_steps=integer_field(args, "steps", fixed_steps or BENCH_STEPS, 1, MAX_STEPS),
            video_guider=guider_params(video, official.video_guidance, layers),
            audio_guider=guider_params(audio, official.audio_guidance, layers),
            two_stage=False, stage1_sigmas=official.stage1_sigmas,
        )  # fmt: skip
        params.validate()  # a fixed schedule runs its own step count
    positive, negative = random_contexts(config["transformer"], ctx.device, dtype, seed)
    original_step = ctx.step
    marks: list[float] = []

    def timed_step(stage: str, step: int, total: int) -> None:
        original_step(stage, step, total)  # synchronises the device first, then the cancel point
        marks.append(time.perf_counter())

    ctx.step = timed_step
    started = time.perf_counter()
    dims = TransformerDims.from_config(config["transformer"], sum(p.numel() for p in model.model.parameters()))
    cuda_graphs = cuda_graphs_wanted(args.get("cuda_graphs"), ctx.device)
    compile_blocks = compile_blocks_wanted(args.get("compile_blocks"), ctx.device)
    fields, out = run_stage1(ctx, model, params, positive, negative, None, args.get("parallel", "auto"), dims, cuda_graphs,
                             args.get("batch_passes", "auto"), compile_blocks)  # fmt: skip
    boundaries = [started, *marks]
    fields["step_seconds"] = [b - a for a, b in zip(boundaries, boundaries[1:])]
    fields["passes"] = len(active_passes(params.video_guider, params.audio_guider))
    fields["video_tokens"] = params.stage1.video_tokens
    fields["audio_tokens"] = params.stage1.audio_tokens
    if ctx.device.type == "cuda":
        fields["peak_memory_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
    return fields, out


def json_key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


# -- jobs of ``python -m mgpu_backend doctor`` ---------------------------------------------------------
# Each one measures or checks one thing on every rank of a short-lived fleet the doctor started, and
# returns plain numbers; the doctor (mgpu_backend/doctor.py) judges them and words the advice.

import logging  # noqa: E402 - used by the doctor's jobs only, kept with them

SP_CHECK_WARN_ABOVE = 1e-4  # fp32 float rounding of a 2-layer model stays far below this
SP_CHECK_FAIL_ABOVE = 1e-2  # beyond any rounding: sharding or the exchange is wrong


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest_rank_seconds(ctx: JobContext, seconds: float) -> float:
    """The time of the slowest rank: a collective is only as fast as its last participant."""
    return float(ctx.control.all_reduce_max(torch.tensor([seconds], dtype=torch.float64)).item())


def _timed_collective(ctx: JobContext, run, iterations: int, warmup: int) -> float:
    """Seconds per call of ``run()``, measured on every rank together, slowest rank's figure."""
    for _ in range(warmup):
        run()
    _synchronize(ctx.device)
    ctx.control.barrier()  # start the clocks together, so no rank's time includes waiting for another
    started = time.perf_counter()
    for _ in range(iterations):
        run()
    _synchronize(ctx.device)
    return _slowest_rank_seconds(ctx, (time.perf_counter() - started) / iterations)


def _check_all_reduce(ctx: JobContext, numel: int) -> None:
    values = torch.full((numel,), float(ctx.rank + 1), device=ctx.device)
    ctx.comm.all_reduce_sum(values)
    expected = ctx.world_size * (ctx.world_size + 1) / 2  # small integers: exact in float32
    wrong = int((values != expected).sum().item())
    if wrong:
        raise RuntimeError(f"all-reduce returned wrong sums in {wrong} of {numel} elements (expected {expected:g})")


def _check_all_to_all(ctx: JobContext, numel: int) -> None:
    chunk = numel // ctx.world_size
    # Chunk j sent by rank r holds r * world + j, so rank r must receive j * world + r from rank j.
    sent = (ctx.rank * ctx.world_size + torch.arange(ctx.world_size, device=ctx.device, dtype=torch.float32)).repeat_interleave(chunk)
    received = ctx.comm.all_to_all(sent, scatter_dim=0, gather_dim=0)
    expected = (torch.arange(ctx.world_size, device=ctx.device, dtype=torch.float32) * ctx.world_size + ctx.rank).repeat_interleave(chunk)
    if not torch.equal(received, expected):
        wrong = int((received != expected).sum().item())
        raise RuntimeError(f"all-to-all delivered wrong data in {wrong} of {numel} elements")


@job("doctor_collectives")
def doctor_collectives(ctx: JobContext, args: dict, tensors: dict):
    """Algorithm bandwidth and latency of the fleet's all-reduce and all-to-all (``ctx.comm``, NCCL on
    GPUs, gloo on CPU) at a few message sizes, each checked for correct data before it is timed."""
    sizes = args.get("sizes_bytes")
    if not isinstance(sizes, list) or not sizes or not all(isinstance(s, int) and 4 <= s <= 2**31 for s in sizes):
        raise JobInputError(f"sizes_bytes must be a list of byte counts from 4 to 2**31, got {sizes!r}")
    with input_errors():
        iterations = integer_field(args, "iterations", 10, 1, 10_000)
        warmup = integer_field(args, "warmup", 2, 0, 1000)
    results = []
    for index, size in enumerate(sizes):
        # float32 elements, a whole number per rank so the all-to-all chunks are equal
        numel = max(1, size // 4 // ctx.world_size) * ctx.world_size
        _check_all_reduce(ctx, numel)
        _check_all_to_all(ctx, numel)
        buffer = torch.zeros(numel, device=ctx.device)  # zeros stay zeros, however often they are summed
        for op, run in (
            ("all_reduce", lambda: ctx.comm.all_reduce_sum(buffer)),
            ("all_to_all", lambda: ctx.comm.all_to_all(buffer, scatter_dim=0, gather_dim=0)),
        ):
            seconds = _timed_collective(ctx, run, iterations, warmup)
            results.append({"op": op, "bytes": numel * 4, "seconds": seconds})
        ctx.step("doctor_collectives", index + 1, len(sizes))
    return {"backend": ctx.comm.backend, "world_size": ctx.world_size, "results": results}, {}


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _install_and_explain(comm, device: torch.device) -> tuple[str, list[str]]:
    """``mgpu_kernels.install_fast_all_to_all`` on ``comm`` (collective), with the lines it logs saying why
    it chose what it chose: the reasons exist only in its log."""
    from mgpu_kernels import install_fast_all_to_all

    logger = logging.getLogger("mgpu_kernels")
    capture, level = _LogCapture(), logger.level
    logger.addHandler(capture)
    logger.setLevel(logging.INFO)
    try:
        choice = install_fast_all_to_all(comm, device)
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)
    return choice, capture.lines


@job("doctor_all_to_all_kernel")
def doctor_all_to_all_kernel(ctx: JobContext, args: dict, tensors: dict):
    """Whether the CUDA-IPC all-to-all kernel can serve this fleet, and why; if it can, check that it
    moves the same bytes as torch.distributed and time both at one size. CUDA fleets of 2+ ranks only:
    the doctor never asks where there is no CUDA, so nothing is ever built there."""
    from mgpu_kernels import CUDA_IPC, uninstall_fast_all_to_all

    if ctx.device.type != "cuda" or ctx.world_size < 2:
        raise JobInputError("the all-to-all kernel check needs a CUDA fleet of at least 2 ranks")
    with input_errors():
        size = integer_field(args, "bytes", 16 << 20, 4 * ctx.world_size, 2**31)
        iterations = integer_field(args, "iterations", 10, 1, 10_000)
    choice, reasons = _install_and_explain(ctx.comm, ctx.device)
    fields = {"choice": choice, "reasons": reasons}
    if choice == CUDA_IPC:
        try:
            numel = size // 4 // ctx.world_size * ctx.world_size
            generator = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
            sent = torch.randn(numel, device=ctx.device, generator=generator)
            by_kernel = ctx.comm.all_to_all(sent, scatter_dim=0, gather_dim=0)
            by_torch = ctx.comm.torch_all_to_all(sent, scatter_dim=0, gather_dim=0)
            fields["max_abs_diff_vs_torch"] = float((by_kernel - by_torch).abs().max().item())
            fields["bytes"] = numel * 4
            fields["kernel_seconds"] = _timed_collective(ctx, lambda: ctx.comm.all_to_all(sent, 0, 0), iterations, 2)
            fields["torch_seconds"] = _timed_collective(ctx, lambda: ctx.comm.torch_all_to_all(sent, 0, 0), iterations, 2)
        finally:
            uninstall_fast_all_to_all(ctx.comm)
    return fields, {}


def sp_check_groups(world_size: int, heads: int) -> list[list[int]]:
    """SP groups for the doctor's check, laid out as stage 1 can lay them out (world = groups x SP
    degree, the degree dividing the heads): the whole fleet when its size divides the head count, else
    equal consecutive groups of the largest degree that divides both."""
    degree = max(d for d in range(1, world_size + 1) if world_size % d == 0 and heads % d == 0)
    return [list(range(start, start + degree)) for start in range(0, world_size, degree)]


def _sp_check_inputs(config: dict, device: torch.device, seed: int, text_tokens: int):
    """Video and audio transformer inputs (``Modality``) of a small stage-1 geometry, seeded on the CPU
    so every rank holds the same numbers whatever its device."""
    from mgpu_backend.ltx.latents import StageGeometry

    geometry = StageGeometry(height=64, width=96, num_frames=17, frame_rate=24.0)  # 3x2x3 = 18 video tokens
    caption_channels = config["transformer"]["caption_channels"]
    return random_transformer_inputs(geometry, geometry, text_tokens, caption_channels, 0.7, device, torch.float32, seed, draw_on_cpu=True)


def random_transformer_inputs(video_geometry, audio_geometry, text_tokens: int, caption_channels: int | tuple[int, int], sigma: float,
                              device: torch.device, dtype: torch.dtype, seed: int, draw_on_cpu: bool = False):  # fmt: skip
    """Video and audio ``Modality`` as the denoising loops build them (ltx-core's latent tools) at
    ``sigma``, with seeded random latents and text contexts of ``text_tokens`` x ``caption_channels``
    (one width for both, or (video, audio) as ``context_widths`` gives them for the 22B layout).
    Drawn in the order video latent, video context, audio latent, audio context, on ``device`` (or
    on the CPU with ``draw_on_cpu``, so every device gets the same numbers)."""
    from mgpu_backend.ltx.stages import modality_input

    widths = caption_channels if isinstance(caption_channels, tuple) else (caption_channels, caption_channels)
    draw_device = torch.device("cpu") if draw_on_cpu else torch.device(device)
    generator = torch.Generator(device=draw_device).manual_seed(seed)
    sigma_tensor = torch.full((1,), sigma, device=device, dtype=torch.float32)
    inputs = []
    for tools, width in zip((video_geometry.video_tools(), audio_geometry.audio_tools()), widths):
        latent = torch.randn(tools.target_shape.to_torch_shape(), generator=generator, device=draw_device, dtype=dtype)
        state = tools.create_initial_state(device, dtype, latent.to(device))
        context = torch.randn((1, text_tokens, width), generator=generator, device=draw_device, dtype=dtype)
        inputs.append(modality_input(state, context.to(device), sigma_tensor))
    return inputs[0], inputs[1]


@job("doctor_sp_check")
def doctor_sp_check(ctx: JobContext, args: dict, tensors: dict):
    """A small random LTXModel run once as it is and once under ``apply_sequence_parallel``, fp32, same
    inputs on every rank; returns the largest difference over the ranks (NaN/inf flagged apart).

    ``reference_noise`` (default 0) perturbs the reference model's weights: the doctor's tests use it to
    make sure a real disagreement is reported.
    """
    from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel, remove_sequence_parallel, sequence_parallel_degree

    config = args.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("transformer"), dict):
        raise JobInputError("doctor_sp_check needs 'config' with a 'transformer' section")
    with input_errors():
        seed = integer_field(args, "seed", 0, 0, 2**31)
        noise = number_field(args, "reference_noise", 0.0, 0.0, 1.0)
    model = random_transformer(config, ctx.device, torch.float32, seed)
    video, audio = _sp_check_inputs(config, ctx.device, seed, text_tokens=8)

    reference_model = model
    if noise:
        reference_model = random_transformer(config, ctx.device, torch.float32, seed)
        for parameter in reference_model.parameters():
            parameter.add_(noise)
    reference = reference_model(video=video, audio=audio, perturbations=None)

    groups = sp_check_groups(ctx.world_size, model.velocity_model.num_attention_heads)
    sp_comm = ctx.comm.split(groups) if len(groups) > 1 else ctx.comm
    exchange = "none"
    if sp_comm.world_size > 1:
        exchange = sp_comm.backend
        if ctx.device.type == "cuda":  # as stage 1 does: the kernel where it can serve, else torch
            exchange, _ = _install_and_explain(sp_comm, ctx.device)
    apply_sequence_parallel(model, sp_comm)
    applied_degree = sequence_parallel_degree(model)  # proof the sharded path ran, not the plain one
    try:
        sharded = model(video=video, audio=audio, perturbations=None)
    finally:
        remove_sequence_parallel(model)
        if ctx.device.type == "cuda" and sp_comm.world_size > 1:
            from mgpu_kernels import uninstall_fast_all_to_all

            uninstall_fast_all_to_all(sp_comm)

    finite = all(bool(torch.isfinite(t).all()) for t in (*sharded, *reference))
    difference = max(float((a.float() - b.float()).abs().max()) for a, b in zip(sharded, reference)) if finite else 0.0
    # NaN does not survive a max all-reduce reliably: reduce "some rank saw non-finite values" apart.
    summary = ctx.control.all_reduce_max(torch.tensor([difference, 0.0 if finite else 1.0], dtype=torch.float64))
    return {
        "max_abs_diff": float(summary[0]),
        "finite": not bool(summary[1]),
        "groups": groups,
        "sp_degree": len(groups[0]),
        "applied_sp_degree": applied_degree,
        "exchange": exchange,
        "video_tokens": int(video.latent.shape[1]),
        "audio_tokens": int(audio.latent.shape[1]),
        "output_scale": float(sharded[0].abs().max()),
        "warn_above": SP_CHECK_WARN_ABOVE,
        "fail_above": SP_CHECK_FAIL_ABOVE,
    }, {}
