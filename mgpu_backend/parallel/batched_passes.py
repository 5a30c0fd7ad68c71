"""The guidance passes of one stage-1 step as ONE batched transformer forward.

What it is: a stage-1 step calls the transformer up to four times with batch 1 (conditional,
unconditional, STG-perturbed, modality-isolated). At the shard sizes a rank sees under high SP
degrees a batch-1 forward is launch-bound (one H200, 19B, 1152 video tokens: ~137 ms eager, while
the same shape at batch 4 costs ~76 ms per pass), so stacking the passes along the batch dimension
buys the launch overhead back. ``batch_passes`` concatenates the passes' inputs (latents,
timesteps, positions, text contexts, sigmas, masks) and their perturbations (one
``PerturbationConfig`` per sample), ``split_outputs`` cuts the outputs back per pass, and
``BatchedPassRunner`` is the ``PassRunner`` doing both around one forward.

Why it is faithful: ltx-core's transformer treats every sample of a batch on its own. Per-sample
inputs (sigma, per-token timesteps, positions, text context, conditioning mask) stay per-sample
through AdaLN, RoPE and attention; a perturbation that only some samples carry is applied as a
per-sample 0/1 mask (``BatchedPerturbationConfig.mask_like``): STG samples get the value
projection instead of the self-attention output (``attn * 0 + v * 1 = v`` exactly), isolated
samples get the audio<->video cross-attention multiplied by 0. The only differences from the
batch-1 calls are those of batched kernels (float rounding).

What it costs: activation memory grows with the batch (4 passes: 4x a pass's activations; small at
the launch-bound shard sizes where it pays off), and a sample perturbed in a block computes the
attention it then discards. Passes that differ in what the forward does (``enabled`` flags, token
or text lengths, which masks are present) cannot share one forward: the runner batches each set
of compatible passes and runs the rest through its ``inner`` runner, so it never refuses a step.

``apply_batched_passes(runner)`` wraps any ``PassRunner`` by composition; it knows nothing of the
runner it wraps. Under guidance parallelism the stage-1 parallelize entry
(``mgpu_backend.ltx.parallelize``) hands the wrapper to the guidance-parallel runner as the runner
of the group's own share, so each group batches its own passes. ``batch_passes_wanted`` reads the
job argument ("auto": batch on GPUs when a rank's shard is launch-bound). This module must never
import ``ltx_pipelines``, another technique module, nor talk to other ranks itself (SP inside the
transformer does that).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from ltx_core.guidance.perturbations import BatchedPerturbationConfig, PerturbationConfig
from ltx_core.model.transformer.modality import Modality

from mgpu_backend.ltx.passes import GuidancePass, PassRunner, SequentialPassRunner

log = logging.getLogger(__name__)

BATCH_PASSES_CHOICES = ("auto", True, False)


class PassesNotBatchable(ValueError):
    """The passes cannot share one forward; the message says which field differs."""


# -- batching ------------------------------------------------------------------------------------


def pass_batch_size(guidance_pass: GuidancePass) -> int:
    """Samples in one pass (1 in the stage-1 loop)."""
    modality = guidance_pass.video if guidance_pass.video is not None else guidance_pass.audio
    return modality.latent.shape[0]


def _modality_key(slot: str, modality: Modality | None, batch: int) -> tuple:
    """What two passes' ``slot`` modality must share to be stacked: every field except the batch
    dimension of its tensors. Refuses a tensor whose first dimension is not the pass's batch."""
    if modality is None:
        return ((slot, None),)
    entries = []
    for field in dataclasses.fields(modality):
        name, value = f"{slot}.{field.name}", getattr(modality, field.name)
        if not isinstance(value, torch.Tensor):
            entries.append((name, value))
        elif field.name == "sigma":
            # One sigma per sample, or one for the whole pass (the stage-1 loop passes a 0-d tensor).
            if value.numel() not in (1, batch):
                raise PassesNotBatchable(f"{name} has {value.numel()} values for a pass of batch {batch}")
            entries.append((name, value.dtype, value.device))
        else:
            if value.ndim == 0 or value.shape[0] != batch:
                raise PassesNotBatchable(f"{name} of shape {tuple(value.shape)} has no batch dimension of {batch}")
            entries.append((name, tuple(value.shape[1:]), value.dtype, value.device))
    return tuple(entries)


