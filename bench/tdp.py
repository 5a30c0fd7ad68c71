"""Stage-2 transformer step on ONE GPU: untiled vs tiled data parallel (TDP) tilings.

One step = one call of ltx-core's X0Model, as the stage-2 loop makes it: positive prompt only, no
guidance, video + audio at the first stage-2 sigma. The full-size run uses the LTX-2 19B transformer
configuration (configs/ltx2-19b-transformer.json) with seeded random weights made on the GPU in
bf16, at 1536x1024, 121 frames, 24 fps: a 16x32x48 latent grid (24576 video tokens), 126 audio
tokens, and text contexts of 1024 tokens x 3840 (the Gemma prompt length and width the 19B model's
own caption projections read; see docs/full-size-config.md).

The tiled rows run ``apply_tiled_data_parallel`` with a single-rank Comm, so every tile runs in
turn on the one GPU: "ms per step" is what TDP costs on one GPU, "ms per tile" is about what one
rank pays per step when every tile has its own GPU (the projection column, which leaves out the
one all-reduce of the blended latents and any straggler). "attention share" is the time inside the
attention kernels (every ltx-core Attention's softmax(QK^T)V, timed per instance) over the step.

    python bench/tdp.py --tiny                              # CPU smoke run: tiny model, small grid
    python bench/tdp.py --device cuda --out docs/bench/tdp-h200.md

Prints a markdown table on stdout only. It must never load checkpoints or download anything.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from _common import (  # noqa: I001 - _common puts the repository on sys.path first
    bench_parser,
    run_bench,
    REPO_ROOT,
    IntervalTimer,
    bench_device,
    log,
    markdown_table,
    materialize_random_,
    median,
    peak_memory_text,
    reset_peak_memory,
    synchronize,
    time_calls,
)
from ltx_core.model.transformer import LTXModelConfigurator, X0Model
from ltx_core.model.transformer.attention import Attention
from ltx_core.model.transformer.modality import Modality

from mgpu_backend.ltx.diagnostics import random_transformer_inputs
from mgpu_backend.ltx.latents import StageGeometry
from mgpu_backend.ltx.stages import STAGE_2_SIGMAS
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.tiled_data_parallel import DimensionTiling, TileCounts, apply_tiled_data_parallel

TRANSFORMER_CONFIG_NAME = "ltx2-19b-transformer.json"
# Where the full-size configuration may sit: the repository's configs/ (DESIGN section 7), a shared/
# checkout next to the code, or the workplace's shared folder.
TRANSFORMER_CONFIG_CANDIDATES = (
    REPO_ROOT / "configs" / TRANSFORMER_CONFIG_NAME,
    REPO_ROOT / "shared" / "configs" / TRANSFORMER_CONFIG_NAME,
    Path("/work/shared/configs") / TRANSFORMER_CONFIG_NAME,
)

TILE_OVERLAP = 4  # latent cells, in height and width


@dataclass(frozen=True)
class BenchSetup:
    geometry: StageGeometry
    text_tokens: int
    # (height tiles, width tiles); frames are never cut (one tile in time), as the TDP upscale runs.
    tilings: tuple[tuple[int, int], ...]


FULL_SIZE = BenchSetup(
    geometry=StageGeometry(height=1024, width=1536, num_frames=121, frame_rate=24.0),
    # ltx-core's Gemma tokenizer pads every prompt to 1024 tokens, and the connectors keep that length.
    text_tokens=1024,
    tilings=((1, 1), (2, 2), (2, 4)),
)
# Same code path, small enough for a CPU: 2x16x24 latent grid = 768 video tokens, 2x4 tiles still fit
# overlap 4 (middle width tiles need at least 8 cells).
TINY = BenchSetup(
    geometry=StageGeometry(height=512, width=768, num_frames=9, frame_rate=24.0),
    text_tokens=128,
    tilings=((1, 1), (2, 2), (2, 4)),
)


def load_transformer_config(tiny: bool, path: str | None) -> dict:
    """The ``transformer`` section as ltx-core's LTXModelConfigurator reads it from a checkpoint."""
    if tiny:
        from mgpu_backend.bundles.tiny import TRANSFORMER_CONFIG

        return dict(TRANSFORMER_CONFIG)
    candidates = [Path(path)] if path else list(TRANSFORMER_CONFIG_CANDIDATES)
    for candidate in candidates:
        if candidate.is_file():
            log(f"transformer configuration: {candidate}")
            return json.loads(candidate.read_text())["transformer"]
    raise SystemExit(
        f"no {TRANSFORMER_CONFIG_NAME} found (looked in {', '.join(map(str, candidates))}); copy "
        f"/work/shared/configs/{TRANSFORMER_CONFIG_NAME} into the repository's configs/ or pass --transformer-config"
    )


