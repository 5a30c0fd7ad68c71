"""The whole two-stage LTX-2 job: the fleet against the official single-GPU pipeline, side by side.

One run, on one random-weight bundle written first (``mgpu_backend.bundles.full_size``: the LTX-2
19B configuration, or the tiny one with ``--tiny``):

1. official: ltx-pipelines 1.0.0's ``TI2VidTwoStagesPipeline`` with the defaults of the bundle's model
   version (LTX-2.0: 40 steps, multimodal guidance, 1536x1024, 121 frames, 24 fps, seed 10; LTX-2.3
   with ``--model 2.3``: 30 steps, STG block 28) in this process. Its stages are
   timed by wrapping, from here, the module-level functions it calls (``encode_prompts``,
   ``denoise_audio_video`` for stage 1 and stage 2, ``upsample_video``, ``vae_decode_video`` with
   its iterator consumed, ``vae_decode_audio``), each between device synchronisations and with the
   peak device memory reset before it; its model builds outside those functions are its load time.
   Then it is freed entirely.
2. fleet (world 1 on one GPU by default): spawn, then the jobs the ComfyUI nodes run through
   ``mgpu_backend.ltx.api`` (load, encode, sample, upscale with the SINGLE-GPU stage-2 sigmas and one
   tile, so it does the official pipeline's work, or with ``--multi-gpu-stage2`` the fleet's own
   stage 2 as the nodes run it on several GPUs, decode), timed from this client; the frame
   handoff through shared memory is timed apart. Then the same job again on the warm fleet.

It prints one markdown table (stages x official / fleet cold / fleet warm, ratio, peak GPU memory)
with the whole-job ratio as its headline, per-step times to extrapolate to the official steps, the
residency the fleet's ranks decided (their load log), and how far
the outputs are apart: stage latents and decoded frames, official vs fleet. Audio is not compared
after stage 2: our stage 2 returns the stage-1 audio by design, the official one re-denoises it.

The bundle's Gemma is the Gemma-3 12B configuration with ``--gemma-layers`` of its 48 layers
(default 6, so that the bundle fits a small disk; text-encode times are then a lower bound, and the
table header and stderr say so). ``--gemma-layers 48`` is the released size.

    python bench/e2e.py --tiny                                              # CPU smoke run (under a minute)
    python bench/e2e.py --gemma-layers 48 --gemma-dir /dev/shm --out FILE   # one H200, full size

Full size on one H200 (measured 2026-11-29, docs/BENCHMARKS.md): with the 48-layer Gemma the
bundle is 75.4 GB of weights (checkpoint, distilled LoRA and upsampler 51.0, Gemma 24.4), written in 106 s,
checked against the free disk before writing; on a 64 GB disk ``--gemma-dir /dev/shm`` puts Gemma
in host memory instead. Host memory stayed under 35 GB besides that (the fleet keeps no host copy
of the resident transformer or Gemma); /dev/shm also needs 2.3 GB for the frames. The whole run
(bundle, official, fleet cold and warm at 40 steps) took 8 minutes.

Memory and weights (docs/fp8-and-residency.md): ``--quantization fp8-cast`` loads the transformer in
float8 on both sides (the official runner's option); ``--residency auto|all|minimal`` is the fleet's
residency policy; ``--memory-gb N`` caps every fleet rank, and this process for the official run, at
N GiB of the GPU (``torch.cuda.set_per_process_memory_fraction``, applied by the ranks at start-up from
``MGPU_MEMORY_FRACTION``), as on a smaller GPU; the residency policy plans for the cap. A job the
fleet refuses (it cannot fit even at the minimal residency) prints the fleet's refusal as the result
and exits 1. ``--fleet-only`` skips the official run and the comparison (a 10-minute machine slot
then holds the bundle and both fleet runs). ``--model 2.0|2.3`` picks the bundle's configuration;
``--pipeline two-stage|distilled`` the recipe (official side ``DistilledPipeline`` for the distilled one).

It never downloads anything; everything it writes goes to --bundle-dir (default: a temporary folder,
removed at the end) and --gemma-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import importlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from _common import append_out, log, markdown_table, stdout_to_stderr  # noqa: I001 - puts the repository on sys.path first
from ltx_core.components.guiders import MultiModalGuiderParams

from mgpu_backend.fleet.client import FleetError
from mgpu_backend.fleet.rank import MEMORY_FRACTION_ENV
from mgpu_backend.ltx import api
from mgpu_backend.ltx.diagnostics import bench_config
from mgpu_backend.ltx.recipes import DEFAULT_RECIPE, LORA_FILES, Recipe, recipe
from mgpu_backend.ltx.residency import GIB, MEMORY_LIMIT_ENV
from mgpu_backend.ltx.schema import MODEL_VERSIONS, PIPELINES, QUANTIZATIONS, RESIDENCY_POLICIES, LoadRequest, defaults_for
from mgpu_backend.tools.generate import DEFAULT_NEGATIVE_PROMPT, MULTI_GPU_STAGE2_SIGMAS, SINGLE_GPU_STAGE2_SIGMAS, TINY_DEFAULTS
from mgpu_backend.bundles import full_size as random_bundle
from mgpu_backend.bundles.configs import model_version as layout_version

PROMPT = (
    "A slow camera push toward a lighthouse on a rocky coast at dusk, waves breaking against the stones, "
    "gulls calling over the wind."
)
STAGES = ("fleet spawn", "load", "text encode", "stage 1", "upsample", "stage 2", "decode", "handoff")
OTHER = "other"  # official time outside every timed function: its gc / memory clean-up between stages


@dataclass(frozen=True)
class Job:
    """One two-stage job, as both sides run it."""

    height: int
    width: int
    num_frames: int
    frame_rate: float
    seed: int
    steps: int
    video_guider: MultiModalGuiderParams
    audio_guider: MultiModalGuiderParams
    prompt: str = PROMPT
    negative_prompt: str = DEFAULT_NEGATIVE_PROMPT
    multi_gpu_stage2: bool = False  # the fleet's own stage 2 (multi-GPU sigmas, TDP tiles) instead of the official work
    model_version: str = "2.0"
    pipeline: str = DEFAULT_RECIPE
    quantization: str | None = None  # "fp8-cast": the transformer's weights in float8, on both sides
    residency: str = "auto"  # the fleet's residency policy (the official pipeline builds one component at a time)
    official_steps: int = 40  # the model version's official stage-1 steps, which a shorter run is extrapolated to

    @property
    def fleet_stage2(self) -> tuple[tuple[float, ...], tuple[int, int] | None]:
        """The fleet's stage-2 sigmas and tiles (None: balanced over the fleet)."""
        return (MULTI_GPU_STAGE2_SIGMAS, None) if self.multi_gpu_stage2 else (SINGLE_GPU_STAGE2_SIGMAS, (1, 1))

    @property
    def frames_bytes(self) -> int:
        return self.num_frames * self.height * self.width * 3 * 4  # IMAGE: float32 RGB


