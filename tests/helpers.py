"""What several test modules share: the tiny models, cases and fakes they build on, kept here so that
no test module imports another."""

from __future__ import annotations

import base64
import collections
import contextlib
import hashlib
import importlib.util
import inspect
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
import types
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import torch
from ltx_core.components.diffusion_steps import EulerDiffusionStep
from ltx_core.components.guiders import MultiModalGuiderFactory, MultiModalGuiderParams
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.conditioning import ConditioningItemAttentionStrengthWrapper, VideoConditionByKeyframeIndex, VideoConditionByLatentIndex
from ltx_core.guidance.perturbations import BatchedPerturbationConfig, Perturbation, PerturbationConfig, PerturbationType
from ltx_core.model.transformer.modality import Modality
from ltx_core.model.transformer.model import X0Model
from ltx_core.model.transformer.model_configurator import LTXModelConfigurator
from ltx_core.model.video_vae import SpatialTilingConfig, TemporalTilingConfig, TilingConfig, VideoDecoder, VideoDecoderConfigurator
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, LatentState, VideoLatentShape

from mgpu_backend.bundles import full_size
from mgpu_backend.bundles.tiny import LTX2_TRANSFORMER_ARCHITECTURE
from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.protocol import Message
from mgpu_backend.ltx import api
from mgpu_backend.ltx.latents import job_generator
from mgpu_backend.ltx.passes import GuidancePass, PASS_NAMES
from mgpu_backend.ltx.residency import sizes_from_headers
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.compiled_blocks import apply_compiled_blocks, remove_compiled_blocks
from mgpu_backend.parallel.guidance_parallel import apply_guidance_parallel, build_stage1_groups, plan_stage1
from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel
from mgpu_backend.tools import comfy_queue
from tests import fleet_harness
from tests.fleet_harness import REPO


# --------------------------------------------------------------------------------------------------
# The command line, run as a user runs it
# --------------------------------------------------------------------------------------------------

