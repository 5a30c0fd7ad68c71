"""The pack inside a real ComfyUI: load it, queue the tiny API workflow headless, get an mp4 with video
and audio, interrupt a long run with POST /interrupt, and see the same fleet serve the next run; then
the same graph on model FILES placed as a user places them (the tiny checkpoint, upsampler and
distilled LoRA in models/checkpoints, latent_upscale_models and loras, the tiny Gemma converted to
ComfyUI's single-file layout in models/text_encoders), picked from Load Checkpoint MGPU's lists.

Runs only with COMFYUI_DIR pointing at a ComfyUI checkout (its Python: COMFYUI_PYTHON, default this
interpreter; it needs ComfyUI's requirements). ComfyUI starts with --cpu on a free port and a
temporary --base-directory whose custom_nodes/ holds a symlink to this pack; its fleet runs
MGPU_CPU_RANKS CPU ranks (default 2) behind a private socket of its own (XDG_RUNTIME_DIR). Its
models/ folder is in the temporary base directory too: it never touches the checkout's own folders.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
import uuid
from pathlib import Path

import pytest

from mgpu_backend.tools import comfy_queue
from mgpu_backend.tools.processes import process_alive

from .comfyui_harness import COMFYUI_DIR, GEMMA_FILE, PACK_DIR, START_TIMEOUT_SECONDS, TINY_WORKFLOW, ComfyUI, get_json, post_json, queue, saved_video


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "main.py").is_file(), reason="set COMFYUI_DIR to a ComfyUI checkout"),
]


@pytest.fixture(scope="module")
def comfyui(tmp_path_factory):
    instance = ComfyUI(tmp_path_factory.mktemp("comfyui-base"))
    try:
        seconds = instance.wait_ready("/object_info/MGPUSPSampler", timeout=START_TIMEOUT_SECONDS)
        print(f"\nComfyUI with the pack up in {seconds:.1f} s at {instance.url}")
        yield instance
    finally:
        instance.stop()
        run_log = instance.log_text().partition("Starting server")[2]
        print(f"--- ComfyUI log after start-up ---{run_log}")


def test_comfyui_knows_the_nodes_the_workflows_use_as_the_tables_say(comfyui):
    from ..test_workflows import SCHEMAS, builder

    info = get_json(f"{comfyui.url}/object_info")
    problems = []
    for node_type, schema in SCHEMAS.items():
        if node_type not in info:
            problems.append(f"ComfyUI has no node {node_type}")
            continue
        declared = info[node_type]
        inputs = {**declared["input"].get("required", {}), **declared["input"].get("optional", {})}
        order = declared.get("input_order", {})
        names = order.get("required", []) + order.get("optional", [])
        widgets, sockets = [], []
        for name in names:
            kind, options = inputs[name][0], inputs[name][1] if len(inputs[name]) > 1 else {}
            kind = "COMBO" if isinstance(kind, list) else kind
            if kind in builder.WIDGET_TYPES:
                widgets.append(name)
                if options.get("image_upload"):
                    widgets.append("upload")
            else:
                sockets.append((name, kind, name in order.get("optional", [])))
        expected_widgets = [name for name, kind, _ in schema["widgets"] if kind != "CONTROL"]
        if widgets != expected_widgets:
            problems.append(f"{node_type}: widgets {widgets} != table {expected_widgets}")
        for name, kind, allowed in schema["widgets"]:
            if kind == "COMBO" and isinstance(allowed, list) and node_type in builder.NATIVE_NODES:
                served = inputs[name][1].get("options", inputs[name][0])
                if served != allowed:
                    problems.append(f"{node_type}.{name}: options {served} != table {allowed}")
        if sockets != [tuple(entry) for entry in schema["sockets"]]:
            problems.append(f"{node_type}: sockets {sockets} != table {schema['sockets']}")
        if declared["output"] != [kind for _, kind in schema["outputs"]]:
            problems.append(f"{node_type}: outputs {declared['output']} != table {schema['outputs']}")
    assert problems == [], "\n".join(problems)
    templates = get_json(f"{comfyui.url}/workflow_templates")
    assert sorted(templates.get("comfyui-mgpu", [])) == sorted(builder.ui_path(name).stem for name in builder.WORKFLOWS), templates
    assert "/extensions/comfyui-mgpu/mgpu_panel.js" in get_json(f"{comfyui.url}/extensions")


def test_tiny_workflow_writes_an_mp4_with_a_video_and_an_audio_stream(comfyui):
    import av

    outcome = queue(comfyui)
    print(f"\ntiny two-stage workflow (fleet start, load, encode, sample, upscale, decode, mux): {outcome.seconds:.1f} s")
    path = saved_video(comfyui, outcome)
    with av.open(str(path)) as container:
        video, audio = container.streams.video, container.streams.audio
        assert len(video) == 1 and len(audio) == 1, f"{path}: {len(video)} video / {len(audio)} audio streams"
        assert (video[0].codec_context.width, video[0].codec_context.height) == (192, 128)
        frames = sum(1 for _ in container.decode(video=0))
    assert frames == 9, f"{path}: {frames} frames, expected the 9 the workflow asks for"
    status = get_json(f"{comfyui.url}/mgpu/status")
    assert status["running"] and status["world_size"] == int(os.environ.get("MGPU_CPU_RANKS", "2")), status


def test_the_hq_workflow_on_the_embedded_ltx_2_3_bundle_writes_an_mp4_with_audio(comfyui):
    """The shipped LTX-2.3 HQ graph with its files swapped for the embedded tiny 2.3 bundle at a tiny size:
    the loader's per-stage strengths, SP Sampler's own audio rescale and TDP Upscale under the recipe's stage-2 policy run."""
    import av

    embedded = "(embedded tiny LTX-2.3, random weights)"
    files = [f"1.{name}={embedded}" for name in ("ckpt_name", "distilled_lora", "spatial_upsampler", "gemma")]
    sizes = ["4.width=96", "4.height=64", "4.length=9", "4.steps=3"]
    workflow = comfy_queue.apply_overrides(json.loads((PACK_DIR / "workflows" / "api" / "ltx23_t2v_hq.json").read_text()), files + sizes)
    assert (workflow["1"]["inputs"]["pipeline"], workflow["4"]["inputs"]["rescale"], workflow["4"]["inputs"]["audio_rescale"]) == ("hq", 0.45, 1.0)
    outcome = comfy_queue.queue_prompt(comfyui.url, workflow, say=lambda text: None, timeout=600)
    path = saved_video(comfyui, outcome)
    with av.open(str(path)) as container:
        assert (container.streams.video[0].codec_context.width, container.streams.video[0].codec_context.height) == (192, 128)
        assert len(container.streams.audio) == 1 and sum(1 for _ in container.decode(video=0)) == 9


