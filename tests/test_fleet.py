"""The fleet as a user meets it: a real server process, real sockets, two real gloo CPU ranks."""

from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from mgpu_backend.fleet import protocol
from mgpu_backend.fleet.client import FleetCancelled, FleetClient, FleetError

from . import fleet_harness
from .fleet_harness import REPO, start_server, stop_server, wait_for_server, wait_gone
from .helpers import wait_until


@pytest.fixture(scope="module")
def fleet(fleet_of):
    return fleet_of(2, "--rank-timeout", "6")


def connect(socket_path) -> FleetClient:
    return FleetClient.connect(str(socket_path), autostart=False)


def test_tensors_round_trip_bit_exact_through_all_ranks(fleet):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, 7, generator=generator),
        "bf16": torch.randn(4, 9, generator=generator).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (11,), generator=generator),
        "u8": torch.randint(0, 256, (2, 3, 4), generator=generator, dtype=torch.uint8),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 4),
    }
    with connect(fleet) as client:
        result = client.run("echo", {"note": "hi"}, tensors)
    assert result.fields["ranks_agreed"] == 2
    assert result.fields["fields"] == {"note": "hi"}
    for name, tensor in tensors.items():
        back = result.tensors[name]
        assert back.dtype == tensor.dtype and back.shape == tensor.shape, name
        assert torch.equal(back.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_progress_events_arrive_in_order_with_per_rank_timing(fleet):
    events = []
    with connect(fleet) as client:
        result = client.run("count", {"steps": 6}, on_progress=events.append)
    assert [event["step"] for event in events] == [1, 2, 3, 4, 5, 6]
    assert all(event["total"] == 6 and event["stage"] == "count" for event in events)
    assert all(len(event["rank_seconds"]) == 2 for event in events)
    assert result.fields["total"] == 6 * (1 + 2)  # every step summed rank+1 over both ranks


def test_cancel_mid_job_stops_all_ranks_then_next_job_succeeds(fleet):
    events = []
    with connect(fleet) as client:
        with pytest.raises(FleetCancelled, match="cancelled at count step"):
            client.run(
                "count",
                {"steps": 200, "seconds_per_step": 0.05},
                on_progress=events.append,
                should_cancel=lambda: len(events) >= 3,
            )
        assert 3 <= len(events) < 200
        status = client.status()
        assert status["fleet_restarts"] == 0, "a cancel must keep the fleet warm"
        assert client.run("count", {"steps": 2}).fields["total"] == 6


def test_failing_rank_reports_its_traceback_and_fleet_recovers(fleet):
    with connect(fleet) as client:
        with pytest.raises(FleetError) as info:
            client.run("count", {"steps": 4, "fail_rank": 1, "fail_step": 2})
        assert info.value.rank == 1
        assert "requested failure on rank 1" in str(info.value)
        assert "Traceback" in info.value.traceback
        assert client.run("count", {"steps": 2}).fields["total"] == 6


def test_kill_9_of_a_rank_mid_job_names_the_rank_and_next_job_succeeds(fleet):
    with connect(fleet) as client:
        rank1_pid = client.status()["ranks"][1]["pid"]
        events = []

        def kill_when_running(event):
            events.append(event)
            if len(events) == 2:
                os.kill(rank1_pid, signal.SIGKILL)

        with pytest.raises(FleetError, match=r"rank 1 \(pid \d+\) died \(killed by signal 9\)") as info:
            client.run("count", {"steps": 100, "seconds_per_step": 0.05}, on_progress=kill_when_running)
        assert info.value.rank == 1
        status = client.status()
        assert all(rank["alive"] for rank in status["ranks"])
        assert status["ranks"][1]["pid"] != rank1_pid
        assert client.run("count", {"steps": 3}).fields["total"] == 9


def test_hung_rank_times_out_with_its_name_and_fleet_recovers(fleet):
    with connect(fleet) as client:
        with pytest.raises(FleetError, match=r"rank 1 made no progress for 6 s") as info:
            client.run("count", {"steps": 5, "hang_rank": 1, "hang_step": 2})
        assert info.value.rank == 1
        assert client.run("count", {"steps": 2}).fields["total"] == 6


def test_unknown_job_and_bad_arguments_are_refused_without_touching_the_fleet(fleet):
    with connect(fleet) as client:
        restarts = client.status()["fleet_restarts"]
        with pytest.raises(FleetError, match="unknown job type 'nope'"):
            client.run("nope")
        with pytest.raises(FleetError, match="steps must be an integer") as info:
            client.run("count", {"steps": "many"})
        assert info.value.kind == "input_error"
        assert client.status()["fleet_restarts"] == restarts


def _raw_connection(socket_path):
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(socket_path))
    sock.settimeout(10)
    return sock


def _handshake(sock, socket_path, token=None):
    return fleet_harness.raw_handshake(sock, token if token is not None else fleet_harness.token_of(socket_path))


