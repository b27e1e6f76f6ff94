"""The helper every config check uses: one-line errors naming the file and the key."""

from __future__ import annotations

from torchneox.base.errors import ConfigError
from torchneox.config.schema import NeoXConfig


class Checker:
    """Raises a config's mistakes as one-line ConfigErrors naming the file and the key."""

    def __init__(self, config: NeoXConfig, origin: dict[str, str]):
        self.c = config
        self.origin = origin

    def fail(self, key: str, message: str) -> None:
        raise ConfigError(message, source=self.origin.get(key, "defaults"), key=key)

    def positive(self, key: str, *, allow_zero: bool = False) -> None:
        value = self.c.get(key)
        if value is None:
            return
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            self.fail(key, f"must be {bound}, got {value}")

    def within(self, key: str, low: float, high: float, *, high_open: bool = False) -> None:
        value = self.c.get(key)
        if value is None:
            return
        if value < low or value > high or (high_open and value == high):
            bracket = ")" if high_open else "]"
            self.fail(key, f"must be in [{low}, {high}{bracket}, got {value}")
