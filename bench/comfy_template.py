"""ComfyUI's own LTX-2.3 text-to-video template, whole, through its HTTP API: as ComfyUI ships it, and
with only its loader swapped for *Load Checkpoint (MGPU fleet)*.

What a ComfyUI v0.20.1 user queues is the ``video_ltx2_3_t2v`` template (``comfyui-workflow-templates``
0.9.73), kept in API form in ``workflows/comfy/ltx23_t2v_api.json`` (``make_comfy_workflows.py``):
1280x720, 5 s at 25 fps (126 frames asked, 16 latent frames: 121 decoded), the distilled LoRA at 0.5
on the dev checkpoint, stage 1 at half size over 8 fixed sigmas with ``euler_ancestral_cfg_pp`` at
cfg 1, ``LTXVLatentUpsampler``, stage 2 over 3 sigmas with ``euler_cfg_pp``, ``VAEDecodeTiled``,
``LTXVAudioVAEDecode``, ``CreateVideo``, ``SaveVideo``. Of the four LTX-2.3 templates it needs the
fewest files: no input image (image to video needs one), the same checkpoint, LoRA, upsampler and
Gemma as the others. This bench:

1. writes one random LTX-2.3 22B bundle at the real configuration (``mgpu_backend.bundles.full_size``,
   with the released 48-layer Gemma-3 12B: ComfyUI's LTX text encoder builds nothing else) and links
   its files into ComfyUI's model folders under the names the template loads (``models.json``);
2. starts ComfyUI (``--comfyui-dir``, a private port and base directory, this pack in its
   ``custom_nodes``) and queues the template as ComfyUI ships it (``CheckpointLoaderSimple``: the model
   in ComfyUI's process), cold (the first queue after start) and warm (the second, both noise seeds
   changed), timing each node from the websocket events; stops it;
3. starts a fresh ComfyUI and does the same with the loader swapped for ``MGPUCheckpointLoader``: its
   fleet at world 1 on the same GPU (``--gpus 0``, the default), or sequence parallel over several
   (``--gpus 0,1,2,3``; several lists: one fleet after the other), running ComfyUI's own LTX model code.

One table per fleet: per stage (the nodes' times summed), stock cold / warm against fleet cold / warm,
the fleet/stock ratios, and the per-step medians of stage 1 and stage 2. Both sides read the same
files and run the same nodes; only where the denoiser runs differs.

Files (54.5 GB on ``--bundle-dir``, 24.4 GB on ``--gemma-dir``): the checkpoint is bf16 (46.1 GB)
under the template's ``ltx-2.3-22b-dev-fp8.safetensors`` name: the fleet's MODEL loads bf16 files only
(ComfyUI's mixed-precision fp8 is refused), and both sides must read the same file. Gemma is ComfyUI's
bf16 single file (24.4 GB) under the template's ``gemma_3_12B_it_fp4_mixed.safetensors`` name: ComfyUI
reads the format from the file, not its name, it is the same text encoder on both sides, and ComfyUI
reads fp8 or fp4 weights only with ``comfy-kitchen`` installed (a 68 MB wheel). The LoRA (rank 384,
8.1 GB) and the upsampler (0.25 GB) as the real ones. Written once, read by both sides; the 48-layer
Gemma folder is written, converted to the single file and removed (host memory peaks near 75 GB then).

``--tiny`` is the check that needs no GPU: the tiny LTX-2.3 bundle, ComfyUI on the CPU, the template's
tiny twin (``ltx23_t2v_tiny_api.json``: 192x128, 9 frames, its prompts encoded by MGPU Text Encode,
since ComfyUI's text encoder builds the released Gemma only), both graphs queued cold and warm to
their end, the fleet on one CPU rank; then the full-size graphs themselves, the tiny files linked under
the template's names: ComfyUI accepts them and runs them, the loaders included, up to that text
encoder, where they must stop.

    python bench/comfy_template.py --comfyui-dir ~/ComfyUI --bundle-dir /data/b23 --gemma-dir /dev/shm/g23 --out FILE   # one GPU
    python bench/comfy_template.py --comfyui-dir ~/ComfyUI --tiny                                                     # CPU check

ComfyUI needs its own requirements in this Python (``main.py`` is started with it); this checkout's
pack is linked into its ``custom_nodes`` and put first on its PYTHONPATH. Nothing is downloaded.
"""