def test_malformed_oversized_and_unauthenticated_frames_are_rejected_while_others_are_served(fleet):
    with connect(fleet) as good:
        good.run("count", {"steps": 1})

        sock = _raw_connection(fleet)
        assert _handshake(sock, fleet, token="0" * 64).fields["message"] == "authentication failed: wrong token"
        sock.close()

        sock = _raw_connection(fleet)
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 32)
        reply = protocol.recv_message(sock)
        assert reply.type == "error" and "bad magic" in reply.fields["message"]
        sock.close()

        sock = _raw_connection(fleet)
        assert _handshake(sock, fleet).type == "welcome"
        sock.sendall(protocol.PREFIX.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, 10, 1 << 40))
        reply = protocol.recv_message(sock)
        assert reply.type == "error" and "exceeds" in reply.fields["message"]
        sock.close()

        sock = _raw_connection(fleet)
        assert _handshake(sock, fleet).type == "welcome"
        header = b'{"type":"submit","fields":{},"tensors":[{"name":"x","dtype":"float32","shape":[4],"nbytes":3}]}'
        sock.sendall(protocol.PREFIX.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, len(header), 3) + header + b"abc")
        reply = protocol.recv_message(sock)
        assert reply.type == "error" and "does not match shape" in reply.fields["message"]
        sock.close()

        sock = _raw_connection(fleet)
        header = b"{not json"
        sock.sendall(protocol.PREFIX.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, len(header), 0) + header)
        assert "not valid JSON" in protocol.recv_message(sock).fields["message"]
        sock.close()

        # The well-behaved client never noticed.
        assert good.run("count", {"steps": 2}).fields["total"] == 6


def test_socket_is_0600_in_a_0700_directory_with_a_0600_token(fleet):
    assert stat.S_IMODE(os.stat(fleet).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(fleet.parent).st_mode) == 0o700
    token = fleet.parent / (fleet.name + ".token")
    assert stat.S_IMODE(os.stat(token).st_mode) == 0o600


def test_several_clients_are_served_first_in_first_out(fleet):
    order = []

    def submit(name, steps):
        with connect(fleet) as client:
            client.run("count", {"steps": steps, "seconds_per_step": 0.02})
            order.append(name)

    first = threading.Thread(target=submit, args=("first", 15))
    first.start()
    with connect(fleet) as observer:
        wait_until(lambda: observer.status()["current_job"] is not None, what="the first job running")
    second = threading.Thread(target=submit, args=("second", 1))
    second.start()
    first.join(60)
    second.join(60)
    assert order == ["first", "second"]


def _segments_of(*pids: int) -> set[str]:
    """Segments made by ``pids``: other test runs on this machine make their own."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(tuple(f"mgpu-{os.getuid()}-{pid}-" for pid in pids))}


def test_large_result_goes_through_shared_memory_and_is_unlinked(fleet):
    big = torch.arange(20 * 2**20, dtype=torch.float32)  # 80 MB: above the shared-memory threshold
    with connect(fleet) as client:
        server_pid = client.status()["server_pid"]
        before = _segments_of(server_pid, os.getpid())
        result = client.run("echo", {}, {"big": big})
    assert torch.equal(result.tensors["big"], big)
    assert _segments_of(server_pid, os.getpid()) - before == set()


def test_shared_memory_segment_is_unlinked_when_the_client_dies_before_reading(fleet, tmp_path):
    with connect(fleet) as client:
        server_pid = client.status()["server_pid"]
    before = _segments_of(server_pid)
    script = textwrap.dedent(
        f"""
        import os, torch
        from mgpu_backend.fleet import protocol
        from mgpu_backend.fleet.client import FleetClient
        client = FleetClient.connect({str(fleet)!r}, autostart=False)
        big = torch.ones(20 * 2**20)
        protocol.send_message(client.sock, protocol.Message("submit", {{"op": "echo", "args": {{}}}}, {{"big": big}}))
        while protocol.recv_message(client.sock).type != "result":
            pass
        os._exit(0)  # dies with the result unread: the segment named in it must not leak
        """
    )
    subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True, timeout=120)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        leftover = _segments_of(server_pid) - before
        if not leftover:
            break
        time.sleep(0.2)
    assert leftover == set()


def test_server_started_by_a_client_dies_with_it_and_takes_its_ranks(tmp_path):
    socket_path = tmp_path / "auto.sock"
    tmp_path.chmod(0o700)
    script = textwrap.dedent(
        f"""
        import json, sys, time
        from mgpu_backend.fleet.client import FleetClient
        client = FleetClient.connect({str(socket_path)!r}, cpu_ranks=2)
        status = client.status()
        print(json.dumps([status["server_pid"]] + [rank["pid"] for rank in status["ranks"]]), flush=True)
        time.sleep(600)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MGPU_SOCKET", None)
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = launcher.stdout.readline()
        pids = [int(pid) for pid in line.strip("[]\n").split(",")]
        assert len(pids) == 3
        wait_for_server(socket_path)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert wait_gone(pids) == [], "server or ranks outlived the client that launched them"
        assert not socket_path.exists()
    finally:
        launcher.kill()


