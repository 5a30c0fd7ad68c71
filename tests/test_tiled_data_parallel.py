"""Tests for tiled data parallel (mgpu_backend/parallel/tiled_data_parallel.py).

CPU only, fp32 (fp64 where exactness of the blend itself is checked). The real-model tests use a
tiny random ltx-core LTXModel built through ltx-core's own configurator and wrapped in X0Model, with
inputs (positions, conditioning tokens, attention mask) built by ltx-core's latent tools and
conditioning items, so the token layout is the one the real stage-2 loop produces.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.conditioning.types.attention_strength_wrapper import ConditioningItemAttentionStrengthWrapper
from ltx_core.conditioning.types.keyframe_cond import VideoConditionByKeyframeIndex
from ltx_core.model.transformer.modality import Modality
from ltx_core.model.transformer.model import X0Model
from ltx_core.model.transformer.model_configurator import LTXModelConfigurator
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, VideoLatentShape

from mgpu_backend.bundles.tiny import LTX2_TRANSFORMER_ARCHITECTURE
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.tiled_data_parallel import (
    DimensionTiling,
    TileCounts,
    VideoTilePlan,
    apply_tiled_data_parallel,
    balanced_tile_split,
    conditioning_tile_membership,
    dimension_blend_ramps,
    dimension_tile_bounds,
    normalize_tile_positions,
    round_robin_tiles,
    tile_position_extents,
)
from tests.dist_harness import run_ranks

VIDEO_CHANNELS = 16
AUDIO_CHANNELS, AUDIO_MEL_BINS = 2, 4
CONTEXT_DIM = 32
FPS = 24.0


# --------------------------------------------------------------------------------------------------
# Tiny real model and ltx-core-built inputs
# --------------------------------------------------------------------------------------------------


LAYOUTS = ("19b", "22b")
"""The transformer layouts of LTX-2.0 (19B) and LTX-2.3 (22B: split RoPE, gated attention,
cross-attention AdaLN, cross-modal timesteps scaled by 1000), both checked under TDP."""


def _tiny_transformer_config(layout: str = "19b") -> dict:
    # Values ltx-core's configurator insists on, plus tiny dimensions: 4 heads of 8 for video and audio.
    config = {
        "transformer": {
            "num_attention_heads": 4,
            "attention_head_dim": 8,
            "in_channels": VIDEO_CHANNELS,
            "out_channels": VIDEO_CHANNELS,
            "num_layers": 1,
            "cross_attention_dim": CONTEXT_DIM,
            "audio_num_attention_heads": 4,
            "audio_attention_head_dim": 8,
            "audio_in_channels": AUDIO_CHANNELS * AUDIO_MEL_BINS,
            "audio_out_channels": AUDIO_CHANNELS * AUDIO_MEL_BINS,
            "audio_cross_attention_dim": CONTEXT_DIM,
            "caption_proj_before_connector": True,
            **LTX2_TRANSFORMER_ARCHITECTURE,
        }
    }
    if layout == "22b":
        config["transformer"].update(rope_type="split", apply_gated_attention=True, cross_attention_adaln=True, av_ca_timestep_scale_multiplier=1000)
    return config


def _tiny_x0_model(seed: int = 0, layout: str = "19b") -> X0Model:
    torch.manual_seed(seed)
    velocity_model = LTXModelConfigurator.from_config(_tiny_transformer_config(layout))
    with torch.no_grad():
        for parameter in velocity_model.parameters():
            parameter.normal_(0.0, 0.2)  # several parameters are created with torch.empty
    return X0Model(velocity_model).eval()


def _stage2_inputs(video_grid, seed: int = 1, with_conditioning: bool = True, latent=None):
    """(video, audio) Modalities as the stage-2 loop builds them, at sigma 0.6.

    With conditioning: a 1x2x2 keyframe at frame 8 (top-left corner, overlaps only some tiles) and a
    1x2x2 reference at a negative time (frame -16, every tile keeps it) with attention strength 0.5.
    """
    generator = torch.Generator().manual_seed(seed)
    frames, height, width = video_grid
    video_tools = VideoLatentTools(
        VideoLatentPatchifier(1), VideoLatentShape(1, VIDEO_CHANNELS, frames, height, width), fps=FPS
    )
    if latent is None:
        latent = torch.randn(1, VIDEO_CHANNELS, frames, height, width, generator=generator)
    video_state = video_tools.create_initial_state("cpu", torch.float32, latent)
    if with_conditioning:
        keyframe = torch.randn(1, VIDEO_CHANNELS, 1, 2, 2, generator=generator)
        reference = torch.randn(1, VIDEO_CHANNELS, 1, 2, 2, generator=generator)
        video_state = VideoConditionByKeyframeIndex(keyframe, frame_idx=8, strength=1.0).apply_to(
            video_state, video_tools
        )
        video_state = ConditioningItemAttentionStrengthWrapper(
            VideoConditionByKeyframeIndex(reference, frame_idx=-16, strength=1.0), attention_mask=0.5
        ).apply_to(video_state, video_tools)
    audio_tools = AudioLatentTools(AudioPatchifier(1), AudioLatentShape(1, AUDIO_CHANNELS, 5, AUDIO_MEL_BINS))
    audio_state = audio_tools.create_initial_state(
        "cpu", torch.float32, torch.randn(1, AUDIO_CHANNELS, 5, AUDIO_MEL_BINS, generator=generator)
    )
    sigma = torch.tensor([0.6])
    context = torch.randn(1, 7, CONTEXT_DIM, generator=generator)
    video = Modality(
        latent=video_state.latent,
        sigma=sigma,
        timesteps=video_state.denoise_mask * sigma,
        positions=video_state.positions,
        context=context,
        attention_mask=video_state.attention_mask,
    )
    audio = Modality(
        latent=audio_state.latent,
        sigma=sigma,
        timesteps=audio_state.denoise_mask * sigma,
        positions=audio_state.positions,
        context=context,
    )
    return video, audio


def _latent_interval_positions(video_grid, batch: int = 1) -> torch.Tensor:
    """[B, 3, F*H*W, 2] latent-cell intervals in patchifier order (what ltx-core builds before scaling)."""
    return VideoLatentPatchifier(1).get_patch_grid_bounds(VideoLatentShape(batch, 1, *video_grid)).float()


class _CallCountingModel:
    """Stand-in model: call k (1-based) returns k for every video and audio token, and records inputs."""

    def __init__(self) -> None:
        self.calls: list[Modality] = []

    def __call__(self, video, audio, perturbations=None):
        self.calls.append(video)
        number = float(len(self.calls))
        return torch.full_like(video.latent, number), torch.full_like(audio.latent, number)


class _RecordingModel:
    """Delegates to a real model and records every video Modality it was called with."""

    def __init__(self, model) -> None:
        self.model = model
        self.calls: list[Modality] = []

    def __call__(self, video, audio, perturbations=None):
        self.calls.append(video)
        return self.model(video=video, audio=audio, perturbations=perturbations)


class _IdentityModel:
    def __call__(self, video, audio, perturbations=None):
        return video.latent.clone(), audio.latent.clone()


# --------------------------------------------------------------------------------------------------
# Tiling math
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "video_grid, tile_counts",
    [
        ((7, 11, 13), TileCounts(DimensionTiling(2, 1), DimensionTiling(3, 2), DimensionTiling(4, 1))),
        ((5, 9, 17), TileCounts(DimensionTiling(3, 1), DimensionTiling(2, 3), DimensionTiling(5, 2))),
        ((4, 10, 10), TileCounts(DimensionTiling(4, 0), DimensionTiling(3, 2), DimensionTiling(3, 1))),
        # Overlaps of 3 and 5 give ramp steps 1/4 and 1/6: exact only because weights are dyadic.
        ((9, 13, 21), TileCounts(DimensionTiling(2, 5), DimensionTiling(2, 3), DimensionTiling(3, 5))),
    ],
)
def test_blend_masks_sum_to_exactly_one_for_uneven_splits_in_all_dimensions(video_grid, tile_counts):
    plan = VideoTilePlan(tile_counts, video_grid)
    for name, cells, tiling in zip(("frames", "height", "width"), video_grid, tile_counts.per_dimension):
        sizes = {end - start for start, end in dimension_tile_bounds(cells, tiling, name)}
        assert max(sizes) - min(sizes) <= 1, (name, sizes)
    mask_sum = torch.zeros(plan.num_video_tokens, dtype=torch.float32)
    coverage = torch.zeros(plan.num_video_tokens, dtype=torch.int64)
    for tile_index in range(plan.num_tiles):
        mask_sum.index_add_(0, plan.token_indices(tile_index), plan.blend_mask(tile_index).flatten())
        ones = torch.ones(math.prod(plan.tiles[tile_index].shape), dtype=torch.int64)
        coverage.index_add_(0, plan.token_indices(tile_index), ones)
    max_abs_diff = (mask_sum - 1.0).abs().max().item()
    assert max_abs_diff == 0.0, f"blend masks must sum to exactly 1; max abs diff {max_abs_diff}"
    # The split really is uneven and overlapping (some cells are covered by several tiles).
    assert coverage.max().item() > 1 and coverage.min().item() == 1


def test_tile_bounds_overlap_by_exactly_the_requested_cells_and_ramps_are_trapezoids():
    bounds = dimension_tile_bounds(23, DimensionTiling(4, 3), "width")
    assert bounds[0][0] == 0 and bounds[-1][1] == 23
    assert [bounds[i][1] - bounds[i + 1][0] for i in range(3)] == [3, 3, 3]
    ramps = dimension_blend_ramps(bounds)
    for index, ramp in enumerate(ramps):
        peak = int(torch.argmax(ramp))
        rising, falling = ramp[: peak + 1], ramp[peak:]
        assert torch.all(rising[1:] >= rising[:-1]) and torch.all(falling[1:] <= falling[:-1]), (index, ramp)
        assert ramp.max().item() == 1.0 and ramp.min().item() > 0.0, (index, ramp)
    # Inside an overlap both neighbours contribute a fraction, and the fractions add to 1 exactly.
    left, right = ramps[0][-3:], ramps[1][:3]
    assert torch.all((left > 0) & (left < 1)) and torch.equal(left + right, torch.ones(3))


@pytest.mark.parametrize(
    "world_size, expected", [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (6, (2, 3)), (8, (2, 4))]
)
def test_balanced_tile_split_is_the_most_square_factorisation(world_size, expected):
    assert balanced_tile_split(world_size) == expected


def test_round_robin_assignment_gives_16_tiles_on_4_ranks_4_each_and_handles_uneven_counts():
    assignment = round_robin_tiles(16, 4)
    assert assignment == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert round_robin_tiles(6, 4) == [[0, 4], [1, 5], [2], [3]]
    assert round_robin_tiles(2, 4) == [[0], [1], [], []]


def test_impossible_tilings_are_refused_with_an_actionable_message():
    with pytest.raises(ValueError, match="height: 8 tiles asked for 5 latent cells; use at most 5 tiles"):
        VideoTilePlan(TileCounts(height=DimensionTiling(8)), (1, 5, 8))
    # Two tiles over 6 cells with overlap 5 would be 6 and 5 cells: a tile no larger than its overlap.
    with pytest.raises(ValueError, match=r"width: overlap 5 is too large .* use overlap <= 4"):
        VideoTilePlan(TileCounts(width=DimensionTiling(2, 5)), (1, 4, 6))
    # Three tiles over 10 cells with overlap 3 would be 6, 5, 5 cells: the middle one cannot hold two
    # 3-cell ramps without a cell being covered by three tiles.
    with pytest.raises(ValueError, match=r"height: overlap 3 is too large .* use overlap <= 2"):
        dimension_tile_bounds(10, DimensionTiling(3, 3), "height")
    with pytest.raises(ValueError, match="overlap must be a non-negative integer"):
        DimensionTiling(2, -1)
    with pytest.raises(ValueError, match="num_tiles must be a positive integer"):
        DimensionTiling(0)
    with pytest.raises(ValueError, match="video_grid must be the latent"):
        VideoTilePlan(TileCounts(), (2, 4))
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        balanced_tile_split(0)


def test_a_video_smaller_than_the_configured_grid_is_refused():
    tdp = apply_tiled_data_parallel(_IdentityModel(), Comm(None), TileCounts(width=DimensionTiling(2, 1)), (1, 4, 6))
    video, audio = _stage2_inputs((1, 4, 4), with_conditioning=False)
    with pytest.raises(ValueError, match=r"video has 16 tokens but TDP was set up for the latent grid 1x4x6"):
        tdp(video=video, audio=audio)


# --------------------------------------------------------------------------------------------------
# Positions and conditioning tokens
# --------------------------------------------------------------------------------------------------


def test_position_normalisation_starts_tile_at_zero_and_keeps_interval_widths():
    generator = torch.Generator().manual_seed(3)
    # Two batch elements with different origins; generated tokens first, then two conditioning tokens.
    starts = torch.rand(2, 3, 6, generator=generator) * 10 + torch.tensor([[5.0], [40.0], [70.0]])
    widths = torch.rand(2, 3, 6, generator=generator) + 0.5
    positions = torch.stack((starts, starts + widths), dim=-1)
    positions[:, 0, 5, :] -= 30.0  # one conditioning token at a negative time
    normalized = normalize_tile_positions(positions, num_generated=4)
    generated_starts = normalized[:, :, :4, 0]
    assert torch.equal(generated_starts.amin(dim=2), torch.zeros(2, 3)), generated_starts.amin(dim=2)
    width_diff = ((normalized[..., 1] - normalized[..., 0]) - widths).abs().max().item()
    assert width_diff < 1e-5, f"interval widths changed by up to {width_diff}"
    offset = positions[:, :, :4, 0].amin(dim=2)
    shift_diff = (positions[:, :, 4:, 0] - normalized[:, :, 4:, 0] - offset[..., None]).abs().max().item()
    assert shift_diff < 1e-5, f"conditioning tokens moved differently from the tile, by up to {shift_diff}"


def test_conditioning_membership_keeps_references_everywhere_and_others_by_overlap_in_all_dimensions():
    video_grid = (2, 4, 4)
    plan = VideoTilePlan(TileCounts(height=DimensionTiling(2, 0), width=DimensionTiling(2, 0)), video_grid)
    extents = tile_position_extents(plan, _latent_interval_positions(video_grid))
    # Tiles (in latent cells, frames [0,2) each): 0 = h[0,2) w[0,2); 1 = h[0,2) w[2,4);
    # 2 = h[2,4) w[0,2); 3 = h[2,4) w[2,4).
    conditioning = torch.tensor(
        [
            [[-1.0, 0.0], [3.0, 4.0], [3.0, 4.0]],  # negative time: a reference, kept by every tile
            [[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]],  # inside tile 0 only
            [[1.0, 2.0], [1.0, 3.0], [3.0, 4.0]],  # straddles the height cut: tiles 1 and 3
            [[0.0, 2.0], [1.0, 3.0], [1.0, 3.0]],  # on the corner: all four tiles by overlap
            [[5.0, 6.0], [0.0, 1.0], [0.0, 1.0]],  # after the last frame: no tile
            [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]],  # touches the right edge only at w=4: no tile
        ]
    ).permute(1, 0, 2)[None]  # -> [1, 3, 6, 2]
    membership = conditioning_tile_membership(extents, conditioning)
    expected = torch.tensor(
        [
            [True, True, False, True, False, False],
            [True, False, True, True, False, False],
            [True, False, False, True, False, False],
            [True, False, True, True, False, False],
        ]
    )
    assert torch.equal(membership, expected), membership


def test_conditioning_tokens_are_averaged_over_the_tiles_that_kept_them_and_audio_over_all_tiles():
    video_grid = (2, 6, 8)
    tdp = apply_tiled_data_parallel(
        _CallCountingModel(),
        Comm(None),
        TileCounts(height=DimensionTiling(2, 1), width=DimensionTiling(2, 1)),
        video_grid,
    )
    video, audio = _stage2_inputs(video_grid)  # 4 keyframe tokens at h,w in [0,2): tile 0 only; 4 references
    denoised_video, denoised_audio = tdp(video=video, audio=audio)
    num_generated = 2 * 6 * 8
    keyframe_out = denoised_video[0, num_generated : num_generated + 4]
    reference_out = denoised_video[0, num_generated + 4 :]
    assert torch.equal(keyframe_out, torch.full_like(keyframe_out, 1.0)), keyframe_out[:, 0]
    # Kept by tiles 1..4 (call numbers 1..4), weight 1/4 each: (1+2+3+4)/4.
    assert torch.equal(reference_out, torch.full_like(reference_out, 2.5)), reference_out[:, 0]
    assert torch.equal(denoised_audio, torch.full_like(denoised_audio, 2.5)), denoised_audio.flatten()[:4]
    kept_counts = [call.latent.shape[1] - math.prod(tile.shape) for call, tile in zip(tdp.model.calls, tdp.plan.tiles)]
    assert kept_counts == [8, 4, 4, 4], kept_counts
    # The tile's conditioning tokens were sliced out of the attention mask along with their latents.
    assert all(call.attention_mask.shape[1:] == (call.latent.shape[1],) * 2 for call in tdp.model.calls)


def test_identity_model_blended_through_overlapping_tiles_returns_the_input_exactly_fp64():
    video_grid = (3, 7, 9)
    tiling = TileCounts(DimensionTiling(2, 1), DimensionTiling(3, 1), DimensionTiling(2, 2))
    tdp = apply_tiled_data_parallel(_IdentityModel(), Comm(None), tiling, video_grid)
    video, audio = _stage2_inputs(video_grid, with_conditioning=False)
    # fp32-representable values in fp64: value x dyadic mask and their sums are then all exact.
    video = dataclasses.replace(video, latent=video.latent.double())
    denoised_video, _ = tdp(video=video, audio=audio)
    max_abs_diff = (denoised_video - video.latent).abs().max().item()
    assert max_abs_diff == 0.0, f"blend of identical tiles differs from the input by {max_abs_diff}"


# --------------------------------------------------------------------------------------------------
# Real tiny LTX-2 transformer
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_1x1x1_tiling_equals_the_untiled_model_call_bitwise(layout):
    model = _tiny_x0_model(layout=layout)
    video_grid = (2, 6, 8)
    video, audio = _stage2_inputs(video_grid)
    tdp = apply_tiled_data_parallel(model, Comm(None), TileCounts(), video_grid)
    with torch.no_grad():
        expected_video, expected_audio = model(video=video, audio=audio, perturbations=None)
        tiled_video, tiled_audio = tdp(video=video, audio=audio)
    video_diff = (tiled_video - expected_video).abs().max().item()
    audio_diff = (tiled_audio - expected_audio).abs().max().item()
    assert torch.equal(tiled_video, expected_video), f"video max abs diff {video_diff}"
    assert torch.equal(tiled_audio, expected_audio), f"audio max abs diff {audio_diff}"


def test_tile_interior_equals_the_model_run_on_that_tile_as_a_video_of_its_own():
    """Tokens where only one tile has weight must be exactly that tile's output, and that output must be
    what ltx-core computes for a standalone video of the tile's size (positions from the origin)."""
    model = _RecordingModel(_tiny_x0_model())
    video_grid = (2, 4, 10)
    tiling = TileCounts(width=DimensionTiling(2, 2))  # tiles w[0,6) and w[4,10)
    video, audio = _stage2_inputs(video_grid, with_conditioning=False)
    full_latent = video.latent.view(1, 2, 4, 10, VIDEO_CHANNELS)
    tile_latent = full_latent[:, :, :, 4:10].permute(0, 4, 1, 2, 3)  # -> [B, C, F, H, 6]
    standalone_video, _ = _stage2_inputs((2, 4, 6), with_conditioning=False, latent=tile_latent)
    standalone_video = dataclasses.replace(standalone_video, context=video.context)

    interior = torch.zeros(2, 4, 6, dtype=torch.bool)
    interior[:, :, 2:] = True  # w[6,10): tile 1 alone
    interior_global = torch.zeros(2, 4, 10, dtype=torch.bool)
    interior_global[:, :, 6:] = True
    with torch.no_grad():
        expected, _ = model(video=standalone_video, audio=audio, perturbations=None)
        tiled, _ = apply_tiled_data_parallel(model, Comm(None), tiling, video_grid)(video=video, audio=audio)
    tile_1_positions = model.calls[2].positions  # calls: standalone, tile 0, tile 1
    assert torch.equal(tile_1_positions, standalone_video.positions), "normalised tile positions differ"
    diff = (tiled[0, interior_global.flatten()] - expected[0, interior.flatten()]).abs().max().item()
    assert diff == 0.0, f"tile interior differs from the standalone tile video by {diff}"

    with torch.no_grad():
        global_tdp = apply_tiled_data_parallel(model, Comm(None), tiling, video_grid, normalize_positions=False)
        global_tdp(video=video, audio=audio)
    width_shift = (standalone_video.positions - model.calls[-1].positions)[:, 2]
    assert torch.equal(width_shift, torch.full_like(width_shift, -4 * 32.0)), "global positions not kept"