@pytest.mark.parametrize("slug", ["ltx23_i2v_comfy_recipe_tiny", "ltx23_flf_keyframes_tiny"])
def test_the_comfyui_recipe_and_keyframes_workflows_write_an_mp4_with_audio(comfyui, slug):
    """The no-download twins as shipped. ComfyUI's LTX-2.3 template settings: ManualSigmas feeds SP Sampler's sigmas,
    the loader chooses the distilled LoRA for stage 1 too, CFG 1, the image at 0.7, stage 2 sequence parallel. The
    keyframes recipe: a first and a last image (LoadImage from input/) into both stages as guiding latents."""
    import av
    import numpy as np
    from PIL import Image

    (comfyui.base / "input").mkdir(exist_ok=True)
    for name, size in (("example.png", (48, 64)), ("example_last.png", (40, 72))):
        pixels = np.linspace(0, 255, size[0] * size[1] * 3).astype(np.uint8).reshape(*size, 3)
        Image.fromarray(pixels[:, ::-1] if name == "example_last.png" else pixels).save(comfyui.base / "input" / name)
    workflow = json.loads((PACK_DIR / "workflows" / "api" / f"{slug}.json").read_text())
    sampler = next(node["inputs"] for node in workflow.values() if node["class_type"] == "MGPUSPSampler")
    if slug == "ltx23_i2v_comfy_recipe_tiny":
        assert workflow[sampler["sigmas"][0]]["class_type"] == "ManualSigmas" and (sampler["video_cfg"], sampler["image_strength"]) == (1.0, 0.7)
    else:
        assert workflow[sampler["last_image"][0]]["inputs"]["image"] == "example_last.png"
    outcome = comfy_queue.queue_prompt(comfyui.url, workflow, say=lambda text: None, timeout=600)
    path = saved_video(comfyui, outcome)
    with av.open(str(path)) as container:
        assert (container.streams.video[0].codec_context.width, container.streams.video[0].codec_context.height) == (192, 128)
        assert len(container.streams.audio) == 1 and sum(1 for _ in container.decode(video=0)) == 9


