"""Batch-1 conditional-pass forward on ONE GPU: eager vs CUDA-graph replay.

At high SP degrees a rank's shard of the video tokens is small and an eager forward is bound by
kernel launches and Python. This bench times ltx-core's X0Model called plainly and through
``mgpu_backend.parallel.cuda_graphs.CapturedForward`` at several video token counts: 6144 (stage 1
at 768x512, 121 frames, the whole sequence on one GPU), 1920 and 1152 (shard-sized sequences: the
latent grid is 16x24 with 5 and 3 latent frames). Audio is always the 121-frame clip's 126 tokens
and the text contexts 1024 tokens, because a rank under SP keeps audio and text whole.

The full-size run uses the LTX-2 19B configuration (configs/ltx2-19b-transformer.json) with seeded
random weights made on the GPU in bf16 (``mgpu_backend.ltx.diagnostics.random_transformer``). Each row:
median ms per call over ``--repeats`` calls after ``--warmup`` (each call ends in a device
synchronisation, so host overhead counts), the one-off capture time (warm-up + capture + first
replay), and the max abs difference captured vs eager on two different inputs of that shape.
Targets: 1152 tokens <= 90 ms, no loss at 6144. ``--compile-blocks`` adds the same forward with the
blocks compiled by torch.compile (``mgpu_backend.parallel.compiled_blocks``) and replayed from a CUDA
graph: its time, the first call's compile time and its difference from eager.

    python bench/graphs.py --tiny                 # CPU smoke run: tiny model, eager-fallback rows
    python bench/graphs.py --device cuda --out docs/bench/graphs-h200.md

Prints a markdown table on stdout only. It must never load checkpoints or download anything.
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import (  # noqa: I001 - _common puts the repository on sys.path first
    bench_parser,
    run_bench,
    bench_device,
    log,
    markdown_table,
    median,
    peak_memory_text,
    reset_peak_memory,
    synchronize,
    time_calls,
)
from ltx_core.model.transformer.modality import Modality
from tdp import load_transformer_config

from mgpu_backend.ltx.diagnostics import random_transformer, random_transformer_inputs
from mgpu_backend.ltx.latents import StageGeometry
from mgpu_backend.parallel.compiled_blocks import apply_compiled_blocks, remove_compiled_blocks
from mgpu_backend.parallel.cuda_graphs import CapturedForward

SIGMA = 0.9  # an early stage-1 sigma; the compute does not depend on it
FULL_SIZE = {
    "video": {6144: StageGeometry(512, 768, 121, 24.0), 1920: StageGeometry(512, 768, 33, 24.0), 1152: StageGeometry(512, 768, 17, 24.0)},
    "audio": StageGeometry(512, 768, 121, 24.0),
    "text_tokens": 1024,
}
TINY = {
    "video": {288: StageGeometry(256, 384, 17, 24.0), 192: StageGeometry(256, 384, 9, 24.0)},
    "audio": StageGeometry(256, 384, 17, 24.0),
    "text_tokens": 64,
}


def forward_inputs(video_geometry: StageGeometry, audio_geometry: StageGeometry, text_tokens: int,
                   caption_channels: int, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[Modality, Modality]:  # fmt: skip
    """Video and audio ``Modality`` as the stage-1 loop builds them, at an early stage-1 sigma."""
    return random_transformer_inputs(video_geometry, audio_geometry, text_tokens, caption_channels, SIGMA, device, dtype, seed)


def measure(args: argparse.Namespace) -> str:
    device, dtype = bench_device(args.device, args.tiny)
    setup = TINY if args.tiny else FULL_SIZE
    transformer_config = load_transformer_config(args.tiny, args.transformer_config)
    started = time.perf_counter()
    model = random_transformer({"transformer": transformer_config}, device, dtype, args.seed)
    synchronize(device)
    log(f"random transformer built on {device} in {dtype} in {time.perf_counter() - started:.1f} s")
    captured = CapturedForward(model)

    rows = []
    sizes = setup["video"]
    if args.tokens:
        wanted = [int(value) for value in args.tokens.split(",")]
        if unknown := sorted(set(wanted) - set(sizes)):
            raise SystemExit(f"--tokens: no row for {unknown}; choose from {', '.join(map(str, sizes))}")
        sizes = {tokens: sizes[tokens] for tokens in wanted}
    for video_tokens, video_geometry in sizes.items():
        grid = "x".join(map(str, video_geometry.video_shape.to_torch_shape()[2:]))
        assert video_geometry.video_tokens == video_tokens, (video_geometry.video_tokens, video_tokens)
        inputs = [
            forward_inputs(video_geometry, setup["audio"], setup["text_tokens"], transformer_config["caption_channels"],
                           device, dtype, args.seed + 1 + index)  # fmt: skip
            for index in range(2)
        ]
        reset_peak_memory(device)
        with torch.inference_mode():
            eager = [model(video=v, audio=a, perturbations=None) for v, a in inputs]
            eager_ms = median(time_calls(lambda: model(video=inputs[0][0], audio=inputs[0][1], perturbations=None),
                                         device, warmup=args.warmup, repeats=args.repeats))  # fmt: skip
            captures_before = captured.captures
            capture_started = time.perf_counter()
            replayed = [captured(v, a, None) for v, a in inputs]  # the first call captures
            synchronize(device)
            first_calls_s = time.perf_counter() - capture_started
            captured_ms = median(time_calls(lambda: captured(inputs[1][0], inputs[1][1], None),
                                            device, warmup=args.warmup, repeats=args.repeats))  # fmt: skip
        diff = max_abs_diff(eager, replayed)
        path = "graph" if captured.captures > captures_before else "eager: " + "; ".join(captured.summary()["eager_reasons"])
        row = [
            str(video_tokens), grid, str(inputs[0][1].latent.shape[1]), f"{eager_ms:.1f}", f"{captured_ms:.1f}",
            f"{eager_ms / captured_ms:.2f}x", f"{first_calls_s:.2f}", f"{diff:.3g}",
        ]  # fmt: skip
        log(f"{video_tokens} video tokens: eager {eager_ms:.1f} ms, captured {captured_ms:.1f} ms, max abs diff {diff:.3g} ({path})")
        if args.compile_blocks:
            apply_compiled_blocks(model)
            with torch.inference_mode():
                compile_started = time.perf_counter()
                # A graph of the compiled blocks is its own variant: it must not serve the eager rows.
                compiled = [captured(v, a, None, variant="compiled blocks") for v, a in inputs]  # compiles, then captures
                synchronize(device)
                compile_s = time.perf_counter() - compile_started
                compiled_ms = median(time_calls(lambda: captured(inputs[1][0], inputs[1][1], None, variant="compiled blocks"),
                                                device, warmup=args.warmup, repeats=args.repeats))  # fmt: skip
            remove_compiled_blocks(model)
            compiled_diff = max_abs_diff(eager, compiled)
            row += [f"{compiled_ms:.1f}", f"{eager_ms / compiled_ms:.2f}x", f"{compile_s:.1f}", f"{compiled_diff:.3g}"]
            log(f"{video_tokens} video tokens: compiled blocks + captured {compiled_ms:.1f} ms (first calls {compile_s:.1f} s), max abs diff {compiled_diff:.3g}")
            del compiled
        rows.append([*row, path, peak_memory_text(device)])
        del eager, replayed
    log(f"capture summary: {captured.summary()}")
    headers = [
        "video tokens", "latent grid F'xH'xW'", "audio tokens", "eager ms", "captured ms", "speed-up",
        "capture s (2 calls)", "max abs diff",
    ]  # fmt: skip
    if args.compile_blocks:
        headers += ["compiled blocks + captured ms", "speed-up vs eager", "compile + capture s (2 calls)", "max abs diff (compiled)"]
    headers += ["path", "peak GPU memory"]
    return markdown_table(headers, rows)


def max_abs_diff(expected: list[tuple], got: list[tuple]) -> float:
    return max(float((e.float() - g.float()).abs().max()) for pair_e, pair_g in zip(expected, got) for e, g in zip(pair_e, pair_g))


def main() -> None:
    parser = bench_parser(__doc__, tiny_help="tiny 2-layer model and small grids (CPU smoke run)", warmup=3, repeats=10, unit="calls per row and path")
    parser.add_argument("--transformer-config", help="path of ltx2-19b-transformer.json (default: searched)")
    parser.add_argument("--tokens", help="comma-separated video token counts of the rows to run (default: all)")
    parser.add_argument("--compile-blocks", action="store_true", help="also time the forward with torch.compile'd blocks, replayed from a CUDA graph (GPU)")
    run_bench(parser, measure)


if __name__ == "__main__":
    main()
