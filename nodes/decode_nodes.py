"""Distributed VAE Decode: AV LATENT -> IMAGE frames + AUDIO, with the video tiles spread over GPUs.

The frames come back from the fleet through shared memory (a 121-frame 1536x1024 video is 2.3 GB
of float32) and leave as ComfyUI's IMAGE ``[frames, H, W, 3]`` in 0..1; the audio as ComfyUI's
AUDIO ``{"waveform": [B, C, T], "sample_rate"}``. The tiling and blending happen in the fleet.
"""

from __future__ import annotations

from mgpu_backend.ltx import api
from mgpu_backend.ltx.schema import DECODE_SPATIAL_TILE_PIXELS, DECODE_TEMPORAL_TILE_FRAMES, OFFICIAL, SEED_MAX

from .fleet_job import FleetJob
from .layouts import FRAME_RATE_KEY, GUIDING_FRAMES_KEY, MODEL_TYPE, STAGES_KEY, check_model_handle, make_audio, split_latent
from .model_nodes import CATEGORY


class DistributedVAEDecode:
    """Decode the video latent tile by tile on all GPUs, and the audio latent with the vocoder."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE", "AUDIO")
    RETURN_NAMES = ("images", "audio")
    OUTPUT_TOOLTIPS = (
        "The video frames, [frames, height, width, 3] in 0..1.",
        "The soundtrack (None when the latent has no audio), for CreateVideo's audio input.",
    )
    FUNCTION = "decode"
    DESCRIPTION = "Decodes an LTX-2 AV LATENT (or a video-only LATENT) to frames and sound; video tiles are decoded on different GPUs."

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "The model from Load Checkpoint MGPU (its VAEs and vocoder decode)."}),
                "av_latent": ("LATENT", {"tooltip": "The AV LATENT from TDP Upscale or SP Sampler, or a video-only LTX-2 LATENT."}),
                "seed": ("INT", {"default": OFFICIAL.seed, "min": 0, "max": SEED_MAX, "control_after_generate": True, "tooltip": "Seed of the small noise LTX-2's video decoder adds; the same seed gives the same frames."}),
                "spatial_tile_pixels": ("INT", {"default": DECODE_SPATIAL_TILE_PIXELS, "min": 64, "max": 4096, "step": 32, "tooltip": f"Side of one decode tile in output pixels (the official {DECODE_SPATIAL_TILE_PIXELS}). Smaller tiles: less memory per GPU and more tiles to share out."}),
                "temporal_tile_frames": ("INT", {"default": DECODE_TEMPORAL_TILE_FRAMES, "min": 16, "max": 1024, "step": 8, "tooltip": f"Frames per decode chunk (the official {DECODE_TEMPORAL_TILE_FRAMES}). Smaller: less memory per GPU."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def decode(self, model, av_latent, seed, spatial_tile_pixels, temporal_tile_frames, unique_id=None):
        handle = check_model_handle(model)
        video_latent, audio_latent = split_latent(av_latent, "av_latent")
        # The decoder's noise continues the job generator after the stages that made the latent, as
        # in the official pipeline; a latent from native nodes has no such history.
        history = {"frame_rate": float(av_latent.get(FRAME_RATE_KEY) or OFFICIAL.frame_rate), "after_stages": int(av_latent.get(STAGES_KEY, 0))}
        if audio_latent is not None:  # ComfyUI's audio length (one frame more than the fleet's) decodes as the fleet's
            audio_latent = api.audio_latent_for_fleet(audio_latent, video_latent, history["frame_rate"])
        job = FleetJob(unique_id, "Distributed VAE Decode")
        frames, waveform, sample_rate = job.call(
            api.decode,
            handle["spec"],
            video_latent,
            audio_latent,
            seed=seed,
            **history,
            guiding_frames=int(av_latent.get(GUIDING_FRAMES_KEY, 0)),
            spatial_tile_pixels=spatial_tile_pixels,
            temporal_tile_frames=temporal_tile_frames,
            dtype=handle["dtype"],
        )
        return (frames.float().contiguous(), make_audio(waveform, sample_rate))
