"""One res_2s step of the HQ recipe's stage 1: the fleet's stage code against the official loop.

Both sides run stage 1 of ltx-pipelines 1.0.0's ``TI2VidTwoStagesHQPipeline`` (res_2s steps over
LTX2Scheduler sigmas shifted by the latent's token count, the recipe's guidance ``LTX_2_3_HQ_PARAMS``:
conditional, unconditional and modality-isolated passes, no STG) on one random transformer built on
the device from a seed, in bfloat16 (the official res_2s loop keeps its latents in bfloat16):

- official: ltx-pipelines' ``denoise_audio_video`` + ``res2s_audio_video_denoising_loop`` +
  ``multi_modal_guider_denoising_func``, as the HQ pipeline calls them;
- ours: ``sample_stage1`` with ``stepper="res2s"`` at world 1 (``mgpu_backend.ltx.res2s``), and the
  same stage with ``stepper="euler"`` for the cost of one Euler step over the same passes.

A res_2s step evaluates the model twice (at the step's sigma and at the midpoint), each evaluation
running every guidance pass; a schedule ending at 0 adds one evaluation at the end. The table gives
the median seconds of the steps after ``--warmup`` (the last step, which holds that final
evaluation, is not timed), the transformer calls per step, and the max abs difference of the two
sides' latents (0 expected: the same computation).

    python bench/res2s_step.py --device cuda                 # LTX-2.3 22B, stage 1 of 1920x1088x121
    python bench/res2s_step.py --tiny                        # CPU smoke run, 2-layer model
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from _common import bench_parser, log, markdown_table, median, peak_memory_text, reset_peak_memory, resolve_device, run_bench, synchronize
from mgpu_backend.ltx.diagnostics import MODEL_CONFIGS, RandomModel, bench_config, random_contexts
from mgpu_backend.ltx.stages import GenerationParams, sample_stage1

FULL_SIZE = (960, 544, 121)  # LTX_2_3_HQ_PARAMS: stage 1 at half of 1920x1088
TINY_SIZE = (192, 128, 9)


class CountingModel:
    """The transformer, counting its calls."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, 0

    def __call__(self, video, audio, perturbations):
        self.calls += 1
        return self.model(video=video, audio=audio, perturbations=perturbations)


def hq_guiders():
    from ltx_pipelines.utils.constants import LTX_2_3_HQ_PARAMS

    return LTX_2_3_HQ_PARAMS.video_guider_params, LTX_2_3_HQ_PARAMS.audio_guider_params


def step_seconds(boundaries: list[float], first: int, count: int) -> list[float]:
    """Seconds of steps ``first`` .. ``first + count - 1`` from the times at each step's end."""
    return [boundaries[step] - boundaries[step - 1] for step in range(first, first + count)]


def official_stage1(model: CountingModel, params: GenerationParams, positive, negative, device: torch.device):
    """The HQ pipeline's stage-1 loop; returns (step-end times, video, audio)."""
    from ltx_core.components.diffusion_steps import Res2sDiffusionStep
    from ltx_core.components.guiders import MultiModalGuider
    from ltx_core.components.noisers import GaussianNoiser
    from ltx_pipelines.utils.helpers import denoise_audio_video, multi_modal_guider_denoising_func
    from ltx_pipelines.utils.samplers import res2s_audio_video_denoising_loop
    from ltx_pipelines.utils.types import PipelineComponents

    video_guider, audio_guider = hq_guiders()
    evaluation_ends = []

    def loop(sigmas, video_state, audio_state, stepper):
        denoise = multi_modal_guider_denoising_func(
            video_guider=MultiModalGuider(params=video_guider, negative_context=negative.video_context),
            audio_guider=MultiModalGuider(params=audio_guider, negative_context=negative.audio_context),
            v_context=positive.video_context, a_context=positive.audio_context, transformer=model,
        )  # fmt: skip

        def timed(*args, **kwargs):
            result = denoise(*args, **kwargs)
            synchronize(device)
            evaluation_ends.append(time.perf_counter())
            return result

        return res2s_audio_video_denoising_loop(sigmas=sigmas, video_state=video_state, audio_state=audio_state, stepper=stepper, denoise_fn=timed)

    dtype = torch.bfloat16
    with torch.inference_mode():
        video_state, audio_state = denoise_audio_video(
            output_shape=params.stage1.pixel_shape, conditionings=[],
            noiser=GaussianNoiser(generator=torch.Generator(device=device).manual_seed(params.seed)),
            sigmas=params.stage1_sigma_schedule(device), stepper=Res2sDiffusionStep(), denoising_loop_fn=loop,
            components=PipelineComponents(dtype=dtype, device=device), dtype=dtype, device=device,
        )  # fmt: skip
    # A step ends with its second (midpoint) evaluation.
    return evaluation_ends[1::2], video_state.latent.float().cpu(), audio_state.latent.float().cpu()


