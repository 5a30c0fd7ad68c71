"""What a live preview costs against a denoising step, at the stage-1 and stage-2 sizes.

For each size, on one device:

- one transformer pass: ltx-core's X0Model at the LTX-2 19B configuration (configs/
  ltx2-19b-transformer.json) with seeded random weights in bf16, on random video and audio inputs of
  that size (a stage-1 step runs up to four such passes, a stage-2 step one: the pass is the
  smallest step there is, so the ratio below is the worst case);
- one preview, exactly as a rank's step callback makes it: the step's video x0 tokens put back in
  ComfyUI's layout (``state_to_comfy``), projected to RGB for 4 latent frames, upsampled 2x, turned
  into uint8 and copied to the host (``LatentRGB.preview``), with a device synchronisation at the end;
- once per size, the one-off fit of the projection (``fit_latent_rgb``: a decode of a 2x16x16
  latent) with a video VAE decoder of the full-size dimensions (``FULL_SIZE_VIDEO_VAE_CONFIG``,
  sources in docs/full-size-config.md) and random weights; it runs once per loaded model.

    python bench/preview.py --tiny                                # CPU smoke run: 2-layer model, small sizes
    python bench/preview.py --device cuda --out docs/bench/preview-h200.md

Target: preview under 1% of a pass. Prints a markdown table on stdout only; never loads checkpoints.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from _common import (  # noqa: I001 - _common puts the repository on sys.path first
    bench_dtype,
    bench_parser,
    log,
    markdown_table,
    materialize_random_,
    median,
    resolve_device,
    run_bench,
    time_calls,
)
from ltx_core.model.video_vae import VideoDecoderConfigurator

from mgpu_backend.bundles.configs import FULL_SIZE_VIDEO_VAE_CONFIG, VIDEO_VAE_CONFIG
from mgpu_backend.ltx.diagnostics import bench_config, random_transformer, random_transformer_inputs
from mgpu_backend.ltx.latents import StageGeometry, state_to_comfy
from mgpu_backend.ltx.previews import fit_latent_rgb

FULL_SIZES = "768x512x121,1536x1024x121"
TINY_SIZES = "96x64x9,192x128x17"
TEXT_TOKENS = 128


def random_decoder(tiny: bool, device: torch.device, dtype: torch.dtype, seed: int):
    config = VIDEO_VAE_CONFIG if tiny else FULL_SIZE_VIDEO_VAE_CONFIG
    with torch.device("meta"):
        decoder = VideoDecoderConfigurator.from_config({"vae": config})
    return materialize_random_(decoder, device, dtype, seed).eval()


def time_fit(tiny: bool, device: torch.device, dtype: torch.dtype, seed: int):
    """Milliseconds of the one-off fit (cold, as a rank first does it) and the fitted projection."""
    decoder = random_decoder(tiny, device, dtype, seed)
    fit_ms = time_calls(lambda: fit_latent_rgb(decoder, device, dtype), device, warmup=0, repeats=1)[0]
    return fit_ms, fit_latent_rgb(decoder, device, dtype)


def measure_size(model, factors, config: dict, size: tuple[int, int, int], device: torch.device, dtype: torch.dtype, args) -> list[str]:
    """One table row: a transformer pass and a preview at ``size`` (width, height, frames)."""
    width, height, frames = size
    geometry = StageGeometry(height, width, frames, 24.0)
    video, audio = random_transformer_inputs(geometry, geometry, TEXT_TOKENS, config["transformer"]["caption_channels"], 0.5, device, dtype, args.seed)
    tools = geometry.video_tools()
    state = tools.create_initial_state(device, dtype, torch.zeros(tools.target_shape.to_torch_shape(), device=device, dtype=dtype))
    log(f"{width}x{height}x{frames}: {video.latent.shape[1]} video tokens")
    with torch.inference_mode():
        video_x0, _ = model(video=video, audio=audio, perturbations=None)
        pass_ms = median(time_calls(lambda: model(video=video, audio=audio, perturbations=None), device, args.warmup, args.repeats))

        def preview():
            return factors.preview(state_to_comfy(replace(state, latent=video_x0), tools))

        strip = preview()
        preview_ms = median(time_calls(preview, device, args.warmup, max(args.repeats, 10)))
    return [
        f"{width}x{height}x{frames}", str(video.latent.shape[1]), f"{pass_ms:.1f}", f"{preview_ms:.2f}",
        f"{100 * preview_ms / pass_ms:.3f}%", "x".join(map(str, strip.shape)), f"{strip.numel() / 1e3:.1f}",
    ]  # fmt: skip


def measure(args) -> str:
    device = resolve_device(args.device)
    dtype = bench_dtype(device) if args.tiny else torch.bfloat16
    config = bench_config("2.0", tiny=args.tiny)
    sizes = [tuple(int(v) for v in size.split("x")) for size in (args.sizes or (TINY_SIZES if args.tiny else FULL_SIZES)).split(",")]

    log(f"building the random transformer ({'tiny' if args.tiny else '19B'}) and video decoder on {device}")
    model = random_transformer(config, device, dtype, args.seed)
    fit_ms, factors = time_fit(args.tiny, device, dtype, args.seed)
    rows = [measure_size(model, factors, config, size, device, dtype, args) + [f"{fit_ms:.0f}"] for size in sizes]
    headers = ["size (WxHxF)", "video tokens", "transformer pass ms", "preview ms", "preview / pass", "preview uint8", "KB to host", "one-off fit ms"]
    return markdown_table(headers, rows)


def main() -> None:
    parser = bench_parser(
        __doc__, tiny_help="2-layer transformer and the tiny bundle's decoder on the CPU at small sizes (smoke run)",
        warmup=2, repeats=5, unit="calls",
    )  # fmt: skip
    parser.add_argument("--sizes", help=f"WxHxF sizes, comma separated (default {FULL_SIZES}; --tiny {TINY_SIZES})")
    run_bench(parser, measure)


if __name__ == "__main__":
    main()
