"""Faults on the ranks of a real fleet (server process, sockets, two gloo CPU ranks): a failure on one
rank is a job error on all, weights (rank state) survive it; dead, stopped and hung ranks are
replaced while the survivors keep their process and state; a long step is not a hang; shutdown
leaves no rank behind; segments of failed jobs are unlinked; the ranks' log lines reach the client
once; inputs of any size reach every rank by reference."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mgpu_backend.fleet.client import FleetCancelled, FleetClient, FleetError

from .fleet_harness import REPO, wait_for_server, wait_gone
from .helpers import cpu_seconds, wait_until

RANK_TIMEOUT = 5


@pytest.fixture(scope="module")
def fleet(fleet_of):
    return fleet_of(2, "--rank-timeout", str(RANK_TIMEOUT))


def connect(socket_path) -> FleetClient:
    return FleetClient.connect(str(socket_path), autostart=False)


def rank_pids(client) -> list[int]:
    return [rank["pid"] for rank in client.status()["ranks"]]


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_failure_on_one_rank_before_a_collective_is_a_job_error_and_every_rank_keeps_its_state(fleet, failing_rank):
    with connect(fleet) as client:
        client.run("remember", {"value": 40 + failing_rank})
        pids, restarts = rank_pids(client), client.status()["fleet_restarts"]
        with pytest.raises(FleetError) as info:
            client.run("count", {"steps": 6, "fail_rank": failing_rank, "fail_step": 2})
        assert info.value.rank == failing_rank
        assert f"rank {failing_rank} failed: RuntimeError: requested failure on rank {failing_rank} at step 2" in str(info.value)
        assert "Traceback" in info.value.traceback and "requested failure" in info.value.traceback
        assert rank_pids(client) == pids and client.status()["fleet_restarts"] == restarts
        assert client.run("recall").fields["remembered"] == [40.0 + failing_rank] * 2
        assert client.run("count", {"steps": 3}).fields["total"] == 9


def test_an_input_error_found_on_rank_0_only_is_an_input_error_of_the_job_and_the_state_is_kept(fleet):
    with connect(fleet) as client:
        client.run("remember", {"value": 11})
        pids = rank_pids(client)
        with pytest.raises(FleetError, match="^requested input error on rank 0 at step 1$") as info:
            client.run("count", {"steps": 4, "fail_rank": 0, "fail_step": 1, "fail_as_input_error": True})
        assert info.value.kind == "input_error" and info.value.rank == 0
        assert client.run("recall").fields["remembered"] == [11.0, 11.0]
        assert rank_pids(client) == pids


def test_a_failure_on_one_rank_after_its_last_collective_keeps_the_groups_and_the_state(fleet):
    with connect(fleet) as client:
        pids = rank_pids(client)
        with pytest.raises(FleetError, match="rank 1 failed: RuntimeError: requested failure on rank 1 after remembering") as info:
            client.run("remember", {"value": 7, "fail_rank": 1})
        assert info.value.rank == 1
        assert client.run("recall").fields["remembered"] == [7.0, 7.0]
        assert rank_pids(client) == pids


@pytest.mark.slow
def test_a_stopped_rank_is_named_in_every_trial_and_only_it_is_replaced(fleet):
    with connect(fleet) as client:
        for trial, stopped_rank in enumerate([1, 0, 1, 0]):
            client.run("remember", {"value": trial})
            pids = rank_pids(client)
            with pytest.raises(FleetError) as info:
                client.run("count", {"steps": 50, "stop_rank": stopped_rank, "stop_step": 2})
            message = str(info.value)
            assert info.value.rank == stopped_rank, message
            assert f"rank {stopped_rank} (pid {pids[stopped_rank]}) sent no heartbeat" in message
            assert "its process is stopped" in message
            assert f"replaced rank {stopped_rank}; rank {1 - stopped_rank} kept its process" in message
            after = rank_pids(client)
            assert after[1 - stopped_rank] == pids[1 - stopped_rank] and after[stopped_rank] != pids[stopped_rank]
            assert wait_gone([pids[stopped_rank]]) == []
            remembered = client.run("recall").fields["remembered"]
            assert remembered[1 - stopped_rank] == trial and remembered[stopped_rank] == -1


@pytest.mark.slow
def test_a_rank_computing_a_step_longer_than_the_rank_timeout_is_not_declared_hung(fleet):
    with connect(fleet) as client:
        restarts, pids = client.status()["fleet_restarts"], rank_pids(client)
        for busy_rank in (0, 1):
            events = []
            args = {"steps": 3, "busy_rank": busy_rank, "busy_step": 1, "busy_seconds": 2.5 * RANK_TIMEOUT}
            assert client.run("count", args, on_progress=events.append).fields["total"] == 9
            assert [event["step"] for event in events] == [1, 2, 3]
        assert client.status()["fleet_restarts"] == restarts and rank_pids(client) == pids


@pytest.mark.slow
def test_a_cancel_during_a_long_step_stops_every_rank_at_the_next_step_boundary(fleet):
    with connect(fleet) as client:
        pids = rank_pids(client)
        events = []
        args = {"steps": 5, "busy_rank": 1, "busy_step": 1, "busy_seconds": 2 * RANK_TIMEOUT}

        def inside_the_long_step() -> bool:
            # Step 1's cancel point passed on rank 0 right after it reported the step; a cancel
            # sent a while later finds rank 1 computing step 2.
            return bool(events) and time.monotonic() - events[0]["received"] > 2.0

        with pytest.raises(FleetCancelled, match="cancelled at count step 2/5"):
            client.run("count", args, on_progress=lambda event: events.append({**event, "received": time.monotonic()}), should_cancel=inside_the_long_step)
        assert rank_pids(client) == pids
        assert client.run("count", {"steps": 2}).fields["total"] == 6


def test_a_rank_hung_outside_a_collective_is_replaced_and_the_other_keeps_its_state(fleet):
    with connect(fleet) as client:
        client.run("remember", {"value": 3})
        pids = rank_pids(client)
        with pytest.raises(FleetError, match=rf"rank 1 made no progress for {RANK_TIMEOUT} s \(hung: rank 1 at selftest_jobs.py") as info:
            client.run("count", {"steps": 5, "hang_rank": 1, "hang_step": 2})
        assert info.value.rank == 1
        after = rank_pids(client)
        assert after[0] == pids[0] and after[1] != pids[1]
        assert client.run("recall").fields["remembered"] == [3.0, -1.0]


def test_after_a_rank_is_killed_only_its_replacement_reads_the_file_again(fleet):
    weights = {f"layer.{index}.weight": torch.randn(256, 1024, generator=torch.Generator().manual_seed(index)) for index in range(4)}
    path = fleet.parent / "weights.safetensors"  # hold_file reads only in the fleet's private folder
    save_file(weights, str(path))
    full = sum(tensor.nbytes for tensor in weights.values())
    checksum = sum(float(tensor.to(torch.float64).sum()) for tensor in weights.values())
    with connect(fleet) as client:
        first = client.run("hold_file", {"path": str(path)}).fields
        assert first["bytes_read"] == [full, full] and first["checksum"] == checksum
        assert client.run("hold_file", {"path": str(path)}).fields["bytes_read"] == [0, 0]
        pids = rank_pids(client)
        events = []
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []
        again = client.run("hold_file", {"path": str(path)}, on_log=events.append).fields
        assert again["bytes_read"] == [0, full] and again["checksum"] == checksum
        assert rank_pids(client)[0] == pids[0]
        assert sorted(events) == ["[rank 0] hold_file: 0.0 MiB read from disk", f"[rank 1] hold_file: {full / 2**20:.1f} MiB read from disk"]


def test_a_rank_killed_mid_job_is_named_and_the_survivor_keeps_its_state(fleet):
    with connect(fleet) as client:
        client.run("remember", {"value": 9})
        pids = rank_pids(client)
        events = []

        def kill_when_running(event):
            events.append(event)
            if len(events) == 2:
                os.kill(pids[0], signal.SIGKILL)

        with pytest.raises(FleetError, match=rf"rank 0 \(pid {pids[0]}\) died \(killed by signal 9\); replaced rank 0; rank 1 kept its process") as info:
            client.run("count", {"steps": 100, "seconds_per_step": 0.05}, on_progress=kill_when_running)
        assert info.value.rank == 0
        assert client.run("recall").fields["remembered"] == [-1.0, 9.0]


def _segments_of(server_pid: int) -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"mgpu-{os.getuid()}-{server_pid}-")}


def test_a_segment_a_killed_rank_created_is_unlinked_with_its_job(fleet):
    with connect(fleet) as client:
        server_pid, pids = client.server_pid, rank_pids(client)
        before = _segments_of(server_pid)
        outcome = {}

        def run():
            try:
                client.run("fill", {"numel": 4 * 2**20, "hang_rank": 0})
            except FleetError as exc:
                outcome["error"] = exc

        runner = threading.Thread(target=run)
        runner.start()
        deadline = time.monotonic() + 60
        while not _segments_of(server_pid) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        created = _segments_of(server_pid) - before
        assert len(created) == 1, "rank 0 should hold one result segment while it hangs"
        os.kill(pids[0], signal.SIGKILL)
        runner.join(120)
        assert "died (killed by signal 9)" in str(outcome["error"])
        assert _segments_of(server_pid) & created == set()


def test_log_lines_of_every_rank_reach_the_client_once_and_the_server_log(fleet):
    lines = []
    with connect(fleet) as client:
        client.run("say", {"text": "technique applied: 2 ranks"}, on_log=lines.append)
    assert sorted(lines) == sorted(
        ["[rank 0-1] technique applied: 2 ranks", "[rank 0] technique applied: 2 ranks from rank 0", "[rank 1] technique applied: 2 ranks from rank 1"]
    )
    server_log = (fleet.parent / "server.log").read_text()
    assert "say, ranks 0-1: technique applied: 2 ranks\n" in server_log
    assert "say, rank 1: technique applied: 2 ranks from rank 1\n" in server_log


def test_inputs_above_one_gib_in_total_reach_every_rank_by_reference(fleet):
    generator = torch.Generator().manual_seed(1)
    inputs = {name: torch.rand(72 * 2**20, dtype=torch.float64, generator=generator) for name in ("a", "b")}  # 1.2 GB in all
    small = {"note": torch.arange(5)}
    with connect(fleet) as client:
        result = client.run("echo", {}, {**inputs, **small})
    assert result.fields["ranks_agreed"] == 2
    for name, tensor in {**inputs, **small}.items():
        assert torch.equal(result.tensors[name], tensor), name


# -- shutdown: a server of its own per test, in its own session like one started by hand -----------


def _ranks_of(server_pid: int) -> list[int]:
    """Every live rank process the server with ``server_pid`` started (whoever its parent is now)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"rank" in command and b"--owner-pid" in command and command[command.index(b"--owner-pid") + 1] == str(server_pid).encode():
            found.append(int(entry.name))
    return found


