"""The pack's CUDA kernel package never collides with PyPI's ``kernels`` (Hugging Face's kernel hub).

Both are importable side by side, in ComfyUI's process (the pack loaded from its folder, as ComfyUI
loads it) and in the fleet's rank processes, with PyPI's ``kernels`` first on the path. The PyPI
package is downloaded from the package index at test time (``pip download --no-deps``); the test
skips only when the index cannot be reached.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mgpu_backend.fleet.client import FleetClient

from .fleet_harness import REPO, start_server, stop_server

# 0.11 accepts huggingface_hub 0.x and 1.x, so it imports beside transformers 4 and 5 alike.
PYPI_KERNELS = "kernels==0.11.0"


@pytest.fixture(scope="module")
def pypi_kernels_dir(tmp_path_factory) -> Path:
    download = tmp_path_factory.mktemp("kernels-wheel")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(download), PYPI_KERNELS],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    wheels = list(download.glob("kernels-*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"could not download {PYPI_KERNELS} from the package index: {done.stderr.strip()[-300:]}")
    site = tmp_path_factory.mktemp("kernels-site")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(site)
    return site


COMFYUI_SIDE = """
import importlib.util, json, sys
from pathlib import Path
import kernels  # PyPI's, imported first, as another node pack would
pack_dir = Path(sys.argv[1])
spec = importlib.util.spec_from_file_location("comfyui_mgpu_pack", pack_dir / "__init__.py", submodule_search_locations=[str(pack_dir)])
pack = importlib.util.module_from_spec(spec)
sys.modules["comfyui_mgpu_pack"] = pack
spec.loader.exec_module(pack)
import mgpu_kernels
import kernels as kernels_again
print(json.dumps({
    "kernels": kernels.__file__, "kernels_after_pack": kernels_again.__file__, "hub_api": hasattr(kernels, "get_kernel"),
    "mgpu_kernels": mgpu_kernels.__file__, "install": hasattr(mgpu_kernels, "install_fast_all_to_all"),
    "nodes": len(pack.NODE_CLASS_MAPPINGS),
}))
"""


def test_pypi_kernels_and_the_pack_import_side_by_side_in_comfyui_process(pypi_kernels_dir):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pypi_kernels_dir), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", COMFYUI_SIDE, str(REPO)], capture_output=True, text=True, env=env, timeout=300, cwd=pypi_kernels_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(seen["kernels"]).is_relative_to(pypi_kernels_dir) and seen["kernels"] == seen["kernels_after_pack"], seen
    assert seen["hub_api"], "the PyPI package's own API must stay reachable"
    assert Path(seen["mgpu_kernels"]).is_relative_to(REPO / "mgpu_kernels") and seen["install"], seen
    assert seen["nodes"] >= 6, seen


def test_pypi_kernels_and_the_pack_import_side_by_side_in_the_fleet(pypi_kernels_dir, tmp_path):
    tmp_path.chmod(0o700)
    socket_path = tmp_path / "fleet.sock"
    process = start_server(socket_path, 2, env={"PYTHONPATH": os.pathsep.join([str(pypi_kernels_dir), str(REPO)])})
    try:
        with FleetClient.connect(str(socket_path), autostart=False) as client:
            result = client.run("modules", {"names": ["kernels", "mgpu_kernels", "mgpu_backend.ltx.parallelize"]}, {})
    finally:
        stop_server(process)
    found = result.fields["modules"]
    assert result.fields["ranks_differing_from_rank_0"] == [], "every rank imports the same copies"
    assert Path(found["kernels"]).is_relative_to(pypi_kernels_dir), found
    assert Path(found["mgpu_kernels"]).is_relative_to(REPO / "mgpu_kernels"), found
    assert Path(found["mgpu_backend.ltx.parallelize"]).is_relative_to(REPO / "mgpu_backend"), found