def build_x0_model(transformer_config: dict, device: torch.device, dtype: torch.dtype, seed: int) -> X0Model:
    with torch.device("meta"):
        velocity_model = LTXModelConfigurator.from_config({"transformer": transformer_config})
    velocity_model = materialize_random_(velocity_model, device, dtype, seed)
    parameters = sum(p.numel() for p in velocity_model.parameters())
    log(f"transformer: {parameters / 1e6:.1f}M parameters, {parameters * dtype.itemsize / 1e9:.2f} GB in {dtype} on {device}")
    return X0Model(velocity_model).eval()


def stage2_inputs(
    setup: BenchSetup, transformer_config: dict, device: torch.device, dtype: torch.dtype, seed: int
) -> tuple[Modality, Modality]:
    """Video and audio Modality as the stage-2 loop builds them (ltx-core's latent tools), with
    random latents and random text contexts of the shape the embeddings processor produces."""
    return random_transformer_inputs(
        setup.geometry, setup.geometry, setup.text_tokens, transformer_config["caption_channels"], STAGE_2_SIGMAS[0], device, dtype, seed
    )


class TimedTiles:
    """The X0 model with each call timed on the device: TDP calls it once per tile."""

    def __init__(self, model: X0Model, timer: IntervalTimer) -> None:
        self.model, self.timer = model, timer

    def __call__(self, video, audio, perturbations=None):
        with self.timer.interval():
            return self.model(video=video, audio=audio, perturbations=perturbations)


def attention_milliseconds(model: X0Model, step, device: torch.device) -> tuple[float, float]:
    """One step with every Attention's kernel timed: (attention ms, step ms).

    ltx-core keeps the attention kernel as a per-instance ``attention_function``; it is wrapped on
    each instance for this one step and put back afterwards.
    """
    timer = IntervalTimer(device)
    originals = {}
    for module in model.modules():
        if isinstance(module, Attention):
            originals[module] = module.attention_function

            def timed(q, k, v, heads, mask=None, _kernel=module.attention_function):
                with timer.interval():
                    return _kernel(q, k, v, heads, mask)

            module.attention_function = timed
    try:
        step_ms = time_calls(step, device, warmup=0, repeats=1)[0]
    finally:
        for module, original in originals.items():
            module.attention_function = original
    return sum(timer.milliseconds()), step_ms


