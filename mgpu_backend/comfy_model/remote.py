"""The ComfyUI-process side of the ComfyUI-model engine: a stock ``MODEL`` whose denoiser runs on the fleet.

What it is: ``load_fleet_model`` builds ComfyUI's own LTX model object (``comfy.model_base.LTXAV``,
chosen by ComfyUI's model detection from the file's header, with ComfyUI's dtype rules) on the
``meta`` device, so it holds no weights, and wraps it in a ``FleetModelPatcher``. Everything a stock
graph does with a MODEL then happens in ComfyUI as usual: samplers, guiders, ``ModelSamplingLTXV``'s
object patch, the conditioning nodes' extra conds, LoRA loaders adding weight patches (their keys
match because the meta model has every weight name). Only the two calls that need the weights leave
the process: the diffusion model's forward (one fleet job per denoiser call) and its text-embedding
connector (``preprocess_text_embeds``, once per conditioning), both set on the instance, never by
editing ComfyUI's classes.

Weights and patches: when ComfyUI "loads" the patcher before sampling (``load``), the fleet loads the
file with ComfyUI's own loader (once; it stays resident) and receives the patcher's weight patches:
tensors once per content digest, then the patch set by digest, applied in the ranks by ComfyUI's own
patch code. The patcher that ComfyUI loaded last defines the weights, as in-process. What the ranks
cannot honour (a ControlNet, a patched attention function, a block replacement, an object patch
inside the diffusion model) is refused before sampling, naming the callable and where it came from.

This module runs inside ComfyUI and imports its modules lazily; it never computes with model weights.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from mgpu_backend.comfy_model import wire
from mgpu_backend.comfy_model.plan import MODEL_OPTIONS
from mgpu_backend.fleet.client import FleetError

log = logging.getLogger("comfyui-mgpu")

LOADERS = ("checkpoint", "diffusion_model")
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")

INERT_OPTIONS = frozenset({
    "cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "callbacks", "wrappers", "patches",
    "model_options", "prefetch_dynamic_vbars", "_inside_attn_wrapper", "transformer_index",
    "block", "block_index", "original_shape", "patches_replace", "rope_options", "total_blocks",
})
"""transformer_options that ComfyUI's LTX model code never reads inside the diffusion model: they
stay in ComfyUI's process (the callable ones among them are checked by ``check_model_options``)."""
PATCH_UPLOAD_BYTES = 512 << 20
"""Weight-patch tensors go to the fleet in buffers of at most this size (one job each)."""


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class UnsupportedModelPatch(ValueError):
    """A patch, option or input on the MODEL that the fleet's ranks cannot apply."""


