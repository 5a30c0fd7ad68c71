"""Live previews and progress that moves with the work.

The latent-to-RGB fit against a decoder whose answer is known; previews from a real two-rank CPU
fleet on the tiny bundle (shape, dtype, rate, the last one equal to the projection of the result,
and latents bitwise equal to previews off); the preview event's validation; decode progress counted
per tile over the ranks and never going back (also as a collective inside the decode loop); the
node's side: ComfyUI's preview setting, the preview image handed to the ProgressBar, the text sent
to the prompt's own client only, and a fleet that goes away mid-job ending the node with a message.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

import pytest
import torch
from ltx_core.model.video_vae import SpatialTilingConfig, TemporalTilingConfig, TilingConfig

from mgpu_backend.fleet import protocol
from mgpu_backend.fleet.client import FleetClient, FleetUnavailable
from mgpu_backend.fleet.protocol import Message
from mgpu_backend.ltx import api
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.ltx.previews import LatentRGB, fit_latent_rgb, preview_due, side_by_side
from mgpu_backend.parallel.comm import Comm
from tests.dist_harness import run_ranks
from .helpers import SCENARIOS, FakeComfy, build_tiny_decoder, distributed_decode_video, fleet_job, noise_seed, scenario_latent, single_gpu_decode_video

from .fleet_harness import REPO, start_server, stop_server

PROMPT = "a red fox runs through fresh snow at dawn"
NEGATIVE = "blurry, low quality"
STAGE2_SIGMAS = [0.909375, 0.725, 0.421875, 0.0]


# --- the projection ------------------------------------------------------------------------------


class LinearDecoder(torch.nn.Module):
    """A 'decoder' that is exactly linear per latent cell: RGB = latent @ weight + bias, spread over
    the 32x32 pixels and 8 frames (1 for the first latent frame) a cell decodes to."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, latent, timestep=None, generator=None):
        rgb = torch.einsum("bcfhw,cr->brfhw", latent.float(), self.weight) + self.bias.view(1, 3, 1, 1, 1)
        rgb = rgb.repeat_interleave(32, dim=3).repeat_interleave(32, dim=4)
        return torch.cat([rgb[:, :, :1], rgb[:, :, 1:].repeat_interleave(8, dim=2)], dim=2)


def test_fit_recovers_the_projection_of_a_linear_decoder():
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(128, 3, generator=generator) * 0.05, torch.tensor([0.1, -0.2, 0.3])
    fitted = fit_latent_rgb(LinearDecoder(weight, bias), torch.device("cpu"), torch.float32)
    # Only the small ridge term stands between the fit and the truth.
    assert torch.allclose(fitted.weight, weight, atol=2e-3), (fitted.weight - weight).abs().max()
    assert torch.allclose(fitted.bias, bias, atol=2e-3), fitted.bias


def test_preview_is_the_projection_of_first_middle_and_last_frames_upsampled_in_uint8():
    weight = torch.zeros(128, 3)
    weight[0], weight[1, 1], weight[2, 2] = torch.tensor([1.0, 0.0, 0.0]), 1.0, 1.0
    factors = LatentRGB(weight=weight, bias=torch.zeros(3))
    x0 = torch.zeros(1, 128, 7, 2, 3)
    for frame in range(7):
        x0[0, 0, frame] = -1.0 + frame / 3  # red runs from -1 (0) to 1 (255) over the frames
    x0[0, 1] = 1.0  # green always full
    frames = factors.preview(x0)
    assert frames.dtype == torch.uint8 and frames.shape == (4, 4, 6, 3)  # 4 of 7 frames, 2x
    assert frames[..., 0].flatten(1).float().mean(1).tolist() == [0.0, 85.0, 170.0, 255.0]  # frames 0, 2, 4, 6
    assert frames[..., 1].unique().tolist() == [255] and frames[..., 2].unique().tolist() == [128]
    assert side_by_side(frames).shape == (4, 24, 3) and torch.equal(side_by_side(frames)[:, 6:12], frames[1])


def test_previews_are_due_every_n_steps_and_at_the_last_one():
    assert [step for step in range(1, 8) if preview_due(step, 7, 3)] == [3, 6, 7]
    assert [step for step in range(1, 8) if preview_due(step, 7, 0)] == []


