"""``python -m mgpu_backend doctor`` on real CPU fleets (gloo), and its verdicts on GPU-shaped inputs.

The end-to-end tests start the doctor's own fleet (1 or 2 CPU ranks) and read its JSON or text; the
others feed the check functions made-up device properties or job results, so the GPU wording (memory
advice, P2P matrix, slow interconnect, SP thresholds) is checked on a machine without CUDA.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch

from mgpu_backend.tools import cli, doctor

from mgpu_backend.fleet import protocol
from mgpu_backend.fleet.client import FleetClient, FleetError
from mgpu_backend.ltx.diagnostics import sp_check_groups
from mgpu_backend.fleet.controller import DeviceSpec

from .fleet_harness import REPO, start_server, stop_server, wait_gone

SECTIONS = ["devices", "p2p", "fleet", "collectives", "all_to_all_kernel", "sp_check"]


def test_doctor_two_cpu_ranks_exits_0_with_every_section_and_sp_matching_below_1e_5(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    env.pop("MGPU_SOCKET", None)
    completed = subprocess.run(
        [sys.executable, "-m", "mgpu_backend", "doctor", "--cpu-ranks", "2", "--json"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=180,
    )  # fmt: skip
    assert completed.returncode == 0, f"exit {completed.returncode}\n{completed.stdout}\n{completed.stderr}"
    report = json.loads(completed.stdout)
    assert list(report["sections"]) == SECTIONS
    assert report["exit_code"] == 0 and report["failures"] == 0
    assert all(section["status"] != "FAIL" for section in report["sections"].values())

    sp = report["sections"]["sp_check"]["data"]
    assert sp["applied_sp_degree"] == 2 and sp["groups"] == [[0, 1]], sp
    assert sp["finite"] and sp["max_abs_diff"] < 1e-5, f"SP vs unsharded max abs difference {sp['max_abs_diff']:g}"
    assert sp["output_scale"] > 0.1, "the SP check compared outputs that are (nearly) all zero"

    collectives = report["sections"]["collectives"]["data"]
    assert collectives["backend"] == "gloo" and collectives["world_size"] == 2
    assert [(m["op"], m["bytes"]) for m in collectives["results"]] == [
        (op, size) for size in doctor.CPU_COLLECTIVE_SIZES for op in ("all_reduce", "all_to_all")
    ]
    assert all(m["seconds"] > 0 and m["algbw_gbps"] > 0 for m in collectives["results"]), collectives["results"]

    assert report["sections"]["all_to_all_kernel"]["status"] == "SKIP"
    fleet = report["sections"]["fleet"]["data"]
    assert fleet["world_size"] == 2
    assert not wait_gone([fleet["server_pid"], *(rank["pid"] for rank in fleet["ranks"])]), "the doctor left its fleet running"
    assert not os.path.exists(os.path.dirname(report["socket"])), "a passing doctor removes its private socket directory"


@pytest.fixture(scope="module")
def running_fleet(tmp_path_factory):
    """A fleet the user already runs: the doctor must neither attach to it nor stop it."""
    directory = tmp_path_factory.mktemp("users-fleet")
    directory.chmod(0o700)
    socket_path = directory / "fleet.sock"
    process = start_server(socket_path, 1, "--idle-timeout", "0")
    yield socket_path
    stop_server(process)


def _jobs_completed(socket_path) -> int:
    with FleetClient.connect(str(socket_path), autostart=False) as client:
        return client.status()["jobs_completed"]


def test_doctor_refuses_a_socket_a_fleet_answers_on_with_exit_2_and_leaves_that_fleet_alone(running_fleet, capsys):
    before = _jobs_completed(running_fleet)
    assert cli.main(["doctor", "--cpu-ranks", "1", "--socket", str(running_fleet)]) == 2
    assert "already answers" in capsys.readouterr().err
    assert _jobs_completed(running_fleet) == before


def test_sp_check_against_a_perturbed_reference_fails_with_exit_1_and_a_fix(running_fleet, monkeypatch, capsys, tmp_path):
    # MGPU_SOCKET names the user's fleet: the doctor must still start and check its own.
    monkeypatch.setenv("MGPU_SOCKET", str(running_fleet))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a failing doctor keeps its directory
    monkeypatch.setattr(doctor, "SP_CHECK_ARGS", {"seed": 0, "reference_noise": 0.05})
    before = _jobs_completed(running_fleet)
    assert cli.main(["doctor", "--cpu-ranks", "1"]) == 1
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the text is wrapped at 110 columns
    assert "SKIP one rank: nothing is exchanged" in flat
    assert "SP degree 1 over ranks [0]" in flat
    assert [line.split()[0] for line in out.splitlines() if line.startswith("  FAIL")] == ["FAIL"], out
    match = re.search(r"FAIL SP disagrees with the unsharded model: max abs difference (\S+) ", flat)
    assert match, out
    assert float(match.group(1)) > 1e-2, f"a 0.05 weight perturbation should show, got {match.group(1)}"
    assert "fix: do not trust SP results here" in flat
    assert "result: 1 failure(s)" in flat
    kept = [path.name for path in tmp_path.glob("mgpu-doctor-*/server.log")]
    assert kept == ["server.log"] and f"server log stays at {tmp_path}" in flat, flat[-300:]
    assert _jobs_completed(running_fleet) == before, "the doctor ran jobs on the user's fleet (or stopped it)"


def test_socket_directory_that_cannot_be_created_fails_with_exit_1_and_a_fix(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["doctor", "--cpu-ranks", "1", "--socket", str(blocker / "sub" / "fleet.sock")]) == 1
    flat = " ".join(capsys.readouterr().out.split())
    assert f"FAIL cannot use {blocker / 'sub'} for the doctor's fleet socket" in flat
    assert "fix: pass --socket a path in a directory you own" in flat
    assert flat.count("SKIP not run: the fleet did not start") == 3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cpu-ranks", "0"], "--cpu-ranks must be at least 1, got 0"),
        (["--gpus", "99"], "GPU 99 is not visible"),
        (["--socket", "tcp://10.0.0.1:5000"], "only listens on loopback"),
    ],
)
def test_bad_arguments_exit_2_with_what_to_do(argv, message, capsys):
    assert cli.main(["doctor", *argv]) == 2
    assert message in capsys.readouterr().err


def test_gpus_and_cpu_ranks_together_exit_2():
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--gpus", "0", "--cpu-ranks", "2"])
    assert info.value.code == 2


def test_sp_check_groups_are_equal_and_their_size_divides_the_world_and_the_heads():
    assert sp_check_groups(8, 32) == [list(range(8))]
    assert sp_check_groups(6, 32) == [[0, 1], [2, 3], [4, 5]]
    assert sp_check_groups(3, 32) == [[0], [1], [2]]
    assert sp_check_groups(1, 32) == [[0]]


# -- verdicts on GPU-shaped inputs (no CUDA needed) -------------------------------------------------


def _fake_gpus(monkeypatch, totals_gb: dict[int, float]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: SimpleNamespace(name=f"FakeGPU{index}", total_memory=int(totals_gb[index] * 1e9))
    )


def test_gpu_memory_advice_warns_below_48_gb_and_when_others_hold_the_memory(monkeypatch):
    _fake_gpus(monkeypatch, {0: 24.0, 1: 141.0, 2: 141.0})
    free = [{"free": 23e9}, {"free": 20e9}, {"free": 139e9}]
    section = doctor.check_devices(DeviceSpec(gpus=(0, 1, 2)), free)
    gpu_lines = [line for line in section.lines if line.text.startswith("GPU ")]
    assert [line.level for line in gpu_lines] == ["WARN", "WARN", "OK"], [(l.level, l.text) for l in gpu_lines]
    assert "residency 'sharded' spreads the transformer over the fleet's GPUs" in gpu_lines[0].text and "48.0 GB" in gpu_lines[0].fix
    assert "other processes hold 121.0 GB" in gpu_lines[1].text and "nvidia-smi" in gpu_lines[1].fix
    assert [gpu["free_bytes"] for gpu in section.data["gpus"]] == [23e9, 20e9, 139e9]
    assert section.status == "WARN"


def test_p2p_matrix_names_each_pair_without_access_and_gives_the_topology_fix(monkeypatch):
    blocked = {(0, 2), (2, 0)}
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) not in blocked)
    section = doctor.check_p2p(DeviceSpec(gpus=(0, 1, 2)))
    assert section.data["matrix"] == [[None, True, False], [True, None, True], [False, True, None]]
    warn = [line for line in section.lines if line.level == "WARN"]
    assert len(warn) == 1 and "0->2, 2->0" in warn[0].text
    assert "nvidia-smi topo -m" in warn[0].fix and "NCCL_P2P_DISABLE=1" in warn[0].fix
    assert warn[0].fix.startswith("The fleet runs without P2P: NCCL routes such pairs through host memory"), warn[0].fix
    assert "NO" in section.lines[0].detail
    assert doctor.check_p2p(DeviceSpec(gpus=(0,))).status == "SKIP"


class _FakeClient:
    def __init__(self, fields: dict | None = None, error: FleetError | None = None) -> None:
        self.fields, self.error, self.calls = fields, error, []

    def run(self, op: str, args: dict):
        self.calls.append((op, args))
        if self.error is not None:
            raise self.error
        return SimpleNamespace(fields=self.fields)


def _sp_result(difference: float, finite: bool = True) -> dict:
    return {
        "max_abs_diff": difference, "finite": finite, "groups": [[0, 1]], "sp_degree": 2, "applied_sp_degree": 2,
        "exchange": "nccl", "video_tokens": 18, "audio_tokens": 18, "output_scale": 4.0, "warn_above": 1e-4, "fail_above": 1e-2,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("difference", "finite", "verdict"),
    [(3e-7, True, "OK"), (5e-3, True, "WARN"), (0.3, True, "FAIL"), (0.0, False, "FAIL")],
)
def test_sp_verdict_is_ok_below_1e_4_warn_below_1e_2_and_fail_above_or_on_nan(difference, finite, verdict):
    section = doctor.check_sequence_parallel(_FakeClient(_sp_result(difference, finite)), DeviceSpec(gpus=(0, 1)), "server.log")
    assert section.status == verdict, [(line.level, line.text) for line in section.lines]
    if verdict != "OK":
        assert section.lines[-1].fix


def test_failing_collective_is_a_fail_naming_the_rank_with_nccl_advice():
    error = FleetError("RuntimeError: NCCL error: unhandled system error", rank=1, traceback="Traceback ...\nRuntimeError: NCCL")
    section = doctor.check_collectives(_FakeClient(error=error), DeviceSpec(gpus=(0, 1)), "/tmp/x/server.log")
    assert section.status == "FAIL"
    assert "failed on rank 1: RuntimeError: NCCL error" in section.lines[0].text
    assert "NCCL_DEBUG=INFO" in section.lines[0].fix and "/tmp/x/server.log" in section.lines[0].fix


def test_slow_gpu_all_to_all_warns():
    results = [
        {"op": op, "bytes": size, "seconds": size / (speed * 1e9)}
        for size in doctor.GPU_COLLECTIVE_SIZES
        for op, speed in (("all_reduce", 4.0), ("all_to_all", 3.0))
    ]
    client = _FakeClient({"backend": "nccl", "world_size": 2, "results": results})
    section = doctor.check_collectives(client, DeviceSpec(gpus=(0, 1)), "server.log")
    assert client.calls[0][1]["sizes_bytes"] == list(doctor.GPU_COLLECTIVE_SIZES)
    assert section.status == "WARN" and "3.0 GB/s" in section.lines[-1].text
    assert section.data["results"][1]["algbw_gbps"] == pytest.approx(3.0)
    assert section.data["results"][0]["busbw_gbps"] == pytest.approx(4.0)  # 2 (n-1)/n = 1 at two ranks


def test_a_broken_server_connection_fails_that_check_and_skips_the_rest(monkeypatch, tmp_path):
    class BrokenClient(_FakeClient):
        shut_down = False

        def run(self, op: str, args: dict):
            raise protocol.ConnectionClosed("the server closed the connection")

        def shutdown(self) -> None:
            BrokenClient.shut_down = True

        def close(self) -> None:
            pass

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    fleet = doctor.Section("fleet", "Fleet start-up", data={"log": str(tmp_path / "server.log"), "server_pid": finished.pid, "ranks": [{}, {}]})
    monkeypatch.setattr(doctor, "start_fleet", lambda devices, address: (fleet, BrokenClient()))
    report = doctor.run_doctor(DeviceSpec(cpu_ranks=2), str(tmp_path / "fleet.sock"))
    sections = {section.key: section for section in report.sections}
    assert list(sections) == SECTIONS and report.exit_code == 1
    assert "connection to the doctor's fleet server broke" in sections["collectives"].lines[0].text
    assert sections["collectives"].status == "FAIL"
    assert [sections[key].status for key in ("all_to_all_kernel", "sp_check")] == ["SKIP", "SKIP"]
    assert BrokenClient.shut_down


def test_fleet_size_that_does_not_divide_the_heads_warns_with_the_sp_degree_it_gets():
    result = {**_sp_result(2e-7), "groups": [[0, 1], [2, 3], [4, 5]], "sp_degree": 2}
    section = doctor.check_sequence_parallel(_FakeClient(result), DeviceSpec(gpus=tuple(range(6))), "server.log")
    warn = [line for line in section.lines if line.level == "WARN"]
    assert len(warn) == 1 and "SP can use at most 2 of them per group (3 groups" in warn[0].text
    assert section.lines[-1].level == "OK"
