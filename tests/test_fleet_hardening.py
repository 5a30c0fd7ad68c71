"""The fleet server against hostile and broken clients: real server processes, real sockets, real
shared-memory segments, gloo CPU ranks. Each test states what one client does and checks that the
server still serves the others, frees what that client held, and tells the client what went wrong."""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from mgpu_backend.fleet import protocol, server, shm
from mgpu_backend.fleet.addresses import Address, ensure_private_dir, write_token
from mgpu_backend.fleet.client import FleetClient, FleetError, FleetUnavailable
from mgpu_backend.fleet.protocol import Message

from . import fleet_harness
from .fleet_harness import REPO, raw_handshake, start_server, token_of
from .helpers import next_of, ranks_of, segments_of, submit, wait_until


@pytest.fixture(scope="module")
def fleet(fleet_of):
    return fleet_of(1)


def connect(socket_path) -> FleetClient:
    return FleetClient.connect(str(socket_path), autostart=False)


def raw(socket_path, authenticate: bool = True) -> socket.socket:
    """A socket to the server, past the handshake unless told otherwise."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(60)
    sock.connect(str(socket_path))
    if authenticate:
        assert raw_handshake(sock, token_of(socket_path)).type == "welcome"
    return sock


def frame(header: bytes, payload: bytes = b"") -> bytes:
    return protocol.PREFIX.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, len(header), len(payload)) + header + payload


def submit_header(nbytes: int) -> bytes:
    """The header of an echo submit with one inline uint8 tensor of ``nbytes``."""
    tensor = {"name": "x", "dtype": "uint8", "shape": [nbytes], "nbytes": nbytes}
    return json.dumps({"type": "submit", "fields": {"op": "echo"}, "tensors": [tensor]}).encode()


def reply_then_closed(sock) -> Message:
    """The server's error reply, after which it closed this connection."""
    reply = protocol.recv_message(sock)
    with pytest.raises((protocol.ConnectionClosed, ConnectionResetError)):
        while True:
            protocol.recv_message(sock)
    sock.close()
    return reply


