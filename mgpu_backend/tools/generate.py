"""``python -m mgpu_backend generate``: the whole two-stage LTX-2 job from the command line.

Flag names follow the official runner (``ltx_pipelines.ti2vid_two_stages``) where they exist; every
default is the schema's (``mgpu_backend.ltx.schema``) for the chosen ``--model-version``. Without
``--checkpoint-path`` it uses the embedded tiny bundle (random weights: the output is noise, but
every real component runs; the fleet makes or finds its files) at small sizes, and says so. It drives the same fleet jobs as
the ComfyUI nodes (load, encode, sample, upscale, decode), shows a progress bar per stage, cancels
cleanly on Ctrl-C, and writes an mp4 with H.264 video and AAC audio.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import replace

import torch

from mgpu_backend.ltx.schema import DISTILLED_LORA_STRENGTH, MODEL_VERSIONS, OFFICIAL, QUANTIZATIONS, RESIDENCY_POLICIES, STAGE_2_SIGMAS, TDP_UPSCALE_SIGMAS, ModelSpec, RequestError, defaults_for, request_model_version

DEFAULT_NEGATIVE_PROMPT = (
    "blurry, out of focus, overexposed, underexposed, low contrast, washed out colors, excessive noise, "
    "grainy texture, poor lighting, flickering, motion blur, distorted proportions, unnatural skin tones, "
    "deformed facial features, asymmetrical face, missing facial features, extra limbs, disfigured hands, "
    "wrong hand count, artifacts around text, inconsistent perspective, camera shake, incorrect depth of "
    "field, background too sharp, background clutter, distracting reflections, harsh shadows, inconsistent "
    "lighting direction, color banding, cartoonish rendering, 3D CGI look, unrealistic materials, uncanny "
    "valley effect, incorrect ethnicity, wrong gender, exaggerated expressions, wrong gaze direction, "
    "mismatched lip sync, silent or muted audio, distorted voice, robotic voice, echo, background noise, "
    "off-sync audio, incorrect dialogue, added dialogue, repetitive speech, jittery movement, awkward "
    "pauses, incorrect timing, unnatural transitions, inconsistent framing, tilted camera, flat lighting, "
    "inconsistent tone, cinematic oversaturation, stylized filters, or AI artifacts."
)  # ltx-pipelines 1.0.0's default negative prompt

# The tiny bundle's sizes, which must stay fast on a CPU (a real model gets the schema's defaults).
TINY_DEFAULTS = {"height": 128, "width": 192, "num_frames": 9, "num_inference_steps": 4}
MULTI_GPU_STAGE2_SIGMAS = TDP_UPSCALE_SIGMAS
SINGLE_GPU_STAGE2_SIGMAS = STAGE_2_SIGMAS


def real_defaults(model_version: str) -> dict:
    """The output size, frames and steps of a real model: the schema's (stage 2 doubles stage 1)."""
    official = defaults_for(model_version)
    return {"height": 2 * official.stage1_height, "width": 2 * official.stage1_width, "num_frames": official.num_frames, "num_inference_steps": official.steps}


def _listed(values) -> str:
    return ",".join(map(str, values))