@dataclass
class Run:
    """What one side measured: seconds and peak device bytes per stage, step times, outputs."""

    seconds: dict[str, float] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    step_seconds: dict[str, list[float]] = field(default_factory=dict)  # "stage 1" / "stage 2"
    total_seconds: float = 0.0
    latents: dict[str, torch.Tensor] = field(default_factory=dict)  # stage-1 video/audio, stage-2 video (CPU)
    frames_uint8: torch.Tensor | None = None  # [F, H, W, 3], as the official decoder converts
    frames_digest: str = ""  # sha256 of the float frames (fleet), to tell cold and warm apart exactly
    load_bytes_read: int = 0  # fleet: bytes its ranks read from model files in the load job
    bytes_read: int = 0  # ... and in the whole job (Gemma and the LoRA are read when first used)
    residency: list[str] = field(default_factory=list)  # fleet: the residency decision its ranks logged at load
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def uint8_like_official(frames: torch.Tensor) -> torch.Tensor:
    """IMAGE frames (0..1 float32, made from the decoder's bf16 output x as (x + 1) / 2) converted to
    uint8 the way ltx-core's ``decode_video`` converts x in bf16, so both sides compare level for level."""
    decoder_output = (frames * 2.0 - 1.0).to(torch.bfloat16)
    return (((decoder_output + 1.0) / 2.0).clamp(0.0, 1.0) * 255.0).to(torch.uint8)


@contextlib.contextmanager
def patched(target: object, name: str, value: object) -> Iterator[None]:
    original = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, original)


# --------------------------------------------------------------------------------------------------
# Official pipeline, timed from the outside
# --------------------------------------------------------------------------------------------------


