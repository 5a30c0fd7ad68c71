"""The Gemma encode path gives bitwise the same encodings under transformers 4.x and 5.x.

This file is also the script each interpreter runs: ``python tests/test_gemma_transformers.py OUT
CHECKPOINT GEMMA_ROOT...`` writes the LTX-2 text contexts of ``PROMPTS`` for every Gemma source (a
Hugging Face folder, ComfyUI's single file) to the safetensors file OUT, with the transformers version
in its metadata. The test runs it with this interpreter and with the one named by
``MGPU_OTHER_TRANSFORMERS_PYTHON`` (a Python whose transformers is the other major version: a venv
over this install with ``transformers>=4.52,<5`` beside a 5.x install, or ``transformers>=5`` beside a
4.x one; ``.ci/run`` makes the 4.x one), and compares the two files bit for bit. Without such a
second interpreter it is skipped, except in CI (``CI`` set to true), where that skip is a failure:
CI must run both versions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROMPTS = [
    "A fox steps through fresh snow at the edge of a pine forest.",
    "",
    "<start_of_turn>user Rain drums on a tin roof at 3:45<end_of_turn>",
]
REPO = Path(__file__).resolve().parents[1]
OTHER_PYTHON_ENV = "MGPU_OTHER_TRANSFORMERS_PYTHON"


def write_encodings(out: str, checkpoint_path: str, gemma_roots: list[str]) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    from mgpu_backend.ltx.loading import ModelLoader, ModelSpec
    from mgpu_backend.ltx.text import encode_prompts

    torch.set_num_threads(1)  # the same reduction order in every process
    tensors = {}
    for source, gemma_root in enumerate(gemma_roots):
        loader = ModelLoader(ModelSpec(checkpoint_path=checkpoint_path, gemma_root=gemma_root), "cpu", torch.bfloat16)
        for index, context in enumerate(encode_prompts(loader, PROMPTS)):
            tensors[f"source{source}.prompt{index}.video"] = context.video_context.contiguous()
            tensors[f"source{source}.prompt{index}.audio"] = context.audio_context.contiguous()
    save_file(tensors, out, metadata={"transformers": transformers.__version__})


if __name__ == "__main__":
    write_encodings(sys.argv[1], sys.argv[2], sys.argv[3:])
    sys.exit(0)


import pytest  # noqa: E402 - the script above runs without pytest's collection

from mgpu_backend.bundles import tiny  # noqa: E402
from mgpu_backend.ltx.gemma_file import gemma_folder_to_comfy_file  # noqa: E402


def _run(python: str, out: Path, bundle: tiny.TinyBundle, comfy_file: str) -> tuple[str, dict]:
    from safetensors import safe_open

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    completed = subprocess.run(
        [python, __file__, str(out), bundle.checkpoint_path, bundle.gemma_root, comfy_file],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, f"{python} failed:\n{completed.stderr[-4000:]}"
    with safe_open(str(out), framework="pt") as f:
        return f.metadata()["transformers"], {key: f.get_tensor(key) for key in f.keys()}


def _major(python: str) -> int:
    completed = subprocess.run(
        [python, "-c", "import transformers; print(transformers.__version__)"], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, f"{python} cannot import transformers:\n{completed.stderr[-2000:]}"
    return int(completed.stdout.strip().split(".")[0])


def skip_outside_ci(reason: str) -> None:
    """Skip with ``reason``; in CI, fail with it: there the comparison must run."""
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"CI must compare transformers 4 and 5, but: {reason}", pytrace=False)
    pytest.skip(reason)


def test_encodings_are_bitwise_equal_under_transformers_4_and_5(tmp_path):
    import torch

    other = os.environ.get(OTHER_PYTHON_ENV)
    if not other:
        wanted = "'transformers>=4.52,<5'" if _major(sys.executable) >= 5 else "'transformers>=5'"
        skip_outside_ci(
            f"set {OTHER_PYTHON_ENV} to a Python with the other transformers major version (python -m venv "
            f"--system-site-packages /tmp/tf-other && /tmp/tf-other/bin/pip install {wanted}; .ci/run does this)"
        )
    pythons = {_major(sys.executable): sys.executable, _major(other): other}
    if set(pythons) != {4, 5}:
        skip_outside_ci(f"{sys.executable} and {other} run transformers majors {sorted(pythons)}, not 4 and 5: nothing to compare")
    bundle = tiny.make_tiny_bundle(tmp_path / "tiny")
    comfy_file = gemma_folder_to_comfy_file(bundle.gemma_root, str(tmp_path / "gemma_3_tiny_comfy.safetensors"))
    version_4, encodings_4 = _run(pythons[4], tmp_path / "tf4.safetensors", bundle, comfy_file)
    version_5, encodings_5 = _run(pythons[5], tmp_path / "tf5.safetensors", bundle, comfy_file)
    assert version_4.startswith("4.") and version_5.startswith("5."), (version_4, version_5)
    assert sorted(encodings_4) == sorted(encodings_5) and len(encodings_4) == 2 * 2 * len(PROMPTS)
    assert not torch.equal(encodings_4["source0.prompt0.video"], encodings_4["source0.prompt2.video"])
    for key in sorted(encodings_4):
        a, b = encodings_4[key], encodings_5[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        diff = (a.float() - b.float()).abs().max()
        assert torch.equal(a, b), f"{key}: transformers {version_4} vs {version_5}, max abs diff {diff}"
    for index in range(len(PROMPTS)):  # and ComfyUI's file still encodes as its folder does, under both
        assert torch.equal(encodings_5[f"source0.prompt{index}.video"], encodings_5[f"source1.prompt{index}.video"])
