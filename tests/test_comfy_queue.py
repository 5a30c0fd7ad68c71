"""``python -m mgpu_backend queue`` against a tiny fake ComfyUI (real HTTP and websocket on 127.0.0.1):
posting with a client id, following the websocket (ping/pong, fragments, 16- and 64-bit lengths,
binary progress text), printing outputs from /history, and exiting non-zero with ComfyUI's error
text when the prompt is refused, fails or is interrupted."""

from __future__ import annotations

import argparse
import json

import pytest

from mgpu_backend.tools import comfy_queue
from tests.helpers import PROMPT_ID, SUCCESS_SCRIPT, WORKFLOW, FakeComfyUI, event


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="python -m mgpu_backend")
    comfy_queue.add_queue_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


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
