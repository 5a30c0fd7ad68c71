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

# What users type into ComfyUI's node search, besides the display name: the model's names (every node
# of the pack is for LTX-2 and LTX-2.3), the pack's, and what the node does in ComfyUI's own words.
# ComfyUI v0.20.1 serves a node's SEARCH_ALIASES in /object_info as ``search_aliases``; its
# frontend's search matches them with the name and display name.
MODEL_ALIASES = ["ltx", "ltx-2", "ltx-2.3", "ltx2", "ltxv", "ltx video", "lightricks", "mgpu", "multi-gpu", "multi gpu"]
SEARCH_ALIASES = {
    "MGPULoadCheckpoint": ["ltx loader", "ltx checkpoint", "load ltx-2", "load ltx-2.3", "checkpoint loader", "load model", "lora", "upscaler", "gemma"],
    "MGPUTextEncode": ["ltx text encode", "ltx prompt", "text encode", "prompt", "conditioning", "gemma"],
    "MGPUSPSampler": ["ltx sampler", "ltx-2 sampler", "sampler", "text to video", "image to video", "sequence parallel", "generate video"],
    "MGPUTDPUpscale": ["ltx upscale", "ltx-2 upscale", "upscale", "upscaler", "latent upscale", "stage 2", "tiled data parallel", "refine"],
    "MGPUDistributedVAEDecode": ["ltx decode", "ltx vae decode", "vae decode", "decode", "video decode", "audio decode"],
    "MGPUFleetControl": ["ltx fleet", "fleet", "unload models", "free memory", "restart", "gpu status"],
    "MGPUCheckpointLoader": ["load checkpoint", "checkpoint loader", "ltx checkpoint", "load model", "sequence parallel", "drop-in", "model"],
    "MGPUDiffusionModelLoader": ["load diffusion model", "unet loader", "ltx diffusion model", "load model", "sequence parallel", "drop-in"],
}
# A node missing from the table still gets the model's names (tests/test_frontend.py asks for its own).
for _name, _node_class in NODE_CLASS_MAPPINGS.items():
    _node_class.SEARCH_ALIASES = [*MODEL_ALIASES, *SEARCH_ALIASES.get(_name, [])]
