"""``python -m mgpu_backend queue WORKFLOW.json``: run an API-format workflow on a running ComfyUI.

It posts the workflow (``POST /prompt`` with a client id), follows the run over ComfyUI's websocket
(``/ws?clientId=...``: node starts, step progress, the per-rank text the MGPU nodes send, errors),
then prints where the outputs landed (``GET /history/<prompt id>``). The exit status is 0 on
success and non-zero with ComfyUI's own error text on a refused prompt, a failed node or an
interrupt. ``--set NODE.INPUT=VALUE`` overrides an input first (NODE: node id, title or class).

Standard library only, with a minimal websocket client (RFC 6455: handshake, masked client
frames, fragmented and ping/pong/close frames). This never imports ComfyUI or torch and never
starts the fleet: ComfyUI's nodes do that.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import socket
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

DEFAULT_SERVER = "http://127.0.0.1:8188"
WEBSOCKET_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
TEXT_EVENT = 3  # ComfyUI's BinaryEventTypes.TEXT: per-node progress text
MAX_FRAME_BYTES = 256 * 1024 * 1024


class QueueError(Exception):
    """The prompt was refused or failed; the message is ComfyUI's error text."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --- workflow --------------------------------------------------------------------------------------


def load_api_workflow(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as file:
            workflow = json.load(file)
    except FileNotFoundError:
        raise QueueError(f"workflow file {path} does not exist; name an API-format workflow (e.g. one in workflows/api/)", 2) from None
    except IsADirectoryError:
        raise QueueError(f"workflow {path} is a directory; name an API-format workflow file (e.g. one in workflows/api/)", 2) from None
    except json.JSONDecodeError as exc:
        raise QueueError(f"{path} is not valid JSON: {exc}", 2) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise QueueError(f"workflow file {path} cannot be read ({exc}); check its permissions and that it is UTF-8 JSON", 2) from None
    if isinstance(workflow, dict) and "nodes" in workflow and "links" in workflow:
        raise QueueError(
            f"{path} is a UI workflow (drag-and-drop format); queue its API twin from workflows/api/, "
            "or save it from ComfyUI with 'Export (API)'",
            2,
        )
    if not isinstance(workflow, dict) or not workflow or not all(
        isinstance(node, dict) and "class_type" in node and isinstance(node.get("inputs"), dict) for node in workflow.values()
    ):
        raise QueueError(f"{path} is not an API-format workflow ({{node id: {{class_type, inputs}}}})", 2)
    return workflow


def find_node(workflow: dict, reference: str) -> str:
    """A node id from an id, a title (``_meta.title``) or a class type; ambiguity is an error."""
    if reference in workflow:
        return reference
    for key, label in (("title", "title"), ("class_type", "class")):
        if key == "title":
            matches = [node_id for node_id, node in workflow.items() if node.get("_meta", {}).get("title") == reference]
        else:
            matches = [node_id for node_id, node in workflow.items() if node["class_type"] == reference]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise QueueError(f"{label} {reference!r} matches nodes {matches}; use one of those ids", 2)
    listing = ", ".join(f"{node_id} ({node['class_type']})" for node_id, node in workflow.items())
    raise QueueError(f"no node {reference!r} in the workflow; nodes are: {listing}", 2)


def parse_value(text: str):
    """JSON where it parses (numbers, true/false, quoted strings, lists), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(workflow: dict, assignments: list[str]) -> dict:
    """``NODE.INPUT=VALUE`` assignments applied to a copy of the workflow."""
    result = json.loads(json.dumps(workflow))
    for assignment in assignments:
        target, equals, value = assignment.partition("=")
        reference, dot, input_name = target.rpartition(".")
        if not equals or not dot or not reference or not input_name:
            raise QueueError(f"--set takes NODE.INPUT=VALUE (e.g. 5.seed=42), got {assignment!r}", 2)
        node_id = find_node(result, reference)
        inputs = result[node_id]["inputs"]
        if input_name not in inputs:
            raise QueueError(
                f"node {node_id} ({result[node_id]['class_type']}) has no input {input_name!r}; it has {sorted(inputs)}", 2
            )
        if isinstance(inputs[input_name], list) and len(inputs[input_name]) == 2 and isinstance(inputs[input_name][0], str):
            source = inputs[input_name][0]
            raise QueueError(f"{node_id}.{input_name} is connected to node {source}; set the value on node {source} instead", 2)
        inputs[input_name] = parse_value(value)
    return result


# --- HTTP ------------------------------------------------------------------------------------------


def http_json(url: str, payload: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    """(status, JSON body) of a GET, or of a POST when ``payload`` is given; HTTP errors included."""
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body)
        except json.JSONDecodeError:
            return exc.code, {"error": {"message": body.decode(errors="replace")}}
    except urllib.error.URLError as exc:
        raise QueueError(f"cannot reach ComfyUI at {url}: {exc.reason}; is it running? (--server)") from None


def describe_prompt_error(body: dict) -> str:
    """ComfyUI's refusal of a prompt (validation errors per node) as readable text."""
    error = body.get("error")
    lines = []
    if isinstance(error, dict):
        lines.append(error.get("message", "prompt refused") + (f": {error['details']}" if error.get("details") else ""))
    elif error:
        lines.append(str(error))
    for node_id, node_error in (body.get("node_errors") or {}).items():
        for item in node_error.get("errors", []):
            detail = f" ({item['details']})" if item.get("details") else ""
            lines.append(f"  node {node_id} ({node_error.get('class_type', '?')}): {item.get('message', '')}{detail}")
    return "\n".join(lines) or json.dumps(body)


# --- websocket -------------------------------------------------------------------------------------


class WebSocket:
    """A minimal blocking websocket client: enough for ComfyUI's /ws event stream."""

    def __init__(self, sock: socket.socket, leftover: bytes = b"") -> None:
        self.sock, self.buffer = sock, leftover

    @classmethod
    def connect(cls, url: str, timeout: float = 30.0) -> WebSocket:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("ws", "http"):
            raise QueueError(f"only plain ws:// / http:// servers are supported, got {url!r}", 2)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        request = (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        sock.sendall(request.encode())
        response = b""
        while b"\r\n\r\n" not in response:
            chunk = sock.recv(4096)
            if not chunk:
                sock.close()
                raise QueueError(f"the websocket handshake with {url} was cut off")
            response += chunk
        head, _, leftover = response.partition(b"\r\n\r\n")
        lines = head.decode(errors="replace").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
        expected = base64.b64encode(hashlib.sha1((key + WEBSOCKET_GUID).encode()).digest()).decode()
        if " 101 " not in lines[0] + " " or headers.get("sec-websocket-accept") != expected:
            sock.close()
            raise QueueError(f"{url} refused the websocket upgrade: {lines[0]}")
        return cls(sock, leftover)

    def _read_exact(self, count: int) -> bytes:
        while len(self.buffer) < count:
            chunk = self.sock.recv(max(65536, count - len(self.buffer)))
            if not chunk:
                raise ConnectionError("the websocket closed mid-frame")
            self.buffer += chunk
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data

    def _read_frame(self) -> tuple[bool, int, bytes]:
        first, second = self._read_exact(2)
        length = second & 0x7F
        if length == 126:
            length = struct.unpack(">H", self._read_exact(2))[0]
        elif length == 127:
            length = struct.unpack(">Q", self._read_exact(8))[0]
        if length > MAX_FRAME_BYTES:
            raise ConnectionError(f"websocket frame of {length} bytes is over the {MAX_FRAME_BYTES} byte limit")
        mask = self._read_exact(4) if second & 0x80 else None
        payload = self._read_exact(length)
        if mask:
            payload = bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload))
        return bool(first & 0x80), first & 0x0F, payload

    def send(self, opcode: int, payload: bytes = b"") -> None:
        """One final frame, masked as RFC 6455 requires of clients."""
        header = bytes([0x80 | opcode])
        if len(payload) < 126:
            header += bytes([0x80 | len(payload)])
        elif len(payload) < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", len(payload))
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", len(payload))
        mask = os.urandom(4)
        self.sock.sendall(header + mask + bytes(byte ^ mask[index % 4] for index, byte in enumerate(payload)))

    def messages(self) -> Iterator[str | bytes]:
        """Text messages as str, binary as bytes, until the server closes the connection."""
        fragments: list[bytes] = []
        message_opcode = 0
        while True:
            try:
                final, opcode, payload = self._read_frame()
            except (ConnectionError, OSError):
                return
            if opcode == 0x8:  # close: answer it, then stop
                try:
                    self.send(0x8, payload[:2])
                except OSError:
                    pass
                return
            if opcode == 0x9:
                self.send(0xA, payload)
                continue
            if opcode == 0xA:
                continue
            if opcode != 0x0:
                message_opcode, fragments = opcode, []
            fragments.append(payload)
            if final:
                data = b"".join(fragments)
                yield data.decode() if message_opcode == 0x1 else data

    def close(self) -> None:
        try:
            self.send(0x8, struct.pack(">H", 1000))
        except OSError:
            pass
        self.sock.close()


