"""Derived: the values derive() computes, in a fixed order, each with its reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Derived:
    """Derived values in a fixed order, with a reason for each, and notes for the user."""

    values: dict[str, Any] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    no_effect: dict[str, str] = field(default_factory=dict)
    """Key (or dotted sub-key) the config sets that changes nothing here -> why."""
    unused: dict[str, str] = field(default_factory=dict)
    """Those of no_effect that other runs read and this one does not (another objective's, the
    other rollout source's): train warns of each at start-up."""
    notes: list[str] = field(default_factory=list)

    def put(self, name: str, value: Any, reason: str) -> Any:
        self.values[name] = value
        self.reasons[name] = reason
        return value

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)
