"""The fleet against what an adversarial review tried: segments that are not files or change under
the ranks, clients that leave or cancel with jobs queued, a launching process that dies while
another client's job runs, connection floods with and without the token, unread results, self-test
jobs with extreme arguments, and servers killed or stopped at awkward moments. Real server
processes, real sockets and segments, gloo CPU ranks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from mgpu_backend.fleet import protocol, selftest_jobs, server, shm
from mgpu_backend.fleet.client import FleetCancelled, FleetClient, FleetError
from mgpu_backend.fleet.protocol import Message

from . import fleet_harness
from .fleet_harness import REPO, raw_handshake, start_server, stop_server, token_of, wait_gone
from .helpers import next_of, ranks_of, segments_of, submit, wait_until

UNACKNOWLEDGED_BYTES = 6 << 20


@pytest.fixture(scope="module")
def fleet(fleet_of):
    """Two CPU ranks; their rendezvous files under the fleet's own TMPDIR; 6 MiB of unread results per client."""
    return fleet_of(2, env={"MGPU_UNACKNOWLEDGED_BYTES": str(UNACKNOWLEDGED_BYTES)}, own_tmpdir=True)


def connect(socket_path) -> FleetClient:
    return FleetClient.connect(str(socket_path), autostart=False)


def raw(socket_path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(60)
    sock.connect(str(socket_path))
    assert raw_handshake(sock, token_of(socket_path)).type == "welcome"
    return sock


def rank_pids(client) -> list[int]:
    return [rank["pid"] for rank in client.status()["ranks"]]


def own_segment_name() -> str:
    return f"mgpu-{os.getuid()}-{os.getpid()}-{os.urandom(8).hex()}"


def descriptor_for(segment: str, nbytes: int = 16) -> dict:
    return {"name": "x", "dtype": "uint8", "shape": [nbytes], "nbytes": nbytes, "segment": segment}


class LongJob:
    """Another client's job that runs until ``stop()`` (a cancel), in a thread of its own."""

    def __init__(self, socket_path) -> None:
        self.socket_path = socket_path
        self.client = connect(socket_path)
        self.started, self.stop_requested = threading.Event(), threading.Event()
        self.outcome: list = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the long job did not start"

    def _run(self) -> None:
        try:
            self.client.run(
                "count", {"steps": 100_000, "seconds_per_step": 0.01}, on_progress=lambda _: self.started.set(), should_cancel=self.stop_requested.is_set
            )
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
            self.outcome.append(exc)

    def running(self) -> bool:
        """Whether this job is the one the fleet runs now (asked on a connection of its own)."""
        with connect(self.socket_path) as other:
            current = other.status()["current_job"]
        return not self.outcome and current is not None and current["op"] == "count"

    def stop(self) -> None:
        self.stop_requested.set()
        self.thread.join(60)
        self.client.close()
        assert isinstance(self.outcome[0], FleetCancelled), self.outcome


# -- segments that are not plain files, or that change ---------------------------------------------
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_segment_that_is_a_directory_or_fifo_is_an_input_error_at_once(fleet, kind):
    name = own_segment_name()
    path = shm.SHM_DIR / name
    os.mkdir(path) if kind == "directory" else os.mkfifo(path)
    try:
        sock = raw(fleet)
        submit(sock, "echo", shm_descriptors=[descriptor_for(name)])
        reply = next_of(sock, "error", "accepted")  # the socket's 60 s timeout: no reply fails here
        assert reply.type == "error" and reply.fields["kind"] == "input_error"
        assert f"segment {name} is not a regular file" in reply.fields["message"]
        sock.close()
        with connect(fleet) as client:
            assert client.run("count", {"steps": 2}).fields["total"] == 6
    finally:
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


def test_reading_a_fifo_as_a_segment_fails_without_waiting_for_a_writer():
    name = own_segment_name()
    os.mkfifo(shm.SHM_DIR / name)
    outcome: list = []

    def read() -> None:
        try:
            shm.read_tensor(descriptor_for(name))
        except protocol.ProtocolError as exc:
            outcome.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    try:
        assert outcome == [f"segment {name} is not a regular file (a directory, FIFO or device); name a segment made by shm.write_tensor"]
    finally:
        (shm.SHM_DIR / name).unlink(missing_ok=True)


def test_an_input_shortened_by_its_client_after_the_submit_reaches_the_ranks_whole(fleet):
    values = torch.arange(2 * 2**20, dtype=torch.float32)  # 8 MiB: a segment
    descriptor = shm.write_tensor("values", values)
    path = shm.SHM_DIR / descriptor["segment"]
    held = os.open(path, os.O_RDWR)  # what a misbehaving client keeps after the submit
    blocker = LongJob(fleet)
    try:
        with connect(fleet) as client:
            pids = rank_pids(client)
            sock = raw(fleet)
            submit(sock, "echo", {"copy": True}, shm_descriptors=[descriptor])
            assert next_of(sock, "accepted", "error").type == "accepted"
            os.ftruncate(held, 4096)  # queued behind the blocker: the ranks have not opened anything yet
            blocker.stop()
            result = next_of(sock, "result", "error")
            assert result.type == "result", result.fields
            assert torch.equal(shm.read_tensor(result.shm[0]), values)
            protocol.send_message(sock, Message("ack", job=result.job))
            sock.close()
            assert rank_pids(client) == pids
    finally:
        os.close(held)
        shm.unlink_segment(descriptor["segment"])


def test_a_jobs_input_segments_are_unmapped_in_every_rank_when_it_ends(fleet):
    with connect(fleet) as client:
        result = client.run("echo", {"copy": True}, {"big": torch.ones(4 * 2**20)})  # 16 MiB
        assert result.tensors["big"].sum().item() == 4 * 2**20
        for pid in rank_pids(client):
            mapped = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/mgpu-" in line]
            assert mapped == [], f"rank pid {pid} still maps {mapped}"


# -- the queue: clients that leave or cancel ---------------------------------------------------------
def test_a_client_that_leaves_frees_its_queued_jobs_segments_while_another_job_runs(fleet):
    blocker = LongJob(fleet)
    try:
        with connect(fleet) as other:
            server_pid = other.status()["server_pid"]
        before = segments_of(server_pid, os.getpid())
        sock = raw(fleet)
        for ref in (1, 2, 3):
            inputs, shared = shm.split_for_transfer({"big": torch.ones(2**20)})
            submit(sock, "echo", {}, inputs, shared, ref=ref)
            assert next_of(sock, "accepted", "error").type == "accepted"
        sock.close()
        wait_until(lambda: segments_of(server_pid, os.getpid()) == before, timeout=10, what="the queued jobs' segments unlinked")
        assert blocker.running(), "the other client's job still runs"
    finally:
        blocker.stop()


def test_cancelling_a_queued_job_answers_at_once_and_unlinks_its_segments(fleet):
    blocker = LongJob(fleet)
    try:
        with connect(fleet) as other:
            server_pid = other.status()["server_pid"]
        before = segments_of(server_pid, os.getpid())
        sock = raw(fleet)
        inputs, shared = shm.split_for_transfer({"big": torch.ones(2**20)})
        submit(sock, "echo", {}, inputs, shared)
        accepted = next_of(sock, "accepted", "error")
        protocol.send_message(sock, Message("cancel", job=accepted.job))
        reply = next_of(sock, "error", "result")
        assert (reply.job, reply.fields) == (accepted.job, {"message": "cancelled before it started", "kind": "cancelled"})
        assert blocker.running(), "answered while the other client's job still runs"
        assert segments_of(server_pid, os.getpid()) == before
        sock.close()
    finally:
        blocker.stop()


def test_unacknowledged_results_beyond_the_cap_hold_back_the_next_job_until_acknowledged(fleet):
    sock = raw(fleet)
    jobs = []
    for ref in (1, 2):  # 4 MiB each, through shared memory: 8 MiB held, over the 6 MiB cap
        submit(sock, "fill", {"numel": 2**20}, ref=ref)
        jobs.append(next_of(sock, "result").job)
    submit(sock, "count", {"steps": 1}, ref=3)
    reply = next_of(sock, "error", "accepted")
    assert reply.type == "error" and reply.fields["kind"] == "busy"
    assert "this client holds 8 MiB of results it has not acknowledged (at most 6 MiB)" in reply.fields["message"]
    for job in jobs:
        protocol.send_message(sock, Message("ack", job=job))
    submit(sock, "count", {"steps": 1}, ref=4)
    assert next_of(sock, "result", "error").fields["result"]["total"] == 3
    sock.close()


# -- connections --------------------------------------------------------------------------------------
HOG = """
import socket, sys
from tests.fleet_harness import raw_handshake
held = []
for _ in range(int(sys.argv[3])):
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(sys.argv[1])
    if raw_handshake(sock, sys.argv[2]).type != "welcome":
        break
    held.append(sock)
print(len(held), flush=True)
sys.stdin.read()
"""


def test_one_process_holding_many_connections_leaves_room_for_another(fleet):
    attempts = server.MAX_CONNECTIONS + 4
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(fleet), token_of(fleet), str(attempts)],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert int(hog.stdout.readline()) == server.MAX_CONNECTIONS_PER_PROCESS
        with connect(fleet) as client:
            assert client.run("count", {"steps": 2}).fields["total"] == 6
    finally:
        hog.stdin.close()
        hog.wait(30)