def batch_key(guidance_pass: GuidancePass) -> tuple:
    """Passes with equal keys can run as one batched forward (raises ``PassesNotBatchable`` for a
    pass whose tensors have no common batch dimension)."""
    batch = pass_batch_size(guidance_pass)
    perturbations = guidance_pass.perturbations
    if perturbations is not None and len(perturbations.perturbations) != batch:
        raise PassesNotBatchable(
            f"pass {guidance_pass.name!r} has {len(perturbations.perturbations)} perturbation configs for batch {batch}"
        )
    return _modality_key("video", guidance_pass.video, batch) + _modality_key("audio", guidance_pass.audio, batch)


def _first_difference(key: tuple, other: tuple) -> str:
    for entry, other_entry in zip(key, other):
        if entry != other_entry:
            return f"{entry[0]}: {entry[1:]} vs {other_entry[1:]}"
    return "different fields"


def _stacked(modalities: list[Modality | None], batches: list[int]) -> Modality | None:
    first = modalities[0]
    if first is None:
        return None
    stacked = {}
    for field in dataclasses.fields(first):
        values = [getattr(modality, field.name) for modality in modalities]
        if not isinstance(values[0], torch.Tensor):
            continue
        if field.name == "sigma":
            values = [sigma.reshape(-1).expand(batch) for sigma, batch in zip(values, batches)]
        stacked[field.name] = torch.cat(values, dim=0)
    return dataclasses.replace(first, **stacked)


def batch_passes(
    passes: list[GuidancePass],
) -> tuple[Modality | None, Modality | None, BatchedPerturbationConfig | None]:
    """``(video, audio, perturbations)`` of one forward running every pass, in order, along the batch.

    Every tensor of both modalities is concatenated on dim 0; a pass's sigma becomes one value per
    sample; the perturbations become one ``PerturbationConfig`` per sample (empty for a pass without
    any), or None when no pass has any. Raises ``PassesNotBatchable`` naming the first field that
    differs (``enabled`` flags, token or text lengths, a mask present in one pass only, dtypes).
    """
    if not passes:
        raise ValueError("batch_passes needs at least one guidance pass")
    keys = [batch_key(guidance_pass) for guidance_pass in passes]
    for guidance_pass, key in zip(passes[1:], keys[1:]):
        if key != keys[0]:
            raise PassesNotBatchable(
                f"pass {guidance_pass.name!r} cannot share a forward with pass {passes[0].name!r}: "
                f"{_first_difference(key, keys[0])}"
            )
    batches = [pass_batch_size(guidance_pass) for guidance_pass in passes]
    video = _stacked([guidance_pass.video for guidance_pass in passes], batches)
    audio = _stacked([guidance_pass.audio for guidance_pass in passes], batches)
    if all(guidance_pass.perturbations is None for guidance_pass in passes):
        return video, audio, None
    configs: list[PerturbationConfig] = []
    for guidance_pass, batch in zip(passes, batches):
        if guidance_pass.perturbations is None:
            configs.extend(PerturbationConfig.empty() for _ in range(batch))
        else:
            configs.extend(guidance_pass.perturbations.perturbations)
    return video, audio, BatchedPerturbationConfig(perturbations=configs)


def split_outputs(
    outputs: tuple[torch.Tensor | None, torch.Tensor | None], passes: list[GuidancePass]
) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The batched forward's ``(video, audio)`` outputs cut back into one pair per pass, in order."""
    batches = [pass_batch_size(guidance_pass) for guidance_pass in passes]
    per_slot = []
    for output in outputs:
        if output is None:
            per_slot.append([None] * len(passes))
        else:
            assert output.shape[0] == sum(batches), (tuple(output.shape), batches)
            per_slot.append(list(torch.split(output, batches, dim=0)))
    return list(zip(*per_slot))


