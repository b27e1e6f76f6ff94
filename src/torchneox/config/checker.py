"""The helper every config check uses: one-line errors naming the file and the key."""

from __future__ import annotations

import math
import re

from torchneox.base.errors import ConfigError
from torchneox.config.schema import KEYS, NeoXConfig

OVERRIDE = "--set"
"""Where a value given on the command line came from (config/load.py names it so)."""


def source_of(origin: dict[str, str], key: str, path: str | None = None) -> str:
    """Where ``key`` (or the entry ``path`` inside it, 'params.lr') was given: a value set with
    ``--set key.params.lr=...`` is that override's, even when a file gave the rest of ``key``."""
    if path:
        parts = path.split(".")
        for n in range(len(parts), 0, -1):
            dotted = ".".join([key, *parts[:n]])
            if dotted in origin:
                return origin[dotted]
    return origin.get(key, "defaults")


class Checker:
    """Raises a config's mistakes as one-line ConfigErrors naming the file and the key."""

    def __init__(self, config: NeoXConfig, origin: dict[str, str]):
        self.c = config
        self.origin = origin

    def fail(self, key: str, message: str, *, path: str | None = None) -> None:
        """``path``: the entry of a mapping key the message is about ('params.lr'). A check of
        several keys is blamed on ``--set`` when one of the others it names came from there
        (the file did not change; the override did)."""
        source = source_of(self.origin, key, path)
        if source != OVERRIDE:
            named = set(re.findall(r"[a-z][a-z0-9_]+", message)) & KEYS.keys()
            if any(self.origin.get(k) == OVERRIDE for k in named - {key}):
                source = OVERRIDE
        raise ConfigError(message, source=source, key=key)

    def ranges(self) -> None:
        """Every key whose field declares a range (``key(..., gt=0)``), in schema order: the
        value, or each number of a list, must lie in it and be finite."""
        for name, spec in KEYS.items():
            bounds = spec.info.range
            value = self.c.get(name) if bounds is not None else None
            for v in value if isinstance(value, list) else [value]:
                if v is None or isinstance(v, bool) or not isinstance(v, int | float):
                    continue
                if not (math.isfinite(v) and bounds.holds(v)):
                    each = " (each of them)" if isinstance(value, list) else ""
                    self.fail(name, f"must be {bounds}{each}, got {value}")
