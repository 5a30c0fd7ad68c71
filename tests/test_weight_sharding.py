"""Weight sharding (residency "sharded"): the transformer's weights spread over the ranks with FSDP2,
gathered block by block, bitwise to the unsharded fleet at the same plan.

On real gloo CPU ranks: the technique on the tiny transformer (alone, under SP, with a rank that has
no work joining the gathers idle), then whole jobs through a real fleet on the tiny bundles — the
two-stage job (guided stage 1 under guidance groups that the passes do not divide, LoRA hot-swap to
the distilled LoRA and back, TDP with more tiles than ranks, decode) and the distilled job (SP in
both stages, bf16 and fp8-cast) — against the same jobs with residency "all". Then the planner's
sharded decisions for the full-size 22B layout on 24 and 32 GiB GPUs.
"""

from __future__ import annotations

import pytest
import torch

from mgpu_backend.bundles import tiny
from mgpu_backend.ltx.residency import GIB, ResidencyError, plan_residency
from mgpu_backend.ltx.schema import ModelSpec
from mgpu_backend.parallel import weight_tracker
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel, remove_sequence_parallel
from mgpu_backend.parallel.weight_sharding import (
    apply_weight_sharding,
    full_tensor,
    gather_rows,
    idle_forward,
    local_state_dict,
    weight_sharding_comm,
)

from .dist_harness import run_ranks
from .fleet_harness import run_job
from .helpers import build_tiny_model, from_portable, full_size_sizes, portable, run_sp_forward_cases, single_threaded, sp_forward_cases

PROMPT = "a red fox in the snow"
NEGATIVE = "blurry"


# --- The technique on the tiny transformer ---------------------------------------------------------


def sharded_forwards_on_ranks() -> bytes:
    """Every SP test case with the weights sharded over the ranks, then with SP on top, then a round in
    which only rank 0 computes while the others join its gathers idle; and each rank's weight bytes."""
    torch.set_num_threads(1)
    world = Comm.world()
    models = {variant: build_tiny_model(variant) for variant in ("19b", "22b")}
    full_bytes = sum(p.nbytes for p in models["19b"].parameters())
    for model in models.values():
        apply_weight_sharding(model, world, "cpu")
    results = {"sharded": run_sp_forward_cases(models), "full_bytes": full_bytes, "sharded_flag": weight_sharding_comm(models["19b"]) is world}
    results["local_bytes"] = sum(t.nbytes for key, t in local_state_dict(models["19b"]).items() if "rope" not in key)
    for model in models.values():
        apply_sequence_parallel(model, world)
    results["sharded_sp"] = run_sp_forward_cases(models)
    for model in models.values():
        remove_sequence_parallel(model)
    whole = {variant: apply_sequence_parallel(build_tiny_model(variant), world) for variant in ("19b", "22b")}
    results["sp_whole_weights"] = run_sp_forward_cases(whole)
    _, (variant, video, audio, perturbations) = next(iter(sp_forward_cases().items()))
    with torch.no_grad():
        if world.rank == 0:
            results["rank_0_alone"] = models[variant](video=video, audio=audio, perturbations=perturbations)[0]
        else:
            idle_forward(models[variant])
    results["after_idle_round"] = run_sp_forward_cases(models)
    # Between forwards every unit is sharded again, the root (the weights outside the blocks) too.
    results["resharded_between_forwards"] = {type(p).__name__ for model in models.values() for p in model.parameters()}
    from mgpu_backend.ltx.parallelize import Stage1Cache, Stage1Options, parallelize_stage1
    from mgpu_backend.parallel.guidance_parallel import plan_stage1

    lines = []
    options = Stage1Options(compile_blocks=True, compile_backend="aot_eager")
    with parallelize_stage1(models["19b"], plan_stage1(2, 45, 1, "sp"), world, torch.device("cpu"), options, Stage1Cache(), lines.append) as stage:
        results["stage1"] = (stage.applied, lines, stage.fields()["compile_blocks"])
    return portable(results)


@pytest.fixture(scope="module")
def unsharded():
    return single_threaded(run_sp_forward_cases, {variant: build_tiny_model(variant) for variant in ("19b", "22b")})


