"""Video VAE decode at stage-2 size: single-rank tiled decode vs our distributed decoder at world 1,
and the shared-memory handoff of the decoded frames.

The full-size run decodes a 1536x1024, 121-frame video (latent [1, 128, 16, 32, 48]) with the LTX-2
video VAE decoder's dimensions (FULL_SIZE_VIDEO_VAE_CONFIG below; docs/full-size-config.md says
where each number comes from) and seeded random weights made on the GPU in bf16, tiled with
``TilingConfig.default()`` as the official pipeline decodes. Rows:

- ltx-core's ``tiled_decode`` through ``mgpu_backend.ltx.decode.decode_video`` (frames stay on the GPU);
- ``distributed_decode_images`` with a single-rank Comm, frames into host memory: the cost of our
  decoder's own assembly compared with ltx-core's loop (same tiles, same noise, equal result);
- the same, writing the frames straight into a shared-memory segment (``shm.create_tensor``), as a
  fleet's rank 0 hands results to ComfyUI;
- the handoff on its own: copying host frames into a new segment, then ``shm.read_tensor`` and
  touching every page, as the client does.

    python bench/decode.py --tiny                            # CPU smoke run: tiny decoder, small latent
    python bench/decode.py --device cuda --out docs/bench/decode-h200.md

Prints a markdown table on stdout only. It must never load checkpoints or download anything.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

from _common import (  # noqa: I001 - _common puts the repository on sys.path first
    bench_parser,
    run_bench,
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
from ltx_core.model.video_vae import TilingConfig, VideoDecoder, VideoDecoderConfigurator
from ltx_core.model.video_vae.tiling import SpatialTilingConfig, TemporalTilingConfig

from mgpu_backend.fleet import shm
from mgpu_backend.bundles.full_size import FULL_SIZE_VIDEO_VAE_CONFIG  # one full-size VAE config, with its sources
from mgpu_backend.ltx.decode import decode_video
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.distributed_decode import decoded_images_shape, distributed_decode_images

@dataclass(frozen=True)
class BenchSetup:
    latent_shape: tuple[int, int, int, int, int]
    vae_config: dict
    tiling: TilingConfig


FULL_SIZE = BenchSetup(
    latent_shape=(1, 128, 16, 32, 48), vae_config=FULL_SIZE_VIDEO_VAE_CONFIG, tiling=TilingConfig.default()
)


def tiny_setup() -> BenchSetup:
    from mgpu_backend.bundles.tiny import VIDEO_VAE_CONFIG

    # The smallest tiles ltx-core allows (128 px with 32 px overlap, 16 frames with 8 overlap) on a
    # 3 x 6 x 6 latent: 2 x 2 spatial tiles in 2 temporal groups, so every code path of the full size
    # runs (TilingConfig.default() would need a latent above 16 x 16 cells, too slow on a shared CPU).
    tiling = TilingConfig(
        spatial_config=SpatialTilingConfig(tile_size_in_pixels=128, tile_overlap_in_pixels=32),
        temporal_config=TemporalTilingConfig(tile_size_in_frames=16, tile_overlap_in_frames=8),
    )
    return BenchSetup(latent_shape=(1, 128, 3, 6, 6), vae_config=VIDEO_VAE_CONFIG, tiling=tiling)


class _ResidentDecoder:
    """What ``decode_video`` needs of a model loader, holding an already built decoder."""

    def __init__(self, decoder: VideoDecoder, device: torch.device, dtype: torch.dtype) -> None:
        self._decoder, self.device, self.dtype = decoder, device, dtype

    def video_decoder(self) -> VideoDecoder:
        return self._decoder


def shm_free_bytes() -> int:
    if not shm.available():
        return 0
    stats = os.statvfs(shm.SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def measure(args: argparse.Namespace) -> str:
    device, dtype = bench_device(args.device, args.tiny, "the full-size decode")
    setup = tiny_setup() if args.tiny else FULL_SIZE
    tiling = setup.tiling

    with torch.device("meta"):
        decoder = VideoDecoderConfigurator.from_config({"vae": setup.vae_config})
    decoder = materialize_random_(decoder, device, dtype, args.seed)
    parameters = sum(p.numel() for p in decoder.parameters())
    log(f"video decoder: {parameters / 1e6:.1f}M parameters in {dtype} on {device}")

    latent_generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    latent = torch.randn(setup.latent_shape, generator=latent_generator, device=device, dtype=dtype)
    image_shape = decoded_images_shape(decoder, latent.shape)
    frames = image_shape[0]
    image_bytes = torch.Size(image_shape).numel() * 4
    log(
        f"latent {list(latent.shape)} -> IMAGE {list(image_shape)} float32 ({image_bytes / 1e9:.2f} GB), "
        f"{len(decoder._prepare_tiles(latent, tiling))} tiles"
    )
    loader = _ResidentDecoder(decoder, device, dtype)

    def noise() -> torch.Generator:
        # The decoder adds seeded noise per tile; the same seed in every path makes results comparable.
        return torch.Generator(device=device).manual_seed(args.seed + 2)

    rows = []
    results: dict[str, torch.Tensor] = {}

    def decode_row(name: str, call, keep: str | None = None) -> None:
        reset_peak_memory(device)
        with torch.inference_mode():
            milliseconds = time_calls(call, device, warmup=args.warmup, repeats=args.repeats)
        seconds = median(milliseconds) / 1e3
        rows.append([name, f"{seconds:.2f}", f"{frames / seconds:.1f}", "-", peak_memory_text(device)])
        log(f"{name}: {seconds:.2f} s (median of {args.repeats})")

    def tiled_decode_call():
        results["tiled_decode"] = decode_video(loader, latent, tiling, generator=noise())

    def distributed_call():
        results["distributed"] = distributed_decode_images(decoder, latent, tiling, Comm(None), generator=noise())

    def tiled_decode_to_host_call():
        decode_video(loader, latent, tiling, generator=noise()).cpu()

    decode_row("ltx-core tiled_decode (mgpu_backend.ltx.decode.decode_video), frames left on the decode device", tiled_decode_call)
    decode_row("ltx-core tiled_decode, then the IMAGE frames copied to host memory (what a ComfyUI node needs)", tiled_decode_to_host_call)
    decode_row("distributed_decode_images, world 1, frames into host memory", distributed_call)
    reference = results.pop("tiled_decode").cpu()
    difference = (results["distributed"] - reference).abs().max().item()
    del reference
    log(f"distributed decode vs tiled_decode: max abs difference {difference:.3g}")
    rows[-1][0] += f" (max abs diff vs tiled_decode {difference:.3g})"

    free = shm_free_bytes()
    if free < 1.1 * image_bytes:
        skipped = f"skipped: /dev/shm has {free / 1e9:.2f} GB free, needs {image_bytes / 1e9:.2f} GB"
        for name in ("distributed_decode_images into shared memory", "shared-memory write", "shared-memory read"):
            rows.append([f"{name} ({skipped})", "-", "-", "-", "-"])
        log(skipped)
        return _table(rows)

    def distributed_into_shm_call():
        out, descriptor = shm.create_tensor("frames", image_shape, torch.float32)
        try:
            distributed_decode_images(decoder, latent, tiling, Comm(None), generator=noise(), out=out)
        finally:
            del out
            shm.unlink_segment(descriptor["segment"])

    decode_row("distributed_decode_images, world 1, frames into shared memory (out=shm.create_tensor)", distributed_into_shm_call)

    host_frames = results.pop("distributed")
    write_seconds, read_seconds = [], []
    for _ in range(args.warmup + args.repeats):
        started = time.perf_counter()
        target, descriptor = shm.create_tensor("frames", image_shape, torch.float32)
        target.copy_(host_frames)
        write_seconds.append(time.perf_counter() - started)
        del target
        started = time.perf_counter()
        received = shm.read_tensor(descriptor)  # maps and unlinks the segment, as the client does
        checksum = float(received.view(-1)[:: 4096 // 4].sum())  # one float per 4 KiB page: every page
        read_seconds.append(time.perf_counter() - started)
        if not torch.equal(received, host_frames):
            raise RuntimeError("frames read back from shared memory differ from the frames written")
        del received, checksum
    for name, seconds_list in (
        ("shared-memory write: host frames -> new segment (create_tensor + copy)", write_seconds),
        ("shared-memory read: read_tensor + touch every page", read_seconds),
    ):
        seconds = median(seconds_list[args.warmup :])
        rows.append(
            [name, f"{seconds:.3f}", f"{frames / seconds:.0f}", f"{image_bytes / seconds / 1e9:.2f}", "-"]
        )
        log(f"{name}: {image_bytes / seconds / 1e9:.2f} GB/s")
    synchronize(device)
    return _table(rows)


def _table(rows: list[list[str]]) -> str:
    return markdown_table(["path", "seconds", "frames/s", "GB/s", "peak GPU memory"], rows)


def main() -> None:
    parser = bench_parser(__doc__, tiny_help="the tiny bundle's decoder and a small latent (CPU smoke run)", warmup=1, repeats=3, unit="runs per path", seed_help="seed of the random weights, latent and decoder noise")
    run_bench(parser, measure)


if __name__ == "__main__":
    main()
