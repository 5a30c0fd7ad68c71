"""The parallelize entries (mgpu_backend.ltx.parallelize): the real sample and upscale jobs on two
gloo ranks leave the resident transformer exactly as ltx-core made it after each stage, and log one
line per technique in the fixed order; on one rank the entry applies and undoes compiled blocks and
refuses to start stage 2 on a transformer that still carries stage 1's techniques. GPU (skipped
without CUDA): graphs captured in one job replay in the next, and the model is left unpatched.
"""

from __future__ import annotations

import re

import pytest
import torch

from mgpu_backend.fleet.jobs import JobContext
from mgpu_backend.ltx.parallelize import (
    COMPILED_BLOCKS,
    CUDA_GRAPHS,
    PROCESS_GROUPS,
    STAGE1_ORDER,
    Stage1Cache,
    Stage1Options,
    left_on_transformer,
    parallelize_stage1,
    parallelize_stage2,
)
from mgpu_backend.ltx.passes import GuidancePass, SequentialPassRunner
from mgpu_backend.parallel.batched_passes import BatchedPassRunner
from mgpu_backend.parallel.comm import Comm
from mgpu_backend.parallel.compiled_blocks import blocks_compiled
from mgpu_backend.parallel.guidance_parallel import plan_stage1
from mgpu_backend.parallel.sequence_parallel import apply_sequence_parallel, remove_sequence_parallel
from tests.dist_harness import run_ranks
from tests.helpers import CommOfSize, build_tiny_model, max_abs_diff, stg_perturbations, transformer_inputs

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = ["a red fox runs through fresh snow at dawn", "blurry, low quality"]
TECHNIQUE_LINE = re.compile(r"^stage (1|2): (.+?): ")


def instance_overrides(model: torch.nn.Module) -> dict:
    """Every callable set on an instance of ``model``'s modules (what SP, compiled blocks and graph
    capture patch), named by type: equal for two states when nothing is patched differently."""
    overrides = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key.startswith("_mgpu") or (callable(value) and not isinstance(value, torch.nn.Module)):
                overrides[f"{name}.{key}"] = f"{type(value).__module__}.{type(value).__qualname__}"
    return overrides


def _context(rank: int, world: Comm, logs: list[str]) -> JobContext:
    def emit(kind: str, fields: dict) -> None:
        if kind == "log":
            logs.append(fields["text"])

    return JobContext(rank, world.world_size, torch.device("cpu"), world, world, {}, emit, lambda: False)


def _technique_lines(logs: list[str]) -> list[tuple[str, str]]:
    return [match.groups() for match in map(TECHNIQUE_LINE.match, logs) if match]


def stage_jobs_on_ranks(spec: dict) -> dict:
    """load, encode, then sample (SP 2) -> upscale -> sample (guidance, batched) -> upscale (tiled),
    recording the transformer's instance patches after each job and the technique lines of each."""
    from mgpu_backend.ltx import jobs

    torch.set_num_threads(1)
    world = Comm.world()
    logs: list[str] = []
    ctx = _context(world.rank, world, logs)
    jobs.load(ctx, {"spec": spec}, {})
    transformer = ctx.state["model"].transformer("none")
    record = {"clean": instance_overrides(transformer)}
    _, contexts = jobs.encode(ctx, {"spec": spec, "prompts": PROMPTS}, {})
    tensors = {
        "positive_video_context": contexts["video_context_0"], "positive_audio_context": contexts["audio_context_0"],
        "negative_video_context": contexts["video_context_1"], "negative_audio_context": contexts["audio_context_1"],
    }  # fmt: skip
    sample = {"spec": spec, "width": 96, "height": 64, "num_frames": 9, "steps": 2, "seed": 3}
    runs = [
        ("sample", {**sample, "parallel": "sp"}),
        ("upscale", {"spec": spec, "seed": 3, "tiles": [1, 1]}),
        ("sample", {**sample, "parallel": "guidance", "batch_passes": True}),
        ("upscale", {"spec": spec, "seed": 3, "tiles": [1, 2], "overlap": 1}),
    ]
    latents = None
    for index, (op, args) in enumerate(runs):
        logs.clear()
        job_tensors = dict(tensors) if op == "sample" else {**latents, **tensors}
        fields, out = getattr(jobs, op)(ctx, args, job_tensors)
        if op == "sample":
            latents = out
        record[f"{index}:{op}"] = {
            "fields": {key: value for key, value in fields.items() if key in ("sp_degree", "guidance_groups", "tiling")},
            "overrides": instance_overrides(transformer),
            "left": left_on_transformer(transformer),
            "lines": _technique_lines(logs),
            "same_transformer": ctx.state["model"].transformer("distilled" if op == "upscale" else "none") is transformer,
        }
    return record


@pytest.fixture(scope="module")
def stage_jobs(spec):
    return run_ranks(2, stage_jobs_on_ranks, spec)


def test_sample_at_sp_degree_2_then_upscale_leave_the_resident_transformer_unpatched(stage_jobs):
    for rank, record in enumerate(stage_jobs):
        clean = record["clean"]
        for step in ("0:sample", "1:upscale", "2:sample", "3:upscale"):
            assert record[step]["same_transformer"], f"rank {rank}, {step}: the jobs must share one resident transformer"
            assert record[step]["left"] == [], f"rank {rank}, after {step}: {record[step]['left']} still applied"
            assert record[step]["overrides"] == clean, (
                f"rank {rank}, after {step}: instance patches differ from the freshly loaded transformer: "
                f"{sorted(set(record[step]['overrides'].items()) ^ set(clean.items()))}"
            )
        # The stages did apply their techniques (else the checks above prove nothing).
        assert record["0:sample"]["fields"] == {"sp_degree": 2, "guidance_groups": 1}
        assert record["2:sample"]["fields"] == {"sp_degree": 1, "guidance_groups": 2}
        assert record["3:upscale"]["fields"]["tiling"].startswith("frames 1")


