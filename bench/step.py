"""Stage-1 step latency: the fleet at world 1 against a plain ltx-core loop, side by side in one run.

Both run the same stage-1 computation (Euler steps over LTX2Scheduler sigmas, full multimodal
guidance: conditional, unconditional, STG-perturbed and modality-isolated passes per step) on the
same random transformer (built on the GPU from a seed, so both hold identical weights):

- plain: ltx-pipelines 1.0.0's own loop (denoise_audio_video + euler_denoising_loop +
  multi_modal_guider_factory_denoising_func) calling ltx-core's X0Model in this process;
- fleet: the ``bench_stage1`` job, i.e. the fleet's stage-1 code path (plan, SP wrapper,
  guidance-pass runner, per-step progress event and cancel all-reduce) in a rank process.

It prints a table of median step times and the fleet's overhead (target <= 2%), and the max abs
difference between the two runs' latents (SP degree 1 must equal plain ltx-core within bf16 noise).

    python bench/step.py --device cuda                 # the LTX-2.0 19B transformer
    python bench/step.py --device cuda --model 2.3     # the LTX-2.3 22B transformer
    python bench/step.py --tiny [--model 2.3]          # CPU smoke run on a 2-layer model of that layout
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mgpu_backend.fleet.client import FleetClient  # noqa: E402
from mgpu_backend.ltx.diagnostics import MODEL_CONFIGS, bench_config, random_contexts, random_transformer, transformer_version  # noqa: E402
from mgpu_backend.ltx.latents import StageGeometry  # noqa: E402
from mgpu_backend.ltx.schema import defaults_for  # noqa: E402

GUIDANCE = {
    "video": {"cfg_scale": 3.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0, "skip_step": 0},
    "audio": {"cfg_scale": 7.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0, "skip_step": 0},
}


def plain_ltx_core(config: dict, size: tuple[int, int, int], steps: int, device: torch.device, seed: int, stg_block: int):
    """ltx-pipelines' own stage-1 loop; returns (per-step seconds, video latent, audio latent)."""
    from ltx_core.components.diffusion_steps import EulerDiffusionStep
    from ltx_core.components.guiders import MultiModalGuiderParams, create_multimodal_guider_factory
    from ltx_core.components.noisers import GaussianNoiser
    from ltx_core.components.schedulers import LTX2Scheduler
    from ltx_pipelines.utils.helpers import denoise_audio_video, multi_modal_guider_factory_denoising_func
    from ltx_pipelines.utils.samplers import euler_denoising_loop
    from ltx_pipelines.utils.types import PipelineComponents

    width, height, frames = size
    dtype = torch.bfloat16
    model = random_transformer(config, device, dtype, seed)
    positive, negative = random_contexts(config["transformer"], device, dtype, seed)
    guiders = {m: MultiModalGuiderParams(**GUIDANCE[m], stg_blocks=[stg_block]) for m in GUIDANCE}
    geometry = StageGeometry(height, width, frames, 24.0)
    marks = []

    def loop(sigmas, video_state, audio_state, stepper):
        denoise = multi_modal_guider_factory_denoising_func(
            video_guider_factory=create_multimodal_guider_factory(params=guiders["video"], negative_context=negative.video_context),
            audio_guider_factory=create_multimodal_guider_factory(params=guiders["audio"], negative_context=negative.audio_context),
            v_context=positive.video_context, a_context=positive.audio_context, transformer=model,
        )  # fmt: skip

        def timed(*args, **kwargs):
            result = denoise(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            marks.append(time.perf_counter())
            return result

        return euler_denoising_loop(sigmas=sigmas, video_state=video_state, audio_state=audio_state, stepper=stepper, denoise_fn=timed)

    started = time.perf_counter()
    with torch.inference_mode():
        video_state, audio_state = denoise_audio_video(
            output_shape=geometry.pixel_shape, conditionings=[], noiser=GaussianNoiser(generator=torch.Generator(device=device).manual_seed(seed)),
            sigmas=LTX2Scheduler().execute(steps=steps).to(dtype=torch.float32, device=device), stepper=EulerDiffusionStep(),
            denoising_loop_fn=loop, components=PipelineComponents(dtype=dtype, device=device), dtype=dtype, device=device,
        )  # fmt: skip
        video, audio = video_state.latent.float().cpu(), audio_state.latent.float().cpu()  # already unpatchified
    boundaries = [started, *marks]
    model = None  # the fleet run that follows needs the GPU memory; the closure above is done with it
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [b - a for a, b in zip(boundaries, boundaries[1:])], video, audio


def fleet_stage1(client: FleetClient, config: dict, size, steps: int, seed: int, stg_block: int):
    width, height, frames = size
    guidance = {f"{m}_guidance": {**GUIDANCE[m], "stg_blocks": [stg_block]} for m in GUIDANCE}
    args = {"config": config, "seed": seed, "width": width, "height": height, "num_frames": frames, "steps": steps, "parallel": "sp", **guidance}
    result = client.run("bench_stage1", args)
    return result.fields, result.tensors["video_latent"], result.tensors["audio_latent"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", choices=tuple(MODEL_CONFIGS), default="2.0", help="model version whose full-size transformer runs: 2.0 (19B) or 2.3 (22B); default 2.0")
    parser.add_argument("--config", help="transformer configuration file (default: the --model one in configs/)")
    parser.add_argument("--sizes", default="768x512x121,1536x1024x121", help="WxHxF stage-1 sizes")
    parser.add_argument("--steps", default="6,3", help="steps per size (the first step is warm-up)")
    parser.add_argument("--tiny", action="store_true", help="2-layer model on the CPU, small sizes (smoke run)")
    parser.add_argument("--out", help="append the table, with command, machine and date, to this file")
    args = parser.parse_args()
    config = bench_config(args.model, args.config, args.tiny)
    if args.tiny:
        args.device, args.sizes, args.steps = "cpu", "96x64x9,192x128x17", "4,3"
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    steps_per_size = [int(v) for v in args.steps.split(",")]
    device = torch.device(args.device)
    # The version's official STG block (29 for 2.0, 28 for 2.3), or the last block of a smaller model.
    official_block = defaults_for(transformer_version(config["transformer"])).video_guidance.stg_blocks[0]
    stg_block = min(official_block, config["transformer"]["num_layers"] - 1)
    seed = 10

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o700)
        socket = str(Path(tmp) / "bench.sock")
        gpus = "0" if device.type == "cuda" else None
        fleet_rows = {}
        client = FleetClient.connect(socket, gpus=gpus, cpu_ranks=None if gpus else 1, idle_timeout=600)
        try:
            for size, steps in zip(sizes, steps_per_size):
                print(f"fleet {size} ...", file=sys.stderr, flush=True)
                fleet_rows[size] = fleet_stage1(client, config, size, steps, seed, stg_block)
            client.run("unload", {})
        finally:
            client.shutdown()
        time.sleep(2)  # the rank gives its GPU memory back
        for size, steps in zip(sizes, steps_per_size):
            print(f"plain {size} ...", file=sys.stderr, flush=True)
            plain_seconds, plain_video, plain_audio = plain_ltx_core(config, size, steps, device, seed, stg_block)
            fields, fleet_video, fleet_audio = fleet_rows[size]
            fleet_median = statistics.median(fields["step_seconds"][1:] or fields["step_seconds"])
            plain_median = statistics.median(plain_seconds[1:] or plain_seconds)
            rows.append({
                "size": "x".join(map(str, size)), "tokens": f"{fields['video_tokens']} + {fields['audio_tokens']}", "steps": steps,
                "plain": plain_median, "fleet": fleet_median, "overhead": fleet_median / plain_median - 1,
                "video_diff": (plain_video - fleet_video).abs().max().item(), "audio_diff": (plain_audio - fleet_audio).abs().max().item(),
                "peak": fields.get("peak_memory_bytes"),
            })  # fmt: skip

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        "| stage-1 size (WxHxF) | video + audio tokens | steps timed | plain ltx-core s/step | fleet world 1 s/step | overhead | max abs diff video / audio | fleet peak GPU memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        peak = f"{row['peak'] / 2**30:.1f} GiB" if row["peak"] else "-"
        lines.append(
            f"| {row['size']} | {row['tokens']} | {row['steps'] - 1} | {row['plain']:.3f} | {row['fleet']:.3f} | {row['overhead'] * 100:+.2f}% | "
            f"{row['video_diff']:.3g} / {row['audio_diff']:.3g} | {peak} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        header = f"\n`python {' '.join(sys.argv)}` on {name}, torch {torch.__version__}, {date.today().isoformat()}\n\n"
        with open(args.out, "a") as file:
            file.write(header + table + "\n")


if __name__ == "__main__":
    main()
