"""One fleet per process by default, and what a client says when its fleet goes away.

Two client processes of one user (two ComfyUIs, in effect) that name no socket start two fleets,
each on the devices it asked for; killing one leaves the other's running job to finish. The command
line's default is the per-user socket. A client reports a removed token file and a server that is
shutting down (its ``shutdown`` error, or the connection dropped after it removed its token) in
words that say what happened and what to do (a server that died: test_fleet_hardening).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from mgpu_backend.fleet import protocol
from mgpu_backend.fleet.addresses import Address, process_fleets, user_socket_by_default, write_token
from mgpu_backend.fleet.client import RUN_AGAIN, FleetClient, FleetUnavailable
from mgpu_backend.fleet.protocol import Message

from .fleet_harness import REPO, start_server, stop_server, wait_gone


@pytest.fixture
def runtime(tmp_path, monkeypatch) -> Path:
    """A private runtime folder shared by this test and the processes it starts; no MGPU_SOCKET."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    monkeypatch.delenv("MGPU_SOCKET", raising=False)
    return folder


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def test_each_process_defaults_to_a_socket_of_its_own_and_the_command_line_to_the_users(runtime, monkeypatch):
    here = Address.parse(None)
    assert here.unix_path == runtime / "comfyui-mgpu" / f"process-{os.getpid()}" / "fleet.sock"
    assert here.token_path == here.unix_path.with_name("fleet.sock.token") and here.log_path == here.unix_path.with_name("server.log")
    script = "import os; from mgpu_backend.fleet.addresses import Address; print(os.getpid(), Address.parse(None))"
    child = subprocess.run([sys.executable, "-c", script], env=child_env(), capture_output=True, text=True, timeout=60, check=True)
    pid, path = child.stdout.split()
    assert int(pid) != os.getpid() and path == str(runtime / "comfyui-mgpu" / f"process-{pid}" / "fleet.sock")
    with user_socket_by_default():
        assert Address.parse(None).unix_path == runtime / "comfyui-mgpu" / "fleet.sock"
    assert Address.parse(None) == here
    with pytest.raises(FleetUnavailable) as caught:  # what the panel of a ComfyUI whose fleet has not started shows
        FleetClient.connect(autostart=False)
    assert str(caught.value) == (
        f"no fleet server answers at {here}; this process's own fleet socket: its first fleet job (in ComfyUI: "
        "the first MGPU node) starts one there"
    )
    monkeypatch.setenv("MGPU_SOCKET", str(runtime / "by-hand.sock"))  # named: every process attaches there
    assert Address.parse(None).unix_path == runtime / "by-hand.sock"
    with user_socket_by_default():
        assert Address.parse(None).unix_path == runtime / "by-hand.sock"


CLIENT = textwrap.dedent(
    """
    import json, sys, time
    from mgpu_backend.fleet.client import FleetClient
    client = FleetClient.connect(cpu_ranks=int(sys.argv[1]))
    status = client.status()
    print(json.dumps({"address": status["address"], "server_pid": status["server_pid"],
                      "ranks": [rank["pid"] for rank in status["ranks"]]}), flush=True)
    if sys.argv[2] == "idle":
        time.sleep(600)
    sys.stdin.readline()  # the test's go: its job starts once both fleets are up
    steps = int(sys.argv[2])
    result = client.run("count", {"steps": steps, "seconds_per_step": 0.1},
                        on_progress=lambda event: event["step"] == 1 and print("running", flush=True))
    print(json.dumps(result.fields), flush=True)
    time.sleep(600)  # alive, and its fleet with it, until the test ends it
    """
)