@pytest.mark.slow  # a server of its own: over 20 s on a loaded 2-core machine
def test_connections_that_never_authenticate_do_not_keep_a_tcp_client_out(tmp_path, monkeypatch):
    with fleet_harness.tcp_fleet(tmp_path, monkeypatch) as (address, port, _):
        squatters = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(server.MAX_CONNECTIONS + 6)]
        try:
            with FleetClient.connect(address, autostart=False) as client:
                assert client.run("count", {"steps": 2}).fields["total"] == 2
        finally:
            for sock in squatters:
                sock.close()


def test_small_frames_are_one_write_and_tcp_sockets_send_without_delay():
    assert len(protocol.encode(Message("status", {"ref": 1}))) == 1
    assert len(protocol.encode(Message("submit", {}, {"x": torch.zeros(4)}))) == 1
    assert len(protocol.encode(Message("submit", {}, {"x": torch.zeros(2**16)}))) == 2  # 256 KiB payload: not copied
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as sock:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
        protocol.tune_socket(sock)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


# -- ranks ----------------------------------------------------------------------------------------------
def test_ranks_form_their_groups_over_loopback_only(fleet):
    with connect(fleet) as client:
        pids = rank_pids(client)
    for pid in pids:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"GLOO_SOCKET_IFNAME=lo" in environ
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
        local = []
        for table, loopback in (("tcp", "0100007F"), ("tcp6", "0000000000000000FFFF00000100007F")):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                columns = line.split()
                if columns[9] in inodes:
                    local.append((columns[1].split(":")[0], columns[3], loopback))
        assert any(state == "0A" for _, state, _ in local), f"rank pid {pid} listens on no TCP socket: {local}"
        assert all(address in (loopback, "00000000000000000000000001000000") for address, _, loopback in local), local


