"""Stage-1 step of the transformer in bf16 against fp8-cast: time, memory, and how much the output moves.

The full-size run builds the LTX-2 19B transformer (configs/ltx2-19b-transformer.json) with seeded
random weights on the GPU in bf16, and then the same weights under fp8-cast
(``mgpu_backend.ltx.fp8.cast_to_fp8_``: ltx-core's ``QuantizationPolicy.fp8_cast()``, the official
``--quantization fp8-cast``, i.e. the attention and feed-forward weights and biases of every block
stored as float8_e4m3fn and upcast per layer for each forward). Each runs a stage-1 step at the
two-stage default's stage-1 size (768x512, 121 frames, 24 fps: 6144 video + 126 audio tokens, text
contexts of 1024 x 3840): four X0Model forwards on the same inputs, as many as the full-guidance
step's passes (conditional, unconditional, STG-perturbed, modality-isolated).

Columns: the transformer's weight bytes, the median step time, the peak GPU memory of a step (the
weights included), and the difference of the step's output (video and audio denoised latents)
from bf16: largest absolute difference and RMS of the difference over RMS of the bf16 output.

    python bench/fp8.py --tiny                                 # CPU smoke run: tiny model, small grid
    python bench/fp8.py --device cuda --out docs/bench/fp8-h200.md

Prints a markdown table on stdout only. It never loads checkpoints or downloads anything.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from _common import (  # noqa: I001 - _common puts the repository on sys.path first
    REPO_ROOT,
    bench_device,
    bench_parser,
    log,
    markdown_table,
    median,
    peak_memory_text,
    reset_peak_memory,
    run_bench,
    synchronize,
    time_calls,
)

from mgpu_backend.ltx import fp8
from mgpu_backend.ltx.diagnostics import random_transformer, random_transformer_inputs
from mgpu_backend.ltx.latents import StageGeometry

PASSES_PER_STEP = 4  # full multimodal guidance: conditional, unconditional, STG-perturbed, modality-isolated
FIRST_SIGMA = 1.0  # stage 1 starts from pure noise
FULL_SIZE = (StageGeometry(height=512, width=768, num_frames=121, frame_rate=24.0), 1024)
TINY = (StageGeometry(height=64, width=96, num_frames=9, frame_rate=24.0), 32)


def transformer_config(tiny: bool, path: str | None) -> dict:
    if tiny:
        from mgpu_backend.bundles.tiny import TRANSFORMER_CONFIG

        return dict(TRANSFORMER_CONFIG)
    config_path = Path(path) if path else REPO_ROOT / "configs" / "ltx2-19b-transformer.json"
    return json.loads(config_path.read_text())["transformer"]


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def byte_text(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.2f} MB"


def run_mode(quantization: str | None, config: dict, geometry: StageGeometry, text_tokens: int, device, dtype, args) -> dict:
    model = random_transformer({"transformer": config}, device, dtype, args.seed)
    if quantization == "fp8-cast":
        fp8.cast_to_fp8_(model.velocity_model)
    release(device)
    weight_bytes = sum(tensor.nbytes for tensor in (*model.parameters(), *model.buffers()))
    video, audio = random_transformer_inputs(geometry, geometry, text_tokens, config["caption_channels"], FIRST_SIGMA, device, dtype, args.seed + 1)

    def step():
        for _ in range(PASSES_PER_STEP):
            outputs = model(video=video, audio=audio, perturbations=None)
        return outputs

    reset_peak_memory(device)
    with torch.inference_mode():
        times = time_calls(step, device, warmup=args.warmup, repeats=args.repeats)
        denoised_video, denoised_audio = step()
    synchronize(device)
    result = {
        "weight_bytes": weight_bytes, "step_ms": median(times), "peak": peak_memory_text(device),
        "video": denoised_video.float().cpu(), "audio": denoised_audio.float().cpu(),
    }  # fmt: skip
    log(f"{quantization or dtype}: {weight_bytes / 1e9:.3f} GB of weights, {result['step_ms']:.1f} ms per step, peak {result['peak']}")
    return result


def relative_rms(difference: torch.Tensor, reference: torch.Tensor) -> float:
    return (difference.pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()).item()


def measure(args: argparse.Namespace) -> str:
    device, dtype = bench_device(args.device, args.tiny)
    geometry, text_tokens = TINY if args.tiny else FULL_SIZE
    config = transformer_config(args.tiny, args.transformer_config)
    log(
        f"stage 1 at {geometry.width}x{geometry.height}, {geometry.num_frames} frames: {geometry.video_tokens} video + "
        f"{geometry.audio_tokens} audio tokens, {text_tokens} text tokens; {PASSES_PER_STEP} forwards per step, {dtype} on {device}"
    )
    reference = run_mode(None, config, geometry, text_tokens, device, dtype, args)
    release(device)  # the first model is gone once run_mode returns
    quantized = run_mode("fp8-cast", config, geometry, text_tokens, device, dtype, args)
    rows = []
    for name, result in ((str(dtype).removeprefix("torch."), reference), ("fp8-cast", quantized)):
        differences = []
        for modality in ("video", "audio"):
            difference = result[modality] - reference[modality]
            differences.append(f"{difference.abs().max().item():.3g} / {relative_rms(difference, reference[modality]):.3g}")
        rows.append([
            name, byte_text(result["weight_bytes"]), f"{result['step_ms']:.1f}", f"{reference['step_ms'] / result['step_ms']:.2f}x",
            result["peak"], differences[0], differences[1],
        ])  # fmt: skip
    headers = [
        "transformer weights", "weight bytes", "ms per stage-1 step", "speed vs unquantized", "peak GPU memory",
        "video: max abs / relative RMS diff", "audio: max abs / relative RMS diff",
    ]  # fmt: skip
    return markdown_table(headers, rows)


def main() -> None:
    parser = bench_parser(__doc__, tiny_help="tiny 2-layer model and a small grid (CPU smoke run)", warmup=1, repeats=3, unit="steps per mode")
    parser.add_argument("--transformer-config", help="path of the transformer configuration (default: configs/ltx2-19b-transformer.json)")
    run_bench(parser, measure)


if __name__ == "__main__":
    main()
