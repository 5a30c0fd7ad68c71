"""The four guidance passes of one stage-1 step on ONE GPU: one after another vs one batched forward,
eager and replayed from CUDA graphs.

A stage-1 step runs the transformer four times with batch 1 (conditional, unconditional with the
negative prompt, STG-perturbed in block 29, modality-isolated). At the shard sizes a rank sees under
SP an eager batch-1 forward is launch-bound, so this bench times, per step of four passes:
``SequentialPassRunner`` (four forwards) against ``BatchedPassRunner`` (one forward of batch 4,
``mgpu_backend/parallel/batched_passes.py``), each called plainly and through
``mgpu_backend.parallel.cuda_graphs.CapturedForward`` (captured sequential: three graphs, since the
conditional and unconditional passes share one; captured batched: one graph). Video token counts
are those of bench/graphs.py: 1152 and 1920 (shard-sized sequences) and 6144 (768x512x121 stage 1
whole); audio is always the 121-frame clip's 126 tokens, the text contexts 1024 tokens.

The full-size run uses the LTX-2 19B configuration (configs/ltx2-19b-transformer.json) with seeded
random weights made on the GPU in bf16 (``mgpu_backend.ltx.diagnostics.random_transformer``). Each row:
median ms per step (all four passes; each call ends in a device synchronisation, so host overhead
counts) over ``--repeats`` calls after ``--warmup``, speed-ups against eager sequential, the max abs
difference of every output against eager sequential (with the outputs' own max abs value for
scale), the one-off capture time, and the peak GPU memory of the row (the graphs of a row are
released before the next). Rows run smallest first; a row that fails is reported as failed and the
bench goes on; rows that would start after ``--budget-s`` seconds are skipped.

    python bench/batched_passes.py --tiny                 # CPU smoke run (eager rows), well under a minute
    python bench/batched_passes.py --device cuda --out docs/bench/batched-passes-h200.md

Prints a markdown table on stdout only. It must never load checkpoints or download anything.
"""

from __future__ import annotations

import argparse
import time
import traceback
from dataclasses import replace

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
from graphs import FULL_SIZE, TINY, forward_inputs
from ltx_core.guidance.perturbations import (
    BatchedPerturbationConfig,
    Perturbation,
    PerturbationConfig,
    PerturbationType,
)
from tdp import load_transformer_config

from mgpu_backend.ltx.diagnostics import random_transformer
from mgpu_backend.ltx.passes import GuidancePass, SequentialPassRunner
from mgpu_backend.parallel.batched_passes import BatchedPassRunner
from mgpu_backend.parallel.cuda_graphs import CapturedForward

# The STG block of the official LTX-2.0 guidance (ltx-pipelines 1.0.0, LTX_2_PARAMS: stg_blocks=[29]).
OFFICIAL_STG_BLOCK = 29


def step_passes(video_geometry, setup: dict, caption_channels: int, layers: int, device, dtype, seed: int) -> list[GuidancePass]:  # fmt: skip
    """The four passes of one step, built like ``stages.guidance_passes``: the unconditional pass
    has its own (negative) text contexts, the others the positive ones."""
    video, audio = forward_inputs(video_geometry, setup["audio"], setup["text_tokens"], caption_channels, device, dtype, seed)  # fmt: skip
    negative_video, negative_audio = forward_inputs(video_geometry, setup["audio"], setup["text_tokens"], caption_channels, device, dtype, seed + 1)  # fmt: skip
    stg_block = min(OFFICIAL_STG_BLOCK, layers - 1)
    stg = PerturbationConfig(
        [
            Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [stg_block]),
            Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, [stg_block]),
        ]
    )
    isolated = PerturbationConfig(
        [
            Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, None),
            Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, None),
        ]
    )
    return [
        GuidancePass("conditional", video, audio, None),
        GuidancePass(
            "unconditional",
            replace(video, context=negative_video.context),
            replace(audio, context=negative_audio.context),
            None,
        ),
        GuidancePass("perturbed", video, audio, BatchedPerturbationConfig([stg])),
        GuidancePass("isolated", video, audio, BatchedPerturbationConfig([isolated])),
    ]


def max_abs_diff(outputs: list[tuple], reference: list[tuple]) -> float:
    return max(
        float((out.float() - ref.float()).abs().max())
        for pair, reference_pair in zip(outputs, reference, strict=True)
        for out, ref in zip(pair, reference_pair, strict=True)
    )