def test_preview_events_are_validated():
    good = torch.zeros(2, 4, 6, 3, dtype=torch.uint8)
    fields = {"stage": "stage1", "step": 1, "total": 3}
    assert protocol.preview_frames(protocol.decode(b"".join(bytes(b) for b in protocol.encode(Message("preview", fields, {"frames": good}))))).shape == (2, 4, 6, 3)
    bad = [
        (fields, {"frames": good.float()}, "uint8"),
        (fields, {"frames": good[0]}, "uint8"),
        (fields, {"frames": good, "other": good}, "exactly one"),
        ({"stage": "stage1", "step": "1", "total": 3}, {"frames": good}, "integer"),
        (fields, {"frames": torch.zeros(1, 4096, 4096, 3, dtype=torch.uint8)}, "exceeds"),
    ]
    for bad_fields, tensors, message in bad:
        with pytest.raises(protocol.ProtocolError, match=message):
            protocol.preview_frames(Message("preview", bad_fields, tensors))


# --- decode progress inside the decode loop ----------------------------------------------------------


def decode_with_progress(scenario: str) -> dict:
    """Runs on every rank: the distributed decode, its progress calls made collective on purpose."""
    torch.set_num_threads(1)
    comm = Comm.world()
    calls = []

    def on_tiles(done: int, total: int) -> None:
        # The fleet's step report is a collective: if ranks called this at different points of the
        # decode's own all-reduces, this would hang or mix up the sums.
        agreed = comm.all_reduce_max(torch.tensor([done], dtype=torch.int64)).item()
        calls.append((done, total, agreed))

    _, tiling, _, _ = SCENARIOS[scenario]
    generator = torch.Generator().manual_seed(noise_seed(scenario))
    video = distributed_decode_video(build_tiny_decoder(), scenario_latent(scenario), tiling, comm, generator, on_tiles=on_tiles)
    return {"calls": calls, "video": video}


@pytest.mark.parametrize(("scenario", "ranks", "expected"), [
    ("spatial_and_temporal", 4, [4, 8, 12, 16, 18]),
    ("three_way_temporal_overlap", 3, [3, 6, 9, 10]),
])  # fmt: skip
def test_decode_reports_every_tile_across_ranks_in_step_on_every_rank(scenario, ranks, expected):
    results = run_ranks(ranks, decode_with_progress, scenario)
    tiles = SCENARIOS[scenario][3]
    for rank, result in enumerate(results):
        assert [(done, total) for done, total, _ in result["calls"]] == [(done, tiles) for done in expected], f"rank {rank}"
        assert all(done == agreed for done, _, agreed in result["calls"]), f"rank {rank} reported out of step"
    generator = torch.Generator().manual_seed(noise_seed(scenario))
    reference = single_gpu_decode_video(build_tiny_decoder(), scenario_latent(scenario), SCENARIOS[scenario][2], generator)
    assert (results[0]["video"] - reference).abs().max().item() <= 1e-5


# --- a real fleet ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(fleet_of):
    socket_path = fleet_of(2)
    api.configure(address=str(socket_path))
    yield socket_path
    api.configure()


@pytest.fixture(scope="module")
def prompts(fleet, spec):
    return api.encode(spec, [PROMPT, NEGATIVE])


@pytest.fixture(scope="module")
def factors(spec) -> LatentRGB:
    """The projection fitted in this process to the tiny bundle's decoder, as rank 0 fits it."""
    loader = ModelLoader(ModelSpec.from_wire(spec), "cpu", torch.bfloat16)
    return fit_latent_rgb(loader.video_decoder(), torch.device("cpu"), torch.bfloat16)


SAMPLE = dict(width=96, height=64, num_frames=17, frame_rate=24.0, seed=7, steps=5, parallel="sp")


def collect():
    previews = []
    return previews, lambda fields, frames: previews.append((dict(fields), frames))


def test_sample_sends_previews_every_n_steps_and_the_latents_equal_previews_off(fleet, spec, prompts, factors):
    positive, negative = prompts
    previews, keep = collect()
    video, audio = api.sample(spec, positive, negative, **SAMPLE, preview=keep, preview_every=2)
    assert [(fields["stage"], fields["step"], fields["total"]) for fields, _ in previews] == [("stage1", 2, 5), ("stage1", 4, 5), ("stage1", 5, 5)]
    assert all(frames.dtype == torch.uint8 and frames.shape == (3, 4, 6, 3) for _, frames in previews)  # 3 latent frames, 2x of 2x3
    assert not torch.equal(previews[0][1], previews[-1][1]), "the preview should follow the denoising"
    # The last step's x0 is the result: its preview is the projection of the returned latent.
    difference = (previews[-1][1].int() - factors.preview(video).int()).abs().max().item()
    assert difference <= 1, difference

    silent, keep_silent = collect()
    video_off, audio_off = api.sample(spec, positive, negative, **SAMPLE, preview=keep_silent, preview_every=0)
    assert silent == []
    assert torch.equal(video, video_off) and torch.equal(audio, audio_off), "previews must not change the result"


