"""CUDA-graph replay of the transformer blocks of ComfyUI's LTX model, one graph per input signature.

Why: at the token counts of ComfyUI's LTX-2.3 templates a rank's forward is bound by kernel launches
and Python, not by the GPU. Measured on an H200 with ComfyUI's own 22B model (bench/comfy_drop_in.py):
stage 1 at 3520 video tokens takes 370 ms, and one rank's shard at SP 2/4/8 still 369/368/343 ms; so
sequence parallelism only pays once the launches are gone. ComfyUI's whole forward cannot be
captured (it builds positions and timestep tables from host tensors on every call), but its
``_process_transformer_blocks`` can: every input is already on the GPU when the blocks start.

What it does: ``capture_blocks(model)`` replaces ``_process_transformer_blocks`` on one model
instance (whatever is set there: the sequence-parallel plan's sharded blocks included, so SP's NCCL
exchanges are recorded in the graph) by a wrapper that, per signature (shape, dtype and device of every
tensor, the structure of the arguments, the honoured transformer options), warms the blocks up twice
on a side stream, records one ``torch.cuda.CUDAGraph`` (all graphs of one model share one memory
pool), and from then on copies the call's tensors into the static inputs, replays, and returns clones
of the static outputs. Same kernels, same order: the results are the eager ones, bit for bit.

When it stays eager (logged once per reason): not on CUDA, a group whose collectives run on the host
(gloo, the several-ranks-on-one-GPU correctness mode), or a capture that raised (that signature
stays eager; the ranks of the group agree first, so they all replay or all run eager). Host-side
work inside the blocks runs at capture only: the plan's cancel points do not fire during a
replayed call, so a cancel stops a captured forward at its end rather than in the middle.

This module never edits ComfyUI's code and talks to other ranks only through the ``Comm`` it is given.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from mgpu_backend.comfy_model.plan import MODEL_OPTIONS
from mgpu_backend.parallel.comm import Comm

log = logging.getLogger(__name__)

WARMUP_CALLS = 2


def _flatten(value, tensors: list[torch.Tensor]):
    """(structure, tensors): the structure names each tensor by its index and keeps the rest."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("tensor", len(tensors) - 1)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_flatten(item, tensors) for item in value))
    if isinstance(value, dict):
        return ("dict", tuple((key, _flatten(item, tensors)) for key, item in value.items()))
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    slots = getattr(type(value), "__slots__", None)
    if slots:  # ComfyUI's CompressedTimestep: a tensor and its sizes
        return ("object", type(value), tuple((name, _flatten(getattr(value, name), tensors)) for name in slots))
    raise TypeError(f"cannot capture blocks called with a {type(value).__name__}")


def _rebuild(structure, tensors: list[torch.Tensor]):
    kind = structure[0]
    if kind == "tensor":
        return tensors[structure[1]]
    if kind in ("list", "tuple"):
        items = [_rebuild(item, tensors) for item in structure[1]]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {key: _rebuild(item, tensors) for key, item in structure[1]}
    if kind == "value":
        return structure[1]
    _, cls, fields = structure
    obj = copy.copy(cls.__new__(cls))
    for name, item in fields:
        setattr(obj, name, _rebuild(item, tensors))
    return obj


def _signature(structure, tensors: list[torch.Tensor], options: dict):
    def hashable(node):
        kind = node[0]
        if kind == "tensor":
            tensor = tensors[node[1]]
            return ("tensor", tuple(tensor.shape), tensor.dtype, str(tensor.device))
        if kind in ("list", "tuple"):
            return (kind, tuple(hashable(item) for item in node[1]))
        if kind == "dict":
            return (kind, tuple((key, hashable(item)) for key, item in node[1]))
        if kind == "value":
            return node
        return ("object", node[1].__qualname__, tuple((name, hashable(item)) for name, item in node[2]))

    return hashable(structure), tuple((key, options.get(key)) for key in MODEL_OPTIONS)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: object  # the blocks' [video, audio] static outputs