def test_interrupt_stops_a_long_run_and_the_same_fleet_serves_the_next(comfyui):
    before = get_json(f"{comfyui.url}/mgpu/status")
    failure: list[BaseException] = []

    def long_run():
        try:
            queue(comfyui, **{"4.steps": 200, "4.seed": 11})
        except comfy_queue.QueueError as exc:
            failure.append(exc)

    runner = threading.Thread(target=long_run)
    runner.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        job = get_json(f"{comfyui.url}/mgpu/status").get("current_job") or {}
        if job.get("op") == "sample" and (job.get("step") or 0) >= 2:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the long run never reached step 2 of stage 1")
    interrupted_at = time.monotonic()
    post_json(f"{comfyui.url}/interrupt", {})
    runner.join(timeout=120)
    stop_seconds = time.monotonic() - interrupted_at
    assert not runner.is_alive(), "the run did not end within 120 s of POST /interrupt"
    assert failure and failure[0].exit_code == 3 and "interrupted at node 4" in str(failure[0]), failure
    print(f"\nPOST /interrupt at step {job['step']}/200 ended the run in {stop_seconds:.1f} s")
    after = get_json(f"{comfyui.url}/mgpu/status")
    assert after["current_job"] is None and after["server_pid"] == before["server_pid"] and after["fleet_restarts"] == before["fleet_restarts"], after

    outcome = queue(comfyui, **{"4.seed": 12})
    assert saved_video(comfyui, outcome).is_file()
    print(f"the next run on the same fleet: {outcome.seconds:.1f} s")
    assert get_json(f"{comfyui.url}/mgpu/status")["server_pid"] == before["server_pid"]


PREVIEW_IMAGE, TEXT_EVENT = 1, 3  # ComfyUI's binary websocket event types (its protocol.BinaryEventTypes)


def run_listening(comfyui: ComfyUI, workflow: dict, preview_method: str) -> tuple[list[bytes], list[bytes]]:
    """Queue ``workflow`` with ComfyUI's per-prompt preview setting; return the binary websocket
    messages of the client that queued it and of another client watching the same server."""
    ws_url = comfyui.url.replace("http://", "ws://") + "/ws?clientId="
    own_id, other_id = uuid.uuid4().hex, uuid.uuid4().hex
    own, other = comfy_queue.WebSocket.connect(ws_url + own_id), comfy_queue.WebSocket.connect(ws_url + other_id)
    own.sock.settimeout(600)
    other_binary: list[bytes] = []

    def watch() -> None:
        try:
            other_binary.extend(message for message in other.messages() if isinstance(message, bytes))
        except (OSError, ConnectionError, ValueError):
            pass  # closed below once the prompt is done

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    own_binary: list[bytes] = []
    try:
        status, body = comfy_queue.http_json(
            f"{comfyui.url}/prompt", {"prompt": workflow, "client_id": own_id, "extra_data": {"preview_method": preview_method}}
        )
        assert status == 200, body
        for message in own.messages():
            if isinstance(message, bytes):
                own_binary.append(message)
                continue
            event = json.loads(message)
            data = event.get("data") or {}
            if data.get("prompt_id") != body["prompt_id"]:
                continue
            assert event["type"] not in ("execution_error", "execution_interrupted"), event
            if event["type"] == "execution_success":
                break
    finally:
        own.close()
        other.close()
        watcher.join(timeout=30)
    return own_binary, other_binary


