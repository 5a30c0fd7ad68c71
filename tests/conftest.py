"""What every test module shares: the tiny bundles and their spec, fleets of CPU ranks, the fake api,
ComfyUI's ``comfy`` for the tests of its own model code, and the rule that, where CI says every test
must run, a skip fails.

``bundle`` is the tiny bundle of ``bundle_version`` (LTX-2.0 unless a module overrides it, for
instance with a fixture parametrised over ``tiny.VERSIONS``); each version's bundle is written once
per session. ``spec`` is its wire spec. ``fleet_of(cpu_ranks, *serve_arguments, env=...)`` starts a
fleet server for the module (one per distinct set of arguments, stopped when the module is done);
``fleet`` is the module's two-rank fleet.

CI sets ``MGPU_REQUIRE_ALL=1`` for the runs whose environment has everything (ComfyUI v0.20.1 and its
requirements for the drop-in model and end-to-end tests): a test that would skip there, because an
environment variable or a package went missing, fails instead, with its skip reason. GPU tests
(marked ``gpu``) are left out of those runs by marker, not turned into failures.

oneDNN is capped below AMX (``ONEDNN_MAX_CPU_ISA``) and MKL runs in strict conditional numerical
reproducibility (``MKL_CBWR``) in this process and, by inheritance, in every rank, fleet server and
CLI it starts: see ``ONEDNN_ROW_COUNT_INDEPENDENT_ISA`` and ``MKL_ROW_COUNT_INDEPENDENT_MODE``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mgpu_backend.bundles import tiny
from mgpu_backend.ltx import api
from tests.fleet_harness import module_fleet
from tests.helpers import ApiRecorder

REQUIRE_ALL_VARIABLE = "MGPU_REQUIRE_ALL"

ONEDNN_ROW_COUNT_INDEPENDENT_ISA = "AVX512_CORE_BF16"
"""oneDNN's AMX bf16 matmul (Xeon 4th generation and later) picks its kernel by the row count of
the call, and the row results differ between those kernels: a feed-forward row of a 24-token SP
shard rounded differently from the same row in one process's 48-token call (the LTX-2.0 stage 2
0.03 off at 2 and 4 ranks). Below AMX a row's result does not depend on the rows beside it (at the
model's shapes; a one-row call aside), so the bitwise comparisons of ranks with one process hold on
every CPU; on CPUs without AMX the cap changes nothing. Set before oneDNN's first matmul, which
reads it once (importing torch runs none)."""
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_ROW_COUNT_INDEPENDENT_ISA)

MKL_ROW_COUNT_INDEPENDENT_MODE = "AUTO,STRICT"
"""MKL's float32 ``sgemm`` (PyTorch's CPU float32 linear layers) also picks its kernel by the row
count of the call unless in strict CNR mode: on an AVX-512 Xeon a row of a 12-token shard of
ComfyUI's tiny LTX-2.3 feed-forward output projection (512 to 128) rounds differently from the same
row in one process's 48-token call (outputs 1.2e-6 off at SP degree 4, one thread a rank; 24-token
shards happened to match). ``STRICT`` makes a row's result independent of the rows beside it;
``AUTO`` keeps the CPU's own instruction set. Set before MKL's first call, which
reads it once (importing torch runs none)."""
os.environ.setdefault("MKL_CBWR", MKL_ROW_COUNT_INDEPENDENT_MODE)


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI's ``comfy`` from COMFYUI_DIR on the CPU, as a rank imports it (tests/comfy_model_cases.py),
    or a skip that says what is missing."""
    from tests import comfy_model_cases

    return comfy_model_cases.import_comfy_or_skip()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get(REQUIRE_ALL_VARIABLE) == "1" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped where {REQUIRE_ALL_VARIABLE}=1 demands every test run: {reason}"


@pytest.fixture
def fake_api(monkeypatch):
    """Every fleet-facing api function replaced; a test that reaches the fleet by mistake fails."""
    recorders = {name: ApiRecorder(getattr(api, name)) for name in ("configure", "load", "encode", "sample", "upscale", "decode", "unload", "restart", "status")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(api, name, recorder)
    return recorders


@pytest.fixture(scope="session")
def tiny_bundle_of(tmp_path_factory) -> Callable[[str], tiny.TinyBundle]:
    """``tiny_bundle_of(version)``: the tiny bundle of that model version, written once per session."""
    made: dict[str, tiny.TinyBundle] = {}

    def bundle_of(version: str) -> tiny.TinyBundle:
        if version not in made:
            made[version] = tiny.make_tiny_bundle(tmp_path_factory.mktemp(f"tiny-ltx{version}"), version=version)
        return made[version]

    return bundle_of


@pytest.fixture(scope="module")
def bundle_version() -> str:
    """The model version of the module's ``bundle``; a module overrides it to test another, or each."""
    return "2.0"


@pytest.fixture(scope="module")
def bundle(tiny_bundle_of, bundle_version) -> tiny.TinyBundle:
    return tiny_bundle_of(bundle_version)


@pytest.fixture(scope="module")
def spec(bundle) -> dict:
    """The tiny bundle's spec as the fleet's jobs take it (full checkpoint, Gemma, upsampler, LoRA)."""
    return bundle.spec().to_json()


@pytest.fixture(scope="module")
def fleet_of(request, tmp_path_factory) -> Iterator[Callable[..., Path]]:
    """``fleet_of(cpu_ranks=2, *serve_arguments, env=None, own_tmpdir=False)``: the socket of a fleet
    server with those ranks and ``serve`` arguments, started on first use and stopped with the module."""
    started: dict[tuple, Path] = {}
    module = request.module.__name__.rsplit(".", 1)[-1]
    with contextlib.ExitStack() as stack:

        def fleet_of(cpu_ranks: int = 2, *serve_arguments: str, env: dict | None = None, own_tmpdir: bool = False) -> Path:
            key = (cpu_ranks, serve_arguments, tuple(sorted((env or {}).items())), own_tmpdir)
            if key not in started:
                server = module_fleet(tmp_path_factory, f"{module}-{cpu_ranks}", cpu_ranks, *serve_arguments, env=env, own_tmpdir=own_tmpdir)
                started[key] = next(server)
                stack.callback(server.close)  # runs module_fleet's finally: the server stops
            return started[key]

        yield fleet_of


@pytest.fixture(scope="module")
def fleet(fleet_of) -> Path:
    """The module's fleet of two CPU ranks."""
    return fleet_of(2)
