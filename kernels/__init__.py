"""Optional CUDA kernels. Nothing here is required: every kernel has a torch.distributed fallback."""
