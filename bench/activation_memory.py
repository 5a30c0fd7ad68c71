"""The transformer forward's activation memory per video token, against the planner's constant.

Every memory check of the fleet counts a forward's live activations as
``validation.ACTIVATION_WIDTHS_PER_TOKEN`` model widths per video token on the rank (the tokens of its
shard under SP). This bench measures that number: ltx-core's transformer at the real width of
``--version`` (seeded random weights, only ``--layers`` blocks: a block's activations do not depend on
how many follow) runs one forward at three video sizes on ``--sp`` ranks (torch.distributed over gloo;
on CUDA every rank on GPU 0, as ranks sharing a GPU run), and each rank reports its peak bytes above
what it held before the forward: on CUDA the allocator's ``max_memory_allocated``, on CPU the live
tensors that torch's ``MemTracker`` sees. "widths per token" is the growth from the row above, over the
growth of the rank's video tokens, in units of the video width's bytes (4096 x 2 in bf16 for the 22B),
over 384 to 1536 video tokens on the CPU and 3072 to 12288 on a GPU; the estimate column is
``validation.estimate_memory_bytes`` at the same size and SP degree.

    python bench/activation_memory.py --tiny                          # CPU smoke run, tiny widths
    python bench/activation_memory.py --device cpu --sp 1 2           # full width on CPU, 2 blocks
    python bench/activation_memory.py --device cuda --sp 1 2 4 --out docs/bench/activation-memory.md

Prints a markdown table on stdout only. It never loads checkpoints or downloads anything. A memory
bench: it gives no timings, and runs where ranks share one GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import emit, log, markdown_table, resolve_device  # noqa: I001 - _common puts the repository on sys.path first
from mgpu_backend.ltx.diagnostics import bench_config, context_widths, random_transformer, random_transformer_inputs
from mgpu_backend.ltx.latents import StageGeometry
from mgpu_backend.ltx.validation import ACTIVATION_WIDTHS_PER_TOKEN, TransformerDims, estimate_memory_bytes

SIGMA = 0.9
TEXT_TOKENS = {"full": 1024, "tiny": 64}
# (height, width, frames): 121 frames as the jobs have them (126 audio tokens in every row, so only the
# video grows from row to row). On the CPU 384, 768 and 1536 video tokens, small enough for it at full
# width; on a GPU 3072, 6144 and 12288, the shards stage 2 gives a rank at 1280x704 to 1536x1024, where
# the allocator's rounding is small against the growth.
SIZES = {"cpu": [(128, 192, 121), (192, 256, 121), (256, 384, 121)], "cuda": [(384, 512, 121), (512, 768, 121), (768, 1024, 121)]}
FRAME_RATE = 24.0


def _forward_peak_bytes(model, video, audio, device: torch.device) -> int:
    """Bytes above what the process held before one forward, at the forward's peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        with torch.inference_mode():
            model(video=video, audio=audio, perturbations=None)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, *(tensor for modality in (video, audio) for tensor in vars(modality).values() if isinstance(tensor, torch.Tensor)))
    with torch.no_grad(), tracker:  # MemTracker follows tensors through autograd's dispatch: no inference mode
        before = tracker.get_tracker_snapshot()[device]["Total"]
        model(video=video, audio=audio, perturbations=None)
    return tracker.get_tracker_snapshot("peak")[device]["Total"] - before


def measure_rank(config: dict, sizes: list, text_tokens: int, device: torch.device, dtype: torch.dtype, seed: int) -> list[int]:
    """This rank's forward peak above its resting bytes at each size, SP over the whole world when above 1."""
    from mgpu_backend.parallel.comm import Comm
    from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel

    model = random_transformer(config, device, dtype, seed)
    if dist.is_initialized() and dist.get_world_size() > 1:
        apply_sequence_parallel(model, Comm.world())
    peaks = []
    for height, width, frames in sizes:
        geometry = StageGeometry(height, width, frames, FRAME_RATE)
        video, audio = random_transformer_inputs(geometry, geometry, text_tokens, context_widths(config["transformer"]), SIGMA,
                                                 device, dtype, seed + 1, draw_on_cpu=True)  # fmt: skip
        peaks.append(_forward_peak_bytes(model, video, audio, device))
    return peaks


