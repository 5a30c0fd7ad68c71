"""Optional CUDA kernels. Nothing here is required: every kernel has a torch.distributed fallback.

``install_fast_all_to_all(comm)`` (collective) puts a ``Comm``'s all-to-all, the sequence-parallel
token/head exchange, on a CUDA kernel that writes straight into the peers' buffers over CUDA IPC,
when every rank of the group can build and open it; otherwise the Comm keeps torch.distributed and
the log says why. The kernel is built just in time (``mgpu_kernels.build``) and never needed.
"""

from mgpu_kernels.build import KernelUnavailable
from mgpu_kernels.install import CUDA_IPC, TORCH_DISTRIBUTED, install_fast_all_to_all, uninstall_fast_all_to_all
from mgpu_kernels.ipc_all_to_all import AllToAllTimeout, ExchangeLayout

__all__ = [
    "CUDA_IPC",
    "TORCH_DISTRIBUTED",
    "AllToAllTimeout",
    "ExchangeLayout",
    "KernelUnavailable",
    "install_fast_all_to_all",
    "uninstall_fast_all_to_all",
]
