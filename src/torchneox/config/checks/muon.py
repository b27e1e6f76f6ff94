"""The checks of ``optimizer.params`` entries that only ``muon`` takes (its lr, weight decay,
betas and eps are checked as Adam's)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torchneox.config.numbers import whole

MUON_PARAMS = (
    "momentum",
    "nesterov",
    "ns_steps",
    "ns_eps",
    "ns_coefficients",
    "adjust_lr_fn",
    "adamw_lr",
    "ns_dtype",
)
ADJUST_LR = ("match_rms_adamw", "original")


def muon_param(name: str, value: Any, fail: Callable[[str], None]) -> Any:
    """``value`` of ``params.name`` as the optimizer takes it; ``fail`` (one line) otherwise."""
    if name == "nesterov":
        if not isinstance(value, bool):
            fail(f"params.nesterov must be true or false, got {value!r}")
        return value
    if name == "adjust_lr_fn":
        if value not in ADJUST_LR:
            fail(
                f"params.adjust_lr_fn must be match_rms_adamw (Moonshot's: the update's RMS "
                f"matches AdamW's) or original (Keller Jordan's), got {value!r}"
            )
        return value
    if name == "ns_dtype":
        if value not in ("bf16", "fp32"):
            fail(
                f"params.ns_dtype must be bf16 (torch's Muon) or fp32 (for a processor without "
                f"bf16 units), got {value!r}"
            )
        return value
    if name == "ns_steps":
        steps = whole(value)  # text such as 1e1 (a string to YAML) counts as the number
        if steps is None or not 1 <= steps <= 99:
            fail(
                f"params.ns_steps must be a whole number of Newton-Schulz steps in 1..99, got {value!r}"
            )
        return steps
    if name == "ns_coefficients":
        numbers = isinstance(value, list | tuple) and len(value) == 3
        if not numbers or not all(_finite(v) for v in value):
            fail(f"params.ns_coefficients must be three numbers (a, b, c), got {value!r}")
        return [float(v) for v in value]
    if not _finite(value):
        fail(f"params.{name} must be a number, got {value!r}")
    result = float(value)
    if name == "momentum" and not 0 <= result < 1:
        fail(f"params.momentum must be in [0, 1), got {value!r}")
    if name in ("adamw_lr", "ns_eps") and result <= 0:
        fail(f"params.{name} must be > 0, got {value!r}")
    return result


def _finite(v: Any) -> bool:
    """A finite number (YAML's 1.0e-7 without a dot before e is text to PyYAML: taken too)."""
    try:
        return not isinstance(v, bool) and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
