"""Tiled data parallel (TDP): the stage-2 upscale transformer split into latent tiles over the ranks.

What it is
    The patchified video latent grid (frames F', height H', width W') is cut into overlapping tiles.
    Each tile is denoised by the full, unmodified ltx-core transformer on its own, with the full audio
    as context; tiles are handed to ranks round-robin, so there may be more tiles than ranks (16 tiles
    on 4 ranks = 4 tiles per rank). Every rank accumulates its tiles' denoised tokens weighted by
    trapezoidal blend masks into a full-size buffer, and ONE all-reduce per call sums the buffers.
    The masks sum to exactly 1 at every latent cell, so the sum is the blended video. Nothing is
    scattered or gathered: every rank already holds the full input and ends with the full output.

When to use it
    Only for the stage-2 upscale (the spatial 2x upsample followed by a few low-sigma denoising steps
    with the distilled LoRA). Each tile is denoised with local context only, so TDP is an
    approximation of the single-GPU result, not a faithful copy (use sequence parallel for that).
    Do not start TDP from pure noise: tiles denoised independently from sigma 1.0 produce unrelated
    content that never converges to one video. Drift between tiles grows with the first sigma.

Warning about audio (from the official LTX-2 multi-GPU documentation)
    Audio is not tiled. Every tile denoises the full audio with a different, partial video context,
    and the audio returned here is the average over all tiles. That average is NOT a meaningful audio
    latent. Keep the stage-1 audio frozen through the upscale and return it unchanged; the audio of
    this wrapper is only the context the video tiles need.

What it costs
    Per step, every rank runs ceil(tiles / ranks) transformer calls on tile-sized sequences (attention
    cost per tile falls quadratically with tile size), plus one all-reduce of the full video and
    audio latents. Weights are a full replica on every rank: TDP saves time, not weight memory.

``apply_tiled_data_parallel`` wraps the model and changes nothing on it, so there is no remove;
the stage-2 parallelize entry (``mgpu_backend.ltx.parallelize``) applies it to a transformer that
carries nothing of stage 1 (never together with sequence parallel). This module must never edit or
fork ltx-core (the model is called as is, per tile), never import ltx-pipelines, and never talk to
other ranks except through ``Comm``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from ltx_core.model.transformer.modality import Modality

from mgpu_backend.parallel.comm import Comm

logger = logging.getLogger(__name__)

DIMENSION_NAMES = ("frames", "height", "width")

# Blend-ramp weights are rounded to multiples of 1/RAMP_RESOLUTION. With 2**8, the product of the
# three per-dimension weights is a multiple of 2**-24 and fits a float32 mantissa exactly, so the
# masks of all tiles covering a cell add up to exactly 1.0 even in float32 (arbitrary fractions such
# as 1/3 would leave rounding residue). The ramp shape changes by at most 1/512.
RAMP_RESOLUTION = 2**8


# --------------------------------------------------------------------------------------------------
# Tiling configuration and pure tiling math (no torch.distributed)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DimensionTiling:
    """How one latent dimension is cut: a tile COUNT (not a size) and the overlap of neighbouring
    tiles in latent cells. The overlap is ignored when there is a single tile."""

    num_tiles: int = 1
    overlap: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.num_tiles, int) or self.num_tiles < 1:
            raise ValueError(f"num_tiles must be a positive integer, got {self.num_tiles!r}; use 1 for no tiling")
        if not isinstance(self.overlap, int) or self.overlap < 0:
            raise ValueError(f"overlap must be a non-negative integer of latent cells, got {self.overlap!r}")


@dataclass(frozen=True)
class TileCounts:
    """Tile counts and overlaps for the three latent dimensions, in ltx-core's token order."""

    frames: DimensionTiling = DimensionTiling()
    height: DimensionTiling = DimensionTiling()
    width: DimensionTiling = DimensionTiling()

    def __post_init__(self) -> None:
        for name in DIMENSION_NAMES:
            if not isinstance(getattr(self, name), DimensionTiling):
                raise TypeError(f"TileCounts.{name} must be a DimensionTiling, got {getattr(self, name)!r}")

    @property
    def per_dimension(self) -> tuple[DimensionTiling, DimensionTiling, DimensionTiling]:
        return (self.frames, self.height, self.width)

    @property
    def num_tiles(self) -> int:
        return math.prod(tiling.num_tiles for tiling in self.per_dimension)

    def describe(self) -> str:
        return " x ".join(
            f"{name} {tiling.num_tiles} (overlap {tiling.overlap})"
            for name, tiling in zip(DIMENSION_NAMES, self.per_dimension)
        )