def _rank_main(rank: int, world: int, store_path: str, job: tuple, results) -> None:
    config, sizes, text_tokens, device_name, dtype, seed = job
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        results.put((rank, measure_rank(config, sizes, text_tokens, device, dtype, seed)))
    except BaseException as error:  # noqa: BLE001 - handed to the parent, which says which rank failed
        results.put((rank, f"{type(error).__name__}: {error}"))
    finally:
        dist.destroy_process_group()


def peaks_on_ranks(world: int, job: tuple) -> list[list[int]]:
    """``measure_rank`` on ``world`` spawned gloo ranks; each rank's peaks, in rank order."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        processes = [context.Process(target=_rank_main, args=(rank, world, store, job, results)) for rank in range(world)]
        for process in processes:
            process.start()
        answers = dict(results.get() for _ in processes)
        for process in processes:
            process.join()
    failed = {rank: answer for rank, answer in answers.items() if isinstance(answer, str)}
    if failed:
        raise SystemExit(f"SP degree {world}: " + "; ".join(f"rank {rank} failed: {why}" for rank, why in sorted(failed.items())))
    return [answers[rank] for rank in range(world)]


def measure(args: argparse.Namespace) -> str:
    device = resolve_device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    scale = "tiny" if args.tiny else "full"
    config = bench_config(args.version, tiny=args.tiny)
    config["transformer"]["num_layers"] = args.layers
    dims = TransformerDims.from_config(config["transformer"], parameter_count=0)
    width_bytes = dims.video_dim * torch.empty((), dtype=dtype).element_size()
    sizes = SIZES[device.type]
    job = (config, sizes, TEXT_TOKENS[scale], str(device), dtype, args.seed)
    rows = []
    for degree in args.sp:
        log(f"SP degree {degree}: {len(sizes)} forwards of {args.layers} block(s) at width {dims.video_dim} on {device} ...")
        peaks = [max(column) for column in zip(*peaks_on_ranks(degree, job))]
        previous = None
        for (height, width, frames), peak in zip(sizes, peaks):
            estimate = estimate_memory_bytes(height, width, frames, FRAME_RATE, dims, dtype, degree, TEXT_TOKENS[scale])
            local = -(-estimate.video_tokens // degree)
            slope = "" if previous is None else f"{(peak - previous[1]) / (local - previous[0]) / width_bytes:.1f}"
            rows.append([degree, f"{width}x{height}x{frames}", estimate.video_tokens, local, f"{peak / 2**20:.1f}",
                         f"{estimate.activation_bytes / 2**20:.1f}", slope])  # fmt: skip
            previous = (local, peak)
    headers = ["SP degree", "WxHxF", "video tokens", "tokens per rank", "peak MiB (max over ranks)", "estimate MiB",
               f"widths per token (estimate: {ACTIVATION_WIDTHS_PER_TOKEN})"]  # fmt: skip
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny widths in float32 on the CPU (a smoke run)")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    parser.add_argument("--version", choices=("2.0", "2.3"), default="2.3", help="the model whose widths to use (default 2.3)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks to build (default 2)")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2], help="SP degrees, one rank each (default 1 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    parser.add_argument("--out", help="also write the table, under a command/machine/date line, to this file")
    args = parser.parse_args()
    if args.layers < 1 or any(degree < 1 for degree in args.sp):
        parser.error("--layers and every --sp degree must be at least 1")
    if args.tiny and args.device is None:
        args.device = "cpu"
    emit(measure(args), resolve_device(args.device), args.out)


if __name__ == "__main__":
    sys.exit(main())
