"""The command line as a user types it: sub-commands, their errors and exit codes."""

from __future__ import annotations

import pytest

from mgpu_backend.bundles.tiny import make_tiny_bundle

from tests.helpers import cli


def test_make_tiny_writes_the_same_bundle_as_the_library(tmp_path):
    completed = cli("make-tiny", str(tmp_path / "cli"))
    assert completed.returncode == 0, completed.stderr
    assert "checkpoint_path" in completed.stdout
    library = make_tiny_bundle(tmp_path / "lib")
    for name in ("ltx-2-tiny.safetensors",):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "lib" / name).read_bytes()
    assert library.checkpoint_path.endswith("ltx-2-tiny.safetensors")


def test_generate_refuses_sizes_that_are_not_multiples_of_64_before_starting_anything(tmp_path):
    completed = cli("generate", "--prompt", "x", "--height", "100", "--output", str(tmp_path / "o.mp4"), "--cpu-ranks", "1",
                    env_extra={"MGPU_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
    assert completed.returncode != 0
    assert "error: --height must be a multiple of 64 for the two-stage graph (stage 1 runs at half size), got 100; use 128" in completed.stderr
    assert not (tmp_path / "o.mp4").exists()


def test_generate_with_half_a_real_model_says_which_flags_are_missing(tmp_path):
    completed = cli("generate", "--prompt", "x", "--checkpoint-path", str(tmp_path / "a.safetensors"))
    assert completed.returncode != 0
    assert "--gemma-root" in completed.stderr and "--distilled-lora" in completed.stderr


def test_status_and_stop_without_a_server_say_how_to_start_one(tmp_path):
    socket_dir = tmp_path / "s"
    socket_dir.mkdir(mode=0o700)
    for command in ("status", "stop"):
        completed = cli(command, "--socket", str(socket_dir / "fleet.sock"))
        assert completed.returncode == 1
        assert "python -m mgpu_backend serve" in completed.stderr


def test_serve_rejects_both_gpus_and_cpu_ranks():
    completed = cli("serve", "--gpus", "0", "--cpu-ranks", "2")
    assert completed.returncode == 2
    assert "not allowed with argument" in completed.stderr


@pytest.mark.parametrize(("flags", "words"), [
    (("--stage1-sigmas", "0.9,0.5,0"), "error: --stage1-sigmas: stage-1 sigmas must run from 1.0 (stage 1 starts from pure noise) down to 0.0 (a clean latent), got 0.9 ... 0"),
    (("--stage1-sigmas", "1,0.5,0", "--num-inference-steps", "4"), "error: --num-inference-steps 4 contradicts --stage1-sigmas (2 steps); drop --num-inference-steps"),
    (("--stage1-sigmas", "1,half,0"), "error: --stage1-sigmas takes numbers separated by commas, got '1,half,0'"),
    (("--sampler", "dpm"), "argument --sampler: invalid choice: 'dpm'"),
    (("--cfg-1", "--video-cfg-guidance-scale", "3"), "error: --cfg-1 sets every guidance scale; drop --video-cfg-guidance-scale (or --cfg-1)"),
    (("--cfg-1", "--negative-prompt", "blurry"), "error: --cfg-1 runs no unconditional pass, so no negative prompt is read; drop --negative-prompt"),
    (("--cfg-1", "--pipeline", "distilled"), "error: --cfg-1 do(es) not apply to --pipeline distilled (one unguided pass per step); drop them"),
])  # fmt: skip
def test_generate_refuses_a_bad_stage1_schedule_or_sampler_before_starting_anything(tmp_path, flags, words):
    completed = cli("generate", "--prompt", "x", *flags, "--output", str(tmp_path / "o.mp4"), "--cpu-ranks", "1", env_extra={"MGPU_CACHE_DIR": str(tmp_path / "cache")})
    assert completed.returncode != 0
    assert words in completed.stderr, completed.stderr
    assert not (tmp_path / "o.mp4").exists()