# --- following one prompt --------------------------------------------------------------------------


@dataclass
class Outcome:
    prompt_id: str
    outputs: dict
    seconds: float


def parse_text_event(data: bytes) -> tuple[str, str] | None:
    """(node id, text) of ComfyUI's binary progress-text event, None for other binary events."""
    if len(data) < 8 or struct.unpack(">I", data[:4])[0] != TEXT_EVENT:
        return None
    id_length = struct.unpack(">I", data[4:8])[0]
    return data[8 : 8 + id_length].decode(errors="replace"), data[8 + id_length :].decode(errors="replace")


def node_label(workflow: dict, node_id) -> str:
    node = workflow.get(str(node_id), {})
    return f"{node_id} {node.get('_meta', {}).get('title') or node.get('class_type', '?')}"


def follow(websocket: WebSocket, workflow: dict, prompt_id: str, say: Callable[[str], None],
           on_event: Callable[[str, dict], None] | None = None) -> None:  # fmt: skip
    """Print the run's events until it succeeds; raise QueueError on a node error or an interrupt.
    ``on_event`` is called with each of the prompt's JSON events (type, data) as it arrives."""
    for message in websocket.messages():
        if isinstance(message, bytes):
            text_event = parse_text_event(message)
            if text_event is not None:
                say(f"  [{node_label(workflow, text_event[0])}] {text_event[1]}")
            continue
        event = json.loads(message)
        kind, data = event.get("type"), event.get("data") or {}
        if data.get("prompt_id") not in (None, prompt_id):
            continue
        if on_event is not None:
            on_event(kind, data)
        if kind == "executing" and data.get("node") is not None:
            say(f"running node {node_label(workflow, data['node'])}")
        elif kind == "execution_cached" and data.get("nodes"):
            say(f"cached: {', '.join(map(str, data['nodes']))}")
        elif kind == "progress":
            say(f"  [{node_label(workflow, data.get('node'))}] {data.get('value')}/{data.get('max')}")
        elif kind == "execution_error":
            raise QueueError(
                f"node {node_label(workflow, data.get('node_id'))} failed: "
                f"{data.get('exception_type', 'error')}: {data.get('exception_message', '').strip()}"
            )
        elif kind == "execution_interrupted":
            raise QueueError(f"interrupted at node {node_label(workflow, data.get('node_id'))}", 3)
        elif kind == "execution_success" or (kind == "executing" and data.get("node") is None and data.get("prompt_id") == prompt_id):
            return
    raise ConnectionError("the websocket closed before the prompt finished")


