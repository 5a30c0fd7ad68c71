"""ComfyUI's own LTX-2.3 model in the test process, and denoiser calls as ComfyUI makes them, for the
tests of the fleet's ComfyUI engine (tests/test_comfy_model_*.py).

They need ComfyUI's code: ``COMFYUI_DIR`` names a ComfyUI v0.20.1 checkout, and the tests run under a
Python with its requirements (``/tmp/comfy-venv/bin/python``); without them the tests skip. The fleet
the tests start runs that same Python, so its ranks import ComfyUI from the same folder.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import pytest
import torch

from mgpu_backend.comfy_model import wire

COMFYUI_DIR = os.environ.get("COMFYUI_DIR", "")

VIDEO_SHAPE = (1, 128, 3, 4, 4)  # 48 video tokens (64 with a guide frame): shards of 24 and 12 tokens
PADDED_VIDEO_SHAPE = (1, 128, 3, 3, 5)  # 45 video tokens: SP 2 and 4 both pad the last shard
LONG_VIDEO_SHAPE = (1, 128, 5, 16, 16)  # 1280 video tokens: a forward long enough to cancel in flight
GATE_ROUNDING_BOUND = 4e-6
"""Where a token count is not a multiple of 4, SP on CPU is not bitwise with the tiny model. PyTorch's
CPU elementwise kernels run the last ``numel % 32`` float32 elements of a tensor through a scalar
loop whose ``sigmoid`` rounds differently from the vectorised one (AVX-512); the tiny model's
per-head attention gate (``2 * sigmoid(to_gate_logits(x))``) is 8 heads wide, so the gates of the
last tokens of the full sequence or of a shard round by where the tensor ends. Measured: 1.2e-6 at
most on outputs of order 1 (float32). LTX-2.3's 32 heads make every gate row two whole vectors."""
BATCH_SPLIT_BOUND = 4e-6
"""A batch split over groups is not bitwise on CPU: each group embeds the timesteps of its own samples
(the AdaLN timestep MLPs, one row per sample), and a matrix product of 1 row rounds differently
from the same row inside a product of 2 (BLAS picks another kernel for so few rows). Measured:
1.9e-6 at most on outputs of order 1 (float32)."""
GUIDE_FRAMES = 1
AUDIO_SHAPE = (1, 8, 12, 16)  # 12 audio tokens: whole gate vectors at batch 1 and 2 (see GATE_ROUNDING_BOUND)
TEXT_TOKENS = 12