from __future__ import annotations  # noqa: I001 - _common first: it puts the repository on sys.path

import argparse
import contextlib
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import HostMemoryWatch, append_out, log, markdown_table, stdout_to_stderr
from comfy_graph import GraphRun, NodeClock, add_comfyui_arguments, link_models, log_stages, run_graph, start_comfyui, step_median, write_files

from mgpu_backend.tools import comfy_queue
from mgpu_backend.tools.comfy_templates import MODEL_LOADER_SWAPS, swap_model_loader

REPO = Path(__file__).resolve().parent.parent
GRAPHS_DIR = REPO / "workflows" / "comfy"
TEMPLATE = "ltx23_t2v"
SIDES = ("stock", "fleet")
STAGE_ORDER = ("load", "text encode", "stage 1", "upsample", "stage 2", "decode")
SAMPLER_TYPES = frozenset({"SamplerCustomAdvanced", "SamplerCustom", "KSampler", "KSamplerAdvanced"})
LOADER_TYPES = frozenset({"CheckpointLoaderSimple", "UNETLoader", "VAELoader", "LTXVAudioVAELoader", "LatentUpscaleModelLoader",
                          "LoraLoaderModelOnly", *MODEL_LOADER_SWAPS.values(), "MGPULoadCheckpoint"})  # fmt: skip
TEXT_TYPES = frozenset({"LTXAVTextEncoderLoader", "CLIPTextEncode", "LTXVConditioning", "MGPUTextEncode"})
NOISE_TYPE = "RandomNoise"


# --------------------------------------------------------------------------------------------------
# The two graphs
# --------------------------------------------------------------------------------------------------


def stock_loader(api_graph: dict) -> dict:
    """The graph with the MGPU fleet's drop-in loaders put back to ComfyUI's own (``swap_model_loader``
    undone; the drop-in's optional ``weight_dtype`` left out where it is the default)."""
    stock_of = {fleet: stock for stock, fleet in MODEL_LOADER_SWAPS.items()}
    graph = json.loads(json.dumps(api_graph))
    for entry in graph.values():
        if entry["class_type"] in stock_of:
            entry["class_type"] = stock_of[entry["class_type"]]
            if entry["inputs"].get("weight_dtype") == "default":
                del entry["inputs"]["weight_dtype"]
            entry.pop("_meta", None)
    return graph


def template_graphs(tiny_run: bool) -> dict[str, dict]:
    """{"stock": the template as ComfyUI ships it, "fleet": the same with only its loader swapped}."""
    if tiny_run:
        stock = json.loads((GRAPHS_DIR / f"{TEMPLATE}_tiny_api.json").read_text())
    else:
        stock = stock_loader(json.loads((GRAPHS_DIR / f"{TEMPLATE}_api.json").read_text()))
    return {"stock": stock, "fleet": swap_model_loader(stock)}


def reseeded(graph: dict, offset: int) -> dict:
    """The graph with every RandomNoise seed moved by ``offset``: what a user's second queue changes."""
    graph = json.loads(json.dumps(graph))
    for entry in graph.values():
        if entry["class_type"] == NOISE_TYPE:
            entry["inputs"]["noise_seed"] += offset
    return graph


def upstream(graph: dict, node_id: str) -> set[str]:
    """Every node ``node_id`` reads from, through any number of links."""
    found, todo = set(), [node_id]
    while todo:
        for value in graph[todo.pop()]["inputs"].values():
            if isinstance(value, list) and len(value) == 2 and str(value[0]) in graph and str(value[0]) not in found:
                found.add(str(value[0]))
                todo.append(str(value[0]))
    return found