def wait_in_history(server: str, prompt_id: str, deadline: float) -> dict:
    """The prompt's history entry once it is complete (the fallback when the websocket drops)."""
    while True:
        status, body = http_json(f"{server}/history/{prompt_id}")
        entry = body.get(prompt_id) if status == 200 else None
        if entry and entry.get("status", {}).get("completed") is not None:
            return entry
        if time.monotonic() > deadline:
            raise QueueError(f"prompt {prompt_id} did not finish in time", 4)
        time.sleep(1.0)


def history_failure(entry: dict) -> str | None:
    """ComfyUI's error text from a finished history entry, None if it succeeded."""
    status = entry.get("status", {})
    if status.get("status_str") != "error":
        return None
    for kind, data in status.get("messages", []):
        if kind == "execution_error":
            return f"node {data.get('node_id')} ({data.get('node_type')}) failed: {data.get('exception_message', '').strip()}"
        if kind == "execution_interrupted":
            return f"interrupted at node {data.get('node_id')}"
    return "the prompt failed"


def output_files(outputs: dict) -> list[tuple[str, dict]]:
    """(node id, file entry) for every file a node saved (images, videos, audio, ...)."""
    found = []
    for node_id, node_output in outputs.items():
        for items in node_output.values():
            if isinstance(items, list):
                found += [(node_id, item) for item in items if isinstance(item, dict) and "filename" in item]
    return found


