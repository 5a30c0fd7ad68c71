"""Per-rank memory of the weight-sharded transformer at full size, on ranks sharing one GPU.

What it measures: N ranks (gloo, all on one GPU: ``MGPU_SHARED_GPU_RANKS``'s layout), each capped
with ``torch.cuda.set_per_process_memory_fraction`` to stand for a consumer GPU of ``--cap-gib``,
hold the full-size transformer (all blocks, random weights) sharded over the ranks and run one
forward at each stage's size of the two-stage and distilled recipes (stage 1 at half the
resolution, stage 2 at the full one: both recipes run these shapes) under SP over all the ranks.
Each rank's peak (``max_memory_allocated``) is set beside the planner's estimate for that stage:
``ComponentSizes.sharded_transformer`` (its shard, two gathered blocks, the weights outside the
blocks) + ``validation.estimate_memory_bytes`` activations at the SP degree. The table also says
what the residency planner decides for the whole job (Gemma, VAEs and all) on such GPUs, including
the refusals and what they name.

The model is built on the meta device, sharded there, and only each rank's shard is materialised
(``to_empty`` + random fill), so no rank ever holds the whole transformer. This is a memory
measurement: ranks sharing one GPU give no speed figures, and none are printed.

With ``--whole-job`` it runs whole jobs instead, through a real fleet: for each recipe (two-stage,
distilled), size, rank count and cap it starts a fleet of N ranks on GPU 0
(``MGPU_SHARED_GPU_RANKS=N``, each rank capped by ``MGPU_MEMORY_FRACTION``, which the rank applies at
start with ``torch.cuda.set_per_process_memory_fraction``) with ``residency: "sharded"``, on a
random-weight bundle written first (``mgpu_backend.bundles.full_size``: the 22B with the released
48-layer Gemma), and runs the jobs of the ComfyUI nodes one by one: load, encode (Gemma), stage 1,
upscale (the upsampler, then stage 2: one job), decode. After each job it reads every rank's peak
from the fleet's ``status`` (each rank resets its peak when a job starts and reports it with the job's
``done``) and sets it beside that job's estimate (``residency.job_peaks``: the ranks' own plan, with
this job's activations). Stage 1 runs ``--steps`` steps (the distilled recipe its 8 fixed sigmas) and
stage 2 the first ``--steps`` of its sigmas: a peak is reached in the first step. A case the planner
refuses is still sent to a fleet, whose load refuses it before reading any weight: the table gives
the fleet's words. With ``--tiny`` the same code runs the tiny bundle on CPU ranks (gloo), where
nothing caps a rank (the cap is only the planner's budget, ``MGPU_MEMORY_LIMIT_GIB``) and no peak
is read: a smoke run of the code path.

    python bench/sharded_memory.py --version 2.3 --ranks 2 4 --cap-gib 24 32
    python bench/sharded_memory.py --tiny          # CPU smoke run of the code path (2 blocks, tiny widths)
    python bench/sharded_memory.py --whole-job --ranks 2 --cap-gib 32 --targets 1280x704 \
        --bundle-dir /tmp/b22 --gemma-dir /dev/shm/g22 --out FILE              # one H200
    python bench/sharded_memory.py --whole-job --tiny --ranks 2 --cap-gib 24   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import HostMemoryWatch, log, markdown_table, provenance  # noqa: E402
from mgpu_backend.bundles import full_size  # noqa: E402
from mgpu_backend.ltx import recipes  # noqa: E402
from mgpu_backend.ltx.diagnostics import bench_config, context_widths, random_transformer_inputs  # noqa: E402
from mgpu_backend.ltx.residency import GIB, ResidencyError, plan_residency, sizes_from_headers  # noqa: E402
from mgpu_backend.ltx.schema import PIPELINES, QUANTIZATIONS, defaults_for, stage2_default_sigmas  # noqa: E402

TEXT_TOKENS = 1024


def _sizes(config: dict):
    """The planner's component sizes of the full-size bundle of this transformer configuration (headers only)."""
    bundle = full_size.full_size_config(config["transformer"], gemma_layers=full_size.GEMMA_FULL_LAYERS)
    headers = {name: {key: ("BF16", shape) for key, shape in shapes.items()} for name, shapes in full_size.planned_shapes(bundle).items()}
    gemma = next(tensors for name, tensors in headers.items() if name.startswith(full_size.GEMMA_DIR_NAME))
    return sizes_from_headers(headers[full_size.CHECKPOINT_NAME], headers[full_size.SPATIAL_UPSAMPLER_NAME], gemma)