def graph_stages(graph: dict) -> tuple[dict[str, str], dict[str, str]]:
    """(node id -> stage, sampler id -> "stage 1"/"stage 2") of a two-stage graph, from its links: the
    sampler that feeds the other is stage 1; what reads stage 2's output is decode, what reads stage 1's
    (and not stage 2's) is upsample; then loaders are load, text encoding is text encode, and the rest
    counts towards the sampler it feeds (stage 1 first), else "other"."""
    samplers = [node_id for node_id, entry in graph.items() if entry["class_type"] in SAMPLER_TYPES]
    if len(samplers) != 2:
        raise SystemExit(f"error: the graph has {len(samplers)} samplers ({', '.join(samplers)}); the bench times two-stage graphs")
    first, second = samplers if samplers[0] in upstream(graph, samplers[1]) else samplers[::-1]
    if first not in upstream(graph, second):
        raise SystemExit(f"error: neither sampler ({first}, {second}) feeds the other; the bench times two-stage graphs")
    before = {first: upstream(graph, first), second: upstream(graph, second)}
    stages = {first: "stage 1", second: "stage 2"}
    for node_id, entry in graph.items():
        if node_id in stages:
            continue
        reads = upstream(graph, node_id)
        if second in reads:
            stages[node_id] = "decode"
        elif first in reads:
            stages[node_id] = "upsample"
        elif entry["class_type"] in LOADER_TYPES:
            stages[node_id] = "load"
        elif entry["class_type"] in TEXT_TYPES:
            stages[node_id] = "text encode"
        elif node_id in before[first]:
            stages[node_id] = "stage 1"
        elif node_id in before[second]:
            stages[node_id] = "stage 2"
        else:
            stages[node_id] = "other"
    return stages, {first: "stage 1", second: "stage 2"}


# --------------------------------------------------------------------------------------------------
# ComfyUI with the pack, and the model files
# --------------------------------------------------------------------------------------------------


def model_links(tiny_run: bool, bundle, gemma_file: str) -> list[tuple[str, str, str]]:
    """(ComfyUI models folder, file name, the file it is) of every model the graphs load: the bundle's
    files under the names the template loads (``models.json``); with ``tiny_run`` also under their own
    names, which the tiny twin loads."""
    sources = {"checkpoints": bundle.checkpoint_path, "loras": bundle.distilled_lora_path,
               "latent_upscale_models": bundle.spatial_upsampler_path, "text_encoders": gemma_file}  # fmt: skip
    links = [(entry["directory"], entry["name"], sources[entry["directory"]]) for entry in template_model_files()]
    if tiny_run:
        links += [(folder, Path(source).name, source) for folder, source in sources.items() if folder != "text_encoders"]
    return links


def template_model_files() -> list[dict]:
    """The model files the template names (``models.json``: name, url, ComfyUI models folder)."""
    return json.loads((GRAPHS_DIR / "models.json").read_text())[TEMPLATE]


def template_gemma_name() -> str:
    (name,) = [entry["name"] for entry in template_model_files() if entry["directory"] == "text_encoders"]
    return name


