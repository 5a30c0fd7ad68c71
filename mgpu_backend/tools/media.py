"""Writing and reading the job's media: an mp4 with H.264 video and AAC audio (PyAV).

Used by the headless ``generate`` command and by tests; the ComfyUI graph saves video with
ComfyUI's own CreateVideo/SaveVideo nodes instead. Never runs on a rank.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch

from mgpu_backend.ltx.decode import fit_audio_to_video


def write_mp4(path: str | Path, frames: torch.Tensor, frame_rate: float, waveform: torch.Tensor | None = None, sample_rate: int | None = None, crf: int = 18) -> Path:
    """``frames`` [F,H,W,3] float in 0..1 (ComfyUI IMAGE); ``waveform`` [B,C,T] or [C,T] float in -1..1,
    cut or padded with silence to the video's duration."""
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be [frames, height, width, 3], got {tuple(frames.shape)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = int(frames.shape[1]), int(frames.shape[2])
    pixels = (frames.clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    rate = Fraction(frame_rate).limit_denominator(1001)
    with av.open(str(path), mode="w") as container:
        video = container.add_stream("libx264", rate=rate)
        video.width, video.height = width + width % 2, height + height % 2
        video.pix_fmt = "yuv420p"
        video.options = {"crf": str(crf)}
        audio = None
        if waveform is not None:
            if sample_rate is None:
                raise ValueError("a waveform needs its sample_rate")
            samples = waveform[0] if waveform.ndim == 3 else waveform
            samples = fit_audio_to_video(samples, int(frames.shape[0]), frame_rate, int(sample_rate))  # both streams end together
            channels = int(samples.shape[0])
            audio = container.add_stream("aac", rate=int(sample_rate))
            audio.layout = "stereo" if channels >= 2 else "mono"
        for image in pixels:
            if image.shape[0] != video.height or image.shape[1] != video.width:
                image = np.pad(image, ((0, video.height - height), (0, video.width - width), (0, 0)), mode="edge")
            for packet in video.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        if audio is not None:
            pcm = samples[: 2 if channels >= 2 else 1].clamp(-1, 1).float().cpu().numpy()
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm), format="fltp", layout=audio.layout.name)
            frame.sample_rate = int(sample_rate)
            for packet in audio.encode(frame):
                container.mux(packet)
            for packet in audio.encode():
                container.mux(packet)
    return path


def probe(path: str | Path) -> dict:
    """Stream facts of a media file: codecs, frame count, size, audio rate and decoded sample count."""
    facts: dict = {}
    with av.open(str(path)) as container:
        for stream in container.streams:
            if stream.type == "video":
                frames = sum(1 for _ in container.decode(stream))
                facts["video"] = {"codec": stream.codec_context.name, "width": stream.width, "height": stream.height, "frames": frames}
                container.seek(0)
            elif stream.type == "audio":
                samples = sum(frame.samples for frame in container.decode(stream))
                facts["audio"] = {"codec": stream.codec_context.name, "sample_rate": stream.rate, "channels": stream.channels, "samples": samples}
                container.seek(0)
    return facts
