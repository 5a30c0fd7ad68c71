"""N ranks on one GPU (``MGPU_SHARED_GPU_RANKS``): gloo with CUDA tensors, a correctness and memory mode.

On the CPU: how the fleet is laid out and told (ranks per GPU, devices, the server's line), the
refusals (bad counts, speed benchmarks, CUDA graphs over a gloo SP group). On a GPU (``-m gpu``,
skipped without CUDA), each against degree 1 on the same GPU (largest difference relative to the
output's largest value, and whether it is bitwise):

- 8 ranks on cuda:0 run the full-size 19B and 22B block layouts (4 blocks, random weights) at the
  full-size token count of 768x512x121 (6144 video tokens): SP degrees 2, 4 and 8, the guidance and
  hybrid plans, and TDP within bf16 noise; weight sharding against the unsharded forward bitwise;
- the distributed VAE decode of the full-size decoder (random weights) at 1536x1024x121 (48 tiles)
  on 2, 4 and 8 ranks against one rank;
- the transformer blocks compiled by Inductor under SP 4 over gloo against the eager forward (both
  layouts, 4 blocks, 6144 tokens). CUDA graphs are not captured over a gloo SP group (the refusal
  below), so here the compiled blocks run without graph replay;
- (ComfyUI's own model on shared ranks: tests/test_comfy_model_shared_gpu.py);
- a fleet started with ``--gpus 0`` and 2 shared ranks answering the doctor's SP check.

Every GPU case has a CPU twin (``device="cpu", tiny=True``) that a CPU test runs on 2 CPU ranks (the
layouts on 8; all but the decode's under ``-m slow``), so its code runs without a GPU; each GPU test
prints its figures for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from mgpu_backend.fleet import shared_gpu
from mgpu_backend.fleet.controller import DeviceSpec

from .dist_harness import run_ranks
from .fleet_harness import REPO, run_job, stop_server, wait_for_server
from .helpers import SCENARIOS, build_tiny_decoder, distributed_decode_video, scenario_latent

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# --- CPU: layout and refusals ------------------------------------------------------------------------


def test_four_shared_ranks_on_gpu_0_make_a_world_of_4_and_the_server_says_it_is_no_speed_mode(monkeypatch):
    monkeypatch.setenv(shared_gpu.SHARED_GPU_RANKS_ENV, "4")
    devices = DeviceSpec.parse("0", None)
    assert (devices.gpus, devices.ranks_per_gpu, devices.world_size) == ((0,), 4, 4)
    assert devices.describe() == (
        "GPUs 0; 4 ranks share each GPU over gloo (MGPU_SHARED_GPU_RANKS=4): a correctness and memory mode; "
        "its timings are not multi-GPU speed figures"
    )
    assert DeviceSpec(gpus=(0, 1), ranks_per_gpu=2).world_size == 4
    monkeypatch.delenv(shared_gpu.SHARED_GPU_RANKS_ENV)
    assert DeviceSpec.parse("0,1", None).world_size == 2 and DeviceSpec.parse(None, 3).world_size == 3


@pytest.mark.parametrize("value", ["0", "9", "two"])
def test_a_bad_shared_rank_count_is_refused_with_the_range(value):
    with pytest.raises(ValueError, match=f"MGPU_SHARED_GPU_RANKS must be a number of ranks per GPU from 1 to 8, got '{value}'"):
        shared_gpu.shared_gpu_ranks({shared_gpu.SHARED_GPU_RANKS_ENV: value})


def test_the_fleet_names_the_gpu_pairs_without_peer_access_and_says_it_runs_without_p2p():
    assert shared_gpu.peer_access_line(4, lambda a, b: True) is None
    line = shared_gpu.peer_access_line(3, lambda a, b: {a, b} != {0, 2})
    assert line.startswith("no peer-to-peer access between GPUs 0->2, 2->0: the fleet runs without P2P, NCCL moves"), line


def test_speed_benchmarks_refuse_ranks_sharing_a_gpu_and_say_what_to_do():
    shared_gpu.refuse_for_speed("step.py", {})  # one rank per GPU: runs
    with pytest.raises(SystemExit) as refused:
        shared_gpu.refuse_for_speed("step.py", {shared_gpu.SHARED_GPU_RANKS_ENV: "2"})
    message = str(refused.value)
    assert message.startswith("step.py measures speed, but MGPU_SHARED_GPU_RANKS=2 puts 2 ranks on each GPU over gloo"), message
    assert "unset MGPU_SHARED_GPU_RANKS and give the fleet one GPU per rank" in message, message


def _why_no_graphs_over_the_world() -> str | None:
    from mgpu_backend.ltx.parallelize import Stage1Options, _Groups, _why_no_cuda_graphs
    from mgpu_backend.parallel.comm import Comm

    return _why_no_cuda_graphs(Stage1Options(cuda_graphs=True), torch.device("cuda", 0), _Groups(Comm.world(), None))


def test_cuda_graphs_are_not_captured_over_a_gloo_sp_group():
    reasons = run_ranks(2, _why_no_graphs_over_the_world)
    assert reasons == ["the SP group runs over gloo (ranks sharing a GPU), whose host-side collectives a CUDA graph cannot hold"] * 2


# --- GPU: 8 ranks on cuda:0 ---------------------------------------------------------------------------

BLOCKS = 4
SIZE = (768, 512, 121)  # 16 x 16 x 24 latent = 6144 video tokens
TEXT_TOKENS = 128


def _model_and_inputs(version: str, device: torch.device, tiny: bool):
    from mgpu_backend.ltx.diagnostics import bench_config, context_widths, random_transformer, random_transformer_inputs
    from mgpu_backend.ltx.latents import StageGeometry

    config = bench_config(version, tiny=tiny)
    config["transformer"]["num_layers"] = BLOCKS
    model = random_transformer(config, device, torch.bfloat16, seed=5)
    width, height, frames = (96 * 4, 64 * 2, 9) if tiny else SIZE
    geometry = StageGeometry(height=height, width=width, num_frames=frames, frame_rate=24.0)
    widths = context_widths(config["transformer"])
    video, audio = random_transformer_inputs(geometry, geometry, TEXT_TOKENS, widths, 0.7, device, torch.bfloat16, seed=6, draw_on_cpu=True)
    return model, video, audio


def _relative(found, expected) -> float:
    """Largest difference relative to the expected output's largest value (tensors, or lists of them: the
    largest over the pairs)."""
    if isinstance(expected, torch.Tensor):
        return float((found.float() - expected.float()).abs().max() / expected.float().abs().max().clamp(min=1e-6))
    return max(_relative(a, b) for a, b in zip(found, expected, strict=True))


def _bitwise(found, expected) -> bool:
    if isinstance(expected, torch.Tensor):
        return torch.equal(found, expected)
    return all(_bitwise(a, b) for a, b in zip(found, expected, strict=True))


def _use(device: str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _degrees(world_size: int) -> list[int]:
    return [degree for degree in (2, 4, 8) if degree <= world_size]


def _group_of(world, degree: int):
    """This rank's group of ``degree`` consecutive ranks (a collective: every rank calls it)."""
    if degree == world.world_size:
        return world
    return world.split([list(range(start, start + degree)) for start in range(0, world.world_size, degree)])


