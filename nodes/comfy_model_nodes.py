"""Drop-in loaders: ComfyUI's own LTX graphs on the MGPU fleet, with only the model loader swapped.

``Load Checkpoint (MGPU fleet)`` takes the place of ComfyUI's *Load Checkpoint* and gives the same
three outputs: a stock ``MODEL`` whose denoiser calls run on every GPU of the fleet (ComfyUI's own
LTX model code in each rank, sequence parallel over the GPUs, a batched call split over GPU groups),
ComfyUI's CLIP output as the stock loader gives it for an LTX checkpoint (none: LTX's text encoder is
Gemma, loaded by *LTXV Audio Text Encoder Loader*), and the checkpoint's video VAE, loaded here by
ComfyUI. ``Load Diffusion Model (MGPU fleet)`` does the same for *Load Diffusion Model*'s files and
weight-dtype choices. Samplers, guiders, LoRA loaders and LTX conditioning nodes take the MODEL
unchanged (``mgpu_backend.comfy_model.remote`` says how).

Thin: the nodes resolve file names in ComfyUI's folders and call ``remote.load_fleet_model``.
"""

from __future__ import annotations

import os

from mgpu_backend.comfy_model.remote import WEIGHT_DTYPES, FleetModelSpec

from .fleet_job import FleetJob, comfy_module

CATEGORY = "MGPU/LTX-2"
EMBEDDED_TINY = "(embedded tiny LTX-2.3, random weights)"
"""The first choice of both loaders: the pack's tiny LTX-2.3 checkpoint (every component, random
weights), written on first use; graphs that use it run anywhere, on CPU ranks too, with no download."""


def _comfy_dir() -> str:
    import folder_paths

    return os.path.dirname(os.path.abspath(folder_paths.__file__))


def _file_list(folder: str) -> list[str]:
    try:
        import folder_paths
    except ImportError:
        return []
    return folder_paths.get_filename_list(folder)


def _full_path(folder: str, name: str) -> str:
    if name == EMBEDDED_TINY:
        from mgpu_backend.bundles.tiny import default_tiny_bundle

        return str(default_tiny_bundle("2.3").checkpoint_path)
    import folder_paths

    return folder_paths.get_full_path_or_raise(folder, name)


def _choices(folder: str) -> list[str]:
    return [EMBEDDED_TINY, *_file_list(folder)]


_reporters: dict[str, FleetJob] = {}


def executing_node_id() -> str | None:
    """The id of the node ComfyUI is executing now (the sampler that calls the denoiser), if it says."""
    utils = comfy_module("comfy_execution.utils")
    context = utils.get_executing_context() if utils is not None and hasattr(utils, "get_executing_context") else None
    return getattr(context, "node_id", None)


def report_denoiser_call(event: dict) -> None:
    """Per-rank step time of one fleet denoiser call, on the sampler node and in the MGPU panel."""
    node_id = executing_node_id()
    reporter = _reporters.get(node_id)
    if reporter is None:
        reporter = _reporters[node_id] = FleetJob(node_id, "denoise on the MGPU fleet")
    reporter.report(event)


def checkpoint_vae(path: str, model_config):
    """The checkpoint's video VAE, as ComfyUI's checkpoint loader builds it, reading only its weights;
    ``model_config`` is the one ComfyUI's detection chose for the MODEL (its VAE key prefixes)."""
    import comfy.sd
    from safetensors import safe_open

    prefixes = tuple(model_config.vae_key_prefix)
    with safe_open(path, framework="pt", device="cpu") as f:
        metadata = f.metadata()
        vae_sd = {name[len(prefix):]: f.get_tensor(name) for name in f.keys() for prefix in prefixes if name.startswith(prefix)}
    if not vae_sd:
        return None
    vae_sd = model_config.process_vae_state_dict(vae_sd)
    return comfy.sd.VAE(sd=vae_sd, metadata=metadata)


class MGPUCheckpointLoader:
    """Load Checkpoint (MGPU fleet): ComfyUI's Load Checkpoint with the denoiser on the fleet."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL", "CLIP", "VAE")
    RETURN_NAMES = ("MODEL", "CLIP", "VAE")
    OUTPUT_TOOLTIPS = (
        "The LTX model for ComfyUI's samplers and guiders; each denoiser call runs on every GPU of the MGPU fleet.",
        "None for LTX checkpoints, as with ComfyUI's Load Checkpoint: load Gemma with LTXV Audio Text Encoder Loader.",
        "The checkpoint's video VAE, loaded in ComfyUI as its own loader does.",
    )
    FUNCTION = "load"
    DESCRIPTION = (
        "Drop-in for Load Checkpoint in ComfyUI's LTX-2 graphs: the same outputs, with the diffusion model spread over all GPUs "
        "of the MGPU fleet (sequence parallel; a batched cond+uncond call split over GPU groups). LoRA loaders, guiders, samplers "
        "and LTX conditioning nodes work on it unchanged."
    )

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "ckpt_name": (_choices("checkpoints"), {"default": EMBEDDED_TINY, "tooltip": (
                    "An LTX-2 checkpoint in ComfyUI's checkpoints folder (e.g. ltx-2.3-22b-dev.safetensors), or the embedded tiny "
                    "LTX-2.3 (random weights: noise out, runs anywhere)")}),
            },
            "optional": {
                "weight_dtype": (list(WEIGHT_DTYPES), {"default": "default", "advanced": True,
                                                       "tooltip": "The transformer's weight dtype in the fleet, as Load Diffusion Model offers it (default: the file's)."}),
            },
        }

    def load(self, ckpt_name, weight_dtype="default"):
        from mgpu_backend.comfy_model.remote import load_fleet_model

        path = _full_path("checkpoints", ckpt_name)
        model = load_fleet_model(FleetModelSpec(_comfy_dir(), path, "checkpoint", weight_dtype), on_forward=report_denoiser_call)
        return model, None, checkpoint_vae(path, model.model.model_config)


class MGPUDiffusionModelLoader:
    """Load Diffusion Model (MGPU fleet): ComfyUI's Load Diffusion Model with the denoiser on the fleet."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The LTX model for ComfyUI's samplers and guiders; each denoiser call runs on every GPU of the MGPU fleet.",)
    FUNCTION = "load"
    DESCRIPTION = "Drop-in for Load Diffusion Model in ComfyUI's LTX-2 graphs: the diffusion model spread over all GPUs of the MGPU fleet."

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "unet_name": (_choices("diffusion_models"), {"default": EMBEDDED_TINY, "tooltip": (
                    "An LTX-2 diffusion model in ComfyUI's diffusion_models folder, or the embedded tiny LTX-2.3 (random weights)")}),
                "weight_dtype": (list(WEIGHT_DTYPES), {"default": "default", "tooltip": "The transformer's weight dtype in the fleet, as Load Diffusion Model offers it."}),
            }
        }

    def load(self, unet_name, weight_dtype):
        from mgpu_backend.comfy_model.remote import load_fleet_model

        path = _full_path("diffusion_models", unet_name)
        loader = "checkpoint" if unet_name == EMBEDDED_TINY else "diffusion_model"  # the tiny bundle is one checkpoint file
        return (load_fleet_model(FleetModelSpec(_comfy_dir(), path, loader, weight_dtype), on_forward=report_denoiser_call),)
