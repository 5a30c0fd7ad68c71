"""Sequence parallelism on a tiny random LTX-2 transformer: SP degrees 2 and 4 (real gloo ranks)
against the unparallelised model, with every perturbation type, a video token count that no degree
divides, and image conditioning (zero-timestep first frame, appended keyframe tokens, attention mask).

The model and input builders here are also used by ``test_guidance_parallel``.
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.conditioning import (
    ConditioningItemAttentionStrengthWrapper,
    VideoConditionByKeyframeIndex,
    VideoConditionByLatentIndex,
)
from ltx_core.guidance.perturbations import (
    BatchedPerturbationConfig,
    Perturbation,
    PerturbationConfig,
    PerturbationType,
)
from ltx_core.model.transformer.modality import Modality
from ltx_core.model.transformer.model import X0Model
from ltx_core.model.transformer.model_configurator import LTXModelConfigurator
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, LatentState, VideoLatentShape

from mgpu_backend.bundles.tiny import LTX2_TRANSFORMER_ARCHITECTURE
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.sequence_parallel import (
    VideoTokenShards,
    apply_sequence_parallel,
    check_sp_degree,
    remove_sequence_parallel,
    sequence_parallel_degree,
)
from tests.dist_harness import run_ranks

VIDEO_CHANNELS = 16
AUDIO_CHANNELS, AUDIO_MEL_BINS = 2, 8  # 16 features per audio token
VIDEO_CONTEXT_DIM, AUDIO_CONTEXT_DIM = 64, 32  # = video / audio inner dims (no caption projection)
TEXT_TOKENS = 7
AUDIO_TOKENS = 9
TOLERANCE = 1e-5




def tiny_transformer_config(variant: str = "19b") -> dict:
    """An LTX-2 AV transformer config with tiny dimensions: 2 layers, 8 video heads of 8, 8 audio
    heads of 4, interleaved RoPE like the 19B model. ``variant="22b"`` switches on the newer options
    (split RoPE, gated attention, cross-attention AdaLN) so SP is checked against them too."""
    transformer = {
        **LTX2_TRANSFORMER_ARCHITECTURE,
        "num_layers": 2,
        "num_attention_heads": 8,
        "attention_head_dim": 8,
        "audio_num_attention_heads": 8,
        "audio_attention_head_dim": 4,
        "in_channels": VIDEO_CHANNELS,
        "out_channels": VIDEO_CHANNELS,
        "audio_in_channels": AUDIO_CHANNELS * AUDIO_MEL_BINS,
        "audio_out_channels": AUDIO_CHANNELS * AUDIO_MEL_BINS,
        "cross_attention_dim": VIDEO_CONTEXT_DIM,
        "audio_cross_attention_dim": AUDIO_CONTEXT_DIM,
        "caption_proj_before_connector": True,  # text arrives already projected: no caption projection
        "rope_type": "interleaved",
        "attention_type": "pytorch",
    }
    if variant == "22b":
        transformer.update(rope_type="split", apply_gated_attention=True, cross_attention_adaln=True)
    return {"transformer": transformer}


def build_tiny_model(variant: str = "19b", seed: int = 0) -> X0Model:
    """A tiny random LTX-2 AV transformer in ltx-core's X0 wrapper, identical for the same seed."""
    model = LTXModelConfigurator.from_config(tiny_transformer_config(variant))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.15)
    return X0Model(model).eval()


def _video_tools(frames: int, height: int = 3, width: int = 5) -> VideoLatentTools:
    return VideoLatentTools(VideoLatentPatchifier(1), VideoLatentShape(1, VIDEO_CHANNELS, frames, height, width), 25.0)


def _audio_tools() -> AudioLatentTools:
    shape = AudioLatentShape(1, AUDIO_CHANNELS, AUDIO_TOKENS, AUDIO_MEL_BINS)
    return AudioLatentTools(AudioPatchifier(AUDIO_MEL_BINS), shape)


