#!/bin/bash
# The weight-sharded memory proof on one GPU, queued: the GPU tests of the streamed Gemma and of
# parking, then one whole-job case after the other (bench/sharded_memory.py --whole-job), each
# appending its rows to OUT/partial.md as it ends, so that a run cut short keeps what it measured.
# Start it detached on a machine that may outlive one command, and collect OUT when you like:
#
#   setsid nohup bash bench/whole_job_queue.sh /tmp/queue > /tmp/queue.log 2>&1 < /dev/null &
#   cat /tmp/queue/progress; cat /tmp/queue/partial.md        # OUT/DONE appears at the end
#
# Run it where the project's requirements import (on the project's GPU machine: after the install line
# of docs/fp8-and-residency.md, PYTHONPATH exported). Its NCCL settings are the caller's environment.
# Needs one GPU, about 70 GB of disk for the bundle (BUNDLE_DIR) and 23 GB of /dev/shm for its Gemma.
# Four 32 GiB caps add up to more than an H100's 80 GB, but a cap is a limit, not a reservation: the
# ranks' peaks at once stay near 51 GiB there (Gemma whole on rank 0, the shards on the others), so
# every case should run on an H100 as on an H200. Cases run in the order below: the ones not yet
# measured to the end first (docs/BENCHMARKS.md, "The queued whole jobs"). About 5-11 minutes a case
# after the bundle (100 s). EXTRA_ARGS is added to every case and FIRST_CASES=N runs only the first N:
# `EXTRA_ARGS=--tiny FIRST_CASES=1` is a CPU smoke run. GPU_TESTS=0 leaves the GPU tests out (a rerun
# that only needs the whole jobs).
set -u
out=${1:?usage: whole_job_queue.sh OUT_DIR}
bundle=${BUNDLE_DIR:-/tmp/b22}
gemma=${GEMMA_DIR:-/dev/shm/g22}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cases=(
  "--recipes two-stage --quantization fp8-cast --targets 1280x704 1536x1024 --ranks 2 --cap-gib 24"
  "--recipes two-stage --targets 1280x704 1536x1024 --ranks 2 --cap-gib 32"
  "--recipes distilled --targets 1280x704 1536x1024 --ranks 4 --cap-gib 32"
  "--recipes two-stage --targets 1280x704 1536x1024 --ranks 4 --cap-gib 32"
  "--recipes distilled --targets 1280x704 1536x1024 --ranks 4 --cap-gib 24"
  "--recipes two-stage --targets 1280x704 1536x1024 --ranks 4 --cap-gib 24"
  "--recipes distilled --quantization fp8-cast --targets 768x512 1280x704 1536x1024 --ranks 2 --cap-gib 24"
)
[ "${GPU_TESTS:-1}" = 0 ] || (
  python3 -m pytest tests/test_distributed_gemma.py tests/test_weight_tracker.py -m gpu -rA --tb=long -p no:cacheprovider > "$out/gpu-tests.txt" 2>&1
  rc=$?  # before any expansion: $(date) would set $? again
  echo "gpu tests ended $(date -u +%T) rc=$rc" >> "$out/progress"
) &
number=0
for case in "${cases[@]:0:${FIRST_CASES:-${#cases[@]}}}"; do
  number=$((number + 1))
  echo "case $number started $(date -u +%T): $case" >> "$out/progress"
  # shellcheck disable=SC2086 # the case's words are the bench's arguments
  python3 bench/sharded_memory.py --whole-job --version 2.3 --steps 1 --bundle-dir "$bundle" --gemma-dir "$gemma" \
    --partial-out "$out/partial.md" --fleet-log "$out/fleet$number" --out "$out/whole-job.md" $case ${EXTRA_ARGS:-} > "$out/case$number.log" 2>&1
  rc=$?
  echo "case $number ended $(date -u +%T) rc=$rc" >> "$out/progress"
done
wait
echo "all ended $(date -u +%T)" >> "$out/progress"
touch "$out/DONE"
