"""Build the CUDA IPC all-to-all library just in time and open it; say why not when it cannot be.

The source (``csrc/ipc_all_to_all.cu``) is compiled with ``torch.utils.cpp_extension.load`` into a
cache folder (``$MGPU_KERNEL_CACHE``, else ``~/.cache/comfyui-mgpu/kernels``, one subfolder per
torch and CUDA version) the first time a process asks for it; later processes find it built. It is
a plain C library with no torch headers, so the build takes seconds, and it is opened with ctypes.

Nothing here is required: ``load_library`` either returns the library or raises
``KernelUnavailable`` with a reason a user can act on. It never raises anything else and never
builds anything when CUDA or a CUDA toolkit is missing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "ipc_all_to_all.cu"
CACHE_ENV = "MGPU_KERNEL_CACHE"
_ABI_VERSION = 1
_EXTENSION_NAME = "mgpu_ipc_all_to_all"


class KernelUnavailable(RuntimeError):
    """The CUDA kernel cannot be used here; the message says why and what would change that."""


_loaded: ctypes.CDLL | KernelUnavailable | None = None


def cache_folder() -> Path:
    """Where the built library lives: one folder per torch and CUDA version, since either changes
    the compiler flags and the libraries it links against."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "comfyui-mgpu" / "kernels")
    return root / f"torch-{torch.__version__}-cuda-{torch.version.cuda}".replace("+", "_")


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    c_int, c_ulonglong, c_void_p = ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p
    c_int_p = ctypes.POINTER(ctypes.c_int)
    signatures = {
        "mgpu_a2a_abi_version": ([], c_int),
        "mgpu_a2a_max_ranks": ([], c_int),
        "mgpu_a2a_error_string": ([c_int], ctypes.c_char_p),
        "mgpu_a2a_allocate": ([c_int, c_ulonglong, ctypes.POINTER(c_void_p), ctypes.c_char_p], c_int),
        "mgpu_a2a_free": ([c_int, c_void_p], c_int),
        "mgpu_a2a_open": ([c_int, ctypes.c_char_p, ctypes.POINTER(c_void_p)], c_int),
        "mgpu_a2a_close": ([c_int, c_void_p], c_int),
        "mgpu_a2a_allocate_status": ([c_int, ctypes.POINTER(c_int_p), ctypes.POINTER(c_int_p)], c_int),
        "mgpu_a2a_free_status": ([c_int_p], c_int),
        "mgpu_a2a_launch": (
            [c_int, c_void_p, c_void_p, ctypes.POINTER(c_ulonglong), c_int, c_int, c_ulonglong, c_ulonglong,
             c_ulonglong, c_ulonglong, c_ulonglong, c_int_p],
            c_int,
        ),
        "mgpu_a2a_copy_out": ([c_int, c_void_p, c_void_p, c_void_p, c_ulonglong], c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    version = library.mgpu_a2a_abi_version()
    if version != _ABI_VERSION:
        raise KernelUnavailable(
            f"the cached all-to-all library speaks ABI {version}, this code expects {_ABI_VERSION}; "
            f"delete {cache_folder()} and run again"
        )
    return library


def _cudart_link_dirs(cuda_home: str) -> list[str]:
    """Folders holding libcudart.so to add to the link line: torch looks only in CUDA_HOME/lib64,
    which some toolkit installs (a versioned folder behind a wrapper nvcc, lib instead of lib64) lack."""
    home = Path(cuda_home)
    candidates = [home / "lib64", home / "lib", home / "targets" / "x86_64-linux" / "lib"]
    candidates += sorted(home.glob("cuda-*/lib*"))
    return [str(folder) for folder in candidates if (folder / "libcudart.so").exists()][:1]


def _why_not_buildable() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return "no CUDA toolkit found (nvcc); install one or set CUDA_HOME to it"
    if not cpp_extension.is_ninja_available():
        return "ninja is not installed; pip install ninja"
    return None


def load_library() -> ctypes.CDLL:
    """The built all-to-all library, built first if needed; the outcome is remembered per process.

    Raises ``KernelUnavailable`` (and only that) when it cannot be had.
    """
    global _loaded
    if _loaded is None:
        _loaded = _build_and_open()
    if isinstance(_loaded, KernelUnavailable):
        raise _loaded
    return _loaded


def _build_and_open() -> ctypes.CDLL | KernelUnavailable:
    reason = _why_not_buildable()
    if reason is not None:
        return KernelUnavailable(reason)
    from torch.utils import cpp_extension

    folder = cache_folder()
    started = time.perf_counter()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = cpp_extension.load(
            name=_EXTENSION_NAME,
            sources=[str(SOURCE)],
            extra_cuda_cflags=["-O3", "-std=c++17"],
            extra_ldflags=[f"-L{folder}" for folder in _cudart_link_dirs(cpp_extension.CUDA_HOME)],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
        library = _declare(ctypes.CDLL(path))
    except KernelUnavailable as unavailable:
        return unavailable
    except Exception as error:  # noqa: BLE001 - any build failure means: use torch.distributed
        detail = " ".join(str(error).split())[-600:]
        return KernelUnavailable(f"building {SOURCE.name} in {folder} failed: {type(error).__name__}: {detail}")
    log.info("CUDA IPC all-to-all library ready: %s (%.1f s)", path, time.perf_counter() - started)
    return library