def measure(args: argparse.Namespace) -> str:
    device, dtype = bench_device(args.device, args.tiny)
    setup = TINY if args.tiny else FULL_SIZE
    geometry = setup.geometry
    video_grid = tuple(geometry.video_shape.to_torch_shape()[2:])
    log(
        f"stage 2 at {geometry.width}x{geometry.height}, {geometry.num_frames} frames, {geometry.frame_rate} fps: "
        f"latent grid {'x'.join(map(str, video_grid))} = {geometry.video_tokens} video tokens, "
        f"{geometry.audio_tokens} audio tokens, {setup.text_tokens} text tokens; {dtype} on {device}"
    )

    transformer_config = load_transformer_config(args.tiny, args.transformer_config)
    model = build_x0_model(transformer_config, device, dtype, args.seed)
    video, audio = stage2_inputs(setup, transformer_config, device, dtype, args.seed + 1)

    rows = []
    untiled_ms = None
    for height_tiles, width_tiles in setup.tilings:
        tile_timer = IntervalTimer(device)
        timed_model = TimedTiles(model, tile_timer)
        if (height_tiles, width_tiles) == (1, 1):
            name = "untiled"
            tile_shapes = [video_grid]
            step = lambda: timed_model(video=video, audio=audio, perturbations=None)  # noqa: E731
        else:
            name = f"TDP {height_tiles}x{width_tiles}"
            tiling = TileCounts(
                height=DimensionTiling(height_tiles, TILE_OVERLAP), width=DimensionTiling(width_tiles, TILE_OVERLAP)
            )
            tiled = apply_tiled_data_parallel(timed_model, Comm(None), tiling, video_grid)
            tile_shapes = [tile.shape for tile in tiled.plan.tiles]
            step = lambda tiled=tiled: tiled(video=video, audio=audio, perturbations=None)  # noqa: E731

        log(f"{name}: {len(tile_shapes)} tiles of {sorted({'x'.join(map(str, s)) for s in tile_shapes})}")
        reset_peak_memory(device)
        with torch.inference_mode():
            for _ in range(args.warmup):
                step()
            tile_timer.milliseconds()  # drop the warm-up calls
            step_ms = time_calls(step, device, warmup=0, repeats=args.repeats)
            tile_ms = tile_timer.milliseconds()
            attention_ms, instrumented_step_ms = attention_milliseconds(model, step, device)
            tile_timer.milliseconds()
        synchronize(device)

        per_step_ms = median(step_ms)
        untiled_ms = per_step_ms if untiled_ms is None else untiled_ms
        tiles = len(tile_shapes)
        # Tile call times in tile order, repeated per step: the slowest tile sets the pace when
        # every tile has its own GPU.
        per_tile_medians = [median(tile_ms[index::tiles]) for index in range(tiles)]
        slowest_tile_ms = max(per_tile_medians)
        token_counts = sorted({math.prod(shape) for shape in tile_shapes})
        tokens_text = (
            str(token_counts[0]) if len(token_counts) == 1 else f"{token_counts[0]}-{token_counts[-1]}"
        )
        rows.append(
            [
                name,
                str(tiles),
                " / ".join(sorted({"x".join(map(str, s)) for s in tile_shapes})),
                tokens_text,
                f"{per_step_ms:.1f}",
                f"{median(per_tile_medians):.1f}",
                f"{untiled_ms / per_step_ms:.2f}x",
                f"{100 * attention_ms / instrumented_step_ms:.0f}%",
                f"{slowest_tile_ms:.1f} ({untiled_ms / slowest_tile_ms:.2f}x)",
                peak_memory_text(device),
            ]
        )
        log(f"{name}: {per_step_ms:.1f} ms per step (median of {args.repeats}), {median(per_tile_medians):.1f} ms per tile")

    headers = [
        "tiling (overlap 4)",
        "tiles",
        "tile grid F'xH'xW'",
        "video tokens per tile",
        "ms per step",
        "ms per tile",
        "speed-up vs untiled, 1 GPU",
        "attention share",
        "projected ms per step, 1 GPU per tile (speed-up)",
        "peak GPU memory",
    ]
    return markdown_table(headers, rows)


def main() -> None:
    parser = bench_parser(__doc__, tiny_help="tiny 2-layer model and a small grid (CPU smoke run)", warmup=2, repeats=5, unit="steps per tiling")
    parser.add_argument("--transformer-config", help=f"path of {TRANSFORMER_CONFIG_NAME} (default: searched)")
    run_bench(parser, measure)


if __name__ == "__main__":
    main()
