"""The values MGPU nodes exchange with ComfyUI, and their checks: model handle, CONDITIONING, LATENT.

- ``MGPU_MODEL``: a small plain dict (the model spec as JSON plus the fleet options). Every job
  carries it, so a fleet that restarted reloads the model on its own.
- ``CONDITIONING``: ComfyUI's LTX-2 layout, ``[[context, {...}]]`` with the video and audio contexts
  concatenated on the last dim, as ComfyUI's LTX-2 text encoder hands them to its model: stock
  samplers take ours, and ours take a stock text encoder's (also the ``unprocessed_ltxav_embeds``
  form, before the model's connectors; the fleet splits and connects it). The options carry the
  digest the fleet keeps the prompt's contexts under; the tensor stays here too, so that a fleet
  that lost the digest gets it again. Earlier versions of the pack held the audio context apart
  under ``mgpu_audio_context``: that form is still read.
- ``LATENT`` (audio + video): built exactly as ComfyUI's LTXVConcatAVLatent builds it, a
  ``comfy.nested_tensor.NestedTensor((video, audio))`` under ``samples``, so native LTX-2 nodes
  (LTXVSeparateAVLatent, LTXVAudioVAEDecode, ...) accept ours and ours accept theirs.

Pure data and checks: nothing here talks to the fleet, and ComfyUI is imported only if present.
"""

from __future__ import annotations

import math

import torch

from mgpu_backend.ltx.api import PromptEncoding, StackedContext
from mgpu_backend.ltx.recipes import DEFAULT_RECIPE
from mgpu_backend.ltx.schema import VIDEO_LATENT_CHANNELS

MODEL_TYPE = "MGPU_MODEL"
AUDIO_CONTEXT_KEY = "mgpu_audio_context"
"""Where earlier versions of the pack kept the audio context, the tensor holding the video context only."""
UNPROCESSED_KEY = "unprocessed_ltxav_embeds"
"""ComfyUI's flag on a text encoding that stops before the model's embeddings connectors."""
PROMPT_KEY = "mgpu_prompt"
DIGEST_KEY = "mgpu_prompt_digest"
DIGESTED_CONTEXT_KEY = "mgpu_digested_context"
"""The context tensor the digest was made for: a native node that replaced the CONDITIONING's tensor
(ConditioningAverage, ...) but copied the options along leaves a digest that no longer fits it."""
EARLIER_DIGESTED_CONTEXT_KEY = "mgpu_digested_video_context"  # the same, in earlier versions of the pack
FRAME_RATE_KEY = "frame_rate"
GUIDING_FRAMES_KEY = "mgpu_guiding_frames"
"""The image latents (a last image's, or every image's under the keyframes recipe) each of its stages
appended to the video: their noise draws were longer by as much, which the decoder's noise follows."""
STAGES_KEY = "mgpu_stages"
"""Our AV LATENT records the frame rate it was sampled at and how many denoising stages made it
(1 after SP Sampler, 2 after TDP Upscale): TDP Upscale needs the rate, and the decoder draws its
noise after those stages' draws, as the official pipeline does. Native nodes copy unknown keys
along (LTXVSeparateAVLatent copies the whole dict)."""

AUDIO_LATENT_CHANNELS = 8
AUDIO_LATENT_MEL_BINS = 16
AUDIO_LATENT_SAMPLE_RATE = 16000
"""The LTX-2 audio VAE's input sample rate: LTXVEmptyLatentAudio stores it in the audio LATENT
under ``sample_rate`` and LTXVConcatAVLatent keeps it, so ours carries the same value."""

DTYPES = ("bfloat16", "float32")  # the loader's choices (the fleet also takes float16)


# --- MGPU_MODEL -----------------------------------------------------------------------------------


def make_model_handle(spec: dict, *, dtype: str, gemma_mode: str, parallel: str, gpus: str, pipeline: str = DEFAULT_RECIPE) -> dict:
    """The MGPU_MODEL value: what every later node sends to the fleet with its job. ``pipeline`` is
    the recipe the files are for (``recipes.RECIPES``); the sampling nodes take its defaults."""
    return {"spec": spec, "dtype": dtype, "gemma_mode": gemma_mode, "parallel": parallel, "gpus": gpus, "pipeline": pipeline}


def handle_pipeline(handle: dict) -> str:
    """The recipe of a model handle (handles made before recipes existed are the default recipe's, two-stage)."""
    return handle.get("pipeline", DEFAULT_RECIPE)