class OfficialClock:
    """Times the official pipeline's stage functions and model builds; a build that happens inside a
    stage function (encode_prompts builds Gemma) belongs to that stage, the others are the load."""

    def __init__(self, device: torch.device, run: Run) -> None:
        self.device, self.run = device, run
        self.active: str | None = None
        self.denoise_calls = 0

    def _timed(self, stage: str, call: Callable, *args, what: str = "", **kwargs):
        synchronize(self.device)
        reset_peak(self.device)
        started = time.perf_counter()
        self.active = stage
        try:
            result = call(*args, **kwargs)
            synchronize(self.device)
        finally:
            self.active = None
        seconds = time.perf_counter() - started
        self.run.seconds[stage] = self.run.seconds.get(stage, 0.0) + seconds
        if (used := peak(self.device)) is not None:
            self.run.peak_bytes[stage] = max(self.run.peak_bytes.get(stage, 0), used)
        log(f"official {stage}{f' ({what})' if what else ''}: {seconds:.2f} s")
        return result

    def stage(self, stage: str, function: Callable) -> Callable:
        return lambda *args, **kwargs: self._timed(stage, function, *args, **kwargs)

    def denoise(self, function: Callable) -> Callable:
        """denoise_audio_video runs stage 1, then stage 2; keep each stage's output latents."""

        def timed(*args, **kwargs):
            self.denoise_calls += 1
            stage = f"stage {self.denoise_calls}"
            video_state, audio_state = self._timed(stage, function, *args, **kwargs)
            self.run.latents[f"{stage} video"] = video_state.latent.float().cpu()
            if stage == "stage 1":
                self.run.latents["stage 1 audio"] = audio_state.latent.float().cpu()
            return video_state, audio_state

        return timed

    def decode_video(self, function: Callable) -> Callable:
        """vae_decode_video returns a lazy iterator: decode it whole inside the timed region."""

        def decode_all(*args, **kwargs):
            return [chunk for chunk in function(*args, **kwargs)]

        return lambda *args, **kwargs: iter(self._timed("decode", decode_all, *args, **kwargs))

    def steps(self, loop: Callable) -> Callable:
        """euler_denoising_loop with a clock after every step (device synchronised)."""

        def timed_loop(*args, **kwargs):
            denoise_fn, marks = kwargs["denoise_fn"], [time.perf_counter()]

            def timed_step(*step_args, **step_kwargs):
                result = denoise_fn(*step_args, **step_kwargs)
                synchronize(self.device)
                marks.append(time.perf_counter())
                return result

            kwargs["denoise_fn"] = timed_step
            result = loop(*args, **kwargs)
            self.run.step_seconds[f"stage {self.denoise_calls}"] = [b - a for a, b in zip(marks, marks[1:])]
            return result

        return timed_loop

    def build(self, name: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self.active is not None:  # part of the stage that asked for it
                return function(*args, **kwargs)
            return self._timed("load", function, *args, what=f"build {name}", **kwargs)

        return timed


LEDGER_BUILDS = ("transformer", "video_encoder", "video_decoder", "audio_decoder", "vocoder", "spatial_upsampler", "text_encoder", "gemma_embeddings_processor")


def run_official(bundle: random_bundle.RandomBundle, job: Job, device: torch.device) -> Run:
    from ltx_core.model.video_vae import TilingConfig
    from ltx_core.text_encoders.gemma.encoders import encoder_configurator

    from mgpu_backend.ltx import fp8

    declared = recipe(job.pipeline)
    official = importlib.import_module(declared.official_runner.rsplit(".", 1)[0])  # the module whose stage functions are timed
    run = Run()
    clock = OfficialClock(device, run)
    gemma = json.loads((Path(bundle.gemma_root) / "config.json").read_text())
    with contextlib.ExitStack() as stack:
        # ltx-core hard-codes Gemma-3 12B (48 layers) for the text encoder and the feature projection.
        stack.enter_context(patched(encoder_configurator, "GEMMA3_CONFIG_FOR_LTX", random_bundle.ltx_core_gemma_config(gemma)))
        if device.type != "cuda":  # the pipeline synchronises CUDA unconditionally
            stack.enter_context(patched(torch.cuda, "synchronize", lambda *args, **kwargs: None))
            stack.enter_context(patched(torch.cuda, "empty_cache", lambda *args, **kwargs: None))
        for name, wrap in (
            ("encode_prompts", lambda f: clock.stage("text encode", f)),
            ("denoise_audio_video", clock.denoise),
            ("upsample_video", lambda f: clock.stage("upsample", f)),
            ("vae_decode_video", clock.decode_video),
            ("vae_decode_audio", lambda f: clock.stage("decode", f)),
            ("euler_denoising_loop", clock.steps),
        ):
            stack.enter_context(patched(official, name, wrap(getattr(official, name))))

        started = time.perf_counter()
        # The random bundle's checkpoint stands in for a distilled one too: same compute.
        paths = {"checkpoint_path": bundle.checkpoint_path, "distilled_lora": bundle.distilled_lora_path,
                 "spatial_upsampler_path": bundle.spatial_upsampler_path, "gemma_root": bundle.gemma_root}  # fmt: skip
        pipeline = official_pipeline(declared, paths, device=device, quantization=fp8.policy(job.quantization))  # the official runner's --quantization
        ledgers = [value for name, value in vars(pipeline).items() if name.endswith("model_ledger")]
        guidance = {} if not declared.guided else {
            "negative_prompt": job.negative_prompt, "num_inference_steps": job.steps,
            "video_guider_params": job.video_guider, "audio_guider_params": job.audio_guider,
        }  # fmt: skip
        run.seconds["load"] = time.perf_counter() - started  # builders only; the builds add to it
        for ledger in ledgers:
            for name in LEDGER_BUILDS:
                setattr(ledger, name, clock.build(name, getattr(ledger, name)))
        with torch.inference_mode():  # as the official runner's main()
            video_chunks, _audio = pipeline(
                prompt=job.prompt, seed=job.seed, height=job.height, width=job.width, num_frames=job.num_frames,
                frame_rate=job.frame_rate, images=[], tiling_config=TilingConfig.default(), **guidance,
            )  # fmt: skip
            frames = torch.cat([chunk.cpu() for chunk in video_chunks])  # decoded already, inside the clock
        synchronize(device)
        run.total_seconds = time.perf_counter() - started
    run.frames_uint8 = frames
    del pipeline, video_chunks, _audio
    free_device_memory(device)
    if device.type == "cuda":  # the fleet gets the GPU next: nothing of the official run may stay on it
        log(f"official pipeline freed: {torch.cuda.memory_allocated(device) / 2**20:.0f} MiB still allocated in this process")
    same_transformer = declared.stage1.lora_set == declared.stage2.lora_set
    builds = "the transformer once (both stages)" if same_transformer else "the transformer twice (stage 1, then stage 2 with the distilled LoRA fused), the VAE encoder twice"
    run.notes.append(
        f"official load = its model builds outside the stage functions: {builds}, upsampler, decoders, vocoder; its text "
        "encode includes building Gemma, as the fleet's cold encode does"
    )
    return run


# --------------------------------------------------------------------------------------------------
# Fleet, timed from its client
# --------------------------------------------------------------------------------------------------


class Timeline:
    """Progress events of the fleet's jobs, stamped on arrival at this client."""

    def __init__(self) -> None:
        self.events: list[tuple[float, dict]] = []

    def __call__(self, event: dict) -> None:
        self.events.append((time.perf_counter(), event))

    def arrival(self, stage: str, step: int | None = None, after: float = 0.0) -> float:
        for stamp, event in self.events:
            if stamp >= after and event.get("stage") == stage and (step is None or event.get("step") == step):
                return stamp
        raise RuntimeError(f"no progress event {stage!r} step {step} arrived; the job did not report it")

    def step_seconds(self, stage: str, after: float) -> list[float]:
        return [event["seconds"] for stamp, event in self.events if stamp >= after and event.get("stage") == stage]


def fleet_peak(device: torch.device) -> int | None:
    """Rank 0's peak device memory in the job that just ended (ranks reset the counter per job)."""
    if device.type != "cuda":
        return None
    memory = api.status()["ranks"][0].get("memory") or {}
    return memory.get("peak")


def official_pipeline(declared: Recipe, paths: dict[str, str], **options):
    """The official runner of ``declared`` (``Recipe.official_runner``) on ``paths`` (model spec field ->
    file): each file goes to the keyword the CLI flag naming it follows, a LoRA at strength 1.0."""
    from ltx_core.loader import LTXV_LORA_COMFY_RENAMING_MAP, LoraPathStrengthAndSDOps

    module_name, class_name = declared.official_runner.rsplit(".", 1)
    files = {}
    for file in declared.files:
        path = paths[file.spec_field]
        lora = [LoraPathStrengthAndSDOps(path, 1.0, LTXV_LORA_COMFY_RENAMING_MAP)] if file.spec_field in LORA_FILES else None
        files[file.flag.lstrip("-").replace("-", "_")] = lora or path
    return getattr(importlib.import_module(module_name), class_name)(loras=[], **files, **options)


def recipe_args(job: Job) -> dict:
    """The recipe fields of the sample and upscale jobs: the model version and the pipeline."""
    return {"model_version": job.model_version, "pipeline": job.pipeline}


def residency_lines(job_log: list[str]) -> list[str]:
    """The residency decisions in a load job's log lines ("[rank R] residency auto: ..."), each text once:
    identical decisions of several ranks become one line naming them all."""
    ranks_of: dict[str, list[str]] = {}
    for line in job_log:
        tag, _, text = line.partition("] ")
        if text.startswith(tuple(f"residency {policy}: " for policy in RESIDENCY_POLICIES)):  # ResidencyPlan.describe()
            ranks_of.setdefault(text, []).append(tag.removeprefix("[rank "))
    return [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)}: {text}" for text, ranks in ranks_of.items()]


