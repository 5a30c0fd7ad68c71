"""``python -m mgpu_backend generate``: the whole two-stage LTX-2 job from the command line.

Every recipe of ``mgpu_backend.ltx.recipes`` (``--pipeline``): ``two-stage`` (the default: the dev
checkpoint, guided stage 1, stage 2 with the distilled LoRA), ``distilled`` (the distilled
checkpoint, 8 + 3 unguided steps, no LoRA, no negative prompt) and ``hq`` (LTX-2.3 only: the dev
checkpoint with the distilled LoRA in both stages at ``--distilled-lora-strength-stage-1/2``, res_2s
steps). The model flags, the flags a recipe ignores and the prompts it encodes are its declaration's;
flag names follow the official runners (``ltx_pipelines.ti2vid_two_stages``, ``ltx_pipelines.distilled``:
``--distilled-checkpoint-path``, ``ltx_pipelines.ti2vid_two_stages_hq``) where they exist; every default is the schema's (``mgpu_backend.ltx.schema``) for the chosen
``--model-version`` and recipe. Without model files it uses the embedded tiny bundle (random weights:
the output is noise, but every real component runs; the fleet makes or finds its files) at small
sizes, and says so; files given as flags get a real model's sizes. It drives the same fleet jobs as
the ComfyUI nodes (load, encode, sample, upscale, decode), shows a progress bar per stage, cancels
cleanly on Ctrl-C, and writes an mp4 with H.264 video and AAC audio.

Every input is checked before the fleet is asked for anything (``check_inputs``, mostly with the
schema's own checks), and refused in one style: ``error: <what was wrong, in the flag's name and the
final video's units>; <what to do>``, exit code 2. A flag that cannot take effect is refused or
warned about, never dropped.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from mgpu_backend.ltx.recipes import DEFAULT_RECIPE, DISTILLED_SIGMAS, FILE_WORDS, RECIPES, STAGE2_POLICIES, STEPPERS, STRENGTH_WORDS, UnsupportedModelVersion, model_flags, recipe, strength_default_words, strength_fields, strength_flag, strength_readers
from mgpu_backend.ltx.schema import DISTILLED_LORA_STRENGTH, IMAGE_STRENGTH, MAX_FRAME_RATE, MIN_FRAME_RATE, MODEL_VERSIONS, NO_GUIDANCE, OFFICIAL, PARALLEL_PLANS, PIPELINES, PREVIEW_EVERY, QUANTIZATIONS, RESIDENCY_POLICIES, SEED_MAX, STAGE2_PLANS, STAGE_2_SIGMAS, TDP_OVERLAP, TDP_UPSCALE_SIGMAS, VIDEO_SPATIAL_COMPRESSION, EncodeRequest, ModelFileError, ModelSpec, RequestError, check_image_strengths, decoded_video_bytes, defaults_for, request_model_version, stage2_default_sigmas, validate_dtype_with_loras, validate_generation, validate_sigmas, validate_stage1_sigmas

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
DEFAULT_VERSION = "2.0"  # the embedded tiny bundle's without --model-version, where the recipe runs it
MULTI_GPU_STAGE2_SIGMAS = TDP_UPSCALE_SIGMAS
SINGLE_GPU_STAGE2_SIGMAS = STAGE_2_SIGMAS


def real_defaults(model_version: str, pipeline: str = DEFAULT_RECIPE) -> dict:
    """The output size, frames and steps of a real model: the schema's (stage 2 doubles stage 1)."""
    official = defaults_for(model_version, pipeline)
    return {"height": 2 * official.stage1_height, "width": 2 * official.stage1_width, "num_frames": official.num_frames, "num_inference_steps": official.steps}


def _listed(values) -> str:
    return ",".join(map(str, values))