def check_model_handle(model) -> dict:
    if not isinstance(model, dict) or not isinstance(model.get("spec"), dict):
        raise ValueError(
            f"the model input must come from 'Load Checkpoint MGPU' (an MGPU_MODEL), got {type(model).__name__}; "
            "connect the MGPU loader's output"
        )
    return model


def parse_gpus(text: str) -> str:
    """'all' or a list of distinct GPU indices like '0,1'; returns the normalised text."""
    cleaned = text.strip().lower().replace(" ", "")
    if cleaned in ("", "all"):
        return "all"
    parts = cleaned.split(",")
    if not all(part.isdigit() for part in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"gpus must be 'all' or a list of distinct GPU indices like 0,1; got {text!r}")
    return ",".join(str(int(part)) for part in parts)


# --- CONDITIONING ---------------------------------------------------------------------------------


def make_conditioning(encoding: PromptEncoding, prompt: str) -> list:
    """One prompt as a ComfyUI CONDITIONING in ComfyUI's LTX-2 layout: the video and audio contexts
    concatenated on the last dim; the prompt and the fleet's digest of both in the options dict."""
    context = torch.cat([encoding.video_context, encoding.audio_context], dim=-1)
    options = {PROMPT_KEY: prompt}
    if encoding.digest is not None:
        options.update({DIGEST_KEY: encoding.digest, DIGESTED_CONTEXT_KEY: context})
    return [[context, options]]