def cli(*args: str, cwd=None, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    env.pop("MGPU_SOCKET", None)
    return subprocess.run([sys.executable, "-m", "mgpu_backend", *args], cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------------------------------
# A tiny fake ComfyUI (real HTTP and websocket on 127.0.0.1) for ``python -m mgpu_backend queue``
# --------------------------------------------------------------------------------------------------

WORKFLOW = Path(__file__).resolve().parent.parent / "workflows" / "api" / "ltx2_t2v_tiny.json"


PROMPT_ID = "prompt-0001"


SAVED = {"filename": "ltx2_tiny_mgpu_00001_.mp4", "subfolder": "video", "type": "output"}


def server_frame(opcode: int, payload: bytes, final: bool = True) -> bytes:
    """A server frame (unmasked), with the 7-, 16- or 64-bit length the payload needs."""
    head = bytes([(0x80 if final else 0) | opcode])
    if len(payload) < 126:
        head += bytes([len(payload)])
    elif len(payload) < 1 << 16:
        head += bytes([126]) + struct.pack(">H", len(payload))
    else:
        head += bytes([127]) + struct.pack(">Q", len(payload))
    return head + payload


def event(kind: str, **data) -> bytes:
    return server_frame(0x1, json.dumps({"type": kind, "data": data}).encode())


def text_event(node_id: str, text: str) -> bytes:
    node = node_id.encode()
    return server_frame(0x2, struct.pack(">I", 3) + struct.pack(">I", len(node)) + node + text.encode())


def read_client_frame(stream) -> tuple[int, bytes, bool]:
    first, second = stream.read(2)
    length = second & 0x7F
    if length == 126:
        length = struct.unpack(">H", stream.read(2))[0]
    elif length == 127:
        length = struct.unpack(">Q", stream.read(8))[0]
    masked = bool(second & 0x80)
    mask = stream.read(4) if masked else b"\0\0\0\0"
    payload = bytes(byte ^ mask[index % 4] for index, byte in enumerate(stream.read(length)))
    return first & 0x0F, payload, masked


class FakeComfyUI:
    """POST /prompt, GET /ws (upgrade, then a scripted event stream), GET /history/<id>."""

    def __init__(self, script: list[bytes], refuse: dict | None = None, history_status: dict | None = None) -> None:
        self.script, self.refuse = script, refuse
        self.history_status = history_status or {"status_str": "success", "completed": True, "messages": []}
        self.posted: list[dict] = []
        self.ws_client_ids: list[str] = []
        self.client_frames: list[tuple[int, bytes, bool]] = []
        self.prompt_posted = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send_json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.posted.append(body)
                if fake.refuse is not None:
                    self.send_json(400, fake.refuse)
                    return
                self.send_json(200, {"prompt_id": PROMPT_ID, "number": 3, "node_errors": {}})
                fake.prompt_posted.set()

            def do_GET(self):
                url = urlsplit(self.path)
                if url.path == "/ws":
                    self.websocket(parse_qs(url.query)["clientId"][0])
                elif url.path == f"/history/{PROMPT_ID}":
                    entry = {"prompt": [], "outputs": {"8": {"images": [SAVED], "animated": [True]}}, "status": fake.history_status}
                    self.send_json(200, {PROMPT_ID: entry})
                else:
                    self.send_json(404, {})

            def websocket(self, client_id: str) -> None:
                fake.ws_client_ids.append(client_id)
                key = self.headers["Sec-WebSocket-Key"]
                accept = base64.b64encode(hashlib.sha1((key + comfy_queue.WEBSOCKET_GUID).encode()).digest()).decode()
                self.send_response(101)
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept)
                self.end_headers()
                self.close_connection = True
                try:
                    self.stream_events(client_id)
                except (OSError, ValueError):
                    pass  # the client hung up first (it stops reading after an error event)

            def stream_events(self, client_id: str) -> None:
                self.wfile.write(event("status", status={"exec_info": {"queue_remaining": 0}}, sid=client_id))
                self.wfile.flush()
                fake.prompt_posted.wait(10)
                for frame in fake.script:
                    if frame == b"DROP":  # the connection dies without a close frame
                        return
                    self.wfile.write(frame)
                    self.wfile.flush()
                    if frame[0] & 0x0F == 0x9:  # a ping: the client must answer with a pong first
                        fake.client_frames.append(read_client_frame(self.rfile))
                self.wfile.write(server_frame(0x8, struct.pack(">H", 1000)))
                self.wfile.flush()
                while True:
                    frame = read_client_frame(self.rfile)
                    fake.client_frames.append(frame)
                    if frame[0] == 0x8:
                        return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeComfyUI:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


SUCCESS_SCRIPT = [
    event("execution_start", prompt_id=PROMPT_ID),
    event("execution_cached", nodes=["1", "3"], prompt_id=PROMPT_ID),
    event("executing", node="4", display_node="4", prompt_id=PROMPT_ID),
    server_frame(0x9, b"are-you-there"),
    event("progress", value=1, max=3, prompt_id=PROMPT_ID, node="4"),
    text_event("4", "stage1 1/3 · 0.40 s/step · rank 0 0.40 s | rank 1 0.41 s"),
    # A text message in two fragments, then a preview image that needs a 64-bit length.
    server_frame(0x1, json.dumps({"type": "progress", "data": {"value": 2, "max": 3, "prompt_id": PROMPT_ID, "node": "4"}}).encode()[:20], final=False),
    server_frame(0x0, json.dumps({"type": "progress", "data": {"value": 2, "max": 3, "prompt_id": PROMPT_ID, "node": "4"}}).encode()[20:]),
    server_frame(0x2, struct.pack(">I", 1) + b"\xff" * 70_000),
    event("progress", value=3, max=3, prompt_id="someone-elses-prompt", node="9"),
    event("progress", value=3, max=3, prompt_id=PROMPT_ID, node="4"),
    event("executing", node="8", display_node="8", prompt_id=PROMPT_ID),
    event("execution_success", prompt_id=PROMPT_ID),
]


# --------------------------------------------------------------------------------------------------
# Inputs and comparisons for the CUDA-graph and compiled-block forwards
# --------------------------------------------------------------------------------------------------

def transformer_inputs(seed: int, frames: int = 3, sigma: float = 0.7, device="cpu", dtype=torch.float32, image_conditioning=False):
    video_state, audio_state = tiny_latent_states(seed, frames=frames, image_conditioning=image_conditioning)
    video_context, audio_context = tiny_contexts(seed)
    video, audio = modality(video_state, video_context, sigma), modality(audio_state, audio_context, sigma)

    def moved(m):
        fields = {}
        for name in ("latent", "sigma", "timesteps", "positions", "context", "attention_mask"):
            value = getattr(m, name)
            if value is not None:
                # Latents and text in the model's dtype; sigma, timesteps, positions stay float32 as in stage 1.
                fields[name] = value.to(device=device, dtype=dtype) if name in ("latent", "context") else value.to(device)
        return replace(m, **fields)

    return moved(video), moved(audio)


def stg_perturbations() -> BatchedPerturbationConfig:
    return BatchedPerturbationConfig([STG])


def isolated_perturbations() -> BatchedPerturbationConfig:
    return BatchedPerturbationConfig([ISOLATED])


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# --------------------------------------------------------------------------------------------------
# A tiny random ltx-core video decoder and the tiling scenarios it decodes
# --------------------------------------------------------------------------------------------------

TINY_DECODER_CONFIG = {
    "vae": {
        "dims": 3,
        "latent_channels": 128,
        "out_channels": 3,
        "patch_size": 4,
        "norm_layer": "pixel_norm",
        "causal_decoder": False,
        "timestep_conditioning": True,
        "decoder_base_channels": 4,
        "spatial_padding_mode": "reflect",
        # Listed encoder-side first, as in checkpoints; the decoder runs them in reverse.
        "decoder_blocks": [
            ["res_x", {"num_layers": 1, "inject_noise": True}],
            ["compress_all", {"residual": True, "multiplier": 2}],
            ["compress_all", {"residual": True, "multiplier": 2}],
            ["compress_all", {"residual": True, "multiplier": 2}],
            ["res_x", {"num_layers": 1, "inject_noise": True}],
        ],
    }
}


SPATIAL_64_32 = SpatialTilingConfig(tile_size_in_pixels=64, tile_overlap_in_pixels=32)


# name -> (latent shape [B, 128, F', H', W'], tiling for the distributed decode, tiling for
# ltx-core's reference, tile count). The reference tiling differs only for the spatial-only case:
# ltx-core 1.0.0's tiled_decode fails without a temporal tiling, so it gets one temporal tile that
# covers the whole video, which yields the same tiles and weights.
SCENARIOS = {
    # 3 temporal x 2 x 3 spatial tiles: more tiles than ranks, 2D corners where 4 tiles overlap.
    "spatial_and_temporal": (
        (1, 128, 6, 3, 4),
        TilingConfig(SPATIAL_64_32, TemporalTilingConfig(24, 8)),
        TilingConfig(SPATIAL_64_32, TemporalTilingConfig(24, 8)),
        18,
    ),
    # Temporal tiles of 2 latent frames with overlap 1: up to three temporal groups overlap a frame.
    "three_way_temporal_overlap": (
        (1, 128, 6, 2, 3),
        TilingConfig(SPATIAL_64_32, TemporalTilingConfig(16, 8)),
        TilingConfig(SPATIAL_64_32, TemporalTilingConfig(16, 8)),
        10,
    ),
    # Two tiles, batch 2: fewer tiles than four ranks, two ranks idle.
    "fewer_tiles_than_ranks": (
        (2, 128, 5, 2, 2),
        TilingConfig(None, TemporalTilingConfig(24, 8)),
        TilingConfig(None, TemporalTilingConfig(24, 8)),
        2,
    ),
    "spatial_only": (
        (1, 128, 3, 2, 3),
        TilingConfig(SPATIAL_64_32, None),
        TilingConfig(SPATIAL_64_32, TemporalTilingConfig(64, 8)),
        2,
    ),
    "no_tiling": ((1, 128, 2, 2, 2), None, None, 1),
}


def build_tiny_decoder(config: dict = TINY_DECODER_CONFIG) -> VideoDecoder:
    decoder = VideoDecoderConfigurator.from_config(config).eval()
    weights = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        # Several parameters and the latent statistics are created with torch.empty: fill them all.
        for parameter in decoder.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=weights) * 0.2)
        decoder.per_channel_statistics.get_buffer("std-of-means").copy_(torch.rand(128, generator=weights) + 0.5)
        decoder.per_channel_statistics.get_buffer("mean-of-means").copy_(torch.randn(128, generator=weights) * 0.1)
    return decoder