def tiny_latent_states(
    seed: int, frames: int = 3, image_conditioning: bool = False
) -> tuple[LatentState, LatentState]:
    """Noisy video (``frames`` x 3 x 5 latent = 15 tokens per frame) and audio (9 tokens) states.

    With ``image_conditioning``, the first latent frame is replaced by a clean image latent (its
    denoise mask, hence its timesteps, become zero) and one keyframe latent frame is appended as
    extra tokens with an attention-strength mask, the way ltx-core's conditioning items do it.
    """
    generator = torch.Generator().manual_seed(seed)
    video_tools, audio_tools = _video_tools(frames), _audio_tools()
    video_shape = video_tools.target_shape.to_torch_shape()
    video = video_tools.create_initial_state("cpu", torch.float32, torch.randn(video_shape, generator=generator))
    audio_shape = audio_tools.target_shape.to_torch_shape()
    audio = audio_tools.create_initial_state("cpu", torch.float32, torch.randn(audio_shape, generator=generator))
    if image_conditioning:
        image = torch.randn(1, VIDEO_CHANNELS, 1, 3, 5, generator=generator)
        keyframe = torch.randn(1, VIDEO_CHANNELS, 1, 3, 5, generator=generator)
        video = VideoConditionByLatentIndex(latent=image, strength=1.0, latent_idx=0).apply_to(video, video_tools)
        keyframe_item = VideoConditionByKeyframeIndex(keyframes=keyframe, frame_idx=8, strength=0.9)
        video = ConditioningItemAttentionStrengthWrapper(keyframe_item, attention_mask=0.5).apply_to(
            video, video_tools
        )
    return video, audio


def tiny_contexts(seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    video_context = torch.randn(batch, TEXT_TOKENS, VIDEO_CONTEXT_DIM, generator=generator)
    audio_context = torch.randn(batch, TEXT_TOKENS, AUDIO_CONTEXT_DIM, generator=generator)
    return video_context, audio_context


def modality(state: LatentState, context: torch.Tensor, sigma: float, enabled: bool = True, **extra) -> Modality:
    sigma_tensor = torch.full((state.latent.shape[0],), sigma)
    return Modality(
        latent=state.latent,
        sigma=sigma_tensor,
        timesteps=state.denoise_mask * sigma,
        positions=state.positions,
        context=context,
        enabled=enabled,
        attention_mask=state.attention_mask,
        **extra,
    )


def _batched(config: PerturbationConfig, batch: int = 1) -> BatchedPerturbationConfig:
    return BatchedPerturbationConfig([config] * batch)


STG = PerturbationConfig(
    [
        Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [1]),
        Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, [1]),
    ]
)
ISOLATED = PerturbationConfig(
    [Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, None), Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, None)]
)


def sp_forward_cases() -> dict[str, tuple[str, Modality, Modality, BatchedPerturbationConfig | None]]:
    """name -> (model variant, video, audio, perturbations). 45 video tokens in every case."""
    video, audio = tiny_latent_states(seed=1)
    video_context, audio_context = tiny_contexts(seed=2)
    plain = (modality(video, video_context, 0.8), modality(audio, audio_context, 0.8))

    conditioned_video, conditioned_audio = tiny_latent_states(seed=3, frames=2, image_conditioning=True)
    text_mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    text_mask[:, -2:] = 0  # padded prompt tokens
    conditioned = (
        modality(conditioned_video, video_context, 0.6, context_mask=text_mask),
        modality(conditioned_audio, audio_context, 0.6, context_mask=text_mask),
    )

    # A batch of two whose samples are perturbed differently: the per-sample mask paths.
    video_pair, audio_pair = (
        Modality(
            latent=torch.cat([m.latent, m.latent.flip(1)]),
            sigma=torch.tensor([0.8, 0.5]),
            timesteps=torch.cat([m.timesteps, m.timesteps * 0.625]),
            positions=torch.cat([m.positions, m.positions]),
            context=torch.cat([m.context, -m.context]),
        )
        for m in plain
    )
    stg_and_isolation_in_block_0 = PerturbationConfig(
        [
            Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [0]),
            Perturbation(PerturbationType.SKIP_AUDIO_SELF_ATTN, [0]),
            Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, [0]),
            Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, [0]),
        ]
    )
    mixed = BatchedPerturbationConfig([stg_and_isolation_in_block_0, PerturbationConfig.empty()])

    return {
        "unperturbed": ("19b", *plain, None),
        "stg_perturbed": ("19b", *plain, _batched(STG)),
        "modality_isolated": ("19b", *plain, _batched(ISOLATED)),
        "mixed_batch_perturbations": ("19b", video_pair, audio_pair, mixed),
        "image_conditioned": ("19b", *conditioned, None),
        "22b_options_stg_perturbed": ("22b", *plain, _batched(STG)),
    }