def conditioning_contexts(conditioning, input_name: str) -> PromptEncoding | StackedContext:
    """The prompt a CONDITIONING holds, as the fleet jobs take it: MGPU Text Encode's (with its digest
    while the tensor is still the one the digest was made for) or ComfyUI's LTX-2 text encoder's."""
    if not isinstance(conditioning, (list, tuple)) or not conditioning:
        raise ValueError(f"{input_name} must be a CONDITIONING from a text encoder, got {type(conditioning).__name__}")
    if len(conditioning) != 1:
        raise ValueError(
            f"{input_name} holds {len(conditioning)} conditionings (combined or concatenated); the MGPU nodes take "
            "exactly one prompt per input: connect the text encoder directly"
        )
    entry = conditioning[0]
    context = entry[0]
    options = entry[1] if len(entry) > 1 and isinstance(entry[1], dict) else {}
    if not isinstance(context, torch.Tensor) or context.ndim != 3 or context.shape[0] != 1:
        shape = list(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
        raise ValueError(f"{input_name} must hold one prompt's text context [1, tokens, width], got {shape}; encode one prompt per input")
    digested = options.get(DIGESTED_CONTEXT_KEY, options.get(EARLIER_DIGESTED_CONTEXT_KEY))
    digest = options.get(DIGEST_KEY) if digested is context else None
    if AUDIO_CONTEXT_KEY in options:
        return PromptEncoding(context, options[AUDIO_CONTEXT_KEY], digest)
    return StackedContext(context, unprocessed=bool(options.get(UNPROCESSED_KEY)), digest=digest)


# --- LATENT ---------------------------------------------------------------------------------------


class _AVSamples:
    """Stand-in for ``comfy.nested_tensor.NestedTensor`` outside ComfyUI (scripts, unit tests):
    the same ``tensors`` / ``is_nested`` / ``unbind()`` surface that the LTX-2 nodes read."""

    is_nested = True

    def __init__(self, tensors) -> None:
        self.tensors = list(tensors)

    def unbind(self) -> list[torch.Tensor]:
        return self.tensors

    @property
    def shape(self) -> torch.Size:
        return self.tensors[0].shape


def _nested(tensors):
    try:
        from comfy.nested_tensor import NestedTensor
    except ImportError:
        return _AVSamples(tensors)
    return NestedTensor(tensors)


def make_av_latent(video_latent: torch.Tensor, audio_latent: torch.Tensor, frame_rate: float | None, stages: int | None = None,
                   guiding_frames: int = 0) -> dict:  # fmt: skip
    """The LATENT of LTXVConcatAVLatent: ``samples`` = nested (video, audio), the audio LATENT's
    ``sample_rate``/``type``, plus the frame rate and stage count when known, and the guiding latents
    its stages appended (``GUIDING_FRAMES_KEY``) when there were any."""
    latent = {
        "samples": _nested((video_latent.float(), audio_latent.float())),
        "sample_rate": AUDIO_LATENT_SAMPLE_RATE,
        "type": "audio",
    }
    if frame_rate is not None:
        latent[FRAME_RATE_KEY] = float(frame_rate)
    if stages is not None:
        latent[STAGES_KEY] = int(stages)
    if guiding_frames:
        latent[GUIDING_FRAMES_KEY] = int(guiding_frames)
    return latent


def split_latent(latent, input_name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(video [1,128,F',h,w], audio [1,8,T,16] or None)`` from an AV LATENT or a video LATENT."""
    if not isinstance(latent, dict) or "samples" not in latent:
        raise ValueError(f"{input_name} must be a LATENT (a dict with 'samples'), got {type(latent).__name__}")
    samples = latent["samples"]
    if getattr(samples, "is_nested", False):
        parts = list(samples.unbind())
        if len(parts) != 2:
            raise ValueError(
                f"{input_name} is a nested LATENT of {len(parts)} parts; expected LTX-2's (video, audio) pair "
                "from SP Sampler or LTXVConcatAVLatent"
            )
        video, audio = parts
    elif isinstance(samples, torch.Tensor) and samples.ndim == 5:
        video, audio = samples, None
    elif isinstance(samples, torch.Tensor) and samples.ndim == 4 and samples.shape[1] == AUDIO_LATENT_CHANNELS:
        raise ValueError(
            f"{input_name} is an audio-only LATENT {list(samples.shape)}; connect the AV LATENT "
            "(or LTXVConcatAVLatent of video and audio)"
        )
    else:
        shape = list(samples.shape) if hasattr(samples, "shape") else type(samples).__name__
        raise ValueError(f"{input_name} is not an LTX-2 latent: samples {shape}; expected video [1, 128, F', H/32, W/32]")
    _check_video_latent(video, input_name)
    if audio is not None:
        _check_audio_latent(audio, input_name)
    return video, audio


def _check_video_latent(video: torch.Tensor, input_name: str) -> None:
    if video.ndim != 5 or video.shape[1] != VIDEO_LATENT_CHANNELS:
        raise ValueError(
            f"{input_name}: the video latent has shape {list(video.shape)}, not LTX-2's [B, 128, F', H/32, W/32]; "
            "use a latent from SP Sampler or an LTX-2 video node"
        )
    if video.shape[0] != 1:
        raise ValueError(
            f"{input_name}: the video latent holds a batch of {video.shape[0]}; the MGPU nodes make one video at a "
            "time: use batch_size 1 (spread batches over separate queue entries)"
        )


def _check_audio_latent(audio: torch.Tensor, input_name: str) -> None:
    if audio.ndim != 4 or audio.shape[1] != AUDIO_LATENT_CHANNELS or audio.shape[3] != AUDIO_LATENT_MEL_BINS:
        raise ValueError(
            f"{input_name}: the audio latent has shape {list(audio.shape)}, not LTX-2's [B, 8, T, 16]; "
            "use a latent from SP Sampler or LTXVEmptyLatentAudio"
        )
    if audio.shape[0] != 1:
        raise ValueError(f"{input_name}: the audio latent holds a batch of {audio.shape[0]}; use batch_size 1")


def latent_frame_rate(latent: dict, override: float, input_name: str) -> float:
    """The frame rate a stage-2 job needs: the latent's own, or ``override`` when it has none.

    ``override`` 0 means "take it from the latent"; a non-zero override that contradicts the
    latent is refused (stage 2 would place the audio at the wrong times).
    """
    recorded = latent.get(FRAME_RATE_KEY)
    if override and recorded and not math.isclose(float(recorded), override, rel_tol=1e-6):
        raise ValueError(
            f"{input_name} was sampled at {recorded} fps but frame_rate is {override}; set frame_rate to 0 "
            "to use the latent's own frame rate"
        )
    if override:
        return float(override)
    if not recorded:
        raise ValueError(
            f"{input_name} does not record its frame rate (it comes from native nodes); set frame_rate to the "
            "rate it was sampled at, e.g. 24"
        )
    return float(recorded)


# --- IMAGE / AUDIO --------------------------------------------------------------------------------


def first_frame(image: torch.Tensor | None, input_name: str = "image") -> torch.Tensor | None:
    """The conditioning image the fleet takes, ``[H, W, 3]`` in 0..1, from a ComfyUI IMAGE batch."""
    if image is None:
        return None
    if image.ndim != 4 or image.shape[-1] not in (3, 4):
        raise ValueError(f"{input_name} must be a ComfyUI IMAGE [batch, H, W, 3], got shape {list(image.shape)}")
    return image[0, :, :, :3].float().contiguous()


def make_audio(waveform: torch.Tensor | None, sample_rate: int | None) -> dict | None:
    """ComfyUI's AUDIO: ``{"waveform": [B, C, T] float32, "sample_rate": int}`` (None without audio)."""
    if waveform is None:
        return None
    return {"waveform": waveform.float().contiguous(), "sample_rate": int(sample_rate)}
