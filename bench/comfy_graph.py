"""ComfyUI's own LTX-2 text-to-video graph, whole, through its HTTP API, against the fleet's whole job.

What a ComfyUI user of LTX-2.0 runs is the ``video_ltx2_t2v`` template of ComfyUI's workflow templates
(package ``comfyui-workflow-templates``, January 2026, and still in 0.9.73, ComfyUI v0.20.1's): its
subgraph "Text to Video (LTX 2.0)". The graph runs on ComfyUI v0.20.1 (its text encoder loader's
``device`` input included); ``bench/comfy_template.py`` does the same for LTX-2.3's template with the
fleet's drop-in MODEL instead of the fleet's own job.
``template_graph`` writes that subgraph in ComfyUI's API format with its own nodes and settings
(stage 1 at half size: ``LTXVScheduler`` 20 steps, ``CFGGuider`` cfg 4, ``euler_ancestral``; the
distilled LoRA, ``LTXVLatentUpsampler``, stage 2 over ``ManualSigmas`` 0.909375, 0.725, 0.421875, 0
at cfg 1; ``VAEDecodeTiled`` 512/64/4096/8, ``LTXVAudioVAEDecode``, ``CreateVideo``, ``SaveVideo``), the
template's bypassed camera LoRAs left out, the final size, frames, frame rate and steps from the
command line (default: the official 1536x1024x121 at 24 fps). This bench:

1. writes one random full-size bundle (``mgpu_backend.bundles.full_size``, the released 48-layer
   Gemma-3 12B: ComfyUI's LTX-2 text encoder takes nothing else) and converts its Gemma folder to
   the single file ComfyUI's ``LTXAVTextEncoderLoader`` reads (``gemma_file.gemma_folder_to_comfy_file``);
2. starts ComfyUI from ``--comfyui-dir`` on a private port with those files in its model folders
   (``--base-directory``; ComfyUI's own memory defaults unless ``--comfyui-args`` says otherwise),
   queues the graph, and times each node from ComfyUI's websocket events (``executing``, ``progress``):
   loaders, text encode, stage 1, upsample, stage 2, decode and save; then again with another seed
   and prompt, so every node but the loaders runs on the warm ComfyUI;
3. runs the fleet's whole job on the same files (``bench/e2e.py``'s ``run_fleet``: load, encode,
   sample, upscale, decode; cold, then warm) with the template's settings: the same size and steps,
   cfg 4 on video and audio and no other guidance, the same stage-2 sigmas, one tile.

It prints one table: per stage, ComfyUI cold and warm against the fleet cold and warm, with the
per-step medians. The two are not compared for their outputs: ComfyUI samples with
``euler_ancestral`` and its own noise, and its stage 2 re-denoises the audio, which the fleet's
two-stage recipe keeps from stage 1 by design; the step counts and passes are the same.

``--tiny`` is the check that needs no GPU: the tiny bundle in ComfyUI's folders, ComfyUI on the CPU,
the same graph queued. ComfyUI accepts it (every node, input and file name valid) and runs it until
its text encoder, which is built for the released Gemma-3 12B only and refuses the tiny one; the
bench prints where it stopped and exits 0 when that is the text encoder.

    python bench/comfy_graph.py --comfyui-dir ~/ComfyUI --bundle-dir /data/b19 --gemma-dir /dev/shm/g19 --out FILE   # one GPU
    python bench/comfy_graph.py --comfyui-dir ~/ComfyUI --tiny                                                     # CPU check

ComfyUI needs its own requirements in this Python (see ``bench/comfy_native.py``); the pack is not
installed into it (the fleet side runs from this repository). Nothing is downloaded.
"""

from __future__ import annotations  # noqa: I001 - _common first: it puts the repository on sys.path

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from _common import append_out, log, markdown_table, median, stdout_to_stderr
from e2e import PROMPT, Job, check_space, run_fleet
from ltx_core.components.guiders import MultiModalGuiderParams

