"""The drop-in MODEL's cost: ComfyUI's own LTX model in-process against the same model on the fleet at world 1.

What a ComfyUI user with the drop-in loader (*Load Checkpoint (MGPU fleet)*) pays per denoiser call
for the model living in another process: the call's inputs packed and sent over the private socket
(shared memory for the latents), ComfyUI's own ``LTXAVModel`` run in the rank (imported from the same
ComfyUI checkout, loaded by ComfyUI's own loader from the same file), the output sent back. Both
sides are timed through ``BaseModel.apply_model``, what ComfyUI's samplers call, on identical inputs
(``comfy_native``'s: the fleet's seeded noise, seeded contexts, frame rate 24), and their outputs
compared (at one rank the fleet computes exactly what ComfyUI does; ``max |diff|`` says whether it did).

Sizes: ComfyUI's LTX-2.3 template (image to video, cfg 1 with the distilled LoRA) renders 1280x720,
121 frames: stage 1 at half size, 640x352 after ComfyUI's rounding to 32 (3520 video tokens), stage 2 at
1280x704 (14080 tokens). ``--shards`` adds the eager forward of one rank's token shard at SP degree
2/4/8 (the latent cut to 1/N of its frames: the same tokens per rank, no exchange), and with
``--capture`` the same with the transformer blocks replayed as a CUDA graph (``captured_blocks``, the fleet's default on
GPU ranks), to show how much of a short shard is launch overhead.

    python bench/comfy_drop_in.py --comfyui-dir ~/ComfyUI --model 2.3 --bundle-dir /data/b22 --shards --capture --out FILE   # one GPU
    python bench/comfy_drop_in.py --comfyui-dir ~/ComfyUI --model 2.3 --bundle-dir /data/b22 --gpus 0,1,2,3,4,5,6,7 --out FILE   # SP over 8 GPUs
    python bench/comfy_drop_in.py --comfyui-dir ~/ComfyUI --tiny                                                            # CPU smoke run

It prints one markdown table and notes (``--out``: appended under the command, machine and date).
"""

from __future__ import annotations  # noqa: I001 - one-line imports, _common first: it puts the repository on sys.path

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from _common import append_out, log, markdown_table, median, synchronize
from comfy_native import TINY_SIZES, ComfyNative, bundle_config, checkpoint_transformer_config, import_comfy, make_inputs, parse_sizes
from e2e import check_space
from mgpu_backend.bundles import full_size
from mgpu_backend.comfy_model.captured_blocks import capture_blocks
from mgpu_backend.ltx import api

TEMPLATE_SIZES = "640x352x121,1280x704x121"  # the LTX-2.3 template's stage 1 and stage 2 at 1280x720, rounded to 32 as ComfyUI does
SHARD_DEGREES = (2, 4, 8)


def time_call(call, device: torch.device, warmup: int, repeats: int) -> list[float]:
    times = []
    for index in range(warmup + repeats):
        synchronize(device)
        started = time.perf_counter()
        call()
        synchronize(device)
        if index >= warmup:
            times.append((time.perf_counter() - started) * 1e3)
    return times


def largest_difference(comfy, reference, other, shapes) -> float:
    pairs = zip(comfy.utils.unpack_latents(reference, shapes), comfy.utils.unpack_latents(other, shapes))
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def captured_columns(comfy, native, diffusion_model, inputs, device: torch.device, args) -> list[str]:
    """[captured ms, max |diff| against eager] of ComfyUI's forward with its blocks replayed as a CUDA
    graph (the fleet's default on GPU ranks, ``captured_blocks``)."""
    call, shapes = native.forward_call(inputs, inputs.forward_sigma)
    eager_out = call()
    wrapper = capture_blocks(diffusion_model, None)
    try:
        captured_out = call()
        if wrapper.replays == 0:
            return ["eager (capture failed)", "-"]
        captured_ms = median(time_call(call, device, args.warmup, args.repeats))
        return [f"{captured_ms:.1f}", f"{largest_difference(comfy, eager_out, captured_out, shapes):.3g}"]
    finally:
        wrapper.remove()