def balanced_tile_split(world_size: int) -> tuple[int, int]:
    """The most square (height_tiles, width_tiles) grid with exactly ``world_size`` tiles.

    Height gets the smaller factor because videos are usually wider than tall: 6 -> (2, 3),
    8 -> (2, 4); a prime gives a single row of tiles (3 -> (1, 3)).
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    height_tiles = max(d for d in range(1, math.isqrt(world_size) + 1) if world_size % d == 0)
    return height_tiles, world_size // height_tiles


def _tile_sizes(cells: int, num_tiles: int, overlap: int) -> list[int]:
    # Neighbouring tiles share exactly `overlap` cells, so the tiles cover cells + (n-1)*overlap in
    # total; spread that as evenly as possible (larger tiles first).
    base, extra = divmod(cells + (num_tiles - 1) * overlap, num_tiles)
    return [base + 1 if index < extra else base for index in range(num_tiles)]


def _tiles_fit(sizes: list[int], overlap: int) -> bool:
    # A tile must be larger than each overlap it has, and its ramp-up and ramp-down regions must not
    # cross, otherwise a cell would be covered by three tiles of one dimension.
    for index, size in enumerate(sizes):
        overlaps = [overlap] * ((index > 0) + (index < len(sizes) - 1))
        if any(size <= o for o in overlaps) or size < sum(overlaps):
            return False
    return True


def dimension_tile_bounds(cells: int, tiling: DimensionTiling, dimension: str = "dimension") -> list[tuple[int, int]]:
    """[start, end) of every tile along one latent dimension of ``cells`` cells.

    Tiles cover all cells, neighbours overlap by exactly ``tiling.overlap`` cells, and tile sizes
    differ by at most one cell when the split is uneven.
    """
    if cells < 1:
        raise ValueError(f"{dimension} has {cells} latent cells; it must have at least 1")
    num_tiles, overlap = tiling.num_tiles, tiling.overlap
    if num_tiles == 1:
        return [(0, cells)]
    if num_tiles > cells:
        raise ValueError(
            f"{dimension}: {num_tiles} tiles asked for {cells} latent cells; use at most {cells} tiles"
        )
    sizes = _tile_sizes(cells, num_tiles, overlap)
    if not _tiles_fit(sizes, overlap):
        largest_fitting = next(
            o for o in range(overlap - 1, -1, -1) if _tiles_fit(_tile_sizes(cells, num_tiles, o), o)
        )
        raise ValueError(
            f"{dimension}: overlap {overlap} is too large for {num_tiles} tiles over {cells} latent cells "
            f"(tiles would be {min(sizes)} cells, and each tile must be larger than its overlap and hold "
            f"both of its blend ramps); use overlap <= {largest_fitting} or fewer tiles"
        )
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size - overlap
    assert bounds[-1][1] == cells, (bounds, cells)
    return bounds


def dimension_blend_ramps(bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Trapezoidal 1-D blend weights (float32) for each tile of ``dimension_tile_bounds``.

    Over the overlap of tiles i and i+1 the weight of tile i+1 rises and that of tile i falls by the
    same amount, so the weights of all tiles at every cell sum to exactly 1; elsewhere a tile has
    weight 1. Weights are multiples of 1/RAMP_RESOLUTION (see there why).
    """
    ramps = [torch.ones(end - start, dtype=torch.float64) for start, end in bounds]
    for index in range(len(bounds) - 1):
        overlap = bounds[index][1] - bounds[index + 1][0]
        if overlap <= 0:
            continue
        rising = torch.arange(1, overlap + 1, dtype=torch.float64) / (overlap + 1)
        rising = torch.round(rising * RAMP_RESOLUTION) / RAMP_RESOLUTION
        ramps[index + 1][:overlap] = rising
        ramps[index][-overlap:] = 1.0 - rising
    return [ramp.to(torch.float32) for ramp in ramps]