from mgpu_backend.bundles import full_size, layout, tiny
from mgpu_backend.ltx.diagnostics import bench_config
from mgpu_backend.ltx.gemma_file import gemma_folder_to_comfy_file
from mgpu_backend.tools import comfy_queue
from mgpu_backend.tools.comfy_server import ComfyUIServer, ComfyUIStartError
from mgpu_backend.tools.generate import DEFAULT_NEGATIVE_PROMPT, SINGLE_GPU_STAGE2_SIGMAS

TEMPLATE_STEPS = 20  # the template's LTXVScheduler
TEMPLATE_CFG = 4.0  # its stage-1 CFGGuider (stage 2: 1)
SEED = 10  # its stage-1 RandomNoise (stage 2: 0)
GEMMA_FILE = "gemma_3_12B_it.safetensors"  # the name the template loads

STAGES = {  # template node id -> the stage its time counts towards
    **dict.fromkeys(("1", "48", "68", "76"), "load"),
    **dict.fromkeys(("60", "3", "4", "22"), "text encode"),
    **dict.fromkeys(("43", "51", "56", "9", "47", "8", "11", "41"), "stage 1"),
    **dict.fromkeys(("80", "81", "84", "83"), "upsample"),
    **dict.fromkeys(("82", "66", "67", "73", "70"), "stage 2"),
    **dict.fromkeys(("94", "98", "96", "97", "75"), "decode"),
}
SAMPLERS = {"41": "stage 1", "70": "stage 2"}
STAGE_ORDER = ("load", "text encode", "stage 1", "upsample", "stage 2", "decode")


