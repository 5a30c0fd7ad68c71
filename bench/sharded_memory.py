"""Per-rank memory of the weight-sharded transformer at full size, on ranks sharing one GPU.

What it measures: N ranks (gloo, all on one GPU: ``MGPU_SHARED_GPU_RANKS``'s layout), each capped
with ``torch.cuda.set_per_process_memory_fraction`` to stand for a consumer GPU of ``--cap-gib``,
hold the full-size transformer (all blocks, random weights) sharded over the ranks and run one
forward at each stage's size of the two-stage and distilled recipes (stage 1 at half the
resolution, stage 2 at the full one: both recipes run these shapes) under SP over all the ranks.
Each rank's peak (``max_memory_allocated``) is set beside the planner's estimate for that stage:
``ComponentSizes.sharded_transformer`` (its shard, two gathered blocks, the weights outside the
blocks) + ``validation.estimate_memory_bytes`` activations at the SP degree. The table also says
what the residency planner decides for the whole job (Gemma, VAEs and all) on such GPUs, including
the refusals and what they name.

The model is built on the meta device, sharded there, and only each rank's shard is materialised
(``to_empty`` + random fill), so no rank ever holds the whole transformer. This is a memory
measurement: ranks sharing one GPU give no speed figures, and none are printed.

    python bench/sharded_memory.py --version 2.3 --ranks 2 4 --cap-gib 24 32
    python bench/sharded_memory.py --tiny          # CPU smoke run of the code path (2 blocks, tiny widths)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import log, markdown_table, provenance  # noqa: E402
from mgpu_backend.bundles import full_size  # noqa: E402
from mgpu_backend.ltx.diagnostics import bench_config, context_widths, random_transformer_inputs  # noqa: E402
from mgpu_backend.ltx.residency import GIB, ResidencyError, plan_residency, sizes_from_headers  # noqa: E402

TEXT_TOKENS = 1024


def _sizes(config: dict):
    """The planner's component sizes of the full-size bundle of this transformer configuration (headers only)."""
    bundle = full_size.full_size_config(config["transformer"], gemma_layers=full_size.GEMMA_FULL_LAYERS)
    headers = {name: {key: ("BF16", shape) for key, shape in shapes.items()} for name, shapes in full_size.planned_shapes(bundle).items()}
    gemma = next(tensors for name, tensors in headers.items() if name.startswith(full_size.GEMMA_DIR_NAME))
    return sizes_from_headers(headers[full_size.CHECKPOINT_NAME], headers[full_size.SPATIAL_UPSAMPLER_NAME], gemma)


def _sharded_random_transformer(config: dict, comm, device: torch.device, seed: int):
    from ltx_core.model.transformer import LTXModelConfigurator, X0Model

    from mgpu_backend.bundles.random_weights import fill_random_, weight_rule
    from mgpu_backend.parallel.weight_sharding import apply_weight_sharding

    with torch.device("meta"):
        velocity = LTXModelConfigurator.from_config(config).to(torch.bfloat16)
    model = X0Model(velocity).eval()
    apply_weight_sharding(model, comm, device)
    velocity.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed + comm.rank)
    with torch.no_grad():
        for name, tensor in (*velocity.named_parameters(), *velocity.named_buffers()):
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.is_floating_point():
                fill_random_(local, weight_rule(name, tuple(tensor.shape)), generator, fan_in=math.prod(tensor.shape[1:]) or None)
    return model