def _own_server(tmp_path) -> tuple[subprocess.Popen, Path]:
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", str(socket_path), "--cpu-ranks", "2", "--idle-timeout", "0"]
    log = open(tmp_path / "server.log", "ab")  # noqa: SIM115
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    wait_for_server(socket_path, process)
    return process, socket_path


def _start_a_long_step(socket_path) -> tuple[FleetClient, threading.Thread, list]:
    client = connect(socket_path)
    events: list = []

    def run():
        try:
            client.run("count", {"steps": 3, "busy_rank": 1, "busy_step": 1, "busy_seconds": 300}, on_progress=events.append)
        except Exception as exc:  # noqa: BLE001 - the job ends with the server, however it ends
            events.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    assert events, "the job did not start"
    return client, runner, events


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "ctrl-c"])
def test_shutdown_during_a_long_step_ends_every_rank_and_starts_none(tmp_path, how):
    process, socket_path = _own_server(tmp_path)
    try:
        with connect(socket_path) as probe:
            pids = rank_pids(probe)
        client, runner, _ = _start_a_long_step(socket_path)
        computing_from = cpu_seconds(pids[1])
        wait_until(lambda: cpu_seconds(pids[1]) > computing_from + 0.2, what="rank 1 computing its long step")
        if how == "stop":
            with connect(socket_path) as other:
                other.shutdown()
        else:
            os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in the server's terminal sends
        assert process.wait(timeout=60) == 0
        assert wait_gone(pids) == []
        assert wait_gone(_ranks_of(process.pid)) == [], "a rank was started during shutdown and outlived the server"
        server_log = (tmp_path / "server.log").read_text()
        assert "restarting" not in server_log and "rebuilding" not in server_log
        client.close()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        for pid in _ranks_of(process.pid):
            os.kill(pid, signal.SIGKILL)