def run_fleet_job(spec: dict, job: Job, device: torch.device, read_before: int) -> Run:
    """The two-stage job through the fleet's API, every stage timed from this client."""
    run, timeline = Run(), Timeline()
    common = {"progress": timeline}

    def timed(call: Callable):
        started = time.perf_counter()
        return call(), started, time.perf_counter()

    def record(stages: dict[str, float]) -> None:
        used = fleet_peak(device)  # one reading after the job, for every stage the job ran
        for stage, seconds in stages.items():
            run.seconds[stage], run.peak_bytes[stage] = seconds, used
            log(f"fleet {stage}: {seconds:.2f} s")

    # api.load, keeping the job's log lines: the ranks say there which residency they chose.
    load_request, load_log = LoadRequest.from_wire({"spec": spec}), []
    loaded, started, ended = timed(lambda: api.run(load_request.op, load_request.to_wire(), progress=timeline, log=load_log.append).fields)
    record({"load": ended - started})
    run.residency = residency_lines(load_log)
    for line in run.residency:
        log(f"fleet {line}")
    run.load_bytes_read = loaded["bytes_read"] - read_before  # the rank's count is cumulative
    (positive, negative), started, ended = timed(lambda: api.encode(spec, [job.prompt, job.negative_prompt], **common))
    record({"text encode": ended - started})
    guidance = {} if not recipe(job.pipeline).guided else {  # an unguided recipe (distilled): the schema's, no guidance
        f"{name}_guidance": api.Guidance(
            cfg_scale=params.cfg_scale, stg_scale=params.stg_scale, rescale_scale=params.rescale_scale,
            modality_scale=params.modality_scale, skip_step=params.skip_step, stg_blocks=tuple(params.stg_blocks),
        )  # fmt: skip
        for name, params in (("video", job.video_guider), ("audio", job.audio_guider))
    }
    (video, audio), started, ended = timed(
        lambda: api.sample(
            spec, positive, negative, width=job.width // 2, height=job.height // 2, num_frames=job.num_frames,
            frame_rate=job.frame_rate, seed=job.seed, steps=job.steps, parallel="auto", **recipe_args(job), **guidance, **common,
        )  # fmt: skip
    )
    record({"stage 1": ended - started})
    run.step_seconds["stage 1"] = timeline.step_seconds("stage1", after=started)

    sigmas, tiles = job.fleet_stage2
    (video2, audio2), started, ended = timed(
        lambda: api.upscale(
            spec, video, audio, positive, frame_rate=job.frame_rate, seed=job.seed, sigmas=sigmas, tiles=tiles, **recipe_args(job), **common,
        )  # fmt: skip
    )
    # One job does both: the upsampler reports when it is done, the rest is stage 2.
    upsampled_at = timeline.arrival("upsample", after=started)
    record({"upsample": upsampled_at - started, "stage 2": ended - upsampled_at})
    run.step_seconds["stage 2"] = timeline.step_seconds("stage2", after=started)
    run.latents = {"stage 1 video": video, "stage 1 audio": audio, "stage 2 video": video2}
    if recipe(job.pipeline).stage2_policy == "tdp" and not torch.equal(audio2, audio):
        raise RuntimeError(f"the fleet's {job.pipeline} stage 2 (TDP) must return the stage-1 audio latent unchanged")
    run.latents["stage 2 audio"] = audio2

    (frames, _waveform, _rate), started, ended = timed(
        lambda: api.decode(spec, video2, audio2, seed=job.seed, frame_rate=job.frame_rate, **common)
    )
    # The job reports its last step when the audio is decoded; what follows is the result's trip:
    # rank 0's frames already sit in shared memory, the client maps them, then touches every page.
    decoded_at = timeline.arrival("audio decode", step=1, after=started)
    touch_started = time.perf_counter()
    float(frames.view(-1)[:: 4096 // frames.element_size()].sum())
    touched = time.perf_counter() - touch_started
    record({"decode": decoded_at - started})
    run.seconds["handoff"] = ended - decoded_at + touched
    log(f"fleet handoff: {run.seconds['handoff']:.2f} s")
    run.frames_digest = hashlib.sha256(frames.numpy().view("uint8")).hexdigest()
    run.frames_uint8 = uint8_like_official(frames)
    del frames
    run.total_seconds = sum(run.seconds.values())
    # The rank counts the bytes it read from model files since it loaded the model; a load of the
    # resident model reads nothing, so one more (untimed) gives the count after this whole job.
    run.bytes_read = api.load(spec)["bytes_read"] - read_before
    return run


def run_fleet(spec: dict, job: Job, device: torch.device, gpus: str | None, cpu_ranks: int | None, socket_dir: str,
              fleet_log: str | None = None) -> tuple[Run, Run]:  # fmt: skip
    """Spawn a private fleet, run the job cold (spawn + first load) and warm; shut it down. The
    fleet's log (every job's lines from every rank: plans, bytes read, Gemma placement, per-rank
    decode memory) is copied to ``fleet_log`` when given."""
    api.configure(str(Path(socket_dir) / "fleet.sock"), gpus=gpus, cpu_ranks=cpu_ranks)
    started = time.perf_counter()
    api.fleet()  # starts the server; it returns once every rank is up
    spawn_seconds = time.perf_counter() - started
    log(f"fleet spawn: {spawn_seconds:.2f} s")
    try:
        log("fleet: cold run ...")
        cold = run_fleet_job(spec, job, device, read_before=0)
        cold.seconds["fleet spawn"] = spawn_seconds
        cold.total_seconds += spawn_seconds
        log(f"fleet cold: {cold.total_seconds:.1f} s; warm run ...")
        warm = run_fleet_job(spec, job, device, read_before=cold.bytes_read)
        log(f"fleet warm: {warm.total_seconds:.1f} s")
    finally:
        api.restart()  # shuts the server and its ranks down
        if fleet_log:
            shutil.copyfile(Path(socket_dir) / "server.log", fleet_log)
            log(f"fleet log copied to {fleet_log}")
    cold.notes.append(
        "fleet stage 2 = its upscale job after the upsampler reported; it includes the LoRA swap of the "
        "resident transformer (the warm stage 1 includes the swap back)"
    )
    return cold, warm


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def gemma_deviation(config: random_bundle.BundleConfig) -> str:
    text = config.gemma["text_config"]
    if text["hidden_size"] == 3840 and config.gemma_layers == random_bundle.GEMMA_FULL_LAYERS:
        return f"Gemma-3 text encoder: the released 12B configuration (hidden 3840, {config.gemma_layers} layers)"
    return (
        f"Gemma-3 text encoder: hidden {text['hidden_size']}, {config.gemma_layers} layers (the released 12B model: "
        f"hidden 3840, {random_bundle.GEMMA_FULL_LAYERS} layers), so text-encode times are a lower bound"
    )


def stage2_text(job: Job) -> str:
    if job.multi_gpu_stage2:
        return (
            f"fleet stage 2: the multi-GPU sigmas {', '.join(map(str, MULTI_GPU_STAGE2_SIGMAS))} with TDP tiles balanced over "
            f"the fleet; official stage 2: its own sigmas {', '.join(map(str, SINGLE_GPU_STAGE2_SIGMAS))}, untiled"
        )
    return f"stage 2: sigmas {', '.join(map(str, SINGLE_GPU_STAGE2_SIGMAS))}, untiled"


def seconds_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def ratio_text(official: float | None, fleet: float | None) -> str:
    return "-" if official is None or not fleet else f"{official / fleet:.2f}"


def memory_text(value: int | None, device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    return "-" if value is None else f"{value / 2**30:.1f}"


def median_step(steps: list[float]) -> float | None:
    """The median step, leaving out the first (it carries the stage's set-up)."""
    timed = steps[1:] or steps
    return statistics.median(timed) if timed else None


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        raise RuntimeError(f"outputs of different shapes: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.float() - b.float()).abs().max().item()


def setup_text(job: Job, config: random_bundle.BundleConfig, memory_cap: str | None) -> str:
    """One sentence: the bundle, the job, the weights and what the fleet may keep."""
    transformer = config.checkpoint["transformer"]
    weights = "bf16" + (", fp8-cast transformer weights" if job.quantization else "")
    cap = f"; {memory_cap}" if memory_cap else ""
    return (
        f"LTX-{job.model_version} {job.pipeline} job on a random-weight bundle ({transformer['num_layers']}-layer transformer, "
        f"{transformer['num_attention_heads']} heads), {job.width}x{job.height}, {job.num_frames} frames, {job.frame_rate:g} fps, "
        f"{job.steps} stage-1 steps, seed {job.seed}, {weights}, fleet residency {job.residency}{cap}; {stage2_text(job)}. "
        f"{gemma_deviation(config)}."
    )


def report(job: Job, config: random_bundle.BundleConfig, official: Run | None, cold: Run, warm: Run, device: torch.device, world: str,
           memory_cap: str | None = None) -> str:  # fmt: skip
    """The table and the notes; ``official`` None: the official run was skipped (--fleet-only)."""
    rows = []
    for stage in STAGES:
        cold_s, warm_s = cold.seconds.get(stage), warm.seconds.get(stage)
        if official is None:
            rows.append([stage, seconds_text(cold_s), seconds_text(warm_s), memory_text(cold.peak_bytes.get(stage), device)])
            continue
        official_s = None if stage in ("fleet spawn", "handoff") else official.seconds.get(stage, 0.0)
        rows.append(
            [
                stage,
                seconds_text(official_s),
                seconds_text(cold_s),
                seconds_text(warm_s),
                f"{ratio_text(official_s, cold_s)} / {ratio_text(official_s, warm_s)}",
                f"{memory_text(official.peak_bytes.get(stage), device)} / {memory_text(cold.peak_bytes.get(stage), device)}",
            ]
        )
    fleet_peak_text = memory_text(max((v for v in cold.peak_bytes.values() if v is not None), default=None), device)
    if official is None:
        rows.append(["**total**", f"**{cold.total_seconds:.2f}**", f"**{warm.total_seconds:.2f}**", fleet_peak_text])
        headers = ["stage", "fleet s (cold)", "fleet s (warm)", "peak GPU GiB fleet"]
        headline = (
            f"**Whole job: fleet {world} cold {cold.total_seconds:.1f} s, warm {warm.total_seconds:.1f} s; the official pipeline "
            "was not run (--fleet-only): no comparison.**"
        )
    else:
        official_other = official.total_seconds - sum(official.seconds.values())
        rows.append([OTHER, seconds_text(official_other), "-", "-", "-", "-"])
        rows.append(
            [
                "**total**",
                f"**{official.total_seconds:.2f}**",
                f"**{cold.total_seconds:.2f}**",
                f"**{warm.total_seconds:.2f}**",
                f"**{ratio_text(official.total_seconds, cold.total_seconds)} / {ratio_text(official.total_seconds, warm.total_seconds)}**",
                f"{memory_text(max(official.peak_bytes.values(), default=None), device)} / {fleet_peak_text}",
            ]
        )
        headers = ["stage", "official s", "fleet s (cold)", "fleet s (warm)", "official / fleet (cold / warm)", "peak GPU GiB official / fleet"]
        headline = (
            f"**Whole job: official {official.total_seconds:.1f} s; fleet {world} cold {cold.total_seconds:.1f} s "
            f"(official / fleet = {official.total_seconds / cold.total_seconds:.2f}), warm {warm.total_seconds:.1f} s "
            f"(official / fleet = {official.total_seconds / warm.total_seconds:.2f}).**"
        )
    lines = [headline, "", setup_text(job, config, memory_cap), "", markdown_table(headers, rows), ""]
    lines += [f"- fleet residency (its load log): {line}" for line in cold.residency] or ["- fleet residency: no decision in the load job's log"]
    sides = ([("official", official)] if official is not None else []) + [("fleet cold", cold), ("warm", warm)]
    for stage in ("stage 1", "stage 2"):
        values = ", ".join(f"{name} {seconds_text(median_step(run.step_seconds.get(stage, [])))}" for name, run in sides)
        lines.append(f"- {stage} s/step (median, first step left out): {values}")
    stage1_steps = [median_step(run.step_seconds.get("stage 1", [])) for _, run in sides]
    if job.steps != job.official_steps and all(value is not None for value in stage1_steps):
        estimates = {name: run.total_seconds + (job.official_steps - job.steps) * step for (name, run), step in zip(sides, stage1_steps)}
        text = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in estimates.items())
        if official is not None:
            text += f" (official / fleet cold = {estimates['official'] / estimates['fleet cold']:.2f}, warm {estimates['official'] / estimates['warm']:.2f})"
        lines.append(f"- whole job at the official {job.official_steps} stage-1 steps (extrapolated with these step times): {text}")
    lines.append(
        f"- bytes the fleet read from model files: cold load {cold.load_bytes_read / 1e9:.2f} GB, cold job "
        f"{cold.bytes_read / 1e9:.2f} GB (Gemma and the LoRA are read when first used); warm load "
        f"{warm.load_bytes_read} bytes, warm job {warm.bytes_read} bytes"
    )
    if official is not None:
        lines += comparison_lines(job, official, cold)
    same = cold.frames_digest == warm.frames_digest
    lines.append(f"- fleet cold vs warm frames: {'bitwise equal' if same else 'DIFFER'}")
    lines += [f"- {note}" for note in (official.notes if official is not None else []) + cold.notes]
    if official is not None:
        lines.append(f"- {OTHER}: the official pipeline's time outside the functions above (garbage collection and CUDA cache release between stages)")
    if device.type == "cuda":
        lines.append(
            "- peak GPU memory: official = the peak within each stage (reset before it); fleet = rank 0's peak within "
            "each job (ranks reset it per job), which holds the resident weights of every component loaded so far"
        )
    lines.append(
        "- the bundle was written (or reused) just before, so the loads read its files mostly from the page "
        "cache: they measure a machine that has read the model before, not a cold disk"
    )
    return "\n".join(lines)


def comparison_lines(job: Job, official: Run, cold: Run) -> list[str]:
    """How far the fleet's outputs are from the official ones: same seed, weights and sigmas, untiled
    stage 2; equal or within bf16 noise."""
    lines = []
    compared = ("stage 1 video", "stage 1 audio") if job.multi_gpu_stage2 else ("stage 1 video", "stage 1 audio", "stage 2 video")
    for name in compared:
        lines.append(f"- max abs diff official vs fleet, {name} latent: {max_abs_diff(official.latents[name], cold.latents[name]):.3g}")
    if job.multi_gpu_stage2:
        lines.append(
            "- stage 2 and the frames are not compared: the fleet ran its multi-GPU stage 2 (other sigmas, TDP tiles) by design"
        )
    else:
        frames_diff = (official.frames_uint8.to(torch.int16) - cold.frames_uint8.to(torch.int16)).abs()
        lines.append(
            f"- decoded video frames, official vs fleet: max abs diff {frames_diff.max().item()} uint8 levels, "
            f"{(frames_diff > 0).float().mean().item() * 100:.3g}% of values differ (the fleet's float frames converted as "
            "ltx-core converts; audio not compared: the fleet's stage 2 keeps the stage-1 audio by design, the official one re-denoises it)"
        )
    return lines


def refusal_report(job: Job, config: random_bundle.BundleConfig, error: FleetError, world: str, memory_cap: str | None) -> str:
    """What the bench prints when the fleet refuses the job (or a job fails): the fleet's own words."""
    where = f" on rank {error.rank}" if error.rank is not None else ""
    what = "refused the job" if error.kind == "input_error" else f"failed the job ({error.kind})"
    return f"**The fleet {world} {what}{where}:** {error}\n\n{setup_text(job, config, memory_cap)}"


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def check_space(path: Path, needed: int, what: str, remedy: str) -> None:
    free = shutil.disk_usage(path).free
    if free < needed:
        raise SystemExit(f"error: {what} needs {needed / 1e9:.1f} GB but {path} has {free / 1e9:.1f} GB free; {remedy}")


def cap_memory(memory_gib: float | None, device: torch.device) -> str | None:
    """Cap the fleet's ranks (through the environment they inherit) and this process at ``memory_gib``;
    returns the cap as the report states it (None: uncapped).

    On a GPU the ranks apply ``MGPU_MEMORY_FRACTION`` (the rank loop's start-up hook) and the residency
    policy plans for total x fraction; this process, which runs the official pipeline, gets the same
    fraction. CPU ranks cannot be capped: the residency policy's budget ``MGPU_MEMORY_LIMIT_GIB`` is set
    instead, so a model that would not fit is refused there as it would be on the GPU."""
    if memory_gib is None:
        return None
    if device.type != "cuda":
        os.environ[MEMORY_LIMIT_ENV] = f"{memory_gib:g}"
        return f"CPU ranks planned for {memory_gib:g} GiB ({MEMORY_LIMIT_ENV}; nothing enforces it on a CPU)"
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = memory_gib * GIB / total
    if fraction > 1:
        raise SystemExit(f"error: --memory-gb {memory_gib:g} is more than the GPU's {total / GIB:.1f} GiB; leave it out to use the whole GPU")
    os.environ[MEMORY_FRACTION_ENV] = repr(fraction)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return f"every process capped at {memory_gib:g} GiB of the GPU's {total / GIB:.1f} GiB (memory fraction {fraction:.4f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny configuration and size (CPU unless --gpus): a smoke run")
    parser.add_argument("--model", choices=MODEL_VERSIONS, default="2.0", help="model version: 2.0 (19B) or 2.3 (22B layout); picks the bundle's configuration and the official defaults (default 2.0)")
    parser.add_argument("--pipeline", choices=PIPELINES, default=DEFAULT_RECIPE, help=f"recipe, one of {', '.join(PIPELINES)} (default {DEFAULT_RECIPE})")
    parser.add_argument("--config", help="full size: transformer configuration (default: the --model's, configs/ltx2-19b-transformer.json or configs/ltx2.3-22b-transformer.json)")
    parser.add_argument("--gemma-layers", type=int, default=random_bundle.DEFAULT_GEMMA_LAYERS, help="full size: layers of the Gemma-3 12B text encoder (released: 48; default 6, text encode is then a lower bound)")
    parser.add_argument("--lora-rank", type=int, default=random_bundle.FULL_SIZE_LORA_RANK, help="full size: distilled LoRA rank (default 384, as the official one)")
    parser.add_argument("--steps", type=int, help="stage-1 steps (default 40, the official default; tiny: 4)")
    parser.add_argument("--height", type=int, help="final height, a multiple of 64 (default 1024; tiny 128)")
    parser.add_argument("--width", type=int, help="final width, a multiple of 64 (default 1536; tiny 192)")
    parser.add_argument("--num-frames", type=int, help="8k+1 frames (default 121; tiny 9)")
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument("--gpus", help="GPUs of the fleet, e.g. 0 or 0,1 (default 0); the official pipeline runs on the first")
    devices.add_argument("--cpu-ranks", type=int, help="a CPU fleet of N ranks (gloo); the official pipeline runs on the CPU")
    parser.add_argument("--bundle-dir", help="where to write the random bundle, reused if complete (default: a temporary folder, removed)")
    parser.add_argument("--gemma-dir", help="a folder on another disk (e.g. /dev/shm) for the bundle's Gemma, when the bundle's disk cannot hold it beside the checkpoint; a temporary folder inside it unless --bundle-dir is given")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (the job's seed is the official 10)")
    parser.add_argument("--multi-gpu-stage2", action="store_true", help="the fleet runs its own stage 2 (multi-GPU sigmas 0.625,0.4,0.0, TDP tiles over the fleet) instead of the official work; stage 2 and the frames are then not compared")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="fp8-cast: the transformer's weights in float8, upcast per layer, on both sides (default: none, bf16)")
    parser.add_argument("--residency", choices=RESIDENCY_POLICIES, default="auto", help="what the fleet keeps on the GPU: what fits (auto, the default), everything (all), the transformer only (minimal)")
    parser.add_argument("--memory-gb", type=float, help="cap every fleet rank, and the official run, at this many GiB of its GPU (torch.cuda.set_per_process_memory_fraction), as on a smaller GPU; CPU ranks: the residency policy's budget only")
    parser.add_argument("--fleet-only", action="store_true", help="skip the official pipeline and the comparison of outputs: the fleet's cold and warm runs only")
    parser.add_argument("--fleet-log", help="copy the fleet's log (every job's lines from every rank: plans, bytes read, Gemma placement, per-rank decode memory) to this file")
    parser.add_argument("--out", help="append command, machine, date and the results to this file")
    args = parser.parse_args()
    if args.memory_gb is not None and not args.memory_gb > 0:
        parser.error(f"--memory-gb must be a positive number of GiB, got {args.memory_gb}")

    on_cpu = args.cpu_ranks is not None or (args.tiny and args.gpus is None) or not torch.cuda.is_available()
    if on_cpu and not args.tiny:
        raise SystemExit("error: the full-size job needs a GPU (torch sees none, or --cpu-ranks was given); use --tiny on a CPU")
    gpus = None if on_cpu else (args.gpus or "0")
    cpu_ranks = (args.cpu_ranks or 1) if on_cpu else None
    device = torch.device("cpu") if on_cpu else torch.device("cuda", int(gpus.split(",")[0]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = f"world {len(gpus.split(','))} (GPU {gpus})" if gpus else f"world {cpu_ranks} (CPU)"

    if args.tiny:
        config = random_bundle.tiny_config(args.model)
        defaults = {"height": TINY_DEFAULTS["height"], "width": TINY_DEFAULTS["width"], "num_frames": TINY_DEFAULTS["num_frames"], "steps": TINY_DEFAULTS["num_inference_steps"]}
    else:
        transformer = bench_config(args.model, args.config)["transformer"]
        config = random_bundle.full_size_config(transformer, args.gemma_layers, args.lora_rank)
        defaults = {"height": None, "width": None, "num_frames": None, "steps": None}  # the official defaults
    if not layout_version(config.checkpoint).startswith(args.model):
        raise SystemExit(f"error: {args.config} is an LTX-{layout_version(config.checkpoint)} transformer, but --model is {args.model}; give the matching --model or --config")
    log(f"note: {gemma_deviation(config)}")

    with contextlib.ExitStack() as stack:
        stack.enter_context(stdout_to_stderr())
        if args.bundle_dir:
            bundle_dir = Path(args.bundle_dir)
            bundle_dir.mkdir(parents=True, exist_ok=True)
        else:
            bundle_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-e2e-bundle-")))
        gemma_dir = None
        if args.gemma_dir:
            gemma_dir = Path(args.gemma_dir) if args.bundle_dir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-e2e-gemma-", dir=args.gemma_dir)))
            gemma_dir.mkdir(parents=True, exist_ok=True)  # the Gemma folder itself (e.g. /dev/shm/e2e-gemma): its disk is checked next
        planned_files = random_bundle.planned_bytes(config)
        planned = sum(planned_files.values())
        gemma_bytes = sum(size for name, size in planned_files.items() if name.startswith(random_bundle.GEMMA_DIR_NAME + "/"))
        if not random_bundle.is_complete(bundle_dir, config, device, args.seed):
            remedy = "point --bundle-dir (or --gemma-dir) at a larger disk, or lower --gemma-layers / --lora-rank"
            if gemma_dir is None:
                check_space(bundle_dir, planned + (1 << 30), "the random bundle", remedy)
            else:
                check_space(bundle_dir, planned - gemma_bytes + (1 << 30), "the random bundle without Gemma", remedy)
                check_space(gemma_dir, gemma_bytes + (1 << 30), "the bundle's Gemma", remedy)
        where = f"{bundle_dir}" + (f", Gemma ({gemma_bytes / 1e9:.1f} GB) in {gemma_dir}" if gemma_dir else "")
        log(f"random bundle: {planned / 1e9:.1f} GB of weights in {where}, drawn on {device} ...")
        started = time.perf_counter()
        bundle = random_bundle.write_bundle(bundle_dir, config, device, args.seed, log=log, gemma_dir=gemma_dir)
        log(f"bundle ready in {time.perf_counter() - started:.1f} s")
        free_device_memory(device)

        from ltx_pipelines.utils.constants import detect_params

        official_params = detect_params(bundle.checkpoint_path)  # from the bundle's model_version metadata, as --model chose
        last_block = config.checkpoint["transformer"]["num_layers"] - 1
        guiders = [  # the official STG block 29, or a smaller model's last block
            replace(params, stg_blocks=[min(block, last_block) for block in params.stg_blocks])
            for params in (official_params.video_guider_params, official_params.audio_guider_params)
        ]
        steps = args.steps or defaults["steps"] or official_params.num_inference_steps
        official_steps = official_params.num_inference_steps
        declared = recipe(args.pipeline)
        if declared.fixed_steps is not None:  # its fixed sigmas
            official_steps = defaults_for(args.model, args.pipeline).steps
            if args.steps not in (None, official_steps):
                raise SystemExit(f"error: the {args.pipeline} pipeline runs its {official_steps} fixed sigmas, got --steps {args.steps}; leave --steps out")
            steps = official_steps
        if not declared.guided:  # one positive-only pass per step
            guiders = [MultiModalGuiderParams(), MultiModalGuiderParams()]
        job = Job(
            height=args.height or defaults["height"] or official_params.stage_2_height,
            width=args.width or defaults["width"] or official_params.stage_2_width,
            num_frames=args.num_frames or defaults["num_frames"] or official_params.num_frames,
            frame_rate=official_params.frame_rate,
            seed=official_params.seed,
            steps=steps,
            video_guider=guiders[0],
            audio_guider=guiders[1],
            multi_gpu_stage2=args.multi_gpu_stage2,
            model_version=args.model,
            pipeline=args.pipeline,
            quantization=args.quantization,
            residency=args.residency,
            official_steps=official_steps,
        )
        if job.height % 64 or job.width % 64 or (job.num_frames - 1) % 8:
            raise SystemExit(f"error: the two-stage job needs height and width multiples of 64 and 8k+1 frames, got {job.width}x{job.height}x{job.num_frames}")
        if os.path.isdir("/dev/shm"):
            check_space(Path("/dev/shm"), job.frames_bytes + (256 << 20), "the decoded frames' shared-memory handoff", "enlarge /dev/shm or lower the size")

        memory_cap = cap_memory(args.memory_gb, device)
        official = None
        if args.fleet_only:
            log("official pipeline: skipped (--fleet-only)")
        else:
            log(f"official pipeline: {job.width}x{job.height}x{job.num_frames}, {job.steps} steps on {device} ...")
            try:
                official = run_official(bundle, job, device)
            except torch.OutOfMemoryError as exc:
                raise SystemExit(
                    f"error: the official pipeline ran out of GPU memory ({memory_cap or 'uncapped'}): {str(exc).splitlines()[0]}; "
                    "run with --fleet-only to measure the fleet alone, or raise --memory-gb"
                ) from None
            log(f"official pipeline: {official.total_seconds:.1f} s")
        socket_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="mgpu-e2e-fleet-"))
        os.chmod(socket_dir, 0o700)
        spec = replace(bundle.spec(), quantization=job.quantization, residency=job.residency)
        # The files the recipe refuses (distilled: no LoRA, the bundle's checkpoint stands in) leave the spec.
        spec = replace(spec, **{file.spec_field: None for file, _why in recipe(job.pipeline).refused})
        spec = spec.to_json()
        try:
            cold, warm = run_fleet(spec, job, device, gpus, cpu_ranks, socket_dir, args.fleet_log)
        except FleetError as exc:  # a model that does not fit is refused in the fleet's words, not with a traceback
            text, failed = refusal_report(job, config, exc, world, memory_cap), True
            if exc.kind != "input_error" and exc.traceback:  # a fault (an out of memory past the plan): where, for stderr only
                log(f"the failing rank's traceback:\n{exc.traceback}")
        else:
            text, failed = report(job, config, official, cold, warm, device, world, memory_cap), False
    print(text, flush=True)
    if args.out:
        append_out(text, device, args.out)
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
