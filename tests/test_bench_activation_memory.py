"""``bench/activation_memory.py --tiny``: the transformer forward's activation peak per rank at three
video sizes, on one CPU rank and on two gloo ranks under SP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "activation_memory.py"


def test_tiny_run_measures_peaks_that_grow_with_the_video_and_shrink_with_sp():
    completed = subprocess.run([sys.executable, str(BENCH), "--tiny", "--sp", "1", "2"], capture_output=True, text=True,
                               timeout=600, cwd=REPO, check=False)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in completed.stdout.splitlines() if line.startswith("| ")]
    header, *rows = rows
    assert header[0] == "SP degree" and header[-1] == "widths per token (estimate: 16)", header
    assert [(row[0], row[2], row[3]) for row in rows] == [
        ("1", "384", "384"), ("1", "768", "768"), ("1", "1536", "1536"),
        ("2", "384", "192"), ("2", "768", "384"), ("2", "1536", "768"),
    ]  # fmt: skip
    peaks = {(int(row[0]), int(row[2])): float(row[4]) for row in rows}
    for degree in (1, 2):  # a longer video needs more: the activations are measured, not a constant
        assert peaks[degree, 384] < peaks[degree, 768] < peaks[degree, 1536], peaks
    for tokens in (384, 768, 1536):  # each of two SP ranks holds less than one rank holding every token
        assert peaks[2, tokens] < peaks[1, tokens], peaks
    widths = [float(row[6]) for row in rows if row[6]]
    assert len(widths) == 4 and all(width > 0 for width in widths), widths