def start_wrapped_server(tmp_path, *wrapper: str):
    """A server with one CPU rank, started through ``wrapper`` (a resource limit, a mount
    namespace), which its rank inherits."""
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "wrapped.sock"
    serve = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", str(socket_path), "--cpu-ranks", "1", "--idle-timeout", "0"]
    log = open(tmp_path / "server.log", "ab")  # noqa: SIM115 - handed to the server
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([*wrapper, *serve], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    fleet_harness.wait_for_server(socket_path, process)
    return socket_path, process


# A private mount namespace whose /dev/shm is a 3 MiB tmpfs: a nearly full /dev/shm for the
# server and its ranks only. The server's segments are then seen through /proc/<pid>/root.
SMALL_SHM = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount -t tmpfs -o size=3m tmpfs /dev/shm && exec "$@"', "sh"]


def _can_mount_a_small_shm() -> bool:
    try:
        return subprocess.run([*SMALL_SHM, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# -- availability -----------------------------------------------------------------------------------
def test_a_submit_naming_an_invalid_segment_is_refused_and_later_jobs_still_run(fleet):
    sock = raw(fleet)
    for name in ("../x", "mgpu-0-1-zz", "/etc/passwd"):
        submit(sock, "echo", shm_descriptors=[{"name": "x", "dtype": "float32", "shape": [4], "nbytes": 16, "segment": name}])
        reply = next_of(sock, "error", "accepted")
        assert reply.type == "error" and reply.fields["kind"] == "input_error"
        assert f"invalid shared-memory segment name {name!r}" in reply.fields["message"]
    sock.close()
    with connect(fleet) as client:
        assert client.run("count", {"steps": 2}).fields["total"] == 2
        assert client.status()["current_job"] is None


def test_the_accept_loop_waits_out_running_out_of_file_descriptors(tmp_path):
    socket_path, process = start_wrapped_server(tmp_path, "prlimit", "--nofile=20")  # fewer than the handshakes it lets wait
    sockets = []
    try:
        def accept_failed() -> bool:
            return "accept failed" in (tmp_path / "server.log").read_text()

        deadline = time.monotonic() + 60
        while len(sockets) < 80 and not accept_failed():
            assert time.monotonic() < deadline, f"the server accepted {len(sockets)} connections without running out"
            sock = socket.socket(socket.AF_UNIX)
            sock.settimeout(0.5)
            try:
                sock.connect(str(socket_path))
                sockets.append(sock)
            except OSError:  # the backlog is full: the server is behind, or has no descriptor left
                sock.close()
                time.sleep(0.05)
        for sock in sockets:
            sock.close()
        sockets.clear()
        # Served again once descriptors are free: the unauthenticated ones time out of their handshake.
        deadline = time.monotonic() + 60
        while True:
            try:
                with connect(socket_path) as client:
                    assert client.run("echo", {"again": 1}).fields["fields"] == {"again": 1}
                break
            except FleetUnavailable:
                assert time.monotonic() < deadline and process.poll() is None, "the server never answered again"
                time.sleep(0.5)
        assert "Too many open files" in (tmp_path / "server.log").read_text()
    finally:
        for sock in sockets:
            sock.close()
        fleet_harness.stop_server(process)


def test_a_client_that_stops_reading_is_dropped_and_the_next_client_is_served(tmp_path):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "outbox.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "0", env={"MGPU_OUTBOX_BYTES": str(64 << 10)})
    try:
        silent = raw(socket_path)
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        submit(silent, "count", {"steps": 100_000})
        with connect(socket_path) as other:
            # Queued behind the silent client's long job: it runs once that client is dropped.
            assert other.run("count", {"steps": 3}).fields["total"] == 3
            wait_until(lambda: other.status()["jobs_completed"] == 2, what="both jobs done")
            assert other.status()["current_job"] is None
        events = 0
        with pytest.raises((protocol.ConnectionClosed, ConnectionResetError)):
            while True:  # what was already on its way, then the end of the connection
                message = protocol.recv_message(silent)
                events += message.type == "progress"
        assert events < 100_000
        silent.close()
        assert "stopped reading" in (tmp_path / "server.log").read_text()
    finally:
        fleet_harness.stop_server(process)


# -- crashes and leaks --------------------------------------------------------------------------------
def test_a_zero_byte_shape_that_would_overflow_strides_is_refused(fleet):
    huge = [0, 2**39, 2**39, 2**39]
    descriptor = {"name": "x", "dtype": "float32", "shape": huge, "nbytes": 0}
    with pytest.raises(protocol.ProtocolError, match="shape sizes must be integers from 0 to"):
        protocol.validate_descriptor(descriptor)
    with pytest.raises(protocol.ProtocolError, match="more than"):
        protocol.validate_descriptor({**descriptor, "shape": [0, 2**30, 2**30]})
    assert protocol.validate_descriptor({**descriptor, "shape": [0, 2**20, 4]})[2] == (0, 2**20, 4)
    # Through the server, a zero-byte segment with that shape: an error reply, and the fleet serves on.
    segment = f"mgpu-{os.getuid()}-{os.getpid()}-{secrets.token_hex(8)}"
    (shm.SHM_DIR / segment).touch(mode=0o600)
    try:
        sock = raw(fleet)
        submit(sock, "echo", shm_descriptors=[{**descriptor, "segment": segment}])
        reply = reply_then_closed(sock)
        assert reply.type == "error" and "shape sizes must be integers" in reply.fields["message"]
    finally:
        (shm.SHM_DIR / segment).unlink(missing_ok=True)
    with connect(fleet) as client:
        assert client.run("count", {"steps": 1}).fields["total"] == 1


def _no_room(fd, offset, length):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_dev_shm_is_a_clear_error_and_leaves_no_segment(monkeypatch, fleet):
    before = segments_of(os.getpid())
    monkeypatch.setattr(os, "posix_fallocate", _no_room)
    with pytest.raises(shm.SharedMemoryFull, match=r"/dev/shm has no room for a 8\.0 MiB shared-memory segment .*MiB free"):
        shm.create_tensor("frames", (2, 2**20), torch.float32)
    with pytest.raises(shm.SharedMemoryFull, match="enlarge it"):
        shm.write_tensor("x", torch.zeros(2**20))
    with connect(fleet) as client:  # a client's large input: the same message, before anything is sent
        with pytest.raises(FleetError, match=r"/dev/shm has no room for a 4\.0 MiB") as info:
            client.run("echo", {}, {"small": torch.ones(4), "big": torch.ones(2**20)})
        assert info.value.kind == "input_error"
        assert segments_of(os.getpid()) == before
        monkeypatch.undo()
        assert torch.equal(client.run("echo", {}, {"big": torch.ones(2**20)}).tensors["big"], torch.ones(2**20))
    assert segments_of(os.getpid()) == before


@pytest.mark.skipif(not _can_mount_a_small_shm(), reason="needs 'unshare --mount' and a tmpfs mount (root or user namespaces)")
def test_a_result_beyond_a_nearly_full_dev_shm_fails_its_job_and_the_rank_survives(tmp_path):
    # Written through a sparse mapping, the 4 MiB result would kill the rank with SIGBUS at 3 MiB.
    socket_path, process = start_wrapped_server(tmp_path, *SMALL_SHM)
    try:
        with connect(socket_path) as client:
            status = client.status()
            rank_pid, private_shm = status["ranks"][0]["pid"], f"/proc/{status['server_pid']}/root/dev/shm"
            with pytest.raises(FleetError, match=r"/dev/shm has no room for a 4\.0 MiB shared-memory segment \(3\.0 MiB free\)"):
                client.run("fill", {"numel": 2**20})
            status = client.status()
            assert status["ranks"][0]["pid"] == rank_pid and status["fleet_restarts"] == 0
            assert [name for name in os.listdir(private_shm) if name.startswith("mgpu-")] == []
            assert client.run("count", {"steps": 2}).fields["total"] == 2  # (a result segment would be unreadable out here)
    finally:
        fleet_harness.stop_server(process)


def test_a_result_beyond_the_file_size_limit_fails_its_job_and_the_fleet_serves_on(tmp_path):
    # A 2 MiB file-size limit (ulimit -f): the rank's reservation of a 4 MiB result fails up front,
    # by the same path as a full /dev/shm, and says which limit to raise.
    socket_path, process = start_wrapped_server(tmp_path, "prlimit", f"--fsize={2 << 20}")
    try:
        with connect(socket_path) as client:
            rank_pid = client.status()["ranks"][0]["pid"]
            with pytest.raises(FleetError, match=r"SharedMemoryFull: .*forbids a 4\.0 MiB shared-memory segment in /dev/shm"):
                client.run("fill", {"numel": 2**20})
            status = client.status()
            assert status["ranks"][0]["pid"] == rank_pid and status["fleet_restarts"] == 0
            assert segments_of(status["server_pid"]) == set()
            assert client.run("fill", {"numel": 1000}).tensors["values"].sum().item() == 1000
    finally:
        fleet_harness.stop_server(process)


def test_refused_submits_unlink_their_input_segments(fleet):
    with connect(fleet) as client:
        server_pid = client.status()["server_pid"]
    sock = raw(fleet)
    refusals = {"unknown job type 'nope'": ("nope", {}), "submit needs an 'op' string": (7, {})}
    for expected, (op, args) in refusals.items():
        descriptor = shm.write_tensor("big", torch.ones(2**20))
        protocol.send_message(sock, Message("submit", {"op": op, "args": args, "ref": 1}, shm=[descriptor]))
        reply = next_of(sock, "error", "accepted")
        assert reply.type == "error" and expected in reply.fields["message"]
        assert not (shm.SHM_DIR / descriptor["segment"]).exists(), expected
    sock.close()
    assert segments_of(os.getpid(), server_pid) == set()


def test_a_clean_shutdown_unlinks_queued_inputs_and_unread_results(tmp_path):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "stop.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "0")
    try:
        with connect(socket_path) as client:
            server_pid = client.status()["server_pid"]
        sock = raw(socket_path)
        submit(sock, "echo", {"copy": True}, {"big": torch.ones(2**20 + 1)}, ref=1)  # a result segment, never read
        unread = next_of(sock, "result")
        assert unread.shm and (shm.SHM_DIR / unread.shm[0]["segment"]).exists()
        submit(sock, "count", {"steps": 100_000, "seconds_per_step": 0.01}, ref=2)
        queued_input = shm.write_tensor("big", torch.ones(2**20))
        submit(sock, "echo", shm_descriptors=[queued_input], ref=3)
        assert next_of(sock, "accepted").fields["ref"] == 2
        assert next_of(sock, "accepted").fields["ref"] == 3
        with connect(socket_path) as client:
            client.shutdown()
        assert process.wait(timeout=60) == 0
        assert segments_of(os.getpid(), server_pid) == set()
        # The running job was stopped before its ranks: no rank was started anew while exiting.
        wait_until(lambda: ranks_of(server_pid) == [], what="every rank gone")
        sock.close()
    finally:
        fleet_harness.stop_server(process)


# -- bounds -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_hello_trickled_byte_by_byte_is_cut_off_at_the_handshake_deadline(fleet):
    sock = raw(fleet, authenticate=False)
    hello = frame(json.dumps({"type": "hello", "fields": {"version": protocol.PROTOCOL_VERSION, "nonce": "0" * 64}}).encode())
    sent = 0
    try:
        while sent < len(hello):
            sock.sendall(hello[sent : sent + 1])
            sent += 1
            time.sleep((server.HANDSHAKE_SECONDS * 3) / len(hello))
    except OSError:
        pass  # closed by the server
    reply = reply_then_closed(sock)
    assert reply.type == "error" and "the handshake did not arrive whole in time" in reply.fields["message"]
    assert sent < len(hello), "a trickled hello must never be welcomed"


def test_connections_are_capped_with_a_reply_and_served_again_below_the_cap(fleet):
    sockets, reply = [], None
    try:
        while reply is None and len(sockets) <= server.MAX_CONNECTIONS:
            sock = raw(fleet, authenticate=False)
            try:
                answer = raw_handshake(sock, token_of(fleet))
            except OSError:  # refused and closed before the hello went out: the reply is still there
                answer = protocol.recv_message(sock)
            sockets.append(sock)
            if answer.type != "welcome":
                reply = answer
        # One process reaches its own cap first (see test_fleet_audit for the cap of all processes together).
        text = f"process {os.getpid()} already has {server.MAX_CONNECTIONS_PER_PROCESS} connections open to the fleet server; close unused clients and retry"
        assert reply.fields == {"message": text, "kind": "busy"}
        # This test's connections, plus any an earlier test closed that the server has not yet seen go.
        assert server.MAX_CONNECTIONS_PER_PROCESS - 3 <= len(sockets) - 1 <= server.MAX_CONNECTIONS_PER_PROCESS
    finally:
        for sock in sockets:
            sock.close()
    deadline = time.monotonic() + 30
    while True:
        try:
            with connect(fleet) as client:
                assert client.run("count", {"steps": 1}).fields["total"] == 1
            break
        except FleetUnavailable:  # the server has not seen every close yet
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_one_client_cannot_fill_the_queue(fleet):
    sock = raw(fleet)
    for ref in range(1, server.MAX_JOBS_PER_CLIENT + 1):
        submit(sock, "count", {"steps": 100_000, "seconds_per_step": 0.01}, ref=ref)
        assert next_of(sock, "accepted", "error").type == "accepted"
    submit(sock, "count", {"steps": 1}, ref=99)
    reply = next_of(sock, "error", "accepted")
    assert reply.type == "error" and reply.fields["kind"] == "busy" and reply.fields["ref"] == 99
    assert f"this client already has {server.MAX_JOBS_PER_CLIENT} jobs queued or running" in reply.fields["message"]
    with connect(fleet) as other:
        wait_until(lambda: other.status()["queue_length"] == server.MAX_JOBS_PER_CLIENT - 1, what="the first job running")
        assert other.status()["queued_mine"] == []
    sock.close()  # cancels all of them
    with connect(fleet) as other:
        assert other.run("count", {"steps": 2}).fields["total"] == 2
        assert other.status()["queue_length"] == 0


def test_a_declared_gigabyte_reserves_nothing_until_it_arrives(fleet):
    with connect(fleet) as client:
        server_pid = client.status()["server_pid"]
    sock = raw(fleet)
    before = rss_bytes(server_pid)
    header = submit_header(1 << 30)
    sock.sendall(protocol.PREFIX.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, len(header), 1 << 30) + header)
    # 64 MiB sent: more than the socket buffers hold, so the server has read most of it by now.
    sock.sendall(b"\0" * (64 << 20))
    assert rss_bytes(server_pid) - before < 256 << 20  # what arrived, not the 1 GiB declared
    sock.close()
    with connect(fleet) as client:
        assert client.run("count", {"steps": 1}).fields["total"] == 1


def test_frames_being_read_share_one_byte_budget_and_return_it():
    budget = protocol.ByteBudget(64 << 10)
    sender, receiver = socket.socketpair()
    with sender, receiver:
        payload = torch.arange(8 << 10, dtype=torch.int32)  # 32 KiB
        protocol.send_message(sender, Message("submit", {"op": "echo"}, {"x": payload}))
        message = protocol.recv_untrusted(receiver, budget=budget)
        assert torch.equal(message.tensors["x"], payload) and budget.used == 0
        assert budget.take(48 << 10)  # another connection's frame, half read
        protocol.send_message(sender, Message("submit", {"op": "echo"}, {"x": payload}))
        with pytest.raises(protocol.ProtocolError, match="the server is already reading 0.0 GiB of frames; retry later"):
            protocol.recv_untrusted(receiver, budget=budget)
        assert budget.used == 48 << 10  # the refused frame gave back what it took


@pytest.mark.slow
def test_a_frame_stalled_half_way_gets_an_error_at_its_deadline(fleet):
    sock = raw(fleet)
    header = submit_header(4096)
    sock.sendall(frame(header, b"\0" * 4096)[:-2048])
    reply = reply_then_closed(sock)
    assert reply.type == "error" and "a frame did not arrive whole in time" in reply.fields["message"]


# -- isolation ----------------------------------------------------------------------------------------
def test_a_client_cannot_name_another_clients_result_segment_or_a_servers(fleet):
    owner = raw(fleet)
    submit(owner, "echo", {"copy": True}, {"big": torch.arange(2**20 + 1, dtype=torch.float32)})
    result = next_of(owner, "result")
    segment = result.shm[0]["segment"]
    with connect(fleet) as thief:
        server_pid = thief.status()["server_pid"]
        assert segment.startswith(f"mgpu-{os.getuid()}-{server_pid}-")
        protocol.send_message(thief.sock, Message("submit", {"op": "echo", "args": {}, "ref": 1}, shm=[result.shm[0]]))
        reply = next_of(thief.sock, "error", "accepted")
        assert reply.type == "error" and f"shared-memory segment {segment} is not yours to name" in reply.fields["message"]
    assert (shm.SHM_DIR / segment).exists(), "the refused submit must leave the owner's result alone"
    tensor = shm.read_tensor(result.shm[0])
    assert torch.equal(tensor, torch.arange(2**20 + 1, dtype=torch.float32))
    protocol.send_message(owner, Message("ack", job=result.job))
    # A waiting job's input is the server's copy from the moment the job is accepted: the client's
    # segment is gone, and the copy is not another connection's to name.
    submit(owner, "count", {"steps": 100_000, "seconds_per_step": 0.01}, ref=2)
    held = shm.write_tensor("big", torch.ones(2**20))
    before = segments_of(server_pid)
    submit(owner, "echo", shm_descriptors=[held], ref=3)
    assert next_of(owner, "accepted").fields["ref"] == 2 and next_of(owner, "accepted").fields["ref"] == 3
    assert not (shm.SHM_DIR / held["segment"]).exists()
    (copy,) = segments_of(server_pid) - before
    with connect(fleet) as thief:
        protocol.send_message(thief.sock, Message("submit", {"op": "echo", "args": {}, "ref": 1}, shm=[{**held, "segment": copy}]))
        reply = next_of(thief.sock, "error", "accepted")
        assert reply.type == "error" and f"shared-memory segment {copy} is not yours to name" in reply.fields["message"]
    assert (shm.SHM_DIR / copy).exists()
    owner.close()  # cancels both jobs; the waiting one's copy is unlinked with it
    wait_until(lambda: not (shm.SHM_DIR / copy).exists(), what="the cancelled job's input unlinked")


def test_a_client_sees_and_cancels_only_its_own_jobs(fleet):
    owner = raw(fleet)
    submit(owner, "count", {"steps": 100_000, "seconds_per_step": 0.01})
    job_id = next_of(owner, "accepted").job
    next_of(owner, "progress")
    with connect(fleet) as other:
        current = other.status()["current_job"]
        assert current["id"] is None and current["mine"] is False and current["op"] == "count"
        protocol.send_message(other.sock, Message("cancel", job=job_id))
        step_after_cancel = other.status()["current_job"]["step"]  # frames are handled in order: the cancel was seen
    # A cancel stops the job at its next step; this one runs on well past that.
    while (event := next_of(owner, "progress", "error")).type == "progress" and event.fields["step"] < step_after_cancel + 5:
        pass
    assert event.type == "progress", event.fields
    protocol.send_message(owner, Message("cancel", job=job_id))  # its own client can
    error = next_of(owner, "error")
    assert error.job == job_id and error.fields["kind"] == "cancelled"
    owner.close()


# -- the handshake --------------------------------------------------------------------------------------
def test_a_squatter_on_the_tcp_port_never_receives_the_token_or_a_job(tmp_path, monkeypatch):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    address = Address.parse(f"tcp://127.0.0.1:{squatter.getsockname()[1]}")
    ensure_private_dir(address.directory)
    token = write_token(address.token_path)  # left behind by a fleet server that crashed
    heard = bytearray()

    def impostor():
        conn, _ = squatter.accept()
        conn.settimeout(10)
        hello = protocol.recv_message(conn)
        heard.extend(json.dumps(hello.fields).encode())
        protocol.send_message(conn, Message("challenge", {"nonce": secrets.token_hex(32), "proof": secrets.token_hex(32)}))
        try:
            while chunk := conn.recv(65536):
                heard.extend(chunk)
        except OSError:
            pass
        conn.close()

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(FleetUnavailable, match="cannot prove it holds this fleet's token, so it is not your fleet server"):
        FleetClient.connect(str(address), autostart=False)
    thread.join(timeout=30)
    squatter.close()
    assert heard and token.encode() not in heard
    assert b'"auth"' not in heard and b"submit" not in heard


def test_the_token_never_crosses_the_socket(fleet):
    sock = raw(fleet, authenticate=False)
    nonce = secrets.token_hex(32)
    protocol.send_message(sock, Message("hello", {"version": protocol.PROTOCOL_VERSION, "nonce": nonce}))
    challenge = protocol.recv_message(sock)
    token = token_of(fleet)
    assert challenge.type == "challenge" and token not in json.dumps(challenge.fields)
    assert challenge.fields["proof"] == protocol.handshake_proof(token, "server", nonce, challenge.fields["nonce"])
    # The server's proof replayed as the client's is refused: the role is part of what is signed.
    protocol.send_message(sock, Message("auth", {"proof": challenge.fields["proof"]}))
    assert reply_then_closed(sock).fields["message"] == "authentication failed: wrong token"


# -- errors ---------------------------------------------------------------------------------------------
MALFORMED_HEADERS = {
    "lone surrogate in the token": b'{"type":"hello","fields":{"version":2,"nonce":"\\ud800"}}',
    "huge integer literal": b'{"type":"hello","fields":{"version":' + b"9" * 5000 + b"}}",
    "deep nesting": b'{"type":"hello","fields":{"v":' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
    "non-ASCII proof": None,  # sent as the auth after a valid hello, below
    "NaN": b'{"type":"hello","fields":{"version":NaN}}',
    "fields not an object": b'{"type":"hello","fields":[1]}',
    "unhashable dtype": b'{"type":"hello","fields":{},"tensors":[{"name":"x","dtype":[],"shape":[1],"nbytes":4}]}',
}


@pytest.mark.parametrize("case", sorted(MALFORMED_HEADERS))
def test_every_malformed_frame_gets_an_error_reply_then_only_its_connection_closes(fleet, case):
    with connect(fleet) as good:
        sock = raw(fleet, authenticate=False)
        if MALFORMED_HEADERS[case] is None:
            protocol.send_message(sock, Message("hello", {"version": protocol.PROTOCOL_VERSION, "nonce": secrets.token_hex(32)}))
            assert protocol.recv_message(sock).type == "challenge"
            sock.sendall(frame(json.dumps({"type": "auth", "fields": {"proof": "é" * 64}}).encode()))
        else:
            sock.sendall(frame(MALFORMED_HEADERS[case]))
        reply = reply_then_closed(sock)
        assert reply.type == "error" and reply.fields["message"], case
        assert "could not handle a frame" not in reply.fields["message"], f"{case}: not diagnosed: {reply.fields['message']}"
        # After the handshake too: the same frame as a request.
        if MALFORMED_HEADERS[case] is not None:
            sock = raw(fleet)
            sock.sendall(frame(MALFORMED_HEADERS[case].replace(b'"hello"', b'"submit"')))
            assert reply_then_closed(sock).type == "error", case
        assert good.run("count", {"steps": 1}).fields["total"] == 1


def test_a_raising_progress_callback_leaves_the_connection_clean_for_the_next_call(fleet):
    def explode(event):
        raise RuntimeError("callback failed")

    with connect(fleet) as client:
        with pytest.raises(RuntimeError, match="callback failed"):
            client.run("count", {"steps": 50, "seconds_per_step": 0.02}, on_progress=explode)
        assert "server_pid" in client.status()  # the status, not a stale progress event of that job
        assert client.run("echo", {"call": "next"}).fields["fields"] == {"call": "next"}
        assert client.status()["current_job"] is None


def test_a_server_that_dies_mid_job_is_a_readable_fleet_unavailable(tmp_path):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "dies.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "0")
    try:
        with connect(socket_path) as client:
            ranks = [rank["pid"] for rank in client.status()["ranks"]]

            def kill_server(event):
                if event["step"] == 2:
                    process.kill()

            before = segments_of(os.getpid())
            died = rf"^the fleet server at {re.escape(str(socket_path))} \(pid {process.pid}\) died \(.*\); its log: {re.escape(str(tmp_path / 'server.log'))}\. Run again"
            with pytest.raises(FleetUnavailable, match=died):
                client.run("count", {"steps": 1000, "seconds_per_step": 0.02}, {"big": torch.ones(2**20)}, on_progress=kill_server)
            assert segments_of(os.getpid()) == before, "the input segment a dead server cannot unlink is the client's to remove"
            with pytest.raises(FleetUnavailable, match=died):
                client.status()
        assert fleet_harness.wait_gone(ranks) == []
    finally:
        fleet_harness.stop_server(process)


@pytest.mark.parametrize("where", ["unwritable", "too long"])
def test_serve_on_a_socket_path_it_cannot_use_says_so_without_a_traceback(tmp_path, where):
    tmp_path.chmod(0o700)
    bad_socket = "/proc/no-such-dir/fleet.sock" if where == "unwritable" else str(tmp_path / ("x" * 120 + ".sock"))
    command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", bad_socket, "--cpu-ranks", "1"]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"error: cannot listen on {bad_socket}" in done.stderr and "choose another --socket path" in done.stderr
    assert "Traceback" not in done.stderr


def test_over_tcp_the_handshake_bounds_and_isolation_hold_too(tmp_path, monkeypatch):
    with fleet_harness.tcp_fleet(tmp_path, monkeypatch) as (address, port, _):
        token = Address.parse(address).token_path.read_text()

        def tcp(authenticate: bool = True) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=60)
            if authenticate:
                assert raw_handshake(sock, token).type == "welcome"
            return sock

        assert raw_handshake(tcp(False), "0" * 64).fields["message"] == "authentication failed: wrong token"
        malformed = tcp()
        malformed.sendall(frame(b'{"type":"submit","fields":{"n":' + b"1" * 5000 + b"}}"))
        assert "not valid JSON" in reply_then_closed(malformed).fields["message"]
        # No peer pid over TCP: another connection's result is still not its to name.
        owner = tcp()
        submit(owner, "echo", {"copy": True}, {"big": torch.ones(2**20 + 1)})
        result = next_of(owner, "result")
        with FleetClient.connect(address, autostart=False) as thief:
            protocol.send_message(thief.sock, Message("submit", {"op": "echo", "args": {}, "ref": 1}, shm=[result.shm[0]]))
            reply = next_of(thief.sock, "error", "accepted")
            assert reply.type == "error" and "is not yours to name" in reply.fields["message"]
            owner.close()  # its unread result is unlinked with it
            wait_until(lambda: not (shm.SHM_DIR / result.shm[0]["segment"]).exists(), what="the result unlinked")
            assert thief.run("count", {"steps": 2}).fields["total"] == 2