SAME_TILING_GRID = (2, 6, 9)
SAME_TILING = TileCounts(height=DimensionTiling(2, 1), width=DimensionTiling(3, 1))  # 6 tiles


def _tiled_stage2_call_on_rank(layout: str = "19b"):
    torch.set_num_threads(1)
    comm = Comm.world()
    model = _tiny_x0_model(layout=layout)
    video, audio = _stage2_inputs(SAME_TILING_GRID)
    tdp = apply_tiled_data_parallel(model, comm, SAME_TILING, SAME_TILING_GRID)
    with torch.no_grad():
        denoised_video, denoised_audio = tdp(video=video, audio=audio)
    return denoised_video, denoised_audio, tdp.tiles_of_this_rank


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_tiling_gives_the_same_video_on_1_2_and_4_ranks_fp32(layout):
    single_video, single_audio, single_tiles = _tiled_stage2_call_on_rank(layout)
    assert single_tiles == [0, 1, 2, 3, 4, 5]
    for world_size, expected_tiles in ((2, [[0, 2, 4], [1, 3, 5]]), (4, [[0, 4], [1, 5], [2], [3]])):
        results = run_ranks(world_size, _tiled_stage2_call_on_rank, layout)
        assert [tiles for _, _, tiles in results] == expected_tiles
        for rank, (video, audio, _) in enumerate(results):
            assert torch.equal(video, results[0][0]) and torch.equal(audio, results[0][1]), f"rank {rank} differs"
        video_diff = (results[0][0] - single_video).abs().max().item()
        audio_diff = (results[0][1] - single_audio).abs().max().item()
        print(f"TDP {world_size} ranks vs 1 rank: video max abs diff {video_diff:.3e}, audio {audio_diff:.3e}")
        assert video_diff <= 1e-5, f"{world_size} ranks vs 1: video max abs diff {video_diff}"
        assert audio_diff <= 1e-5, f"{world_size} ranks vs 1: audio max abs diff {audio_diff}"
