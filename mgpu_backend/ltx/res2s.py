"""The res_2s second-order sampler of the official HQ recipe, as a denoising loop of the stages.

ltx-pipelines 1.0.0's ``TI2VidTwoStagesHQPipeline`` steps both of its stages with res_2s (its
``res2s_audio_video_denoising_loop``) instead of Euler. ``res2s_loop`` is that loop rebuilt here,
with ``_euler_loop``'s signature, so that ``sample_stage1`` and ``refine_stage2`` select it with
``GenerationParams.stepper = "res2s"`` and keep their own denoise functions: stage 1's guidance
passes go through the same ``PassRunner`` (guidance parallel), and sequence parallelism stays inside
the transformer. Each step, in float64 outside the model:

1. evaluate at the current point (sigma): ``x0_1``; ``eps_1 = x0_1 - x``;
2. the midpoint ``x_mid = x + h a21 eps_1`` at ``sqrt(sigma sigma_next)``, with ``h`` the step in
   log-sigma and the Runge-Kutta coefficients of ``res2s_coefficients``, re-noised by ltx-core's
   ``Res2sDiffusionStep`` (SDE noise, ``sigma_up = sigma_next / 2``);
3. for a small step (``h < 0.5``) at ``sigma > 0.03``, 100 "bong" refinements of the anchor ``x`` so
   that the midpoint is exactly reachable from it;
4. evaluate at the midpoint: ``x0_2``; combine ``x + h (b1 eps_1 + b2 eps_2)`` and re-noise to
   ``sigma_next`` with the step's SDE noise.

A schedule ending at 0 gets an extra last sigma 0.0011 (a log step to 0 is infinite); after the
last full step, one more evaluation there gives the final x0. So a stage of N steps makes 2N + 1
denoise calls (each of them all of stage 1's guidance passes).

The SDE noise comes from two generators of their own, seeded -1 (steps) and 9999 (midpoints) in
every stage: the official pipeline leaves the loop's default seed, so this noise does not follow
the job's seed. Each draw is the whole latent's shape, made on the latent's device, so every rank
(which holds the whole latent state; SP splits only inside the transformer) draws the same numbers,
and the same as the official pipeline at one rank.

Latent states are kept in the loader's dtype between steps (the official pipeline's bfloat16).
Nothing here talks to other ranks or loads a model; it never imports ltx_pipelines.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from ltx_core.components.diffusion_steps import Res2sDiffusionStep
from ltx_core.types import LatentState

from mgpu_backend.ltx.stages import DenoiseFn, OnStep, keep_clean_tokens, report_step

STEP_NOISE_SEED = -1  # ltx-pipelines' res2s loop default, which the HQ pipeline keeps
MIDPOINT_NOISE_SEED = STEP_NOISE_SEED + 10000
FINAL_SIGMA = 0.0011  # the sigma inserted before a final 0
MIDPOINT = 0.5  # c2: the midpoint's place in the step (its sigma, sqrt(sigma sigma_next), assumes 0.5)
BONG_ITERATIONS = 100
BONG_MAX_STEP = 0.5  # refine the anchor only for steps smaller than this in log-sigma ...
BONG_MIN_SIGMA = 0.03  # ... and above this sigma


def phi(order: int, neg_h: float) -> float:
    """The exponential integrator's phi_order(-h): ``(e^z - sum_{k<order} z^k / k!) / z^order`` at
    ``z = neg_h``; ``1 / order!`` at 0."""
    if abs(neg_h) < 1e-10:
        return 1.0 / math.factorial(order)
    truncated_exp = sum(neg_h**k / math.factorial(k) for k in range(order))
    return (math.exp(neg_h) - truncated_exp) / (neg_h**order)


def res2s_coefficients(h: float, c2: float = MIDPOINT) -> tuple[float, float, float]:
    """``(a21, b1, b2)`` of the two-stage exponential Runge-Kutta step of log-size ``h``:
    ``a21 = c2 phi_1(-h c2)`` for the midpoint, ``b2 = phi_2(-h) / c2`` and ``b1 = phi_1(-h) - b2``."""
    a21 = c2 * phi(1, -h * c2)
    b2 = phi(2, -h) / c2
    b1 = phi(1, -h) - b2
    return a21, b1, b2


def sde_noise(latent: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Float64 Gaussian noise of ``latent``'s shape on the generator's device, standardised over
    the whole tensor, then again over the last two dimensions (tokens x channels of a state)."""
    noise = torch.randn(latent.shape, generator=generator, dtype=torch.float64, device=generator.device)
    noise = (noise - noise.mean()) / noise.std()
    return noise.sub_(noise.mean(dim=(-2, -1), keepdim=True)).div_(noise.std(dim=(-2, -1), keepdim=True))