def _assert_same_outputs(ours: dict, theirs: dict, what: str) -> None:
    for case, (video, audio) in theirs.items():
        assert torch.equal(ours[case][0], video), f"{what}, {case}: video differs by {(ours[case][0] - video).abs().max().item()}"
        assert torch.equal(ours[case][1], audio), f"{what}, {case}: audio differs"


def test_weights_sharded_over_2_ranks_give_the_unsharded_forward_bitwise_with_half_the_bytes_each(unsharded):
    ranks = from_portable(run_ranks(2, sharded_forwards_on_ranks))
    for rank, out in enumerate(ranks):
        assert out["sharded_flag"]
        _assert_same_outputs(out["sharded"], unsharded, f"rank {rank} sharded")
        _assert_same_outputs(out["after_idle_round"], unsharded, f"rank {rank} after a round with an idle rank")
        # Under SP too the gathered weights are the exact ones: equal to SP on whole weights.
        _assert_same_outputs(out["sharded_sp"], out["sp_whole_weights"], f"rank {rank} sharded under SP 2")
        # torch.chunk over dim 0: each rank holds half of every even-sized parameter (the tiny model's are).
        assert out["local_bytes"] * 2 == pytest.approx(out["full_bytes"], rel=0.01), (out["local_bytes"], out["full_bytes"])
        assert out["resharded_between_forwards"] == {"DTensor"}, out["resharded_between_forwards"]
    assert torch.equal(ranks[0]["rank_0_alone"], unsharded["unperturbed"][0])
    applied, lines, compiled = ranks[0]["stage1"]
    assert applied == ["weight sharding", "process groups", "sequence parallel"] and compiled is False, (applied, lines)
    assert any(line.startswith("stage 1: weight sharding: weights sharded over all 2 ranks [0, 1]") for line in lines), lines
    assert "stage 1: compiled blocks not applied: the transformer's weights are sharded; compiled blocks are not run sharded" in lines, lines


def gathers_on_ranks() -> dict:
    """Every key of the sharded tiny transformer gathered whole by ``full_tensor`` (the LoRA swap's
    gather), against the unsharded weights and DTensor's own gather; and float8 rows gathered."""
    torch.set_num_threads(1)
    world = Comm.world()
    whole = build_tiny_model("22b").velocity_model.state_dict()
    model = apply_weight_sharding(build_tiny_model("22b"), world, "cpu")
    sharded = model.velocity_model.state_dict(keep_vars=True)
    out = {"keys": 0, "unequal": [], "unlike_dtensor": [], "padded_keys": 0}
    for key, tensor in sharded.items():
        if not hasattr(tensor, "to_local"):
            continue
        out["keys"] += 1
        out["padded_keys"] += tensor.shape[0] % world.world_size != 0
        gathered = full_tensor(model, key)
        if not torch.equal(gathered, whole[key]):
            out["unequal"].append(key)
        if not torch.equal(gathered, tensor.detach().full_tensor()):
            out["unlike_dtensor"].append(key)
    out["float8"] = []
    for count in (7, 2):  # 3 + 3 + 1 rows, and 1 + 1 + none: a rank past the last chunk
        values = (torch.arange(count * 3, dtype=torch.float32).reshape(count, 3) / 4).to(torch.float8_e4m3fn)
        rows = torch.chunk(values, world.world_size)
        mine = rows[world.rank] if world.rank < len(rows) else values[:0]
        out["float8"].append(torch.equal(gather_rows(mine, tuple(values.shape), world).view(torch.uint8), values.view(torch.uint8)))
    return out


def test_the_lora_swaps_gather_gives_every_sharded_weight_whole_on_3_ranks_float8_too():
    for rank, out in enumerate(run_ranks(3, gathers_on_ranks)):
        assert out["keys"] > 50 and out["padded_keys"] > 0, (rank, out["keys"], out["padded_keys"])  # some keys' rows differ in count
        assert out["unequal"] == [] and out["unlike_dtensor"] == [], (rank, out["unequal"][:5], out["unlike_dtensor"][:5])
        assert out["float8"] == [True, True], rank


# --- Whole jobs through a fleet --------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundles(tiny_bundle_of):
    return {version: tiny_bundle_of(version) for version in tiny.VERSIONS}