def add_generate_parser(commands) -> None:
    parser = commands.add_parser("generate", help="run the two-stage LTX-2 job headless and write an mp4")
    model = parser.add_argument_group("model (omit all to use the embedded tiny bundle with random weights)")
    recipes_help = " or ".join(f"{declared.name} ({declared.short})" for declared in RECIPES.values())
    model.add_argument("--pipeline", choices=PIPELINES, default=DEFAULT_RECIPE, help=f"recipe: {recipes_help} (default {DEFAULT_RECIPE})")
    model.add_argument("--checkpoint-path", help="LTX-2 dev checkpoint (.safetensors) of the two-stage pipeline (default: none, the tiny bundle)")
    model.add_argument("--distilled-checkpoint-path", help="LTX-2 distilled checkpoint (.safetensors) of the distilled pipeline (default: none, the tiny bundle)")
    model.add_argument("--gemma-root", help="Gemma-3 text encoder: a Hugging Face folder or ComfyUI's single file (gemma_3_12B_it.safetensors) (default: none, the tiny bundle)")
    model.add_argument("--distilled-lora", nargs="+", metavar=("PATH", "STRENGTH"), help="distilled LoRA for stage 2 (two-stage: in stage 1 too with --distilled-lora-strength-stage-1; the hq pipeline: both stages, at its --distilled-lora-strength-stage-1/2, no STRENGTH here) and an optional strength (strength default 1.0; default: none, the tiny bundle)")
    model.add_argument("--spatial-upsampler-path", help="spatial 2x latent upsampler (.safetensors) (default: none, the tiny bundle)")
    for field in strength_fields():
        model.add_argument(strength_flag(field), type=float, help=f"--pipeline {strength_readers(field)} only: {STRENGTH_WORDS[field]} (default: the recipe's own, as its official runner: {strength_default_words(field)}; 0: none)")
    model.add_argument("--lora", nargs="+", action="append", metavar=("PATH", "STRENGTH"), help="a user LoRA, optional strength (default 1.0; repeatable; with the tiny bundle too). Default: none")
    # bfloat16 only: stage 2 fuses the distilled LoRA, and ltx-core fuses LoRAs into bfloat16 or fp8 weights only.
    model.add_argument("--dtype", choices=("bfloat16",), default="bfloat16", help="compute dtype (default bfloat16, as the official pipeline; the two-stage job fuses the distilled LoRA, which needs bfloat16)")
    model.add_argument("--quantization", choices=QUANTIZATIONS, help="fp8-cast: transformer weights in float8, upcast per layer (about half its memory; as the official --quantization fp8-cast). Default: none")
    model.add_argument("--residency", choices=RESIDENCY_POLICIES, default=RESIDENCY_POLICIES[0], help="what stays on each GPU between jobs: auto (what fits), all, minimal (the transformer only), sharded (the transformer spread over the GPUs, 1/N each) (default auto)")
    only = ", ".join(f"{declared.name} {'/'.join(declared.versions)}" for declared in RECIPES.values() if DEFAULT_VERSION not in declared.versions)
    model.add_argument("--model-version", choices=MODEL_VERSIONS, help=f"LTX-2 version: a check only, the checkpoint's model_version metadata decides whose official defaults apply (a contradicting value is refused); without model flags, which embedded tiny bundle runs (default {DEFAULT_VERSION}, or the recipe's own where it runs no {DEFAULT_VERSION}: {only})")

    job = parser.add_argument_group("generation")
    prompt = job.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="what the video and its audio show (required, or --prompt-file)")
    prompt.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this UTF-8 text file, for long prompts (default: none, --prompt)")
    negative = job.add_mutually_exclusive_group()
    negative.add_argument("--negative-prompt", help="what to steer away from (default: the official pipeline's negative prompt)")
    negative.add_argument("--negative-prompt-file", metavar="PATH", help="read the negative prompt from this UTF-8 text file (default: none, --negative-prompt)")
    job.add_argument("--output", "--output-path", dest="output", default="output.mp4", help="mp4 to write (default output.mp4)")
    real, tiny = real_defaults("2.0"), TINY_DEFAULTS
    job.add_argument("--seed", type=int, default=OFFICIAL.seed, help=f"noise seed, 0 to {SEED_MAX} (default {OFFICIAL.seed})")
    job.add_argument("--height", type=int, help=f"output height, a multiple of 64 (default {real['height']}; tiny bundle {tiny['height']})")
    job.add_argument("--width", type=int, help=f"output width, a multiple of 64 (default {real['width']}; tiny bundle {tiny['width']})")
    job.add_argument("--num-frames", type=int, help=f"8k+1 frames (default {real['num_frames']}; tiny bundle {tiny['num_frames']})")
    job.add_argument("--frame-rate", type=float, default=OFFICIAL.frame_rate, help=f"frames per second, {MIN_FRAME_RATE:g} to {MAX_FRAME_RATE:g} (default {OFFICIAL.frame_rate:g})")
    job.add_argument("--num-inference-steps", type=int, help=f"stage-1 steps (default {real['num_inference_steps']} for 2.0, {real_defaults('2.3')['num_inference_steps']} for 2.3; tiny bundle {tiny['num_inference_steps']})")
    job.add_argument("--image", metavar="PATH", help="image-to-video: condition the first frame on this image (default: none, text-to-video)")
    job.add_argument("--stage1-sigmas", help=f"stage-1 sigmas from 1.0 down to 0.0, comma separated, e.g. ComfyUI's LTX-2.3 templates' {_listed(DISTILLED_SIGMAS)}; the step count follows them (default: the recipe's schedule)")
    per_recipe_steppers = "; ".join(f"{declared.name}: {declared.stage1.stepper}" for declared in RECIPES.values())
    job.add_argument("--sampler", choices=tuple(STEPPERS), help=f"how both stages step from one sigma to the next (default: the recipe's, {per_recipe_steppers})")
    per_recipe_sigmas = "; ".join(f"{declared.name}: {_listed(declared.upscale_sigmas)}" for declared in RECIPES.values())
    job.add_argument("--stage2-sigmas", help=f"stage-2 sigmas (default: the recipe's, {per_recipe_sigmas})")
    per_recipe_auto = "; ".join(f"{declared.name}: {STAGE2_POLICIES[declared.stage2_policy]}" for declared in RECIPES.values())
    job.add_argument("--stage2-parallel", choices=STAGE2_PLANS, default="auto", help=f"stage 2: sp (sequence parallel, audio denoised as the official pipelines), tdp (tiles, stage-1 audio kept), auto ({per_recipe_auto}) (default auto)")
    job.add_argument("--tiles", default="auto", help="stage-2 TDP tiles HxW (height tiles x width tiles, e.g. 2x2), or 'auto' (default auto: balanced over the fleet; untiled on one rank)")
    job.add_argument("--parallel", choices=PARALLEL_PLANS, default="auto", help="stage-1 plan: auto (planned from the fleet), sp, guidance or hybrid (default auto)")
    job.add_argument("--image-strength", type=float, default=IMAGE_STRENGTH, help=f"how strongly --image holds the first frame, 0 to 1 (default {IMAGE_STRENGTH:g}: kept as given; ComfyUI's LTX-2.3 image-to-video template uses 0.7)")
    job.add_argument("--last-image", metavar="PATH", help="first/last-frame video: guide the last frame with this image, appended as a guiding latent as the official pipelines do (stage 2 then runs sequence parallel: tiles cannot hold it; default: none)")
    job.add_argument("--last-image-strength", type=float, default=IMAGE_STRENGTH, help=f"how strongly --last-image holds the last frame, 0 to 1 (default {IMAGE_STRENGTH:g})")
    job.add_argument("--free-gemma", action="store_true", help="give Gemma's GPU memory back after encoding the prompts (for GPUs where memory is tight; default: keep it)")
    job.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", help="run the stage-1 forward eagerly instead of replaying captured CUDA graphs (GPU only; default: graphs on with CUDA)")
    job.add_argument("--compile-blocks", action="store_true", help="torch.compile the transformer blocks for stage 1 (GPU only; tens of seconds of compile per new shape, then faster small shards: for SP degree 4+; default off)")
    job.add_argument("--debug-dump", metavar="PATH", help="write stage latents, frames (uint8) and waveform to this safetensors file (default: none)")
    job.add_argument("--preview-dir", metavar="DIR", help="write the live previews of stages 1 and 2 (latent-to-RGB strips of a few frames) there as PNGs (default: none)")
    job.add_argument("--preview-every", type=int, default=PREVIEW_EVERY, help=f"steps per preview with --preview-dir, 0 for none (default {PREVIEW_EVERY}: every step)")

    # Unset guidance flags take the schema's official values of --model-version (shown: 2.0's).
    guidance = parser.add_argument_group("guidance (default: the official values of the model version)")
    guidance.add_argument("--cfg-1", dest="unguided", action="store_true", help="CFG 1, as ComfyUI's LTX-2.3 templates run the dev checkpoint with the distilled LoRA: one conditional pass per step, no negative prompt, no STG or modality guidance (sequence parallel over all GPUs); not with the scale flags below (default: off)")
    for modality, modality_flag in (("video", "--a2v-guidance-scale"), ("audio", "--v2a-guidance-scale")):
        official = getattr(OFFICIAL, f"{modality}_guidance")
        guidance.add_argument(f"--{modality}-cfg-guidance-scale", type=float, help=f"default {official.cfg_scale}")
        guidance.add_argument(f"--{modality}-stg-guidance-scale", type=float, help=f"default {official.stg_scale}")
        guidance.add_argument(f"--{modality}-rescale-scale", type=float, help=f"default {official.rescale_scale}")
        guidance.add_argument(modality_flag, type=float, dest=f"{modality}_modality_scale", help=f"default {official.modality_scale}")
        guidance.add_argument(f"--{modality}-skip-step", type=int, help=f"default {official.skip_step}")
        guidance.add_argument(f"--{modality}-stg-blocks", type=int, nargs="*", default=None, help=f"default: block {_listed(official.stg_blocks)} (2.3: {_listed(getattr(defaults_for('2.3'), f'{modality}_guidance').stg_blocks)}; the last block of a smaller model)")

    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--socket", help="the fleet server's socket (default: $MGPU_SOCKET, else the private per-user socket). Nothing answering there is refused, unless --gpus or --cpu-ranks say what to start there for this run; without --socket a fleet is started for this run when none answers")
    devices = fleet.add_mutually_exclusive_group()
    devices.add_argument("--gpus", help="GPUs for a fleet this run starts: 'all' or 0,1,2,3 (default: all visible GPUs, else one CPU rank); a fleet that already answers keeps its own devices (warned)")
    devices.add_argument("--cpu-ranks", type=int, help="CPU ranks (gloo) for a fleet this run starts (default: none, GPUs); a fleet that already answers keeps its own devices (warned)")
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


