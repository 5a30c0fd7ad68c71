"""Distributed video VAE decode: ltx-core's tiled decode with its tiles spread over the ranks.

What it is
    ltx-core's single-GPU ``VideoDecoder.tiled_decode`` cuts the video latent into overlapping tiles
    (time x height x width), decodes them one after another and blends them with trapezoidal masks,
    normalising by the accumulated mask weight. Here the SAME tiles (taken from ltx-core itself, for
    the same ``TilingConfig``) are handed to the ranks round-robin (tile i -> rank i % world_size;
    tiles may outnumber ranks, and ranks with no tile simply take part in the reductions). Each rank
    multiplies its decoded tiles by ltx-core's blend masks; for every temporal group of tiles (tiles
    sharing one frame range) the ranks add their weighted tiles into a group buffer and ONE
    all-reduce sums it. Rank 0 then blends the groups in time exactly as ltx-core does (previous
    group + current group over the overlapping frames, divided by the summed mask weights clamped at
    1e-8) and hands out each frame range as soon as no later group can touch it. Only rank 0 ends
    with frames; the other ranks return ``None``.

Faithfulness
    Tile geometry, masks, weights, decoded frame counts, the temporal blend and the final division
    are ltx-core's. With one rank the result is bit-identical to ``tiled_decode``. With several
    ranks the only difference is the order in which float additions happen where three or more
    tiles overlap (a spatial corner): rank partial sums are added instead of one running sum, a
    difference at float rounding level (about 1e-7 relative in fp32). Weights are always summed on
    rank 0 in ltx-core's order, so they are exact.

Noise (timestep-conditioned decoders)
    A decoder with timestep conditioning adds noise to every latent tile, and blocks with
    ``inject_noise`` add spatial noise, all drawn from the caller's generator in tile order. Every
    rank replays the draws of the tiles other ranks decode (same shapes, dtype and device, so the
    generator advances identically) and therefore decodes its own tiles with exactly the noise the
    single-GPU loop would use; at the end every rank's generator stands where the single-GPU loop
    leaves it. Every rank checks the replay against its own real decodes and stops with an error if
    ltx-core's decoder ever draws differently. ``generator=None`` means the device's default
    generator, as in ltx-core; every rank must then have been seeded alike.

Shared-memory-friendly assembly
    Rank 0 never needs a second full copy of the video: it keeps only the frames a later temporal
    group can still add to (ltx-core's "previous chunk") and writes finished frames straight into
    the caller's output. ``distributed_decode_images(..., out=...)`` fills a preallocated ComfyUI
    IMAGE tensor (``[frames, height, width, 3]`` float32 in 0..1), for instance one mapped onto a
    shared-memory segment; ``decoded_images_shape`` says how big it must be.

What it costs
    Decode time per rank falls to about ceil(tiles / ranks) tile decodes. Each rank decodes its
    tiles one round ahead of the reduction (it may hold the weighted tiles of the current and next
    round), so ranks with no tile in one temporal group keep working instead of waiting; a round is
    decoded before a group's reduction when the round starts before the group's end plus one round,
    the same rounds on every rank, so that the progress calls line up. Traffic is
    one all-reduce per temporal group of a buffer holding that group's frames at full resolution
    (about the video size times the temporal overlap factor in total). Per-rank memory: the decoder's
    activations for one tile (unchanged by the rank count: tiles keep their size), one group buffer,
    and the rank's held tiles (these fall as 1/ranks); rank 0 also holds the frame window and, while
    it hands finished frames out, the normalised chunk and (as images) two float32 copies of it: at
    1536x1024x121 in bf16 rank 0 holds 3.2 GiB at once, another rank 0.6 GiB.
    ``last_decode_stats()`` reports tiles, seconds and peak bytes of the last call in this process;
    ``assembly_peak_estimate`` gives the same bytes from the shapes alone (the memory planner's term).

Progress
    ``on_tiles(done, total)`` is called after every round of tiles (one tile per rank: tiles
    ``k*N .. k*N+N-1`` in round k) with the number of tiles all ranks have decoded so far and the
    tile count: on every rank, at the same points and with the same arguments, so it may be a
    collective (the fleet's step report, which is also its cancel point). With one rank it is one
    call per tile.

Every rank must pass the same decoder weights, latent, tiling, timestep and generator state.
This module must never edit or fork ltx-core (the decoder is called as is, per tile), never change
ltx-core's tile geometry or blend weights, never import ltx-pipelines, and never talk to other ranks
except through ``Comm``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from ltx_core.model.video_vae.resnet import ResnetBlock3D, UNetMidBlock3D
from ltx_core.model.video_vae.sampling import DepthToSpaceUpsample
from ltx_core.model.video_vae.tiling import Tile, TilingConfig
from ltx_core.model.video_vae.video_vae import SpatioTemporalScaleFactors, VideoDecoder

from mgpu_backend.parallel.comm import Comm

logger = logging.getLogger(__name__)

OnTiles = Callable[[int, int], None]
"""``on_tiles(tiles_decoded_on_all_ranks, tiles_total)`` after each round of tiles."""
Emit = Callable[[int, torch.Tensor], "int | None"]
"""``emit(first_frame, chunk)`` on rank 0 for each run of finished frames; it may return the bytes it
allocated beside the chunk while handling it (counted in ``assembly_peak_bytes``)."""

# ltx-core's tiled decode divides by the summed mask weights clamped at this value.
_MIN_BLEND_WEIGHT = 1e-8


@dataclass(frozen=True)
class DecodeStats:
    """What the last distributed decode did on this rank.

    ``assembly_peak_bytes`` counts the weighted tiles, group buffer and frame window this rank held
    at once, and on rank 0 what a hand-out of finished frames held beside them (the normalised chunk,
    its weights, what ``emit`` reported); not the decoder's activations, not the caller's output.
    ``assembly_peak_estimate`` gives the same figure from shapes alone. ``device_peak_bytes`` is the
    CUDA allocator's peak during the call when the latent is on a CUDA device, else ``None``.
    ``reduce_seconds`` includes waiting in the reductions for slower ranks.
    """

    rank: int
    world_size: int
    tiles_total: int
    tiles_decoded: int
    tile_indices: tuple[int, ...]
    temporal_groups: int
    decode_seconds: float
    reduce_seconds: float
    total_seconds: float
    assembly_peak_bytes: int
    device_peak_bytes: int | None


_last_stats: DecodeStats | None = None


def last_decode_stats() -> DecodeStats | None:
    """Statistics of the last ``distributed_decode_*`` call in this process (``None`` before any)."""
    return _last_stats


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def distributed_decode_images(
    decoder: VideoDecoder,
    latent: torch.Tensor,
    tiling_config: TilingConfig | None,
    comm: Comm,
    generator: torch.Generator | None = None,
    *,
    timestep: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    on_tiles: OnTiles | None = None,
) -> torch.Tensor | None:
    """Decode ``latent`` [B, 128, F', H', W'] with its tiles spread over ``comm``'s ranks; rank 0 gets
    ComfyUI IMAGE frames: float32 [B*F, H, W, 3] in 0..1 (F = 8(F'-1)+1, H = 32 H', W = 32 W'), written chunk by chunk into ``out`` when given (for instance a tensor
    over a shared-memory segment of ``decoded_images_shape``), so no second full copy is made.
    Returns ``None`` on the other ranks (``out`` is only used on rank 0)."""
    _check_latent(decoder, latent)
    images = None
    if comm.rank == 0:
        expected_shape = decoded_images_shape(decoder, latent.shape)
        if out is None:
            images = torch.empty(expected_shape, dtype=torch.float32)
        else:
            if tuple(out.shape) != expected_shape or out.dtype != torch.float32 or not out.is_contiguous():
                raise ValueError(
                    f"out must be a contiguous float32 tensor of shape {expected_shape} (frames, height, width, 3) "
                    f"for a latent of shape {tuple(latent.shape)}; got {out.dtype} {tuple(out.shape)}; "
                    "allocate it with decoded_images_shape(decoder, latent.shape)"
                )
            images = out
    batch = latent.shape[0]

    def write_frames(first_frame: int, chunk: torch.Tensor) -> int:
        per_batch = images.view(batch, -1, *images.shape[1:])
        per_batch[:, first_frame : first_frame + chunk.shape[2]] = _to_image_layout(chunk).to(images.device)
        return _IMAGE_LAYOUT_COPIES * chunk.numel() * 4

    decode_tiles(decoder, latent, tiling_config, comm, generator, timestep, write_frames, on_tiles)
    return images


def decoded_images_shape(decoder: VideoDecoder, latent_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the IMAGE tensor a latent decodes to: (B*F, H, W, 3)."""
    batch, channels, frames, height, width = decoded_video_shape(decoder, latent_shape)
    return (batch * frames, height, width, channels)


# --------------------------------------------------------------------------------------------------
# Tile plan: ltx-core's tiles grouped by frame range, and what decoding one tile draws and yields
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TemporalGroup:
    """Consecutive tiles sharing one output frame range (ltx-core decodes and blends them together)."""

    first_tile: int
    end_tile: int
    first_frame: int
    frames: int


def decoded_video_shape(decoder: VideoDecoder, latent_shape) -> tuple[int, int, int, int, int]:
    """Shape of the video a latent decodes to: (B, 3, F, H, W)."""
    scale = decoder.video_downscale_factors
    batch, _, latent_frames, latent_height, latent_width = latent_shape
    return (batch, 3, (latent_frames - 1) * scale.time + 1, latent_height * scale.height, latent_width * scale.width)


def _resolved_frame_range(frame_slice: slice, total_frames: int) -> tuple[int, int]:
    # Without temporal tiling ltx-core maps time to slice(0, None), on which its own tiled decode
    # fails; None means "to the end of the video".
    start = 0 if frame_slice.start is None else frame_slice.start
    stop = total_frames if frame_slice.stop is None else frame_slice.stop
    return start, stop


def _temporal_groups(tiles: list[Tile], total_frames: int) -> list[_TemporalGroup]:
    groups: list[_TemporalGroup] = []
    first = 0
    for index in range(1, len(tiles) + 1):
        if index == len(tiles) or tiles[index].out_coords[2] != tiles[first].out_coords[2]:
            start, stop = _resolved_frame_range(tiles[first].out_coords[2], total_frames)
            groups.append(_TemporalGroup(first_tile=first, end_tile=index, first_frame=start, frames=stop - start))
            first = index
    return groups


def _tile_decode_plan(decoder: VideoDecoder, tile_latent_shape: torch.Size) -> tuple[list[torch.Size], int]:
    """The noise draws (shapes, in order) decoding one latent tile makes, and its decoded frame count.

    Mirrors ``VideoDecoder.forward``: the latent-shaped noise of timestep conditioning first, then
    two (height, width) draws per ResnetBlock3D with ``inject_noise``, at the block's resolution.
    """
    noise_shapes: list[torch.Size] = []
    if decoder.timestep_conditioning:
        noise_shapes.append(torch.Size(tile_latent_shape))
    frames, height, width = tile_latent_shape[2:]
    for block in decoder.up_blocks:
        if isinstance(block, DepthToSpaceUpsample):
            time_stride, height_stride, width_stride = block.stride
            # A temporal 2x upsample drops the first frame (causal first-frame handling).
            frames = frames * time_stride - (1 if time_stride == 2 else 0)
            height, width = height * height_stride, width * width_stride
            continue
        if isinstance(block, UNetMidBlock3D):
            resnets = list(block.res_blocks)
        elif isinstance(block, ResnetBlock3D):
            resnets = [block]
        else:
            raise TypeError(
                f"distributed decode does not know the decoder block {type(block).__name__}; it supports "
                "ltx-core 1.0.0's VideoDecoder blocks (UNetMidBlock3D, ResnetBlock3D, DepthToSpaceUpsample)"
            )
        for resnet in resnets:
            if resnet.inject_noise:
                noise_shapes.extend([torch.Size((height, width))] * 2)
    return noise_shapes, frames


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise ValueError(f"no default generator for device {device}; pass generator= explicitly")


class _TileDecoder:
    """Decodes tiles by index in increasing order, keeping the generator where ltx-core's
    single-GPU loop would have it before each tile (draws of skipped tiles are replayed)."""

    def __init__(self, decoder, latent, tiles, generator, timestep) -> None:
        self.decoder, self.latent, self.tiles, self.timestep = decoder, latent, tiles, timestep
        self.plans = [_tile_decode_plan(decoder, latent[tile.in_coords].shape) for tile in tiles]
        self.draws_noise = any(shapes for shapes, _ in self.plans)
        if self.draws_noise and generator is None:
            generator = _default_generator(latent.device)
        self.generator = generator
        self.next_tile = 0

    def decoded_frames(self, tile_index: int) -> int:
        return self.plans[tile_index][1]

    def _replay(self, tile_index: int) -> None:
        for shape in self.plans[tile_index][0]:
            torch.randn(shape, generator=self.generator, device=self.latent.device, dtype=self.latent.dtype)

    def skip_to(self, tile_index: int) -> None:
        if self.draws_noise:
            for skipped in range(self.next_tile, tile_index):
                self._replay(skipped)
        self.next_tile = max(self.next_tile, tile_index)

    def decode(self, tile_index: int) -> torch.Tensor:
        assert tile_index >= self.next_tile, (tile_index, self.next_tile)
        self.skip_to(tile_index)
        expected_state = None
        if self.draws_noise:
            state_before = self.generator.get_state()
            self._replay(tile_index)
            expected_state = self.generator.get_state()
            self.generator.set_state(state_before)
        decoded = self.decoder(self.latent[self.tiles[tile_index].in_coords], self.timestep, self.generator)
        if expected_state is not None and not torch.equal(self.generator.get_state(), expected_state):
            raise RuntimeError(
                f"tile {tile_index}: the decoder drew different noise than distributed decode replays on the "
                "other ranks, so ranks would decode with the wrong noise; the ltx-core VideoDecoder is not "
                "the 1.0.0 layout this module mirrors (see _tile_decode_plan)"
            )
        if decoded.shape[2] != self.decoded_frames(tile_index):
            raise RuntimeError(
                f"tile {tile_index} decoded to {decoded.shape[2]} frames, expected {self.decoded_frames(tile_index)}; "
                "the ltx-core VideoDecoder is not the 1.0.0 layout this module mirrors"
            )
        self.next_tile = tile_index + 1
        return decoded


# --------------------------------------------------------------------------------------------------
# Decode and assemble
# --------------------------------------------------------------------------------------------------


def _device_blend_mask(tile: Tile, device: torch.device) -> torch.Tensor:
    """``tile.blend_mask`` built on ``device``: the same fp32 products in the same order as
    ltx-core's property, so the same values, without building a full-size mask on the host and
    copying it over for every tile (that cost more than the decode itself at 1024x1536)."""
    num_dims = len(tile.out_coords)
    combined = None
    for dim_index, mask_1d in enumerate(tile.masks_1d):
        view_shape = [1] * num_dims
        if mask_1d is None:
            factor = torch.ones(1, device=device).view(*view_shape)
        else:
            view_shape[dim_index] = mask_1d.shape[0]
            factor = mask_1d.to(device).view(*view_shape)
        combined = factor if combined is None else combined * factor
    return combined


def _landing(tile: Tile, group: _TemporalGroup, decoded_frames: int, total_frames: int) -> tuple[tuple[slice, ...], int]:
    """Where a tile lands in its group buffer and how many of its frames, clipped like ltx-core clips it."""
    tile_start, tile_stop = _resolved_frame_range(tile.out_coords[2], total_frames)
    offset = tile_start - group.first_frame
    frames = min(tile_stop - tile_start, decoded_frames, group.frames - offset)
    return (slice(None), slice(None), slice(offset, offset + frames), tile.out_coords[3], tile.out_coords[4]), frames


def _blend_region(tile: Tile, group: _TemporalGroup, decoded_frames: int, total_frames: int, device: torch.device):
    """Where a tile lands in its group buffer and its blend mask, clipped like ltx-core clips it."""
    coords, frames = _landing(tile, group, decoded_frames, total_frames)
    mask = _device_blend_mask(tile, device)
    if mask.shape[2] > 1:
        mask = mask[:, :, :frames]
    return coords, mask, frames


class _FrameWindow:
    """Rank 0's blended frames that a later temporal group may still add to (ltx-core's previous
    chunk). Frames before the next group's first frame are final and handed out."""

    def __init__(self, emit: Emit) -> None:
        self.emit = emit
        self.first_frame = 0
        self.values: torch.Tensor | None = None
        self.weights: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.values is None else self.values.nbytes + self.weights.nbytes

    def _emit(self, frames: int) -> int:
        """Hands out the first ``frames`` frames; returns the bytes held for it beside the window
        (the normalised chunk, its clamped weights and what ``emit`` says it allocated)."""
        if frames <= 0:
            return 0
        weights = self.weights[:, :, :frames].clamp(min=_MIN_BLEND_WEIGHT)
        chunk = self.values[:, :, :frames] / weights
        return weights.nbytes + chunk.nbytes + (self.emit(self.first_frame, chunk) or 0)

    def add_group(self, first_frame: int, values: torch.Tensor, weights: torch.Tensor) -> int:
        """Takes the next group in; returns the bytes its hand-out held beside the window and group."""
        emitted = 0
        if self.values is not None:
            final_frames = first_frame - self.first_frame
            assert final_frames >= 0, "temporal groups must start in increasing frame order"
            emitted = self._emit(final_frames)
            overlap = self.values.shape[2] - final_frames
            assert overlap <= values.shape[2], "a temporal group may not end before the previous one"
            if overlap > 0:
                # Float addition is commutative, so current + previous equals ltx-core's previous +
                # current bit for bit.
                values[:, :, :overlap] += self.values[:, :, final_frames:]
                weights[:, :, :overlap] += self.weights[:, :, final_frames:]
        self.first_frame, self.values, self.weights = first_frame, values, weights
        return emitted

    def flush(self) -> int:
        """Hands out the rest; returns the bytes that held beside the window."""
        emitted = 0 if self.values is None else self._emit(self.values.shape[2])
        self.values = self.weights = None
        return emitted


def _schedule(tile_count: int, groups: list[_TemporalGroup], world_size: int, rank: int):
    """The order a rank works in, the same rounds on every rank: ``(rounds_done, tile_index)`` after a
    round's tile is due (``tile_index`` None when the last round has no tile for this rank), and
    ``(None, group)`` when a temporal group is reduced.

    One round ahead: a rank with no tile in a group decodes its next one before waiting in that
    group's reduction, so ranks stay busy whatever the tiles per group. A single rank never waits and
    needs no lookahead."""
    rounds = -(-tile_count // world_size)
    lookahead_tiles = world_size if world_size > 1 else 0
    next_round = 0
    for group in groups:
        while next_round < rounds and next_round * world_size < group.end_tile + lookahead_tiles:
            tile_index = next_round * world_size + rank
            next_round += 1
            yield next_round, (tile_index if tile_index < tile_count else None)
        yield None, group
    assert next_round == rounds, "every round is scheduled"


def decode_tiles(
    decoder: VideoDecoder,
    latent: torch.Tensor,
    tiling_config: TilingConfig | None,
    comm: Comm,
    generator: torch.Generator | None,
    timestep: torch.Tensor | None,
    emit: Emit,
    on_tiles: OnTiles | None = None,
) -> None:
    """The distributed decode itself: ltx-core's tiles of ``latent`` decoded round-robin over ``comm``'s
    ranks, blended as ltx-core's ``tiled_decode`` blends them (``decoder(latent)`` when
    ``tiling_config`` is None), and handed to ``emit(first_frame, chunk)`` on rank 0 in frame order,
    each chunk [B, 3, frames, H, W] in the decoder's range (about -1..1). Every rank must call it."""
    global _last_stats
    _check_latent(decoder, latent)
    started = time.perf_counter()
    on_cuda = latent.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(latent.device)

    with torch.no_grad():
        tiles = decoder._prepare_tiles(latent, tiling_config)  # ltx-core's tiles: the single source of truth
        batch, channels, total_frames, height, width = decoded_video_shape(decoder, latent.shape)
        groups = _temporal_groups(tiles, total_frames)
        assert groups[-1].first_frame + groups[-1].frames == total_frames, "ltx-core's tiles cover every frame"
        group_of_tile = [index for index, group in enumerate(groups) for _ in range(group.first_tile, group.end_tile)]
        tile_decoder = _TileDecoder(decoder, latent, tiles, generator, timestep)
        own_tiles = list(range(comm.rank, len(tiles), comm.world_size))
        held: dict[int, tuple[tuple[slice, ...], torch.Tensor]] = {}
        window = _FrameWindow(emit) if comm.rank == 0 else None
        decode_seconds = reduce_seconds = 0.0
        peak_bytes = 0

        def held_bytes() -> int:
            return sum(piece.nbytes for _, piece in held.values()) + (window.nbytes if window else 0)

        for rounds_done, step in _schedule(len(tiles), groups, comm.world_size, comm.rank):
            if rounds_done is not None:  # this rank's tile of a round (None: the last round has none)
                if step is not None:
                    tile_started = time.perf_counter()
                    decoded = tile_decoder.decode(step)
                    coords, mask, frames = _blend_region(
                        tiles[step], groups[group_of_tile[step]], decoded.shape[2], total_frames, latent.device
                    )
                    held[step] = (coords, decoded[:, :, :frames] * mask.to(device=latent.device, dtype=latent.dtype))
                    del decoded
                    if on_cuda:
                        torch.cuda.synchronize(latent.device)
                    decode_seconds += time.perf_counter() - tile_started
                    peak_bytes = max(peak_bytes, held_bytes())
                _report_round(on_tiles, rounds_done, comm.world_size, len(tiles))
                continue

            group = step
            group_values = torch.zeros(
                (batch, channels, group.frames, height, width), device=latent.device, dtype=latent.dtype
            )
            for tile_index in range(group.first_tile, group.end_tile):
                if tile_index in held:
                    coords, piece = held.pop(tile_index)
                    group_values[coords] += piece
            peak_bytes = max(peak_bytes, held_bytes() + group_values.nbytes)
            reduce_started = time.perf_counter()
            comm.all_reduce_sum(group_values)
            reduce_seconds += time.perf_counter() - reduce_started

            if window is not None:
                # Weights are the same for every batch element and channel: one plane, summed in
                # ltx-core's tile order, so they are exact.
                group_weights = torch.zeros(
                    (1, 1, group.frames, height, width), device=latent.device, dtype=latent.dtype
                )
                for tile_index in range(group.first_tile, group.end_tile):
                    coords, mask, _ = _blend_region(
                        tiles[tile_index], group, tile_decoder.decoded_frames(tile_index), total_frames, latent.device
                    )
                    group_weights[coords] += mask.to(device=latent.device, dtype=latent.dtype)
                beside = held_bytes() + group_values.nbytes + group_weights.nbytes  # the old window included
                peak_bytes = max(peak_bytes, beside + window.add_group(group.first_frame, group_values, group_weights))
                peak_bytes = max(peak_bytes, held_bytes())
            del group_values

        assert not held, "every own tile is decoded and reduced"
        if window is not None:
            window_bytes = window.nbytes
            peak_bytes = max(peak_bytes, window_bytes + window.flush())
        # Leave the generator where the single-GPU loop leaves it, on every rank alike.
        tile_decoder.skip_to(len(tiles))

    _last_stats = DecodeStats(
        rank=comm.rank,
        world_size=comm.world_size,
        tiles_total=len(tiles),
        tiles_decoded=len(own_tiles),
        tile_indices=tuple(own_tiles),
        temporal_groups=len(groups),
        decode_seconds=decode_seconds,
        reduce_seconds=reduce_seconds,
        total_seconds=time.perf_counter() - started,
        assembly_peak_bytes=peak_bytes,
        device_peak_bytes=torch.cuda.max_memory_allocated(latent.device) if on_cuda else None,
    )
    logger.info(
        "distributed decode: rank %d/%d decoded %d of %d tiles (%d temporal groups) in %.2fs",
        comm.rank,
        comm.world_size,
        len(own_tiles),
        len(tiles),
        len(groups),
        _last_stats.total_seconds,
    )


# ltx-core's video decoder maps one latent cell to 8 frames and 32 x 32 pixels whatever its config
# (VideoDecoder.__init__ sets it); its tiling reads nothing else of the decoder.
_LTX_VIDEO_SCALE = SpatioTemporalScaleFactors(time=8, width=32, height=32)


def assembly_peak_estimate(
    latent_shape: tuple[int, ...],
    tiling_config: TilingConfig | None,
    world_size: int,
    rank: int,
    element_size: int,
    *,
    image_layout: bool = True,
    tile_activation_bytes: int = 0,
) -> int:
    """What ``decode_tiles`` holds at its peak on ``rank`` for a latent of ``latent_shape``, from the
    shapes alone (no decoder, nothing decoded): ltx-core's tiles for ``tiling_config``, the same
    schedule, weighted tiles, group buffers and frame window in the decode's dtype (``element_size``
    bytes), and rank 0's hand-outs of finished frames, converted to images as
    ``distributed_decode_images`` does when ``image_layout``. With ``tile_activation_bytes=0`` it is the
    ``assembly_peak_bytes`` a real decode reports; the memory planner adds the decoder's activations
    for one tile (and its output), held while a tile decodes beside what the rank holds then."""
    stand_in = SimpleNamespace(video_downscale_factors=_LTX_VIDEO_SCALE)  # all that ltx-core's tiling reads of a decoder
    latent = torch.empty(latent_shape, device="meta")
    tiles = VideoDecoder._prepare_tiles(stand_in, latent, tiling_config)
    batch, _, total_frames, height, width = decoded_video_shape(stand_in, latent_shape)
    groups = _temporal_groups(tiles, total_frames)
    group_of_tile = [index for index, group in enumerate(groups) for _ in range(group.first_tile, group.end_tile)]
    plane = height * width * element_size  # one frame of one channel

    def handout(frames: int) -> int:  # the normalised chunk and its clamped weights, then the images' copies
        images = _IMAGE_LAYOUT_COPIES * batch * 3 * frames * height * width * 4 if image_layout else 0
        return (batch * 3 + 1) * frames * plane + images

    held: dict[int, int] = {}
    window, peak, in_window = 0, 0, None
    for rounds_done, step in _schedule(len(tiles), groups, world_size, rank):
        if rounds_done is not None:
            if step is not None:
                peak = max(peak, sum(held.values()) + window + tile_activation_bytes)
                decoded_frames = decoded_video_shape(stand_in, latent[tiles[step].in_coords].shape)[2]
                coords, frames = _landing(tiles[step], groups[group_of_tile[step]], decoded_frames, total_frames)
                tile_pixels = len(range(height)[coords[3]]) * len(range(width)[coords[4]])
                held[step] = batch * 3 * frames * tile_pixels * element_size
                peak = max(peak, sum(held.values()) + window)
            continue
        group = step
        group_bytes = batch * 3 * group.frames * plane
        for tile_index in range(group.first_tile, group.end_tile):
            held.pop(tile_index, None)
        peak = max(peak, sum(held.values()) + window + group_bytes)
        if rank == 0:
            weights = group.frames * plane
            emitted = handout(group.first_frame - in_window.first_frame) if in_window is not None else 0
            peak = max(peak, sum(held.values()) + window + group_bytes + weights + emitted)
            window, in_window = group_bytes + weights, group
            peak = max(peak, sum(held.values()) + window)
    if in_window is not None:
        peak = max(peak, window + handout(in_window.frames))
    return peak


def _report_round(on_tiles: OnTiles | None, rounds_done: int, world_size: int, tiles: int) -> None:
    if on_tiles is not None:
        on_tiles(min(rounds_done * world_size, tiles), tiles)


# float32 copies of a chunk alive at once in _to_image_layout: each step's input and its result.
_IMAGE_LAYOUT_COPIES = 2


def _to_image_layout(video: torch.Tensor) -> torch.Tensor:
    """[B, 3, F, H, W] in about -1..1 -> [B, F, H, W, 3] float32 in 0..1 (ComfyUI's convention)."""
    return ((video.float() + 1.0) / 2.0).clamp(0.0, 1.0).permute(0, 2, 3, 4, 1)


def _check_latent(decoder: VideoDecoder, latent: torch.Tensor) -> None:
    latent_channels = decoder.per_channel_statistics.get_buffer("std-of-means").numel()
    if latent.ndim != 5 or latent.shape[1] != latent_channels:
        raise ValueError(
            f"the video latent must be [batch, {latent_channels}, frames, height, width] (the LTX-2 video "
            f"latent); got shape {tuple(latent.shape)}. Separate the video part of an audio+video latent first."
        )
