"""A new user's audit of the command line and the nodes, rerun: every bad input is refused before
any heavy work, in one message style (the user's flag names and units, what to do, no rank label);
no flag is silently ignored; audio lasts as long as the video.

One CPU fleet (2 gloo ranks) serves the whole module. Refusals run ``python -m mgpu_backend``'s own
``main`` in this process (a subprocess per case would spend most of its time importing torch) and
check that the fleet served no job meanwhile; the cases that need the ranks run the command as a
subprocess, as a user would.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mgpu_backend.fleet.addresses import Address, private_dir, user_socket_by_default
from mgpu_backend.fleet.client import FleetClient
from mgpu_backend.ltx.decode import fit_audio_to_video
from mgpu_backend.ltx.schema import EMBEDDED_TINY, audio_sample_count
from mgpu_backend.tools import cli

from .fleet_harness import REPO
from .helpers import NODES

PROMPT = "a red fox runs through fresh snow at dawn"


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("audit-cache")


@pytest.fixture(scope="module")
def fleet(fleet_of, cache_dir):
    return fleet_of(2, env={"MGPU_CACHE_DIR": str(cache_dir)})


def jobs_served(socket_path: Path) -> int:
    with FleetClient.connect(str(socket_path), autostart=False) as client:
        status = client.status()
    assert status["current_job"] is None and status["queue_length"] == 0
    return status["jobs_completed"]


def generate_here(capsys, monkeypatch, *args: str) -> tuple[int, str]:
    """``python -m mgpu_backend generate ARGS`` in this process: (exit code, stderr)."""
    monkeypatch.delenv("MGPU_SOCKET", raising=False)
    try:
        code = cli.main(["generate", *args])
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def generate_subprocess(cache_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "MGPU_CACHE_DIR": str(cache_dir)}
    env.pop("MGPU_SOCKET", None)
    return subprocess.run([sys.executable, "-m", "mgpu_backend", "generate", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


# --- refused before the fleet is asked for anything -----------------------------------------------

REFUSALS = [
    (["--num-frames", "100000"], "error: --num-frames must be 8k+1 (the video VAE packs 8 frames per latent frame after the first), got 100000; use 99993"),
    (["--num-frames", "100001"], "error: --num-frames must be 8k+1 from 1 to 99993, got 100001; use 99993 or fewer"),
    (["--width", "20032"], "error: --width must be at most 16384 for the two-stage graph (stage 1 runs at half size), got 20032; use 16384 or less"),
    (["--height", "100"], "error: --height must be a multiple of 64 for the two-stage graph (stage 1 runs at half size), got 100; use 128"),
    (["--frame-rate", "0"], "error: --frame-rate must be positive, got 0; the official default is 24"),
    (["--frame-rate", "500"], "error: --frame-rate must be from 1 to 240 frames per second, got 500; the official default is 24"),
    (["--seed", "-1"], "error: --seed must be a whole number from 0 to 9223372036854775807, got -1; the official default is 10"),
    (["--num-inference-steps", "0"], "error: --num-inference-steps must be a whole number >= 1, got 0; the official default is 40"),
    (["--tiles", "2x2"], "error: --tiles 2x2 does not fit a 128x192 (height x width) output: its height is 4 latent cells of 32 pixels, "
                         "too few for 2 tiles that overlap by 4 cells; use --tiles auto, fewer tiles, or a larger --height"),
    (["--tiles", "3"], "error: --tiles: tiles must be 'auto' or HxW tile counts like 2x2 (height x width); got '3'"),
    (["--stage2-sigmas", "0.1,0.5,0.0"], "error: --stage2-sigmas must decrease strictly, got [0.1, 0.5, 0.0]; e.g. 0.909375, 0.725, 0.421875, 0.0"),
    (["--stage2-sigmas", "1.0,0.5,0.0"], "error: --stage2-sigmas must start below 1.0 (pure noise), got 1.0,0.5,0.0: stage 2 refines the upsampled "
                                         "stage-1 video, and from pure noise its tiles would not agree on one video; use e.g. 0.625,0.4,0.0"),
    (["--stage2-sigmas", "0.6;0"], "error: --stage2-sigmas takes numbers separated by commas, got '0.6;0'; e.g. 0.625,0.4,0.0"),
    (["--lora", "/nonexistent/style.safetensors"], "error: --lora: LoRA file /nonexistent/style.safetensors does not exist; check the path (or download the file there)"),
    (["--image", "/nonexistent/first.png"], "error: --image /nonexistent/first.png does not exist (or is not a file); name a PNG or JPEG file for the first frame"),
    (["--checkpoint-path", "a.safetensors", "--gemma-root", "gemma", "--spatial-upsampler-path", "up.safetensors", "--distilled-lora", "d.safetensors", "1.0", "x"],
     "error: --distilled-lora takes a path and an optional strength, got d.safetensors 1.0 x"),
    (["--lora", "style.safetensors", "0.5", "x"], "error: --lora takes a path and an optional strength, got style.safetensors 0.5 x; repeat --lora for each LoRA"),
    (["--lora", "style.safetensors", "strong"], "error: --lora style.safetensors strong: the strength after the path must be a number, got 'strong'; e.g. --lora style.safetensors 1.0"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "error: --prompt-file /nonexistent/prompt.txt does not exist; name a UTF-8 text file holding the prompt"),
    (["--image-strength", "1.5"], "error: --image-strength must be a number from 0.0 to 1.0, got 1.5; leave it out for the default 1.0"),
    (["--last-image-strength", "0.5"], "error: --last-image-strength is 0.5 but no --last-image was given: it is the strength of the last frame image; "
                                       "give the --last-image too, or leave --last-image-strength at 1.0"),
    (["--last-image", "/nonexistent/last.png"], "error: --last-image /nonexistent/last.png does not exist (or is not a file); name a PNG or JPEG file for the last frame"),
    (["--last-image", "/nonexistent/last.png", "--stage2-parallel", "tdp"],
     "error: --stage2-parallel tdp cannot run with the 1 image latent that the two-stage pipeline appends to the video for its images: no tile can "
     "hold them; use --stage2-parallel auto or sp, and leave --tiles at auto"),
    (["--image", "/nonexistent/first.png", "--pipeline", "keyframes", "--tiles", "1x2"],
     "error: --tiles 1x2 cannot run with the 1 image latent that the keyframes pipeline appends to the video for its images: no tile can "
     "hold them; use --stage2-parallel auto or sp, and leave --tiles at auto"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), REFUSALS, ids=[" ".join(flags) for flags, _ in REFUSALS])
def test_a_bad_flag_is_refused_in_its_own_words_before_the_fleet_runs_a_job(fleet, tmp_path, capsys, monkeypatch, flags, message):
    before = jobs_served(fleet)
    prompt = [] if "--prompt-file" in flags else ["--prompt", PROMPT]
    code, err = generate_here(capsys, monkeypatch, *prompt, "--socket", str(fleet), "--output", str(tmp_path / "out.mp4"), *flags)
    assert code == 2 and err.splitlines()[-1] == message
    assert "Traceback" not in err and "(rank" not in err
    assert jobs_served(fleet) == before and not (tmp_path / "out.mp4").exists()


def test_output_paths_that_cannot_be_the_mp4_are_refused_before_any_job(fleet, tmp_path, capsys, monkeypatch):
    before = jobs_served(fleet)
    code, err = generate_here(capsys, monkeypatch, "--prompt", PROMPT, "--socket", str(fleet), "--output", str(tmp_path))
    assert code == 2 and err.splitlines()[-1] == f"error: --output {tmp_path} is a directory; name the mp4 file to write, e.g. {tmp_path / 'output.mp4'}"
    code, err = generate_here(capsys, monkeypatch, "--prompt", PROMPT, "--socket", str(fleet), "--output", str(tmp_path / "clip"))
    assert code == 2 and err.splitlines()[-1] == (
        f"error: --output {tmp_path / 'clip'} must end in .mp4 (the command writes H.264 video with AAC audio in an mp4); e.g. {tmp_path / 'clip.mp4'}"
    )
    assert jobs_served(fleet) == before


def test_an_unreadable_image_and_an_overlong_prompt_file_are_refused_without_a_traceback(fleet, tmp_path, capsys, monkeypatch):
    before = jobs_served(fleet)
    not_an_image = tmp_path / "first.png"
    not_an_image.write_text("not a picture")
    code, err = generate_here(capsys, monkeypatch, "--prompt", PROMPT, "--socket", str(fleet), "--image", str(not_an_image))
    assert code == 2 and err.splitlines()[-1].startswith(f"error: --image {not_an_image} is not an image that can be read (")
    assert err.splitlines()[-1].endswith("); use a PNG or JPEG file")
    long_prompt = tmp_path / "prompt.txt"
    long_prompt.write_text("snow " * 40_000, encoding="utf-8")  # 200000 characters: more than a command line takes
    code, err = generate_here(capsys, monkeypatch, "--prompt-file", str(long_prompt), "--socket", str(fleet))
    assert code == 2 and err.splitlines()[-1] == "error: a prompt is longer than 20000 characters; shorten it"
    assert "Traceback" not in err and jobs_served(fleet) == before


def test_an_empty_prompt_is_warned_about(fleet, tmp_path, capsys, monkeypatch):
    code, err = generate_here(capsys, monkeypatch, "--prompt", "  ", "--socket", str(fleet), "--output", str(tmp_path))
    lines = err.splitlines()
    assert lines[0] == "warning: the prompt is empty, so the video follows no text; describe the scene with --prompt or --prompt-file"
    assert code == 2 and lines[-1].startswith(f"error: --output {tmp_path} is a directory")


def test_a_job_whose_frames_cannot_fit_in_host_memory_is_refused_before_any_job(fleet, tmp_path, capsys, monkeypatch):
    from mgpu_backend.ltx.validation import GIB, available_memory_bytes

    frames = 99993  # 128x192 float32: 27.5 GiB per copy of the decoded frames
    available = available_memory_bytes(torch.device("cpu"))
    if 2 * frames * 128 * 192 * 3 * 4 <= available:
        pytest.skip(f"this machine has {available / GIB:.0f} GiB free: the decoded frames would fit")
    before = jobs_served(fleet)
    code, err = generate_here(capsys, monkeypatch, "--prompt", PROMPT, "--socket", str(fleet), "--num-frames", str(frames))
    last = err.splitlines()[-1]
    assert code == 2 and last.startswith("error: a 99993-frame 128x192 (height x width) video needs about 54.9 GiB of host memory for its decoded frames")
    assert last.endswith("is available; use fewer --num-frames or a smaller --height/--width")
    assert jobs_served(fleet) == before


def test_a_socket_where_nothing_listens_is_refused_instead_of_starting_a_one_rank_fleet(tmp_path, capsys, monkeypatch):
    directory = tmp_path / "nobody"
    directory.mkdir(mode=0o700)
    socket_path = directory / "fleet.sock"
    code, err = generate_here(capsys, monkeypatch, "--prompt", PROMPT, "--socket", str(socket_path))
    assert code == 2 and err.splitlines()[-1] == (
        f"error: no fleet server answers at --socket {socket_path}; start one there with 'python -m mgpu_backend serve --socket {socket_path}' "
        "(with --gpus or --cpu-ranks), add --gpus or --cpu-ranks to start one there for this run, or leave out --socket to use the default socket"
    )
    assert not socket_path.exists() and not (directory / "server.log").exists()


def test_mgpu_socket_where_nothing_listens_is_refused(tmp_path, capsys, monkeypatch):
    socket_path = tmp_path / "fleet.sock"
    monkeypatch.setenv("MGPU_SOCKET", str(socket_path))
    try:
        code = cli.main(["generate", "--prompt", PROMPT, "--cpu-ranks", "2"])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        f"error: no fleet server answers at $MGPU_SOCKET ({socket_path}); start one there with 'python -m mgpu_backend serve "
        f"--socket {socket_path}' (with --gpus or --cpu-ranks), or unset MGPU_SOCKET to use the default socket"
    )
    assert not socket_path.exists()


def test_a_truncated_checkpoint_is_refused_in_one_line(fleet, tmp_path, capsys, monkeypatch):
    from mgpu_backend.bundles.tiny import make_tiny_bundle

    bundle = make_tiny_bundle(tmp_path / "bundle")
    whole = Path(bundle.checkpoint_path).read_bytes()
    truncated = tmp_path / "ltx-2-truncated.safetensors"
    truncated.write_bytes(whole[: len(whole) // 2])
    code, err = generate_here(
        capsys, monkeypatch, "--prompt", PROMPT, "--socket", str(fleet), "--checkpoint-path", str(truncated), "--gemma-root", bundle.gemma_root,
        "--spatial-upsampler-path", bundle.spatial_upsampler_path, "--distilled-lora", bundle.distilled_lora_path,
    )  # fmt: skip
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"error: checkpoint {truncated} is damaged or incomplete (")
    assert lines[0].endswith("); download it again (compare its size with the original)")
    assert "Traceback" not in err


def test_float32_is_not_offered_to_the_two_stage_job(capsys, monkeypatch):
    code, err = generate_here(capsys, monkeypatch, "--prompt", PROMPT, "--dtype", "float32")
    assert code == 2 and err.splitlines()[-1] == "python -m mgpu_backend generate: error: argument --dtype: invalid choice: 'float32' (choose from 'bfloat16')"


# --- help, the other commands, the README ---------------------------------------------------------


def test_help_lists_no_internal_command_and_every_flag_shows_its_default():
    parser = cli.build_parser()
    usage = parser.format_help()
    assert "{serve,status,stop,make-tiny,generate,queue,doctor}" in usage and not re.search(r"\brank\b", usage)
    commands = parser._subparsers._group_actions[0].choices
    undocumented = [
        f"{name} {action.option_strings[0]}" for name in ("serve", "status", "stop", "make-tiny", "generate", "queue") for action in commands[name]._actions
        if action.option_strings and action.help != argparse.SUPPRESS and action.option_strings[0] != "-h"
        and not re.search(r"default|required", action.help or "", re.I)
    ]  # fmt: skip
    assert undocumented == []


def test_serve_with_gpus_on_a_machine_without_cuda_says_what_to_do(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible here")
    assert cli.main(["serve", "--gpus", "0,1", "--socket", str(Path(tempfile.mkdtemp()) / "fleet.sock")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --gpus 0,1 names CUDA GPUs, but none is visible (no CUDA device or driver, or CUDA_VISIBLE_DEVICES hides them); "
        "use --cpu-ranks N to run on the CPU"
    )


def test_generate_with_gpus_on_a_machine_without_cuda_is_refused_before_a_fleet_starts(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA is visible here")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # a default socket of its own, where nothing answers
    code, err = generate_here(capsys, monkeypatch, "--prompt", PROMPT, "--gpus", "0", "--output", str(tmp_path / "o.mp4"))
    assert code == 2 and err.splitlines()[-1] == (
        "error: --gpus 0 names CUDA GPUs, but none is visible (no CUDA device or driver, or CUDA_VISIBLE_DEVICES hides them); "
        "use --cpu-ranks N to run on the CPU"
    )
    assert not (tmp_path / "comfyui-mgpu" / "server.log").exists()


def test_queue_with_a_missing_workflow_file_says_so(tmp_path, capsys):
    assert cli.main(["queue", str(tmp_path / "t2v.json")]) == 2
    err = capsys.readouterr().err
    assert f"workflow file {tmp_path / 't2v.json'} does not exist; name an API-format workflow (e.g. one in workflows/api/)" in err
    assert "Traceback" not in err


def test_the_readme_socket_example_is_the_command_lines_default_socket_on_any_linux(monkeypatch):
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("export MGPU_SOCKET=")]
    assert len(lines) == 1
    path = lines[0].split("=", 1)[1].split()[0].replace("$UID", str(os.getuid()))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("MGPU_SOCKET", raising=False)
    with user_socket_by_default():
        assert Address.parse(path) == Address.parse(None) and Path(path).parent == private_dir()
    assert Path(path).parent.parent == Path(tempfile.gettempdir())


# --- the nodes refuse the same inputs before ComfyUI queues them ------------------------------------


def test_nodes_validate_their_widgets_before_queueing():
    sampler, upscale, loader = NODES["MGPUSPSampler"], NODES["MGPUTDPUpscale"], NODES["MGPULoadCheckpoint"]
    assert sampler.VALIDATE_INPUTS(width=768, height=512, length=121, frame_rate=24.0, seed=10, steps=40, stg_blocks="") is True
    # Each refusal names the one input at fault first: ComfyUI files it under every input of the signature.
    assert sampler.VALIDATE_INPUTS(width=768, height=512, length=120, frame_rate=24.0, seed=10, steps=40, stg_blocks="") == (
        "length: frames must be 8k+1 (the video VAE packs 8 frames per latent frame after the first), got 120; use 121"
    )
    assert sampler.VALIDATE_INPUTS(width=768, height=512, length=121, frame_rate=24.0, seed=10, steps=40, stg_blocks="x").startswith("stg_blocks: stg_blocks must be")
    assert upscale.VALIDATE_INPUTS(sigmas="0.625, 0.4, 0.0", tiles="auto", force_from_noise=False) is True
    assert upscale.VALIDATE_INPUTS(sigmas="0.1, 0.5, 0.0", tiles="auto", force_from_noise=False) == (
        "sigmas: sigmas must decrease strictly, got [0.1, 0.5, 0.0]; e.g. 0.909375, 0.725, 0.421875, 0.0"
    )
    assert upscale.VALIDATE_INPUTS(sigmas="0.625, 0.4, 0.0", tiles="2", force_from_noise=False).startswith("tiles: tiles must be 'auto' or HxW")
    assert sampler.VALIDATE_INPUTS(width=None, height=512, length=121, stg_blocks="") is True, "a linked input is checked when the node runs"
    encode = NODES["MGPUTextEncode"]
    assert encode.VALIDATE_INPUTS(positive=PROMPT, negative="") is True
    assert encode.VALIDATE_INPUTS(positive="  ", negative="") == "positive: the positive prompt is empty; describe the video and its sound"
    assert encode.VALIDATE_INPUTS(positive="snow " * 5000, negative="") == "positive: a prompt has 25000 characters; the limit is 20000: shorten it"
    none = "(none)"
    assert loader.VALIDATE_INPUTS(distilled_lora=none, dtype="float32") is True
    assert loader.VALIDATE_INPUTS(distilled_lora="(embedded tiny LTX-2, random weights)", dtype="float32") == (
        "distilled_lora: dtype float32 cannot be used with the distilled LoRA (stage 2 of the two-stage job fuses it): ltx-core fuses LoRAs only "
        "into bfloat16 (or fp8-cast) weights; use dtype bfloat16 (optionally with quantization fp8-cast), or a model without LoRAs"
    )


# --- audio as long as the video -------------------------------------------------------------------


def test_the_waveform_is_cut_or_padded_with_silence_to_the_video_duration():
    assert audio_sample_count(9, 24.0, 24000) == 9000 and audio_sample_count(121, 24.0, 24000) == 121000
    short = torch.ones(1, 2, 8184)  # what the tiny bundle's vocoder makes for 9 frames: 0.341 s
    fitted = fit_audio_to_video(short, 9, 24.0, 24000)
    assert fitted.shape == (1, 2, 9000) and torch.equal(fitted[..., :8184], short) and not fitted[..., 8184:].any()
    long = torch.arange(10_000.0).expand(2, -1)
    assert torch.equal(fit_audio_to_video(long, 9, 24.0, 24000), long[:, :9000])


# --- through the ranks ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_on_a_fleet_with_other_devices_warns_of_each_flag_not_applied_and_its_audio_lasts_as_long_as_its_video(fleet, tmp_path, cache_dir):
    output, dump = tmp_path / "fox.mp4", tmp_path / "fox.safetensors"
    completed = generate_subprocess(
        cache_dir, "--prompt", PROMPT, "--socket", str(fleet), "--cpu-ranks", "3", "--compile-blocks", "--output", str(output), "--debug-dump", str(dump)
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert (
        "warning: --compile-blocks not applied: the fleet runs on 2 CPU rank(s), and only GPU ranks compile the blocks; the blocks run eagerly"
    ) in completed.stderr.splitlines()
    assert (
        f"warning: --cpu-ranks 3 not applied: the fleet at {fleet} already runs on 2 CPU rank(s); this run uses it as it is "
        "(stop it with 'python -m mgpu_backend stop' to start one with your devices)"
    ) in completed.stderr.splitlines()
    (stage2_line,) = [line for line in completed.stderr.splitlines() if line.startswith("stage-2 plan")]
    assert "tiled data parallel on 2 ranks for" in stage2_line and stage2_line.count("stage-1 audio") == 1, stage2_line
    assert re.search(r"^wrote .*fox\.mp4 \(9 frames 128x192 \(height x width\), audio (\d+) Hz\)", completed.stdout, re.M)
    sample_rate = int(re.search(r"audio (\d+) Hz", completed.stdout).group(1))
    waveform = load_file(str(dump))["waveform"]
    assert waveform.shape[-1] == audio_sample_count(9, 24.0, sample_rate) == sample_rate * 9 // 24


def test_an_input_error_found_by_the_ranks_carries_no_rank_label_and_no_traceback(fleet, tmp_path, cache_dir):
    completed = generate_subprocess(cache_dir, "--prompt", PROMPT, "--socket", str(fleet), "--video-stg-blocks", "99", "--output", str(tmp_path / "o.mp4"))
    assert completed.returncode == 1
    last = completed.stderr.splitlines()[-1]
    assert re.fullmatch(
        r"error: video stg_blocks \[99\] name blocks \[99\] outside this model's (\d+) transformer blocks \(0\.\.\d+\); use blocks in that "
        r"range \(the official LTX-2 default \[29\] is for the 48-block model\), or set the video stg scale to 0", last
    ), last
    assert "(rank" not in completed.stderr and "Traceback" not in completed.stderr
    assert "stage1 [" not in completed.stderr, "refused before the first stage-1 step"
    assert not (tmp_path / "o.mp4").exists()


def test_embedded_spec_carries_user_loras_so_the_flag_takes_effect(tmp_path, capsys, monkeypatch):
    from mgpu_backend.tools.generate import build_spec

    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"")  # only its existence is checked before the fleet: the ranks read it
    args = cli.build_parser().parse_args(["generate", "--prompt", PROMPT, "--lora", str(lora), "0.5"])
    spec, tiny = build_spec(args)
    assert tiny and spec["checkpoint_path"] == EMBEDDED_TINY and spec["loras"] == [[str(lora), 0.5]]


def test_an_input_error_is_shown_without_a_rank_in_the_cli_and_in_a_node(monkeypatch):
    from mgpu_backend.fleet.client import FleetError
    from mgpu_backend.tools.generate import describe_fleet_error

    from tests.helpers import FakeComfy, fleet_job

    input_error = FleetError("frames must be 8k+1, got 10; use 9", kind="input_error", rank=1, traceback="Traceback ...")
    fault = FleetError("out of memory on cuda:1", rank=1, traceback="Traceback ...\nOutOfMemoryError")
    assert describe_fleet_error(input_error) == "error: frames must be 8k+1, got 10; use 9"
    assert describe_fleet_error(fault) == "error (rank 1): out of memory on cuda:1\nTraceback ...\nOutOfMemoryError"
    FakeComfy(monkeypatch)

    def failing(*, progress, should_cancel):
        raise input_error

    with pytest.raises(RuntimeError) as raised:
        fleet_job.FleetJob("3", "SP Sampler").call(failing)
    assert str(raised.value) == "SP Sampler: frames must be 8k+1, got 10; use 9"
