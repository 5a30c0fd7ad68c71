"""One node's call into the fleet, wired to ComfyUI: progress bar, per-rank text, cancel, errors.

``FleetJob(node_id).call(api.sample, ...)`` hands the api function a ``progress`` callback and a
``should_cancel`` poll (and, to the denoising calls, a ``preview`` callback) and maps what comes back:

- each progress event advances a ``comfy.utils.ProgressBar`` (one per stage: denoising steps, decode
  tiles; a stage's bar never goes back), shows per-rank step times on the node
  (``PromptServer.send_progress_text``, where this ComfyUI has it) and is sent as an ``mgpu.status``
  event for the web panel, both only to the browser that queued the prompt;
- each live preview (a uint8 strip of the video being denoised, computed in the fleet) goes to the
  node through ComfyUI's own preview channel, ``ProgressBar.update_absolute(step, total, ("JPEG",
  image, max_size))``, as ComfyUI's samplers send theirs. It follows the user's preview setting:
  ``--preview-method none`` (or the per-prompt override) asks the fleet for none; auto, latent2rgb
  and taesd get the fleet's latent-to-RGB projection (the fleet has no TAESD of LTX-2's latent; it
  falls back the way ComfyUI does without the TAESD file). ``MGPU_PREVIEW_EVERY`` sets the rate
  (steps per preview; 0 off; default ``schema.PREVIEW_EVERY``);
- ComfyUI's interrupt (the Cancel button, ``POST /interrupt``) becomes a fleet cancel: every rank
  stops at the same step boundary and the fleet stays warm; the node then raises ComfyUI's
  ``InterruptProcessingException`` so ComfyUI reports an interrupt, not an error;
- a ``FleetError`` becomes a ``RuntimeError`` carrying the fleet's message; the failing rank's
  traceback goes to the log. A fleet server that went away mid-run is one of them: the client's
  ``FleetUnavailable``, whose message says to run again.

ComfyUI modules are imported lazily and only if present, so nodes run (and are tested) without
ComfyUI. Nothing here decides how work is split: that is the fleet's job.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import time
from collections.abc import Callable

from mgpu_backend.fleet.client import FleetCancelled, FleetError
from mgpu_backend.ltx.previews import side_by_side
from mgpu_backend.ltx.schema import PREVIEW_EVERY

log = logging.getLogger("comfyui-mgpu")

STATUS_EVENT = "mgpu.status"
TEXT_INTERVAL_SECONDS = 0.5
"""Per-rank text is throttled: a fast stage (decode tiles of a tiny model) would otherwise flood
the websocket with one message per tile."""


def comfy_module(name: str):
    """A ComfyUI module if this process runs inside ComfyUI, else None."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def prompt_server():
    server = comfy_module("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def prompt_client(server) -> str | None:
    """The websocket client that queued the running prompt: node text goes to it alone."""
    return getattr(server, "client_id", None)


def node_note(node_id, text: str) -> None:
    """A line of text on the node, for the prompt's own client only (where this ComfyUI shows
    progress text), and in the log."""
    log.info(text)
    server = prompt_server()
    if server is not None and hasattr(server, "send_progress_text") and node_id is not None:
        server.send_progress_text(text, node_id, sid=prompt_client(server))


PREVIEW_EVERY_VARIABLE = "MGPU_PREVIEW_EVERY"
DEFAULT_PREVIEW_SIZE = 512  # ComfyUI's --preview-size default, for a ComfyUI that does not say


def preview_setting() -> tuple[int, int]:
    """(steps per preview, largest preview side) from the user's ComfyUI settings; (0, ...) when
    ComfyUI's preview method is none or this process is not ComfyUI (nobody would see them)."""
    cli_args = comfy_module("comfy.cli_args")
    args = getattr(cli_args, "args", None)
    if args is None:
        return 0, DEFAULT_PREVIEW_SIZE
    method = getattr(args, "preview_method", None)
    size = int(getattr(args, "preview_size", DEFAULT_PREVIEW_SIZE) or DEFAULT_PREVIEW_SIZE)
    if getattr(method, "value", method) == "none":
        return 0, size
    text = os.environ.get(PREVIEW_EVERY_VARIABLE, "").strip()
    if not text:
        return PREVIEW_EVERY, size
    if not text.isdigit():
        raise ValueError(f"{PREVIEW_EVERY_VARIABLE} must be a whole number of steps per preview (0: no previews), got {text!r}")
    return int(text), size


def preview_image(frames):
    """uint8 [n, h, w, 3] -> one PIL image, the frames side by side (ComfyUI has Pillow)."""
    from PIL import Image

    return Image.fromarray(side_by_side(frames).numpy())


def interrupt_exception_type() -> type[BaseException] | None:
    model_management = comfy_module("comfy.model_management")
    return getattr(model_management, "InterruptProcessingException", None)


def format_progress(event: dict) -> str:
    """'stage1 3/40 · 1.21 s/step · rank 0 1.21 s | rank 1 1.25 s' from one progress event."""
    stage, step, total = event.get("stage", "job"), event.get("step", 0), event.get("total", 0)
    text = f"{stage} {step}/{total}"
    if event.get("seconds") is not None:
        text += f" · {float(event['seconds']):.2f} s/step"
    rank_seconds = event.get("rank_seconds") or []
    if len(rank_seconds) > 1:
        text += " · " + " | ".join(
            f"rank {rank} {seconds:.2f} s" if seconds is not None else f"rank {rank} -"
            for rank, seconds in enumerate(rank_seconds)
        )
    return text


class FleetJob:
    """Progress, cancel and error mapping for one node execution (one or more fleet calls)."""

    def __init__(self, node_id: str | None, title: str) -> None:
        self.node_id, self.title = node_id, title
        self.cancel_requested = False
        self._bar = None
        self._bar_stage: str | None = None
        self._bar_value = 0
        self._last_text = 0.0
        self._preview_size = DEFAULT_PREVIEW_SIZE

    # -- the two callbacks the api functions take ------------------------------------------------
    def should_cancel(self) -> bool:
        if not self.cancel_requested:
            model_management = comfy_module("comfy.model_management")
            if model_management is not None and model_management.processing_interrupted():
                self.cancel_requested = True
        return self.cancel_requested

    def progress(self, event: dict) -> None:
        self._advance_bar(event)
        self.report(event)

    def report(self, event: dict) -> None:
        """The event to the web panel (``mgpu.status``) and, throttled, as text on the node: both only
        to the browser that queued the prompt. No progress bar: for a node whose bar ComfyUI moves."""
        server = prompt_server()
        if server is None:
            return
        client = prompt_client(server)
        server.send_sync(STATUS_EVENT, {"node": self.node_id, "title": self.title, **_json_safe(event)}, sid=client)
        now = time.monotonic()
        final = event.get("step") == event.get("total")
        if hasattr(server, "send_progress_text") and self.node_id is not None and (final or now - self._last_text >= TEXT_INTERVAL_SECONDS):
            self._last_text = now
            server.send_progress_text(format_progress(event), self.node_id, sid=client)

    def preview(self, fields: dict, frames) -> None:
        """One live preview from the fleet: shown on the node through ComfyUI's preview channel."""
        if comfy_module("comfy.utils") is None:
            return
        self._advance_bar(fields, ("JPEG", preview_image(frames), self._preview_size))

    def _advance_bar(self, event: dict, preview=None) -> None:
        total, step = int(event.get("total") or 0), int(event.get("step") or 0)
        if total <= 0:
            return
        stage = event.get("stage")
        if self._bar is None or stage != self._bar_stage:
            utils = comfy_module("comfy.utils")
            if utils is None:
                return
            self._bar, self._bar_stage, self._bar_value = utils.ProgressBar(total, node_id=self.node_id), stage, 0
        # Within a stage the bar only moves forward: a stage run again (a job resent after the fleet
        # lost a prompt) or a preview of a step already reported keeps the furthest value.
        self._bar_value = max(self._bar_value, min(step, total))
        try:
            self._bar.update_absolute(self._bar_value, total, preview)
        except BaseException as exc:
            # ComfyUI's progress hook raises its interrupt here. Letting it escape would abandon the
            # fleet job mid-stream on the shared connection; turn it into a cancel instead, which
            # the client sends at its next poll and which ends in FleetCancelled below.
            interrupt = interrupt_exception_type()
            if interrupt is None or not isinstance(exc, interrupt):
                raise
            self.cancel_requested = True

    # -- running one api call ----------------------------------------------------------------------
    def call(self, function: Callable, *args, **kwargs):
        """``function(*args, progress=..., should_cancel=..., **kwargs)``, its fleet exceptions
        mapped as ComfyUI expects them: an interrupt, or a RuntimeError with the fleet's message."""
        callbacks = {"progress": self.progress, "should_cancel": self.should_cancel}
        parameters = inspect.signature(function).parameters
        if "preview" in parameters:
            every, self._preview_size = preview_setting()
            callbacks["preview"] = self.preview if every > 0 else None
            if "preview_every" in parameters:
                callbacks["preview_every"] = every
        try:
            return function(*args, **callbacks, **kwargs)
        except FleetCancelled as exc:
            raise self._interrupt(exc) from None
        except FleetError as exc:
            where = exc.where  # no rank on an input error: every rank finds it alike
            if exc.traceback:
                log.error("%s failed in the fleet%s:\n%s", self.title, where, exc.traceback)
            raise RuntimeError(f"{self.title}: {exc}{where}") from None

    def _interrupt(self, cancelled: FleetCancelled) -> BaseException:
        model_management = comfy_module("comfy.model_management")
        if model_management is None:
            return cancelled
        # Clear ComfyUI's interrupt flag the way its own cancel points do, so the next prompt
        # does not start interrupted.
        try:
            model_management.throw_exception_if_processing_interrupted()
        except model_management.InterruptProcessingException as exc:
            return exc
        return model_management.InterruptProcessingException()


def _json_safe(event: dict) -> dict:
    return {key: value for key, value in event.items() if isinstance(value, (str, int, float, bool, list, type(None)))}
