"""``bench/res2s_step.py --tiny``: one res_2s step of the HQ recipe's stage 1, ours against the official
loop, on the CPU. The two sides' latents must be equal bitwise, and the transformer calls per stage
must be what res_2s makes: two evaluations per step plus a final one, each running the recipe's
three guidance passes (Euler: one evaluation per step). Nothing here asserts a time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "res2s_step.py"


@pytest.mark.slow
def test_tiny_run_gives_the_official_latents_bitwise_with_two_evaluations_per_step():
    completed = subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--warmup", "1", "--repeats", "1"], capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    header, *rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in completed.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert header[2:5] == ["stepper", "steps timed", "s/step"], header
    by_stepper = {row[2]: row for row in rows}
    assert list(by_stepper) == ["official res_2s", "ours res_2s", "ours Euler"]
    # 3 steps: (2 x 3 + 1) evaluations x 3 passes for res_2s, 3 x 3 for Euler.
    assert [by_stepper[name][6] for name in by_stepper] == ["21 (3 steps)", "21 (3 steps)", "9 (3 steps)"]
    assert by_stepper["ours res_2s"][7] == "0 / 0", by_stepper["ours res_2s"]
    assert all(float(row[4]) > 0 for row in rows)
    assert by_stepper["ours res_2s"][:2] == ["192x128x9", "48"]
