"""What every test module shares: ComfyUI's ``comfy`` for the tests of its own model code, and the rule
that, where CI says every test must run, a skip fails.

CI sets ``MGPU_REQUIRE_ALL=1`` for the runs whose environment has everything (ComfyUI v0.20.1 and its
requirements for the drop-in model and end-to-end tests): a test that would skip there, because an
environment variable or a package went missing, fails instead, with its skip reason. GPU tests
(marked ``gpu``) are left out of those runs by marker, not turned into failures.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ALL_VARIABLE = "MGPU_REQUIRE_ALL"


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