def _rank(rank: int, world: int, store: str, config: dict, cap_gib: float, sizes: list, results) -> None:
    from mgpu_backend.ltx.latents import StageGeometry
    from mgpu_backend.parallel.comm import Comm
    from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel

    try:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / torch.cuda.get_device_properties(device).total_memory), device)
        # A rank that runs out of memory leaves the others waiting in a collective: they give up after this.
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=timedelta(seconds=120))
        comm = Comm.world()
        model = _sharded_random_transformer(config, comm, device, seed=11)
        apply_sequence_parallel(model, comm)
        held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        rows = []
        for width, height, frames in sizes:
            geometry = StageGeometry(height=height, width=width, num_frames=frames, frame_rate=24.0)
            video, audio = random_transformer_inputs(geometry, geometry, TEXT_TOKENS, context_widths(config["transformer"]), 0.7, device, torch.bfloat16, seed=3, draw_on_cpu=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            status = "ran"
            try:
                with torch.inference_mode():
                    out = model(video=video, audio=audio, perturbations=None)
                    status = "ran" if bool(torch.isfinite(out[0]).all()) else "ran (non-finite)"
            except torch.OutOfMemoryError:
                status = "out of memory"
            except RuntimeError as error:  # a peer ran out: its collective never came
                status = f"stopped ({type(error).__name__}: a peer failed)"
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            rows.append((width, height, frames, int(video.latent.shape[1]), peak, status))
            del video, audio
            if status.startswith(("out of memory", "stopped")):  # out of step with the others' gathers: stop here
                break
        results.put((rank, "ok", {"held": held, "rows": rows}))
    except BaseException:  # noqa: BLE001 - handed to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(config: dict, world: int, cap_gib: float, sizes: list) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(rank, world, os.path.join(tmp, "store"), config, cap_gib, sizes, results)) for rank in range(world)]
        for proc in procs:
            proc.start()
        collected = {}
        for _ in range(world):
            rank, status, value = results.get()
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
        for proc in procs:
            proc.join(120)
    return [collected[rank] for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="2.3", choices=["2.0", "2.3"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cap-gib", type=float, nargs="+", default=[24.0, 32.0])
    parser.add_argument("--targets", nargs="+", default=["1536x1024", "1280x704"], help="the recipes' output sizes WxH (stage 1 runs half of each)")
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--full-size-only", action="store_true", help="only the stage-2 forwards (they set the peak: stage 1 runs half the size)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: 2 blocks at tiny widths, tiny sizes")
    parser.add_argument("--out", help="also append the table to this file")
    args = parser.parse_args()
    from mgpu_backend.ltx.validation import TransformerDims, estimate_memory_bytes

    config = bench_config(args.version, tiny=args.tiny)
    sizes = _sizes(bench_config(args.version))
    targets = [tuple(int(v) for v in target.split("x")) for target in (["192x128"] if args.tiny else args.targets)]
    frames = 9 if args.tiny else args.frames
    # Smallest first: a rank that runs out of memory ends the run.
    shapes = [] if args.full_size_only else [(w // 2, h // 2, frames) for w, h in targets]
    shapes = sorted(shapes + [(w, h, frames) for w, h in targets], key=lambda shape: shape[0] * shape[1])
    dims = TransformerDims.from_config(config["transformer"], 0)
    rows = []
    for world in args.ranks:
        for cap in args.cap_gib:
            log(f"{world} ranks capped at {cap} GiB")
            per_rank = measure(config, world, cap, shapes)
            for index, (width, height, frames_, tokens, _, _) in enumerate(max((rank["rows"] for rank in per_rank), key=len)):
                peaks = [rank["rows"][index][4] for rank in per_rank if index < len(rank["rows"])]
                statuses = {rank["rows"][index][5] for rank in per_rank if index < len(rank["rows"])}
                activations = estimate_memory_bytes(height, width, frames_, dims=dims, sp_degree=world, text_tokens=TEXT_TOKENS).activation_bytes
                estimate = sizes.sharded_transformer(None, world) + activations
                peak = max(peaks)
                try:
                    plan = plan_residency(sizes, int(cap * GIB), world, "auto")
                    decision = f"{plan.policy}, sharded over {plan.sharded_over}, peak {plan.peak_bytes / GIB:.1f} GiB"
                except ResidencyError as refused:
                    decision = "refused: " + str(refused).split("; ", 1)[-1]
                rows.append([str(world), f"{cap:g}", f"{width}x{height}x{frames_}", str(tokens), ", ".join(sorted(statuses)),
                             f"{peak / GIB:.2f}", f"{estimate / GIB:.2f}", f"{(estimate - peak) / max(peak, 1) * 100:+.0f}%", decision])  # fmt: skip
    table = markdown_table(["ranks", "cap GiB", "forward WxHxF", "video tokens", "status", "peak GiB (max rank)", "estimate GiB", "estimate vs peak", "planner for the whole job (bf16)"], rows)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print(table)
    if args.out:
        with open(args.out, "a") as out:
            out.write(provenance(device) + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