def scenario_latent(name: str) -> torch.Tensor:
    shape = SCENARIOS[name][0]
    return torch.randn(shape, generator=torch.Generator().manual_seed(len(name)))


def noise_seed(name: str) -> int:
    return 100 + list(SCENARIOS).index(name)


def single_gpu_decode_video(
    decoder: VideoDecoder,
    latent: torch.Tensor,
    tiling_config: TilingConfig | None,
    generator: torch.Generator | None = None,
    *,
    timestep: torch.Tensor | None = None,
) -> torch.Tensor:
    """ltx-core's own single-GPU decode, assembled: the reference the distributed decode equals.

    ``tiled_decode``'s chunks concatenated along frames, or ``decoder(latent)`` without tiling (what
    ltx-core's ``decode_video`` does before converting to uint8). Note that ltx-core 1.0.0's
    ``tiled_decode`` fails (TypeError) for a spatial-only tiling; the distributed decode handles it.
    """
    with torch.no_grad():
        if tiling_config is None:
            return decoder(latent, timestep, generator)
        chunks = list(decoder.tiled_decode(latent, tiling_config, timestep=timestep, generator=generator))
    return torch.cat(chunks, dim=2)


def distributed_decode_video(
    decoder: VideoDecoder,
    latent: torch.Tensor,
    tiling_config: TilingConfig | None,
    comm,
    generator: torch.Generator | None = None,
    *,
    timestep: torch.Tensor | None = None,
    on_tiles=None,
) -> torch.Tensor | None:
    """The product's distributed decode (``decode_tiles``) assembled into the decoder's own video
    [B, 3, F, H, W] on rank 0 (``None`` elsewhere), so that it compares with ``single_gpu_decode_video``
    before any conversion to images."""
    from mgpu_backend.parallel.distributed_decode import decode_tiles, decoded_video_shape

    video = None
    if comm.rank == 0:
        video = torch.empty(decoded_video_shape(decoder, latent.shape), device=latent.device, dtype=latent.dtype)

    def write_frames(first_frame: int, chunk: torch.Tensor) -> None:
        video[:, :, first_frame : first_frame + chunk.shape[2]] = chunk

    decode_tiles(decoder, latent, tiling_config, comm, generator, timestep, write_frames, on_tiles)
    return video


def video_to_images(video: torch.Tensor) -> torch.Tensor:
    """Decoded video [B, 3, F, H, W] (about -1..1) -> ComfyUI IMAGE [B*F, H, W, 3] float32 in 0..1."""
    batch, channels, frames, height, width = video.shape
    images = ((video.float() + 1.0) / 2.0).clamp(0.0, 1.0).permute(0, 2, 3, 4, 1)
    return images.reshape(batch * frames, height, width, channels)


# --------------------------------------------------------------------------------------------------
# Raw clients of a fleet server: submit a job, read its replies, poll for a condition
# --------------------------------------------------------------------------------------------------

def segments_of(*pids: int) -> set[str]:
    """Segments in /dev/shm created by ``pids`` (other tests may run beside this one)."""
    prefixes = tuple(f"mgpu-{os.getuid()}-{pid}-" for pid in pids)
    return {name for name in os.listdir(shm.SHM_DIR) if name.startswith(prefixes)}