def measure_row(model, passes: list[GuidancePass], device: torch.device, args: argparse.Namespace) -> dict:
    """Times and differences of the four ways to run one step's passes."""
    sequential, batched = SequentialPassRunner(), BatchedPassRunner()
    row: dict = {}
    with torch.inference_mode():
        reference = sequential.run(model, passes)
        row["scale"] = max(float(out.float().abs().max()) for pair in reference for out in pair)
        row["diff eager batched"] = max_abs_diff(batched.run(model, passes), reference)
        if batched.forwards != 1:
            raise RuntimeError(f"the four passes did not run as one batched forward ({batched.forwards} forwards)")
        for name, runner in (("sequential", sequential), ("batched", batched)):
            row[f"eager {name}"] = median(time_calls(lambda: runner.run(model, passes), device, args.warmup, args.repeats))  # fmt: skip
        paths = []
        for name, runner in (("sequential", sequential), ("batched", batched)):
            captured = CapturedForward(model)
            try:
                started = time.perf_counter()
                replayed = runner.run(captured, passes)  # the first call of each signature captures
                synchronize(device)
                row[f"capture s {name}"] = time.perf_counter() - started
                row[f"diff captured {name}"] = max_abs_diff(replayed, reference)
                del replayed
                row[f"captured {name}"] = median(time_calls(lambda: runner.run(captured, passes), device, args.warmup, args.repeats))  # fmt: skip
                summary = captured.summary()
                paths.append(f"{name}: {summary['graphs']} graph(s)" if summary["graphs"] else "eager: " + "; ".join(summary["eager_reasons"]))  # fmt: skip
            finally:
                captured.release()
        row["path"] = paths[0] if paths[0] == paths[1] else ", ".join(paths)
    return row


def measure(args: argparse.Namespace) -> str:
    started = time.perf_counter()
    device, dtype = bench_device(args.device, args.tiny)
    setup = TINY if args.tiny else FULL_SIZE
    transformer_config = load_transformer_config(args.tiny, args.transformer_config)
    model = random_transformer({"transformer": transformer_config}, device, dtype, args.seed)
    synchronize(device)
    log(f"random transformer built on {device} in {dtype} at {time.perf_counter() - started:.1f} s")

    rows = []
    for video_tokens, video_geometry in sorted(setup["video"].items()):
        grid = "x".join(map(str, video_geometry.video_shape.to_torch_shape()[2:]))
        elapsed = time.perf_counter() - started
        if elapsed > args.budget_s:
            rows.append([str(video_tokens), grid, *["-"] * 10, f"skipped: {elapsed:.0f} s elapsed, over the {args.budget_s:.0f} s budget", "-"])  # fmt: skip
            log(f"{video_tokens} video tokens: skipped, {elapsed:.0f} s elapsed (--budget-s {args.budget_s:.0f})")
            continue
        reset_peak_memory(device)
        failure = None
        try:
            passes = step_passes(video_geometry, setup, transformer_config["caption_channels"],
                                 transformer_config["num_layers"], device, dtype, args.seed + 1)  # fmt: skip
            assert video_geometry.video_tokens == video_tokens == passes[0].video.latent.shape[1]
            row = measure_row(model, passes, device, args)
        except Exception as exc:  # noqa: BLE001 - one failed row (OOM, capture) must not lose the others
            log(traceback.format_exc())
            failure = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        passes = None  # and the failure's traceback is gone here: the row's tensors can be freed
        if failure is not None:
            rows.append([str(video_tokens), grid, *["-"] * 10, failure, peak_memory_text(device)])
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        base = row["eager sequential"]
        rows.append([
            str(video_tokens), grid,
            f"{row['eager sequential']:.1f}", f"{row['eager batched']:.1f}",
            f"{row['captured sequential']:.1f}", f"{row['captured batched']:.1f}",
            f"{base / row['eager batched']:.2f}x", f"{base / row['captured sequential']:.2f}x", f"{base / row['captured batched']:.2f}x",
            f"{row['diff eager batched']:.3g} / {row['diff captured sequential']:.3g} / {row['diff captured batched']:.3g}",
            f"{row['scale']:.3g}",
            f"{row['capture s sequential']:.2f} / {row['capture s batched']:.2f}",
            row["path"], peak_memory_text(device),
        ])  # fmt: skip
        log(
            f"{video_tokens} video tokens, ms per step of 4 passes: eager sequential {row['eager sequential']:.1f}, "
            f"eager batched {row['eager batched']:.1f}, captured sequential {row['captured sequential']:.1f}, "
            f"captured batched {row['captured batched']:.1f}; max abs diff vs eager sequential: batched "
            f"{row['diff eager batched']:.3g}, captured sequential {row['diff captured sequential']:.3g}, captured "
            f"batched {row['diff captured batched']:.3g} (outputs up to {row['scale']:.3g}); {row['path']}; "
            f"peak {peak_memory_text(device)}; {time.perf_counter() - started:.0f} s elapsed"
        )
    headers = [
        "video tokens", "latent grid F'xH'xW'", "eager sequential ms/step", "eager batched ms/step",
        "captured sequential ms/step", "captured batched ms/step", "eager batched speed-up",
        "captured sequential speed-up", "captured batched speed-up",
        "max abs diff vs eager sequential (eager batched / captured seq. / captured batched)", "output max |x|",
        "capture s (seq. / batched)", "path", "peak GPU memory",
    ]  # fmt: skip
    return markdown_table(headers, rows)


def main() -> None:
    parser = bench_parser(__doc__, tiny_help="tiny 2-layer model and small grids (CPU smoke run)", warmup=2, repeats=5, unit="steps per row and path")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="start no new row after this many seconds (default 120, so that the 19B run with its "
                             "~1 min 6144-token row stays near 3 min; rows run smallest first)")  # fmt: skip
    parser.add_argument("--transformer-config", help="path of ltx2-19b-transformer.json (default: searched)")
    run_bench(parser, measure)


if __name__ == "__main__":
    main()