def add_generate_parser(commands) -> None:
    parser = commands.add_parser("generate", help="run the two-stage LTX-2 job headless and write an mp4")
    model = parser.add_argument_group("model (omit all to use the embedded tiny bundle with random weights)")
    model.add_argument("--checkpoint-path", help="LTX-2 checkpoint (.safetensors)")
    model.add_argument("--gemma-root", help="Gemma-3 text encoder: a Hugging Face folder or ComfyUI's single file (gemma_3_12B_it.safetensors)")
    model.add_argument("--distilled-lora", nargs="+", metavar=("PATH", "STRENGTH"), help="distilled LoRA for stage 2, optional strength (default 1.0)")
    model.add_argument("--spatial-upsampler-path", help="spatial 2x latent upsampler (.safetensors)")
    model.add_argument("--lora", nargs="+", action="append", metavar=("PATH", "STRENGTH"), help="a user LoRA (repeatable)")
    model.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype (default bfloat16, as the official pipeline)")
    model.add_argument("--quantization", choices=QUANTIZATIONS, help="fp8-cast: transformer weights in float8, upcast per layer (about half its memory; as the official --quantization fp8-cast). Default: none")
    model.add_argument("--residency", choices=RESIDENCY_POLICIES, default=RESIDENCY_POLICIES[0], help="what stays on each GPU between jobs: auto (what fits), all, minimal (the transformer only) (default auto)")
    model.add_argument("--model-version", choices=MODEL_VERSIONS, help="LTX-2 version: a check only, the checkpoint's model_version metadata decides whose official defaults apply (a contradicting value is refused); without model flags, which embedded tiny bundle runs (default 2.0)")

    job = parser.add_argument_group("generation")
    job.add_argument("--prompt", required=True)
    job.add_argument("--negative-prompt", default=DEFAULT_NEGATIVE_PROMPT)
    job.add_argument("--output", "--output-path", dest="output", default="output.mp4", help="mp4 to write (default output.mp4)")
    real, tiny = real_defaults("2.0"), TINY_DEFAULTS
    job.add_argument("--seed", type=int, default=OFFICIAL.seed)
    job.add_argument("--height", type=int, help=f"output height, a multiple of 64 (default {real['height']}; tiny bundle {tiny['height']})")
    job.add_argument("--width", type=int, help=f"output width, a multiple of 64 (default {real['width']}; tiny bundle {tiny['width']})")
    job.add_argument("--num-frames", type=int, help=f"8k+1 frames (default {real['num_frames']}; tiny bundle {tiny['num_frames']})")
    job.add_argument("--frame-rate", type=float, default=OFFICIAL.frame_rate)
    job.add_argument("--num-inference-steps", type=int, help=f"stage-1 steps (default {real['num_inference_steps']} for 2.0, {real_defaults('2.3')['num_inference_steps']} for 2.3; tiny bundle {tiny['num_inference_steps']})")
    job.add_argument("--image", metavar="PATH", help="image-to-video: condition the first frame on this image")
    job.add_argument("--stage2-sigmas", default=_listed(TDP_UPSCALE_SIGMAS), help=f"stage-2 sigmas (default: TDP Upscale's {_listed(TDP_UPSCALE_SIGMAS)}; the official single-GPU stage 2: {_listed(STAGE_2_SIGMAS)})")
    job.add_argument("--tiles", default="auto", help="stage-2 TDP tiles HxW, or 'auto' (balanced over the fleet; untiled on one rank)")
    job.add_argument("--parallel", choices=("auto", "sp", "guidance", "hybrid"), default="auto", help="stage-1 plan (default auto)")
    job.add_argument("--free-gemma", action="store_true", help="give Gemma's GPU memory back after encoding the prompts (for GPUs where memory is tight)")
    job.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run the stage-1 forward eagerly instead of replaying captured CUDA graphs (GPU only)")
    job.add_argument("--compile-blocks", action="store_true", help="torch.compile the transformer blocks for stage 1 (GPU only; tens of seconds of compile per new shape, then faster small shards: for SP degree 4+)")
    job.add_argument("--debug-dump", metavar="PATH", help="write stage latents, frames (uint8) and waveform to this safetensors file")

    # Unset guidance flags take the schema's official values of --model-version (shown: 2.0's).
    guidance = parser.add_argument_group("guidance (default: the official values of the model version)")
    for modality, modality_flag in (("video", "--a2v-guidance-scale"), ("audio", "--v2a-guidance-scale")):
        official = getattr(OFFICIAL, f"{modality}_guidance")
        guidance.add_argument(f"--{modality}-cfg-guidance-scale", type=float, help=f"default {official.cfg_scale}")
        guidance.add_argument(f"--{modality}-stg-guidance-scale", type=float, help=f"default {official.stg_scale}")
        guidance.add_argument(f"--{modality}-rescale-scale", type=float, help=f"default {official.rescale_scale}")
        guidance.add_argument(modality_flag, type=float, dest=f"{modality}_modality_scale", help=f"default {official.modality_scale}")
        guidance.add_argument(f"--{modality}-skip-step", type=int, help=f"default {official.skip_step}")
        guidance.add_argument(f"--{modality}-stg-blocks", type=int, nargs="*", default=None, help=f"default: block {_listed(official.stg_blocks)} (2.3: {_listed(getattr(defaults_for('2.3'), f'{modality}_guidance').stg_blocks)}; the last block of a smaller model)")

    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--socket", help="attach to this fleet server (default: $MGPU_SOCKET, else start one for this run)")
    devices = fleet.add_mutually_exclusive_group()
    devices.add_argument("--gpus", help="GPUs for a fleet this run starts: 'all' or 0,1,2,3")
    devices.add_argument("--cpu-ranks", type=int, help="CPU ranks (gloo) for a fleet this run starts")
    parser.set_defaults(func=run_generate)