@dataclass(frozen=True)
class FleetModelSpec:
    """Which file, loaded how: the same three things ComfyUI's stock loaders take."""

    comfy_dir: str
    path: str
    loader: str = "checkpoint"
    weight_dtype: str = "default"

    def __post_init__(self) -> None:
        if self.loader not in LOADERS:
            raise ValueError(f"loader must be one of {', '.join(LOADERS)}, got {self.loader!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if not os.path.isabs(self.path) or not os.path.isfile(self.path):
            raise ValueError(f"model file {self.path!r} does not exist (an absolute path to a .safetensors file)")

    def load_args(self) -> dict:
        return {"comfy_dir": self.comfy_dir, "path": self.path, "loader": self.loader, "weight_dtype": self.weight_dtype}


# -- what may travel ---------------------------------------------------------------------------------

def _origin(value) -> str:
    """'LTXVSomething (comfy_extras.nodes_x)' for a callable or object: what a user can find in a graph."""
    target = getattr(value, "__func__", value)
    owner = getattr(value, "__self__", None)
    name = getattr(target, "__qualname__", None) or type(value).__qualname__
    module = getattr(target, "__module__", None) or type(value).__module__
    if owner is not None and not isinstance(owner, type):
        name = f"{type(owner).__qualname__}.{getattr(target, '__name__', name)}"
    return f"{name} (from {module})"


def check_model_options(model_options: dict, object_patches: dict | None = None) -> None:
    """Refuse what would change the diffusion model's computation in a way the ranks cannot
    reproduce: block replacements, attention overrides, object patches inside the diffusion model."""
    options = model_options.get("transformer_options", {}) or {}
    for kind, replacements in (options.get("patches_replace") or {}).items():
        for where, patch in (replacements or {}).items():
            raise UnsupportedModelPatch(
                f"the MODEL carries a '{kind}' block replacement at {where} by {_origin(patch)}; the MGPU fleet runs "
                "ComfyUI's LTX blocks as they are and cannot apply it: remove that node, or use ComfyUI's own model loader"
            )
    override = options.get("optimized_attention_override")
    if override is not None:
        raise UnsupportedModelPatch(
            f"the MODEL's attention function is replaced by {_origin(override)}; the MGPU fleet uses its own attention "
            "over the GPUs and cannot apply it: remove that node, or use ComfyUI's own model loader"
        )
    for name, patch in (object_patches or {}).items():
        if name.startswith("diffusion_model"):
            raise UnsupportedModelPatch(
                f"the MODEL has '{name}' replaced by {_origin(patch)}; the MGPU fleet runs the diffusion model in its own "
                "processes and cannot apply it: remove that node, or use ComfyUI's own model loader"
            )


def transformer_options_to_send(options: dict) -> dict:
    """The part of a call's transformer_options the ranks honour; anything unknown is refused in words."""
    check_model_options({"transformer_options": options})
    sent = {}
    for key, value in options.items():
        if key in MODEL_OPTIONS:
            if not isinstance(value, bool):
                raise UnsupportedModelPatch(f"transformer option {key!r} must be True or False, got {value!r}")
            sent[key] = value
        elif key == "cond_or_uncond":
            sent[key] = [int(item) for item in value]
        elif key not in INERT_OPTIONS:
            raise UnsupportedModelPatch(
                f"the MODEL carries the transformer option {key!r} ({_origin(value) if callable(value) else type(value).__name__}), "
                "which the MGPU fleet does not apply; remove the node that sets it, or use ComfyUI's own model loader"
            )
    return sent


# -- the link to the fleet ---------------------------------------------------------------------------

class FleetLink:
    """One model file in the fleet, and the weight patches applied there now. Shared by every clone
    of a ``FleetModelPatcher`` of that file (they share the ComfyUI model object it hangs on)."""

    def __init__(self, spec: FleetModelSpec) -> None:
        self.spec = spec
        self.model_key: str | None = None
        self.info: dict = {}
        self.set_digest = ""
        self.sent_digests: set[str] = set()
        self.fleet_pid: int | None = None
        self.node_id: str | None = None
        self.last_rank_seconds: list[float] = []
        self.last_blocks = ""  # how the ranks ran the transformer blocks in the last call: "cuda graph" or "eager"
        self.last_timing: dict[str, float] = {}  # the last call's parts in seconds (CallTiming's keys), for the benchmarks
        self.kept = wire.KeptTensors(skip=("x", "timestep"))  # what the ranks keep between calls: text context, masks
        self.on_forward = None  # on_forward(event): each denoiser call's step and per-rank seconds, for the UI
        self._lock = threading.RLock()

    # The fleet connection of the process (nodes and CLI share it); imported here so that this
    # module stays importable without a fleet.
    @staticmethod
    def _run(op: str, args: dict, tensors: dict | None = None, should_cancel=None):
        from mgpu_backend.ltx import api

        return api.run(op, args, tensors, should_cancel=should_cancel)

    def _fleet_changed(self) -> bool:
        from mgpu_backend.ltx import api

        pid = api.fleet().server_pid
        if pid != self.fleet_pid:
            self.fleet_pid, self.model_key, self.set_digest, self.sent_digests = pid, None, "", set()
            self.kept.forget()
            return True
        return False

    def ensure_loaded(self) -> dict:
        with self._lock:
            self._fleet_changed()
            if self.model_key is None:
                result = self._run("comfy.load", self.spec.load_args())
                self.info = dict(result.fields)
                self.model_key = self.info["model_key"]
                self.set_digest = ""
                log.info("MGPU fleet holds %s (%s, ComfyUI %s, %s)", os.path.basename(self.spec.path), self.info.get("model_class"),
                         self.info.get("comfyui_version"), self.info.get("dtype"))
            return self.info

    def apply_patches(self, patches: dict) -> None:
        """Make the fleet's weights those of ``patches`` (a ModelPatcher's patch dict)."""
        start = time.perf_counter()
        try:
            entries, by_digest = wire.pack_patches(patches)
        except wire.UnsupportedValue as exc:
            raise UnsupportedModelPatch(f"a weight patch on the MODEL cannot be sent to the MGPU fleet: {exc}") from None
        set_digest = wire.patch_set_digest(entries) if entries else ""
        digested = time.perf_counter()
        with self._lock:
            self.ensure_loaded()
            if set_digest == self.set_digest:
                return
            sent_bytes = self._upload(by_digest)
            uploaded = time.perf_counter()
            self._run("comfy.patch_model", {"model_key": self.model_key, "set_digest": set_digest}, {"entries": wire.entries_tensor(entries)})
            self.set_digest = set_digest
        # The cold cost of a LoRA on the fleet, in its parts (docs/BENCHMARKS.md reads them from this line).
        log.info("MGPU fleet weight patches: %d entries, %d tensors; digests %.2f s, sent %.2f GB in %.2f s, patched on the ranks in %.2f s",
                 len(entries), len(by_digest), digested - start, sent_bytes / 1e9, uploaded - digested, time.perf_counter() - uploaded)

    def _upload(self, by_digest: dict[str, torch.Tensor]) -> int:
        """Send the tensors the ranks do not hold yet, in batches; the bytes sent."""
        batch: dict[str, torch.Tensor] = {}
        size = sent = 0
        for digest, tensor in by_digest.items():
            if digest in self.sent_digests:
                continue
            batch[digest] = tensor
            size += tensor.numel() * tensor.element_size()
            if size >= PATCH_UPLOAD_BYTES:
                self._upload_batch(batch)
                batch, sent, size = {}, sent + size, 0
        if batch:
            self._upload_batch(batch)
        return sent + size

    def _upload_batch(self, batch: dict[str, torch.Tensor]) -> None:
        index, blob = wire.pack_tensor_blob(batch)
        self._run("comfy.patches", {"index": index}, {"blob": blob})
        self.sent_digests.update(batch)

    def forward(self, call: dict, should_cancel=None) -> torch.Tensor:
        device = call["x"][0].device if isinstance(call["x"], (list, tuple)) else call["x"].device
        timing: dict[str, float] = {}
        with self._lock:
            if self._fleet_changed() or self.model_key is None:
                raise UnsupportedModelPatch("the MGPU fleet restarted during sampling; run the graph again")
            try:
                result = self._forward_once(call, should_cancel, timing)
            except FleetError as exc:
                if wire.KEPT_MISSING not in str(exc):
                    raise
                self.kept.forget()  # the ranks lost what they kept (a rank was replaced): send everything again
                result = self._forward_once(call, should_cancel, timing)
        self.last_rank_seconds = [float(seconds) for seconds in result.fields.get("rank_seconds", [])]
        self.last_blocks = str(result.fields.get("blocks", ""))
        started = time.perf_counter()
        out = wire.to_device(wire.unpack(result.fields["out"], wire.tensors_in_order(result.tensors, int(result.fields["count"]))), device)
        timing["output to the device"] = time.perf_counter() - started
        timing["rank 0's job"] = float(result.fields.get("job_seconds", 0.0))
        timing["the ranks' forward"] = max(self.last_rank_seconds, default=0.0)
        self.last_timing = timing
        return out

    def _forward_once(self, call: dict, should_cancel, timing: dict[str, float]):
        started = time.perf_counter()
        try:
            packed, tensors = wire.pack(call, kept=self.kept)
        except wire.UnsupportedValue as exc:
            raise UnsupportedModelPatch(f"a denoiser input cannot be sent to the MGPU fleet: {exc}") from None
        args = {"model_key": self.model_key, "set_digest": self.set_digest, "call": packed, "count": len(tensors)}
        sent = wire.tensors_by_name([tensor.detach().cpu() for tensor in tensors])
        packed_at = time.perf_counter()
        result = self._run("comfy.forward", args, sent, should_cancel)
        timing["inputs packed"] = packed_at - started
        timing["the fleet's job, round trip"] = time.perf_counter() - packed_at
        return result

    def text_embeds(self, context: torch.Tensor, unprocessed: bool) -> torch.Tensor:
        with self._lock:
            self.ensure_loaded()
            args = {"model_key": self.model_key, "set_digest": self.set_digest, "unprocessed": bool(unprocessed)}
            result = self._run("comfy.text_embeds", args, {"cross_attn": context.detach().cpu()})
        return result.tensors["out"].to(context.device)


# -- the ComfyUI objects -----------------------------------------------------------------------------





def _should_cancel() -> bool:
    import comfy.model_management

    return comfy.model_management.processing_interrupted()


def denoise_step(transformer_options: dict) -> tuple[int, int]:
    """(step, steps) of the sampler's schedule that this call belongs to (1-based; (0, 0) when unknown)."""
    schedule, current = transformer_options.get("sample_sigmas"), transformer_options.get("sigmas")
    if not isinstance(schedule, torch.Tensor) or not isinstance(current, torch.Tensor) or schedule.numel() < 2 or current.numel() == 0:
        return 0, 0
    matches = (schedule[:-1] == current.flatten()[0].to(schedule)).nonzero()
    return (int(matches[0]) + 1 if len(matches) else 0), schedule.numel() - 1


def _remote_forward(link: FleetLink):
    def forward(x, timestep, context=None, control=None, transformer_options=None, **kwargs):
        if control is not None:
            raise UnsupportedModelPatch("a ControlNet is applied to the MODEL; the MGPU fleet cannot apply it: remove it, or use ComfyUI's own model loader")
        call = {
            "x": x,
            "timestep": timestep,
            "context": context,
            "transformer_options": transformer_options_to_send(transformer_options or {}),
            "kwargs": kwargs,
        }
        from mgpu_backend.fleet.client import FleetCancelled

        start = time.perf_counter()
        try:
            out = link.forward(call, should_cancel=_should_cancel)
        except FleetCancelled:
            import comfy.model_management

            raise comfy.model_management.InterruptProcessingException() from None
        if link.on_forward is not None:
            step, steps = denoise_step(transformer_options or {})
            link.on_forward({"stage": "denoise", "step": step, "total": steps, "seconds": time.perf_counter() - start,
                             "rank_seconds": list(link.last_rank_seconds)})
        return out

    return forward


def _remote_text_embeds(link: FleetLink):
    def preprocess_text_embeds(context, unprocessed=False, **kwargs):
        if kwargs:
            raise UnsupportedModelPatch(f"preprocess_text_embeds got {sorted(kwargs)}, which the MGPU fleet does not know")
        return link.text_embeds(context, unprocessed)

    return preprocess_text_embeds


def fleet_patcher_class():
    """``FleetModelPatcher``: ComfyUI's ModelPatcher for a model whose weights live in the fleet.

    Built on first use, so that importing this module needs no ComfyUI. Loading it moves no weights:
    it brings the fleet's model and weight patches up to date and marks it loaded; unloading it
    only undoes the object patches (``model_sampling``) ComfyUI applied in this process.
    """
    global _FLEET_PATCHER
    if _FLEET_PATCHER is not None:
        return _FLEET_PATCHER
    import comfy.model_patcher
    import comfy.utils

    class FleetModelPatcher(comfy.model_patcher.ModelPatcher):
        FLEET_MODEL_SIZE = 1  # what ComfyUI's memory manager reserves for it here: the weights are elsewhere

        def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
            super().__init__(model, load_device, offload_device, size=self.FLEET_MODEL_SIZE, weight_inplace_update=weight_inplace_update)

        @property
        def fleet_link(self) -> FleetLink:
            return self.model.mgpu_fleet_link

        def model_size(self):
            return self.FLEET_MODEL_SIZE

        def memory_required(self, input_shape):
            return 0  # activations live in the fleet

        def model_mmap_residency(self, free=False):
            return 0, 0

        def pinned_memory_size(self):
            return 0

        def partially_unload_ram(self, ram_to_unload):
            return 0

        def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
            check_model_options(self.model_options, self.object_patches)
            link = self.fleet_link
            link.apply_patches(self.patches)
            self.model.device = device_to if device_to is not None else self.model.device
            self.model.model_lowvram = False
            self.model.lowvram_patch_counter = 0
            self.model.model_loaded_weight_memory = self.FLEET_MODEL_SIZE
            self.model.model_offload_buffer_memory = 0
            self.model.current_weight_patches_uuid = self.patches_uuid

        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            self.patch_model(device_to, load_weights=True, force_patch_weights=force_patch_weights)
            return 0

        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
            return 0

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            self.eject_model()
            if unpatch_weights:
                self.model.current_weight_patches_uuid = None
                self.model.model_loaded_weight_memory = 0
                if device_to is not None:
                    self.model.device = device_to
            for key in list(self.object_patches_backup):
                comfy.utils.set_attr(self.model, key, self.object_patches_backup[key])
            self.object_patches_backup.clear()

    _FLEET_PATCHER = FleetModelPatcher
    return FleetModelPatcher


_FLEET_PATCHER = None


def meta_model(path: str, weight_dtype: str = "default", loader: str = "checkpoint"):
    """ComfyUI's own model object for ``path`` (detected, dtype chosen, as its loaders do), on the
    meta device: every weight name and shape, no weight. Returns (model, model_config, header)."""
    import comfy.model_detection
    import comfy.model_management
    import comfy.utils

    from mgpu_backend.ltx.safetensors_header import read_header

    header = read_header(path, "model file", "Pick an LTX-2 .safetensors checkpoint or diffusion model.")
    metadata = header.metadata
    state_dict = {name: torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype], device="meta") for name, (dtype, shape) in header.tensors.items()
                  if dtype in SAFETENSORS_DTYPES}
    if loader == "checkpoint":
        prefix = comfy.model_detection.unet_prefix_from_state_dict(state_dict)
    else:  # a diffusion model file, with or without the checkpoint's prefix
        prefix = "model.diffusion_model."
        if not any(name.startswith(prefix) for name in state_dict):
            state_dict = {prefix + name: tensor for name, tensor in state_dict.items()}
    parameters = comfy.utils.calculate_parameters(state_dict, prefix)
    file_dtype = comfy.utils.weight_dtype(state_dict, prefix)
    load_device = comfy.model_management.get_torch_device()
    model_config = comfy.model_detection.model_config_from_unet(state_dict, prefix, metadata=metadata)
    if model_config is None:
        raise ValueError(f"{os.path.basename(path)}: ComfyUI does not recognise this file as a diffusion model")
    if model_config.quant_config is not None:
        raise ValueError(
            f"{os.path.basename(path)} holds quantized weights (ComfyUI's mixed-precision format); the MGPU fleet model loads "
            "bf16/fp16/fp32 files: use the bf16 checkpoint, or weight_dtype fp8_e4m3fn on it"
        )
    explicit = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3fn_fast": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}.get(weight_dtype)
    unet_dtype = explicit or comfy.model_management.unet_dtype(
        model_params=parameters, supported_dtypes=list(model_config.supported_inference_dtypes), weight_dtype=file_dtype)
    manual_cast_dtype = comfy.model_management.unet_manual_cast(unet_dtype, load_device, model_config.supported_inference_dtypes)
    model_config.set_inference_dtype(unet_dtype, manual_cast_dtype)
    model = model_config.get_model(state_dict, prefix, device=torch.device("meta"))
    return model, model_config, header


