"""How a config key is declared: its default, its one-line help and what torchneox does with it.

Every GPT-NeoX key is a dataclass field declared with :func:`key`. The metadata it carries
drives validation (``load.py``; a numeric key's allowed range, ``gt``/``ge``/``le``/``lt``, is
declared here and checked for every key at load), the reference printed by ``torchneox config
keys`` and docs/config.md, and the "accepted, no effect here" notes of ``config explain``.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any


class Status(enum.Enum):
    """What torchneox does with a key."""

    USED = "used"
    """Read and honoured."""
    NO_EFFECT = "no effect"
    """Accepted so that GPT-NeoX configs load, but nothing here changes with it."""
    UNSUPPORTED = "unsupported"
    """A feature torchneox does not build: setting it away from its default is an error."""
    DERIVED = "derived"
    """GPT-NeoX fills it in at launch; torchneox derives its own value."""
    EXTENSION = "torchneox"
    """A key GPT-NeoX does not have, added by torchneox."""


@dataclass(frozen=True)
class Range:
    """The values a numeric key may take: above ``low`` (strictly when ``low_open``), below
    ``high`` (strictly when ``high_open``); None: no bound on that side."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or not (
            value > self.high or (self.high_open and value == self.high)
        )

    def __str__(self) -> str:
        def num(x: float) -> str:
            return f"{x:g}"

        if self.high is None:
            return f"{'>' if self.low_open else '>='} {num(self.low)}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {num(self.high)}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{num(self.low)}, {num(self.high)}{right}"


def _range(gt: float | None, ge: float | None, lt: float | None, le: float | None) -> Range | None:
    if (gt is not None and ge is not None) or (lt is not None and le is not None):
        raise AssertionError("give one lower and one upper bound")
    low, high = (gt if gt is not None else ge), (lt if lt is not None else le)
    if low is None and high is None:
        return None
    return Range(low, high, low_open=gt is not None, high_open=lt is not None)


@dataclass(frozen=True)
class KeyInfo:
    """Metadata of one config key (stored in the dataclass field's metadata)."""

    help: str
    status: Status = Status.USED
    why: str = ""
    """For NO_EFFECT and UNSUPPORTED: the reason; for UNSUPPORTED, the feature's name first."""
    range: Range | None = None
    """The values a number (or each number of a list) may take; None: any."""


def key(
    default: Any,
    help: str,
    *,
    status: Status = Status.USED,
    why: str = "",
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
) -> Any:
    """Declare a config field, with the range its value must lie in (``gt``/``ge`` below,
    ``lt``/``le`` above; unset: unbounded). Mutable defaults are copied per instance."""
    if status in (Status.NO_EFFECT, Status.UNSUPPORTED) and not why:
        raise AssertionError(f"a {status.value} key needs a reason: {help}")
    bounds = _range(gt, ge, lt, le)
    meta = {"neox": KeyInfo(help=help, status=status, why=why, range=bounds)}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def no_effect(default: Any, help: str, why: str) -> Any:
    """A key accepted for compatibility that changes nothing here, with the reason."""
    return key(default, help, status=Status.NO_EFFECT, why=why)


def unsupported(default: Any, help: str, why: str) -> Any:
    """A key whose non-default value asks for a feature torchneox does not build."""
    return key(default, help, status=Status.UNSUPPORTED, why=why)


def derived(default: Any, help: str, **bounds: float) -> Any:
    """A key GPT-NeoX computes at launch; torchneox computes its own (see derive.py)."""
    return key(default, help, status=Status.DERIVED, **bounds)


def extension(default: Any, help: str, **bounds: float) -> Any:
    """A torchneox key that GPT-NeoX does not have."""
    return key(default, help, status=Status.EXTENSION, **bounds)


def info(field: dataclasses.Field) -> KeyInfo:
    return field.metadata["neox"]
