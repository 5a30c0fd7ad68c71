"""``python -m mgpu_backend queue`` against a tiny fake ComfyUI (real HTTP and websocket on 127.0.0.1):
posting with a client id, following the websocket (ping/pong, fragments, 16- and 64-bit lengths,
binary progress text), printing outputs from /history, and exiting non-zero with ComfyUI's error
text when the prompt is refused, fails or is interrupted."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from mgpu_backend.tools import comfy_queue

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


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu_backend")
    comfy_queue.add_queue_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


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


def test_queue_posts_with_the_websocket_client_id_follows_progress_and_prints_saved_files(capsys):
    with FakeComfyUI(SUCCESS_SCRIPT) as fake:
        code = run_cli("queue", str(WORKFLOW), "--server", fake.url, "--set", "4.seed=42", "--set", "SP Sampler.steps=2", "--set", "MGPUTextEncode.positive=a cat purring")
    out = capsys.readouterr().out
    assert code == 0, out
    (posted,) = fake.posted
    assert posted["client_id"] == fake.ws_client_ids[0] and len(posted["client_id"]) == 32
    expected = json.loads(WORKFLOW.read_text())
    expected["4"]["inputs"].update(seed=42, steps=2)
    expected["2"]["inputs"]["positive"] = "a cat purring"
    assert posted["prompt"] == expected
    assert f"queued prompt {PROMPT_ID} (position 3)" in out
    assert "running node 4 SP Sampler" in out and "[4 SP Sampler] 1/3" in out and "[4 SP Sampler] 2/3" in out
    assert "[4 SP Sampler] stage1 1/3 · 0.40 s/step · rank 0 0.40 s | rank 1 0.41 s" in out
    assert "[9 " not in out, "another prompt's progress was printed"
    assert "8 Save Video: output/video/ltx2_tiny_mgpu_00001_.mp4" in out
    assert f"{fake.url}/view?filename=ltx2_tiny_mgpu_00001_.mp4&subfolder=video&type=output" in out
    pong, *rest = fake.client_frames
    assert pong == (0xA, b"are-you-there", True), "the ping must be answered with a masked pong carrying its payload"
    assert rest and rest[-1][0] == 0x8 and rest[-1][2], "the client must answer the close with a masked close"


def test_refused_prompt_exits_1_with_comfyuis_validation_errors(capsys):
    refusal = {
        "error": {"type": "prompt_outputs_failed_validation", "message": "Prompt outputs failed validation", "details": ""},
        "node_errors": {"4": {"class_type": "MGPUSPSampler", "errors": [{"message": "Value bigger than max", "details": "steps: 500 > 200"}]}},
    }
    with FakeComfyUI([], refuse=refusal) as fake:
        code = run_cli("queue", str(WORKFLOW), "--server", fake.url, "--set", "4.steps=500")
    err = capsys.readouterr().err
    assert code == 1
    assert "ComfyUI refused the prompt" in err and "Prompt outputs failed validation" in err
    assert "node 4 (MGPUSPSampler): Value bigger than max (steps: 500 > 200)" in err


def test_node_failure_exits_1_with_the_exception_text(capsys):
    script = [
        event("execution_start", prompt_id=PROMPT_ID),
        event("execution_error", prompt_id=PROMPT_ID, node_id="5", node_type="MGPUTDPUpscale", exception_type="RuntimeError",
              exception_message="TDP Upscale: overlap 4 is too large for 2 tiles (rank 1)\n", traceback=["..."]),
    ]  # fmt: skip
    with FakeComfyUI(script) as fake:
        code = run_cli("queue", str(WORKFLOW), "--server", fake.url)
    err = capsys.readouterr().err
    assert code == 1
    assert "error: node 5 TDP Upscale failed: RuntimeError: TDP Upscale: overlap 4 is too large for 2 tiles (rank 1)" in err


def test_interrupt_exits_3(capsys):
    script = [event("execution_interrupted", prompt_id=PROMPT_ID, node_id="4", node_type="MGPUSPSampler", executed=[])]
    with FakeComfyUI(script) as fake:
        code = run_cli("queue", str(WORKFLOW), "--server", fake.url)
    assert code == 3 and "interrupted at node 4 SP Sampler" in capsys.readouterr().err


def test_dropped_websocket_falls_back_to_the_history(capsys):
    with FakeComfyUI([event("execution_start", prompt_id=PROMPT_ID), b"DROP"]) as fake:
        code = run_cli("queue", str(WORKFLOW), "--server", fake.url)
    out = capsys.readouterr().out
    assert code == 0 and "lost the websocket" in out and "output/video/ltx2_tiny_mgpu_00001_.mp4" in out


def test_failure_recorded_only_in_the_history_still_exits_1(capsys):
    status = {"status_str": "error", "completed": False, "messages": [["execution_error", {"node_id": "6", "node_type": "MGPUDistributedVAEDecode", "exception_message": "rank 0 died"}]]}
    with FakeComfyUI([b"DROP"], history_status=status) as fake:
        code = run_cli("queue", str(WORKFLOW), "--server", fake.url)
    assert code == 1 and "node 6 (MGPUDistributedVAEDecode) failed: rank 0 died" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("99.seed=1", "no node '99' in the workflow; nodes are: 1 (MGPULoadCheckpoint)"),
        ("4.sed=1", "node 4 (MGPUSPSampler) has no input 'sed'"),
        ("4.model=1", "4.model is connected to node 1; set the value on node 1 instead"),
        ("seed=1", "--set takes NODE.INPUT=VALUE"),
    ],
)
def test_bad_overrides_exit_2_before_anything_is_sent(capsys, assignment, message):
    code = run_cli("queue", str(WORKFLOW), "--server", "http://127.0.0.1:9", "--set", assignment)
    assert code == 2 and message in capsys.readouterr().err


def test_a_ui_workflow_is_refused_with_where_to_find_its_api_twin(capsys):
    code = run_cli("queue", str(WORKFLOW.parent.parent / "LTX-2.0 Tiny Test — no download.json"))
    assert code == 2 and "is a UI workflow" in capsys.readouterr().err


def test_unreachable_server_says_so(capsys):
    code = run_cli("queue", str(WORKFLOW), "--server", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach ComfyUI at http://127.0.0.1:9" in capsys.readouterr().err


def test_set_values_parse_as_json_where_they_can():
    assert [comfy_queue.parse_value(text) for text in ("42", "2.5", "true", '"7"', "[1, 2]", "a fox")] == [42, 2.5, True, "7", [1, 2], "a fox"]