def _sharded_random_transformer(config: dict, comm, device: torch.device, seed: int):
    from ltx_core.model.transformer import LTXModelConfigurator, X0Model

    from mgpu_backend.bundles.random_weights import fill_random_, weight_rule
    from mgpu_backend.parallel.weight_sharding import apply_weight_sharding

    with torch.device("meta"):
        velocity = LTXModelConfigurator.from_config(config).to(torch.bfloat16)
    model = X0Model(velocity).eval()
    apply_weight_sharding(model, comm, device)
    velocity.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed + comm.rank)
    with torch.no_grad():
        for name, tensor in (*velocity.named_parameters(), *velocity.named_buffers()):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.is_floating_point():
                fill_random_(local, weight_rule(name, tuple(tensor.shape)), generator, fan_in=math.prod(tensor.shape[1:]) or None)
    return model


def _rank(rank: int, world: int, store: str, config: dict, cap_gib: float, sizes: list, results) -> None:
    from mgpu_backend.ltx.latents import StageGeometry
    from mgpu_backend.parallel.comm import Comm
    from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel

    try:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / torch.cuda.get_device_properties(device).total_memory), device)
        # A rank that runs out of memory leaves the others waiting in a collective: they give up after this.
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=120))
        comm = Comm.world()
        model = _sharded_random_transformer(config, comm, device, seed=11)
        apply_sequence_parallel(model, comm)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        rows = []
        for width, height, frames in sizes:
            geometry = StageGeometry(height=height, width=width, num_frames=frames, frame_rate=24.0)
            video, audio = random_transformer_inputs(geometry, geometry, TEXT_TOKENS, context_widths(config["transformer"]), 0.7, device, torch.bfloat16, seed=3, draw_on_cpu=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            status = "ran"
            try:
                with torch.inference_mode():
                    out = model(video=video, audio=audio, perturbations=None)
                    status = "ran" if bool(torch.isfinite(out[0]).all()) else "ran (non-finite)"
            except torch.OutOfMemoryError:
                status = "out of memory"
            except RuntimeError as error:  # a peer ran out: its collective never came
                status = f"stopped ({type(error).__name__}: a peer failed)"
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            rows.append((width, height, frames, int(video.latent.shape[1]), peak, status))
            del video, audio
            if status.startswith(("out of memory", "stopped")):  # out of step with the others' gathers: stop here
                break
        results.put((rank, "ok", {"held": held, "rows": rows}))
    except BaseException:  # noqa: BLE001 - handed to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(config: dict, world: int, cap_gib: float, sizes: list) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(rank, world, os.path.join(tmp, "store"), config, cap_gib, sizes, results)) for rank in range(world)]
        for proc in procs:
            proc.start()
        collected = {}
        for _ in range(world):
            rank, status, value = results.get()
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
        for proc in procs:
            proc.join(120)
    return [collected[rank] for rank in range(world)]


# --- Whole jobs through a fleet ---------------------------------------------------------------------------

WHOLE_JOB_HEADERS = ["recipe", "WxHxF", "ranks", "cap GiB", "weights", "job", "peak GiB per rank", "peak GiB (max)", "estimate GiB",
                     "estimate vs peak", "ended"]  # fmt: skip
PROMPT = "A slow camera push toward a lighthouse on a rocky coast at dusk, waves breaking against the stones."
NEGATIVE_PROMPT = "blurry, low quality"


@dataclass(frozen=True)
class Case:
    recipe: str
    width: int
    height: int
    frames: int
    ranks: int
    cap_gib: float

    def label(self) -> str:
        return f"{self.recipe} {self.width}x{self.height}x{self.frames} {self.ranks} ranks {self.cap_gib:g} GiB"


def stage_activation_bytes(case: Case, dims, version: str, on_gpu: bool) -> tuple[int, int]:
    """Each rank's transformer activations in stage 1 and stage 2 of ``case``, as the fleet plans the
    stages: stage 1 over ``plan_stage1``'s SP degree, the passes of a group in one batched forward
    where the rank would batch them; stage 2 over ``plan_stage2``'s SP degree or, under TDP, one tile
    of ``case.ranks`` per rank (its overlap not counted)."""
    from mgpu_backend.ltx.latents import StageGeometry
    from mgpu_backend.ltx.validation import estimate_memory_bytes
    from mgpu_backend.parallel.batched_passes import BATCH_PASSES_BELOW_TOKENS
    from mgpu_backend.parallel.guidance_parallel import plan_stage1, plan_stage2

    from mgpu_backend.ltx.jobs import active_passes

    defaults = defaults_for(version, case.recipe)
    passes = len(active_passes(defaults.video_guidance, defaults.audio_guidance))  # the recipe's defaults, as the job plans them
    heads = {"attention_heads": dims.video_heads, "audio_attention_heads": dims.audio_heads}
    stage1 = StageGeometry(height=case.height // 2, width=case.width // 2, num_frames=case.frames, frame_rate=defaults.frame_rate)
    plan1 = plan_stage1(case.ranks, stage1.video_tokens, passes, "auto", **heads)
    batched = on_gpu and math.ceil(plan1.video_tokens / plan1.sp_degree) < BATCH_PASSES_BELOW_TOKENS
    in_one_forward = math.ceil(passes / plan1.guidance_groups) if batched else 1
    one = estimate_memory_bytes(stage1.height, stage1.width, case.frames, defaults.frame_rate, dims, sp_degree=plan1.sp_degree)
    stage2 = StageGeometry(height=case.height, width=case.width, num_frames=case.frames, frame_rate=defaults.frame_rate)
    plan2 = plan_stage2(case.ranks, stage2.video_tokens, case.recipe, **heads)
    share = plan2.sp_degree if plan2.technique == "sp" else case.ranks
    two = estimate_memory_bytes(case.height, case.width, case.frames, defaults.frame_rate, dims, sp_degree=share)
    return one.activation_bytes * in_one_forward, two.activation_bytes


def _set_fleet_environment(ranks: int, cap_gib: float, on_gpu: bool) -> None:
    """What the next fleet's ranks inherit: N ranks sharing GPU 0 each capped at ``cap_gib`` (a memory
    fraction the rank applies at start), or on CPU ranks the planner's budget only."""
    from mgpu_backend.fleet.rank import MEMORY_FRACTION_ENV
    from mgpu_backend.fleet.shared_gpu import SHARED_GPU_RANKS_ENV
    from mgpu_backend.ltx.residency import MEMORY_LIMIT_ENV

    if on_gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        if cap_gib * GIB > total:
            raise SystemExit(f"error: --cap-gib {cap_gib:g} is more than the GPU's {total / GIB:.1f} GiB; choose a smaller cap")
        os.environ[SHARED_GPU_RANKS_ENV] = str(ranks)
        os.environ[MEMORY_FRACTION_ENV] = repr(cap_gib * GIB / total)
    else:
        os.environ[MEMORY_LIMIT_ENV] = f"{cap_gib:g}"


def _rank_peaks() -> list[int | None]:
    """Each rank's peak device bytes in the job that just ended (the fleet's status; None on CPU ranks)."""
    from mgpu_backend.ltx import api

    ranks = sorted(api.status()["ranks"], key=lambda rank: rank["rank"])
    return [(rank.get("memory") or {}).get("peak") for rank in ranks]


def run_fleet(cases: list[Case], spec: dict, version: str, steps: int) -> list[tuple[dict[str, list[int | None]], str]]:
    """The whole jobs of ``cases`` (one recipe, rank count and cap; their sizes) on one running fleet:
    the load and the encode once (neither depends on the size), then stage 1, upscale and decode per
    size. For each case its jobs' per-rank peaks (the shared load and encode included) and how it
    ended ("finished", the fleet's refusal, or the failing job and its first line). A size that fails
    does not stop the next one: the fleet stays usable after a failed job.

    Stage 1 of the two-stage recipe runs ``steps`` steps. The distilled recipe's stage 1 runs fixed
    sigmas, so it is cancelled after about ``steps`` steps (the cancel is sent when step ``steps - 1``
    is reported; every rank stops at the same cancel point, at the end of step ``steps`` when the step
    outlasts the message, as full-size steps do; on tiny CPU runs one step earlier or later), and stage 2 starts from a random latent of the stage-1 shape instead: memory does not depend on the
    values. Stage 2 runs the first ``steps`` of the recipe's sigmas, then 0."""
    from mgpu_backend.fleet.client import FleetCancelled, FleetError
    from mgpu_backend.ltx import api
    from mgpu_backend.ltx.latents import StageGeometry

    recipe_name = cases[0].recipe
    declared = recipes.recipe(recipe_name)
    negative, fixed_steps = declared.encodes_negative_prompt, declared.fixed_steps is not None
    defaults = defaults_for(version, recipe_name)
    sigmas = stage2_default_sigmas(recipe_name)
    sigmas = tuple(sigmas[: min(steps, len(sigmas) - 1)]) + (0.0,)
    recipe = {"model_version": version, "pipeline": recipe_name}
    shared: dict[str, list[int | None]] = {}
    state: dict = {}

    def run_jobs(label: str, jobs: dict, peaks: dict) -> str | None:
        """Runs ``jobs`` in order, recording each one's peaks; how the first failing one failed, or None."""
        for phase, job in jobs.items():
            log(f"{label}: {phase} ...")
            try:
                job()
            except FleetError as error:
                if error.kind == "input_error" and phase == "load":
                    return f"refused at load: {error}"
                peaks[phase] = _rank_peaks()
                return f"{phase} failed{error.where}: {str(error).splitlines()[0]}"
            peaks[phase] = _rank_peaks()
            measured = [f"{peak / GIB:.2f}" for peak in peaks[phase] if peak is not None]
            log(f"{label}: {phase} done, peak GiB per rank: {' / '.join(measured) or 'n/a (CPU)'}")  # seen even if the call is cut short
        return None

    failed = run_jobs(
        f"{recipe_name} {cases[0].ranks} ranks {cases[0].cap_gib:g} GiB",
        {"load": lambda: api.load(spec),
         "encode": lambda: state.update(prompts=api.encode(spec, [PROMPT, NEGATIVE_PROMPT] if negative else [PROMPT]))},
        shared,
    )  # fmt: skip
    if failed:
        return [(dict(shared), failed)] * len(cases)
    results = []
    for case in cases:
        stage1 = StageGeometry(height=case.height // 2, width=case.width // 2, num_frames=case.frames, frame_rate=defaults.frame_rate)
        progress = {"stage 1 steps": 0, "cut": ""}

        def count_steps(event: dict) -> None:
            if event.get("stage") == "stage1":
                progress["stage 1 steps"] = max(progress["stage 1 steps"], int(event.get("step", 0)))

        def sample() -> None:
            try:
                state["stage1"] = api.sample(
                    spec, state["prompts"][0], state["prompts"][1] if negative else None, width=stage1.width, height=stage1.height,
                    num_frames=case.frames, steps=None if fixed_steps else steps, progress=count_steps,
                    should_cancel=None if not fixed_steps else lambda: progress["stage 1 steps"] >= steps - 1, **recipe,
                )  # fmt: skip
            except FleetCancelled:
                progress["cut"] = f" (stage 1 stopped after {progress['stage 1 steps']} of its {defaults.steps} steps)"
                generator = torch.Generator().manual_seed(0)
                shapes = (stage1.video_shape.to_torch_shape(), stage1.audio_shape.to_torch_shape())
                state["stage1"] = tuple(torch.randn(tuple(shape), generator=generator) for shape in shapes)

        peaks = dict(shared)
        failed = run_jobs(
            case.label(),
            {"stage 1": sample,
             "upscale": lambda: state.update(stage2=api.upscale(spec, *state["stage1"], state["prompts"][0], sigmas=sigmas, **recipe)),
             "decode": lambda: api.decode(spec, *state["stage2"])},
            peaks,
        )  # fmt: skip
        results.append((peaks, failed or "finished" + progress["cut"]))
    return results


def _case_rows(case: Case, peaks: dict, ending: str, plan, planner: str, sizes, dims, args, on_gpu: bool) -> list[list[str]]:
    """The table's rows of one case: each job's per-rank peaks beside its estimate, then the whole job."""
    from mgpu_backend.ltx.residency import JOB_PHASES, job_peaks, video_decode_activation_bytes

    rows, estimates = [], {}
    if plan is not None:
        stage1, stage2 = stage_activation_bytes(case, dims, args.version, on_gpu)
        video = video_decode_activation_bytes(case.width, case.height, case.frames, case.ranks)
        estimates = job_peaks(sizes, plan, stage1, stage2, video)
    size = f"{case.width}x{case.height}x{case.frames}"
    weights = args.quantization or "bf16"
    for phase in JOB_PHASES:
        if phase not in peaks and phase not in estimates:
            continue
        measured = [peak for peak in peaks.get(phase, []) if peak is not None]
        estimate = estimates.get(phase)
        per_rank = " / ".join(f"{peak / GIB:.2f}" for peak in measured) if measured else ("n/a (CPU)" if not on_gpu and phase in peaks else "-")
        error = f"{(estimate - max(measured)) / max(measured) * 100:+.1f}%" if measured and estimate else "-"
        rows.append([case.recipe, size, str(case.ranks), f"{case.cap_gib:g}", weights, phase, per_rank,
                     f"{max(measured) / GIB:.2f}" if measured else "-", f"{estimate / GIB:.2f}" if estimate else "-", error, ""])  # fmt: skip
    measured_all = [peak for values in peaks.values() for peak in values if peak is not None]
    whole_error = (
        f"{(plan.peak_bytes - max(measured_all)) / max(measured_all) * 100:+.1f}%" if plan is not None and measured_all and ending.startswith("finished") else "-"
    )  # fmt: skip
    rows.append([case.recipe, size, str(case.ranks), f"{case.cap_gib:g}", weights, "**whole job**", "",
                 f"{max(measured_all) / GIB:.2f}" if measured_all else "-", f"{plan.peak_bytes / GIB:.2f} (plan)" if plan else "-", whole_error,
                 ending if ending.startswith("finished") or planner.removeprefix("refused: ") in ending else f"{ending}; this process's planner: {planner}"])  # fmt: skip
    return rows


def whole_job_bench(args) -> tuple[str, torch.device]:
    """Every (recipe, size, ranks, cap) case through its own fleet: the table of per-rank peaks per job
    against the estimates, and the planner's decision or refusal."""
    from mgpu_backend.ltx import api
    from mgpu_backend.ltx.residency import component_sizes
    from mgpu_backend.ltx.validation import TransformerDims

    on_gpu = torch.cuda.is_available() and not args.tiny
    if not on_gpu and not args.tiny:
        raise SystemExit("error: the full-size whole job needs a GPU (torch sees none); use --tiny on a CPU")
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    if args.tiny:
        config = full_size.tiny_config(args.version)
        targets, frames = [(192, 128), (256, 128)], 9  # two sizes: one fleet serves both
    else:
        config = full_size.full_size_config(bench_config(args.version)["transformer"], args.gemma_layers)
        targets, frames = [tuple(int(v) for v in target.split("x")) for target in args.targets], args.frames
    for width, height in targets:
        if width % 64 or height % 64:
            raise SystemExit(f"error: the two-stage sizes are multiples of 64, got {width}x{height}; the 1280x720 template runs at 1280x704")
    cases = [Case(recipe, w, h, frames, ranks, cap) for recipe in args.recipes for w, h in targets for ranks in args.ranks for cap in args.cap_gib]
    rows = []
    with contextlib.ExitStack() as stack:
        bundle = write_random_bundle(stack, config, device, args)
        sizes_by_recipe, specs = {}, {}
        for recipe in args.recipes:
            spec = replace(bundle.spec(), quantization=args.quantization, residency="sharded")
            # The files the recipe refuses (the distilled one's LoRA) leave the spec; the bundle's checkpoint
            # stands in for the distilled one: the same shapes.
            spec = replace(spec, **{file.spec_field: None for file, _ in recipes.recipe(recipe).refused})
            specs[recipe], sizes_by_recipe[recipe] = spec, component_sizes(spec)
        dims = TransformerDims.from_checkpoint(bundle.checkpoint_path)
        socket_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-sharded-memory-"))
        fleets: dict[tuple, list[Case]] = {}  # one fleet per recipe, rank count and cap: its sizes share the load
        for case in cases:
            fleets.setdefault((case.recipe, case.ranks, case.cap_gib), []).append(case)
        for number, ((recipe, ranks, cap_gib), fleet_cases) in enumerate(fleets.items()):
            _set_fleet_environment(ranks, cap_gib, on_gpu)
            spec, sizes = specs[recipe], sizes_by_recipe[recipe]
            lora_swap = spec.distilled_lora is not None
            try:
                plan = plan_residency(sizes, int(cap_gib * GIB), ranks, "sharded", args.quantization, lora_swap)
            except ResidencyError as refused:
                plan, planner = None, f"refused: {refused}"
            else:
                planner = f"peak {plan.peak_bytes / GIB:.1f} GiB"
            api.configure(os.path.join(socket_dir, f"fleet-{number}.sock"), gpus="0" if on_gpu else None, cpu_ranks=None if on_gpu else ranks)
            try:  # the load starts the fleet: a fleet that cannot start ends its cases as a failed load
                with HostMemoryWatch() as host_memory:
                    results = run_fleet(fleet_cases, spec.to_json(), args.version, args.steps)
                if on_gpu:
                    results = [(peaks, f"{ending}; {host_memory.describe()}") for peaks, ending in results]
            finally:
                api.restart()
                if args.fleet_log and os.path.exists(os.path.join(socket_dir, "server.log")):
                    shutil.copyfile(os.path.join(socket_dir, "server.log"), f"{args.fleet_log}.{number}")
            first_row = len(rows)
            for case, (peaks, ending) in zip(fleet_cases, results):
                log(f"{case.label()}: {ending}")
                rows.extend(_case_rows(case, peaks, ending, plan, planner, sizes, dims, args, on_gpu))
            if args.partial_out:  # a call that runs out of time still leaves the fleets it finished
                with open(args.partial_out, "a") as partial:
                    partial.write(markdown_table(WHOLE_JOB_HEADERS, rows[first_row:]) + "\n\n")
    allocator = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    caption = (
        f"Whole jobs on LTX-{args.version} ({'tiny bundle, CPU ranks: no cap, no peaks' if not on_gpu else 'full-size random weights, ranks sharing GPU 0'}), "
        f"residency sharded, {args.steps} step{'s' if args.steps != 1 else ''} per stage (a job peaks in its first step; the distilled stage 1, whose 8 sigmas are fixed, is "
        "cancelled after them and stage 2 starts from a random latent of its shape). "
        + (f"Allocator: PYTORCH_CUDA_ALLOC_CONF={allocator}. " if allocator else "")
        + "Estimates: `residency.job_peaks` per job (this job's activations), the plan's own peak (`plan_residency`, 6 GiB headroom) for the whole job. "
        "upscale = the upsampler, then stage 2 (one fleet job, one peak). One fleet serves the sizes of a recipe, rank count and cap: "
        "their load and encode run once and their rows repeat under each size."
    )
    return caption + "\n\n" + markdown_table(WHOLE_JOB_HEADERS, rows), device


def write_random_bundle(stack: contextlib.ExitStack, config, device: torch.device, args):
    """The random bundle at ``config`` in --bundle-dir (reused when complete) or a temporary folder,
    its Gemma in --gemma-dir when given."""
    bundle_dir = Path(args.bundle_dir) if args.bundle_dir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-sharded-bundle-")))
    bundle_dir.mkdir(parents=True, exist_ok=True)
    gemma_dir = None
    if args.gemma_dir:
        gemma_dir = Path(args.gemma_dir) if args.bundle_dir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-sharded-gemma-", dir=args.gemma_dir)))
        gemma_dir.mkdir(parents=True, exist_ok=True)
    planned = sum(full_size.planned_bytes(config).values())
    log(f"random bundle: {planned / 1e9:.1f} GB of weights in {bundle_dir}" + (f", Gemma in {gemma_dir}" if gemma_dir else "") + f", drawn on {device} ...")
    bundle = full_size.write_bundle(bundle_dir, config, device, 0, log=log, gemma_dir=gemma_dir)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return bundle


def forward_bench(args) -> tuple[str, torch.device]:
    """One forward per stage size on ranks of this benchmark (the default mode)."""
    from mgpu_backend.ltx.validation import TransformerDims, estimate_memory_bytes

    config = bench_config(args.version, tiny=args.tiny)
    sizes = _sizes(bench_config(args.version))
    targets = [tuple(int(v) for v in target.split("x")) for target in (["192x128"] if args.tiny else args.targets)]
    frames = 9 if args.tiny else args.frames
    # Smallest first: a rank that runs out of memory ends the run.
    shapes = [] if args.full_size_only else [(w // 2, h // 2, frames) for w, h in targets]
    shapes = sorted(shapes + [(w, h, frames) for w, h in targets], key=lambda shape: shape[0] * shape[1])
    dims = TransformerDims.from_config(config["transformer"], 0)
    rows = []
    for world in args.ranks:
        for cap in args.cap_gib:
            log(f"{world} ranks capped at {cap} GiB")
            per_rank = measure(config, world, cap, shapes)
            for index, (width, height, frames_, tokens, _, _) in enumerate(max((rank["rows"] for rank in per_rank), key=len)):
                peaks = [rank["rows"][index][4] for rank in per_rank if index < len(rank["rows"])]
                statuses = {rank["rows"][index][5] for rank in per_rank if index < len(rank["rows"])}
                activations = estimate_memory_bytes(height, width, frames_, dims=dims, sp_degree=world, text_tokens=TEXT_TOKENS).activation_bytes
                estimate = sizes.sharded_transformer(None, world) + activations
                peak = max(peaks)
                try:
                    plan = plan_residency(sizes, int(cap * GIB), world, "auto")
                    decision = f"{plan.policy}, sharded over {plan.sharded_over}, peak {plan.peak_bytes / GIB:.1f} GiB"
                except ResidencyError as refused:
                    decision = "refused: " + str(refused).split("; ", 1)[-1]
                rows.append([str(world), f"{cap:g}", f"{width}x{height}x{frames_}", str(tokens), ", ".join(sorted(statuses)),
                             f"{peak / GIB:.2f}", f"{estimate / GIB:.2f}", f"{(estimate - peak) / max(peak, 1) * 100:+.0f}%", decision])  # fmt: skip
    table = markdown_table(["ranks", "cap GiB", "forward WxHxF", "video tokens", "status", "peak GiB (max rank)", "estimate GiB", "estimate vs peak", "planner for the whole job (bf16)"], rows)
    return table, torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="2.3", choices=["2.0", "2.3"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cap-gib", type=float, nargs="+", default=[24.0, 32.0])
    parser.add_argument("--targets", nargs="+", default=["1536x1024", "1280x704"],
                        help="the recipes' output sizes WxH, multiples of 64 (stage 1 runs half of each; the 1280x720 template runs at 1280x704)")  # fmt: skip
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--full-size-only", action="store_true", help="only the stage-2 forwards (they set the peak: stage 1 runs half the size)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: 2 blocks at tiny widths, tiny sizes")
    whole = parser.add_argument_group("whole jobs through a fleet (--whole-job)")
    whole.add_argument("--whole-job", action="store_true", help="run whole jobs through a fleet of ranks sharing GPU 0 instead of single forwards")
    whole.add_argument("--recipes", nargs="+", choices=PIPELINES, default=list(PIPELINES), help="the recipes to run (default both)")
    whole.add_argument("--quantization", choices=QUANTIZATIONS, help="fp8-cast: the transformer's weights in float8 (default bf16)")
    whole.add_argument("--steps", type=int, default=2, help="stage-1 steps of the two-stage recipe and stage-2 steps of both (default 2)")
    whole.add_argument("--gemma-layers", type=int, default=full_size.GEMMA_FULL_LAYERS, help="layers of the bundle's Gemma-3 12B (default 48, the released size)")
    whole.add_argument("--bundle-dir", help="where to write the random bundle, reused if complete (default: a temporary folder, removed)")
    whole.add_argument("--gemma-dir", help="a folder on another disk (e.g. /dev/shm) for the bundle's Gemma")
    whole.add_argument("--partial-out", help="append each case's rows to this file as soon as the case ends (the table's columns)")
    whole.add_argument("--fleet-log", help="copy each fleet's log (plans, parks, Gemma placement) to FILE.<case>")
    parser.add_argument("--out", help="also append the table to this file")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if not all(cap > 0 for cap in args.cap_gib) or not all(ranks >= 2 for ranks in args.ranks):
        parser.error(f"--cap-gib takes positive GiB and --ranks 2 or more ranks (weights sharded over them), got {args.cap_gib} and {args.ranks}")
    table, device = whole_job_bench(args) if args.whole_job else forward_bench(args)
    print(table)
    if args.out:
        with open(args.out, "a") as out:
            out.write(provenance(device) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