def load_fleet_model(spec: FleetModelSpec, on_forward=None):
    """A ComfyUI MODEL (``FleetModelPatcher``) for ``spec`` whose denoiser runs on the fleet.

    Loads the file into the fleet right away, so that a wrong file fails in the loader node.
    ``on_forward(event)`` hears of every denoiser call (step, total, seconds, per-rank seconds)."""
    import comfy.model_management

    model, _, _ = meta_model(spec.path, spec.weight_dtype, spec.loader)
    diffusion_model = model.diffusion_model
    link = FleetLink(spec)
    link.on_forward = on_forward
    info = link.ensure_loaded()
    expected = str(model.get_dtype_inference()).replace("torch.", "")
    if info.get("dtype") and info["dtype"] != expected:
        raise ValueError(
            f"the MGPU fleet computes {os.path.basename(spec.path)} in {info['dtype']} but this ComfyUI would use {expected}; "
            "start ComfyUI and the fleet on the same kind of device (both GPU, or --cpu with MGPU_CPU_RANKS)"
        )
    model.mgpu_fleet_link = link
    diffusion_model.forward = _remote_forward(link)
    diffusion_model.preprocess_text_embeds = _remote_text_embeds(link)
    patcher_class = fleet_patcher_class()
    return patcher_class(model, load_device=comfy.model_management.get_torch_device(),
                         offload_device=comfy.model_management.unet_offload_device())

