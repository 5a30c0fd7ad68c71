"""The LTX-2 jobs through a real fleet (server process, sockets, gloo CPU ranks) on the tiny bundle."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from mgpu_backend.tools import media
from mgpu_backend.fleet.client import FleetCancelled, FleetClient, FleetError
from mgpu_backend.ltx import api
from mgpu_backend.ltx.jobs import EMBEDDED_BUNDLE_FOLDER, stage1_params
from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
from mgpu_backend.ltx.schema import CONTEXT_MISSING, SampleRequest, prompt_digest
from mgpu_backend.ltx.stages import GenerationParams, refine_stage2, sample_stage1, upsample_video
from mgpu_backend.ltx.text import encode_prompts

from .fleet_harness import run_job
from .helpers import NEGATIVE, PROMPT, SINGLE_GPU_SIGMAS, context_tensors, contexts_of, ranks_reported_after, run_generate, sample_args


run = run_job


def test_fleet_jobs_at_two_ranks_equal_the_in_process_stages_bf16(fleet, spec):
    """SP + guidance parallel in stage 1 and an untiled stage 2 on 2 ranks reproduce the one-process stages."""
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT, NEGATIVE]})
    tensors = context_tensors(encoded)
    stage1 = run(fleet, "sample", sample_args(spec, parallel="sp"), tensors)
    upscaled = run(
        fleet, "upscale", {"spec": spec, "seed": 7, "sigmas": SINGLE_GPU_SIGMAS, "tiles": [1, 1]},
        {**stage1.tensors, "positive_video_context": tensors["positive_video_context"], "positive_audio_context": tensors["positive_audio_context"]},
    )  # fmt: skip

    loader = ModelLoader(ModelSpec.from_wire(spec), "cpu", torch.bfloat16)
    positive, negative = encode_prompts(loader, [PROMPT, NEGATIVE])
    params = stage1_params(SampleRequest.from_wire(sample_args(spec)), layer_count=2)
    video, audio = sample_stage1(loader, params, positive, negative)
    params2 = GenerationParams(height=128, width=192, num_frames=9, seed=7, two_stage=True)
    video2, audio2 = refine_stage2(loader, params2, upsample_video(loader, video), audio, positive, sigmas=SINGLE_GPU_SIGMAS)

    # The contexts come back in the model's dtype, exactly what the ranks computed (bf16 round trip).
    for index, context in enumerate((positive, negative)):
        for name, tensor in (("video", context.video_context), ("audio", context.audio_context)):
            sent = encoded.tensors[f"{name}_context_{index}"]
            assert sent.dtype == tensor.dtype == torch.bfloat16 and torch.equal(sent, tensor), f"{name} context {index}"
    for name, ours, fleet_tensor in (
        ("stage-1 video", video, stage1.tensors["video_latent"]),
        ("stage-1 audio", audio, stage1.tensors["audio_latent"]),
        ("stage-2 video", video2, upscaled.tensors["video_latent"]),
    ):
        diff = (ours - fleet_tensor).abs().max().item()
        assert diff == 0.0, f"{name} differs from the one-process stages by {diff}"
    assert torch.equal(upscaled.tensors["audio_latent"], stage1.tensors["audio_latent"]), "stage 2 must return the stage-1 audio"
    assert stage1.fields["sp_degree"] == 2


def test_sample_naming_the_prompts_by_digest_equals_sending_the_contexts(fleet, spec):
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT, NEGATIVE]})
    digests = encoded.fields["digests"]
    assert digests == [prompt_digest(p, ModelSpec.from_wire(spec), "bfloat16", "sharded") for p in (PROMPT, NEGATIVE)]
    by_tensors = run(fleet, "sample", sample_args(spec, steps=2), context_tensors(encoded))
    by_digest = run(fleet, "sample", sample_args(spec, steps=2, positive_digest=digests[0], negative_digest=digests[1]))
    for name in ("video_latent", "audio_latent"):
        assert torch.equal(by_digest.tensors[name], by_tensors.tensors[name]), name


def test_a_digest_the_fleet_does_not_hold_fails_with_context_missing_and_the_api_resends_once(fleet, spec, monkeypatch):
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT, NEGATIVE]})
    unknown = "f" * 64  # as after a fleet restart: the client kept the contexts, the ranks did not
    with pytest.raises(FleetError, match=CONTEXT_MISSING) as info:
        run(fleet, "sample", sample_args(spec, steps=2, positive_digest=unknown, negative_digest=encoded.fields["digests"][1]))
    assert info.value.kind == "input_error" and "positive" in str(info.value)
    expected = run(fleet, "sample", sample_args(spec, steps=2), context_tensors(encoded))

    sent = []
    real_run = api.run
    monkeypatch.setattr(api, "run", lambda op, args, tensors=None, **kw: sent.append((op, sorted(tensors or {}))) or real_run(op, args, tensors, **kw))
    api.configure(address=str(fleet))
    try:
        (pv, pa), (nv, na) = contexts_of(encoded, 0), contexts_of(encoded, 1)
        video, audio = api.sample(
            spec, api.PromptEncoding(pv, pa, unknown), api.PromptEncoding(nv, na, encoded.fields["digests"][1]),
            width=96, height=64, num_frames=9, frame_rate=24.0, seed=7, steps=2,
            video_guidance=api.Guidance(3.0, 1.0, 0.7, 3.0, stg_blocks=(1,)), audio_guidance=api.Guidance(7.0, 1.0, 0.7, 3.0, stg_blocks=(1,)),
        )  # fmt: skip
        # Now the fleet holds the resent contexts under the digest: a second job sends none.
        api.sample(spec, api.PromptEncoding(pv, pa, unknown), api.PromptEncoding(nv, na, encoded.fields["digests"][1]),
                   width=96, height=64, num_frames=9, seed=7, steps=1)  # fmt: skip
    finally:
        api.configure()
    contexts = [f"{p}_{m}_context" for p in ("negative", "positive") for m in ("audio", "video")]
    assert sent == [("sample", []), ("sample", contexts), ("sample", [])]
    assert torch.equal(video, expected.tensors["video_latent"]) and torch.equal(audio, expected.tensors["audio_latent"])


def test_a_float32_model_returns_float32_contexts(fleet, spec):
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT], "dtype": "float32"})
    assert encoded.tensors["video_context_0"].dtype == torch.float32 == encoded.tensors["audio_context_0"].dtype
    assert encoded.fields["digests"] != run(fleet, "encode", {"spec": spec, "prompts": [PROMPT]}).fields["digests"]


def test_stage1_guidance_plan_at_two_ranks_equals_the_in_process_stage_bf16(fleet, spec):
    """Two guidance groups of one rank each (the passes of a step split over the ranks) reproduce the
    one-process stage 1 bitwise, as the sp plan does in the test above."""
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT, NEGATIVE]})
    stage1 = run(fleet, "sample", sample_args(spec, parallel="guidance"), context_tensors(encoded))

    loader = ModelLoader(ModelSpec.from_wire(spec), "cpu", torch.bfloat16)
    positive, negative = encode_prompts(loader, [PROMPT, NEGATIVE])
    params = stage1_params(SampleRequest.from_wire(sample_args(spec)), layer_count=2)
    video, audio = sample_stage1(loader, params, positive, negative)
    assert (stage1.fields["guidance_groups"], stage1.fields["sp_degree"]) == (2, 1)
    for name, ours, fleet_tensor in (("video", video, stage1.tensors["video_latent"]), ("audio", audio, stage1.tensors["audio_latent"])):
        diff = (ours - fleet_tensor).abs().max().item()
        assert diff == 0.0, f"stage-1 {name} under 2 guidance groups differs from the one-process stage by {diff}"


def test_warm_second_load_reads_nothing_from_disk(fleet, spec):
    first = run(fleet, "load", {"spec": spec})
    second = run(fleet, "load", {"spec": spec})
    assert first.fields["bytes_read"] > 0
    assert second.fields["bytes_read"] == first.fields["bytes_read"], "a warm load must read 0 more bytes"
    assert "transformer" in second.fields["components"]


def test_cancel_during_stage1_stops_every_rank_and_the_next_job_runs(fleet, spec):
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT, NEGATIVE]})
    steps_seen = []
    with pytest.raises(FleetCancelled, match=r"cancelled at stage1 step \d+/30") as info:
        run(
            fleet, "sample", sample_args(spec, steps=30), context_tensors(encoded),
            on_progress=steps_seen.append, should_cancel=lambda: len([e for e in steps_seen if e["stage"] == "stage1"]) >= 2,
        )  # fmt: skip
    stopped_at = int(str(info.value).split("step ")[1].split("/")[0])
    assert stopped_at <= 3, f"asked to cancel after step 2, the ranks ran on to step {stopped_at}"
    result = run(fleet, "sample", sample_args(spec, steps=2), context_tensors(encoded))
    assert result.tensors["video_latent"].shape == (1, 128, 2, 2, 3)
    with FleetClient.connect(str(fleet), autostart=False) as client:
        assert client.status()["fleet_restarts"] == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_frames": 120}, "got 120; use 121"),
        ({"width": 100}, "multiple of 32"),
        ({"parallel": "everything"}, "must be one of auto, sp, guidance, hybrid"),
        ({"video_guidance": {"cfg_scale": 3.0, "stg_blocks": [40]}}, "outside this model's 2 transformer blocks"),
        ({"width": 8192, "height": 8192, "num_frames": 2001}, r"this job needs about [\d.]+ GiB on cpu .* but only [\d.]+ GiB is free"),
    ],
)
def test_bad_sample_input_is_refused_before_any_work_and_fleet_stays_warm(fleet, spec, change, message):
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT, NEGATIVE]})
    with pytest.raises(FleetError, match=message) as info:
        run(fleet, "sample", sample_args(spec, **change), context_tensors(encoded))
    assert info.value.kind == "input_error"
    with FleetClient.connect(str(fleet), autostart=False) as client:
        assert client.status()["fleet_restarts"] == 0


def test_bad_model_files_are_refused_with_the_file_named(fleet, spec, bundle, tmp_path):
    not_ltx = tmp_path / "not_ltx.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, str(not_ltx))
    foreign_lora = tmp_path / "foreign_lora.safetensors"
    save_file({"diffusion_model.some.other.layer.lora_A.weight": torch.zeros(4, 8), "diffusion_model.some.other.layer.lora_B.weight": torch.zeros(8, 4)}, str(foreign_lora))
    cases = [
        ({**spec, "checkpoint_path": str(tmp_path / "missing.safetensors")}, "missing.safetensors"),
        ({**spec, "checkpoint_path": str(not_ltx)}, "not_ltx.safetensors"),
        ({**spec, "distilled_lora": str(foreign_lora)}, "foreign_lora.safetensors"),
    ]
    for bad_spec, named in cases:
        with pytest.raises(FleetError, match=named) as info:
            run(fleet, "load", {"spec": bad_spec})
        assert info.value.kind == "input_error"
    assert run(fleet, "load", {"spec": spec}).fields["layers"] == 2


def test_tdp_refuses_pure_noise_unless_forced(fleet, spec):
    encoded = run(fleet, "encode", {"spec": spec, "prompts": [PROMPT, NEGATIVE]})
    stage1 = run(fleet, "sample", sample_args(spec, steps=1), context_tensors(encoded))
    tensors = {**stage1.tensors, "positive_video_context": encoded.tensors["video_context_0"], "positive_audio_context": encoded.tensors["audio_context_0"]}
    with pytest.raises(FleetError, match="refuses to start from pure noise"):
        run(fleet, "upscale", {"spec": spec, "sigmas": [1.0, 0.5, 0.0]}, tensors)
    forced = run(fleet, "upscale", {"spec": spec, "sigmas": [1.0, 0.0], "force_from_noise": True, "tiles": [2, 1], "overlap": 1}, tensors)
    assert forced.fields["tiling"].startswith("frames 1")
    assert torch.equal(forced.tensors["audio_latent"], stage1.tensors["audio_latent"])


def test_generate_writes_an_h264_aac_mp4_on_the_tiny_bundle_and_says_so(tmp_path):
    completed = run_generate(tmp_path, "one")
    assert "embedded tiny LTX-2 bundle" in completed.stderr
    # The CLI named the bundle; the fleet's ranks wrote it into the cache.
    assert (tmp_path / "cache" / EMBEDDED_BUNDLE_FOLDER / "ltx-2-tiny.safetensors").is_file()
    facts = media.probe(tmp_path / "one.mp4")
    assert facts["video"] == {"codec": "h264", "width": 192, "height": 128, "frames": 9}
    assert facts["audio"]["codec"] == "aac" and facts["audio"]["sample_rate"] == 24000
    dump = load_file(str(tmp_path / "one.safetensors"))
    assert set(dump) == {"stage1_video", "stage1_audio", "stage2_video", "stage2_audio", "frames", "waveform"}
    assert dump["frames"].dtype == torch.uint8 and dump["frames"].shape == (9, 128, 192, 3)
    assert torch.equal(dump["stage2_audio"], dump["stage1_audio"])


@pytest.mark.slow
def test_debug_dump_is_identical_at_1_2_and_4_cpu_ranks(tmp_path):
    dumps = {}
    for ranks in (1, 2, 4):
        run_generate(tmp_path, f"r{ranks}", "--tiles", "1x1", cpu_ranks=ranks)
        dumps[ranks] = load_file(str(tmp_path / f"r{ranks}.safetensors"))
    for ranks in (2, 4):
        for name, tensor in dumps[1].items():
            diff = (tensor.float() - dumps[ranks][name].float()).abs().max().item()
            assert diff == 0.0, f"{name} at {ranks} ranks differs from 1 rank by {diff}"


def test_every_job_logs_its_disk_reads_and_status_reports_weight_memory_per_rank(fleet, spec):
    logs = []
    run(fleet, "unload", {})
    run(fleet, "load", {"spec": spec}, on_log=logs.append)
    run(fleet, "encode", {"spec": spec, "prompts": [PROMPT]}, on_log=logs.append)  # first use of Gemma reads it
    run(fleet, "encode", {"spec": spec, "prompts": [PROMPT]}, on_log=logs.append)
    # Rank 0's line, alone or collapsed with rank 1's identical one.
    cold = [line for line in logs if line.startswith(("[rank 0] load:", "[rank 0-1] load:"))]
    warm = [line for line in logs if line.startswith(("[rank 0] encode:", "[rank 0-1] encode:"))]
    assert cold and float(cold[0].split(": ")[1].split(" MiB")[0]) > 1.0, logs
    assert len(warm) == 2 and "0.0 MiB read from disk" in warm[1], logs
    encoded_at = time.time()
    with FleetClient.connect(str(fleet), autostart=False) as client:
        ranks = ranks_reported_after(client, encoded_at)
    shards = [rank["weights"]["clean_shard_bytes"] for rank in ranks]
    working = [rank["weights"]["working_bytes"] for rank in ranks]
    assert working[0] == working[1] > 0, "every rank holds the whole working transformer"
    assert abs(shards[0] - shards[1]) < 0.2 * sum(shards), f"the clean copy is split about evenly: {shards}"
    assert 0.95 * working[0] <= sum(shards) <= working[0] * 1.0001, "the clean shards add up to one transformer"
    # Host memory: the registry keeps only the state dicts of the small components (on CPU ranks
    # exactly their tensors), not the resident transformer or Gemma: both are dropped once built.
    for rank in ranks:
        host, other = rank["weights"]["host_copies_bytes"], rank["weights"]["other_components_bytes"]
        assert host == other > 0, (host, other, working[0])


def test_sp_exchange_stays_on_torch_distributed_unless_the_ipc_kernel_is_asked_for(monkeypatch):
    from mgpu_backend.ltx import parallelize

    class GroupOn:  # a Comm's backend as torch.distributed names it
        def __init__(self, backend):
            self.backend = backend

    installed = []
    monkeypatch.setattr(parallelize, "install_fast_all_to_all", lambda comm, device: installed.append(comm) or "cuda-ipc")
    monkeypatch.delenv("MGPU_ALL_TO_ALL", raising=False)
    nccl, gloo = GroupOn("nccl"), GroupOn("gloo")
    assert parallelize.sp_all_to_all(nccl, torch.device("cuda", 0)).startswith("torch.distributed (NCCL;")
    # Ranks sharing one GPU exchange over gloo: the log line says so, not NCCL.
    assert parallelize.sp_all_to_all(gloo, torch.device("cuda", 0)).startswith("torch.distributed (GLOO;")
    assert installed == []
    monkeypatch.setenv("MGPU_ALL_TO_ALL", "ipc")
    assert parallelize.sp_all_to_all(nccl, torch.device("cuda", 0)) == "cuda-ipc"
    assert installed == [nccl]