def template_graph(files: dict[str, str], width: int, height: int, frames: int, fps: float, steps: int, seed: int,
                   prompt: str, negative: str) -> dict:  # fmt: skip
    """ComfyUI's LTX-2 text-to-video template in API format (its node ids kept). ``files``: the names of
    ``checkpoint``, ``gemma``, ``distilled_lora`` and ``upsampler`` in ComfyUI's model folders. The
    template sets the final size and scales it by 0.5 for stage 1; here that is done in numbers."""
    checkpoint = files["checkpoint"]

    def node(class_type: str, **inputs) -> dict:
        return {"class_type": class_type, "inputs": inputs}

    return {
        "1": node("CheckpointLoaderSimple", ckpt_name=checkpoint),
        "60": node("LTXAVTextEncoderLoader", text_encoder=files["gemma"], ckpt_name=checkpoint, device="default"),  # device: v0.20.1
        "48": node("LTXVAudioVAELoader", ckpt_name=checkpoint),
        "68": node("LoraLoaderModelOnly", model=["1", 0], lora_name=files["distilled_lora"], strength_model=1.0),
        "76": node("LatentUpscaleModelLoader", model_name=files["upsampler"]),
        "3": node("CLIPTextEncode", text=prompt, clip=["60", 0]),
        "4": node("CLIPTextEncode", text=negative, clip=["60", 0]),
        "22": node("LTXVConditioning", positive=["3", 0], negative=["4", 0], frame_rate=float(fps)),
        "43": node("EmptyLTXVLatentVideo", width=width // 2, height=height // 2, length=frames, batch_size=1),
        "51": node("LTXVEmptyLatentAudio", frames_number=frames, frame_rate=round(fps), batch_size=1, audio_vae=["48", 0]),
        "56": node("LTXVConcatAVLatent", video_latent=["43", 0], audio_latent=["51", 0]),
        "9": node("LTXVScheduler", steps=steps, max_shift=2.05, base_shift=0.95, stretch=True, terminal=0.1, latent=["56", 0]),
        "47": node("CFGGuider", model=["1", 0], positive=["22", 0], negative=["22", 1], cfg=TEMPLATE_CFG),
        "8": node("KSamplerSelect", sampler_name="euler_ancestral"),
        "11": node("RandomNoise", noise_seed=seed),
        "41": node("SamplerCustomAdvanced", noise=["11", 0], guider=["47", 0], sampler=["8", 0], sigmas=["9", 0], latent_image=["56", 0]),
        "80": node("LTXVSeparateAVLatent", av_latent=["41", 0]),
        "81": node("LTXVCropGuides", positive=["22", 0], negative=["22", 1], latent=["80", 0]),
        "84": node("LTXVLatentUpsampler", samples=["81", 2], upscale_model=["76", 0], vae=["1", 2]),
        "83": node("LTXVConcatAVLatent", video_latent=["84", 0], audio_latent=["80", 1]),
        "82": node("CFGGuider", model=["68", 0], positive=["81", 0], negative=["81", 1], cfg=1.0),
        "66": node("KSamplerSelect", sampler_name="euler_ancestral"),
        "67": node("RandomNoise", noise_seed=0),
        "73": node("ManualSigmas", sigmas=", ".join(f"{sigma:g}" for sigma in SINGLE_GPU_STAGE2_SIGMAS)),
        "70": node("SamplerCustomAdvanced", noise=["67", 0], guider=["82", 0], sampler=["66", 0], sigmas=["73", 0], latent_image=["83", 0]),
        "94": node("LTXVSeparateAVLatent", av_latent=["70", 1]),
        "98": node("VAEDecodeTiled", samples=["94", 0], vae=["1", 2], tile_size=512, overlap=64, temporal_size=4096, temporal_overlap=8),
        "96": node("LTXVAudioVAEDecode", samples=["94", 1], audio_vae=["48", 0]),
        "97": node("CreateVideo", images=["98", 0], audio=["96", 0], fps=float(fps)),
        "75": node("SaveVideo", video=["97", 0], filename_prefix="video/LTX-2", format="mp4", codec="auto"),
    }


# --------------------------------------------------------------------------------------------------
# ComfyUI as a server of its own
# --------------------------------------------------------------------------------------------------


def link_models(base: Path, links: list[tuple[str, str, str]]) -> None:
    """Symlink each (models folder, name, file) into ComfyUI's model folders under ``base``."""
    for folder, name, source in links:
        (base / "models" / folder).mkdir(parents=True, exist_ok=True)
        target = base / "models" / folder / name
        target.unlink(missing_ok=True)
        target.symlink_to(source)


def place_models(base: Path, bundle: layout.TwoStageFiles, gemma_file: str) -> dict[str, str]:
    """Link the bundle's files into ComfyUI's model folders under ``base``; their names there."""
    sources = {"checkpoint": ("checkpoints", bundle.checkpoint_path), "distilled_lora": ("loras", bundle.distilled_lora_path),
               "upsampler": ("latent_upscale_models", bundle.spatial_upsampler_path), "gemma": ("text_encoders", gemma_file)}  # fmt: skip
    link_models(base, [(folder, Path(source).name, source) for folder, source in sources.values()])
    return {key: Path(source).name for key, (_, source) in sources.items()}


def start_comfyui(comfyui_dir: Path, base: Path, extra_args: list[str], env: dict | None = None,
                  ready_path: str = "/system_stats") -> tuple[ComfyUIServer, float]:  # fmt: skip
    """ComfyUI on a free local port with ``base`` as its base directory and a web root of one page
    (only the API is used, so ComfyUI needs no frontend package): the server and its start-up seconds
    (until it answers ``ready_path``). ``env``: its environment (default: this process's)."""
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    web_root = base / "web-root"
    web_root.mkdir(exist_ok=True)
    (web_root / "index.html").write_text("<!doctype html><title>ComfyUI for a bench</title>\n")
    server = ComfyUIServer(comfyui_dir, base, ["--front-end-root", str(web_root), *extra_args], env=env)
    try:
        return server, server.wait_ready(ready_path)
    except ComfyUIStartError as exc:
        server.stop()
        raise SystemExit(f"error: {exc}") from None


@dataclass
class GraphRun:
    """One queued graph: seconds per stage (from the nodes' start events), step times per sampler, total."""

    seconds: dict[str, float] = field(default_factory=dict)
    step_seconds: dict[str, list[float]] = field(default_factory=dict)
    total_seconds: float = 0.0
    failure: str | None = None  # ComfyUI's error text when a node failed
    ran: list[str] = field(default_factory=list)  # node ids in the order they started


class NodeClock:
    """Timestamps ComfyUI's events of one prompt and sums them into a ``GraphRun``: a node runs from its
    ``executing`` event to the next node's (or the end), each sampler step ends at a ``progress``. Newer
    ComfyUI sends a progress bar's updates at most every 100 ms: an event whose ``value`` moved by k
    steps since the last one ends k steps of equal length. ``stages``: node id -> the stage its time counts towards ("other" if missing); ``samplers``: the
    sampler nodes' ids -> their stage (default: this template's)."""

    def __init__(self, stages: dict[str, str] | None = None, samplers: dict[str, str] | None = None) -> None:
        self.stages = STAGES if stages is None else stages
        self.samplers = SAMPLERS if samplers is None else samplers
        self.started = time.perf_counter()
        self.starts: list[tuple[str, float]] = []
        self.progress: dict[str, list[tuple[int, float]]] = {}  # sampler -> (steps done, when)

    def __call__(self, kind: str, data: dict) -> None:
        now = time.perf_counter()
        if kind == "executing" and data.get("node") is not None:
            self.starts.append((str(data["node"]), now))
        elif kind == "progress" and str(data.get("node")) in self.samplers:
            marks = self.progress.setdefault(str(data["node"]), [])
            done = marks[-1][0] if marks else 0
            value = data.get("value")
            marks.append((int(value) if isinstance(value, int) and value > done else done + 1, now))

    def result(self, ended: float, failure: str | None) -> GraphRun:
        run = GraphRun(failure=failure, total_seconds=ended - self.started, ran=[node for node, _ in self.starts])
        marks = [*self.starts, ("", ended)]
        for (node, start), (_, end) in itertools.pairwise(marks):
            stage = self.stages.get(node, "other")
            run.seconds[stage] = run.seconds.get(stage, 0.0) + end - start
        for node, marks in self.progress.items():
            start = next(start for started_node, start in self.starts if started_node == node)
            steps = run.step_seconds[self.samplers[node]] = []
            for (done_before, before), (done, now) in itertools.pairwise([(0, start), *marks]):
                steps += [(now - before) / (done - done_before)] * (done - done_before)
        return run


def run_graph(server: ComfyUIServer, graph: dict, timeout: float, clock: NodeClock | None = None) -> GraphRun:
    """Queue ``graph`` and follow it to its end: the ``GraphRun`` of ``clock`` (default: this template's)."""
    clock = clock or NodeClock()
    failure = None
    try:
        comfy_queue.queue_prompt(server.url, graph, say=lambda text: None, timeout=timeout, on_event=clock)
    except comfy_queue.QueueError as exc:
        failure = str(exc)
    return clock.result(time.perf_counter(), failure)


# --------------------------------------------------------------------------------------------------
# The fleet with the template's settings
# --------------------------------------------------------------------------------------------------


def template_job(width: int, height: int, frames: int, fps: float, steps: int) -> Job:
    """The fleet's whole job as the template sets it: cfg 4 on video and audio and no other guidance
    (no STG, rescale or modality guidance), the template's stage-1 seed, its stage-2 sigmas (the
    single-GPU ones) in one tile."""
    guider = MultiModalGuiderParams(cfg_scale=TEMPLATE_CFG, stg_scale=0.0, stg_blocks=[], rescale_scale=0.0, modality_scale=1.0, skip_step=0)
    return Job(height=height, width=width, num_frames=frames, frame_rate=fps, seed=SEED, steps=steps,
               video_guider=guider, audio_guider=guider, official_steps=steps)  # fmt: skip


def run_fleet_side(bundle: layout.TwoStageFiles, gemma_file: str, job: Job, device: torch.device, gpus: str | None, cpu_ranks: int | None):
    """``bench/e2e.py``'s fleet job, cold and warm, on the bundle with ``gemma_file`` (the same single
    Gemma file ComfyUI read) as its text encoder: (cold, warm) ``e2e.Run``s."""
    spec = replace(bundle.spec(), gemma_root=gemma_file).to_json()
    with tempfile.TemporaryDirectory(prefix="mgpu-comfy-graph-fleet-") as socket_dir:
        os.chmod(socket_dir, 0o700)
        return run_fleet(spec, job, device, gpus, cpu_ranks, socket_dir)


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def step_median(steps: list[float] | None) -> str:
    steps = steps or []
    return f"{median(steps[1:] or steps):.2f}" if steps else "-"


def report_table(comfy_cold: GraphRun, comfy_warm: GraphRun, fleet_cold, fleet_warm) -> str:
    """Per stage: ComfyUI cold / warm against the fleet cold / warm (``e2e.Run``s), and the totals."""

    def fleet_seconds(run, stage: str) -> float | None:
        if stage == "load":
            return run.seconds.get("load", 0.0) + run.seconds.get("fleet spawn", 0.0)
        if stage == "decode":
            return run.seconds.get("decode", 0.0) + run.seconds.get("handoff", 0.0)
        return run.seconds.get(stage)

    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    rows = []
    for stage in (*STAGE_ORDER, *(["other"] if "other" in comfy_cold.seconds else [])):
        rows.append([stage, cell(comfy_cold.seconds.get(stage)), cell(comfy_warm.seconds.get(stage)),
                     cell(fleet_seconds(fleet_cold, stage)), cell(fleet_seconds(fleet_warm, stage))])  # fmt: skip
    for stage in ("stage 1", "stage 2"):
        rows.append([f"{stage} s/step (median, first left out)", step_median(comfy_cold.step_seconds.get(stage)),
                     step_median(comfy_warm.step_seconds.get(stage)), step_median(fleet_cold.step_seconds.get(stage)),
                     step_median(fleet_warm.step_seconds.get(stage))])  # fmt: skip
    rows.append(["**total**", f"**{comfy_cold.total_seconds:.1f}**", f"**{comfy_warm.total_seconds:.1f}**",
                 f"**{fleet_cold.total_seconds:.1f}**", f"**{fleet_warm.total_seconds:.1f}**"])  # fmt: skip
    return markdown_table(["stage", "ComfyUI s (cold)", "ComfyUI s (warm)", "fleet s (cold)", "fleet s (warm)"], rows)


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def write_files(args: argparse.Namespace, device: torch.device, stack: contextlib.ExitStack, version: str = "2.0",
                gemma_name: str = GEMMA_FILE) -> tuple[layout.TwoStageFiles, str]:  # fmt: skip
    """The random bundle of LTX-``version`` (``args.bundle_dir``; the tiny one with ``args.tiny``) and its
    Gemma as one ComfyUI-layout bf16 file named ``gemma_name`` (``args.gemma_dir``): (bundle, Gemma file)."""
    if args.tiny:
        bundle = tiny.default_tiny_bundle(version)
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-comfy-graph-gemma-")))
        return bundle, gemma_folder_to_comfy_file(bundle.gemma_root, str(folder / gemma_name))
    config = full_size.full_size_config(bench_config(version)["transformer"], 48)  # ComfyUI's text encoder is the released 48-layer Gemma only
    bundle_dir = Path(args.bundle_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-comfy-graph-bundle-")))
    gemma_dir = Path(args.gemma_dir) if args.gemma_dir else bundle_dir
    bundle_dir.mkdir(parents=True, exist_ok=True)
    gemma_dir.mkdir(parents=True, exist_ok=True)
    gemma_file = gemma_dir / gemma_name
    planned = full_size.planned_bytes(config)
    gemma_bytes = sum(size for name, size in planned.items() if name.startswith(full_size.GEMMA_DIR_NAME + "/"))
    remedy = "point --bundle-dir (or --gemma-dir) at a larger disk"
    if args.gemma_dir:
        check_space(bundle_dir, sum(planned.values()) - gemma_bytes + (1 << 30), "the random bundle without Gemma", remedy)
        check_space(gemma_dir, 2 * gemma_bytes + (1 << 30), "the bundle's Gemma folder and its single-file copy", remedy)
    else:  # one disk holds the bundle and, for a while, Gemma twice
        check_space(bundle_dir, sum(planned.values()) + gemma_bytes + (1 << 30), "the random bundle and its single-file Gemma", remedy)
    log(f"random bundle: {sum(planned.values()) / 1e9:.1f} GB in {bundle_dir}, Gemma in {gemma_dir}, drawn on {device} ...")
    started = time.perf_counter()
    bundle = full_size.write_bundle(bundle_dir, config, device, 0, log=log, gemma_dir=gemma_dir / full_size.GEMMA_DIR_NAME if args.gemma_dir else None)
    log(f"writing {gemma_file} (ComfyUI's single-file Gemma layout) ...")
    gemma_folder_to_comfy_file(bundle.gemma_root, str(gemma_file))
    # Both sides read the single file; the folder would only hold 24 GB more of host memory (tmpfs).
    shutil.rmtree(Path(bundle.gemma_root).resolve())
    log(f"files ready in {time.perf_counter() - started:.1f} s")
    return bundle, str(gemma_file)


def add_comfyui_arguments(parser: argparse.ArgumentParser, tiny_help: str) -> None:
    """The options every bench that queues a graph in its own ComfyUI takes: --comfyui-args, --tiny,
    --timeout, --comfyui-log and --out."""
    parser.add_argument("--comfyui-args", default="", help="extra arguments for ComfyUI's main.py, e.g. '--gpu-only' (default: ComfyUI's own memory defaults)")
    parser.add_argument("--tiny", action="store_true", help=tiny_help)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one graph may take (default 1800)")
    parser.add_argument("--comfyui-log", help="write ComfyUI's log to this file at the end (also when a node fails)")
    parser.add_argument("--out", help="append the table, with command, machine and date, to this file")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui-dir", required=True, help="a ComfyUI checkout (its main.py is started with this Python)")
    parser.add_argument("--bundle-dir", help="where to write the random 19B bundle (default: a temporary folder)")
    parser.add_argument("--gemma-dir", help="a folder for the bundle's Gemma and its single-file copy (e.g. /dev/shm/g19) when the bundle's disk cannot hold them")
    parser.add_argument("--width", type=int, default=1536, help="final width, a multiple of 64 (default 1536)")
    parser.add_argument("--height", type=int, default=1024, help="final height, a multiple of 64 (default 1024)")
    parser.add_argument("--num-frames", type=int, default=121, help="8k+1 frames (default 121)")
    parser.add_argument("--frame-rate", type=float, default=24.0, help="frames per second (default 24)")
    parser.add_argument("--steps", type=int, default=TEMPLATE_STEPS, help=f"stage-1 steps on both sides (default {TEMPLATE_STEPS}, the template's)")
    add_comfyui_arguments(parser, "the CPU check: the tiny bundle, ComfyUI --cpu, the graph until ComfyUI's text encoder")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill (e.g. by timeout) still stops ComfyUI and copies its log
    if args.width % 64 or args.height % 64 or (args.num_frames - 1) % 8 or args.steps < 1:
        parser.error(f"the two-stage job needs width and height multiples of 64, 8k+1 frames and 1+ steps, got {args.width}x{args.height}x{args.num_frames}, {args.steps} steps")
    comfyui_dir = Path(args.comfyui_dir).expanduser().resolve()
    if not (comfyui_dir / "main.py").is_file():
        raise SystemExit(f"error: --comfyui-dir {args.comfyui_dir} holds no ComfyUI checkout (no main.py)")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("error: the full-size graph needs a GPU (torch sees none); --tiny checks the graph on the CPU")
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    if args.tiny:
        args.width, args.height, args.num_frames, args.steps = 192, 128, 9, 2
    extra = ["--cpu"] if args.tiny else args.comfyui_args.split()

    with contextlib.ExitStack() as stack:
        stack.enter_context(stdout_to_stderr())
        bundle, gemma_file = write_files(args, device, stack)
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-comfy-graph-base-")))
        files = place_models(base, bundle, gemma_file)
        if args.comfyui_log:
            stack.callback(lambda: shutil.copyfile(base / "comfyui.log", args.comfyui_log) if (base / "comfyui.log").exists() else None)
        server, seconds = start_comfyui(comfyui_dir, base, extra)
        stack.callback(server.stop)
        log(f"ComfyUI: up in {seconds:.1f} s at {server.url} ({' '.join(extra) or 'its default memory settings'})")

        def graph(seed: int, suffix: str) -> dict:
            prompts = (PROMPT + suffix, DEFAULT_NEGATIVE_PROMPT + suffix)
            return template_graph(files, args.width, args.height, args.num_frames, args.frame_rate, args.steps, seed, *prompts)

        log("ComfyUI: the template graph, cold ...")
        comfy_cold = run_graph(server, graph(SEED, ""), args.timeout)
        if args.tiny:
            tiny_text = tiny_report(comfy_cold, len(graph(SEED, "")))
        elif comfy_cold.failure:
            raise SystemExit(f"error: ComfyUI's graph failed: {comfy_cold.failure}\n{server.log_tail()}")
        else:
            log_stages("cold", comfy_cold)
            log("ComfyUI: warm (another seed and prompt) ...")
            comfy_warm = run_graph(server, graph(SEED + 1, " "), args.timeout)
            if comfy_warm.failure:
                raise SystemExit(f"error: ComfyUI's warm graph failed: {comfy_warm.failure}\n{server.log_tail()}")
            log_stages("warm", comfy_warm)
            server.stop()  # its GPU memory back before the fleet loads
            torch.cuda.empty_cache()

            job = template_job(args.width, args.height, args.num_frames, args.frame_rate, args.steps)
            fleet_cold, fleet_warm = run_fleet_side(bundle, gemma_file, job, device, "0", None)

    if args.tiny:  # stopped where it should: at ComfyUI's text encoder, built for the released Gemma only
        print(tiny_text, flush=True)
        if not (comfy_cold.failure or "").startswith("node 60 LTXAVTextEncoderLoader failed"):
            raise SystemExit(1)
        return
    text = "\n".join([
        (
            f"**Whole graph: ComfyUI's LTX-2 t2v template cold {comfy_cold.total_seconds:.1f} s, warm {comfy_warm.total_seconds:.1f} s; "
            f"the fleet at world 1 cold {fleet_cold.total_seconds:.1f} s, warm {fleet_warm.total_seconds:.1f} s.**"
        ),
        "",
        (
            f"LTX-2.0 19B random bundle, the released 48-layer Gemma-3 12B as one file for both; {args.width}x{args.height}, "
            f"{args.num_frames} frames, {args.frame_rate:g} fps; stage 1 at half size, {args.steps} steps, cfg {TEMPLATE_CFG:g} (two "
            f"passes a step); stage 2 over {', '.join(f'{s:g}' for s in SINGLE_GPU_STAGE2_SIGMAS)} with the distilled LoRA; ComfyUI "
            f"{' '.join(extra) or 'with its default memory settings'}."
        ),
        "",
        report_table(comfy_cold, comfy_warm, fleet_cold, fleet_warm),
        "",
        (
            "- ComfyUI: each stage sums its nodes' times (a node runs from its start event to the next node's); its loaders only read "
            "the files, the weights reach the GPU inside the first sampler and the text encoder, so its cold stage 1 and text encode include "
            "that; warm: another seed and prompt, so every node but the loaders runs again"
        ),
        "- fleet: `bench/e2e.py`'s job (load includes the fleet's spawn, decode the frames' handoff); warm: the same job on the warm fleet",
        "- not compared for outputs: ComfyUI samples with euler_ancestral and its own noise, and its stage 2 also re-denoises the audio",
    ])
    print(text, flush=True)
    if args.out:
        append_out(text, device, args.out)


def log_stages(name: str, run: GraphRun) -> None:
    """One run's stages on stderr as soon as it ends, so a cut run still leaves its figures."""
    stages = ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in run.seconds.items())
    steps = "; ".join(f"{stage} steps {', '.join(f'{s:.2f}' for s in times)} s" for stage, times in run.step_seconds.items())
    log(f"ComfyUI {name}: {run.total_seconds:.1f} s: {stages}; {steps}")


def tiny_report(run: GraphRun, nodes: int) -> str:
    """The CPU check's lines: ComfyUI took the graph, which nodes ran, where it stopped and why."""
    stopped = run.failure.splitlines()[0] if run.failure else "nowhere: the graph ran to the end"
    return "\n".join([
        f"ComfyUI accepted the template graph ({nodes} nodes) and started {len(run.ran)} of them: {', '.join(run.ran)}",
        f"stopped at: {stopped}",
    ])


if __name__ == "__main__":
    main()
