"""Distributed video VAE decode equals ltx-core's single-GPU tiled decode (CPU, gloo, fp32).

The decoder is a tiny random ltx-core VideoDecoder built by ltx-core's configurator: 128 latent
channels like the real one, the three 2x upsamplers and patch size 4 the tiling's 8x/32x scale
factors assume, timestep conditioning and noise injection on (so the generator replay is tested),
and 4 base channels. Each multi-rank run decodes every scenario once; the tests read its results.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ltx_core.model.video_vae import VideoDecoder

from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.distributed_decode import (
    assembly_peak_estimate,
    decoded_images_shape,
    distributed_decode_images,
    last_decode_stats,
)
from tests.dist_harness import run_ranks
from tests.helpers import (
    SCENARIOS,
    TINY_DECODER_CONFIG,
    build_tiny_decoder,
    distributed_decode_video,
    noise_seed,
    scenario_latent,
    single_gpu_decode_video,
    video_to_images,
)

TOLERANCE = 1e-5


# The LTX-2.3 decoder's layout at tiny width: space and time upsampled by separate blocks, no
# timestep conditioning (so no decoder noise), zero padding (configs/ltx2.3-22b-transformer.json's
# bundle, docs/full-size-config.md).
TINY_LTX23_DECODER_CONFIG = {
    "vae": {
        **{key: value for key, value in TINY_DECODER_CONFIG["vae"].items() if key != "decoder_blocks"},
        "timestep_conditioning": False,
        "spatial_padding_mode": "zeros",
        "decoder_blocks": [
            ["res_x", {"num_layers": 1}],
            ["compress_space", {"multiplier": 2}],
            ["res_x", {"num_layers": 1}],
            ["compress_time", {"multiplier": 2}],
            ["res_x", {"num_layers": 1}],
            ["compress_all", {"multiplier": 1}],
            ["res_x", {"num_layers": 1}],
            ["compress_all", {"multiplier": 2}],
            ["res_x", {"num_layers": 1}],
        ],
    }
}


# This scenario decodes with generator=None (the default CPU generator, seeded alike on every rank).
DEFAULT_GENERATOR_SCENARIO = "three_way_temporal_overlap"
IMAGE_SCENARIO = "spatial_and_temporal"


def _generator_state_after(name: str, generator: torch.Generator | None) -> torch.Tensor:
    return (torch.random.get_rng_state() if generator is None else generator.get_state()).clone()


def decode_every_scenario(world_size: int) -> dict:
    """Runs on every rank: the distributed decode of every scenario, with its stats."""
    torch.set_num_threads(1)
    comm = Comm.world()
    assert comm.world_size == world_size
    decoder = build_tiny_decoder()
    results = {}
    for name, (_, tiling, _, _) in SCENARIOS.items():
        generator = torch.Generator().manual_seed(noise_seed(name))
        if name == DEFAULT_GENERATOR_SCENARIO:
            torch.manual_seed(noise_seed(name))
            generator = None
        video = distributed_decode_video(decoder, scenario_latent(name), tiling, comm, generator)
        results[name] = {
            "video": video,
            "stats": last_decode_stats(),
            "generator_state": _generator_state_after(name, generator),
        }
    latent = scenario_latent(IMAGE_SCENARIO)
    out = torch.full(decoded_images_shape(decoder, latent.shape), -1.0) if comm.rank == 0 else None
    generator = torch.Generator().manual_seed(noise_seed(IMAGE_SCENARIO))
    images = distributed_decode_images(decoder, latent, SCENARIOS[IMAGE_SCENARIO][1], comm, generator, out=out)
    results["images"] = images
    results["images_stats"] = last_decode_stats()
    results["images_written_into_out"] = images is not None and images.data_ptr() == out.data_ptr()
    return _tensors_as_numpy(results)


def _tensors_as_numpy(tree):
    # Tensors sent back through the harness's queue travel as shared-memory file descriptors, which
    # break when the rank process exits before the test process reads them; numpy arrays travel
    # by value.
    if isinstance(tree, dict):
        return {key: _tensors_as_numpy(value) for key, value in tree.items()}
    return tree.numpy() if isinstance(tree, torch.Tensor) else tree


def _numpy_as_tensors(tree):
    if isinstance(tree, dict):
        return {key: _numpy_as_tensors(value) for key, value in tree.items()}
    return torch.from_numpy(tree) if isinstance(tree, np.ndarray) else tree


@pytest.fixture(scope="module")
def decoder() -> VideoDecoder:
    torch.set_num_threads(1)
    return build_tiny_decoder()


@pytest.fixture(scope="module")
def reference(decoder) -> dict:
    """ltx-core's single-GPU decode of every scenario, and where it leaves the generator."""
    results = {}
    for name, (_, _, reference_tiling, _) in SCENARIOS.items():
        generator = torch.Generator().manual_seed(noise_seed(name))
        if name == DEFAULT_GENERATOR_SCENARIO:
            torch.manual_seed(noise_seed(name))
            generator = None
        video = single_gpu_decode_video(decoder, scenario_latent(name), reference_tiling, generator)
        results[name] = {"video": video, "generator_state": _generator_state_after(name, generator)}
    return results