def test_rendezvous_files_of_earlier_groups_are_removed(fleet):
    store_dirs = list((fleet.parent / "tmp").glob("mgpu-store-*"))
    assert len(store_dirs) == 1
    with connect(fleet) as client:
        for _ in range(2):
            pids = rank_pids(client)
            os.kill(pids[1], signal.SIGKILL)
            assert wait_gone([pids[1]]) == []
            assert client.run("count", {"steps": 2}).fields["total"] == 6
    assert len(os.listdir(store_dirs[0])) == 1, os.listdir(store_dirs[0])


def test_a_replacement_rank_that_dies_while_joining_is_noticed_at_once(fleet):
    with connect(fleet) as client:
        pids = rank_pids(client)
        server_pid = client.status()["server_pid"]
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []
        killed: list[int] = []

        def kill_the_replacement() -> None:
            deadline = time.monotonic() + 60
            while not killed and time.monotonic() < deadline:
                for pid in set(ranks_of(server_pid)) - set(pids):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                time.sleep(0.01)

        killer = threading.Thread(target=kill_the_replacement, daemon=True)
        killer.start()
        assert client.run("count", {"steps": 2}).fields["total"] == 6
        killer.join()
        assert killed
    log = (fleet.parent / "server.log").read_text()
    assert "died while the ranks formed their groups" in log or "died or stopped while the ranks formed their groups" in log


def test_self_test_jobs_refuse_extreme_arguments_as_input_errors(fleet):
    (fleet.parent / "outside.safetensors").touch()
    cases = [
        ("count", {"steps": 2, "busy_rank": 1, "busy_seconds": 1e9}, "busy_seconds must be a number from 0 to 600, got 1000000000.0"),
        ("count", {"steps": 2, "seconds_per_step": "abc"}, "seconds_per_step must be a number from 0 to 10, got 'abc'"),
        ("fill", {"numel": 2**32}, f"numel must be an integer from 0 to {selftest_jobs.MAX_FILL_ELEMENTS}, got {2**32}"),
        ("hold_file", {"path": "/etc/passwd"}, f"in the fleet's private folder {fleet.parent}, got '/etc/passwd'"),
        ("modules", {"names": ["os"]}, "modules imports only modules of the packages mgpu_backend, mgpu_kernels, kernels; not os"),
    ]
    with connect(fleet) as client:
        pids = rank_pids(client)
        for op, args, text in cases:
            with pytest.raises(FleetError) as info:
                client.run(op, args)
            assert info.value.kind == "input_error" and text in str(info.value), (op, str(info.value))
            assert "rank 1 failed" not in str(info.value)
        assert rank_pids(client) == pids