def our_stage1(loader: RandomModel, params: GenerationParams, positive, negative, device: torch.device):
    """``sample_stage1`` at world 1; returns (step-end times, video, audio)."""
    step_ends = []

    def on_step(step, total, video_x0=None):
        synchronize(device)
        step_ends.append(time.perf_counter())

    video, audio = sample_stage1(loader, params, positive, negative, on_step=on_step)
    return step_ends, video.cpu(), audio.cpu()


def measure(args) -> str:
    device = resolve_device(args.device)
    if device.type != "cuda" and not args.tiny:
        raise SystemExit("the full-size LTX-2.3 transformer needs a GPU: use --device cuda, or --tiny on a CPU")
    width, height, frames = TINY_SIZE if args.tiny else FULL_SIZE
    steps = args.warmup + args.repeats + 1
    config = bench_config(args.model, None, args.tiny)
    loader = RandomModel(config, device, torch.bfloat16, args.seed)
    counting = CountingModel(loader.model)
    loader.model = counting
    positive, negative = random_contexts(config["transformer"], device, torch.bfloat16, args.seed)
    video_guider, audio_guider = hq_guiders()
    params = GenerationParams(
        height=height, width=width, num_frames=frames, seed=args.seed, num_inference_steps=steps, video_guider=video_guider,
        audio_guider=audio_guider, two_stage=False, shift_sigmas_by_tokens=True, stepper="res2s",
    )  # fmt: skip

    runs = {}
    for name, run, run_params in (
        ("official res_2s", official_stage1, params),
        ("ours res_2s", our_stage1, params),
        ("ours Euler", our_stage1, replace(params, stepper="euler")),
    ):
        log(f"{name}: {steps} steps of {width}x{height}x{frames} ...")
        counting.calls = 0
        reset_peak_memory(device)
        ends, video, audio = run(counting if name.startswith("official") else loader, run_params, positive, negative, device)
        runs[name] = {"seconds": median(step_seconds(ends, args.warmup, args.repeats)), "calls": counting.calls, "video": video,
                      "audio": audio, "peak": peak_memory_text(device)}  # fmt: skip

    official, ours, euler = runs["official res_2s"], runs["ours res_2s"], runs["ours Euler"]
    video_diff = (ours["video"] - official["video"]).abs().max().item()
    audio_diff = (ours["audio"] - official["audio"]).abs().max().item()
    tokens = params.stage1.video_tokens
    headers = ["stage-1 size (WxHxF)", "video tokens", "stepper", "steps timed", "s/step", "vs official res_2s",
               "transformer calls per stage", "max abs diff video / audio", "peak GPU memory"]  # fmt: skip
    rows = []
    for name, run in runs.items():
        diff = "-" if name == "ours Euler" else ("0 (itself)" if run is official else f"{video_diff:.3g} / {audio_diff:.3g}")
        rows.append([
            f"{width}x{height}x{frames}", tokens, name, args.repeats, f"{run['seconds']:.3f}",
            f"{run['seconds'] / official['seconds'] - 1:+.1%}", f"{run['calls']} ({steps} steps)", diff, run["peak"],
        ])  # fmt: skip
    log(f"res_2s / Euler step time: {ours['seconds'] / euler['seconds']:.2f}x; transformer calls {ours['calls']} vs {euler['calls']}")
    return markdown_table(headers, rows)


def main() -> None:
    parser = bench_parser(__doc__, tiny_help="2-layer model on the CPU at 192x128x9 (smoke run)", warmup=1, repeats=3, unit="res_2s steps")
    parser.add_argument("--model", choices=tuple(MODEL_CONFIGS), default="2.3", help="transformer layout: 2.3 (22B, the HQ recipe's) or 2.0 (19B)")
    run_bench(parser, measure)


if __name__ == "__main__":
    main()