@pytest.fixture(scope="module")
def one_rank() -> list[dict]:
    # World size 1 runs in this process: Comm.world() is a single-rank Comm without torch.distributed.
    return [_numpy_as_tensors(decode_every_scenario(1))]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return [_numpy_as_tensors(result) for result in run_ranks(2, decode_every_scenario, 2)]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return [_numpy_as_tensors(result) for result in run_ranks(4, decode_every_scenario, 4)]


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a.double() - b.double()).abs().max().item()


def _check_matches_reference(ranks: list[dict], reference: dict, tolerance: float) -> dict[str, float]:
    diffs = {}
    for name, (_, _, _, tile_count) in SCENARIOS.items():
        diffs[name] = _max_abs_diff(ranks[0][name]["video"], reference[name]["video"])
        assert ranks[0][name]["stats"].tiles_total == tile_count, (name, ranks[0][name]["stats"])
        for rank, result in enumerate(ranks):
            if rank > 0:
                assert result[name]["video"] is None, f"{name}: rank {rank} returned frames; only rank 0 should"
            assert torch.equal(result[name]["generator_state"], reference[name]["generator_state"]), (
                f"{name}: rank {rank}'s generator does not stand where ltx-core's single-GPU decode leaves it"
            )
    assert all(diff <= tolerance for diff in diffs.values()), f"max abs diff per scenario: {diffs}"
    return diffs


def test_single_rank_is_bit_identical_to_ltx_core_tiled_decode(one_rank, reference):
    diffs = _check_matches_reference(one_rank, reference, tolerance=0.0)
    print(f"1 rank, max abs diff per scenario: {diffs}")


def test_two_ranks_match_ltx_core_tiled_decode_fp32(two_ranks, reference):
    diffs = _check_matches_reference(two_ranks, reference, TOLERANCE)
    print(f"2 ranks, max abs diff per scenario: {diffs}")


def test_four_ranks_match_ltx_core_tiled_decode_fp32(four_ranks, reference):
    diffs = _check_matches_reference(four_ranks, reference, TOLERANCE)
    print(f"4 ranks, max abs diff per scenario: {diffs}")


def test_reference_video_is_not_trivial(reference):
    # Guards the equality tests: a decoder that output constants would match anything.
    video = reference["spatial_and_temporal"]["video"]
    assert tuple(video.shape) == (1, 3, 41, 96, 128)
    assert video.std().item() > 0.05, f"decoded video std {video.std().item()}"


def test_tiles_are_assigned_round_robin_and_idle_ranks_decode_nothing(four_ranks):
    for name, (_, _, _, tile_count) in SCENARIOS.items():
        decoded = [four_ranks[rank][name]["stats"].tile_indices for rank in range(4)]
        assert decoded == [tuple(range(rank, tile_count, 4)) for rank in range(4)], (name, decoded)
    fewer = [four_ranks[rank]["fewer_tiles_than_ranks"]["stats"].tiles_decoded for rank in range(4)]
    assert fewer == [1, 1, 0, 0], fewer


def test_images_written_into_preallocated_out_match_single_gpu_images(four_ranks, reference):
    expected = video_to_images(reference[IMAGE_SCENARIO]["video"])
    images = four_ranks[0]["images"]
    assert four_ranks[0]["images_written_into_out"], "rank 0 did not fill the caller's out tensor"
    assert all(four_ranks[rank]["images"] is None for rank in (1, 2, 3))
    assert images.dtype == torch.float32 and tuple(images.shape) == (41, 96, 128, 3)
    assert images.min().item() >= 0.0 and images.max().item() <= 1.0
    diff = _max_abs_diff(images, expected)
    assert diff <= TOLERANCE, f"IMAGE max abs diff {diff}"


def test_held_tile_bytes_fall_with_the_rank_count(one_rank, four_ranks):
    # A non-root rank holds its weighted tiles (about 1/ranks of them, one round ahead) plus one
    # temporal group buffer; the single rank holds a whole group's tiles, the buffer and the window.
    single = one_rank[0]["spatial_and_temporal"]["stats"]
    per_rank = [four_ranks[rank]["spatial_and_temporal"]["stats"] for rank in range(4)]
    group_buffer_bytes = 1 * 3 * 25 * 96 * 128 * 4  # the largest temporal group: 25 frames
    report = {
        "1 rank": single.assembly_peak_bytes,
        "4 ranks": [stats.assembly_peak_bytes for stats in per_rank],
        "group buffer": group_buffer_bytes,
    }
    print(f"assembly peak bytes: {report}")
    single_held = single.assembly_peak_bytes - group_buffer_bytes
    for stats in per_rank[1:]:
        assert stats.assembly_peak_bytes - group_buffer_bytes < 0.5 * single_held, report
    assert single.tiles_decoded == 18 and max(stats.tiles_decoded for stats in per_rank) == 5


