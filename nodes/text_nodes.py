"""MGPU Text Encode: positive and negative prompt -> two CONDITIONING, encoded by Gemma on the fleet.

LTX-2 conditions video and audio on two different text contexts; a native ComfyUI CONDITIONING
has room for one, so the audio context rides in its options dict (see ``layouts``), with the digest
the fleet keeps both under. Nothing here runs Gemma: the fleet does.
"""

from __future__ import annotations

from mgpu_backend.ltx import api
from mgpu_backend.ltx.schema import MAX_PROMPT_CHARS

from .fleet_job import FleetJob
from .layouts import MODEL_TYPE, check_model_handle, make_conditioning
from .model_nodes import CATEGORY
from .validation import refusal

DEFAULT_PROMPT = (
    "A red fox trots through fresh snow in a quiet birch forest at dawn, its breath visible in the cold air. "
    "The camera follows at ground level. Soft crunching footsteps, distant birdsong."
)
DEFAULT_NEGATIVE_PROMPT = (
    "blurry, low quality, distorted anatomy, flickering, jittery motion, watermark, text overlay, "
    "muffled or distorted audio, silence"
)

EMPTY_PROMPT = "the positive prompt is empty; describe the video and its sound"


class MGPUTextEncode:
    """Encode the positive and negative prompt with the model's Gemma text encoder on the fleet."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("CONDITIONING", "CONDITIONING")
    RETURN_NAMES = ("positive", "negative")
    OUTPUT_TOOLTIPS = (
        "The positive prompt's video and audio contexts, for SP Sampler and TDP Upscale.",
        "The negative prompt's contexts, for SP Sampler's guidance.",
    )
    FUNCTION = "encode"
    DESCRIPTION = "Encodes prompts for LTX-2 (video and audio contexts) with Gemma 3 on the MGPU fleet."

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "The model from Load Checkpoint MGPU (its Gemma folder encodes the prompts)."}),
                "positive": ("STRING", {"default": DEFAULT_PROMPT, "multiline": True, "dynamicPrompts": False, "tooltip": "What to see and hear: describe the scene, the motion, the camera and the sounds or speech, in a few sentences."}),
                "negative": ("STRING", {"default": DEFAULT_NEGATIVE_PROMPT, "multiline": True, "dynamicPrompts": False, "tooltip": "What to steer away from (used by the video and audio guidance). May be empty."}),
            },
            "optional": {
                "free_gemma": ("BOOLEAN", {"default": False, "tooltip": "Give Gemma's GPU memory back after encoding (about 24 GB for Gemma 3 12B, split over the GPUs when sharded). The next encode rebuilds it from host memory (from disk the first time after a Gemma that was kept), which takes seconds. Turn on when GPU memory is tight, e.g. on 80 GB GPUs."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, positive=None, negative=None):
        """ComfyUI runs this before queueing: an empty or overlong prompt is refused before any load,
        under the prompt at fault (a prompt fed by a link is None here, checked when the node runs)."""

        def check_length(prompt):
            if len(prompt) > MAX_PROMPT_CHARS:
                raise ValueError(f"a prompt has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}: shorten it")

        def check_positive(prompt):
            if not prompt.strip():
                raise ValueError(EMPTY_PROMPT)
            check_length(prompt)

        return refusal([("positive", positive, check_positive), ("negative", negative, check_length)])

    def encode(self, model, positive, negative, free_gemma=False, unique_id=None):
        handle = check_model_handle(model)
        if not positive.strip():
            raise ValueError(EMPTY_PROMPT)
        job = FleetJob(unique_id, "MGPU Text Encode")
        positive_encoding, negative_encoding = job.call(
            api.encode, handle["spec"], [positive, negative], dtype=handle["dtype"], gemma_mode=handle["gemma_mode"],
            free_gemma=bool(free_gemma),
        )
        return make_conditioning(positive_encoding, positive), make_conditioning(negative_encoding, negative)
