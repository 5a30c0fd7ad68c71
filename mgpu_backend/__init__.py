"""comfyui-mgpu backend: the out-of-process multi-GPU fleet that runs LTX-2 for the ComfyUI nodes.

Importable and usable without ComfyUI. Nothing here imports ComfyUI modules. The tree:

- ``fleet/``: the generic SPMD fleet (wire protocol, server, controller, rank loop, client, shared
  memory, job registry); it knows nothing of LTX-2.
- ``ltx/``: the LTX-2 side (model files, stages, the fleet's LTX-2 jobs and their Python API).
- ``parallel/``: the parallel techniques, each applied from outside to ltx-core's models.
- ``bundles/``: the tiny and full-size random LTX-2 bundles that tests and benchmarks run on.
- ``tools/``: the command line (serve, generate, doctor, queue).
"""

from pathlib import Path

__version__ = "0.1.0"

# The folder holding ``mgpu_backend``: the pack's folder in ComfyUI, or the checkout. Fleet processes
# get it on PYTHONPATH so they import this same copy.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