@pytest.mark.slow  # two fleets, two clients and an 8 s job; the default suite checks the sockets themselves above
def test_two_processes_start_two_fleets_and_killing_one_leaves_the_others_job_running(runtime):
    started = []
    try:
        for cpu_ranks, job in (("1", "idle"), ("2", "80")):
            command = [sys.executable, "-c", CLIENT, cpu_ranks, job]
            started.append(subprocess.Popen(command, env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        first, second = started
        first_fleet, second_fleet = (json.loads(process.stdout.readline()) for process in started)
        private = runtime / "comfyui-mgpu"
        assert first_fleet["address"] == str(private / f"process-{first.pid}" / "fleet.sock")
        assert second_fleet["address"] == str(private / f"process-{second.pid}" / "fleet.sock")
        assert (len(first_fleet["ranks"]), len(second_fleet["ranks"])) == (1, 2)
        for folder in (private, private / f"process-{first.pid}", private / f"process-{second.pid}"):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
        assert [(pid, str(path)) for pid, path, _ in process_fleets()] == sorted(
            [(first.pid, first_fleet["address"]), (second.pid, second_fleet["address"])], key=lambda entry: entry[1]
        )

        second.stdin.write("go\n")
        second.stdin.flush()
        assert second.stdout.readline() == "running\n"
        first.kill()  # the first "ComfyUI" dies: its fleet ends with it
        first.wait()
        assert wait_gone([first_fleet["server_pid"], *first_fleet["ranks"]]) == []
        with FleetClient.connect(second_fleet["address"], autostart=False) as observer:
            status = observer.status()
        assert status["server_pid"] == second_fleet["server_pid"] and status["current_job"]["op"] == "count"
        assert status["current_job"]["step"] < 80, "the job ended before the other fleet was gone: nothing was shown"

        # The command line's default socket holds no fleet: status says so and lists the one left.
        cli = subprocess.run([sys.executable, "-m", "mgpu_backend", "status"], env=child_env(), capture_output=True, text=True, timeout=60)
        assert cli.returncode == 1
        assert cli.stderr.splitlines()[:3] == [
            f"no fleet server answers at {private / 'fleet.sock'}; start one with 'python -m mgpu_backend serve'",
            "fleets of running processes (a ComfyUI starts its own); name one with --socket:",
            f"  {second_fleet['address']}  (pid {second.pid}: {' '.join(f'{sys.executable} -c {CLIENT} 2 80'.split())[:120]})",
        ]

        result = json.loads(second.stdout.readline())
        assert result == {"steps": 80, "total": 80 * (1 + 2)}, result  # every step summed over both of its ranks
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_a_removed_token_file_says_so_and_which_server_to_stop_instead_of_starting_a_second(tmp_path, monkeypatch):
    monkeypatch.delenv("MGPU_SOCKET", raising=False)
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    server = start_server(socket_path, 1, "--idle-timeout", "0")
    try:
        (tmp_path / "fleet.sock.token").unlink()
        expected = (
            f"a fleet server (pid {server.pid}) listens at {socket_path}, but the fleet's token file {socket_path}.token is "
            f"missing (removed while the server ran), so no client can attach to it. Stop it with 'kill {server.pid}' (it stops "
            "its ranks and removes its socket); a fresh fleet can then start there"
        )
        for autostart in (False, True):
            with pytest.raises(FleetUnavailable) as caught:
                FleetClient.connect(str(socket_path), autostart=autostart, cpu_ranks=1)
            assert str(caught.value) == expected
        assert "already listens" not in (tmp_path / "server.log").read_text(), "a second server was started"
        server.send_signal(signal.SIGTERM)  # what the message says to do: the address is then free
        assert server.wait(timeout=60) == 0 and not socket_path.exists()
    finally:
        stop_server(server)


def test_a_tcp_listener_without_the_fleets_token_is_named_by_its_port_and_no_server_is_started(runtime):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with pytest.raises(FleetUnavailable) as caught:
            FleetClient.connect(f"tcp://127.0.0.1:{port}", cpu_ranks=1)
    token = runtime / "comfyui-mgpu" / f"tcp-{port}.token"
    assert str(caught.value) == (
        f"a process listens at tcp://127.0.0.1:{port}, but the fleet's token file {token} is missing (removed while the "
        f"server ran), so no client can attach to it. Stop the process listening on port {port} (find it with "
        f"'ss -ltnp sport = :{port}'); a fresh fleet can then start there"
    )
    assert not (runtime / "comfyui-mgpu" / "server.log").exists(), "a server was started on a taken port"


def run_in_thread(client: FleetClient, fields: dict) -> tuple[threading.Thread, threading.Event, list]:
    """``count`` with ``fields`` on ``client`` in a thread; the event is set at its first step, the
    list receives the exception it ended with."""
    first_step, outcome = threading.Event(), []

    def work() -> None:
        try:
            client.run("count", fields, on_progress=lambda event: first_step.set())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, first_step, outcome


def test_a_job_ended_by_stop_says_the_server_is_shutting_down(tmp_path):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    server = start_server(socket_path, 1, "--idle-timeout", "0")
    try:
        client = FleetClient.connect(str(socket_path), autostart=False)
        thread, first_step, outcome = run_in_thread(client, {"steps": 10_000, "seconds_per_step": 0.05})
        assert first_step.wait(60)
        with FleetClient.connect(str(socket_path), autostart=False) as other:
            other.shutdown()  # python -m mgpu_backend stop
        thread.join(60)
        (error,) = outcome
        assert isinstance(error, FleetUnavailable) and error.kind == "shutdown"
        assert str(error) == (
            f"the fleet server at {socket_path} is shutting down (it was told to stop: 'python -m mgpu_backend stop', "
            f"the MGPU Fleet Control node, or a signal), so the job ended before it finished. {RUN_AGAIN}"
        )
        assert server.wait(timeout=60) == 0
    finally:
        stop_server(server)


class ShuttingDownServer:
    """The fleet's side of the wire, by hand: handshake, accept one submit, then the error a server
    that is shutting down sends (for the job, or for the whole connection), and close."""

    def __init__(self, socket_path: Path, job_scoped: bool) -> None:
        self.token = write_token(socket_path.with_name(socket_path.name + ".token"))
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(socket_path))
        self.listener.listen(1)
        self.job_scoped = job_scoped
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        connection, _ = self.listener.accept()
        with connection:
            hello = protocol.recv_message(connection)
            server_nonce = "ab" * (protocol.NONCE_HEX_DIGITS // 2)
            proof = protocol.handshake_proof(self.token, "server", hello.fields["nonce"], server_nonce)
            protocol.send_message(connection, Message("challenge", {"nonce": server_nonce, "proof": proof}))
            protocol.recv_message(connection)  # auth
            protocol.send_message(connection, Message("welcome", {"version": protocol.PROTOCOL_VERSION, "server_pid": os.getpid()}))
            submit = protocol.recv_message(connection)
            protocol.send_message(connection, Message("accepted", {"ref": submit.fields["ref"]}, job="job-1"))
            error = {"message": "server shutting down", "kind": "shutdown"}
            protocol.send_message(connection, Message("error", error, job="job-1" if self.job_scoped else None))


@pytest.mark.parametrize("job_scoped", [True, False], ids=["job-error", "connection-error"])
def test_the_servers_shutdown_error_reads_as_shutting_down(tmp_path, job_scoped):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    server = ShuttingDownServer(socket_path, job_scoped)
    client = FleetClient.connect(str(socket_path), autostart=False)
    with pytest.raises(FleetUnavailable) as caught:
        client.run("count", {"steps": 3})
    server.thread.join(10)
    assert caught.value.kind == "shutdown" and str(caught.value).startswith(f"the fleet server at {socket_path} is shutting down (")
    assert client.sock.fileno() == -1, "the connection to a server on its way out must be closed"