@dataclass(frozen=True)
class VideoTile:
    """One tile of the latent grid: its number in frames-height-width order and its cell ranges."""

    index: int
    frames: tuple[int, int]
    height: tuple[int, int]
    width: tuple[int, int]

    @property
    def bounds(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        return (self.frames, self.height, self.width)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(end - start for start, end in self.bounds)


class VideoTilePlan:
    """The tiles of a latent grid (F', H', W') under a ``TileCounts``: bounds, token indices into
    ltx-core's patchified sequence (order frames, height, width), and blend masks."""

    def __init__(self, tile_counts: TileCounts, video_grid: tuple[int, int, int]) -> None:
        video_grid = tuple(video_grid)
        if len(video_grid) != 3 or not all(isinstance(c, int) and c > 0 for c in video_grid):
            raise ValueError(
                f"video_grid must be the latent (frames, height, width) as three positive integers, got {video_grid!r}"
            )
        self.tile_counts = tile_counts
        self.video_grid: tuple[int, int, int] = video_grid
        per_dimension_bounds = [
            dimension_tile_bounds(cells, tiling, name)
            for cells, tiling, name in zip(video_grid, tile_counts.per_dimension, DIMENSION_NAMES)
        ]
        per_dimension_ramps = [dimension_blend_ramps(bounds) for bounds in per_dimension_bounds]
        self.tiles: list[VideoTile] = []
        self._ramps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for f, frames in enumerate(per_dimension_bounds[0]):
            for h, height in enumerate(per_dimension_bounds[1]):
                for w, width in enumerate(per_dimension_bounds[2]):
                    self.tiles.append(VideoTile(len(self.tiles), frames, height, width))
                    self._ramps.append(
                        (per_dimension_ramps[0][f], per_dimension_ramps[1][h], per_dimension_ramps[2][w])
                    )

    @property
    def num_tiles(self) -> int:
        return len(self.tiles)

    @property
    def num_video_tokens(self) -> int:
        return math.prod(self.video_grid)

    def blend_mask(self, tile_index: int) -> torch.Tensor:
        """Float32 mask of shape tile.shape; the masks of all tiles sum to exactly 1 on the grid."""
        frames_ramp, height_ramp, width_ramp = self._ramps[tile_index]
        return frames_ramp[:, None, None] * height_ramp[None, :, None] * width_ramp[None, None, :]

    def token_indices(self, tile_index: int) -> torch.Tensor:
        """Positions of the tile's cells in the patchified video sequence, in frames-height-width order."""
        tile = self.tiles[tile_index]
        _, grid_height, grid_width = self.video_grid
        frames, height, width = (torch.arange(start, end) for start, end in tile.bounds)
        cells = (frames[:, None, None] * grid_height + height[None, :, None]) * grid_width + width[None, None, :]
        return cells.flatten()


def round_robin_tiles(num_tiles: int, world_size: int) -> list[list[int]]:
    """Tile numbers per rank: rank r runs tiles r, r + world_size, r + 2*world_size, ..."""
    if num_tiles < 1 or world_size < 1:
        raise ValueError(f"need at least one tile and one rank, got {num_tiles} tiles and {world_size} ranks")
    return [list(range(rank, num_tiles, world_size)) for rank in range(world_size)]


def normalize_tile_positions(positions: torch.Tensor, num_generated: int) -> torch.Tensor:
    """Shift a tile's positions [B, 3, T, 2] so its generated tokens (the first ``num_generated``)
    start at 0 in every dimension.

    The model was trained on position grids that start at the origin; a tile in the corner of a
    large frame would otherwise carry positions it never saw. Only the origin moves: interval widths
    are kept, and the conditioning tokens after the generated ones move by the same offset so their
    relation to the tile is unchanged.
    """
    offset = positions[:, :, :num_generated, 0].amin(dim=2, keepdim=True)  # [B, 3, 1]
    return positions - offset.unsqueeze(-1)


def tile_position_extents(plan: VideoTilePlan, generated_positions: torch.Tensor) -> torch.Tensor:
    """[num_tiles, B, 3, 2]: per tile, the lowest start and highest end of its generated tokens'
    positions, in the units the positions use (ltx-core uses pixels and seconds)."""
    extents = []
    for tile_index in range(plan.num_tiles):
        indices = plan.token_indices(tile_index).to(generated_positions.device)
        tile_positions = generated_positions.index_select(2, indices)
        extents.append(torch.stack((tile_positions[..., 0].amin(dim=2), tile_positions[..., 1].amax(dim=2)), dim=-1))
    return torch.stack(extents)


def conditioning_tile_membership(tile_extents: torch.Tensor, conditioning_positions: torch.Tensor) -> torch.Tensor:
    """Which tiles keep which conditioning token: bool [num_tiles, C].

    A tile keeps a conditioning token when the token's [start, end) interval overlaps the tile's
    extent in all three dimensions, or when the token's time start is negative: such tokens are
    references (e.g. reference frames) that every tile must see so all tiles share the same context.
    ``tile_extents`` is [num_tiles, B, 3, 2] from ``tile_position_extents``; ``conditioning_positions``
    is [B, 3, C, 2].
    """
    starts = conditioning_positions[..., 0].unsqueeze(0)  # [1, B, 3, C]
    ends = conditioning_positions[..., 1].unsqueeze(0)
    tile_starts = tile_extents[..., 0].unsqueeze(-1)  # [num_tiles, B, 3, 1]
    tile_ends = tile_extents[..., 1].unsqueeze(-1)
    overlaps = ((starts < tile_ends) & (ends > tile_starts)).all(dim=2)  # [num_tiles, B, C]
    is_reference = (conditioning_positions[:, 0, :, 0] < 0).unsqueeze(0)  # [1, B, C]
    kept = overlaps | is_reference
    # One tile Modality holds the whole batch, so every batch element must keep the same tokens.
    if not torch.equal(kept.all(dim=1), kept.any(dim=1)):
        raise ValueError(
            "conditioning tokens fall into different tiles for different batch elements; TDP needs the same "
            "conditioning layout across the batch: run batch elements with different conditioning separately"
        )
    return kept[:, 0, :]


# --------------------------------------------------------------------------------------------------
# The wrapper
# --------------------------------------------------------------------------------------------------


class TiledDataParallelTransformer:
    """Callable like ltx-core's ``X0Model``: ``(video=Modality, audio=Modality, perturbations)`` ->
    ``(denoised_video, denoised_audio)``, computed tile by tile on the ranks of ``comm``.

    The video Modality holds the generated tokens of the grid first (F'*H'*W' of them, ltx-core's
    patchifier order) and any conditioning tokens appended after them; positions are ltx-core's
    [B, 3, T, 2] [start, end) intervals. The returned video covers every input token: generated tokens
    are the mask-weighted blend of the tiles that cover them; a conditioning token is the average over
    the tiles that kept it (weight 1/keepers), or its input latent unchanged if no tile kept it.
    The returned audio is the average over all tiles and must not be used as output (module docstring).
    ``idle_forward(model)``, when given, runs once for each tile this rank has fewer than the busiest
    rank, before the all-reduce: a model whose forwards are collective over the ranks (its weights
    sharded) needs every rank to run as many of them.
    """

    def __init__(self, model, comm: Comm, plan: VideoTilePlan, normalize_positions: bool = True,
                 idle_forward: Callable[[object], None] | None = None) -> None:  # fmt: skip
        self.model = model
        self.idle_forward = idle_forward
        self.comm = comm
        self.plan = plan
        self.normalize_positions = normalize_positions
        self.tiles_of_this_rank = round_robin_tiles(plan.num_tiles, comm.world_size)[comm.rank]
        self._device_cache: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _indices_and_masks(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if device not in self._device_cache:
            self._device_cache[device] = [
                (self.plan.token_indices(t).to(device), self.plan.blend_mask(t).flatten().to(device))
                for t in range(self.plan.num_tiles)
            ]
        return self._device_cache[device]

    def _check_video(self, video: Modality) -> None:
        if video is None:
            raise ValueError("tiled data parallel needs a video Modality; it tiles the video tokens")
        total_tokens = video.latent.shape[1]
        if total_tokens < self.plan.num_video_tokens:
            grid = "x".join(map(str, self.plan.video_grid))
            raise ValueError(
                f"the video has {total_tokens} tokens but TDP was set up for the latent grid {grid} "
                f"({self.plan.num_video_tokens} generated tokens); apply TDP again with the grid of this video"
            )
        if video.positions.ndim != 4 or video.positions.shape[1] != 3 or video.positions.shape[-1] != 2:
            raise ValueError(
                f"video positions must be ltx-core's [batch, 3, tokens, 2] [start, end) intervals, got shape "
                f"{tuple(video.positions.shape)}"
            )

    def __call__(self, video: Modality, audio: Modality | None, perturbations=None):
        self._check_video(video)
        num_generated = self.plan.num_video_tokens
        device = video.latent.device
        positions = video.positions
        num_conditioning = video.latent.shape[1] - num_generated

        if num_conditioning > 0:
            extents = tile_position_extents(self.plan, positions[:, :, :num_generated])
            membership = conditioning_tile_membership(extents, positions[:, :, num_generated:])
        else:
            membership = torch.zeros(self.plan.num_tiles, 0, dtype=torch.bool, device=device)
        keepers = membership.sum(dim=0)
        accumulate_dtype = torch.promote_types(video.latent.dtype, torch.float32)
        conditioning_weights = 1.0 / keepers.clamp(min=1).to(accumulate_dtype)

        video_sum = torch.zeros(video.latent.shape, dtype=accumulate_dtype, device=device)
        audio_sum = None if audio is None else torch.zeros(audio.latent.shape, dtype=accumulate_dtype, device=device)
        indices_and_masks = self._indices_and_masks(device)
        for tile_index in self.tiles_of_this_rank:
            generated_indices, blend_mask = indices_and_masks[tile_index]
            conditioning_indices = num_generated + torch.nonzero(membership[tile_index]).flatten()
            token_indices = torch.cat((generated_indices, conditioning_indices))
            tile_video = self._tile_modality(video, token_indices, num_tile_generated=generated_indices.numel())
            tile_denoised_video, tile_denoised_audio = self.model(
                video=tile_video, audio=audio, perturbations=perturbations
            )
            weights = torch.cat(
                (blend_mask.to(accumulate_dtype), conditioning_weights[conditioning_indices - num_generated])
            )
            video_sum.index_add_(1, token_indices, tile_denoised_video.to(accumulate_dtype) * weights[None, :, None])
            if audio_sum is not None:
                assert tile_denoised_audio is not None, "the model returned no audio for an audio input"
                audio_sum += tile_denoised_audio.to(accumulate_dtype)

        if self.idle_forward is not None:
            for _ in range(math.ceil(self.plan.num_tiles / self.comm.world_size) - len(self.tiles_of_this_rank)):
                self.idle_forward(self.model)

        orphans = num_generated + torch.nonzero(keepers == 0).flatten()
        if orphans.numel() > 0 and self.comm.rank == 0:
            # Conditioning tokens no tile kept pass through unchanged; added once, on one rank only.
            video_sum[:, orphans] = video.latent[:, orphans].to(accumulate_dtype)

        # One collective per call: the blended video and the audio sum travel in one buffer.
        parts = [video_sum.flatten()] + ([] if audio_sum is None else [audio_sum.flatten()])
        reduced = self.comm.all_reduce_sum(torch.cat(parts) if len(parts) > 1 else parts[0])
        denoised_video = reduced[: video_sum.numel()].view(video_sum.shape).to(video.latent.dtype)
        denoised_audio = None
        if audio_sum is not None:
            audio_average = reduced[video_sum.numel() :].view(audio_sum.shape) / self.plan.num_tiles
            denoised_audio = audio_average.to(audio.latent.dtype)
        return denoised_video, denoised_audio

    def _tile_modality(self, video: Modality, token_indices: torch.Tensor, num_tile_generated: int) -> Modality:
        positions = video.positions.index_select(2, token_indices)
        if self.normalize_positions:
            positions = normalize_tile_positions(positions, num_tile_generated)
        attention_mask = video.attention_mask
        if attention_mask is not None:
            attention_mask = attention_mask.index_select(1, token_indices).index_select(2, token_indices)
        timesteps = video.timesteps
        # ltx-core allows one timestep per sample ([B] or [B, 1]) as well as one per token.
        if timesteps.ndim >= 2 and timesteps.shape[1] == video.latent.shape[1]:
            timesteps = timesteps.index_select(1, token_indices)
        return dataclasses.replace(
            video,
            latent=video.latent.index_select(1, token_indices),
            timesteps=timesteps,
            positions=positions,
            attention_mask=attention_mask,
        )


def apply_tiled_data_parallel(
    model,
    comm: Comm,
    tiling: TileCounts,
    video_grid: tuple[int, int, int],
    normalize_positions: bool = True,
    idle_forward: Callable[[object], None] | None = None,
) -> TiledDataParallelTransformer:
    """Wrap an ltx-core ``X0Model`` (or anything with its call signature) so each call is computed as
    tiles of the latent grid ``video_grid`` = (F', H', W') spread round-robin over ``comm``'s ranks.

    Every rank must call the returned object with the same inputs, in lockstep. Errors for tilings
    that cannot fit the grid are raised here, before any model work. ``idle_forward``: see
    ``TiledDataParallelTransformer``.
    """
    if not isinstance(tiling, TileCounts):
        raise TypeError(f"tiling must be a TileCounts, got {type(tiling).__name__}")
    plan = VideoTilePlan(tiling, video_grid)
    wrapper = TiledDataParallelTransformer(model, comm, plan, normalize_positions=normalize_positions, idle_forward=idle_forward)
    per_rank = math.ceil(plan.num_tiles / comm.world_size)
    idle = max(0, comm.world_size - plan.num_tiles)
    logger.info(
        "tiled data parallel: latent grid %s, tiles %s = %d tiles of about %s cells, round-robin on %d ranks "
        "(up to %d per rank%s), positions %s; this rank runs tiles %s",
        "x".join(map(str, plan.video_grid)),
        tiling.describe(),
        plan.num_tiles,
        "x".join(map(str, plan.tiles[0].shape)),
        comm.world_size,
        per_rank,
        f", {idle} ranks idle" if idle else "",
        "normalised per tile" if normalize_positions else "global",
        wrapper.tiles_of_this_rank,
    )
    return wrapper