def refuse(message: str) -> SystemExit:
    """The one way a bad input ends the command: ``error: <what was wrong>; <what to do>``, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return SystemExit(2)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class PreviewWriter:
    """``--preview-dir``: each live preview as ``<stage>_step<NNN>.png`` (the frames side by side)."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.written = 0

    def __call__(self, fields: dict, frames: torch.Tensor) -> None:
        from PIL import Image

        from mgpu_backend.ltx.previews import side_by_side

        name = f"{fields['stage']}_step{int(fields['step']):03d}.png"
        Image.fromarray(side_by_side(frames).numpy()).save(self.directory / name)
        self.written += 1


def _parse_floats(text: str, name: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise refuse(f"{name} takes numbers separated by commas, got {text!r}; e.g. {_listed(TDP_UPSCALE_SIGMAS)}") from None


def _strength(words: list[str], flag: str, default: float) -> float:
    """The optional strength after a LoRA's path."""
    if len(words) < 2:
        return default
    try:
        return float(words[1])
    except ValueError:
        raise refuse(f"{flag} {' '.join(words)}: the strength after the path must be a number, got {words[1]!r}; e.g. {flag} {words[0]} {default}") from None


def _read_text(path: str, flag: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise refuse(f"{flag} {path} does not exist; name a UTF-8 text file holding the prompt") from None
    except IsADirectoryError:
        raise refuse(f"{flag} {path} is a directory; name a UTF-8 text file holding the prompt") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise refuse(f"{flag} {path} cannot be read as UTF-8 text ({exc}); save the prompt as a UTF-8 text file") from None


def _load_image(path: str, flag: str = "--image", frame: str = "first") -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    import numpy as np

    if not Path(path).is_file():
        raise refuse(f"{flag} {path} does not exist (or is not a file); name a PNG or JPEG file for the {frame} frame")
    try:
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    except (UnidentifiedImageError, OSError) as exc:
        raise refuse(f"{flag} {path} is not an image that can be read ({exc}); use a PNG or JPEG file") from None
    return torch.from_numpy(pixels)


def _check_output(path: str) -> None:
    """The mp4 must be a file name this run can create: refused now, not after the whole job."""
    output = Path(path)
    if output.is_dir():
        raise refuse(f"--output {path} is a directory; name the mp4 file to write, e.g. {output / 'output.mp4'}")
    if output.suffix.lower() != ".mp4":
        raise refuse(f"--output {path} must end in .mp4 (the command writes H.264 video with AAC audio in an mp4); e.g. {output.with_suffix('.mp4')}")
    parent = output.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise refuse(f"--output {path} cannot be written: {parent} is not a writable folder; choose another path")


def _check_tiles(tiles: tuple[int, int] | None, height: int, width: int) -> None:
    """User tiles must fit the stage-2 latent with TDP's overlap: the ranks would refuse them after stage 1."""
    from mgpu_backend.parallel import tiled_data_parallel as tdp

    if tiles is None or tiles == (1, 1):
        return
    cells = {"height": height // VIDEO_SPATIAL_COMPRESSION, "width": width // VIDEO_SPATIAL_COMPRESSION}
    for name, count in zip(("height", "width"), tiles, strict=True):
        try:
            tdp.dimension_tile_bounds(cells[name], tdp.DimensionTiling(count, TDP_OVERLAP), name)
        except ValueError:
            raise refuse(
                f"--tiles {tiles[0]}x{tiles[1]} does not fit a {height}x{width} (height x width) output: its {name} is "
                f"{cells[name]} latent cells of {VIDEO_SPATIAL_COMPRESSION} pixels, too few for {count} tiles that overlap by "
                f"{TDP_OVERLAP} cells; use --tiles auto, fewer tiles, or a larger --{name}"
            ) from None


def _check_host_memory(height: int, width: int, num_frames: int) -> None:
    """The decoded frames come back through shared memory into this process (two copies in host RAM,
    whatever the ranks run on): refuse a video that cannot fit before hours of denoising."""
    from mgpu_backend.ltx.validation import GIB, available_memory_bytes

    needed = 2 * decoded_video_bytes(height, width, num_frames)
    available = available_memory_bytes(torch.device("cpu"))
    if needed > available:
        raise refuse(
            f"a {num_frames}-frame {height}x{width} (height x width) video needs about {needed / GIB:.1f} GiB of host memory "
            f"for its decoded frames (float32, in shared memory and in this process), but only {available / GIB:.1f} GiB is "
            "available; use fewer --num-frames or a smaller --height/--width"
        )


def _flag_value(args, flag: str):
    return getattr(args, flag.lstrip("-").replace("-", "_"))


def _refuse_foreign_model_flags(args, declared) -> None:
    """A model flag of another recipe (or one this recipe refuses) is refused, saying why or which recipe takes it."""
    why = {file.flag: reason for file, reason in declared.refused}
    own = {file.flag for file in declared.files}
    for flag in model_flags():
        if flag not in own and _flag_value(args, flag):
            takers = " or ".join(other.name for other in RECIPES.values() if flag in {file.flag for file in other.files})
            raise refuse(f"{flag} does not apply to --pipeline {declared.name} ({why.get(flag, f'use --pipeline {takers} for it')}); drop it")


def _stage_strengths(args, declared) -> dict[str, float]:
    """The per-stage strength flags given; one the recipe does not read is refused, naming the one that does."""
    given = {field: getattr(args, field) for field in strength_fields() if getattr(args, field) is not None}
    for field in given:
        if field not in declared.stage_strengths:
            readers = " or ".join(other.name for other in RECIPES.values() if field in other.stage_strengths)
            ours = "; --distilled-lora's STRENGTH sets its stage-2 strength" if "distilled_lora_strength" in declared.lora_strengths else ""
            raise refuse(f"{strength_flag(field)} does not apply to --pipeline {declared.name} (use --pipeline {readers} for it{ours}); drop it")
    return given


def build_spec(args) -> tuple[dict, bool]:
    """The model spec JSON, and whether it is the embedded tiny bundle (named, not written here)."""
    from safetensors import SafetensorError, safe_open

    from mgpu_backend.ltx.loading import validate_model_files

    pipeline = args.pipeline
    declared = recipe(pipeline)
    wanted = tuple(file.flag for file in declared.files)
    _refuse_foreign_model_flags(args, declared)
    given = [_flag_value(args, flag) for flag in wanted]
    loras = []
    for lora in args.lora or []:
        if len(lora) > 2:
            raise refuse(f"--lora takes a path and an optional strength, got {' '.join(lora)}; repeat --lora for each LoRA")
        loras.append((lora[0], _strength(lora, "--lora", 1.0)))
    held = {"quantization": args.quantization, "residency": args.residency, "loras": tuple(loras), **_stage_strengths(args, declared)}
    if not any(given):
        version = args.model_version or (DEFAULT_VERSION if DEFAULT_VERSION in declared.versions else declared.versions[0])
        try:
            declared.check_version(version)
        except UnsupportedModelVersion as error:
            raise refuse(f"--model-version: {error}") from None
        spec = replace(ModelSpec.embedded_tiny_for(pipeline, version=version), **held)
        try:  # the bundle itself is made on the ranks; a user LoRA must exist here already
            spec.check_files_exist()
        except ModelFileError as error:
            raise refuse(f"--lora: {error}") from None
        return spec.to_wire(), True
    missing = [flag for flag, value in zip(wanted, given, strict=True) if not value]
    if missing:
        raise refuse(f"a real model needs {', '.join(missing)} too (or omit all model flags for the tiny bundle)")
    files = {}
    for file, value in zip(declared.files, given, strict=True):
        if isinstance(value, list):  # a LoRA flag: PATH [STRENGTH]
            if len(value) > 2:
                raise refuse(f"{file.flag} takes a path and an optional strength, got {' '.join(value)}")
            strength = f"{file.spec_field}_strength"
            if len(value) == 2 and strength not in declared.lora_strengths:  # the official runner reads it nowhere either
                flags = " and ".join(map(strength_flag, declared.stage_strengths))
                raise refuse(f"{file.flag} {' '.join(value)}: --pipeline {declared.name} reads no strength there (its stages take {flags}); drop {value[1]}")
            files[file.spec_field], files[strength] = value[0], _strength(value, file.flag, DISTILLED_LORA_STRENGTH)
        else:
            files[file.spec_field] = value
    spec = ModelSpec(**files, **held)
    try:  # from the files' headers: a wrong file stops here, before a fleet starts
        validate_model_files(spec)
    except ModelFileError as error:
        raise refuse(str(error)) from None
    opened = [(FILE_WORDS[file.spec_field], getattr(spec, file.spec_field)) for file in declared.files if file.spec_field != "gemma_root"]
    opened += [("LoRA", path) for path, _ in spec.loras] + [("Gemma file", spec.gemma_root)] * Path(spec.gemma_root).is_file()
    for role, path in opened:
        try:  # opening checks that the header's tensors lie inside the file: a cut download fails here, not on the ranks
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            raise refuse(f"{role} {path} is damaged or incomplete ({error}); download it again (compare its size with the original)") from None
    return spec.to_wire(), False


def check_inputs(args, spec: dict) -> dict:
    """Every input checked before the fleet is asked for anything: prompts, size, frames, steps,
    seed, frame rate, dtype vs LoRAs, tiles, sigmas, output path and image. Returns the parsed ones."""
    from mgpu_backend.ltx import api

    prompt = _read_text(args.prompt_file, "--prompt-file") if args.prompt_file else args.prompt.strip()
    if args.negative_prompt_file:
        negative = _read_text(args.negative_prompt_file, "--negative-prompt-file")
    else:
        negative = DEFAULT_NEGATIVE_PROMPT if args.negative_prompt is None else args.negative_prompt
    if not prompt:
        warn("the prompt is empty, so the video follows no text; describe the scene with --prompt or --prompt-file")
    try:
        EncodeRequest.from_wire({"spec": spec, "prompts": [prompt, negative], "dtype": args.dtype})
        validate_generation(args.height, args.width, args.num_frames, two_stage=True, num_inference_steps=args.num_inference_steps, frame_rate=args.frame_rate, seed=args.seed)
        validate_dtype_with_loras(args.dtype, spec["distilled_lora"] is not None, bool(spec["loras"]))
        sigmas = stage2_default_sigmas(args.pipeline) if args.stage2_sigmas is None else _parse_floats(args.stage2_sigmas, "--stage2-sigmas")
        validate_sigmas(sigmas)
    except (RequestError, ModelFileError) as error:
        raise refuse(_in_flag_names(str(error))) from None
    if sigmas[0] >= 1.0:  # validate_upscale_sigmas' rule, worded for this command (it has no force flag)
        raise refuse(
            f"--stage2-sigmas must start below 1.0 (pure noise), got {_listed(sigmas)}: stage 2 refines the upsampled "
            f"stage-1 video, and from pure noise its tiles would not agree on one video; use e.g. {_listed(TDP_UPSCALE_SIGMAS)}"
        )
    _check_host_memory(args.height, args.width, args.num_frames)
    try:
        tiles = api.parse_tiles(args.tiles)
    except ValueError as exc:
        raise refuse(f"--tiles: {exc}") from None
    _check_tiles(tiles, args.height, args.width)
    _check_output(args.output)
    if args.preview_every < 0:
        raise refuse(f"--preview-every must be 0 (no previews) or a number of steps, got {args.preview_every}; e.g. {PREVIEW_EVERY}")
    try:
        check_image_strengths(args.image_strength, args.last_image_strength, bool(args.image), bool(args.last_image), IMAGE_FLAGS)
    except RequestError as error:
        raise refuse(str(error)) from None
    guiding = recipe(args.pipeline).guiding_frames(args.num_frames, bool(args.image), bool(args.last_image))
    if guiding and (args.stage2_parallel == "tdp" or tiles is not None):
        chosen = "--stage2-parallel tdp" if args.stage2_parallel == "tdp" else f"--tiles {args.tiles}"
        raise refuse(
            f"{chosen} cannot run with the {guiding} image latent{'s' if guiding > 1 else ''} that the {args.pipeline} pipeline appends to the video "
            "for its images: no tile can hold them; use --stage2-parallel auto or sp, and leave --tiles at auto"
        )
    image = _load_image(args.image) if args.image else None
    last_image = _load_image(args.last_image, "--last-image", "last") if args.last_image else None
    return {"prompt": prompt, "negative": negative, "tiles": tiles, "sigmas": sigmas, "image": image, "last_image": last_image, "guiding_frames": guiding}


IMAGE_FLAGS = {"image_strength": "--image-strength", "image": "--image", "last_image_strength": "--last-image-strength", "last_image": "--last-image"}
"""The image inputs' flags, by request field (``schema.check_image_strengths`` words its refusals with them)."""


# The schema speaks of request fields; the command line of its flags.
_FLAG_NAMES = (("frames must", "--num-frames must"), ("height must", "--height must"), ("width must", "--width must"),
               ("steps must", "--num-inference-steps must"), ("frame rate must", "--frame-rate must"), ("seed must", "--seed must"),
               ("sigmas", "--stage2-sigmas"), ("dtype ", "--dtype "))  # fmt: skip


def _in_flag_names(message: str) -> str:
    for field, flag in _FLAG_NAMES:
        if message.startswith(field):
            return flag + message[len(field):]
    return message


def attach_fleet(args) -> tuple[bool, str]:
    """Point ``api`` at the fleet. Returns whether this run starts it (it then ends with the run) and
    its devices as the server describes them ("GPUs 0,1", "2 CPU rank(s)").

    A socket named by ``--socket`` or ``$MGPU_SOCKET`` where nothing answers is refused unless
    ``--gpus``/``--cpu-ranks`` say what to start there (a typo must not start a 1-rank fleet); a
    fleet that already answers keeps its devices, so ``--gpus``/``--cpu-ranks`` are then warned about."""
    from mgpu_backend.fleet.addresses import Address
    from mgpu_backend.fleet.client import FleetClient, FleetUnavailable
    from mgpu_backend.ltx import api

    address = Address.parse(args.socket)
    devices_given = args.gpus is not None or args.cpu_ranks is not None
    try:
        with FleetClient.connect(args.socket, autostart=False) as probe:
            running = probe.status()["devices"]
    except FleetUnavailable:
        start_there = f"start one there with 'python -m mgpu_backend serve --socket {address}' (with --gpus or --cpu-ranks)"
        if args.socket and not devices_given:
            raise refuse(
                f"no fleet server answers at --socket {args.socket}; {start_there}, add --gpus or --cpu-ranks to start one "
                "there for this run, or leave out --socket to use the default socket"
            ) from None
        if not args.socket and os.environ.get("MGPU_SOCKET"):  # MGPU_SOCKET names a fleet started by hand: never one of ours
            raise refuse(f"no fleet server answers at $MGPU_SOCKET ({address}); {start_there}, or unset MGPU_SOCKET to use the default socket") from None
        if args.socket:
            devices = f"{args.cpu_ranks} CPU ranks" if args.cpu_ranks is not None else f"GPUs {args.gpus}"
            print(f"no fleet answers at {address}: starting one on {devices} there for this run", file=sys.stderr)
        api.configure(args.socket, args.gpus, args.cpu_ranks)
        return True, _devices_wanted(args)
    if devices_given:
        if _devices_wanted(args) != running:
            asked = f"--cpu-ranks {args.cpu_ranks}" if args.cpu_ranks is not None else f"--gpus {args.gpus}"
            warn(f"{asked} not applied: the fleet at {address} already runs on {running}; this run uses it as it is "
                 "(stop it with 'python -m mgpu_backend stop' to start one with your devices)")  # fmt: skip
    api.configure(args.socket, None, None)
    return False, running


def _devices_wanted(args) -> str:
    """The devices a fleet started for this run gets, in the server's words."""
    from mgpu_backend.fleet.controller import DeviceSpec

    try:
        devices = DeviceSpec.parse(args.gpus, args.cpu_ranks)
        devices.check_gpus_visible()  # else the fleet would start and every rank die on CUDA
    except ValueError as exc:
        raise refuse(str(exc)) from None
    return devices.describe()


def describe_fleet_error(exc) -> str:
    """A failed job for the terminal: an input error as one line, a fault with its rank and traceback."""
    if exc.kind == "input_error" or not exc.traceback:
        return f"error{exc.where}: {exc}"
    return f"error{exc.where}: {exc}\n{exc.traceback}"


GUIDANCE_FLAGS = tuple(
    f"{modality}_{name}" for modality in ("video", "audio")
    for name in ("cfg_guidance_scale", "stg_guidance_scale", "rescale_scale", "modality_scale", "skip_step", "stg_blocks")
)  # fmt: skip


def check_ignored_flags(args, declared) -> None:
    """Refuse the flags the recipe would ignore (``recipes.Recipe.ignores``): guidance, step count.
    ``--cfg-1`` sets every guidance scale to its neutral value (``schema.NO_GUIDANCE``) and so takes none of them."""
    guidance = declared.ignored("guidance")
    set_flags = ["--" + name.replace("_", "-") for name in GUIDANCE_FLAGS if getattr(args, name) is not None]
    if guidance is not None and (set_flags or args.unguided):
        raise refuse(f"{', '.join(set_flags) or '--cfg-1'} do(es) not apply to --pipeline {declared.name} ({guidance.why}); drop them")
    if args.unguided and set_flags:
        raise refuse(f"--cfg-1 sets every guidance scale; drop {', '.join(set_flags)} (or --cfg-1)")
    if args.unguided and (args.negative_prompt is not None or args.negative_prompt_file):
        raise refuse("--cfg-1 runs no unconditional pass, so no negative prompt is read; drop --negative-prompt / --negative-prompt-file (or --cfg-1)")
    if args.unguided:
        for modality in ("video", "audio"):
            for name in ("cfg_scale", "stg_scale", "rescale_scale", "modality_scale"):
                flag = {"cfg_scale": "cfg_guidance_scale", "stg_scale": "stg_guidance_scale"}.get(name, name)
                setattr(args, f"{modality}_{flag}", getattr(NO_GUIDANCE, name))
    steps = declared.ignored("steps")
    if args.stage1_sigmas is not None:
        try:
            sigmas = validate_stage1_sigmas(_parse_floats(args.stage1_sigmas, "--stage1-sigmas"))
        except RequestError as error:
            raise refuse(f"--stage1-sigmas: {error}") from None
        if args.num_inference_steps is not None and args.num_inference_steps != len(sigmas) - 1:
            raise refuse(f"--num-inference-steps {args.num_inference_steps} contradicts --stage1-sigmas ({len(sigmas) - 1} steps); drop --num-inference-steps")
        args.stage1_sigmas, args.num_inference_steps = sigmas, len(sigmas) - 1
    elif steps is not None and args.num_inference_steps is not None and args.num_inference_steps != declared.fixed_steps:
        raise refuse(f"--pipeline {declared.name} runs {steps.why}; drop --num-inference-steps (got {args.num_inference_steps})")


def run_generate(args) -> int:
    from mgpu_backend.ltx import api
    from mgpu_backend.fleet.client import FleetCancelled, FleetError
    from mgpu_backend.tools.media import write_mp4

    spec, tiny = build_spec(args)
    declared = recipe(args.pipeline)
    try:
        args.model_version = request_model_version(ModelSpec.from_wire(spec), args.model_version)
        declared.check_version(args.model_version)
    except (RequestError, UnsupportedModelVersion) as error:
        raise refuse(f"--model-version: {error}" if isinstance(error, RequestError) else str(error)) from None
    check_ignored_flags(args, declared)
    defaults = dict(TINY_DEFAULTS) if tiny else real_defaults(args.model_version, args.pipeline)
    if declared.fixed_steps is not None:
        defaults["num_inference_steps"] = declared.fixed_steps
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    inputs = check_inputs(args, spec)
    if tiny:
        print(
            f"No checkpoint given: using the embedded tiny LTX-2 bundle of version {args.model_version} (random weights; the video is noise, every "
            f"real component runs) at {args.height}x{args.width} (height x width), {args.num_frames} frames, {args.num_inference_steps} steps, "
            f"{args.pipeline} pipeline.",
            file=sys.stderr,
        )
    image = inputs["image"]
    images = dict(image_strength=args.image_strength, last_image=inputs["last_image"], last_image_strength=args.last_image_strength)
    video_guidance, audio_guidance = (
        api.Guidance(
            cfg_scale=getattr(args, f"{m}_cfg_guidance_scale"), stg_scale=getattr(args, f"{m}_stg_guidance_scale"),
            rescale_scale=getattr(args, f"{m}_rescale_scale"), modality_scale=getattr(args, f"{m}_modality_scale"),
            skip_step=getattr(args, f"{m}_skip_step"),
            stg_blocks=None if getattr(args, f"{m}_stg_blocks") is None else tuple(getattr(args, f"{m}_stg_blocks")),
        )  # fmt: skip
        for m in ("video", "audio")
    )
    started_here, devices = attach_fleet(args)
    if args.compile_blocks and not devices.startswith("GPUs"):
        warn(f"--compile-blocks not applied: the fleet runs on {devices}, and only GPU ranks compile the blocks; the blocks run eagerly")
    cancelled = {"flag": False}

    def on_interrupt(*_):
        if cancelled["flag"]:
            raise KeyboardInterrupt
        cancelled["flag"] = True
        print("\ncancelling at the next step (Ctrl-C again to quit at once)...", file=sys.stderr)

    signal.signal(signal.SIGINT, on_interrupt)
    progress = StageProgress()
    common = dict(progress=progress, should_cancel=lambda: cancelled["flag"], dtype=args.dtype)
    previews = PreviewWriter(args.preview_dir) if args.preview_dir and args.preview_every > 0 else None
    denoising = dict(preview=previews, preview_every=args.preview_every)
    started = time.perf_counter()
    try:
        loaded = api.load(spec, **common)
        progress.close()
        print(f"model on the fleet ({loaded['bytes_read'] / 2**20:.1f} MiB read from disk since it was loaded)", file=sys.stderr)
        # An unguided recipe (distilled) or --cfg-1 runs no unconditional pass: no negative prompt to encode.
        prompts = [inputs["prompt"], inputs["negative"]] if declared.encodes_negative_prompt and not args.unguided else [inputs["prompt"]]
        positive, *negative = api.encode(spec, prompts, free_gemma=args.free_gemma, **common)
        video, audio = api.sample(
            spec, positive, negative[0] if negative else None, width=args.width // 2, height=args.height // 2,
            num_frames=args.num_frames, frame_rate=args.frame_rate, seed=args.seed, steps=args.num_inference_steps,
            video_guidance=video_guidance if declared.guided else None, audio_guidance=audio_guidance if declared.guided else None,
            image=image, parallel=args.parallel, cuda_graphs=args.cuda_graphs, compile_blocks=args.compile_blocks,
            model_version=args.model_version, pipeline=args.pipeline, sigmas=args.stage1_sigmas, sampler=args.sampler, **common, **denoising, **images,
        )  # fmt: skip
        stage1_video, stage1_audio = video, audio
        stage2_fields: dict = {}
        video, audio = api.upscale(
            spec, video, audio, positive, frame_rate=args.frame_rate, seed=args.seed, sigmas=inputs["sigmas"], tiles=inputs["tiles"],
            image=image, model_version=args.model_version, pipeline=args.pipeline, parallel=args.stage2_parallel,
            fields=stage2_fields, sampler=args.sampler, **common, **denoising, **images,
        )  # fmt: skip
        progress.close()
        # The plan's reason already says what the stage-2 audio is (denoised or the stage-1 audio).
        print(stage2_fields.get("plan", "stage 2 done"), file=sys.stderr)
        frames, waveform, sample_rate = api.decode(spec, video, audio, seed=args.seed, frame_rate=args.frame_rate, **common,
                                                   guiding_frames=inputs["guiding_frames"])
        progress.close()
    except FleetCancelled:
        progress.close()
        if started_here:
            print("cancelled; the fleet this run started stops with it", file=sys.stderr)
        else:
            print("cancelled; the fleet is still up for the next job", file=sys.stderr)
        return 130
    except FleetError as exc:
        progress.close()
        print(describe_fleet_error(exc), file=sys.stderr)
        return 1
    output = write_mp4(args.output, frames, args.frame_rate, waveform, sample_rate)
    print(f"wrote {output} ({frames.shape[0]} frames {frames.shape[1]}x{frames.shape[2]} (height x width), audio {sample_rate} Hz) in {time.perf_counter() - started:.1f} s")
    if previews is not None:
        print(f"{previews.written} live previews in {previews.directory}")
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