def test_upscale_sends_stage2_previews_and_the_latents_equal_previews_off(fleet, spec, prompts):
    positive, negative = prompts
    video, audio = api.sample(spec, positive, negative, **{**SAMPLE, "steps": 2})
    previews, keep = collect()
    refined, _ = api.upscale(spec, video, audio, positive, seed=7, sigmas=STAGE2_SIGMAS, tiles=(1, 2), overlap=1, preview=keep)
    assert [fields["step"] for fields, _ in previews] == [1, 2, 3] and {fields["stage"] for fields, _ in previews} == {"stage2"}
    assert all(frames.shape == (3, 8, 12, 3) and frames.dtype == torch.uint8 for _, frames in previews)
    refined_off, _ = api.upscale(spec, video, audio, positive, seed=7, sigmas=STAGE2_SIGMAS, tiles=(1, 2), overlap=1)
    assert torch.equal(refined, refined_off)


def test_decode_progress_counts_every_tile_and_never_goes_back(fleet, spec, prompts):
    positive, negative = prompts
    video, audio = api.sample(spec, positive, negative, **{**SAMPLE, "width": 192, "height": 128, "steps": 1})
    events = []
    # 64-pixel tiles without overlap of a 192x128 video: 2 x 3 tiles, 3 rounds on 2 ranks.
    frames, _, _ = api.decode(spec, video, audio, after_stages=1, spatial_tile_pixels=64, progress=events.append)
    decode = [(event["step"], event["total"]) for event in events if event["stage"] == "decode"]
    decoder = ModelLoader(ModelSpec.from_wire(spec), "cpu", torch.bfloat16).video_decoder()
    tiling = TilingConfig(SpatialTilingConfig(64, 0), TemporalTilingConfig(64, 24))  # what the decode job builds
    tiles = len(decoder._prepare_tiles(video.to(torch.bfloat16), tiling))
    assert tiles == 6 and decode[-1] == (tiles, tiles) and {total for _, total in decode} == {tiles}
    steps = [step for step, _ in decode]
    assert steps == sorted(steps) and steps == [min(2 * round_, tiles) for round_ in range(1, len(steps) + 1)]
    assert [event["stage"] for event in events][-1] == "audio decode" and frames.shape == (17, 128, 192, 3)


# --- the node's side ---------------------------------------------------------------------------------


class ComfyWithPreviews(FakeComfy):
    """FakeComfy plus ComfyUI's preview setting, the prompt's client id and the previews the bar gets."""

    def __init__(self, monkeypatch, preview_method: str) -> None:
        super().__init__(monkeypatch)
        self.previews, self.sids = [], []
        fake = self
        utils, server = sys.modules["comfy.utils"], sys.modules["server"]
        base_bar, base_server = utils.ProgressBar, server.PromptServer

        class ProgressBar(base_bar):
            def update_absolute(self, value, total=None, preview=None):
                if preview is not None:
                    fake.previews.append((value, total, preview))
                super().update_absolute(value, total, preview)

        class PromptServer(base_server):
            client_id = "browser-that-queued"

            def send_sync(self, event, data, sid=None):
                fake.sids.append(sid)
                super().send_sync(event, data, sid)

            def send_progress_text(self, text, node_id, sid=None):
                fake.sids.append(sid)
                super().send_progress_text(text, node_id, sid)

        PromptServer.instance = PromptServer()
        utils.ProgressBar, server.PromptServer = ProgressBar, PromptServer
        cli_args = types.ModuleType("comfy.cli_args")
        cli_args.args = types.SimpleNamespace(preview_method=types.SimpleNamespace(value=preview_method), preview_size=256)
        monkeypatch.setitem(sys.modules, "comfy.cli_args", cli_args)


