"""A rank of a warm LTX-2 fleet dies: only its replacement reads the model again, the survivor keeps
its weights (with the distilled LoRA fused when the rank died), and the results stay the same.
Real server process, sockets, two gloo CPU ranks, the tiny bundle."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from mgpu_backend.fleet.client import FleetClient

from .fleet_harness import wait_gone
from .helpers import NEGATIVE, PROMPT, SINGLE_GPU_SIGMAS, context_tensors, sample_args


@pytest.fixture(scope="module")
def fleet(fleet_of):
    return fleet_of(2, "--rank-timeout", "60")


def mib_read(lines: list[str], job: str) -> dict[int, float]:
    """Per rank, the MiB the job's log line says it read from disk ('[rank 0-1] load: 0.0 MiB ...')."""
    found = {}
    for line in lines:
        label, _, text = line.partition("] ")
        if text.startswith(f"{job}: ") and "MiB read from disk" in text:
            ranks = label.removeprefix("[rank ")
            first, _, last = ranks.partition("-")
            for rank in range(int(first), int(last or first) + 1):
                found[rank] = float(text.split(": ")[1].split(" MiB")[0])
    return found


def test_after_a_rank_dies_only_its_replacement_reads_the_model_and_results_are_unchanged(fleet, spec):
    with FleetClient.connect(str(fleet), autostart=False) as client:
        cold = []
        client.run("load", {"spec": spec}, on_log=cold.append)
        full = mib_read(cold, "load")
        assert full[0] == full[1] > 1.0, cold
        encoded = client.run("encode", {"spec": spec, "prompts": [PROMPT, NEGATIVE]})
        contexts = context_tensors(encoded)
        before = client.run("sample", sample_args(spec, parallel="sp"), contexts)
        # Stage 2 leaves the distilled LoRA fused in the working copies when the rank dies.
        stage2_inputs = {**before.tensors, "positive_video_context": contexts["positive_video_context"], "positive_audio_context": contexts["positive_audio_context"]}
        upscaled = client.run("upscale", {"spec": spec, "seed": 7, "sigmas": SINGLE_GPU_SIGMAS, "tiles": [1, 1]}, stage2_inputs)

        pids = [rank["pid"] for rank in client.status()["ranks"]]
        os.kill(pids[1], signal.SIGKILL)
        assert wait_gone([pids[1]]) == []

        after_kill = []
        client.run("load", {"spec": spec}, on_log=after_kill.append)
        read = mib_read(after_kill, "load")
        # The replacement reads a cold load (and the distilled LoRA, to undo it with the survivor).
        assert read[0] == 0.0 and full[1] <= read[1] < 1.1 * full[1], after_kill
        status = client.status()
        assert status["ranks"][0]["pid"] == pids[0] and status["ranks"][1]["pid"] != pids[1]

        again = client.run("sample", sample_args(spec, parallel="sp"), contexts)
        for name in ("video_latent", "audio_latent"):
            assert torch.equal(again.tensors[name], before.tensors[name]), f"stage-1 {name} changed after the replacement"
        upscaled_again = client.run("upscale", {"spec": spec, "seed": 7, "sigmas": SINGLE_GPU_SIGMAS, "tiles": [1, 1]}, stage2_inputs)
        assert torch.equal(upscaled_again.tensors["video_latent"], upscaled.tensors["video_latent"]), "stage 2 changed after the replacement"
