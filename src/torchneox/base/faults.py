"""Fault injection for the reliability tests: ``TORCHNEOX_FAULT=ACTION@POINT[:ITERATION[:RANK]]``
makes the process kill itself (``kill``: SIGKILL, as ``kill -9``), freeze (``stop``: SIGSTOP,
a rank that hangs) or find its disk full (``full``: the write there fails with ENOSPC) when it
reaches the named point, optionally only at one iteration and on one rank. Points: ``step.start``, ``step.backward`` (gradients computed, not applied),
``save.start``, ``save.shards`` (this rank's shards written), ``save.meta`` (config and
metadata written, no manifest), ``save.manifest`` (complete but not renamed), ``save.renamed``
(renamed, ``latest`` not moved yet), ``writer.write`` (the background writer process about to
write a rank's shards). Unset, every point is a no-op."""

from __future__ import annotations

import errno
import os
import signal

ENV = "TORCHNEOX_FAULT"
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "full": None}


def fault_point(name: str, iteration: int | None = None) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    action, _, where = spec.partition("@")
    point, *rest = where.split(":")
    if point != name or action not in ACTIONS:
        return
    if rest and rest[0] and iteration is not None and int(rest[0]) != iteration:
        return
    if len(rest) > 1 and int(rest[1]) != int(os.environ.get("RANK", "0")):
        return
    if action == "full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.kill(os.getpid(), ACTIONS[action])
