"""``python -m mgpu_backend queue`` in a Python without torch (a bare venv: the standard library
and this checkout on PYTHONPATH): its help, a real queue run against the fake ComfyUI of
test_comfy_queue, the command list, and the fleet commands saying what they need instead of a
traceback. The command list is the same whether the sub-commands are built lazily or in full."""

from __future__ import annotations

import subprocess
import venv
from pathlib import Path

import pytest

from mgpu_backend.tools import cli

from .fleet_harness import REPO
from .helpers import PROMPT_ID, SUCCESS_SCRIPT, WORKFLOW, FakeComfyUI


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory) -> str:
    """A venv without pip and without the system's packages: no torch, no numpy."""
    folder = tmp_path_factory.mktemp("bare-venv")
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(folder)
    python = str(folder / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], capture_output=True, timeout=60).returncode == 1
    return python


def bare(python: str, *args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    return subprocess.run([python, "-m", "mgpu_backend", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_queue_help_and_the_command_list_need_no_torch(bare_python):
    queue_help = bare(bare_python, "queue", "--help")
    assert queue_help.returncode == 0, queue_help.stderr
    assert queue_help.stdout.startswith("usage: python -m mgpu_backend queue [-h] [--server SERVER]") and "--set NODE.INPUT=VALUE" in queue_help.stdout
    top = bare(bare_python, "--help")
    assert top.returncode == 0, top.stderr
    for name, summary in cli.SUMMARIES.items():
        assert f"    {name}" in top.stdout and summary.split()[0] in top.stdout, name


def test_queue_runs_a_workflow_against_comfyui_from_a_python_without_torch(bare_python):
    with FakeComfyUI(SUCCESS_SCRIPT) as fake:
        completed = bare(bare_python, "queue", str(WORKFLOW), "--server", fake.url, "--set", "4.seed=42")
    assert completed.returncode == 0, completed.stderr
    (posted,) = fake.posted
    assert posted["prompt"]["4"]["inputs"]["seed"] == 42 and posted["client_id"] == fake.ws_client_ids[0]
    assert f"queued prompt {PROMPT_ID} (position 3)" in completed.stdout
    assert "8 Save Video: output/video/ltx2_tiny_mgpu_00001_.mp4" in completed.stdout


@pytest.mark.parametrize("command", [["generate", "--help"], ["status"], ["doctor", "--cpu-ranks", "1"]])
def test_a_fleet_command_in_a_python_without_torch_says_what_it_needs(bare_python, command):
    completed = bare(bare_python, *command)
    assert completed.returncode == 2 and "Traceback" not in completed.stderr
    assert completed.stderr == (
        f"error: 'python -m mgpu_backend {command[0]}' needs the package 'torch', which {bare_python} cannot import; "
        "run it with the Python the project is installed in (pip install -e .)\n"
    )


def test_the_command_list_is_the_same_built_lazily_or_in_full():
    assert cli.build_parser([]).format_help() == cli.build_parser().format_help()
    assert cli.build_parser(["queue"]).format_help() == cli.build_parser().format_help()
