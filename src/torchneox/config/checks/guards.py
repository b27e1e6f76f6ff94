"""Checks of the run's guards (config/keys/guards.py)."""

from __future__ import annotations

from torchneox.config.checker import Checker


def check_guards(ch: Checker) -> None:
    g = ch.c.guards
    if g.spike_action == "rewind" and not ch.c.checkpoint.save:
        ch.fail(
            "spike_action",
            "rewind reloads the last checkpoint, and save is not set: set save (and "
            "save_interval) or use spike_action: warn",
        )