def test_each_job_logs_its_techniques_in_the_fixed_order(stage_jobs):
    for rank, record in enumerate(stage_jobs):
        assert record["0:sample"]["lines"] == [("1", "process groups"), ("1", "sequence parallel")], (rank, record["0:sample"])
        assert record["1:upscale"]["lines"] == [("2", "tiled data parallel not applied")], (rank, record["1:upscale"])
        assert record["2:sample"]["lines"] == [("1", "process groups"), ("1", "guidance parallel"), ("1", "batched passes")], (
            rank, record["2:sample"],
        )  # fmt: skip
        assert record["3:upscale"]["lines"] == [("2", "tiled data parallel")], (rank, record["3:upscale"])


def test_one_rank_entry_applies_compiled_blocks_and_batched_passes_in_order_and_undoes_them():
    model = build_tiny_model()
    clean = instance_overrides(model)
    plan = plan_stage1(1, 45, 4, "auto", attention_heads=8, audio_attention_heads=8)
    options = Stage1Options(cuda_graphs=True, batch_passes=True, compile_blocks=True, compile_backend="aot_eager")
    lines: list[str] = []
    with parallelize_stage1(model, plan, Comm(None), torch.device("cpu"), options, Stage1Cache(), lines.append) as stage:
        assert blocks_compiled(model)
        assert isinstance(stage.runner, BatchedPassRunner) and isinstance(stage.runner.inner, SequentialPassRunner)
        assert stage.applied == [PROCESS_GROUPS, COMPILED_BLOCKS, "batched passes"]
        assert stage.graphs is None, "CUDA graphs never combine with batched passes"
    assert not blocks_compiled(model) and instance_overrides(model) == clean
    assert lines[0] == plan.reason
    named = [match.group(2) for match in map(TECHNIQUE_LINE.match, lines[1:])]
    assert named == ["process groups", "compiled blocks", "batched passes", "CUDA graphs not applied"], lines
    assert [STAGE1_ORDER.index(name) for name in stage.applied] == sorted(STAGE1_ORDER.index(name) for name in stage.applied)
    assert "batched forward builds its perturbation masks on the host" in lines[-1]


def test_stage1_undoes_its_techniques_when_the_loop_raises():
    model = build_tiny_model()
    clean = instance_overrides(model)
    plan = plan_stage1(1, 45, 4, "auto", attention_heads=8, audio_attention_heads=8)
    options = Stage1Options(compile_blocks=True, compile_backend="aot_eager")
    with pytest.raises(RuntimeError, match="the loop failed"):
        with parallelize_stage1(model, plan, Comm(None), torch.device("cpu"), options, Stage1Cache()):
            assert blocks_compiled(model)
            raise RuntimeError("the loop failed")
    assert instance_overrides(model) == clean


def test_stage2_refuses_a_transformer_that_is_still_sequence_parallel():
    model = apply_sequence_parallel(build_tiny_model(), CommOfSize(2))
    with pytest.raises(RuntimeError, match="stage 2 got the resident transformer with sequence parallel still applied"):
        with parallelize_stage2(model, Comm(None), None, (2, 3, 5)):
            pass
    remove_sequence_parallel(model)
    with parallelize_stage2(model, Comm(None), None, (2, 3, 5)) as wrapper:
        assert wrapper is None



@pytest.mark.gpu
@gpu
def test_gpu_graphs_captured_in_one_job_replay_in_the_next_and_leave_the_model_unpatched():
    device = torch.device("cuda", torch.cuda.current_device())
    model = build_tiny_model(seed=21).to(device, torch.bfloat16)
    clean = instance_overrides(model)
    plan = plan_stage1(1, 45, 2, "auto", attention_heads=8, audio_attention_heads=8)
    cache, options = Stage1Cache(), Stage1Options(cuda_graphs=True)
    video, audio = transformer_inputs(8, device=device, dtype=torch.bfloat16)
    passes = [GuidancePass("conditional", video, audio, None), GuidancePass("perturbed", video, audio, stg_perturbations())]
    outputs, captures = [], []
    for _job in range(2):
        with torch.inference_mode(), parallelize_stage1(model, plan, Comm(None), device, options, cache) as stage:
            assert stage.applied == [PROCESS_GROUPS, CUDA_GRAPHS], stage.applied
            outputs.append(stage.runner.run(model, passes))
            captures.append(stage.fields()["cuda_graphs"]["captures"])
        assert instance_overrides(model) == clean, "the RoPE grids of graph capture must be given back"
    with torch.inference_mode():
        eager = SequentialPassRunner().run(model, passes)
    assert captures == [2, 2], f"two signatures captured in the first job, none more in the second: {captures}"
    for first, second, expected in zip(*outputs, eager):
        for slot in range(2):
            assert torch.equal(first[slot], second[slot]), "the second job's replay differs from the first job's"
            scale = float(expected[slot].float().abs().max())
            assert max_abs_diff(first[slot], expected[slot]) <= 2e-2 * scale, (max_abs_diff(first[slot], expected[slot]), scale)
