"""The nodes' checks before queueing (their VALIDATE_INPUTS), one refusal naming the one input at fault.

ComfyUI v0.20.1 files a refusal of VALIDATE_INPUTS under every input the method takes (execution.py
``validate_inputs``: one ``custom_validation_failed`` error per argument), so one bad frame count on SP
Sampler would read as seven errors. Each check here looks at one input, and the refusal starts with
that input's name (``"length: frames must be 8k+1 ..., got 126; use 121"``); the web extension
(web/mgpu_panel.js) keeps the error under that input only.

An input fed by a link has no value before the run (ComfyUI passes None): it is skipped here and
checked when the node runs. Nothing here talks to the fleet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from mgpu_backend.ltx.schema import validate_generation

Check = tuple[str, object, Callable[[object], None]]
"""(input name, its value or None when linked, a function that raises ValueError for a bad value)."""


def refusal(checks: Iterable[Check]) -> str | bool:
    """True when every check passes, else ``"<input>: <why and what to use>"`` of the first that fails."""
    for input_name, value, check in checks:
        if value is None:
            continue
        try:
            check(value)
        except ValueError as error:
            return input_fault(input_name, error)
    return True


def input_fault(input_name: str, error: ValueError | str) -> str:
    """A refusal filed under ``input_name`` (the web extension reads the name before the colon)."""
    return f"{input_name}: {error}"


# validate_generation checks each of these on its own; the others get values valid at any stage.
_GENERATION_ARGUMENTS = {"width": "width", "height": "height", "length": "num_frames", "steps": "num_inference_steps", "frame_rate": "frame_rate", "seed": "seed"}
_NEUTRAL_SIZE = {"width": 64, "height": 64, "num_frames": 1}


def generation_check(input_name: str, two_stage: bool = False) -> Callable[[object], None]:
    """The check of one of SP Sampler's size, frame, step, rate or seed inputs (schema.validate_generation)."""
    argument = _GENERATION_ARGUMENTS[input_name]
    return lambda value: validate_generation(**{**_NEUTRAL_SIZE, argument: value}, two_stage=two_stage)