def shard_inputs(inputs, degree: int):
    """``inputs`` with 1/``degree`` of the latent frames: one rank's share of the video tokens at SP ``degree``."""
    frames = inputs.video_noise.shape[2]
    if frames % degree:
        return None
    return replace(inputs, video_noise=inputs.video_noise[:, :, : frames // degree].contiguous())


def fleet_patcher(comfy, comfyui_dir: str, checkpoint: str):
    from mgpu_backend.comfy_model.remote import FleetModelSpec, load_fleet_model

    patcher = load_fleet_model(FleetModelSpec(str(Path(comfyui_dir).resolve()), str(Path(checkpoint).resolve())))
    comfy.model_management.load_models_gpu([patcher], force_full_load=True)
    return patcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui-dir", required=True, help="a ComfyUI checkout with LTX-2.3 (v0.20.1 or later); both sides import it")
    parser.add_argument("--model", choices=("2.0", "2.3"), default="2.3", help="the random bundle's layout: 2.3 (22B, default) or 2.0 (19B)")
    parser.add_argument("--bundle-dir", help="the random bundle both sides load (written if missing; default: a temporary folder)")
    parser.add_argument("--gemma-dir", help="write the bundle's random Gemma folder here instead (e.g. /dev/shm: neither side reads it)")
    parser.add_argument("--sizes", default=TEMPLATE_SIZES, help=f"WxHxF sizes (default {TEMPLATE_SIZES}: the template's two stages)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls per side and size (default 2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per side and size; the median is reported (default 7)")
    parser.add_argument("--shards", action="store_true", help="also one rank's token shard at SP degree 2/4/8, eager (ComfyUI's forward)")
    parser.add_argument("--capture", action="store_true", help="with --shards: also each shard replayed as a CUDA graph (GPU)")
    parser.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available; cpu with --tiny)")
    parser.add_argument("--gpus", help="the fleet's GPUs, e.g. 0,1,2,3 (default: the one of --device): with several, each call is "
                                       "sequence parallel over them, against ComfyUI in-process on one")
    parser.add_argument("--tiny", action="store_true", help="the tiny bundle on the CPU at small sizes, one CPU rank (the smoke run)")
    parser.add_argument("--out", help="append the table, with command, machine and date, to this file")
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.tiny:
        args.device = args.device or "cpu"
        if args.sizes == TEMPLATE_SIZES:
            args.sizes = TINY_SIZES
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {args.device} asked for, but torch sees no CUDA device; use --tiny on the CPU")
    if args.capture and device.type != "cuda":
        parser.error("--capture replays CUDA graphs: it needs a GPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    comfy = import_comfy(args.comfyui_dir, device)
    rows, notes = [], []
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        bundle_dir = args.bundle_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-drop-in-"))
        config = bundle_config(args.model, args.tiny)
        planned = sum(size for name, size in full_size.planned_bytes(config).items() if not (args.gemma_dir and name.startswith("gemma")))
        Path(bundle_dir).mkdir(parents=True, exist_ok=True)
        if not full_size.is_complete(bundle_dir, config, device, 0):
            check_space(Path(bundle_dir), planned + (1 << 30), "the random bundle", "point --bundle-dir at a larger disk")
        log(f"random bundle: {planned / 1e9:.2f} GB in {bundle_dir} ...")
        bundle = full_size.write_bundle(bundle_dir, config, device, 0, log=log, gemma_dir=args.gemma_dir)
        gc.collect()
        transformer_config = checkpoint_transformer_config(bundle.checkpoint_path)
        inputs_per_size = [make_inputs(size, transformer_config, 2, device, dtype) for size in parse_sizes(args.sizes)]

        socket_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-drop-in-fleet-"))
        os.chmod(socket_dir, 0o700)
        gpus = (args.gpus or str(device.index or 0)) if device.type == "cuda" else None
        api.configure(address=os.path.join(socket_dir, "fleet.sock"), gpus=gpus, cpu_ranks=None if gpus else 1)
        stack.callback(lambda: api.fleet().shutdown())

        log("ComfyUI in-process: comfy.sd.load_checkpoint_guess_config ...")
        native = ComfyNative(comfy, bundle.checkpoint_path, device)
        notes.append(f"- in-process: {native.description}")
        started = time.perf_counter()
        remote = fleet_patcher(comfy, args.comfyui_dir, bundle.checkpoint_path)
        where = f"GPUs {gpus}" if gpus and "," in gpus else str(device)
        notes.append(f"- fleet: {len(gpus.split(',')) if gpus else 1} rank(s) on {where}, ComfyUI's own model loaded there in "
                     f"{time.perf_counter() - started:.1f} s (cold)")
        diffusion_model = native.patcher.model.diffusion_model
        for inputs in inputs_per_size:
            native_call, shapes = native.forward_call(inputs, inputs.forward_sigma)
            fleet_call, _ = ComfyNative.wrapping(comfy, remote, device, "the fleet").forward_call(inputs, inputs.forward_sigma)
            reference, remote_out = native_call(), fleet_call()
            diff = largest_difference(comfy, reference, remote_out, shapes)
            log(f"{inputs.size}: timing ComfyUI in-process and the fleet ...")
            native_ms = median(time_call(native_call, device, args.warmup, args.repeats))
            rank_ms: list[float] = []
            parts: dict[str, list[float]] = {}

            def timed_fleet_call(call=fleet_call):
                out = call()
                rank_ms.append(max(remote.fleet_link.last_rank_seconds) * 1e3)
                for part, seconds in remote.fleet_link.last_timing.items():
                    parts.setdefault(part, []).append(seconds * 1e3)
                return out

            fleet_ms = median(time_call(timed_fleet_call, device, args.warmup, args.repeats))
            rank_ms = rank_ms[args.warmup:]
            notes.append(f"- the fleet's call at {inputs.video_tokens} tokens in its parts (median ms): "
                         + ", ".join(f"{part} {median(times[args.warmup:]):.2f}" for part, times in parts.items()))
            notes.append(f"- fleet at {inputs.video_tokens} tokens: the rank ran its blocks as {remote.fleet_link.last_blocks or 'unknown'}")
            row = [f"{inputs.size[0]}x{inputs.size[1]}x{inputs.size[2]}", str(inputs.video_tokens), "whole", f"{native_ms:.1f}", f"{fleet_ms:.1f}",
                   f"{(fleet_ms / native_ms - 1) * 100:+.1f}%", f"{median(rank_ms):.1f}", f"{fleet_ms - median(rank_ms):.1f}", f"{diff:.3g}"]
            rows.append(row + captured_columns(comfy, native, diffusion_model, inputs, device, args) if args.capture else row + ["-", "-"])
            if not args.shards:
                continue
            for degree in SHARD_DEGREES:
                shard = shard_inputs(inputs, degree)
                if shard is None:
                    continue
                call, _ = native.forward_call(shard, shard.forward_sigma)
                eager_ms = median(time_call(call, device, args.warmup, args.repeats))
                row = ["", str(shard.video_tokens), f"shard of SP {degree}", f"{eager_ms:.1f}", "-", "-", "-", "-", "-"]
                rows.append(row + captured_columns(comfy, native, diffusion_model, shard, device, args) if args.capture else row + ["-", "-"])
        native.free()
    world = len(args.gpus.split(",")) if args.gpus and device.type == "cuda" else 1
    headers = ["size", "video tokens", "forward", "ComfyUI eager ms", f"fleet world {world} ms", "overhead", "rank's forward ms", "the call around it ms",
               "max |diff| fleet", "ComfyUI blocks captured ms", "max |diff| captured"]
    notes.insert(0, f"- LTX-{args.model} random bundle ({'tiny' if args.tiny else 'full size'}), {str(dtype).removeprefix('torch.')}; one video+audio "
                    f"denoiser call (apply_model) at sigma {inputs_per_size[0].forward_sigma:g}, positive context, median of {args.repeats}; overhead: the "
                    "fleet's call against the in-process one (the fleet replays its blocks as CUDA graphs unless MGPU_COMFY_CUDA_GRAPHS=0); rank's forward: the slowest rank's "
                    "time inside ComfyUI's forward (median), the call around it: the fleet's call less that (packing, the socket, copies to and from the "
                    "device); each call gets a new context tensor with the same values, as ComfyUI's sampler makes one every step; shard rows: ComfyUI's forward "
                    "on 1/N of the frames (one rank's tokens, no exchange); captured: the same in-process forward with its transformer blocks replayed as a CUDA graph")
    text = markdown_table(headers, rows) + "\n\n" + "\n".join(notes)
    print(text, flush=True)
    if args.out:
        append_out(text, device, args.out)


if __name__ == "__main__":
    main()
