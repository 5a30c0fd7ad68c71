"""comfyui-mgpu backend: the out-of-process multi-GPU fleet that runs LTX-2 for the ComfyUI nodes.

Importable and usable without ComfyUI. Nothing here imports ComfyUI modules.
"""

__version__ = "0.1.0"