_STEPPER = Res2sDiffusionStep()


def _renoise(state: LatentState, sample: torch.Tensor, target: torch.Tensor, generator: torch.Generator,
             sigmas: torch.Tensor, step: int) -> torch.Tensor:  # fmt: skip
    """``target`` (reached from ``sample``) re-noised from ``sigmas[step]`` to ``sigmas[step + 1]``; clean
    (conditioning) tokens put back. The noise is drawn even where the step ends up not using it."""
    noise = sde_noise(state.latent, generator)
    moved = _STEPPER.step(sample=sample, denoised_sample=target, sigmas=sigmas, step_index=step, noise=noise)
    return keep_clean_tokens(moved, state)


def res2s_loop(
    sigmas: torch.Tensor,
    video_state: LatentState,
    audio_state: LatentState,
    denoise: DenoiseFn,
    on_step: OnStep | None = None,
    video_tools=None,
) -> tuple[LatentState, LatentState]:
    """Step both modalities from ``sigmas[0]`` to ``sigmas[-1]`` with res_2s; ``on_step`` after each of
    the ``len(sigmas) - 1`` steps (the final evaluation at 0.0011 belongs to the last step's end)."""
    device = video_state.latent.device
    step_noise = torch.Generator(device=device).manual_seed(STEP_NOISE_SEED)
    midpoint_noise = torch.Generator(device=device).manual_seed(MIDPOINT_NOISE_SEED)
    model_dtype = video_state.latent.dtype
    total = len(sigmas) - 1
    ends_clean = bool(sigmas[-1] == 0)
    if ends_clean:
        sigmas = torch.cat([sigmas[:-1], torch.tensor([FINAL_SIGMA, 0.0], device=sigmas.device)], dim=0)
    log_steps = -torch.log(sigmas[1:].double().cpu() / sigmas[:-1].double().cpu())

    for step in range(total):
        sigma, sigma_next = sigmas[step].double(), sigmas[step + 1].double()
        anchor_video, anchor_audio = video_state.latent.clone().double(), audio_state.latent.clone().double()

        x0_video, x0_audio = denoise(video_state, audio_state, sigmas, step)
        x0_video, x0_audio = keep_clean_tokens(x0_video, video_state), keep_clean_tokens(x0_audio, audio_state)

        h = log_steps[step].item()
        a21, b1, b2 = res2s_coefficients(h)
        midpoint_sigma = torch.sqrt(sigma * sigma_next)
        to_midpoint = torch.stack([sigma, midpoint_sigma])

        eps_video = x0_video.double() - anchor_video
        eps_audio = x0_audio.double() - anchor_audio
        mid_video = _renoise(video_state, anchor_video, anchor_video + h * a21 * eps_video, midpoint_noise, to_midpoint, 0)
        mid_audio = _renoise(audio_state, anchor_audio, anchor_audio + h * a21 * eps_audio, midpoint_noise, to_midpoint, 0)

        if h < BONG_MAX_STEP and sigma > BONG_MIN_SIGMA:
            for _ in range(BONG_ITERATIONS):
                anchor_video = mid_video - h * a21 * eps_video
                eps_video = x0_video.double() - anchor_video
                anchor_audio = mid_audio - h * a21 * eps_audio
                eps_audio = x0_audio.double() - anchor_audio

        x0_mid_video, x0_mid_audio = denoise(
            replace(video_state, latent=mid_video.to(model_dtype)),
            replace(audio_state, latent=mid_audio.to(model_dtype)),
            torch.stack([midpoint_sigma]).to(sigmas.device),
            0,
        )
        x0_mid_video, x0_mid_audio = keep_clean_tokens(x0_mid_video, video_state), keep_clean_tokens(x0_mid_audio, audio_state)

        next_video = anchor_video + h * (b1 * eps_video + b2 * (x0_mid_video.double() - anchor_video))
        next_audio = anchor_audio + h * (b1 * eps_audio + b2 * (x0_mid_audio.double() - anchor_audio))
        next_video = _renoise(video_state, anchor_video, next_video, step_noise, sigmas, step)
        next_audio = _renoise(audio_state, anchor_audio, next_audio, step_noise, sigmas, step)
        video_state = replace(video_state, latent=next_video.to(model_dtype))
        audio_state = replace(audio_state, latent=next_audio.to(model_dtype))

        if step + 1 == total and ends_clean:
            x0_video, x0_audio = denoise(video_state, audio_state, sigmas, total)
            video_state = replace(video_state, latent=keep_clean_tokens(x0_video, video_state).to(model_dtype))
            audio_state = replace(audio_state, latent=keep_clean_tokens(x0_audio, audio_state).to(model_dtype))
        report_step(on_step, step + 1, total, x0_video, video_state, video_tools)
    return video_state, audio_state
