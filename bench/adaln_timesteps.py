"""One timestep per token or one per sample: does ltx-core's forward give the same numbers, and how much faster is it?

ltx-core's denoising loop (which the fleet and the official pipeline run) hands the transformer a
timestep per token, ``Modality.timesteps = denoise_mask * sigma`` of shape [1, T, 1], so every block
builds its AdaLN shift/scale/gate per token and adds them at full size. ComfyUI's LTX-2 passes one
per sample when no token is conditioned, and its forward is 4-5% faster for that (docs/BENCHMARKS.md,
"Why ComfyUI is faster"). Where every token has the same sigma (text-to-video, no conditioning) the
two are the same arithmetic up to the AdaLN projection's rounding: the projection then runs on one
row instead of T. The fleet may take that speed only if the outputs stay bitwise equal, since stage 1
must equal the official pipeline. On an H200 in bf16 they do not (a few ulps apart, both layouts, at
4-8% speed-up; docs/BENCHMARKS.md, "The lever, and why the default stays"), so the fleet keeps one
timestep per token.

For each size this bench runs ltx-core's X0Model (random weights of the chosen configuration, built
here; bf16 on a GPU, fp32 on the CPU) on one set of inputs twice: timesteps per token, and the same
tensor's first column only ([1, 1, 1]), and prints whether video and audio outputs are bitwise
equal, their largest difference, and the median forward time of each.

    python bench/adaln_timesteps.py --device cuda                  # LTX-2.0 19B, 6144 and 24576 video tokens
    python bench/adaln_timesteps.py --device cuda --model 2.3      # the 22B layout
    python bench/adaln_timesteps.py --tiny [--model 2.3]           # CPU smoke run

Prints a markdown table on stdout only. It never loads checkpoints or downloads anything.
"""

from __future__ import annotations  # noqa: I001 - _common first: it puts the repository on sys.path

import argparse
import dataclasses
import time

import torch

from _common import bench_device, bench_parser, log, markdown_table, median, run_bench, synchronize, time_calls

from mgpu_backend.ltx.diagnostics import MODEL_CONFIGS, bench_config, context_widths, random_transformer, random_transformer_inputs
from mgpu_backend.ltx.latents import StageGeometry

SIGMA = 0.9  # an early stage-1 sigma; any sigma shared by every token would do
FULL_SIZE = {"768x512x121": StageGeometry(512, 768, 121, 24.0), "1536x1024x121": StageGeometry(1024, 1536, 121, 24.0)}
TINY = {"384x256x17": StageGeometry(256, 384, 17, 24.0), "384x256x25": StageGeometry(256, 384, 25, 24.0)}


def per_token_inputs(transformer_config: dict, geometry: StageGeometry, device: torch.device, dtype: torch.dtype, seed: int):
    """Video and audio ``Modality`` as the stage-1 loop builds them (a timestep per token, all at ``SIGMA``),
    with seeded latents and 1024-token text contexts of the widths this transformer takes."""
    return random_transformer_inputs(geometry, geometry, 1024, context_widths(transformer_config), SIGMA, device, dtype, seed)


def per_sample(modality):
    """The same input with one timestep per sample: the per-token tensor's first column."""
    return dataclasses.replace(modality, timesteps=modality.timesteps[:, :1])


def measure(args: argparse.Namespace) -> str:
    device, dtype = bench_device(args.device, args.tiny)
    config = bench_config(args.model, tiny=args.tiny)
    started = time.perf_counter()
    model = random_transformer(config, device, dtype, args.seed)
    synchronize(device)
    log(f"random LTX-{args.model} transformer built on {device} in {dtype} in {time.perf_counter() - started:.1f} s")
    rows = []
    for size, geometry in (TINY if args.tiny else FULL_SIZE).items():
        video, audio = per_token_inputs(config["transformer"], geometry, device, dtype, args.seed + 1)
        one_video, one_audio = per_sample(video), per_sample(audio)
        with torch.inference_mode():
            reference = model(video=video, audio=audio, perturbations=None)
            candidate = model(video=one_video, audio=one_audio, perturbations=None)
            token_ms = median(time_calls(lambda: model(video=video, audio=audio, perturbations=None), device, args.warmup, args.repeats))  # noqa: B023
            sample_ms = median(time_calls(lambda: model(video=one_video, audio=one_audio, perturbations=None), device, args.warmup, args.repeats))  # noqa: B023
        equal = [torch.equal(r, c) for r, c in zip(reference, candidate)]
        diffs = [float((r.float() - c.float()).abs().max()) for r, c in zip(reference, candidate)]
        log(f"{size}: per token {token_ms:.1f} ms, per sample {sample_ms:.1f} ms; bitwise equal video {equal[0]}, audio {equal[1]}")
        rows.append([
            size, f"{geometry.video_tokens} + {audio.latent.shape[1]}", f"{token_ms:.1f}", f"{sample_ms:.1f}", f"{token_ms / sample_ms:.3f}",
            "yes" if equal[0] else "no", "yes" if equal[1] else "no", f"{diffs[0]:.3g} / {diffs[1]:.3g}",
        ])  # fmt: skip
        del reference, candidate
    headers = [
        "size (WxHxF)", "video + audio tokens", "ms, timestep per token", "ms, timestep per sample", "speed-up",
        "video bitwise equal", "audio bitwise equal", "max abs diff video / audio",
    ]  # fmt: skip
    return markdown_table(headers, rows) + f"\n\nLTX-{args.model} random transformer ({'tiny' if args.tiny else 'full size'}), {str(dtype).removeprefix('torch.')}, sigma {SIGMA:g}, median of {args.repeats}."


def main() -> None:
    parser = bench_parser(__doc__, tiny_help="the tiny 2-layer model of that layout on the CPU (smoke run)", warmup=2, repeats=5, unit="forwards per row and path")
    parser.add_argument("--model", choices=tuple(MODEL_CONFIGS), default="2.0", help="2.0 (19B) or 2.3 (22B layout); default 2.0")
    run_bench(parser, measure)


if __name__ == "__main__":
    main()
