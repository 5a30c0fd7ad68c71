"""CUDA-graph capture of the transformer forward (mgpu_backend.parallel.cuda_graphs).

CPU tests: the eager fallback is exactly the plain call, the signature separates what a graph
cannot share, the runner wrapper changes nothing, and the device-resident RoPE grids give the same
numbers. GPU tests (skipped without CUDA): captured vs eager in bf16 on a tiny random LTXModel, over
new input values and two shapes, and the number of captures.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from ltx_core.guidance.perturbations import BatchedPerturbationConfig

from mgpu_backend.ltx.parallelize import Stage1Cache
from mgpu_backend.ltx.passes import GuidancePass, SequentialPassRunner
from mgpu_backend.parallel.cuda_graphs import (
    CapturedForward,
    apply_cuda_graphs,
    cuda_graphs_wanted,
    forward_signature,
    keep_rope_grids_on_device,
)
from tests.helpers import build_tiny_model, isolated_perturbations, max_abs_diff, stg_perturbations, transformer_inputs

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- CPU ---------------------------------------------------------------------------------------------


def test_cpu_wrapper_falls_back_to_eager_with_outputs_equal_to_plain_call(caplog):
    model = build_tiny_model(seed=1)
    wrapper = CapturedForward(model)
    caplog.set_level(logging.INFO, logger="mgpu_backend.parallel.cuda_graphs")
    with torch.inference_mode():
        for seed, perturbations in ((2, None), (3, stg_perturbations()), (4, None)):
            video, audio = transformer_inputs(seed)
            expected = model(video=video, audio=audio, perturbations=perturbations)
            got = wrapper(video=video, audio=audio, perturbations=perturbations)
            for name, e, g in zip(("video", "audio"), expected, got):
                assert torch.equal(e, g), f"{name} differs from the plain call by {max_abs_diff(e, g)}"
    assert (wrapper.captures, wrapper.replays, wrapper.eager_calls) == (0, 0, 3)
    fallback_lines = [r.getMessage() for r in caplog.records if "eagerly" in r.getMessage()]
    assert len(fallback_lines) == 1 and "CUDA device" in fallback_lines[0], fallback_lines


def test_signature_separates_shapes_and_perturbations_and_matches_equal_ones():
    video, audio = transformer_inputs(5)
    other_values_video, other_values_audio = transformer_inputs(6)
    longer_video, _ = transformer_inputs(5, frames=4)
    with torch.inference_mode():
        base = forward_signature(video, audio, None)
        assert forward_signature(other_values_video, other_values_audio, None) == base
        assert forward_signature(video, audio, stg_perturbations()) == forward_signature(other_values_video, other_values_audio, stg_perturbations())
        assert forward_signature(longer_video, audio, None) != base
        assert forward_signature(video, audio, stg_perturbations()) != base
        assert forward_signature(video, audio, stg_perturbations()) != forward_signature(video, audio, isolated_perturbations())
        assert forward_signature(video, audio, BatchedPerturbationConfig.empty(1)) != base
        assert forward_signature(replace(video, enabled=False), audio, None) != base
        assert forward_signature(replace(video, latent=video.latent.half()), audio, None) != base
        assert forward_signature(video, replace(audio, context_mask=torch.ones(1, 7)), None) != base
    # Static buffers made in inference mode cannot be written outside it: a different key.
    with torch.no_grad():
        assert forward_signature(video, audio, None) != base


def test_capturing_runner_gives_the_inner_runners_outputs():
    model = build_tiny_model(seed=7)
    with torch.inference_mode():
        video, audio = transformer_inputs(8)
        passes = [
            GuidancePass("conditional", video, audio, None),
            GuidancePass("perturbed", video, audio, stg_perturbations()),
            GuidancePass("isolated", video, audio, isolated_perturbations()),
        ]
        expected = SequentialPassRunner().run(model, passes)
        cache = Stage1Cache()
        runner = apply_cuda_graphs(SequentialPassRunner(), cache.captured_forward(model))
        got = runner.run(model, passes)
        again = runner.run(model, passes)
    for index, (e, g, a) in enumerate(zip(expected, got, again)):
        for slot in range(2):
            assert torch.equal(e[slot], g[slot]), f"pass {index} output {slot} differs by {max_abs_diff(e[slot], g[slot])}"
            assert torch.equal(e[slot], a[slot]), f"pass {index} output {slot} (2nd run) differs by {max_abs_diff(e[slot], a[slot])}"
    assert cache.captured_forward(model) is runner.captured, "the wrapper is not kept per transformer"
    assert runner.summary()["eager_calls"] == 6, runner.summary()
    cache.release_graphs()
    assert cache.captured_forward(model) is not runner.captured


def test_rope_grids_on_device_give_bit_identical_outputs():
    model = build_tiny_model(seed=11)
    video, audio = transformer_inputs(12)
    with torch.inference_mode():
        before = model(video=video, audio=audio, perturbations=None)
        keep_rope_grids_on_device(model)
        keep_rope_grids_on_device(model)  # idempotent
        after = model(video=video, audio=audio, perturbations=None)
    patched = [p for p in (model.velocity_model.video_args_preprocessor.simple_preprocessor,
                           model.velocity_model.audio_args_preprocessor.simple_preprocessor)
               if "_prepare_positional_embeddings" in vars(p)]  # fmt: skip
    assert len(patched) == 2, "both modalities' preprocessors must read the resident grids"
    for name, b, a in zip(("video", "audio"), before, after):
        assert torch.equal(b, a), f"{name} changed by {max_abs_diff(b, a)} with device-resident RoPE grids"


def test_cuda_graphs_argument_defaults_to_the_device_and_refuses_non_booleans():
    assert cuda_graphs_wanted(None, torch.device("cuda", 0)) is True
    assert cuda_graphs_wanted(None, torch.device("cpu")) is False
    assert cuda_graphs_wanted(False, torch.device("cuda", 0)) is False
    with pytest.raises(ValueError, match="cuda_graphs must be true or false, got 'yes'"):
        cuda_graphs_wanted("yes", torch.device("cpu"))


# -- GPU ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["19b", "22b"])  # the LTX-2.0 and LTX-2.3 block layouts
def test_captured_forward_matches_eager_bf16_over_new_values_and_two_shapes(variant):
    device = torch.device("cuda", torch.cuda.current_device())
    model = build_tiny_model(variant, seed=21).to(device, torch.bfloat16)
    wrapper = CapturedForward(model)
    worst, scale = 0.0, 0.0
    calls = [(frames, seed, perturbations) for frames in (3, 5) for seed in (31, 32, 33) for perturbations in (None,)]
    calls += [(3, 34, stg_perturbations()), (3, 35, stg_perturbations())]
    with torch.inference_mode():
        for frames, seed, perturbations in calls:
            video, audio = transformer_inputs(seed, frames=frames, sigma=0.3 + 0.1 * (seed % 5), device=device, dtype=torch.bfloat16)
            got = wrapper(video=video, audio=audio, perturbations=perturbations)
            expected = model(video=video, audio=audio, perturbations=perturbations)
            for e, g in zip(expected, got):
                worst = max(worst, max_abs_diff(e, g))
                scale = max(scale, float(e.float().abs().max()))
    # 3 signatures (3 frames, 5 frames, 3 frames with STG): one capture each, the rest replays.
    assert (wrapper.captures, wrapper.replays, wrapper.eager_calls) == (3, 8, 0), wrapper.summary()
    assert worst <= 2e-2 * scale, f"captured vs eager max abs diff {worst} (output scale {scale})"
    print(f"captured vs eager bf16: max abs diff {worst:.3g} at output scale {scale:.3g}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["19b", "22b"])  # the LTX-2.0 and LTX-2.3 block layouts
def test_captured_forward_reads_new_inputs_not_the_captured_ones(variant):
    device = torch.device("cuda", torch.cuda.current_device())
    model = build_tiny_model(variant, seed=22).to(device, torch.bfloat16)
    wrapper = CapturedForward(model)
    with torch.inference_mode():
        first = wrapper(*transformer_inputs(41, device=device, dtype=torch.bfloat16))
        second_video, second_audio = transformer_inputs(42, device=device, dtype=torch.bfloat16)
        second = wrapper(second_video, second_audio)
        expected = model(video=second_video, audio=second_audio, perturbations=None)
    assert max_abs_diff(first[0], second[0]) > 0.1, "the replay returned the first call's outputs"
    assert max_abs_diff(second[0], expected[0]) <= 2e-2 * float(expected[0].float().abs().max())
    assert wrapper.captures == 1


@pytest.mark.gpu
@gpu
def test_conditioning_attention_mask_runs_eagerly_and_exactly():
    device = torch.device("cuda", torch.cuda.current_device())
    model = build_tiny_model(seed=23).to(device, torch.bfloat16)
    wrapper = CapturedForward(model)
    with torch.inference_mode():
        video, audio = transformer_inputs(51, device=device, dtype=torch.bfloat16, image_conditioning=True)
        assert video.attention_mask is not None
        got = wrapper(video, audio)
        expected = model(video=video, audio=audio, perturbations=None)
    assert torch.equal(got[0], expected[0]), max_abs_diff(got[0], expected[0])
    assert (wrapper.captures, wrapper.eager_calls) == (0, 1)
    assert any("attention mask" in reason for reason in wrapper.summary()["eager_reasons"]), wrapper.summary()
