"""Sequence parallelism over real rank processes (gloo CPU) running ComfyUI's own LTX-2.3 model: a
call at SP degree 2 (and 4) is bitwise ComfyUI's in-process call at the ranks' thread count, where
the token counts fill whole vectors; a padded shard and a batch split over groups stay within the
bounds whose causes tests/comfy_model_cases.py states.

Needs COMFYUI_DIR and ComfyUI's Python (see tests/comfy_model_cases.py); skips without them.
"""

from __future__ import annotations

import pytest

from tests import comfy_model_cases as cases

ALIGNED = ("plain", "image_to_video", "keyframes")  # token counts of whole gate vectors: see cases.GATE_ROUNDING_BOUND


@pytest.fixture(scope="module")
def tiny(comfy):
    return cases.load_tiny(comfy)


@pytest.fixture(scope="module")
def calls(comfy, tiny):
    """Each case's call and ComfyUI's in-process output of it at the threads of a rank of a 2- and 4-rank fleet."""
    _, patcher = tiny
    made = {case: cases.make_call(comfy, patcher, case, seed) for seed, case in enumerate((*ALIGNED, "padded"))}
    expected = {(case, world): cases.in_process(patcher, call, cases.rank_threads(world)) for case, call in made.items() for world in (2, 4)}
    return made, expected


@pytest.fixture(scope="module")
def batch_calls(comfy, tiny, calls):
    """Batches of two: cond + uncond of one step (one sigma), and two samples at different sigmas."""
    made = {
        "one_sigma": cases.make_call(comfy, tiny[1], "image_to_video", seed=7, batch=2),
        "two_sigmas": cases.make_call(comfy, tiny[1], "plain", seed=8, batch=2, sigmas=(0.9, 0.6)),
    }
    return {name: (call, cases.in_process(tiny[1], call, cases.rank_threads(2))) for name, call in made.items()}


@pytest.fixture(scope="module")
def fleet_2(fleet_of, comfy):
    return fleet_of(2)


@pytest.mark.parametrize("case", ALIGNED)
def test_sp_degree_2_call_is_bitwise_comfyui_in_process(fleet_2, tiny, calls, case):
    key = cases.load_in_fleet(fleet_2, tiny[0])["model_key"]
    out, fields = cases.forward_in_fleet(fleet_2, key, calls[0][case])
    cases.assert_same(out, calls[1][case, 2])
    assert (fields["batch_groups"], fields["sp_degree"]) == (1, 2)
    assert len(fields["rank_seconds"]) == 2


def test_sp_degree_2_padded_shard_is_within_the_gate_rounding_bound(fleet_2, tiny, calls):
    """45 tokens: the last shard carries one padding token, dropped before attention. Not bitwise with
    the tiny model's 8-wide attention gates on CPU (cases.GATE_ROUNDING_BOUND says why)."""
    key = cases.load_in_fleet(fleet_2, tiny[0])["model_key"]
    out, _ = cases.forward_in_fleet(fleet_2, key, calls[0]["padded"])
    difference = cases.max_difference(out, calls[1]["padded", 2])
    assert 0 < difference <= cases.GATE_ROUNDING_BOUND


def test_batch_2_call_of_one_step_splits_into_two_groups_within_the_batch_bound(fleet_2, tiny, batch_calls):
    call, expected = batch_calls["one_sigma"]
    key = cases.load_in_fleet(fleet_2, tiny[0])["model_key"]
    out, fields = cases.forward_in_fleet(fleet_2, key, call)
    assert (fields["batch_groups"], fields["sp_degree"]) == (2, 1)
    assert cases.max_difference(out, expected) <= cases.BATCH_SPLIT_BOUND  # one-row timestep products: see the bound


def test_batch_2_call_at_two_sigmas_runs_unsplit_bitwise(fleet_2, tiny, batch_calls):
    """ComfyUI's model couples a batch through its largest timestep: split, the samples would change."""
    call, expected = batch_calls["two_sigmas"]
    key = cases.load_in_fleet(fleet_2, tiny[0])["model_key"]
    out, fields = cases.forward_in_fleet(fleet_2, key, call)
    assert (fields["batch_groups"], fields["sp_degree"]) == (1, 2)
    cases.assert_same(out, expected)


@pytest.fixture(scope="module")
def fleet_4(fleet_of, comfy):
    return fleet_of(4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ALIGNED)
def test_sp_degree_4_call_is_bitwise_comfyui_in_process(fleet_4, tiny, calls, case):
    key = cases.load_in_fleet(fleet_4, tiny[0])["model_key"]
    out, fields = cases.forward_in_fleet(fleet_4, key, calls[0][case])
    cases.assert_same(out, calls[1][case, 4])
    assert (fields["batch_groups"], fields["sp_degree"]) == (1, 4)


@pytest.mark.slow
def test_sp_degree_4_padded_shards_are_within_the_gate_rounding_bound(fleet_4, tiny, calls):
    key = cases.load_in_fleet(fleet_4, tiny[0])["model_key"]
    out, _ = cases.forward_in_fleet(fleet_4, key, calls[0]["padded"])
    assert cases.max_difference(out, calls[1]["padded", 4]) <= cases.GATE_ROUNDING_BOUND