def binary_kinds(messages: list[bytes]) -> list[int]:
    return [struct.unpack(">I", message[:4])[0] for message in messages]


def test_previews_reach_the_prompts_client_as_jpegs_and_only_with_previews_on(comfyui):
    from io import BytesIO

    from PIL import Image

    workflow = json.loads(TINY_WORKFLOW.read_text())
    on = comfy_queue.apply_overrides(workflow, ["4.seed=21", "5.seed=21"])
    own, other = run_listening(comfyui, on, "latent2rgb")
    previews = [message for message in own if struct.unpack(">I", message[:4])[0] == PREVIEW_IMAGE]
    # SP Sampler's 3 steps and TDP Upscale's 2: a preview after each.
    assert len(previews) == 5, binary_kinds(own)
    for message in previews:
        assert struct.unpack(">I", message[4:8])[0] == 1  # JPEG
        with Image.open(BytesIO(message[8:])) as image:
            assert image.format == "JPEG" and image.width > image.height  # frames side by side
    assert TEXT_EVENT in binary_kinds(own), "the nodes' per-rank text should reach the prompt's client"
    assert PREVIEW_IMAGE not in binary_kinds(other) and TEXT_EVENT not in binary_kinds(other), "another browser saw this prompt's node messages"

    off = comfy_queue.apply_overrides(workflow, ["4.seed=22", "5.seed=22"])
    own, _ = run_listening(comfyui, off, "none")
    assert PREVIEW_IMAGE not in binary_kinds(own), "--preview-method none must send no preview"
    assert TEXT_EVENT in binary_kinds(own)


def decoded(path: Path):
    """Every video frame and audio sample of an mp4, as arrays."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        frames = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    with av.open(str(path)) as container:
        audio = np.concatenate([frame.to_ndarray() for frame in container.decode(audio=0)], axis=-1)
    return frames, audio


def test_model_files_in_comfyuis_folders_with_the_single_file_gemma_run_the_graph_as_the_embedded_bundle(comfyui):
    inputs = get_json(f"{comfyui.url}/object_info/MGPULoadCheckpoint")["MGPULoadCheckpoint"]["input"]["required"]
    # A combo is served as [choices, options], or as ["COMBO", {"options": choices}] by newer servers.
    listed = {name: entry[0] if isinstance(entry[0], list) else entry[1]["options"] for name, entry in inputs.items() if name in comfyui.model_files}
    for input_name, file_name in comfyui.model_files.items():
        assert file_name in listed[input_name], f"{input_name} lists {listed[input_name]}, not the placed {file_name}"
    assert listed["gemma"].count(GEMMA_FILE) == 1 and GEMMA_FILE not in listed["ckpt_name"], listed

    # Same graph and seeds on both: the files are the embedded bundle's bytes and the single file
    # encodes bit for bit as the Gemma folder, so the decoded frames and audio must be identical.
    seeds = {"4.seed": 31, "5.seed": 31, "6.seed": 31}
    from_files = queue(comfyui, **seeds, **{f"1.{name}": value for name, value in comfyui.model_files.items()})
    print(f"\ntiny two-stage workflow on files in models/ (load from disk, encode with the single-file Gemma, ...): {from_files.seconds:.1f} s")
    embedded = queue(comfyui, **seeds)
    files_path, embedded_path = saved_video(comfyui, from_files), saved_video(comfyui, embedded)
    assert files_path != embedded_path
    (files_frames, files_audio), (embedded_frames, embedded_audio) = decoded(files_path), decoded(embedded_path)
    assert files_frames.shape == (9, 128, 192, 3) and files_audio.size > 0, (files_frames.shape, files_audio.shape)
    assert (files_frames == embedded_frames).all() and (files_audio == embedded_audio).all(), "the files gave other frames or audio"


def test_stopping_comfyui_ends_its_fleet(comfyui):
    status = get_json(f"{comfyui.url}/mgpu/status")
    pids = [status["server_pid"], *(rank["pid"] for rank in status["ranks"])]
    comfyui.stop()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
        time.sleep(0.5)
    assert not [pid for pid in pids if process_alive(pid)], f"fleet processes {pids} outlived ComfyUI"

