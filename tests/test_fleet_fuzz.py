"""Seeded fuzzing of the fleet server's wire: a few hundred mutations of valid frames (the hello, a
submit with inline tensors, a submit naming a shared-memory segment), each sent on its own real
connection to a real server with a gloo CPU rank. After every one the server must still answer a
well-behaved client; at the end no rank has been replaced and no segment is left behind."""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import time

import pytest
import torch

from mgpu_backend.fleet import protocol, shm
from mgpu_backend.fleet.client import FleetClient
from mgpu_backend.fleet.protocol import Message

from . import fleet_harness

MUTATIONS = 300
SEED = 20261201

EVIL_VALUES = [
    2**64, -1, 0, "", "\ud800", "x" * 300, None, True, {}, [], 1e308, float("inf"), -0.0,
    [0, 2**39, 2**39, 2**39], [2**20] * 9, {"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]},
    "../x", f"mgpu-{os.getuid()}-1-{'0' * 16}", "bfloat16", "object",
]  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    directory.chmod(0o700)
    socket_path = directory / "fleet.sock"
    process = fleet_harness.start_server(socket_path, 1, "--idle-timeout", "0")
    yield socket_path, process
    fleet_harness.stop_server(process)


def _frame(message: Message) -> bytes:
    return b"".join(bytes(part) for part in protocol.encode(message))


def _repack(header: dict, payload: bytes) -> bytes:
    header_bytes = json.dumps(header, separators=(",", ":")).encode()  # NaN, infinities, surrogates allowed
    return protocol.PREFIX.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, len(header_bytes), len(payload)) + header_bytes + payload


def _split(data: bytes) -> tuple[dict, bytes]:
    _, _, header_len, _ = protocol.PREFIX.unpack(data[: protocol.PREFIX.size])
    header = json.loads(data[protocol.PREFIX.size : protocol.PREFIX.size + header_len])
    return header, data[protocol.PREFIX.size + header_len :]


def _replace_somewhere(rng: random.Random, value, replacement, root: bool = True):
    """``value`` (a JSON tree) with one randomly chosen node below the root replaced."""
    if not isinstance(value, (dict, list)) or not value or (not root and rng.random() < 0.25):
        return replacement
    if isinstance(value, dict):
        key = rng.choice(list(value))
        return {**value, key: _replace_somewhere(rng, value[key], replacement, root=False)}
    index = rng.randrange(len(value))
    return value[:index] + [_replace_somewhere(rng, value[index], replacement, root=False)] + value[index + 1 :]


def mutate(rng: random.Random, data: bytes) -> bytes:
    kind = rng.choice(["flip", "truncate", "insert", "lengths", "json", "json", "json"])
    if kind == "flip":
        mutated = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        return bytes(mutated)
    if kind == "truncate":
        return data[: rng.randrange(len(data))]
    if kind == "insert":
        position = rng.randrange(len(data))
        return data[:position] + rng.randbytes(rng.randint(1, 64)) + data[position:]
    if kind == "lengths":
        magic, version, header_len, payload_len = protocol.PREFIX.unpack(data[: protocol.PREFIX.size])
        header_len = rng.choice([0, header_len - 1, header_len + 1, 2**32 - 1, rng.randrange(2**21)])
        payload_len = rng.choice([0, payload_len + 1, max(payload_len - 1, 0), 2**64 - 1, 2**30])
        return protocol.PREFIX.pack(magic, version, header_len, payload_len) + data[protocol.PREFIX.size :]
    header, payload = _split(data)
    return _repack(_replace_somewhere(rng, header, rng.choice(EVIL_VALUES)), payload)


def _hello() -> bytes:
    return _frame(Message("hello", {"version": protocol.PROTOCOL_VERSION, "nonce": secrets.token_hex(32)}))


def _inline_submit() -> bytes:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([True, False])}
    return _frame(Message("submit", {"op": "echo", "args": {"k": [1, 2]}, "ref": 1}, tensors))


def _send_and_drain(socket_path, data: bytes, authenticate: bool) -> None:
    """Send ``data`` on a fresh connection, then end it and read whatever comes until the server
    closes: an error reply for a malformed frame, or the answers to a frame that was still valid."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(60)
    sock.connect(str(socket_path))
    try:
        if authenticate:
            assert fleet_harness.raw_handshake(sock, fleet_harness.token_of(socket_path)).type == "welcome"
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1 << 16):
            pass
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server closed first, having replied to an earlier part
    finally:
        sock.close()


def _names_the_segment(data: bytes, segment: str) -> bool:
    """Whether the server saw a valid submit naming ``segment``: it must then unlink it."""
    try:
        message = protocol.decode(data)
    except (protocol.ProtocolError, protocol.ConnectionClosed, ValueError, OverflowError):
        return False
    return message.type == "submit" and any(descriptor.get("segment") == segment for descriptor in message.shm)


def test_a_few_hundred_mutated_frames_never_stop_the_server_or_leak(fleet):
    socket_path, process = fleet
    rng = random.Random(SEED)
    with FleetClient.connect(str(socket_path), autostart=False) as good:
        status = good.status()
        server_pid, rank_pids = status["server_pid"], [rank["pid"] for rank in status["ranks"]]
        counts = {"hello": 0, "inline": 0, "shm": 0}
        for index in range(MUTATIONS):
            kind = rng.choice(list(counts))
            counts[kind] += 1
            segment = None
            if kind == "hello":
                data, authenticate = mutate(rng, _hello()), False
            elif kind == "inline":
                data, authenticate = mutate(rng, _inline_submit()), True
            else:
                descriptor = shm.write_tensor("big", torch.full((rng.choice([1, 1000, 300_000]),), float(index)))
                segment = descriptor["segment"]
                valid = _frame(Message("submit", {"op": "echo", "args": {}, "ref": 1}, shm=[descriptor]))
                data, authenticate = mutate(rng, valid), True
            _send_and_drain(socket_path, data, authenticate)
            if segment is not None:
                path = shm.SHM_DIR / segment
                if _names_the_segment(data, segment):
                    deadline = time.monotonic() + 30
                    while path.exists():  # a job cancelled while queued frees its input when the queue reaches it
                        assert time.monotonic() < deadline, f"mutation {index}: the server kept a segment it was handed"
                        time.sleep(0.05)
                else:
                    path.unlink(missing_ok=True)  # the server never saw its name: the sender's to remove
            assert good.status()["server_pid"] == server_pid, f"mutation {index}"
        assert min(counts.values()) > MUTATIONS // 5
        result = good.run("echo", {"after": "fuzz"}, {"x": torch.arange(5)})
        assert result.fields["fields"] == {"after": "fuzz"} and result.tensors["x"].tolist() == [0, 1, 2, 3, 4]
        status = good.status()
        assert [rank["pid"] for rank in status["ranks"]] == rank_pids and all(rank["alive"] for rank in status["ranks"])
        assert status["fleet_restarts"] == 0 and status["current_job"] is None and status["queue_length"] == 0
    prefix = f"mgpu-{os.getuid()}-"
    leftover = {name for name in os.listdir(shm.SHM_DIR) if name.startswith((f"{prefix}{server_pid}-", f"{prefix}{os.getpid()}-"))}
    assert leftover == set()
    fleet_harness.stop_server(process)
    assert process.returncode == 0
    # Every mutation was diagnosed as a protocol error, none reached the catch-all for surprises.
    assert "could not be handled" not in (socket_path.parent / "server.log").read_text()
    assert fleet_harness.wait_gone(rank_pids) == []