GUIDANCE = {"cfg_scale": 3.0, "stg_scale": 1.0, "rescale_scale": 0.7, "modality_scale": 3.0, "stg_blocks": [1]}


def two_stage_job(socket_path, spec: dict, residency: str, parallel: str, tiles: list[int], logs: list) -> dict:
    """Encode, guided stage 1 under ``parallel``, TDP stage 2 with the distilled LoRA over ``tiles``,
    then stage 1 again (back to no LoRA), and decode: every tensor that came back."""
    common = {"spec": {**spec, "residency": residency}}
    loaded = run_job(socket_path, "load", common, on_log=logs.append)
    encoded = run_job(socket_path, "encode", {**common, "prompts": [PROMPT, NEGATIVE]}, on_log=logs.append)
    contexts = {
        "positive_video_context": encoded.tensors["video_context_0"], "positive_audio_context": encoded.tensors["audio_context_0"],
        "negative_video_context": encoded.tensors["video_context_1"], "negative_audio_context": encoded.tensors["audio_context_1"],
    }  # fmt: skip
    sample_args = {**common, "width": 96, "height": 64, "num_frames": 9, "seed": 7, "steps": 2, "parallel": parallel,
                   "video_guidance": GUIDANCE, "audio_guidance": GUIDANCE}  # fmt: skip
    stage1 = run_job(socket_path, "sample", sample_args, contexts, on_log=logs.append)
    stage2 = run_job(socket_path, "upscale", {**common, "seed": 7, "tiles": tiles, "overlap": 1}, {**stage1.tensors, **contexts}, on_log=logs.append)
    again = run_job(socket_path, "sample", sample_args, contexts, on_log=logs.append)
    decoded = run_job(socket_path, "decode", {**common, "seed": 7, "after_stages": 2}, stage2.tensors)
    return {
        "stage-1 video": stage1.tensors["video_latent"], "stage-1 audio": stage1.tensors["audio_latent"],
        "stage-2 video": stage2.tensors["video_latent"], "stage-1 video after the swap back": again.tensors["video_latent"],
        "frames": decoded.tensors["frames"], "waveform": decoded.tensors["waveform"],
        "plan": stage1.fields["plan"], "weights": loaded.fields["weights"],
    }  # fmt: skip


def distilled_job(socket_path, spec: dict, residency: str, quantization: str | None, logs: list) -> dict:
    common = {"spec": {**spec, "residency": residency, "quantization": quantization}}
    encoded = run_job(socket_path, "encode", {**common, "prompts": [PROMPT]}, on_log=logs.append)
    positive = {"positive_video_context": encoded.tensors["video_context_0"], "positive_audio_context": encoded.tensors["audio_context_0"]}
    args = {**common, "pipeline": "distilled", "width": 96, "height": 64, "num_frames": 9, "seed": 7}
    stage1 = run_job(socket_path, "sample", args, positive, on_log=logs.append)
    stage2 = run_job(socket_path, "upscale", {**common, "pipeline": "distilled", "seed": 7, "parallel": "sp"}, {**stage1.tensors, **positive}, on_log=logs.append)
    decoded = run_job(socket_path, "decode", {**common, "seed": 7}, stage2.tensors)
    return {
        "stage-1 video": stage1.tensors["video_latent"], "stage-1 audio": stage1.tensors["audio_latent"],
        "stage-2 video": stage2.tensors["video_latent"], "stage-2 audio": stage2.tensors["audio_latent"], "frames": decoded.tensors["frames"],
    }  # fmt: skip


def _assert_bitwise(sharded: dict, whole: dict, what: str) -> None:
    for name, value in whole.items():
        if isinstance(value, torch.Tensor):
            diff = (sharded[name].float() - value.float()).abs().max().item()
            assert torch.equal(sharded[name], value), f"{what}: {name} differs from the unsharded fleet by {diff}"