class CapturedBlocks:
    """The wrapper ``capture_blocks`` sets on a model instance; ``remove`` undoes it."""

    def __init__(self, model: torch.nn.Module, group: Comm | None) -> None:
        self.model, self.group = model, group
        self.inner = model._process_transformer_blocks
        self.instance_attribute = model.__dict__.get("_process_transformer_blocks")
        self.graphs: dict = {}
        self.eager: dict = {}
        self.pool = None
        self.replays = 0
        model._process_transformer_blocks = self

    def remove(self) -> None:
        if self.instance_attribute is None:
            self.model.__dict__.pop("_process_transformer_blocks", None)
        else:
            self.model._process_transformer_blocks = self.instance_attribute
        self.graphs.clear()
        self.pool = None

    def __call__(self, x, context, attention_mask, timestep, pe, transformer_options={}, self_attention_mask=None, **kwargs):  # noqa: B006 - ComfyUI's signature
        arguments = {"x": x, "context": context, "attention_mask": attention_mask, "timestep": timestep, "pe": pe,
                     "self_attention_mask": self_attention_mask, "kwargs": kwargs}

        def eager():
            return self.inner(x, context, attention_mask, timestep, pe, transformer_options=transformer_options,
                              self_attention_mask=self_attention_mask, **kwargs)

        reason = self._reason_for_eager(x)
        if reason is not None:
            return self._eager(reason, eager)
        tensors: list[torch.Tensor] = []
        structure = _flatten(arguments, tensors)
        key = _signature(structure, tensors, transformer_options)
        if key in self.eager:
            return eager()
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, structure, tensors, transformer_options)
            if entry is None:
                return eager()
        for static, tensor in zip(entry.inputs, tensors):
            static.copy_(tensor)
        entry.graph.replay()
        self.replays += 1
        return [output.clone() for output in entry.outputs]

    def _reason_for_eager(self, x) -> str | None:
        video = x[0] if isinstance(x, (list, tuple)) else x
        if not isinstance(video, torch.Tensor) or video.device.type != "cuda":
            return "not on CUDA"
        if torch.is_grad_enabled():
            return "autograd is on"
        if self.group is not None and self.group.world_size > 1 and self.group.backend != "nccl":
            return f"the group's collectives run on the host ({self.group.backend})"
        return None

    def _eager(self, reason: str, eager):
        if reason not in self.eager:
            self.eager[reason] = True
            log.info("ComfyUI blocks run eagerly: %s", reason)
        return eager()

    def _capture(self, key, structure, tensors: list[torch.Tensor], options: dict) -> _Graph | None:
        device = next(tensor.device for tensor in tensors if tensor.device.type == "cuda")
        static = [tensor.clone() for tensor in tensors]
        arguments = _rebuild(structure, static)

        def call():
            return self.inner(arguments["x"], arguments["context"], arguments["attention_mask"], arguments["timestep"], arguments["pe"],
                              transformer_options=options, self_attention_mask=arguments["self_attention_mask"], **arguments["kwargs"])

        error = None
        entry = None
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_CALLS):
                    for source, target in zip(tensors, static):
                        target.copy_(source)
                    call()
            torch.cuda.current_stream(device).wait_stream(stream)
            for source, target in zip(tensors, static):
                target.copy_(source)
            graph = torch.cuda.CUDAGraph()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = call()
            entry = _Graph(graph, static, outputs)
        except Exception as exc:  # noqa: BLE001 - the signature then stays eager, on every rank alike
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        error = self._agree_on_failure(error, device)
        if error is not None:
            self.eager[key] = True
            log.warning("ComfyUI blocks at this input signature stay eager: capture failed (%s)", error)
            return None
        self.graphs[key] = entry
        log.info("ComfyUI blocks captured as a CUDA graph (%d graph(s) held)", len(self.graphs))
        return entry

    def _agree_on_failure(self, error: str | None, device: torch.device) -> str | None:
        if self.group is None or self.group.world_size == 1:
            return error
        failed = torch.tensor([1.0 if error else 0.0], device=device)
        failed = self.group.all_reduce_max(failed)
        if float(failed.item()) > 0:
            return error or "another rank of the group failed to capture"
        return None


def capture_blocks(model: torch.nn.Module, group: Comm | None) -> CapturedBlocks:
    """Replay ``model``'s transformer blocks as CUDA graphs (see the module docstring); returns the wrapper."""
    current = model.__dict__.get("_process_transformer_blocks")
    if isinstance(current, CapturedBlocks):
        current.remove()
    return CapturedBlocks(model, group)