def _passes(video, audio):
    from ltx_core.guidance.perturbations import BatchedPerturbationConfig, Perturbation, PerturbationConfig, PerturbationType

    from mgpu_backend.ltx.passes import GuidancePass

    stg = BatchedPerturbationConfig([PerturbationConfig([Perturbation(PerturbationType.SKIP_VIDEO_SELF_ATTN, [1])])])
    isolated = BatchedPerturbationConfig([PerturbationConfig([Perturbation(PerturbationType.SKIP_A2V_CROSS_ATTN, None),
                                                              Perturbation(PerturbationType.SKIP_V2A_CROSS_ATTN, None)])])  # fmt: skip
    negative = dataclasses.replace(video, context=-video.context)
    return [GuidancePass("conditional", video, audio, None), GuidancePass("unconditional", negative, audio, None),
            GuidancePass("perturbed", video, audio, stg), GuidancePass("isolated", video, audio, isolated)]  # fmt: skip


def shared_gpu_layouts(version: str, device: str = "cuda:0", tiny: bool = False) -> dict:
    """On every rank (all on cuda:0, gloo): degree 1, SP 2/4/8, guidance and hybrid plans, TDP over
    the world, then the weights sharded over the world (alone and under SP 8); relative differences
    against degree 1 on rank 0, and whether the sharded forwards are bitwise. (``device`` "cpu" with
    ``tiny`` widths runs the same code on CPU ranks.)"""
    from mgpu_backend.ltx.passes import SequentialPassRunner
    from mgpu_backend.parallel.comm import Comm
    from mgpu_backend.parallel.guidance_parallel import apply_guidance_parallel, build_stage1_groups, plan_stage1
    from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel, remove_sequence_parallel
    from mgpu_backend.parallel.tiled_data_parallel import DimensionTiling, TileCounts, apply_tiled_data_parallel
    from mgpu_backend.parallel.weight_sharding import apply_weight_sharding

    device = _use(device)
    world = Comm.world()
    model, video, audio = _model_and_inputs(version, device, tiny)
    passes = _passes(video, audio)
    results = {}
    with torch.inference_mode():
        reference = SequentialPassRunner().run(model, passes)
        for degree in _degrees(world.world_size):
            apply_sequence_parallel(model, _group_of(world, degree))
            out = model(video=video, audio=audio, perturbations=None)
            remove_sequence_parallel(model)
            results[f"SP {degree}"] = _relative(out, reference[0])
        for mode in ("guidance", "hybrid"):
            plan = plan_stage1(world.world_size, video.latent.shape[1], 4, mode)
            sp_comm = build_stage1_groups(world, plan)
            apply_sequence_parallel(model, sp_comm)
            outputs = apply_guidance_parallel(world, plan).run(model, passes)
            remove_sequence_parallel(model)
            results[f"{mode} {plan.guidance_groups}x{plan.sp_degree}"] = _relative(outputs, reference)
        grid = (2, 4, 12) if tiny else (16, 16, 24)
        tiling = TileCounts(DimensionTiling(1, 0), DimensionTiling(2, 2), DimensionTiling(4, 2))
        tiled = apply_tiled_data_parallel(model, world, tiling, grid)(video=video, audio=audio)
        alone = apply_tiled_data_parallel(model, Comm(None), tiling, grid)(video=video, audio=audio)
        results["TDP 8 tiles on 8 ranks"] = _relative(tiled[0], alone[0])
        apply_weight_sharding(model, world, device)
        sharded = model(video=video, audio=audio, perturbations=None)
        results["sharded bitwise"] = _bitwise(sharded, reference[0])
        results["sharded max diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(sharded, reference[0]))
        apply_sequence_parallel(model, world)
        results["sharded SP 8"] = _relative(model(video=video, audio=audio, perturbations=None), reference[0])
        remove_sequence_parallel(model)
        results["peak GiB"] = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return results


BF16_NOISE = 2e-2  # relative to the output's largest value, as the CUDA-graph and SP GPU tests allow


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("version", ["2.0", "2.3"])  # the 19B and 22B block layouts
def test_8_ranks_sharing_one_gpu_match_degree_1_under_sp_guidance_hybrid_and_tdp_and_sharding_is_bitwise(version):
    results = run_ranks(8, shared_gpu_layouts, version, timeout=600)
    print(f"LTX-{version}, 8 ranks on one GPU:", results[0])
    _check_layouts(results)


def _check_layouts(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for name, value in result.items():
            if name.startswith(("SP", "guidance", "hybrid", "TDP", "sharded SP")):
                assert value <= BF16_NOISE, f"rank {rank}: {name} differs from degree 1 by {value:.3g} of the output scale"
        assert result["sharded bitwise"], f"rank {rank}: sharded forward differs from the unsharded one by {result['sharded max diff']}"


@pytest.mark.slow
def test_the_gpu_layouts_check_runs_on_8_cpu_ranks_at_tiny_widths():
    results = run_ranks(8, shared_gpu_layouts, "2.3", "cpu", True)
    _check_layouts(results)
    assert {"SP 8", "guidance 4x2", "hybrid 4x2", "TDP 8 tiles on 8 ranks"} <= set(results[0]), results[0]


@pytest.mark.gpu
@gpu
def test_a_fleet_on_gpu_0_with_2_shared_ranks_runs_stage_1_sequence_parallel_over_gloo(tmp_path):
    from mgpu_backend.ltx.diagnostics import bench_config

    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # keep what the tests import from
    env = {**os.environ, "PYTHONPATH": path, shared_gpu.SHARED_GPU_RANKS_ENV: "2"}
    log = open(tmp_path / "server.log", "ab")  # noqa: SIM115
    command = [sys.executable, "-m", "mgpu_backend", "serve", "--socket", str(socket_path), "--gpus", "0", "--idle-timeout", "0"]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    logs = []
    try:
        wait_for_server(socket_path, process)
        args = {"config": bench_config("2.0", tiny=True), "seed": 3, "width": 96, "height": 64, "num_frames": 9, "steps": 2, "parallel": "sp",
                "batch_passes": False}  # batched passes are the other reason for no graphs ("auto" batches a few tokens on CUDA)
        result = run_job(socket_path, "bench_stage1", args, on_log=logs.append)
    finally:
        stop_server(process)
    assert result.fields["sp_degree"] == 2, result.fields
    assert all(bool(torch.isfinite(tensor).all()) for tensor in result.tensors.values())
    assert any("CUDA graphs not applied: the SP group runs over gloo" in line for line in logs), logs
    assert "2 ranks share each GPU over gloo" in (tmp_path / "server.log").read_text()


# --- The distributed VAE decode on ranks sharing a GPU ------------------------------------------------

DECODE_LATENT = (1, 128, 16, 32, 48)  # bench/decode.py's full size: 1536x1024x121, 48 tiles in 3 temporal groups
DECODE_SCENARIO = "spatial_and_temporal"  # the tiny twin: 18 tiles, corners where 4 tiles overlap


def _decoder_and_latent(device: torch.device, tiny: bool):
    """The full-size LTX-2 video decoder (FULL_SIZE_VIDEO_VAE_CONFIG, random bf16 weights, timestep
    conditioning and noise injection on), a random latent and ``TilingConfig.default()``, as
    bench/decode.py decodes; ``tiny``: the distributed decode tests' tiny decoder and scenario (fp32)."""
    if tiny:
        return build_tiny_decoder().to(device), scenario_latent(DECODE_SCENARIO).to(device), SCENARIOS[DECODE_SCENARIO][1]
    from ltx_core.model.video_vae import TilingConfig, VideoDecoderConfigurator

    from mgpu_backend.bundles.full_size import FULL_SIZE_VIDEO_VAE_CONFIG
    from mgpu_backend.bundles.random_weights import materialize_random_

    with torch.device("meta"):
        decoder = VideoDecoderConfigurator.from_config({"vae": FULL_SIZE_VIDEO_VAE_CONFIG})
    decoder = materialize_random_(decoder, device, torch.bfloat16, seed=7)
    latent = torch.randn(DECODE_LATENT, generator=torch.Generator(device=device).manual_seed(8), device=device, dtype=torch.bfloat16)
    return decoder, latent, TilingConfig.default()


def shared_gpu_decode(device: str = "cuda:0", tiny: bool = False) -> dict:
    """On every rank: rank 0 decodes alone (degree 1), then the group of ranks 0..N-1 decodes the same
    latent with the same decoder noise for N = 2, 4, 8 (up to the world size); rank 0 reports each
    decode's largest difference from degree 1 relative to the video's largest value, and whether it
    is bitwise. Every rank reports its peak device memory."""
    from mgpu_backend.parallel.comm import Comm
    from mgpu_backend.parallel.distributed_decode import last_decode_stats

    device = _use(device)
    world = Comm.world()
    decoder, latent, tiling = _decoder_and_latent(device, tiny)
    results, peaks = {}, [0]

    def decode(comm):
        video = distributed_decode_video(decoder, latent, tiling, comm, torch.Generator(device=device).manual_seed(9))
        peaks.append(last_decode_stats().device_peak_bytes or 0)
        return video

    with torch.inference_mode():
        reference = decode(Comm(None)) if world.rank == 0 else None
        if reference is not None:
            results["tiles"] = last_decode_stats().tiles_total
        for degree in _degrees(world.world_size):
            comm = _group_of(world, degree)
            if world.rank >= degree:
                continue  # only rank 0's group decodes: the others wait in the next group's creation
            video = decode(comm)
            if reference is not None:
                results[f"{degree} ranks"] = _relative(video, reference)
                results[f"{degree} ranks bitwise"] = _bitwise(video, reference)
    results["peak GiB"] = max(peaks) / 2**30
    return results


DECODE_NOISE = 1e-2  # bf16 rounding of the blend sums where several tiles overlap, relative to the video's scale


def _check_decode(results: list[dict], tolerance: float) -> None:
    decoded = {name: value for name, value in results[0].items() if name.endswith(" ranks")}
    assert decoded, results[0]
    for name, value in decoded.items():
        assert value <= tolerance, f"{name} differ from one rank by {value:.3g} of the video's scale"


@pytest.mark.gpu
@gpu
def test_the_full_size_decode_on_2_4_and_8_ranks_sharing_one_gpu_matches_one_rank():
    results = run_ranks(8, shared_gpu_decode, timeout=600)
    print("VAE decode 1536x1024x121, ranks on one GPU vs one rank:", results[0], "peak GiB per rank:", [round(r["peak GiB"], 1) for r in results])
    assert results[0]["tiles"] == 48
    _check_decode(results, DECODE_NOISE)


def test_the_gpu_decode_check_runs_on_2_cpu_ranks_with_the_tiny_decoder_within_fp32_rounding():
    results = run_ranks(2, shared_gpu_decode, "cpu", True)
    assert results[0]["tiles"] == 18 and results[1] == {"peak GiB": 0.0}
    _check_decode(results, 1e-5)  # fp32: the 4-tile corners add in another order (the module docstring's 1e-7)


# --- Compiled blocks under SP over gloo ----------------------------------------------------------------


def _why_no_compile(device: torch.device, backend: str, world) -> str | None:
    """Why torch.compile cannot build kernels on this machine (Inductor needs Triton and a C compiler
    for its launchers), agreed by every rank, or None."""
    try:
        torch.compile(lambda x: torch.sin(x) * 2, backend=backend)(torch.ones(8, device=device))
        why = None
    except Exception as exc:  # noqa: BLE001 - any failure to build a kernel is the reason to skip
        first_line = (str(exc).strip().splitlines() or [""])[0]
        why = f"torch.compile ({backend}) cannot build kernels on this machine: {type(exc).__name__}: {first_line}"
    return _agreed(why, world, "another rank cannot build torch.compile kernels")


def _agreed(why: str | None, world, elsewhere: str) -> str | None:
    """A reason to skip that every rank takes (``elsewhere`` where only other ranks have one), so that no
    rank goes on into collectives the others never reach."""
    failed = world.all_reduce_max(torch.tensor([float(why is not None)]))
    return why or (elsewhere if failed.item() else None)


def shared_gpu_compiled_blocks(versions: tuple[str, ...], device: str = "cuda:0", tiny: bool = False, backend: str = "inductor") -> dict:
    """On every rank: each layout's degree-1 eager forward, then the same forward under SP over the
    world with the blocks compiled (``apply_compiled_blocks``); the relative difference and whether it
    is bitwise, or ``{"skipped": why}`` where torch.compile cannot build kernels."""
    from mgpu_backend.parallel.comm import Comm
    from mgpu_backend.parallel.compiled_blocks import apply_compiled_blocks, remove_compiled_blocks
    from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel, remove_sequence_parallel

    device = _use(device)
    world = Comm.world()
    why = _why_no_compile(device, backend, world)
    if why is not None:
        return {"skipped": why}
    results = {}
    for version in versions:
        model, video, audio = _model_and_inputs(version, device, tiny)
        with torch.inference_mode():
            eager = model(video=video, audio=audio, perturbations=None)
            apply_sequence_parallel(model, world)
            apply_compiled_blocks(model, backend)
            compiled = model(video=video, audio=audio, perturbations=None)
            remove_compiled_blocks(model)
            remove_sequence_parallel(model)
        results[f"LTX-{version} compiled SP {world.world_size}"] = _relative(compiled, eager)
        results[f"LTX-{version} bitwise"] = _bitwise(compiled, eager)
        del model
    return results


def _check_compiled(results: list[dict], tolerance: float) -> None:
    if "skipped" in results[0]:
        pytest.skip(results[0]["skipped"])
    for rank, result in enumerate(results):
        for name, value in result.items():
            if "compiled SP" in name:
                assert value <= tolerance, f"rank {rank}: {name} differs from the eager degree-1 forward by {value:.3g} of the output scale"


@pytest.mark.gpu
@gpu
def test_inductor_compiled_blocks_under_sp_4_over_gloo_on_one_gpu_match_the_eager_degree_1_forward():
    # CUDA graphs are not captured over a gloo SP group (test_cuda_graphs_are_not_captured_over_a_gloo_sp_group):
    # the compiled blocks run here without graph replay, as a fleet of shared ranks runs them.
    results = run_ranks(4, shared_gpu_compiled_blocks, ("2.0", "2.3"), timeout=600)
    print("compiled blocks, 4 ranks on one GPU vs eager degree 1:", results[0])
    _check_compiled(results, BF16_NOISE)


@pytest.mark.slow
def test_the_gpu_compiled_blocks_check_runs_on_2_cpu_ranks_with_aot_eager():
    results = run_ranks(2, shared_gpu_compiled_blocks, ("2.3",), "cpu", True, "aot_eager")
    _check_compiled(results, BF16_NOISE)  # bf16 on the CPU: shards round their matrix products by their own row count
    assert set(results[0]) == {"LTX-2.3 compiled SP 2", "LTX-2.3 bitwise"}, results[0]
