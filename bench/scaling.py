"""Stage-1 scaling over GPUs: step time and faithfulness of each plan against one GPU, in one run.

For every world size (1 and the others asked for) it starts a fleet on that many GPUs and runs the
fleet's own stage-1 code (``bench_stage1``: planner, SP over the IPC kernel or NCCL, guidance
groups) on the same random transformer (built on every GPU from one seed). It prints, per token
count and plan, the median step time, the speed-up over world 1, and the max abs difference of the
final latents against world 1 (SP is faithful: bf16 noise only).

``--pipeline`` picks the recipe's stage 1: two-stage (default) runs all four guidance passes per step
over LTX2Scheduler's sigmas; distilled runs its fixed sigmas (8 steps) with one unguided pass per step,
so the plans that split the world into guidance groups do not apply: they are skipped, saying why
(the planner's own reason), and the SP plans run.

    python bench/scaling.py --worlds 1,2 --plans sp,guidance,auto        # on a machine with 2 GPUs
    python bench/scaling.py --worlds 1,2 --plans sp,guidance --model 2.3 # the LTX-2.3 22B transformer
    python bench/scaling.py --tiny --worlds 1,2 --plans sp,guidance      # CPU smoke run (gloo)
    python bench/scaling.py --worlds 1,2 --plans sp --batch-passes off   # SP forwards replayed from CUDA graphs
    python bench/scaling.py --worlds 1,2 --plans sp,auto --pipeline distilled             # distilled stage 1
    python bench/scaling.py --worlds 1,2 --plans sp,auto --pipeline distilled --model 2.3 # distilled LTX-2.3
    python bench/scaling.py --tiny --worlds 1,2 --pipeline distilled --model 2.3          # CPU smoke run of it
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mgpu_backend.fleet.client import FleetClient  # noqa: E402
from mgpu_backend.ltx.diagnostics import BENCH_STEPS, MODEL_CONFIGS, bench_config  # noqa: E402
from mgpu_backend.ltx.jobs import active_passes  # noqa: E402
from mgpu_backend.ltx.recipes import DEFAULT_RECIPE, RECIPES  # noqa: E402
from mgpu_backend.ltx.schema import PIPELINES, Guidance, PipelineDefaults, defaults_for  # noqa: E402
from mgpu_backend.ltx.stages import guider_params  # noqa: E402
from mgpu_backend.parallel.guidance_parallel import GUIDANCE_GROUP_MODES, ONE_PASS_NO_GROUPS, PLAN_MODES  # noqa: E402

GUIDANCE = {
    "video_guidance": {"cfg_scale": 3.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0},
    "audio_guidance": {"cfg_scale": 7.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(MODEL_CONFIGS), default="2.0", help="model version whose full-size transformer runs: 2.0 (19B) or 2.3 (22B); default 2.0")
    parser.add_argument("--config", help="transformer configuration file (default: the --model one in configs/)")
    parser.add_argument("--worlds", default="1,2", help="world sizes; 1 is always run as the reference")
    parser.add_argument("--plans", default="sp,guidance,auto", help="stage-1 plans to time at worlds above 1")
    parser.add_argument("--sizes", default="768x512x121,1536x1024x121", help="WxHxF stage-1 sizes (6144 and 24576 video tokens)")
    stage1 = " or ".join(f"{declared.name} ({declared.stage1_words})" for declared in RECIPES.values())
    parser.add_argument("--pipeline", choices=PIPELINES, default=DEFAULT_RECIPE, help=f"the recipe's stage 1: {stage1} (default {DEFAULT_RECIPE})")
    parser.add_argument("--steps", type=int, help=f"steps per run; the first is warm-up (default {BENCH_STEPS}; the distilled pipeline always runs its fixed sigmas' steps)")
    parser.add_argument("--tiny", action="store_true", help="2-layer model on CPU ranks (smoke run)")
    parser.add_argument("--batch-passes", choices=("auto", "on", "off"), default="auto", help="a guidance group's passes as one batched forward (auto: below 4096 tokens per rank on GPUs); off shows CUDA-graph replay under SP")
    parser.add_argument("--compile-blocks", action="store_true", help="torch.compile the transformer blocks on the ranks (GPU; the first step of each run then includes the compile)")
    parser.add_argument("--out", help="append the table, with command, machine and date, to this file")
    args = parser.parse_args()

    config = bench_config(args.model, args.config, args.tiny)
    if args.tiny:
        args.sizes = "96x64x9,192x128x17"
    worlds = sorted({1, *(int(w) for w in args.worlds.split(","))})
    recipe = defaults_for(args.model, args.pipeline)
    steps, guidance = recipe_job_fields(recipe, args.steps)
    requested = args.plans.split(",")
    unknown = [plan for plan in requested if plan not in PLAN_MODES]
    if unknown:
        raise SystemExit(f"--plans {args.plans}: unknown plan {', '.join(unknown)}; choose from {', '.join(PLAN_MODES)}")
    plans, skipped = applicable_plans(requested, recipe, guidance)
    for plan, why in skipped.items():
        print(f"plan {plan} skipped for the {args.pipeline} pipeline: {why}", file=sys.stderr)
    if not plans and max(worlds) > 1:
        raise SystemExit(f"none of --plans {args.plans} applies to the {args.pipeline} pipeline; ask for sp or auto")
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    if not args.tiny and torch.cuda.device_count() < max(worlds):
        raise SystemExit(f"world {max(worlds)} needs {max(worlds)} GPUs; this machine has {torch.cuda.device_count()}")

    results: dict[tuple, dict] = {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o700)
            devices = {"cpu_ranks": world} if args.tiny else {"gpus": ",".join(map(str, range(world)))}
            client = FleetClient.connect(str(Path(tmp) / "fleet.sock"), idle_timeout=600, **devices)
            try:
                for size in sizes:
                    for plan in (["sp"] if world == 1 else plans):
                        width, height, frames = size
                        job = {"config": config, "pipeline": args.pipeline, "seed": 10, "width": width, "height": height,
                               "num_frames": frames, "steps": steps, "parallel": plan, "compile_blocks": args.compile_blocks,
                               "batch_passes": {"auto": "auto", "on": True, "off": False}[args.batch_passes], **guidance}  # fmt: skip
                        print(f"world {world} {size} {plan} ...", file=sys.stderr, flush=True)
                        started = time.perf_counter()
                        result = client.run("bench_stage1", job)
                        results[(world, size, plan)] = {
                            "fields": result.fields, "video": result.tensors["video_latent"], "audio": result.tensors["audio_latent"],
                            "wall": time.perf_counter() - started,
                        }  # fmt: skip
            finally:
                client.shutdown()
        time.sleep(2)

    lines = [
        "| stage-1 size | video tokens | GPUs | plan (groups x SP) | forward | s/step | speed-up vs 1 GPU | max abs diff video / audio vs 1 GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        reference = results[(1, size, "sp")]
        reference_step = statistics.median(reference["fields"]["step_seconds"][1:])
        for (world, result_size, plan), result in results.items():
            if result_size != size:
                continue
            fields = result["fields"]
            step = statistics.median(fields["step_seconds"][1:])
            video_diff = (result["video"] - reference["video"]).abs().max().item()
            audio_diff = (result["audio"] - reference["audio"]).abs().max().item()
            layout = f"{plan} ({fields['guidance_groups']} x {fields['sp_degree']})"
            lines.append(
                f"| {'x'.join(map(str, size))} | {fields['video_tokens']} | {world} | {layout} | {forward_path(fields)} | {step:.3f} | "
                f"{reference_step / step:.2f}x | {video_diff:.3g} / {audio_diff:.3g} |"
            )
    ran = results[(1, sizes[0], "sp")]["fields"]  # what the ranks ran, not what was asked
    passes = ran["passes"]
    lines.insert(0, f"LTX-{args.model} {args.pipeline} stage 1: {len(ran['step_seconds'])} steps, {passes} pass{'es' if passes > 1 else ''} per step\n")
    lines.extend(f"\nplan {plan} skipped: {why}" for plan, why in skipped.items())
    table = "\n".join(lines)
    print(table)
    if args.out:
        machine = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() and not args.tiny else "CPU (gloo)"
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(args.out, "a") as file:
            file.write(f"\n`python {' '.join(sys.argv)}` on {machine}, torch {torch.__version__}, {stamp}\n\n{table}\n")


def recipe_job_fields(recipe: PipelineDefaults, steps: int | None) -> tuple[int, dict]:
    """The step count and guidance the bench job gets for a recipe. Two-stage: ``steps`` (default
    ``BENCH_STEPS``: a step is timed, the official count would only repeat it) with the four guidance
    passes; distilled: its fixed sigmas' step count and no guidance (the job's defaults)."""
    if recipe.stage1_sigmas is None:
        return steps or BENCH_STEPS, GUIDANCE
    fixed = len(recipe.stage1_sigmas) - 1
    if steps not in (None, fixed):
        raise SystemExit(f"--steps {steps}: the {recipe.pipeline} pipeline runs its {fixed} fixed sigmas {list(recipe.stage1_sigmas)}; leave --steps out")
    return fixed, {}


def planned_guiders(recipe: PipelineDefaults, guidance: dict):
    """ltx-core's video and audio guider parameters of the bench job: ``guidance`` over the recipe's."""
    return [
        guider_params(Guidance.from_wire(guidance.get(f"{m}_guidance"), f"{m}_guidance", getattr(recipe, f"{m}_guidance")), getattr(recipe, f"{m}_guidance"))
        for m in ("video", "audio")
    ]  # fmt: skip


def applicable_plans(plans: list[str], recipe: PipelineDefaults, guidance: dict) -> tuple[list[str], dict[str, str]]:
    """The ``plans`` that apply to the recipe's stage 1 under ``guidance``, and why each other one is
    skipped: a step of one pass (the distilled recipe) leaves nothing to split over guidance groups."""
    if len(active_passes(*planned_guiders(recipe, guidance))) > 1:
        return plans, {}
    skipped = {plan: ONE_PASS_NO_GROUPS for plan in plans if plan in GUIDANCE_GROUP_MODES}
    return [plan for plan in plans if plan not in skipped], skipped


def forward_path(fields: dict) -> str:
    """How the ranks ran the transformer: batched passes, CUDA-graph replay (and why not), compiled."""
    path = "batched" if fields.get("batch_passes") else "sequential"
    graphs = fields.get("cuda_graphs") or {}
    if graphs.get("captures"):
        path += f", graphs ({graphs['captures']} captured, {graphs['replays']} replays)"
    elif graphs.get("eager_reasons"):
        path += f", eager ({'; '.join(graphs['eager_reasons'])})"
    if fields.get("compile_blocks"):
        path += ", compiled blocks"
    return path


if __name__ == "__main__":
    main()
