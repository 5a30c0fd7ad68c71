"""ComfyUI's own LTX-2.3 model (the drop-in engine) on ranks sharing one GPU over gloo, against world 1.

On a GPU (``-m gpu``): 4 ranks on cuda:0 load ComfyUI's ``LTXAVModel`` as the engine's ranks load it
(``runtime.load_model``: ComfyUI's checkpoint loader) from a random checkpoint of the 22B block layout
cut to 2 blocks, make denoiser calls with ComfyUI's own conditioning code (tests/comfy_model_cases.py),
and compare ComfyUI's forward at SP 2 and 4 under the fleet's plan (``plan.apply_plan``, with the
captured blocks, which run eagerly over a gloo group) with its world-1 forward. Its CPU twin runs the
tiny LTX-2.3 bundle on 2 CPU ranks, bitwise. Both need COMFYUI_DIR and ComfyUI's Python; they skip
without them. The case sits beside the other shared-GPU cases (tests/test_shared_gpu_ranks.py, whose
comparisons it uses) and in a ``test_comfy_*`` module, so the CI step that has ComfyUI runs its twin.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from .dist_harness import run_ranks
from .helpers import write_diffusion_checkpoint
from .test_shared_gpu_ranks import BF16_NOISE, _agreed, _bitwise, _degrees, _group_of, _relative, _use, gpu

COMFY_BLOCKS = 2
COMFY_CASES = ("long", "image_to_video", "keyframes")  # 1280 tokens; 48 and 64 tokens with a first-frame image or a guide


def _comfy_transformer() -> dict:
    """The 22B (LTX-2.3) transformer cut to ``COMFY_BLOCKS`` blocks and one text-connector layer (the
    connectors run once per call, before the blocks SP splits): a checkpoint of 3.2 GB."""
    from mgpu_backend.ltx.diagnostics import bench_config

    transformer = bench_config("2.3")["transformer"]
    transformer.update(num_layers=COMFY_BLOCKS, connector_num_layers=1)
    return transformer


def shared_gpu_comfy_model(comfy_dir: str, checkpoint: str, device: str = "cuda:0", tiny: bool = False) -> dict:
    """On every rank: ComfyUI's model loaded as the drop-in engine's ranks load it (``runtime.load_model``:
    ComfyUI's checkpoint loader, weights on ``device``) from a random 22B-layout checkpoint that rank 0
    writes at ``checkpoint`` (``tiny``: the tiny LTX-2.3 bundle's), denoiser calls made by ComfyUI's own
    conditioning code, ComfyUI's forward at world 1, then at SP 2 and 4 with the fleet's plan
    (``plan.apply_plan``, and on CUDA the captured blocks, which run eagerly over gloo, as ``comfy.forward``
    applies them): each call's relative difference and whether it is bitwise; or ``{"skipped": why}``
    where ComfyUI's requirements are not importable."""
    from mgpu_backend.bundles.tiny import default_tiny_bundle
    from mgpu_backend.comfy_model import jobs, plan, runtime
    from mgpu_backend.comfy_model.captured_blocks import capture_blocks
    from mgpu_backend.parallel.comm import Comm

    from . import comfy_model_cases as cases

    device = _use(device)
    world = Comm.world()
    try:
        comfy, _ = runtime.import_comfy(comfy_dir, device)
        why = None
    except runtime.ComfyInputError as exc:
        why = str(exc)
    why = _agreed(why, world, "another rank cannot import ComfyUI")
    if why is not None:
        return {"skipped": why}
    if tiny:
        checkpoint = default_tiny_bundle("2.3").checkpoint_path
    elif world.rank == 0:
        write_diffusion_checkpoint(checkpoint, _comfy_transformer(), device)
    world.barrier()
    patcher = runtime.load_model(checkpoint, "checkpoint", "default", device)
    names = COMFY_CASES[1:] if tiny else COMFY_CASES
    calls = {name: cases.make_call(comfy, patcher, name, seed, device=device) for seed, name in enumerate(names)}
    model = patcher.model.diffusion_model
    plan.check_model(model)
    threads = torch.get_num_threads()
    reference = {name: cases.in_process(patcher, call, threads) for name, call in calls.items()}
    results = {}
    for degree in _degrees(world.world_size):
        sp_comm = _group_of(world, degree)
        loaded = runtime.LoadedModel("shared", patcher, plan=plan.apply_plan(model, sp_comm, video_query_exchange=device.type == "cpu"))
        if device.type == "cuda":
            loaded.captured = capture_blocks(model, sp_comm)
        try:
            for name, call in calls.items():
                out = cases.in_process(patcher, call, threads)
                results[f"{name} SP {degree}"] = _relative(out, reference[name])
                results[f"{name} SP {degree} bitwise"] = _bitwise(out, reference[name])
            results[f"SP {degree} graph replays"] = loaded.captured.replays if loaded.captured is not None else 0
        finally:
            jobs.release_parallelism(loaded)
    return results


def _on_ranks(world_size: int, *args, timeout: float = 300.0) -> list[dict]:
    """``shared_gpu_comfy_model(COMFYUI_DIR, *args)`` on ``world_size`` ranks, or a skip without COMFYUI_DIR.

    ComfyUI's folder is taken off ``sys.path`` while the ranks spawn: a spawned rank starts with the
    test process's path and imports this pack's ``__init__`` (the package above ``tests``), which imports
    ComfyUI's ``server`` where it can. After another module of the session imported ComfyUI here (the
    ``comfy`` fixture puts its folder on the path), that import would set up ComfyUI's device management
    in every rank, which on a machine without CUDA kills the rank before it runs."""
    from . import comfy_model_cases as cases

    if not cases.COMFYUI_DIR:
        pytest.skip("set COMFYUI_DIR to a ComfyUI v0.20.1 checkout (and run under its Python) to test ComfyUI's model on shared ranks")
    comfy_dir = os.path.abspath(cases.COMFYUI_DIR)
    with _off_the_path(comfy_dir):
        return run_ranks(world_size, shared_gpu_comfy_model, comfy_dir, *args, timeout=timeout)


@contextlib.contextmanager
def _off_the_path(folder: str):
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if os.path.realpath(entry or os.curdir) != os.path.realpath(folder)]
    try:
        yield
    finally:
        sys.path[:] = saved


def _check_comfy(results: list[dict], tolerance: float) -> None:
    if "skipped" in results[0]:
        pytest.skip(f"{results[0]['skipped']} (run the tests under ComfyUI's Python)")
    for rank, result in enumerate(results):
        for name, value in result.items():
            if name.endswith(("SP 2", "SP 4")):
                assert value <= tolerance, f"rank {rank}: {name} differs from ComfyUI's world-1 forward by {value:.3g} of the output scale"


@pytest.mark.gpu
@gpu
def test_comfyui_model_at_sp_2_and_4_on_ranks_sharing_one_gpu_matches_its_world_1_forward(tmp_path):
    checkpoint = str(tmp_path / f"ltx-2.3-{COMFY_BLOCKS}-blocks.safetensors")
    results = _on_ranks(4, checkpoint, timeout=600)
    print(f"ComfyUI LTX-2.3 model ({COMFY_BLOCKS} blocks), 4 ranks on one GPU vs world 1:", results[0])
    _check_comfy(results, BF16_NOISE)
    assert results[0]["SP 4 graph replays"] == 0  # the captured blocks run eagerly over a gloo group


@pytest.mark.slow
def test_the_gpu_comfyui_model_check_runs_on_2_cpu_ranks_bitwise():
    results = _on_ranks(2, "", "cpu", True)
    _check_comfy(results, 0.0)
    assert all(results[rank][f"{name} SP 2 bitwise"] for rank in (0, 1) for name in COMFY_CASES[1:]), results