@pytest.mark.parametrize("ranks", ["one_rank", "two_ranks", "four_ranks"])
def test_the_estimate_from_shapes_alone_equals_what_every_rank_held(request, ranks):
    # The memory planner's decode term: the same figure as each rank's real decode, for every tiling
    # scenario (batch 2, three-way temporal overlaps, fewer tiles than ranks), fp32 tiles; and for
    # rank 0's frames written as ComfyUI images, the float32 copies of that conversion counted too.
    results = request.getfixturevalue(ranks)
    world_size = len(results)
    compared = {}
    for name, (shape, tiling, _, _) in SCENARIOS.items():
        held = [results[rank][name]["stats"].assembly_peak_bytes for rank in range(world_size)]
        estimated = [assembly_peak_estimate(shape, tiling, world_size, rank, 4, image_layout=False) for rank in range(world_size)]
        compared[name] = (held, estimated)
    shape, tiling = SCENARIOS[IMAGE_SCENARIO][:2]
    held = [results[rank]["images_stats"].assembly_peak_bytes for rank in range(world_size)]
    compared["as images"] = (held, [assembly_peak_estimate(shape, tiling, world_size, rank, 4) for rank in range(world_size)])
    print(f"held / estimated bytes per rank: {compared}")
    assert all(held == estimated for held, estimated in compared.values()), compared
    # Rank 0 holds more than any other rank once the images' copies count (its window and hand-outs).
    assert compared["as images"][0][0] > max(compared["as images"][0][1:], default=0)
    assert compared["as images"][0][0] > compared[IMAGE_SCENARIO][0][0]


def test_decoder_drawing_unexpected_noise_is_refused(decoder):
    # A decoder whose noise draws differ from what ranks replay must not silently desynchronise.
    latent = scenario_latent("fewer_tiles_than_ranks")
    original_forward = decoder.forward

    def forward_with_extra_draw(sample, timestep=None, generator=None):
        torch.randn(3, generator=generator)
        return original_forward(sample, timestep, generator)

    decoder.forward = forward_with_extra_draw
    try:
        with pytest.raises(RuntimeError, match="drew different noise"):
            distributed_decode_video(
                decoder, latent, SCENARIOS["fewer_tiles_than_ranks"][1], Comm(None), torch.Generator().manual_seed(0)
            )
    finally:
        del decoder.forward


def test_wrong_latent_and_out_shapes_get_actionable_errors(decoder):
    with pytest.raises(ValueError, match=r"\[batch, 128, frames, height, width\]"):
        distributed_decode_images(decoder, torch.zeros(1, 16, 2, 2, 2), None, Comm(None))
    latent = scenario_latent("no_tiling")
    with pytest.raises(ValueError, match="decoded_images_shape"):
        distributed_decode_images(decoder, latent, None, Comm(None), out=torch.zeros(1, 64, 64, 3))


def decode_with_the_ltx23_decoder(world_size: int) -> dict:
    """Runs on every rank: the 2.3-layout decoder's distributed decode of the tiled scenarios."""
    torch.set_num_threads(1)
    comm = Comm.world()
    decoder = build_tiny_decoder(TINY_LTX23_DECODER_CONFIG)
    names = ("spatial_and_temporal", "three_way_temporal_overlap")
    return _tensors_as_numpy({name: distributed_decode_video(decoder, scenario_latent(name), SCENARIOS[name][1], comm, None) for name in names})


def test_ltx23_decoder_layout_at_four_ranks_matches_ltx_core_tiled_decode_fp32():
    torch.set_num_threads(1)
    decoder = build_tiny_decoder(TINY_LTX23_DECODER_CONFIG)
    ranks = [_numpy_as_tensors(result) for result in run_ranks(4, decode_with_the_ltx23_decoder, 4)]
    for name, video in ranks[0].items():
        _, _, reference_tiling, _ = SCENARIOS[name]
        expected = single_gpu_decode_video(decoder, scenario_latent(name), reference_tiling, None)
        assert expected.abs().max().item() > 0.1, f"{name}: the reference decode is trivial"
        diff = _max_abs_diff(video, expected)
        assert diff <= TOLERANCE, f"{name}: 4 ranks differ from ltx-core's tiled decode by {diff}"
        assert all(result[name] is None for result in ranks[1:]), f"{name}: only rank 0 returns frames"