# -- the runner ----------------------------------------------------------------------------------


class BatchedPassRunner:
    """A ``PassRunner`` that runs all passes of a step as one batched forward.

    Passes that cannot share a forward with the others (see ``batch_passes``) are split into sets
    of compatible passes, each set one forward; a pass alone in its set goes through ``inner``.
    Outputs come back in the order of the passes, equal to ``inner``'s up to float rounding.
    """

    def __init__(self, inner: PassRunner | None = None) -> None:
        self.inner = SequentialPassRunner() if inner is None else inner
        self.forwards = 0  # batched forwards run so far (passes run by ``inner`` not counted)
        self._logged: set[str] = set()

    def run(self, transformer, passes: list[GuidancePass]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if len(passes) < 2:
            return self.inner.run(transformer, passes)
        sets: dict[object, list[int]] = {}  # batch key -> indices of the passes that share it
        for index, guidance_pass in enumerate(passes):
            try:
                key = batch_key(guidance_pass)
            except PassesNotBatchable as reason:
                self._log_once(f"guidance pass {guidance_pass.name!r} runs on its own: {reason}")
                key = ("alone", index)
            sets.setdefault(key, []).append(index)
        if len(sets) > 1:
            names = [[passes[index].name for index in indices] for indices in sets.values()]
            self._log_once(f"guidance passes run as {len(sets)} forwards, not 1: {names}")

        results: list = [None] * len(passes)
        for indices in sets.values():
            members = [passes[index] for index in indices]
            if len(members) == 1:
                outputs = self.inner.run(transformer, members)
            else:
                video, audio, perturbations = batch_passes(members)
                outputs = split_outputs(transformer(video=video, audio=audio, perturbations=perturbations), members)
                self.forwards += 1
            for index, output in zip(indices, outputs, strict=True):
                results[index] = output
        return results

    def _log_once(self, message: str) -> None:
        if message not in self._logged:
            self._logged.add(message)
            log.info(message)


def apply_batched_passes(runner: PassRunner | None = None) -> BatchedPassRunner:
    """``runner`` made to run the passes it is handed as batched forwards: a ``BatchedPassRunner``
    around it (passes that cannot share a forward go through ``runner``). A runner that batches
    already is returned as it is. Wrap the runner of one rank's (one group's) own passes; under
    guidance parallelism that is the local runner of the guidance-parallel runner. Nothing is
    patched on the model, so there is nothing to remove: drop the wrapper."""
    if isinstance(runner, BatchedPassRunner):
        return runner
    return BatchedPassRunner(inner=runner)


# Measured on one H200 at the 19B configuration, four passes of a step (bench/batched_passes.py,
# docs/BENCHMARKS.md): one batched forward is 1.59x faster at 1152 video tokens, 1.28x at 1920, and
# 0.99x at 6144, where a forward is compute-bound.
BATCH_PASSES_BELOW_TOKENS = 4096


def batch_passes_wanted(value, plan, device: torch.device) -> bool:
    """The ``batch_passes`` job argument: true, false, or "auto" = batch on a CUDA device when a
    rank's share of the video tokens is below ``BATCH_PASSES_BELOW_TOKENS`` (where a batch-1 forward
    leaves the GPU waiting on kernel launches). ``plan`` is the stage-1 plan: only its
    ``video_tokens`` and ``sp_degree`` are read.

    "auto" leaves CPU ranks sequential: a CPU forward is compute-bound, so batching gains little
    there, and sequential passes keep a CPU fleet's results bit-identical at any rank count (a
    batched kernel rounds differently from a batch-1 one, ~1e-6 in fp32).
    """
    if value not in BATCH_PASSES_CHOICES or (value != "auto" and not isinstance(value, bool)):
        raise ValueError(f'batch_passes must be "auto", true or false, got {value!r}; leave it out for "auto"')
    if value != "auto":
        return value
    shard_tokens = math.ceil(plan.video_tokens / plan.sp_degree)
    return torch.device(device).type == "cuda" and shard_tokens < BATCH_PASSES_BELOW_TOKENS
