"""The guidance passes of one stage-1 denoising step, and the interface that runs them.

LTX-2 stage 1 calls the transformer up to four times per step (conditional, unconditional,
STG-perturbed, modality-isolated). The stage-1 loop builds the list of ``GuidancePass`` for a step
and hands it to a ``PassRunner``; ``SequentialPassRunner`` runs them one after another on this
rank, and the guidance-parallel runner (``mgpu_backend.parallel.guidance_parallel``) runs them on
separate rank groups at once. Runners must return outputs equal to the sequential ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from ltx_core.guidance.perturbations import BatchedPerturbationConfig
from ltx_core.model.transformer.modality import Modality

PASS_NAMES = ("conditional", "unconditional", "perturbed", "isolated")


@dataclass(frozen=True)
class GuidancePass:
    """One transformer call of a denoising step."""

    name: str  # one of PASS_NAMES
    video: Modality
    audio: Modality
    perturbations: BatchedPerturbationConfig | None


class PassRunner(Protocol):
    def run(self, transformer, passes: list[GuidancePass]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Return ``(denoised_video, denoised_audio)`` for every pass, in the order given."""


class SequentialPassRunner:
    """Every pass on this rank, one after another (world size 1, or SP inside the transformer)."""

    def run(self, transformer, passes: list[GuidancePass]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [transformer(video=p.video, audio=p.audio, perturbations=p.perturbations) for p in passes]
