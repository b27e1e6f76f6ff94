"""Numbers as config files write them: YAML 1.1 reads ``1e-5`` and ``1e3`` (no dot before the
``e``) as text, so a number given as text counts as that number, for the flat keys
(``load.coerce``) and for the entries of the dict keys the features read (``lora.alpha``,
``soft_prompt_tuning.init_range``, ``curriculum_learning``'s steps, ...) alike."""

from __future__ import annotations

import math
from typing import Any


class Mismatch(Exception):
    """The value is not a number of the kind asked for."""


def to_float(value: Any) -> float:
    """``value`` as a float (a number, or text that reads as one; not NaN), else Mismatch."""
    if isinstance(value, bool):
        raise Mismatch
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise Mismatch from None
        if math.isnan(number):
            raise Mismatch
        return number
    raise Mismatch


def to_int(value: Any) -> int:
    """``value`` as an int (an integer, or a whole number written as one: 1e3), else Mismatch.
    A whole number in quotes ("64") is a Mismatch: YAML 1.1 leaves only the exponent forms as
    text, so quotes were put there."""
    if isinstance(value, bool):
        raise Mismatch
    if isinstance(value, int):
        return value
    if isinstance(value, str) and not any(c in value for c in "eE"):
        raise Mismatch
    number = to_float(value)
    if not number.is_integer():
        raise Mismatch
    return int(number)


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not one (a feature's check then names
    the value as given)."""
    try:
        result = to_float(value)
    except Mismatch:
        return None
    return result if math.isfinite(result) else None


def whole(value: Any) -> int | None:
    """``value`` as an int (1e3 written as text too), or None when it is not a whole number."""
    try:
        return to_int(value)
    except (Mismatch, OverflowError):
        return None
