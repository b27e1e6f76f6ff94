"""How a config key is declared: its default, its one-line help and what torchneox does with it.

Every GPT-NeoX key is a dataclass field declared with :func:`key`. The metadata it carries
drives validation (``load.py``), the reference printed by ``torchneox config keys`` and
docs/config.md, and the "accepted, no effect here" notes of ``config explain``.
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
class KeyInfo:
    """Metadata of one config key (stored in the dataclass field's metadata)."""

    help: str
    status: Status = Status.USED
    why: str = ""
    """For NO_EFFECT and UNSUPPORTED: the reason; for UNSUPPORTED, the feature's name first."""


def key(default: Any, help: str, *, status: Status = Status.USED, why: str = "") -> Any:
    """Declare a config field. Mutable defaults are copied per instance."""
    if status in (Status.NO_EFFECT, Status.UNSUPPORTED) and not why:
        raise AssertionError(f"a {status.value} key needs a reason: {help}")
    meta = {"neox": KeyInfo(help=help, status=status, why=why)}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def no_effect(default: Any, help: str, why: str) -> Any:
    """A key accepted for compatibility that changes nothing here, with the reason."""
    return key(default, help, status=Status.NO_EFFECT, why=why)


def unsupported(default: Any, help: str, why: str) -> Any:
    """A key whose non-default value asks for a feature torchneox does not build."""
    return key(default, help, status=Status.UNSUPPORTED, why=why)


def derived(default: Any, help: str) -> Any:
    """A key GPT-NeoX computes at launch; torchneox computes its own (see derive.py)."""
    return key(default, help, status=Status.DERIVED)


def extension(default: Any, help: str) -> Any:
    """A torchneox key that GPT-NeoX does not have."""
    return key(default, help, status=Status.EXTENSION)


def info(field: dataclasses.Field) -> KeyInfo:
    return field.metadata["neox"]