def rank_threads(world_size: int) -> int:
    """The intra-op threads of a CPU rank in a fleet of ``world_size`` (mgpu_backend/fleet/rank.py's rule).

    CPU matrix products round by their thread count, so the in-process reference is computed with
    the threads of the ranks it is compared with: "bitwise" means at the same threads per process."""
    return max(1, (os.cpu_count() or 1) // world_size)


@contextlib.contextmanager
def torch_threads(count: int):
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def import_comfy_or_skip(device: torch.device = torch.device("cpu")):
    """ComfyUI's ``comfy`` from COMFYUI_DIR on ``device``, as a rank imports it, or a skip that says why."""
    if not COMFYUI_DIR:
        pytest.skip("set COMFYUI_DIR to a ComfyUI v0.20.1 checkout (and run under its Python) to test the ComfyUI engine")
    from mgpu_backend.comfy_model import runtime

    try:
        comfy, _ = runtime.import_comfy(os.path.abspath(COMFYUI_DIR), device)
    except runtime.ComfyInputError as exc:
        if "requirements are not importable" not in str(exc):
            raise
        pytest.skip(f"{exc} (run the tests under ComfyUI's Python, e.g. /tmp/comfy-venv/bin/python)")
    return comfy


def load_tiny(comfy):
    """The tiny LTX-2.3 bundle's checkpoint, loaded as CheckpointLoaderSimple loads it."""
    import comfy.sd

    from mgpu_backend.bundles.tiny import default_tiny_bundle

    path = str(default_tiny_bundle("2.3").checkpoint_path)
    patcher = comfy.sd.load_checkpoint_guess_config(path, output_vae=False, output_clip=False, model_options={})[0]
    return path, patcher


def text_width(diffusion_model) -> int:
    """The width of LTX-2.3's unprocessed text features: video and audio parts side by side."""
    return diffusion_model.cross_attention_dim + diffusion_model.audio_cross_attention_dim


@dataclass
class Call:
    """One call of the diffusion model as ``BaseModel._apply_model`` makes it, and its in-process output."""

    x: object
    timestep: object
    context: torch.Tensor
    transformer_options: dict
    kwargs: dict

    def wire_args(self, model_key: str, set_digest: str = "") -> tuple[dict, dict]:
        packed, tensors = wire.pack({
            "x": self.x, "timestep": self.timestep, "context": self.context,
            "transformer_options": self.transformer_options, "kwargs": self.kwargs,
        })
        args = {"model_key": model_key, "set_digest": set_digest, "call": packed, "count": len(tensors)}
        return args, wire.tensors_by_name(tensors)


def load_in_fleet(socket_path, model_path: str) -> dict:
    """``comfy.load`` of the model at ``model_path`` as CheckpointLoaderSimple loads it; its result fields."""
    from tests.fleet_harness import run_job

    return run_job(socket_path, "comfy.load", {
        "comfy_dir": os.path.abspath(COMFYUI_DIR), "path": model_path, "loader": "checkpoint", "weight_dtype": "default",
    }).fields


def forward_in_fleet(socket_path, model_key: str, call: Call, set_digest: str = ""):
    """``comfy.forward`` of ``call``: (the model's output, the result fields)."""
    from tests.fleet_harness import run_job

    args, tensors = call.wire_args(model_key, set_digest)
    result = run_job(socket_path, "comfy.forward", args, tensors)
    return wire.unpack(result.fields["out"], wire.tensors_in_order(result.tensors, result.fields["count"])), result.fields


def _keyframe_idxs(comfy, guide: torch.Tensor, frame_idx: int) -> torch.Tensor:
    """Keyframe pixel coordinates of a guide latent, computed as LTXVAddGuide.add_keyframe_index does."""
    from comfy.ldm.lightricks.symmetric_patchifier import SymmetricPatchifier, latent_to_pixel_coords

    _, latent_coords = SymmetricPatchifier(1, start_end=True).patchify(guide)
    pixel_coords = latent_to_pixel_coords(latent_coords, (8, 32, 32), causal_fix=frame_idx == 0 or guide.shape[2] == 1)
    pixel_coords[:, 0] += frame_idx
    return pixel_coords


class _Captured(Exception):
    """Stops ComfyUI's forward once the diffusion model's call is captured."""


def make_call(comfy, patcher, case: str, seed: int, batch: int = 1, sigmas: tuple[float, ...] = (0.8,), device=torch.device("cpu")) -> Call:
    """A denoiser call of ``case`` ('plain', 'padded' (plain, 45 tokens), 'long' (plain, 1280 tokens),
    'image_to_video' or 'keyframes'), made by the in-process model's own extra_conds / process_timestep / _apply_model on
    random latents of ComfyUI's shapes, at ``sigmas`` (one per sample; one for all), on ``device`` (where
    the model's weights are; the random values are drawn on the CPU, so they are the same on any device)."""
    import comfy.utils

    model = patcher.model
    generator = torch.Generator().manual_seed(seed)
    video_shape = list({"padded": PADDED_VIDEO_SHAPE, "long": LONG_VIDEO_SHAPE}.get(case, VIDEO_SHAPE))
    video_shape[0] = batch
    if case == "keyframes":
        video_shape[2] += GUIDE_FRAMES
    video = torch.randn(video_shape, generator=generator).to(device)
    audio = torch.randn((batch, *AUDIO_SHAPE[1:]), generator=generator).to(device)
    packed, latent_shapes = comfy.utils.pack_latents([video, audio])
    cross_attn = torch.randn(batch, TEXT_TOKENS, text_width(model.diffusion_model), generator=generator).to(device)
    conds = {
        "cross_attn": cross_attn, "unprocessed_ltxav_embeds": True, "device": device, "frame_rate": 24.0,
        "latent_shapes": latent_shapes,
    }
    if case in ("image_to_video", "keyframes"):
        video_mask = torch.ones(batch, 1, *video_shape[2:], device=device)
        if case == "image_to_video":
            video_mask[:, :, 0] = 0.0  # the first frame is the given image
        else:
            video_mask[:, :, -GUIDE_FRAMES:] = 0.0  # a guide of strength 1
            guide = video[:, :, -GUIDE_FRAMES:]
            conds["keyframe_idxs"] = _keyframe_idxs(comfy, guide, frame_idx=2)
            conds["guide_attention_entries"] = [
                {"pre_filter_count": GUIDE_FRAMES * video_shape[3] * video_shape[4], "strength": 0.5, "pixel_mask": None, "latent_shape": [GUIDE_FRAMES, *video_shape[3:]]}
            ]
        audio_mask = torch.ones(batch, 1, audio.shape[2], 1, device=device)
        conds["denoise_mask"], _ = comfy.utils.pack_latents([video_mask.expand(video.shape), audio_mask.expand(audio.shape)])
    extra = {name: cond.cond for name, cond in model.extra_conds(**conds).items()}
    sigma = torch.tensor(sigmas, device=device).expand(batch).contiguous()
    options = {"cond_or_uncond": list(range(batch)), "sigmas": sigma}

    seen: dict = {}

    def capture(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)
        raise _Captured  # the call is what the test needs; the forward runs where the test wants it

    handle = model.diffusion_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.inference_mode():
            model.apply_model(packed, sigma, transformer_options=options, **extra)
    except _Captured:
        pass
    finally:
        handle.remove()
    kwargs = dict(seen["kwargs"])
    context, options, control = kwargs.pop("context"), kwargs.pop("transformer_options"), kwargs.pop("control")
    assert control is None
    x, timestep = seen["args"]
    return Call(x, timestep, context, options, kwargs)


def in_process(patcher, call: Call, threads: int):
    """ComfyUI's own diffusion model on ``call`` in this process, with ``threads`` intra-op threads."""
    with torch_threads(threads), torch.inference_mode():
        return patcher.model.diffusion_model(
            call.x, call.timestep, context=call.context, control=None, transformer_options=call.transformer_options, **call.kwargs
        )


def random_lora(comfy, patcher, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """A small random LoRA in ComfyUI's ``lora_unet_*`` key format for a few Linear weights of the
    video, audio and audio-video attentions and a feed-forward."""
    import comfy.lora

    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    targets = [
        "transformer_blocks.0.attn1.to_q", "transformer_blocks.0.audio_to_video_attn.to_v",
        "transformer_blocks.1.video_to_audio_attn.to_k", "transformer_blocks.1.ff.net.0.proj",
    ]
    state = patcher.model.state_dict()
    generator = torch.Generator().manual_seed(seed)
    lora: dict[str, torch.Tensor] = {}
    for target in targets:
        name = "lora_unet_" + target.replace(".", "_")
        weight = state[key_map[name]]
        lora[f"{name}.lora_up.weight"] = torch.randn(weight.shape[0], rank, generator=generator) * 0.1
        lora[f"{name}.lora_down.weight"] = torch.randn(rank, weight.shape[1], generator=generator) * 0.1
        lora[f"{name}.alpha"] = torch.tensor(float(rank))
    return lora


def max_difference(found, expected) -> float:
    """The largest absolute difference of two model outputs (a tensor or ComfyUI's [video, audio] list)."""
    if isinstance(expected, torch.Tensor):
        assert found.dtype == expected.dtype and found.shape == expected.shape
        return (found.float() - expected.float()).abs().max().item()
    assert isinstance(found, (list, tuple)) and len(found) == len(expected)
    return max(max_difference(got, want) for got, want in zip(found, expected))


def assert_same(found, expected) -> None:
    """Bitwise equality of two model outputs (a tensor or ComfyUI's [video, audio] list)."""
    difference = max_difference(found, expected)
    if isinstance(expected, torch.Tensor):
        assert torch.equal(found, expected), f"max difference {difference}"
        return
    for got, want in zip(found, expected):
        assert torch.equal(got, want), f"max difference {difference}"
