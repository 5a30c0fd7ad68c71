"""Numbers read from the environment (``MGPU_*``): unset or empty means the default, anything else
must parse and lie in its range, or it is refused in words that name the variable, what it must be
and what unsetting it does. One reader for every such setting, so that they all answer alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

Number = TypeVar("Number", int, float)


def number_setting(environ: Mapping[str, str], name: str, convert: Callable[[str], Number], accepts: Callable[[Number], bool],
                   must_be: str, unset_it: str) -> Number | None:  # fmt: skip
    """``convert(environ[name])`` when it is set and ``accepts`` it; None when unset or empty.
    Refused (ValueError): "<name> must be <must_be>, got '<text>'; unset it <unset_it>"."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not accepts(value):
        raise ValueError(f"{name} must be {must_be}, got {text!r}; unset it {unset_it}")
    return value