def comfyui_environment(runtime: Path, tiny_run: bool, gpus: str) -> dict[str, str]:
    """ComfyUI's environment: this checkout's mgpu_backend first, a private runtime folder for its
    fleet's socket, the fleet on ``gpus`` (one CPU rank with --tiny)."""
    env = {key: value for key, value in os.environ.items() if key not in ("MGPU_SOCKET", "MGPU_GPUS", "MGPU_CPU_RANKS")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), XDG_RUNTIME_DIR=str(runtime))
    env.update({"MGPU_CPU_RANKS": "1", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")} if tiny_run else {"MGPU_GPUS": gpus})
    return env


def run_side(side: str, graph: dict, args: argparse.Namespace, links: list, extra: list[str], gpus: str,
             full_size_graph: dict | None = None) -> tuple[GraphRun, GraphRun, GraphRun | None]:  # fmt: skip
    """One fresh ComfyUI with the pack and the model files (its fleet, if the graph starts one, on
    ``gpus``): ``graph`` queued cold, then warm with new seeds; then, if given, ``full_size_graph``
    (the CPU check: how far ComfyUI runs it on the tiny files): (cold, warm, full size or None). The
    ComfyUI (and its fleet) is stopped before returning."""
    stages, samplers = graph_stages(graph)
    with tempfile.TemporaryDirectory(prefix=f"mgpu-comfy-template-{side}-") as folder:
        base = Path(folder)
        (base / "custom_nodes").mkdir()
        (base / "custom_nodes" / "comfyui-mgpu").symlink_to(REPO, target_is_directory=True)
        link_models(base, links)
        runtime = base / "run"
        runtime.mkdir(mode=0o700)
        env = comfyui_environment(runtime, args.tiny, gpus)
        server, seconds = start_comfyui(args.comfyui_dir, base, extra, env=env, ready_path="/object_info/MGPUCheckpointLoader")
        try:
            status, body = comfy_queue.http_json(f"{server.url}/object_info/MGPUCheckpointLoader")
            if status != 200 or "MGPUCheckpointLoader" not in body:
                raise SystemExit(f"error: ComfyUI did not load this pack (no MGPUCheckpointLoader):\n{server.log_tail()}")
            log(f"{side}: ComfyUI up in {seconds:.1f} s at {server.url} ({' '.join(extra) or 'its default memory settings'})")
            runs = []
            for name, offset in (("cold", 0), ("warm", 1)):
                log(f"{side}: the template graph, {name} ...")
                with HostMemoryWatch() as memory:
                    run = run_graph(server, reseeded(graph, offset), args.timeout, NodeClock(stages, samplers))
                log(f"{side} {name}: {memory.describe()}")
                if run.failure:
                    raise SystemExit(f"error: the {side} graph ({name}) failed: {run.failure}\n{server.log_tail()}")
                log_stages(f"{side} {name}", run)
                runs.append(run)
            if full_size_graph is not None:
                log(f"{side}: the full-size template graph on the tiny files ...")
                runs.append(run_graph(server, full_size_graph, args.timeout, NodeClock({}, {})))
            return runs[0], runs[1], runs[2] if full_size_graph is not None else None
        finally:
            server.stop()
            if args.comfyui_log:  # both sides' logs, one after the other, each with its fleet server's (the ranks' output)
                with open(args.comfyui_log, "w" if side == SIDES[0] or not Path(args.comfyui_log).exists() else "a") as out:
                    out.write(f"===== ComfyUI, {side} side (fleet GPUs {gpus}) =====\n{server.log_text()}\n")
                    for fleet_log in sorted(runtime.rglob("server.log")):
                        out.write(f"===== its fleet's {fleet_log.relative_to(runtime)} =====\n{fleet_log.read_text(errors='replace')}\n")


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def report_table(runs: dict[str, GraphRun | None]) -> str:
    """Per stage: stock cold / warm against fleet cold / warm and the fleet/stock ratios, then the
    per-step medians (first step left out) and the totals. ``runs``: "stock cold", ..., "fleet warm"
    (None: not run). A stage a warm graph did not run (ComfyUI's cache) reads "cached"."""

    def seconds(run: GraphRun | None, stage: str) -> float | None:
        return None if run is None else run.seconds.get(stage)

    def cell(run: GraphRun | None, value: float | None) -> str:
        return "-" if run is None else "cached" if value is None else f"{value:.2f}"

    def ratio(fleet: float | None, stock: float | None) -> str:
        return f"{fleet / stock:.2f}x" if fleet is not None and stock else "-"

    names = [f"{side} {temperature}" for side, temperature in itertools.product(SIDES, ("cold", "warm"))]
    stages = [*STAGE_ORDER, *sorted({stage for run in runs.values() if run for stage in run.seconds} - set(STAGE_ORDER))]
    rows = []
    for stage in stages:
        values = {name: seconds(runs[name], stage) for name in names}
        rows.append([stage, *(cell(runs[name], values[name]) for name in names),
                     ratio(values["fleet cold"], values["stock cold"]), ratio(values["fleet warm"], values["stock warm"])])  # fmt: skip
    for stage in ("stage 1", "stage 2"):
        medians = {name: step_median(runs[name].step_seconds.get(stage)) if runs[name] else "-" for name in names}
        numbers = {name: float(value) for name, value in medians.items() if value != "-"}
        rows.append([f"{stage} s/step (median, first left out)", *medians.values(),
                     ratio(numbers.get("fleet cold"), numbers.get("stock cold")), ratio(numbers.get("fleet warm"), numbers.get("stock warm"))])  # fmt: skip
    totals = {name: runs[name].total_seconds if runs[name] else None for name in names}
    rows.append(["**total**", *(f"**{value:.1f}**" if value is not None else "-" for value in totals.values()),
                 ratio(totals["fleet cold"], totals["stock cold"]), ratio(totals["fleet warm"], totals["stock warm"])])  # fmt: skip
    headers = ["stage", "stock s (cold)", "stock s (warm)", "fleet s (cold)", "fleet s (warm)", "fleet/stock (cold)", "fleet/stock (warm)"]
    return markdown_table(headers, rows)


TEXT_ENCODER_STOP = "LTXAVTextEncoderLoader"
"""Where the full-size graph stops on the tiny files: ComfyUI's text encoder builds the 12B Gemma only."""


def report_text(tables: dict[str, str], files_seconds: float, extra: list[str]) -> str:
    """The GPU run's report: what ran, one table per fleet (keyed by its GPUs; "-": the stock side alone), notes."""
    parts = [
        f"ComfyUI's LTX-2.3 text-to-video template ({TEMPLATE}_api.json), whole, 1280x720, 121 frames (126 asked at 25 fps), random 22B "
        f"bundle (bf16 checkpoint, the 48-layer Gemma-3 12B as one bf16 file), files ready in {files_seconds:.0f} s; stock: ComfyUI's Load "
        f"Checkpoint, the model in ComfyUI's process; fleet: Load Checkpoint (MGPU fleet), its ranks running ComfyUI's LTX code; ComfyUI "
        f"{' '.join(extra) or 'with its default memory settings'}.",
    ]
    for gpus, table in tables.items():
        parts += ["", f"Fleet on GPUs {gpus} (world {len(gpus.split(','))}):" if gpus != "-" else "Stock only:", "", table]
    parts += [
        "",
        "- each stage sums its nodes' times (a node runs from its start event to the next node's); cold: the first queue after "
        "ComfyUI's start, warm: the second, with new noise seeds (ComfyUI's cache keeps the loaders and the text encoding: 'cached')",
        "- stage 1 and stage 2 include what ComfyUI does inside the sampler node: moving the model to the GPU and applying the LoRA "
        "(stock), or sending the LoRA to the fleet (fleet)",
    ]
    return "\n".join(parts)


def tiny_report(graphs: dict[str, dict], full_size_graphs: dict[str, dict], sides: list[tuple[str, tuple]]) -> tuple[str, bool]:
    """The CPU check's lines and whether it passed: per side (name, (cold, warm, full size)) and run, how
    many nodes ComfyUI ran to the graph's end, with which loader, how many sampler steps it reported;
    and how far it ran the full-size graph: to its text encoder, which must be where it stopped."""
    lines, passed = [], True
    for side, (cold, warm, full_size) in sides:
        graph = graphs[side]
        (loader,) = {entry["class_type"] for entry in graph.values() if entry["class_type"] in {*MODEL_LOADER_SWAPS, *MODEL_LOADER_SWAPS.values()}}
        for temperature, run in (("cold", cold), ("warm", warm)):
            lines.append(f"{side} {temperature}: ComfyUI ran {len(run.ran)} of {len(graph)} nodes to the end ({loader}), "
                         f"stage 1 {len(run.step_seconds.get('stage 1', []))} steps, stage 2 {len(run.step_seconds.get('stage 2', []))} steps")  # fmt: skip
        full_graph = full_size_graphs[side]
        stopped = full_size.ran[-1] if full_size.ran else None
        at_text_encoder = bool(full_size.failure) and stopped is not None and full_graph[stopped]["class_type"] == TEXT_ENCODER_STOP
        loader_ran = any(full_graph[node]["class_type"] == loader for node in full_size.ran)
        passed &= at_text_encoder and loader_ran
        lines.append(f"{side} full size: ComfyUI accepted the template's graph ({len(full_graph)} nodes) and ran {len(full_size.ran)} of them, "
                     f"{loader} {'among them' if loader_ran else 'not among them'}, "
                     f"{'up to its text encoder' if at_text_encoder else 'stopping elsewhere'}: {(full_size.failure or 'no failure').splitlines()[0]}")  # fmt: skip
    return "\n".join(lines), passed


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--comfyui-dir", required=True, help="ComfyUI v0.20.1 (or later) checkout; its main.py is started with this Python")
    parser.add_argument("--bundle-dir", help="where to write the random 22B bundle, 54.5 GB (default: a temporary folder); reused when complete")
    parser.add_argument("--gemma-dir", help="a folder for the 48-layer Gemma (24.4 GB while converted) and its single file, e.g. /dev/shm/g23")
    parser.add_argument("--sides", default="stock,fleet", help="which graphs to run: stock, fleet or both (default stock,fleet)")
    parser.add_argument("--gpus", nargs="+", default=["0"],
                        help="the fleet's GPUs: 0 (world 1 beside ComfyUI, the default), 0,1,2,3 (SP over 4); several lists run one fleet after the other")
    add_comfyui_arguments(parser, "the CPU check: the tiny bundle, ComfyUI --cpu, the tiny twin of the template, one CPU rank")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill (e.g. by timeout) still stops ComfyUI and its fleet
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if not sides or set(sides) - set(SIDES):
        parser.error(f"--sides takes stock, fleet or stock,fleet, got {args.sides!r}")
    args.comfyui_dir = Path(args.comfyui_dir).expanduser().resolve()
    if not (args.comfyui_dir / "main.py").is_file():
        raise SystemExit(f"error: --comfyui-dir {args.comfyui_dir} holds no ComfyUI checkout (no main.py)")
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("error: the full-size graph needs a GPU (torch sees none); --tiny checks the graphs on the CPU")
    device = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    extra = ["--cpu"] if args.tiny else args.comfyui_args.split()
    graphs = template_graphs(args.tiny)

    with contextlib.ExitStack() as stack:
        stack.enter_context(stdout_to_stderr())
        started = time.perf_counter()
        bundle, gemma_file = write_files(args, device, stack, "2.3", template_gemma_name())
        links = model_links(args.tiny, bundle, gemma_file)
        files_seconds = time.perf_counter() - started
        full_size_graphs = template_graphs(tiny_run=False) if args.tiny else dict.fromkeys(SIDES)
        stock = run_side("stock", graphs["stock"], args, links, extra, args.gpus[0], full_size_graphs["stock"]) if "stock" in sides else (None,) * 3
        fleets = {gpus: run_side("fleet", graphs["fleet"], args, links, extra, gpus, full_size_graphs["fleet"])
                  for gpus in args.gpus} if "fleet" in sides else {}  # fmt: skip
    tables = {gpus: report_table({"stock cold": stock[0], "stock warm": stock[1], "fleet cold": fleet[0], "fleet warm": fleet[1]})
              for gpus, fleet in (fleets or {"-": (None,) * 3}).items()}  # fmt: skip

    if args.tiny:
        ran = [("stock", stock)] if "stock" in sides else []
        lines, passed = tiny_report(graphs, full_size_graphs, ran + [("fleet", fleet) for fleet in fleets.values()])
        print(lines, flush=True)
        print("\n\n".join(tables.values()), flush=True)
        if not passed:
            raise SystemExit(1)
        return
    text = report_text(tables, files_seconds, extra)
    print(text, flush=True)
    if args.out:
        append_out(text, device, args.out)


if __name__ == "__main__":
    main()