@pytest.mark.parametrize("version", [pytest.param("2.0", marks=pytest.mark.slow), "2.3"])
def test_two_stage_job_sharded_over_2_ranks_equals_the_unsharded_fleet_bitwise(fleet, bundles, version):
    spec = bundles[version].spec().to_json()
    whole_logs, sharded_logs = [], []
    whole = two_stage_job(fleet, spec, "all", "guidance", [1, 3], whole_logs)
    sharded = two_stage_job(fleet, spec, "sharded", "guidance", [1, 3], sharded_logs)
    _assert_bitwise(sharded, whole, f"LTX-{version} two-stage")
    # 3 guided passes on 2 groups and 3 tiles on 2 ranks: one rank idles a forward each time.
    assert "2 guidance groups x SP degree 1" in sharded["plan"], sharded["plan"]
    assert any("residency sharded:" in line and "transformer weights sharded over 2 ranks" in line for line in sharded_logs), sharded_logs
    assert any("stage 1: weight sharding: weights sharded over all 2 ranks" in line for line in sharded_logs), sharded_logs
    assert any("stage 2: weight sharding: weights sharded over all 2 ranks" in line for line in sharded_logs), sharded_logs
    assert not any("weight sharding" in line for line in whole_logs), whole_logs
    assert sharded["weights"]["working_bytes"] < 0.6 * whole["weights"]["working_bytes"], (sharded["weights"], whole["weights"])
    # Sharded, each rank's clean rows are views of the checkpoint file (the OS's cached pages, no copy), and the
    # swaps to the LoRA and back above stay bitwise; unsharded on a CPU rank the working copy is that mapping
    # itself (LoRAs fuse into it in place), so its clean shard is a copy.
    assert sharded["weights"]["clean_shard_file_bytes"] == sharded["weights"]["clean_shard_bytes"] > 0, sharded["weights"]
    assert whole["weights"]["clean_shard_file_bytes"] == 0 < whole["weights"]["clean_shard_bytes"], whole["weights"]


@pytest.mark.parametrize("quantization", [pytest.param(None, marks=pytest.mark.slow, id="bf16"), "fp8-cast"])
def test_distilled_job_sharded_over_2_ranks_equals_the_unsharded_fleet(fleet, bundles, quantization):
    bundle = bundles["2.3"]
    spec = ModelSpec(checkpoint_path=bundle.distilled_checkpoint_path, gemma_root=bundle.gemma_root,
                     spatial_upsampler_path=bundle.spatial_upsampler_path).to_wire()  # fmt: skip
    whole = distilled_job(fleet, spec, "all", quantization, [])
    sharded = distilled_job(fleet, spec, "sharded", quantization, [])
    _assert_bitwise(sharded, whole, f"distilled LTX-2.3 {quantization or 'bf16'}")


@pytest.mark.slow
def test_ranks_short_of_host_memory_build_in_turns_and_equal_the_unsharded_fleet(fleet, fleet_of, bundles):
    # Host memory for one whole transformer at a time (MGPU_HOST_MEMORY_GIB, as on a 64 GB machine
    # with 4 GPUs): rank 0 builds and shards, then rank 1; the weights are the same.
    short = fleet_of(2, env={"MGPU_HOST_MEMORY_GIB": "0.001"})
    bundle = bundles["2.3"]
    spec = ModelSpec(checkpoint_path=bundle.distilled_checkpoint_path, gemma_root=bundle.gemma_root,
                     spatial_upsampler_path=bundle.spatial_upsampler_path).to_wire()  # fmt: skip
    logs: list[str] = []
    whole = distilled_job(fleet, spec, "all", None, [])
    in_turns = distilled_job(short, spec, "sharded", None, logs)
    _assert_bitwise(in_turns, whole, "distilled LTX-2.3 sharded in turns")
    turns = sorted(line for line in logs if "sharded it in turn" in line)
    assert len(turns) == 2, logs
    assert "rank 0 built" in turns[0] and "turn 1 of 2 (1 rank(s) at a time" in turns[0], turns
    assert "rank 1 built" in turns[1] and "turn 2 of 2" in turns[1], turns