def _run_cases(models: dict[str, X0Model]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    outputs = {}
    with torch.no_grad():
        for name, (variant, video, audio, perturbations) in sp_forward_cases().items():
            outputs[name] = models[variant](video=video, audio=audio, perturbations=perturbations)
    return outputs


def portable(value) -> bytes:
    """``value`` (tensors inside) serialised for the harness's result queue; ``from_portable`` undoes it.

    Tensors put on that queue travel as shared-memory file descriptors that the rank process may
    close by exiting before the test process has read them (ConnectionResetError); bytes do not.
    """
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_portable(per_rank: list[bytes]) -> list:
    return [torch.load(io.BytesIO(blob), weights_only=False) for blob in per_rank]


LOCAL_QUERIES = "4, local video queries"  # SP degree 4 as on GPUs: video-query cross-attention on the local shards


def sp_forward_on_ranks() -> dict:
    """On 4 ranks: every case at SP degree 4 (one group), at SP degree 4 with the video-query
    cross-attentions on the local shards (the GPU layout), then at SP degree 2 (two groups of two),
    re-applying SP to the same model instances."""
    torch.set_num_threads(1)
    world = Comm.world()
    models = {variant: build_tiny_model(variant) for variant in ("19b", "22b")}
    results = {}
    for key, degree, groups, video_query_exchange in ((4, 4, [[0, 1, 2, 3]], None), (LOCAL_QUERIES, 4, [[0, 1, 2, 3]], False), (2, 2, [[0, 1], [2, 3]], None)):
        comm = world if degree == world.world_size else world.split(groups)
        for model in models.values():
            apply_sequence_parallel(model, comm, video_query_exchange=video_query_exchange)
            assert sequence_parallel_degree(model) == degree
        results[key] = _run_cases(models)
    for model in models.values():
        remove_sequence_parallel(model)
    results["after_removal"] = _run_cases(models)
    return portable(results)


def single_threaded(fn, *args):
    """``fn(*args)`` with one intra-op thread, like the rank processes: CPU kernels split their
    reductions by thread count, and that alone moves fp32 results by ~1e-6."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single_rank_outputs():
    return single_threaded(_run_cases, {variant: build_tiny_model(variant) for variant in ("19b", "22b")})


@pytest.fixture(scope="module")
def four_rank_outputs():
    return from_portable(run_ranks(4, sp_forward_on_ranks))


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", list(sp_forward_cases()))
@pytest.mark.parametrize("sp_degree", [2, 4, LOCAL_QUERIES])
def test_sp_degree_matches_single_rank_fp32(sp_degree, case, single_rank_outputs, four_rank_outputs):
    video_tokens = sp_forward_cases()[case][1].latent.shape[1]
    assert video_tokens % (4 if sp_degree == LOCAL_QUERIES else sp_degree) != 0, "the case must exercise padding"
    reference_video, reference_audio = single_rank_outputs[case]
    assert reference_video.abs().mean() > 0.1 and reference_audio.abs().mean() > 0.1
    for rank, per_rank in enumerate(four_rank_outputs):
        video, audio = per_rank[sp_degree][case]
        video_diff = _max_abs_diff(video, reference_video)
        audio_diff = _max_abs_diff(audio, reference_audio)
        assert video_diff <= TOLERANCE and audio_diff <= TOLERANCE, (
            f"SP degree {sp_degree}, {case}, rank {rank}: max abs diff video {video_diff:.3g}, "
            f"audio {audio_diff:.3g} (tolerance {TOLERANCE})"
        )


def test_sp_ranks_of_a_group_return_identical_outputs(four_rank_outputs):
    for sp_degree in (2, 4, LOCAL_QUERIES):
        for case in sp_forward_cases():
            first_video, first_audio = four_rank_outputs[0][sp_degree][case]
            for rank, per_rank in enumerate(four_rank_outputs[1:], start=1):
                video, audio = per_rank[sp_degree][case]
                diff = max(_max_abs_diff(video, first_video), _max_abs_diff(audio, first_audio))
                assert diff == 0.0, f"SP degree {sp_degree}, {case}: rank {rank} differs from rank 0 by {diff:.3g}"


def test_removed_sp_restores_single_rank_forward(single_rank_outputs, four_rank_outputs):
    for case, (reference_video, reference_audio) in single_rank_outputs.items():
        video, audio = four_rank_outputs[0]["after_removal"][case]
        diff = max(_max_abs_diff(video, reference_video), _max_abs_diff(audio, reference_audio))
        assert diff <= TOLERANCE, f"{case} after remove_sequence_parallel: max abs diff {diff:.3g}"


def test_image_conditioning_case_has_clean_tokens_appended_tokens_and_mask():
    _, video, _, _ = sp_forward_cases()["image_conditioned"]
    assert video.latent.shape[1] == 45, video.latent.shape
    assert video.attention_mask is not None and video.attention_mask.shape == (1, 45, 45)
    zero_timestep_tokens = int((video.timesteps.flatten() == 0).sum())
    assert zero_timestep_tokens == 15, f"first latent frame should have zero timesteps, got {zero_timestep_tokens}"


class _CommOfSize:
    """Stands in for a group of ``world_size`` ranks; validation must refuse before any collective."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.rank, self.global_ranks = world_size, 0, list(range(world_size))


def test_sp_degree_3_refused_with_the_valid_degrees():
    with pytest.raises(ValueError) as refused:
        check_sp_degree(3, 32, 32)
    assert str(refused.value) == "SP degree 3 does not divide the 32 attention heads; use 1, 2, 4, 8, 16 or 32"

    model = build_tiny_model()
    with pytest.raises(ValueError) as refused:
        apply_sequence_parallel(model, _CommOfSize(3))
    assert str(refused.value) == "SP degree 3 does not divide the 8 attention heads; use 1, 2, 4 or 8"
    assert sequence_parallel_degree(model) == 1


def test_sp_degree_refused_when_it_does_not_divide_the_audio_heads():
    with pytest.raises(ValueError) as refused:
        check_sp_degree(4, 32, 2)
    assert str(refused.value) == "SP degree 4 does not divide the 2 audio attention heads; use 1 or 2"


def test_sp_on_cpu_weights_runs_the_video_query_cross_attentions_head_parallel_and_says_why(caplog):
    model = build_tiny_model()
    with caplog.at_level(logging.INFO, logger="mgpu_backend.parallel.sequence_parallel"):
        apply_sequence_parallel(model, _CommOfSize(4))
    blocks = model.velocity_model.transformer_blocks
    exchanged = {name for name in ("attn1", "attn2", "audio_to_video_attn", "video_to_audio_attn", "audio_attn1", "audio_attn2")
                 if getattr(blocks[0], name).attention_function.__class__.__module__ == "mgpu_backend.parallel.sequence_parallel"}  # fmt: skip
    assert exchanged == {"attn1", "attn2", "audio_to_video_attn", "video_to_audio_attn"}
    (line,) = [record.getMessage() for record in caplog.records]
    assert "text and video-from-audio cross-attention head-parallel over all video queries too (CPU attention rounds" in line
    with caplog.at_level(logging.INFO, logger="mgpu_backend.parallel.sequence_parallel"):
        apply_sequence_parallel(model, _CommOfSize(4), video_query_exchange=False)
    local = {name for name in ("attn2", "audio_to_video_attn") if getattr(blocks[0], name).attention_function.__class__.__module__ == "mgpu_backend.parallel.sequence_parallel"}
    assert local == set() and "on the local shards" in caplog.records[-1].getMessage()
    remove_sequence_parallel(model)
    assert sequence_parallel_degree(model) == 1


def test_sp_degree_1_leaves_model_unchanged_and_logs_one_line(caplog, single_rank_outputs):
    model = build_tiny_model()
    with caplog.at_level(logging.INFO, logger="mgpu_backend.parallel.sequence_parallel"):
        apply_sequence_parallel(model, Comm.world())
    assert len(caplog.records) == 1 and "SP degree 1" in caplog.records[0].getMessage()
    _, video, audio, _ = sp_forward_cases()["unperturbed"]
    with torch.no_grad():
        out_video, out_audio = single_threaded(model, video, audio, None)
    reference_video, reference_audio = single_rank_outputs["unperturbed"]
    diff = max(_max_abs_diff(out_video, reference_video), _max_abs_diff(out_audio, reference_audio))
    assert diff == 0.0, f"degree 1 changed the output by {diff:.3g}"


@pytest.mark.parametrize("video_tokens, sp_degree, padding", [(45, 4, 3), (45, 2, 1), (48, 8, 0), (1, 4, 3)])
def test_video_token_shards_cover_the_sequence_in_order(video_tokens, sp_degree, padding):
    shards = VideoTokenShards(video_tokens, sp_degree)
    assert shards.padding == padding and shards.padded_tokens % sp_degree == 0
    tokens = torch.arange(float(video_tokens)).view(1, video_tokens, 1)
    pieces = [shards.shard(tokens, 1, rank) for rank in range(sp_degree)]
    assert all(piece.shape[1] == shards.shard_tokens for piece in pieces)
    joined = torch.cat(pieces, dim=1)
    assert torch.equal(joined[:, :video_tokens], tokens), joined.flatten().tolist()
    assert torch.equal(joined[:, video_tokens:], tokens[:, -1:].expand(1, padding, 1))