def test_idle_timeout_ends_server_and_ranks(tmp_path):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "idle.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "2")
    try:
        with connect(socket_path) as client:
            rank_pids = [rank["pid"] for rank in client.status()["ranks"]]
        assert process.wait(timeout=30) == 0
        assert wait_gone(rank_pids) == []
    finally:
        stop_server(process)


def test_an_idle_connection_seems_connected_until_its_server_stops(tmp_path):
    # What the drop-in MODEL checks before every denoiser call instead of a status round trip.
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "alive.sock"
    process = start_server(socket_path, 1)
    try:
        with connect(socket_path) as client:
            assert client.seems_connected()
            client.status()
            assert client.seems_connected()  # a finished request leaves nothing waiting
            stop_server(process)
            wait_until(lambda: not client.seems_connected(), timeout=10, what="the stopped server seen on the socket")
            client.close()
            assert not client.seems_connected()
    finally:
        stop_server(process)


def test_protocol_rejects_a_header_that_lies_about_tensor_sizes():
    header = {"type": "x", "tensors": [{"name": "t", "dtype": "float32", "shape": [2, 2], "nbytes": 16}]}
    parsed, descriptors = protocol.parse_header(__import__("json").dumps(header).encode())
    assert descriptors[0][3] == 16
    for bad in (
        {"name": "t", "dtype": "object", "shape": [1], "nbytes": 8},
        {"name": "t", "dtype": "float32", "shape": [-1], "nbytes": 4},
        {"name": "t", "dtype": "float32", "shape": [2, 2], "nbytes": 15},
        {"name": "", "dtype": "float32", "shape": [1], "nbytes": 4},
    ):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_header(__import__("json").dumps({"type": "x", "tensors": [bad]}).encode())
    assert struct.calcsize(">4sHxxIQ") == protocol.PREFIX.size


def test_tcp_loopback_fallback_serves_with_the_token_and_refuses_without(tmp_path, monkeypatch):
    with fleet_harness.tcp_fleet(tmp_path, monkeypatch) as (address, port, runtime):
        with FleetClient.connect(address, autostart=False) as client:
            assert client.run("echo", {}, {"x": torch.arange(4)}).tensors["x"].tolist() == [0, 1, 2, 3]
        token_file = runtime / "comfyui-mgpu" / f"tcp-{port}.token"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        assert fleet_harness.raw_handshake(sock, "wrong").fields["message"] == "authentication failed: wrong token"
        sock.close()


def test_gpu_indices_are_taken_within_an_inherited_cuda_visible_devices():
    from mgpu_backend.fleet.controller import DeviceSpec

    assert DeviceSpec(gpus=(0, 1)).visible_device_ids({}) == ["0", "1"]
    assert DeviceSpec(gpus=(0, 1)).visible_device_ids({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert DeviceSpec(gpus=(1,)).visible_device_ids({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}) == ["GPU-bb"]
    with pytest.raises(ValueError, match="GPU index 2 is not visible: CUDA_VISIBLE_DEVICES=5,6"):
        DeviceSpec(gpus=(2,)).visible_device_ids({"CUDA_VISIBLE_DEVICES": "5,6"})


def test_an_input_segment_that_cannot_be_mapped_fails_only_that_job(fleet):
    with connect(fleet) as client:
        restarts = client.status()["fleet_restarts"]
        descriptor = {"name": "x", "dtype": "float32", "shape": [4], "nbytes": 16, "segment": f"mgpu-{os.getuid()}-{os.getpid()}-{'0' * 16}"}
        protocol.send_message(client.sock, protocol.Message("submit", {"op": "echo", "args": {}}, shm=[descriptor]))
        while (reply := protocol.recv_message(client.sock)).type == "accepted":
            pass
        assert reply.type == "error" and reply.fields["kind"] == "input_error"
        assert "cannot read input segment" in reply.fields["message"]
        assert client.status()["fleet_restarts"] == restarts
        assert client.run("count", {"steps": 2}).fields["total"] == 6


def test_an_input_handed_back_unchanged_reaches_the_client_by_reference_and_is_unlinked(fleet):
    big = torch.randn(3 * 2**20)  # 12 MB: travels through shared memory
    with connect(fleet) as client:
        server_pid = client.status()["server_pid"]
        before = _segments_of(server_pid, os.getpid())
        handed_back = client.run("echo", {}, {"big": big})
        copied = client.run("echo", {"copy": True}, {"big": big})
    assert torch.equal(handed_back.tensors["big"], big) and torch.equal(copied.tensors["big"], big)
    assert _segments_of(server_pid, os.getpid()) - before == set()