def wait_until(condition, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``condition()`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.1)


def ranks_reported_after(client, moment: float, timeout: float = 30.0) -> list[dict]:
    """``client.status()``'s ranks once every rank's memory and weight report was taken after
    ``moment`` (a ``time.time()`` after the job that changed them returned).

    A report rides on a rank's heartbeat (one a second). A heartbeat that reached the server after
    ``moment`` left the rank after the job's result, but may have been measured before it; the one
    after it was measured after: so wait for two."""
    seen: list[list[dict]] = []

    def every_rank_beat_after(moments: dict[int, float]) -> bool:
        seen.append(client.status()["ranks"])
        return all((rank["heartbeat"] or 0.0) > moments[rank["rank"]] for rank in seen[-1])

    wait_until(lambda: every_rank_beat_after(collections.defaultdict(lambda: moment)), timeout, "a heartbeat from every rank")
    first = {rank["rank"]: rank["heartbeat"] for rank in seen[-1]}
    wait_until(lambda: every_rank_beat_after(first), timeout, "a second heartbeat from every rank")
    return seen[-1]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def submit(sock, op: str, args: dict | None = None, tensors=None, shm_descriptors=None, ref: int = 1) -> None:
    fields = {"op": op, "args": args or {}, "ref": ref}
    protocol.send_message(sock, Message("submit", fields, tensors or {}, shm=shm_descriptors or []))


def next_of(sock, *types: str) -> Message:
    while (message := protocol.recv_message(sock)).type not in types:
        pass
    return message


def ranks_of(server_pid: int) -> list[int]:
    """Live rank processes started by server ``server_pid``, whoever their parent is now."""
    marker = b"rank\0--rank", f"--owner-pid\0{server_pid}\0".encode()
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                text = cmdline.read()
        except OSError:
            continue
        if all(part in text for part in marker) and fleet_harness.process_alive(int(entry)):
            pids.append(int(entry))
    return pids


# --------------------------------------------------------------------------------------------------
# A 3-step Euler stage-1 loop with its four guidance passes, on one process or over ranks
# --------------------------------------------------------------------------------------------------

TOLERANCE = 1e-5


SIGMAS = torch.tensor([1.0, 0.7, 0.4, 0.0])


TINY_HEADS = {"attention_heads": 8, "audio_attention_heads": 8}


VIDEO_TOKENS = 45  # 2 latent frames of 3 x 5 plus one appended keyframe of 3 x 5


def _guider_factories() -> tuple[MultiModalGuiderFactory, MultiModalGuiderFactory]:
    """Guidance that changes the active passes between steps: all four at sigma 1.0, no STG at
    0.7 (three passes: uneven on two groups), CFG only at 0.4 (two passes: idle groups)."""
    negative_video, negative_audio = tiny_contexts(seed=11)

    def schedule(cfg: float, stg: float, modality_scale: float, rescale: float) -> dict:
        # Bins by sigma upper bound: (0.75, 1.0] all passes, (0.5, 0.75] no STG, below 0.5 CFG only.
        return {
            1.0: MultiModalGuiderParams(
                cfg_scale=cfg, stg_scale=stg, stg_blocks=[1], rescale_scale=rescale, modality_scale=modality_scale
            ),
            0.75: MultiModalGuiderParams(
                cfg_scale=cfg, stg_scale=0.0, stg_blocks=[1], rescale_scale=rescale, modality_scale=modality_scale
            ),
            0.5: MultiModalGuiderParams(cfg_scale=cfg, stg_scale=0.0, rescale_scale=0.0, modality_scale=1.0),
        }

    return (
        MultiModalGuiderFactory.from_dict(schedule(3.0, 1.0, 3.0, 0.7), negative_context=negative_video),
        MultiModalGuiderFactory.from_dict(schedule(7.0, 1.0, 3.0, 0.0), negative_context=negative_audio),
    )


def _step_passes(video, audio, video_guider, audio_guider) -> list[GuidancePass]:
    passes = [GuidancePass("conditional", video, audio, None)]
    if video_guider.do_unconditional_generation() or audio_guider.do_unconditional_generation():
        negative_video = replace(video, context=video_guider.negative_context)
        negative_audio = replace(audio, context=audio_guider.negative_context)
        passes.append(GuidancePass("unconditional", negative_video, negative_audio, None))
    if video_guider.do_perturbed_generation() or audio_guider.do_perturbed_generation():
        skipped = [Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, video_guider.params.stg_blocks)]
        skipped.append(Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, audio_guider.params.stg_blocks))
        passes.append(GuidancePass("perturbed", video, audio, BatchedPerturbationConfig([PerturbationConfig(skipped)])))
    if video_guider.do_isolated_modality_generation() or audio_guider.do_isolated_modality_generation():
        passes.append(GuidancePass("isolated", video, audio, BatchedPerturbationConfig([ISOLATED])))
    return passes


def _guided(guider, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return guider.calculate(
        outputs["conditional"],
        outputs.get("unconditional", 0.0),
        outputs.get("perturbed", 0.0),
        outputs.get("isolated", 0.0),
    )


def euler_stage1_loop(transformer, runner) -> dict:
    """Three Euler steps of image-conditioned AV denoising with full multi-modal guidance."""
    video_state, audio_state = tiny_latent_states(seed=5, frames=2, image_conditioning=True)
    video_context, audio_context = tiny_contexts(seed=6)
    video_factory, audio_factory = _guider_factories()
    stepper = EulerDiffusionStep()
    pass_names = []
    with torch.no_grad():
        for step in range(len(SIGMAS) - 1):
            sigma = float(SIGMAS[step])
            video_guider, audio_guider = video_factory.build_from_sigma(sigma), audio_factory.build_from_sigma(sigma)
            passes = _step_passes(
                modality(video_state, video_context, sigma),
                modality(audio_state, audio_context, sigma),
                video_guider,
                audio_guider,
            )
            pass_names.append([guidance_pass.name for guidance_pass in passes])
            outputs = runner.run(transformer, passes)
            denoised_video = _guided(video_guider, {p.name: out[0] for p, out in zip(passes, outputs)})
            denoised_audio = _guided(audio_guider, {p.name: out[1] for p, out in zip(passes, outputs)})
            # Clean conditioning tokens (denoise mask 0) keep their clean latent.
            mask = video_state.denoise_mask
            denoised_video = denoised_video * mask + video_state.clean_latent * (1 - mask)
            video_state = replace(video_state, latent=stepper.step(video_state.latent, denoised_video, SIGMAS, step))
            audio_state = replace(audio_state, latent=stepper.step(audio_state.latent, denoised_audio, SIGMAS, step))
    return {"video": video_state.latent, "audio": audio_state.latent, "passes": pass_names}


def stage1_loops_on_ranks(modes: list[str], variant: str = "19b") -> dict:
    torch.set_num_threads(1)
    world = Comm.world()
    results = {}
    for mode in modes:
        plan = plan_stage1(world.world_size, VIDEO_TOKENS, PASS_NAMES, mode, **TINY_HEADS)
        sp_comm, runner = build_stage1_groups(world, plan), apply_guidance_parallel(world, plan)
        transformer = apply_sequence_parallel(build_tiny_model(variant), sp_comm)
        results[mode] = {"layout": (plan.guidance_groups, plan.sp_degree), **euler_stage1_loop(transformer, runner)}
    return portable(results)


# --------------------------------------------------------------------------------------------------
# LTX-2 jobs on a fleet: prompts, sigmas, the sample job's arguments
# --------------------------------------------------------------------------------------------------

PROMPT = "a red fox runs through fresh snow at dawn"


NEGATIVE = "blurry, low quality"


SINGLE_GPU_SIGMAS = [0.909375, 0.725, 0.421875, 0.0]


def contexts_of(result, index):
    return result.tensors[f"video_context_{index}"], result.tensors[f"audio_context_{index}"]


def sample_args(spec, **overrides):
    args = {
        "spec": spec, "width": 96, "height": 64, "num_frames": 9, "frame_rate": 24.0, "seed": 7, "steps": 3,
        "video_guidance": {"cfg_scale": 3.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0, "stg_blocks": [1]},
        "audio_guidance": {"cfg_scale": 7.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0, "stg_blocks": [1]},
    }  # fmt: skip
    args.update(overrides)
    return args


def context_tensors(encoded):
    (pv, pa), (nv, na) = contexts_of(encoded, 0), contexts_of(encoded, 1)
    return {"positive_video_context": pv, "positive_audio_context": pa, "negative_video_context": nv, "negative_audio_context": na}


def run_generate(tmp_path, name, *extra, cpu_ranks=1):
    env = {**os.environ, "PYTHONPATH": str(REPO), "MGPU_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MGPU_SOCKET", None)
    socket_dir = tmp_path / f"sock-{name}"
    socket_dir.mkdir(mode=0o700)
    command = [
        sys.executable, "-m", "mgpu_backend", "generate", "--prompt", PROMPT, "--output", str(tmp_path / f"{name}.mp4"),
        "--cpu-ranks", str(cpu_ranks), "--socket", str(socket_dir / "fleet.sock"), "--debug-dump", str(tmp_path / f"{name}.safetensors"), *extra,
    ]  # fmt: skip
    completed = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed


# --------------------------------------------------------------------------------------------------
# The node pack loaded without ComfyUI, a fake ComfyUI and recorders of the api it calls
# --------------------------------------------------------------------------------------------------

PACK_DIR = Path(__file__).resolve().parent.parent


def load_pack():
    """The pack imported the way ComfyUI imports it (a package from its folder path)."""
    name = "comfyui_mgpu_pack"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PACK_DIR / "__init__.py", submodule_search_locations=[str(PACK_DIR)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


pack = load_pack()


layouts = sys.modules["comfyui_mgpu_pack.nodes.layouts"]


fleet_job = sys.modules["comfyui_mgpu_pack.nodes.fleet_job"]


NODES = pack.NODE_CLASS_MAPPINGS


def node(name):
    return NODES[name]()


class ApiRecorder:
    """Stands in for one mgpu_backend.ltx.api function: records its calls, returns a canned result, and
    shows the real function's signature (nodes look at it to see what the fleet api takes)."""

    def __init__(self, signature_of=None, result=None) -> None:
        self.calls, self.result = [], result
        if signature_of is not None:
            self.__signature__ = inspect.signature(signature_of)

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result(*args, **kwargs) if callable(self.result) else self.result


def contexts(seed: int, tokens: int = 5):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, 32, generator=generator), torch.randn(1, tokens, 16, generator=generator)


def mgpu_conditioning(seed: int, prompt: str = "a prompt"):
    return layouts.make_conditioning(api.PromptEncoding(*contexts(seed), digest=f"{seed:064x}"), prompt)


def tiny_handle(**overrides):
    spec = {"checkpoint_path": "/m/ckpt.safetensors", "gemma_root": "/m/gemma", "spatial_upsampler_path": "/m/up.safetensors", "distilled_lora": "/m/lora.safetensors", "distilled_lora_strength": 1.0, "loras": []}
    return layouts.make_model_handle({**spec, **overrides}, dtype="float32", gemma_mode="sharded", parallel="sp", gpus="all")


def av_latent(frames: int = 2, height: int = 2, width: int = 3, audio_frames: int = 9, frame_rate=24.0):
    generator = torch.Generator().manual_seed(frames * 100 + width)
    video = torch.randn(1, 128, frames, height, width, generator=generator)
    audio = torch.randn(1, 8, audio_frames, 16, generator=generator)
    return layouts.make_av_latent(video, audio, frame_rate), video, audio


SAMPLER_INPUTS = dict(
    width=96, height=64, length=9, frame_rate=25.0, seed=7, steps=3, video_cfg=3.5, audio_cfg=6.0,
    stg_scale=1.0, stg_blocks="1", rescale=0.5, modality_scale=2.0, parallel="(from loader)",
)  # fmt: skip


UPSCALE_INPUTS = dict(seed=11, sigmas="0.625, 0.4, 0.0", tiles="auto", overlap=2, frame_rate=0.0, force_from_noise=False)


class FakeComfy:
    """comfy.utils / comfy.model_management / server stand-ins with ComfyUI's interrupt semantics."""

    class InterruptProcessingException(Exception):
        pass

    def __init__(self, monkeypatch) -> None:
        self.interrupted = False
        self.bar_updates, self.texts, self.events = [], [], []
        fake = self

        class ProgressBar:
            def __init__(self, total, node_id=None):
                self.total, self.node_id = total, node_id

            def update_absolute(self, value, total=None, preview=None):
                fake.bar_updates.append((self.node_id, value, total))
                fake.throw_exception_if_processing_interrupted()  # as ComfyUI's progress hook does

        class PromptServer:
            instance = None

            def send_sync(self, event, data, sid=None):
                fake.events.append((event, data))

            def send_progress_text(self, text, node_id, sid=None):
                fake.texts.append((node_id, text))

        PromptServer.instance = PromptServer()
        management = types.ModuleType("comfy.model_management")
        management.InterruptProcessingException = self.InterruptProcessingException
        management.processing_interrupted = lambda: self.interrupted
        management.throw_exception_if_processing_interrupted = self.throw_exception_if_processing_interrupted
        utils = types.ModuleType("comfy.utils")
        utils.ProgressBar = ProgressBar
        server = types.ModuleType("server")
        server.PromptServer = PromptServer
        comfy = types.ModuleType("comfy")
        comfy.__path__ = []
        for name, module in (("comfy", comfy), ("comfy.model_management", management), ("comfy.utils", utils), ("server", server)):
            monkeypatch.setitem(sys.modules, name, module)

    def throw_exception_if_processing_interrupted(self):
        if self.interrupted:
            self.interrupted = False
            raise self.InterruptProcessingException()


# --------------------------------------------------------------------------------------------------
# Checkpoint sizes of the full-size models
# --------------------------------------------------------------------------------------------------

def full_size_sizes(transformer_config: str):
    transformer = json.loads((REPO / "configs" / transformer_config).read_text())["transformer"]
    config = full_size.full_size_config(transformer, gemma_layers=full_size.GEMMA_FULL_LAYERS)
    headers = {name: {key: ("BF16", shape) for key, shape in shapes.items()} for name, shapes in full_size.planned_shapes(config).items()}
    gemma = next(tensors for name, tensors in headers.items() if name.startswith(full_size.GEMMA_DIR_NAME))
    return sizes_from_headers(headers[full_size.CHECKPOINT_NAME], headers[full_size.SPATIAL_UPSAMPLER_NAME], gemma)


# --------------------------------------------------------------------------------------------------
# A tiny random LTX-2 transformer, its inputs, and the forward cases the parallel tests compare
# --------------------------------------------------------------------------------------------------

VIDEO_CHANNELS = 16


AUDIO_CHANNELS, AUDIO_MEL_BINS = 2, 8  # 16 features per audio token


VIDEO_CONTEXT_DIM, AUDIO_CONTEXT_DIM = 64, 32  # = video / audio inner dims (no caption projection)


TEXT_TOKENS = 7


AUDIO_TOKENS = 9


def tiny_transformer_config(variant: str = "19b") -> dict:
    """An LTX-2 AV transformer config with tiny dimensions: 2 layers, 8 video heads of 8, 8 audio
    heads of 4, interleaved RoPE like the 19B model. ``variant="22b"`` switches on the newer options
    (split RoPE, gated attention, cross-attention AdaLN) so SP is checked against them too."""
    transformer = {
        **LTX2_TRANSFORMER_ARCHITECTURE,
        "num_layers": 2,
        "num_attention_heads": 8,
        "attention_head_dim": 8,
        "audio_num_attention_heads": 8,
        "audio_attention_head_dim": 4,
        "in_channels": VIDEO_CHANNELS,
        "out_channels": VIDEO_CHANNELS,
        "audio_in_channels": AUDIO_CHANNELS * AUDIO_MEL_BINS,
        "audio_out_channels": AUDIO_CHANNELS * AUDIO_MEL_BINS,
        "cross_attention_dim": VIDEO_CONTEXT_DIM,
        "audio_cross_attention_dim": AUDIO_CONTEXT_DIM,
        "caption_proj_before_connector": True,  # text arrives already projected: no caption projection
        "rope_type": "interleaved",
        "attention_type": "pytorch",
    }
    if variant == "22b":
        transformer.update(rope_type="split", apply_gated_attention=True, cross_attention_adaln=True)
    return {"transformer": transformer}


def build_tiny_model(variant: str = "19b", seed: int = 0) -> X0Model:
    """A tiny random LTX-2 AV transformer in ltx-core's X0 wrapper, identical for the same seed."""
    model = LTXModelConfigurator.from_config(tiny_transformer_config(variant))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.15)
    return X0Model(model).eval()


def _video_tools(frames: int, height: int = 3, width: int = 5) -> VideoLatentTools:
    return VideoLatentTools(VideoLatentPatchifier(1), VideoLatentShape(1, VIDEO_CHANNELS, frames, height, width), 25.0)


def _audio_tools() -> AudioLatentTools:
    shape = AudioLatentShape(1, AUDIO_CHANNELS, AUDIO_TOKENS, AUDIO_MEL_BINS)
    return AudioLatentTools(AudioPatchifier(AUDIO_MEL_BINS), shape)


def tiny_latent_states(
    seed: int, frames: int = 3, image_conditioning: bool = False
) -> tuple[LatentState, LatentState]:
    """Noisy video (``frames`` x 3 x 5 latent = 15 tokens per frame) and audio (9 tokens) states.

    With ``image_conditioning``, the first latent frame is replaced by a clean image latent (its
    denoise mask, hence its timesteps, become zero) and one keyframe latent frame is appended as
    extra tokens with an attention-strength mask, the way ltx-core's conditioning items do it.
    """
    generator = torch.Generator().manual_seed(seed)
    video_tools, audio_tools = _video_tools(frames), _audio_tools()
    video_shape = video_tools.target_shape.to_torch_shape()
    video = video_tools.create_initial_state("cpu", torch.float32, torch.randn(video_shape, generator=generator))
    audio_shape = audio_tools.target_shape.to_torch_shape()
    audio = audio_tools.create_initial_state("cpu", torch.float32, torch.randn(audio_shape, generator=generator))
    if image_conditioning:
        image = torch.randn(1, VIDEO_CHANNELS, 1, 3, 5, generator=generator)
        keyframe = torch.randn(1, VIDEO_CHANNELS, 1, 3, 5, generator=generator)
        video = VideoConditionByLatentIndex(latent=image, strength=1.0, latent_idx=0).apply_to(video, video_tools)
        keyframe_item = VideoConditionByKeyframeIndex(keyframes=keyframe, frame_idx=8, strength=0.9)
        video = ConditioningItemAttentionStrengthWrapper(keyframe_item, attention_mask=0.5).apply_to(
            video, video_tools
        )
    return video, audio


def tiny_contexts(seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    video_context = torch.randn(batch, TEXT_TOKENS, VIDEO_CONTEXT_DIM, generator=generator)
    audio_context = torch.randn(batch, TEXT_TOKENS, AUDIO_CONTEXT_DIM, generator=generator)
    return video_context, audio_context


def modality(state: LatentState, context: torch.Tensor, sigma: float, enabled: bool = True, **extra) -> Modality:
    sigma_tensor = torch.full((state.latent.shape[0],), sigma)
    return Modality(
        latent=state.latent,
        sigma=sigma_tensor,
        timesteps=state.denoise_mask * sigma,
        positions=state.positions,
        context=context,
        enabled=enabled,
        attention_mask=state.attention_mask,
        **extra,
    )


def _batched(config: PerturbationConfig, batch: int = 1) -> BatchedPerturbationConfig:
    return BatchedPerturbationConfig([config] * batch)


STG = PerturbationConfig(
    [
        Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [1]),
        Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, [1]),
    ]
)


ISOLATED = PerturbationConfig(
    [Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, None), Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, None)]
)


def sp_forward_cases() -> dict[str, tuple[str, Modality, Modality, BatchedPerturbationConfig | None]]:
    """name -> (model variant, video, audio, perturbations). 45 video tokens in every case."""
    video, audio = tiny_latent_states(seed=1)
    video_context, audio_context = tiny_contexts(seed=2)
    plain = (modality(video, video_context, 0.8), modality(audio, audio_context, 0.8))

    conditioned_video, conditioned_audio = tiny_latent_states(seed=3, frames=2, image_conditioning=True)
    text_mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    text_mask[:, -2:] = 0  # padded prompt tokens
    conditioned = (
        modality(conditioned_video, video_context, 0.6, context_mask=text_mask),
        modality(conditioned_audio, audio_context, 0.6, context_mask=text_mask),
    )

    # A batch of two whose samples are perturbed differently: the per-sample mask paths.
    video_pair, audio_pair = (
        Modality(
            latent=torch.cat([m.latent, m.latent.flip(1)]),
            sigma=torch.tensor([0.8, 0.5]),
            timesteps=torch.cat([m.timesteps, m.timesteps * 0.625]),
            positions=torch.cat([m.positions, m.positions]),
            context=torch.cat([m.context, -m.context]),
        )
        for m in plain
    )
    stg_and_isolation_in_block_0 = PerturbationConfig(
        [
            Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [0]),
            Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, [0]),
            Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, [0]),
            Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, [0]),
        ]
    )
    mixed = BatchedPerturbationConfig([stg_and_isolation_in_block_0, PerturbationConfig.empty()])

    return {
        "unperturbed": ("19b", *plain, None),
        "stg_perturbed": ("19b", *plain, _batched(STG)),
        "modality_isolated": ("19b", *plain, _batched(ISOLATED)),
        "mixed_batch_perturbations": ("19b", video_pair, audio_pair, mixed),
        "image_conditioned": ("19b", *conditioned, None),
        "22b_options_stg_perturbed": ("22b", *plain, _batched(STG)),
    }


def run_sp_forward_cases(models: dict[str, X0Model]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    outputs = {}
    with torch.no_grad():
        for name, (variant, video, audio, perturbations) in sp_forward_cases().items():
            outputs[name] = models[variant](video=video, audio=audio, perturbations=perturbations)
    return outputs


def portable(value) -> bytes:
    """``value`` (tensors inside) serialised for the harness's result queue; ``from_portable`` undoes it.

    Tensors put on that queue travel as shared-memory file descriptors that the rank process may
    close by exiting before the test process has read them (ConnectionResetError); bytes do not.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_portable(per_rank: list[bytes]) -> list:
    return [torch.load(io.BytesIO(blob), weights_only=False) for blob in per_rank]


def single_threaded(fn, *args):
    """``fn(*args)`` with one intra-op thread, like the rank processes: CPU kernels split their
    reductions by thread count, and that alone moves fp32 results by ~1e-6."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


class CommOfSize:
    """Stands in for a group of ``world_size`` ranks; validation must refuse before any collective."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.rank, self.global_ranks = world_size, 0, list(range(world_size))


# --------------------------------------------------------------------------------------------------
# The shipped example workflows' builder
# --------------------------------------------------------------------------------------------------



WORKFLOWS = PACK_DIR / "workflows"


def load_builder():
    name = "comfyui_mgpu_make_workflows"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, WORKFLOWS / "make_workflows.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


builder = load_builder()


# --------------------------------------------------------------------------------------------------
# Compositions of public entry points that only the tests need
# --------------------------------------------------------------------------------------------------

def decoder_generator(params, device: torch.device, dtype: torch.dtype) -> torch.Generator:
    """The generator the official pipeline hands its video decoder: past every stage's noise."""
    stages = (params.stage1, params.stage2) if params.two_stage else (params.stage1,)
    return job_generator(params.seed, device, dtype, stages_before=stages)


class PromptEncoder(torch.nn.Module):
    """Gemma plus the LTX-2 embeddings processor: prompts -> video and audio text contexts.

    ``encode`` does what ltx-pipelines' ``encode_prompts`` does (without prompt enhancement).
    """

    def __init__(self, gemma, embeddings_processor):
        super().__init__()
        self.gemma = gemma
        self.embeddings_processor = embeddings_processor

    def encode(self, prompts: list[str]) -> list:
        """One ``EmbeddingsProcessorOutput`` (video_encoding, audio_encoding, attention_mask) per prompt."""
        outputs = []
        for prompt in prompts:
            hidden_states, attention_mask = self.gemma.encode(prompt)
            outputs.append(self.embeddings_processor.process_hidden_states(hidden_states, attention_mask))
        return outputs


@contextlib.contextmanager
def compiled_blocks(model, enabled: bool, backend: str = "inductor") -> Iterator[None]:
    """The blocks compiled for the duration when ``enabled`` (eager otherwise), eager afterwards.

    Dynamo keeps compiled graphs with the block code, not with the wrapper, so compiling again in a
    later job costs nothing for shapes seen before; other jobs (stage 2's tiles, a job that asks for
    eager) never meet the compiled blocks or pay their compile time."""
    started_here = enabled and apply_compiled_blocks(model, backend)
    try:
        yield
    finally:
        if started_here:
            remove_compiled_blocks(model)


def convert_checkpoint_to_fp8(source: str | Path, destination: str | Path, scaled: bool = True) -> Path:
    """Write an fp8 copy of an LTX-2 checkpoint in the layout of Lightricks' fp8 files: the layers
    fp8-cast quantizes stored as float8_e4m3fn (biases left as they are), each, when ``scaled``,
    with a float32 per-tensor ``weight_scale`` (absmax / 448) and an ``input_scale``, plus ComfyUI's
    ``_quantization_metadata`` header entry. Everything else, and the metadata, is copied.
    It reads the whole checkpoint into memory: for the tiny bundle's files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mgpu_backend.ltx import fp8

    prefix = "model.diffusion_model."
    tensors, layers = {}, {}
    with safe_open(str(source), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        for name in f.keys():
            value = f.get_tensor(name)
            model_key = name[len(prefix) :] if name.startswith(prefix) else None
            if model_key is None or not model_key.endswith(".weight") or not fp8.downcast_by_policy(model_key, "fp8-cast"):
                tensors[name] = value
                continue
            layer = name[: -len(".weight")]
            if scaled:
                scale = (value.float().abs().max() / torch.finfo(fp8.FP8_DTYPE).max).clamp(min=torch.finfo(torch.float32).tiny)
                tensors[name] = fp8.quantize_with_scale(value, scale)
                tensors[layer + fp8.WEIGHT_SCALE_SUFFIX] = scale.reshape(())
                tensors[layer + fp8.INPUT_SCALE_SUFFIX] = torch.ones((), dtype=torch.float32)
            else:
                tensors[name] = value.to(fp8.FP8_DTYPE)
            layers[layer] = {"format": "float8_e4m3fn"}
    metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    save_file(tensors, str(destination), metadata=metadata)
    return Path(destination)


def write_diffusion_checkpoint(path: str | os.PathLike, transformer: dict, device: torch.device | str, seed: int = 0) -> str:
    """A random checkpoint at ``transformer``'s layout holding only what a diffusion model loads: the
    transformer and the text embeddings processor of a full-size bundle's checkpoint (``full_size``'s
    file layout and metadata, weights drawn on ``device``), without the VAEs and vocoder. With the
    block count and connector depth cut, a full-size layout's file is a few GB, so a test can write it."""
    from mgpu_backend.bundles import layout

    parts, metadata = layout.weight_files(full_size.full_size_config(transformer), full_size._STYLE)[full_size.CHECKPOINT_NAME]
    kept = [part for part in parts if part.name in ("transformer", "embeddings_processor")]
    layout.write_weight_file(Path(path), kept, metadata, layout.DeviceSeeded(torch.device(device), seed))
    return str(path)


def bench_module(name: str):
    """``bench/<name>.py`` imported as the benches import each other: ``bench/`` first on sys.path while it loads."""
    import importlib

    sys.path.insert(0, str(PACK_DIR / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(PACK_DIR / "bench"))
