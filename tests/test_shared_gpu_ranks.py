"""N ranks on one GPU (``MGPU_SHARED_GPU_RANKS``): gloo with CUDA tensors, a correctness and memory mode.

On the CPU: how the fleet is laid out and told (ranks per GPU, devices, the server's line), the
refusals (bad counts, speed benchmarks, CUDA graphs over a gloo SP group). On a GPU (``-m gpu``,
skipped without CUDA): 8 ranks on cuda:0 run the full-size 19B and 22B block layouts (4 blocks,
random weights) at the full-size token count of 768x512x121 (6144 video tokens): SP degrees 2, 4
and 8, the guidance and hybrid plans, and TDP against degree 1 on the same GPU within bf16 noise;
weight sharding against the unsharded forward bitwise; and a fleet started with ``--gpus 0`` and 2
shared ranks answering the doctor's SP check.
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


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


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

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = Comm.world()
    model, video, audio = _model_and_inputs(version, device, tiny)
    passes = _passes(video, audio)
    results = {}
    with torch.inference_mode():
        reference = SequentialPassRunner().run(model, passes)
        for degree in (2, 4, 8):
            groups = [list(range(start, start + degree)) for start in range(0, world.world_size, degree)]
            comm = world if degree == world.world_size else world.split(groups)
            apply_sequence_parallel(model, comm)
            out = model(video=video, audio=audio, perturbations=None)
            remove_sequence_parallel(model)
            results[f"SP {degree}"] = max(_relative(a, b) for a, b in zip(out, reference[0]))
        for mode in ("guidance", "hybrid"):
            plan = plan_stage1(world.world_size, video.latent.shape[1], 4, mode)
            sp_comm = build_stage1_groups(world, plan)
            apply_sequence_parallel(model, sp_comm)
            outputs = apply_guidance_parallel(world, plan).run(model, passes)
            remove_sequence_parallel(model)
            results[f"{mode} {plan.guidance_groups}x{plan.sp_degree}"] = max(_relative(a, b) for pair, ref in zip(outputs, reference) for a, b in zip(pair, ref))
        grid = (2, 4, 12) if tiny else (16, 16, 24)
        tiling = TileCounts(DimensionTiling(1, 0), DimensionTiling(2, 2), DimensionTiling(4, 2))
        tiled = apply_tiled_data_parallel(model, world, tiling, grid)(video=video, audio=audio)
        alone = apply_tiled_data_parallel(model, Comm(None), tiling, grid)(video=video, audio=audio)
        results["TDP 8 tiles on 8 ranks"] = _relative(tiled[0], alone[0])
        apply_weight_sharding(model, world, device)
        sharded = model(video=video, audio=audio, perturbations=None)
        results["sharded bitwise"] = all(torch.equal(a, b) for a, b in zip(sharded, reference[0]))
        results["sharded max diff"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(sharded, reference[0]))
        apply_sequence_parallel(model, world)
        results["sharded SP 8"] = max(_relative(a, b) for a, b in zip(model(video=video, audio=audio, perturbations=None), reference[0]))
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
    for rank, result in enumerate(results):
        for name, value in result.items():
            if name.startswith(("SP", "guidance", "hybrid", "TDP", "sharded SP")):
                assert value <= BF16_NOISE, f"rank {rank}: {name} differs from degree 1 by {value:.3g} of the output scale"
        assert result["sharded bitwise"], f"rank {rank}: sharded forward differs from the unsharded one by {result['sharded max diff']}"


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
