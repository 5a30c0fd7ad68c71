"""The stage-1 scaling benchmark ``bench/scaling.py`` on CPU ranks: both recipes, both model versions.

Each run is real: the benchmark starts gloo fleets of 1 and 2 CPU ranks, builds the tiny random
transformer on every rank and runs the fleet's own stage-1 job per plan. The two-stage recipe runs
its four guidance passes, so guidance groups apply; the distilled recipe runs one unguided pass per
step over its fixed sigmas, so the benchmark skips the guidance-group plans and says why. Nothing
here asserts a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_backend.ltx.schema import DISTILLED_SIGMAS
from mgpu_backend.parallel.guidance_parallel import ONE_PASS_NO_GROUPS

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "scaling.py"
BF16_NOISE = 0.05  # 2 layers in bfloat16: rounding of a sharded sum stays far below this


def run_bench(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MGPU_")}
    return subprocess.run(
        [sys.executable, str(BENCH), "--tiny", "--worlds", "1,2", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={**environment, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def table_rows(stdout: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header, *rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]
    assert header[:4] == ["stage-1 size", "video tokens", "GPUs", "plan (groups x SP)"], header
    return [{"size": row[0], "world": int(row[2]), "plan": row[3], "diffs": [float(v) for v in row[7].split(" / ")]} for row in rows]


@pytest.mark.slow
def test_two_stage_recipe_times_sp_and_guidance_groups_against_one_rank():
    completed = run_bench("--plans", "sp,guidance")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "LTX-2.0 two-stage stage 1: 4 steps, 4 passes per step" in completed.stdout
    assert "skipped" not in completed.stdout + completed.stderr
    rows = table_rows(completed.stdout)
    for size in ("96x64x9", "192x128x17"):
        layouts = [row["plan"] for row in rows if row["size"] == size]
        assert layouts == ["sp (1 x 1)", "sp (1 x 2)", "guidance (2 x 1)"], rows
    for row in rows:
        assert all(diff <= BF16_NOISE for diff in row["diffs"]), row


@pytest.mark.slow
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_distilled_recipe_runs_the_sp_plans_and_says_why_guidance_groups_are_skipped(tmp_path, version):
    out = tmp_path / "scaling.md"
    completed = run_bench("--pipeline", "distilled", "--model", version, "--plans", "sp,guidance,hybrid,auto", "--out", str(out))
    assert completed.returncode == 0, completed.stderr[-3000:]
    for plan in ("guidance", "hybrid"):
        assert f"plan {plan} skipped for the distilled pipeline: {ONE_PASS_NO_GROUPS}" in completed.stderr.splitlines()
    # The ranks ran the recipe's fixed sigmas, one pass per step.
    assert f"LTX-{version} distilled stage 1: {len(DISTILLED_SIGMAS) - 1} steps, 1 pass per step" in completed.stdout
    rows = table_rows(completed.stdout)
    for size in ("96x64x9", "192x128x17"):
        # auto agrees with the planner: one pass leaves nothing for a second group, so SP over both ranks.
        assert [row["plan"] for row in rows if row["size"] == size] == ["sp (1 x 1)", "sp (1 x 2)", "auto (1 x 2)"], rows
    for row in rows:
        assert all(diff <= BF16_NOISE for diff in row["diffs"]), row
    written = out.read_text()
    assert written.startswith("\n`python ") and "--pipeline distilled" in written
    assert f"plan hybrid skipped: {ONE_PASS_NO_GROUPS}" in written and "| 192x128x17 | 72 | 2 | auto (1 x 2) |" in written


def test_distilled_recipe_refuses_a_step_count_or_plans_it_cannot_run_before_starting_a_fleet():
    completed = run_bench("--pipeline", "distilled", "--steps", "4")
    assert completed.returncode != 0
    assert f"--steps 4: the distilled pipeline runs its 8 fixed sigmas {list(DISTILLED_SIGMAS)}; leave --steps out" in completed.stderr
    completed = run_bench("--pipeline", "distilled", "--plans", "guidance")
    assert completed.returncode != 0
    assert "none of --plans guidance applies to the distilled pipeline; ask for sp or auto" in completed.stderr
    assert "world 1" not in completed.stderr, "no fleet may start for a refused run"