def test_node_shows_fleet_previews_through_comfys_progress_bar_for_its_own_client(fleet, spec, prompts, monkeypatch):
    comfy = ComfyWithPreviews(monkeypatch, "latent2rgb")
    positive, negative = prompts
    monkeypatch.setenv("MGPU_PREVIEW_EVERY", "2")
    fleet_job.FleetJob("9", "SP Sampler").call(api.sample, spec, positive, negative, **SAMPLE)
    assert [(value, total) for value, total, _ in comfy.previews] == [(2, 5), (4, 5), (5, 5)]
    for _, _, (kind, image, size) in comfy.previews:
        assert (kind, size, image.mode, image.size) == ("JPEG", 256, "RGB", (3 * 6, 4))  # 3 frames of 6x4 side by side
    assert comfy.sids and set(comfy.sids) == {"browser-that-queued"}, "node text must go to the prompt's client only"
    bar = [value for node, value, total in comfy.bar_updates if total == 5]
    assert bar == sorted(bar) and bar[-1] == 5


def test_preview_method_none_asks_the_fleet_for_no_previews(fleet, spec, prompts, monkeypatch):
    comfy = ComfyWithPreviews(monkeypatch, "none")
    positive, negative = prompts
    sent = []
    real_run = api.run
    monkeypatch.setattr(api, "run", lambda op, args, tensors=None, **kw: sent.append(args.get("preview_every")) or real_run(op, args, tensors, **kw))
    fleet_job.FleetJob("9", "SP Sampler").call(api.sample, spec, positive, negative, **{**SAMPLE, "steps": 2})
    assert sent == [0] and comfy.previews == []
    assert [value for _, value, total in comfy.bar_updates if total == 2] == [1, 2]


def test_a_stage_run_again_never_moves_the_bar_back(monkeypatch):
    comfy = FakeComfy(monkeypatch)
    job = fleet_job.FleetJob("4", "TDP Upscale")
    for step in (1, 2, 1, 3):
        job.progress({"stage": "stage2", "step": step, "total": 3})
    assert [value for _, value, _ in comfy.bar_updates] == [1, 2, 2, 3]


def test_a_fleet_that_goes_away_mid_job_ends_the_node_with_a_message(spec, tmp_path, monkeypatch):
    FakeComfy(monkeypatch)
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "0")
    try:
        api.configure(address=str(socket_path))
        positive, negative = api.encode(spec, [PROMPT, NEGATIVE])
        started = threading.Event()

        def stop_when_sampling(event):
            if event.get("stage") == "stage1" and not started.is_set():
                started.set()
                process.terminate()  # the server (and with it its ranks) goes away mid-job

        job = fleet_job.FleetJob("3", "SP Sampler")
        real_progress = job.progress
        job.progress = lambda event: (stop_when_sampling(event), real_progress(event))
        with pytest.raises(RuntimeError) as raised:
            job.call(api.sample, spec, positive, negative, **{**SAMPLE, "steps": 200})
        assert started.is_set()
        message = str(raised.value)
        # The client's own words for a server that went away, whole, and no chained traceback.
        assert message.startswith(f"SP Sampler: the fleet server at {socket_path} is shutting down (") and ". Run again: " in message
        assert raised.value.__cause__ is None and raised.value.__suppress_context__
    finally:
        api.configure()
        stop_server(process)
    with pytest.raises(FleetUnavailable):
        FleetClient.connect(str(socket_path), autostart=False)


# --- generate --preview-dir ----------------------------------------------------------------------------


@pytest.mark.slow
def test_generate_writes_the_previews_of_both_stages_as_pngs(tmp_path):
    from PIL import Image

    env = {**os.environ, "PYTHONPATH": str(REPO), "MGPU_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MGPU_SOCKET", None)
    socket_dir = tmp_path / "sock"
    socket_dir.mkdir(mode=0o700)
    command = [
        sys.executable, "-m", "mgpu_backend", "generate", "--prompt", PROMPT, "--output", str(tmp_path / "out.mp4"),
        "--cpu-ranks", "1", "--socket", str(socket_dir / "fleet.sock"), "--preview-dir", str(tmp_path / "previews"), "--preview-every", "2",
    ]  # fmt: skip
    completed = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    names = sorted(path.name for path in (tmp_path / "previews").iterdir())
    # The tiny bundle's 4 stage-1 steps and TDP Upscale's 2 stage-2 steps, a preview every 2nd.
    assert names == ["stage1_step002.png", "stage1_step004.png", "stage2_step002.png"]
    assert "3 live previews in" in completed.stdout
    for name, size in (("stage1_step004.png", (2 * 6, 4)), ("stage2_step002.png", (2 * 12, 8))):  # 2 latent frames, 2x
        with Image.open(tmp_path / "previews" / name) as image:
            assert image.mode == "RGB" and image.size == size, name