class StageProgress:
    """One progress line per stage: a bar, the step, seconds per step and the slowest rank."""

    def __init__(self, stream=sys.stderr) -> None:
        self.stream, self.stage, self.started = stream, None, time.perf_counter()

    def __call__(self, event: dict) -> None:
        stage, step, total = event.get("stage", ""), event.get("step", 0), event.get("total", 0)
        if stage != self.stage:
            if self.stage is not None:
                self.stream.write("\n")
            self.stage, self.started = stage, time.perf_counter()
        width = 24
        filled = int(width * step / max(total, 1))
        rank_seconds = [s for s in event.get("rank_seconds", []) if s is not None]
        slowest = f", slowest rank {max(rank_seconds):.2f} s" if len(rank_seconds) > 1 else ""
        self.stream.write(
            f"\r{stage:>9} [{'#' * filled}{'.' * (width - filled)}] {step}/{total} "
            f"{event.get('seconds', 0):.2f} s/step{slowest}   "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.stage is not None:
            self.stream.write("\n")
            self.stage = None


def _parse_floats(text: str, name: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"error: {name} takes numbers separated by commas, got {text!r}") from None


def _load_image(path: str) -> torch.Tensor:
    from PIL import Image

    import numpy as np

    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(pixels)


def build_spec(args) -> tuple[dict, bool]:
    """The model spec JSON, and whether it is the embedded tiny bundle (named, not written here)."""
    from mgpu_backend.ltx.loading import ModelFileError, validate_model_files

    given = [args.checkpoint_path, args.gemma_root, args.spatial_upsampler_path, args.distilled_lora]
    held = {"quantization": args.quantization, "residency": args.residency}
    if not any(given):
        return replace(ModelSpec.embedded_tiny(version=args.model_version or "2.0"), **held).to_wire(), True
    missing = [flag for flag, value in zip(("--checkpoint-path", "--gemma-root", "--spatial-upsampler-path", "--distilled-lora"), given) if not value]
    if missing:
        raise SystemExit(f"error: a real model needs {', '.join(missing)} too (or omit all model flags for the tiny bundle)")
    strength = float(args.distilled_lora[1]) if len(args.distilled_lora) > 1 else DISTILLED_LORA_STRENGTH
    loras = [(lora[0], float(lora[1]) if len(lora) > 1 else 1.0) for lora in args.lora or []]
    spec = ModelSpec(
        checkpoint_path=args.checkpoint_path,
        gemma_root=args.gemma_root,
        spatial_upsampler_path=args.spatial_upsampler_path,
        distilled_lora=args.distilled_lora[0],
        distilled_lora_strength=strength,
        loras=tuple(loras),
        **held,
    )
    try:  # from the files' headers: a wrong file stops here, before a fleet starts
        validate_model_files(spec)
    except ModelFileError as error:
        raise SystemExit(f"error: {error}") from None
    return spec.to_wire(), False


def run_generate(args) -> int:
    from mgpu_backend.ltx import api
    from mgpu_backend.fleet.client import FleetCancelled, FleetError
    from mgpu_backend.tools.media import write_mp4

    spec, tiny = build_spec(args)
    try:
        args.model_version = request_model_version(ModelSpec.from_wire(spec), args.model_version)
    except RequestError as error:
        raise SystemExit(f"error: --model-version: {error}") from None
    defaults = TINY_DEFAULTS if tiny else real_defaults(args.model_version)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if tiny:
        print(
            f"No checkpoint given: using the embedded tiny LTX-2 bundle of version {args.model_version} (random weights; the video is noise, every "
            f"real component runs) at {args.width}x{args.height}, {args.num_frames} frames, {args.num_inference_steps} steps.",
            file=sys.stderr,
        )
    if args.height % 64 or args.width % 64:
        raise SystemExit(f"error: height and width must be multiples of 64 for the two-stage job, got {args.height}x{args.width}")
    try:
        tiles = api.parse_tiles(args.tiles)
    except ValueError as exc:
        raise SystemExit(f"error: --tiles: {exc}") from None
    sigmas = _parse_floats(args.stage2_sigmas, "--stage2-sigmas")
    image = _load_image(args.image) if args.image else None
    video_guidance, audio_guidance = (
        api.Guidance(
            cfg_scale=getattr(args, f"{m}_cfg_guidance_scale"), stg_scale=getattr(args, f"{m}_stg_guidance_scale"),
            rescale_scale=getattr(args, f"{m}_rescale_scale"), modality_scale=getattr(args, f"{m}_modality_scale"),
            skip_step=getattr(args, f"{m}_skip_step"),
            stg_blocks=None if getattr(args, f"{m}_stg_blocks") is None else tuple(getattr(args, f"{m}_stg_blocks")),
        )  # fmt: skip
        for m in ("video", "audio")
    )
    api.configure(args.socket, args.gpus, args.cpu_ranks)
    cancelled = {"flag": False}

    def on_interrupt(*_):
        if cancelled["flag"]:
            raise KeyboardInterrupt
        cancelled["flag"] = True
        print("\ncancelling at the next step (Ctrl-C again to quit at once)...", file=sys.stderr)

    signal.signal(signal.SIGINT, on_interrupt)
    progress = StageProgress()
    common = dict(progress=progress, should_cancel=lambda: cancelled["flag"], dtype=args.dtype)
    started = time.perf_counter()
    try:
        loaded = api.load(spec, **common)
        progress.close()
        print(f"model loaded on the fleet ({loaded['bytes_read'] / 2**20:.1f} MiB read from disk)", file=sys.stderr)
        positive, negative = api.encode(spec, [args.prompt, args.negative_prompt], free_gemma=args.free_gemma, **common)
        video, audio = api.sample(
            spec, positive, negative, width=args.width // 2, height=args.height // 2, num_frames=args.num_frames,
            frame_rate=args.frame_rate, seed=args.seed, steps=args.num_inference_steps, video_guidance=video_guidance,
            audio_guidance=audio_guidance, image=image, parallel=args.parallel, cuda_graphs=args.cuda_graphs,
            compile_blocks=args.compile_blocks, model_version=args.model_version, **common,
        )  # fmt: skip
        stage1_video, stage1_audio = video, audio
        video, audio = api.upscale(
            spec, video, audio, positive, frame_rate=args.frame_rate, seed=args.seed, sigmas=sigmas, tiles=tiles,
            image=image, model_version=args.model_version, **common,
        )  # fmt: skip
        frames, waveform, sample_rate = api.decode(spec, video, audio, seed=args.seed, frame_rate=args.frame_rate, **common)
        progress.close()
    except FleetCancelled:
        progress.close()
        print("cancelled; the fleet is still up for the next job", file=sys.stderr)
        return 130
    except FleetError as exc:
        progress.close()
        where = f" (rank {exc.rank})" if exc.rank is not None else ""
        print(f"error{where}: {exc}", file=sys.stderr)
        if exc.traceback:
            print(exc.traceback, file=sys.stderr)
        return 1
    output = write_mp4(args.output, frames, args.frame_rate, waveform, sample_rate)
    print(f"wrote {output} ({frames.shape[0]} frames {frames.shape[2]}x{frames.shape[1]}, audio {sample_rate} Hz) in {time.perf_counter() - started:.1f} s")
    if args.debug_dump:
        from safetensors.torch import save_file

        save_file(
            {
                "stage1_video": stage1_video.contiguous(), "stage1_audio": stage1_audio.contiguous(),
                "stage2_video": video.contiguous(), "stage2_audio": audio.contiguous(),
                "frames": (frames.clamp(0, 1) * 255).round().to(torch.uint8).contiguous(),
                "waveform": waveform.contiguous(),
            },  # fmt: skip
            args.debug_dump,
        )
        print(f"debug dump: {args.debug_dump}")
    return 0
