"""``bench/adaln_timesteps.py --tiny``: ltx-core's forward with a timestep per token and with one per
sample, on the CPU; the table says whether the outputs are bitwise equal, and says it consistently."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "adaln_timesteps.py"


def test_the_per_sample_input_is_the_per_token_one_with_one_timestep(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import adaln_timesteps

    config = adaln_timesteps.bench_config("2.0", tiny=True)["transformer"]
    geometry = adaln_timesteps.TINY["384x256x17"]
    video, audio = adaln_timesteps.per_token_inputs(config, geometry, torch.device("cpu"), torch.float32, 1)
    assert video.timesteps.shape == (1, 288, 1) and audio.timesteps.shape == (1, 18, 1)
    assert torch.all(video.timesteps == adaln_timesteps.SIGMA) and torch.all(audio.timesteps == adaln_timesteps.SIGMA)
    one = adaln_timesteps.per_sample(video)
    assert one.timesteps.shape == (1, 1, 1) and torch.all(one.timesteps == adaln_timesteps.SIGMA)
    assert one.latent is video.latent and one.positions is video.positions and one.context is video.context


@pytest.mark.parametrize("model", ["2.0", "2.3"])
def test_tiny_run_prints_both_timings_and_a_bitwise_verdict_that_matches_the_difference(model):
    completed = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--model", model, "--warmup", "0", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in completed.stdout.splitlines() if line.startswith("| ")]
    header, *rows = rows
    assert header[:5] == ["size (WxHxF)", "video + audio tokens", "ms, timestep per token", "ms, timestep per sample", "speed-up"]
    assert [row[:2] for row in rows] == [["384x256x17", "288 + 18"], ["384x256x25", "384 + 26"]]
    for row in rows:
        token_ms, sample_ms, speed_up = (float(cell) for cell in row[2:5])
        assert token_ms > 0 and sample_ms > 0 and speed_up == pytest.approx(token_ms / sample_ms, rel=0.03, abs=0.002)
        video_diff, audio_diff = (float(value) for value in row[7].split(" / "))
        assert (row[5] == "yes") == (video_diff == 0) and (row[6] == "yes") == (audio_diff == 0), row
        # Same arithmetic up to the AdaLN projection's rounding: any difference is float rounding.
        assert video_diff < 1e-4 and audio_diff < 1e-4, row
    assert re.search(rf"LTX-{re.escape(model)} random transformer \(tiny\), float32, sigma 0\.9, median of 1\.", completed.stdout)
