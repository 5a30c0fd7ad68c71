"""The sharded-memory benchmark's estimates and its whole-job mode.

The estimate of each job of a whole job (``residency.job_peaks``) for the real LTX-2.3 22B sizes (the
full-size bundle's headers: nothing is allocated), the planner's count of Gemma on ranks that share a
GPU (rank 0 builds it whole there, so a 24 GiB cap cannot hold the 22B's encode and is refused before
loading, saying why), and ``bench/sharded_memory.py --whole-job --tiny``: real fleets of CPU ranks
running the whole two-stage and distilled jobs sharded, and refusing a case whose cap is too small in the fleet's words.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mgpu_backend.fleet.shared_gpu import SHARED_GPU_RANKS_ENV
from mgpu_backend.ltx.residency import (
    AUDIO_DECODE_ACTIVATION_BYTES,
    DECODE_TILE_ACTIVATION_BYTES,
    ENCODE_HEADROOM_BYTES,
    GIB,
    ResidencyError,
    gemma_gpus,
    job_peaks,
    plan_residency,
    video_decode_activation_bytes,
)

from .helpers import full_size_sizes

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sizes_22b():
    return full_size_sizes("ltx2.3-22b-transformer.json")


def test_ranks_sharing_one_gpu_spread_gemma_over_that_gpu_only():
    assert gemma_gpus(4, {}) == 4
    assert gemma_gpus(4, {SHARED_GPU_RANKS_ENV: "4"}) == 1
    assert gemma_gpus(8, {SHARED_GPU_RANKS_ENV: "4"}) == 2


def test_4_ranks_sharing_one_gpu_at_24_gib_stream_the_part_of_gemma_rank_0_has_no_room_for(sizes_22b):
    # On 4 GPUs, Gemma spreads over them (5.7 GiB each, then the 5.9 GiB processor): stage 2 sets the
    # 19.3 GiB per GPU, without parking the shard or streaming.
    on_4_gpus = plan_residency(sizes_22b, 24 * GIB, 4, "sharded", gemma_split=4)
    assert round(on_4_gpus.peak_bytes / GIB, 1) == 19.3 and not on_4_gpus.transformer_parked_for_encode, on_4_gpus.describe()
    assert not on_4_gpus.gemma_streamed
    # On one shared GPU rank 0 builds Gemma (22.7 GiB) alone; with the shard parked it still needs 24.7 GiB whole
    # with the encode's activations, so the part beyond 24 GiB stays in host memory and is streamed at the encode.
    shared = plan_residency(sizes_22b, 24 * GIB, 4, "sharded", gemma_split=1)
    assert shared.gemma_streamed and shared.transformer_parked_for_encode and shared.peak_bytes == 24 * GIB, shared.describe()
    peaks = job_peaks(sizes_22b, shared, 1 * GIB, 2 * GIB, 2 * GIB)
    on_gpu = peaks["encode"] - ENCODE_HEADROOM_BYTES
    assert round(on_gpu / GIB, 1) == 22.0 and on_gpu > sizes_22b.components["embeddings_processor"], peaks  # of Gemma's 22.7 GiB
    # A cap that leaves Gemma less than its token embeddings and two layers is refused.
    floor = sizes_22b.gemma_streamed_bytes + ENCODE_HEADROOM_BYTES
    with pytest.raises(ResidencyError) as refused:
        plan_residency(sizes_22b, floor - GIB, 4, "sharded", gemma_split=1)
    assert "even with its transformer sharded over 4 ranks" in str(refused.value)


def test_the_22b_two_stage_job_on_4_ranks_sharing_one_gpu_at_32_gib_is_estimated_job_by_job(sizes_22b):
    plan = plan_residency(sizes_22b, 32 * GIB, 4, "sharded", gemma_split=1)
    assert plan.transformer_parked_for_encode and plan.clean_shard_on_host and plan.clean_device_bytes == 0, plan.describe()
    assert not plan.gemma_streamed, plan.describe()
    stage1, stage2, video = 1 * GIB, 2 * GIB, video_decode_activation_bytes(1536, 1024, 121, 4)
    peaks = job_peaks(sizes_22b, plan, stage1, stage2, video)
    parts = sizes_22b.components
    sharded = sizes_22b.sharded_transformer(None, 4)  # the shard, four block-sized gather buffers, the rest
    at_rest = sizes_22b.sharded_transformer_at_rest(None, 4)  # between forwards: the shard, and the rest as a margin
    assert peaks["load"] == math.ceil(sizes_22b.transformer_bytes / 4) + parts["embeddings_processor"]  # the largest build of the load
    assert peaks["encode"] == parts["gemma"] + ENCODE_HEADROOM_BYTES  # parked: Gemma whole in rank 0, then the processor alone
    assert peaks["stage 1"] == sharded + parts["video_encoder"] + stage1
    assert peaks["upscale"] == sharded + parts["video_encoder"] + parts["spatial_upsampler"] + stage2
    # The video decodes with its decoder alone built; the audio decoder and vocoder come after it.
    decoders = parts["video_decoder"] + parts["audio_decoder"] + parts["vocoder"]
    assert peaks["decode"] == max(at_rest + parts["video_decoder"] + video, at_rest + decoders + AUDIO_DECODE_ACTIVATION_BYTES)
    assert at_rest == -(-sizes_22b.transformer_bytes // 4) + sizes_22b.outside_blocks_bytes[0] < sharded
    assert round(peaks["encode"] / GIB, 1) == 24.7 and round(peaks["stage 1"] / GIB, 1) == 14.1 and round(peaks["decode"] / GIB, 1) == 13.6
    # The plan's own peak (6 GiB of headroom per stage) is the encode's here: the job's estimate equals it.
    assert plan.peak_bytes == peaks["encode"] == max(peaks.values())


# Rank 0's decode peaks measured on one H100 80GB (ranks sharing it, bench/whole_job_queue.sh,
# 2026-12-07 15:44-16:07 UTC) and one H200 (2026-12-02), LTX-2.3 22B sharded, 121 frames, in GiB:
# (weights, ranks, cap GiB, width, height) -> measured.
MEASURED_DECODE_PEAKS_GIB = {
    (None, 4, 24, 1280, 704): 11.53,
    (None, 4, 24, 1536, 1024): 12.88,
    ("fp8-cast", 2, 24, 768, 512): 11.21,
    ("fp8-cast", 2, 24, 1280, 704): 11.74,
    ("fp8-cast", 2, 24, 1536, 1024): 13.09,
    (None, 2, 32, 1280, 704): 20.36,
    (None, 2, 32, 1536, 1024): 21.72,
}


def test_the_decode_estimate_follows_the_frame_size_and_stays_within_10_percent_above_the_measured_peaks(sizes_22b):
    errors = {}
    for (quantization, ranks, cap_gib, width, height), measured_gib in MEASURED_DECODE_PEAKS_GIB.items():
        plan = plan_residency(sizes_22b, cap_gib * GIB, ranks, "sharded", quantization, gemma_split=1)
        video = video_decode_activation_bytes(width, height, 121, ranks)
        estimate = job_peaks(sizes_22b, plan, 1 * GIB, 1 * GIB, video)["decode"] / GIB
        errors[(quantization, ranks, width, height)] = round((estimate - measured_gib) / measured_gib * 100, 1)
    print(f"decode estimate vs measured peak, %: {errors}")
    assert all(0 <= error <= 10 for error in errors.values()), errors
    # The video's term grows with the frame (rank 0's window and hand-outs; 1536x1024 has 1.75 times
    # the pixels of 1280x704), not with the rank count; a small video's is the tile's activations and more.
    small, template, large = (video_decode_activation_bytes(width, height, 121, 2) for width, height in ((768, 512), (1280, 704), (1536, 1024)))
    assert DECODE_TILE_ACTIVATION_BYTES < small < template and large / template > 1.5, (small, template, large)
    assert video_decode_activation_bytes(1536, 1024, 121, 4) == video_decode_activation_bytes(1536, 1024, 121, 2)


def run_bench(*args: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("MGPU_")}
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "sharded_memory.py"), *args], capture_output=True, text=True, timeout=900, cwd=REPO,
        env={**environment, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


@pytest.mark.slow
def test_whole_job_tiny_runs_both_recipes_sharded_and_shows_a_too_small_cap_refused_in_the_fleets_words(tmp_path):
    completed = run_bench(
        "--whole-job", "--tiny", "--recipes", "two-stage", "distilled", "--ranks", "2", "--cap-gib", "24", "5", "--out", str(tmp_path / "t.md"),
        "--partial-out", str(tmp_path / "partial.md"),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    table = [line for line in completed.stdout.splitlines() if line.startswith(("| two-stage", "| distilled"))]
    two_stage = {(row[3], row[5]): row for row in ([cell.strip() for cell in line.split("|")[1:-1]] for line in table) if row[0] == "two-stage"}
    assert two_stage[("24", "**whole job**")][10] == "finished"  # its --steps 2 stage 1 runs whole: nothing cancelled
    assert two_stage[("5", "**whole job**")][10].startswith("refused at load: this model needs about 6.0 GiB per GPU")
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table if line.startswith("| distilled")]
    by_case = {(row[1], row[3], row[5]): row for row in rows}
    # One fleet per recipe, rank count and cap serves both sizes: each size runs its own stages and ends on its own.
    for size in ("192x128x9", "256x128x9"):
        assert [phase for at, cap, phase in by_case if (at, cap) == (size, "24")] == ["load", "encode", "stage 1", "upscale", "decode", "**whole job**"]
        ended = by_case[(size, "24", "**whole job**")][10]
        assert ended.startswith("finished (stage 1 stopped after ") and ended.endswith(" of its 8 steps)"), ended
        # Cancelled near --steps 2: the cancel is sent once step 1 is reported and races the ranks' next cancel point.
        assert 1 <= int(ended.split("after ")[1].split(" of")[0]) < 8, ended
        assert by_case[(size, "24", "decode")][6] == "n/a (CPU)" and float(by_case[(size, "24", "decode")][8]) > DECODE_TILE_ACTIVATION_BYTES / GIB  # no peak on CPU; the estimate stands
        refused = by_case[(size, "5", "**whole job**")][10]
        assert refused.startswith("refused at load: this model needs about 6.0 GiB per GPU even with its transformer sharded over 2 ranks"), refused
        assert [phase for at, cap, phase in by_case if (at, cap) == (size, "5")] == ["**whole job**"]
    assert "residency sharded" in completed.stdout and (tmp_path / "t.md").read_text().count("| distilled") == len(rows)
    # Each case's rows reach the partial file when the case ends, so a call cut short keeps what it measured.
    partial = [line for line in (tmp_path / "partial.md").read_text().splitlines() if line.startswith(("| two-stage", "| distilled"))]
    assert partial == table