def test_sharded_builds_take_turns_as_host_memory_holds_them():
    gib = 1 << 30
    assert weight_tracker.sharded_builds_at_once(41 * gib, 125 * gib, 4) == 2  # the 22B in bf16 on a 128 GiB host
    assert weight_tracker.sharded_builds_at_once(41 * gib, 60 * gib, 4) == 1
    assert weight_tracker.sharded_builds_at_once(41 * gib, 10 * gib, 2) == 1  # one at a time even when none fits
    assert weight_tracker.sharded_builds_at_once(41 * gib, 1000 * gib, 4) == 4
    assert weight_tracker.sharded_builds_at_once(41 * gib, None, 4) == 4  # nothing known: all at once, as before
    assert weight_tracker.host_memory_bytes({"MGPU_HOST_MEMORY_GIB": "64"}) == 64 * gib
    with pytest.raises(ValueError, match="MGPU_HOST_MEMORY_GIB must be a positive number of GiB, got 'lots'"):
        weight_tracker.host_memory_bytes({"MGPU_HOST_MEMORY_GIB": "lots"})
    available = weight_tracker.host_memory_bytes({})
    assert available is None or available > 0


@pytest.fixture(scope="module")
def fleet_of_four(fleet_of):
    return fleet_of(4)


@pytest.mark.slow
def test_two_stage_job_sharded_over_4_ranks_under_hybrid_groups_equals_the_unsharded_fleet(fleet_of_four, bundles):
    spec = bundles["2.3"].spec().to_json()
    whole = two_stage_job(fleet_of_four, spec, "all", "hybrid", [1, 3], [])
    sharded = two_stage_job(fleet_of_four, spec, "sharded", "hybrid", [1, 3], [])
    assert "2 guidance groups x SP degree 2" in sharded["plan"], sharded["plan"]
    _assert_bitwise(sharded, whole, "LTX-2.3 two-stage at 4 ranks")


# --- The planner ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sizes_22b():
    return full_size_sizes("ltx2.3-22b-transformer.json")


def test_the_22b_fp8_cast_runs_sharded_on_two_24_gib_gpus_and_is_refused_on_one_naming_sharding(sizes_22b):
    plan = plan_residency(sizes_22b, 24 * GIB, world_size=2, quantization="fp8-cast")
    assert plan.sharded_over == 2 and plan.policy == "auto" and plan.peak_bytes <= 24 * GIB, plan.describe()
    assert "transformer weights sharded over 2 ranks" in plan.describe()
    with pytest.raises(ResidencyError) as refused:
        plan_residency(sizes_22b, 24 * GIB, world_size=1, quantization="fp8-cast")
    assert "shard the transformer over the GPUs (residency 'sharded': about" in str(refused.value), refused.value


def test_the_22b_bf16_needs_four_24_gib_gpus_sharded_and_two_are_told_so(sizes_22b):
    plan = plan_residency(sizes_22b, 24 * GIB, world_size=4)
    assert plan.sharded_over == 4 and plan.peak_bytes <= 24 * GIB, plan.describe()
    with pytest.raises(ResidencyError) as refused:
        plan_residency(sizes_22b, 24 * GIB, world_size=2, policy="sharded")
    message = str(refused.value)
    assert "even with its transformer sharded over 2 ranks" in message and "on 4 GPUs" in message, message


def test_a_sharded_rank_holds_its_shard_four_block_sized_gather_buffers_and_the_rest(sizes_22b):
    # 48 blocks: the largest block and the weights outside the blocks, read from the headers.
    block, outside = sizes_22b.largest_block_bytes[0], sizes_22b.outside_blocks_bytes[0]
    assert 47 * block < sizes_22b.transformer_bytes < 49 * block + outside, (block, outside)
    for world in (2, 4, 8):
        expected = -(-sizes_22b.transformer_bytes // world) + 4 * block + outside
        assert sizes_22b.sharded_transformer(None, world) == expected


def test_residency_sharded_on_one_rank_is_refused_with_what_to_do(sizes_22b):
    with pytest.raises(ResidencyError, match="residency 'sharded' spreads the transformer over the fleet's ranks, but this fleet has 1 rank"):
        plan_residency(sizes_22b, 141 * GIB, world_size=1, policy="sharded")


def test_an_h200_keeps_the_22b_unsharded_under_auto_even_with_several_ranks(sizes_22b):
    for world in (1, 2, 4):
        assert plan_residency(sizes_22b, 139 * GIB, world_size=world).sharded_over == 1
    assert plan_residency(sizes_22b, 139 * GIB, world_size=2, policy="sharded").sharded_over == 2
