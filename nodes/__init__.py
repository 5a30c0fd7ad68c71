"""The ComfyUI nodes of comfyui-mgpu: thin wrappers that validate, call ``mgpu_backend.ltx.api`` and map
ComfyUI types. No distributed logic lives here.

Loaded only relatively, through the pack's root ``__init__`` (ComfyUI has a top-level ``nodes``
module of its own, so this package must never be importable as ``nodes``). ComfyUI modules are
imported lazily inside functions, so every node class also loads, and is tested, without ComfyUI.
"""

from .comfy_model_nodes import MGPUCheckpointLoader, MGPUDiffusionModelLoader
from .decode_nodes import DistributedVAEDecode
from .model_nodes import LoadCheckpointMGPU, MGPUFleetControl
from .sampling_nodes import SPSampler, TDPUpscale
from .text_nodes import MGPUTextEncode

NODE_CLASS_MAPPINGS = {
    "MGPULoadCheckpoint": LoadCheckpointMGPU,
    "MGPUTextEncode": MGPUTextEncode,
    "MGPUSPSampler": SPSampler,
    "MGPUTDPUpscale": TDPUpscale,
    "MGPUDistributedVAEDecode": DistributedVAEDecode,
    "MGPUFleetControl": MGPUFleetControl,
    "MGPUCheckpointLoader": MGPUCheckpointLoader,
    "MGPUDiffusionModelLoader": MGPUDiffusionModelLoader,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "MGPULoadCheckpoint": "Load Checkpoint MGPU",
    "MGPUTextEncode": "MGPU Text Encode",
    "MGPUSPSampler": "SP Sampler",
    "MGPUTDPUpscale": "TDP Upscale",
    "MGPUDistributedVAEDecode": "Distributed VAE Decode",
    "MGPUFleetControl": "MGPU Fleet Control",
    "MGPUCheckpointLoader": "Load Checkpoint (MGPU fleet)",
    "MGPUDiffusionModelLoader": "Load Diffusion Model (MGPU fleet)",
}