def queue_prompt(server: str, workflow: dict, say: Callable[[str], None] = print, timeout: float = 3600.0,
                 on_event: Callable[[str, dict], None] | None = None) -> Outcome:  # fmt: skip
    """Queue ``workflow`` on ComfyUI at ``server``, follow it, and return its outputs (``on_event``:
    see ``follow``)."""
    server = server.rstrip("/")
    client_id = uuid.uuid4().hex
    websocket_url = server.replace("https://", "wss://").replace("http://", "ws://") + f"/ws?clientId={client_id}"
    started = time.monotonic()
    # Connect first: events of a fast prompt would otherwise be sent before anyone listens.
    try:
        websocket = WebSocket.connect(websocket_url)
    except OSError as exc:
        raise QueueError(f"cannot reach ComfyUI at {server}: {exc}; is it running? (--server)") from None
    try:
        websocket.sock.settimeout(timeout)
        status, body = http_json(f"{server}/prompt", {"prompt": workflow, "client_id": client_id})
        if status != 200 or "prompt_id" not in body:
            raise QueueError(f"ComfyUI refused the prompt:\n{describe_prompt_error(body)}")
        prompt_id = body["prompt_id"]
        say(f"queued prompt {prompt_id} (position {body.get('number')})")
        try:
            follow(websocket, workflow, prompt_id, say, on_event)
        except (ConnectionError, socket.timeout):
            say("lost the websocket; waiting for the result in the history")
    finally:
        websocket.close()
    entry = wait_in_history(server, prompt_id, started + timeout)
    failure = history_failure(entry)
    if failure:
        raise QueueError(failure, 3 if failure.startswith("interrupted") else 1)
    return Outcome(prompt_id, entry.get("outputs", {}), time.monotonic() - started)


def cmd_queue(args: argparse.Namespace) -> int:
    try:
        workflow = apply_overrides(load_api_workflow(args.workflow), args.set or [])
        outcome = queue_prompt(args.server, workflow, timeout=args.timeout)
    except QueueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"done in {outcome.seconds:.1f} s")
    files = output_files(outcome.outputs)
    for node_id, item in files:
        relative = "/".join(part for part in (item.get("type", "output"), item.get("subfolder", ""), item["filename"]) if part)
        query = urllib.parse.urlencode({key: item.get(key, "") for key in ("filename", "subfolder", "type")})
        print(f"  {node_label(workflow, node_id)}: {relative}  ({args.server.rstrip('/')}/view?{query})")
    if not files:
        print("  (no files saved: add a SaveVideo / SaveImage node to keep the result)")
    return 0


def add_queue_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``queue`` on the CLI's sub-command parsers (``python -m mgpu_backend queue``)."""
    parser = subparsers.add_parser("queue", help="run an API-format workflow on a running ComfyUI and wait for its outputs")
    parser.add_argument("workflow", help="API-format workflow JSON, e.g. workflows/api/ltx2_t2v_tiny.json")
    parser.add_argument("--server", default=os.environ.get("COMFYUI_URL", DEFAULT_SERVER), help=f"ComfyUI's URL (default: $COMFYUI_URL or {DEFAULT_SERVER})")
    parser.add_argument("--set", action="append", metavar="NODE.INPUT=VALUE", help="override an input; NODE is a node id, title or class type; VALUE is JSON or text (repeatable; default: none, the workflow as saved)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds (default 3600)")
    parser.set_defaults(func=cmd_queue)
    return parser