def test_a_long_busy_step_stops_at_a_cancel(fleet):
    with connect(fleet) as client, connect(fleet) as watcher:

        def running() -> bool:
            return watcher.status()["current_job"] is not None

        with pytest.raises(FleetCancelled, match="cancelled at count step 1/3"):
            client.run("count", {"steps": 3, "busy_rank": 1, "busy_seconds": 600}, should_cancel=running)
        assert client.run("count", {"steps": 1}).fields["total"] == 3


# -- servers of their own -----------------------------------------------------------------------------
def test_serve_on_a_path_that_is_a_regular_file_refuses_and_keeps_the_file(tmp_path):
    tmp_path.chmod(0o700)
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", str(precious), "--cpu-ranks", "1"]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"error: cannot listen on {precious}: {precious} exists and is not a socket, so it was left as it is" in done.stderr
    assert precious.read_text() == "keep me"


def test_a_fleet_whose_launcher_dies_finishes_another_clients_job_then_exits(tmp_path):
    tmp_path.chmod(0o700)
    launcher = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    socket_path = tmp_path / "fleet.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "0", "--parent-pid", str(launcher.pid))
    try:
        with connect(socket_path) as client:
            launcher_gone = threading.Event()

            def on_progress(event) -> None:
                if event["step"] == 1:
                    launcher.stdin.close()
                    launcher.wait()
                    launcher_gone.set()

            result = client.run("count", {"steps": 40, "seconds_per_step": 0.1}, on_progress=on_progress)
            assert launcher_gone.is_set() and result.fields["total"] == 40
            assert process.poll() is None, "the fleet left while a client was still connected"
        assert process.wait(timeout=30) == 0
    finally:
        stop_server(process)


@pytest.mark.slow  # a server of its own: over 20 s on a loaded 2-core machine
def test_a_stopped_rank_dies_with_a_killed_server(tmp_path):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", str(socket_path), "--cpu-ranks", "1", "--idle-timeout", "0"]
    log = open(tmp_path / "server.log", "ab")  # noqa: SIM115 - handed to the server
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        fleet_harness.wait_for_server(socket_path, process)
        with connect(socket_path) as client:
            pids = rank_pids(client)
        os.kill(pids[0], signal.SIGSTOP)
        process.kill()
        process.wait()
        assert wait_gone(pids) == [], "a stopped rank outlived its server"
    finally:
        for pid in ranks_of(process.pid):
            os.kill(pid, signal.SIGKILL)


SLOW_RANK_START = """
import sys, time
if "rank" in sys.argv:
    time.sleep(60)
"""


def test_sigterm_while_the_ranks_start_removes_the_socket_token_and_rendezvous_files(tmp_path):
    tmp_path.chmod(0o700)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_RANK_START)
    (tmp_path / "tmp").mkdir()
    socket_path = tmp_path / "fleet.sock"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]), "TMPDIR": str(tmp_path / "tmp")}
    command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", str(socket_path), "--cpu-ranks", "1", "--idle-timeout", "0"]
    log = open(tmp_path / "server.log", "ab")  # noqa: SIM115 - handed to the server
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        wait_until(lambda: socket_path.exists() and any(ranks_of(process.pid)), timeout=60, what="the socket bound and a rank started")
        rank = ranks_of(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert wait_gone(rank) == []
        assert not socket_path.exists() and not (tmp_path / "fleet.sock.token").exists()
        assert os.listdir(tmp_path / "tmp") == []
        assert "serving on" not in (tmp_path / "server.log").read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.slow  # a server of its own: over 20 s on a loaded 2-core machine
def test_a_job_stopped_by_a_shutdown_tells_its_client_the_server_is_shutting_down(tmp_path):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "0")
    try:
        with connect(socket_path) as client:

            def stop_the_fleet(event) -> None:
                if event["step"] == 1:
                    with connect(socket_path) as other:
                        other.shutdown()

            with pytest.raises(FleetError) as info:
                client.run("count", {"steps": 1000, "seconds_per_step": 0.02}, on_progress=stop_the_fleet)
        assert info.value.kind == "shutdown" and "is shutting down" in str(info.value), str(info.value)
        assert process.wait(timeout=60) == 0
    finally:
        stop_server(process)
