"""Fault injection for the reliability tests: ``TORCHNEOX_FAULT=ACTION@POINT[:ITERATION[:RANK]]``
makes the process kill itself (``kill``: SIGKILL, as ``kill -9``), freeze (``stop``: SIGSTOP,
a rank that hangs) or find its disk full (``full``: the write there fails with ENOSPC) when it
reaches the named point, optionally only at one iteration and on one rank. Points: ``step.start``, ``step.backward`` (gradients computed, not applied),
``save.start``, ``save.shards`` (this rank's shards written), ``save.meta`` (config and
metadata written, no manifest), ``save.manifest`` (complete but not renamed), ``save.renamed``
(renamed, ``latest`` not moved yet), ``writer.write`` (the background writer process about to
write a rank's shards).

``wait`` blocks the process at the point until the folder named by ``TORCHNEOX_FAULT_FLAG``
holds a file named after the iteration (``5``; ``any`` without one): a group of replicas held
at a step while the test restarts another.

Three more actions change what a step computes instead, each once in a process (a rewound run
meets the iteration again): ``spike`` multiplies the step's loss and gradients by 1000 (at
``step.backward``: the loss-spike guard's test), ``flip`` flips one bit of the rank's first
gradient (at ``step.backward``: the corruption check's), and ``slow`` (every time it matches)
sleeps a second (at ``step.start``: a straggler). The caller asks :func:`fault_fires` and acts.
Several specs are separated by commas (``slow@step.start::1,flip@step.backward:4:1``).
Unset, every point is a no-op."""

from __future__ import annotations

import errno
import os
import signal
import time

ENV = "TORCHNEOX_FAULT"
FLAG = "TORCHNEOX_FAULT_FLAG"  # the file a ``wait`` waits for
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "full": None}
ONCE = ("spike", "flip")  # what the caller does, once in a process
SLOW_SECONDS = 1.0
_fired: set[tuple[str, int | None]] = set()


def _matching(name: str, iteration: int | None) -> str | None:
    """The action of the first TORCHNEOX_FAULT spec (several: comma-separated) that names this
    point, iteration and rank."""
    for spec in filter(None, os.environ.get(ENV, "").split(",")):
        action, _, where = spec.partition("@")
        point, *rest = where.split(":")
        if point != name:
            continue
        if rest and rest[0] and iteration is not None and int(rest[0]) != iteration:
            continue
        if len(rest) > 1 and int(rest[1]) != int(os.environ.get("RANK", "0")):
            continue
        return action
    return None


def fault_point(name: str, iteration: int | None = None) -> None:
    action = _matching(name, iteration)
    if action == "slow":
        time.sleep(SLOW_SECONDS)
    if action == "wait":
        flag = os.path.join(os.environ[FLAG], "any" if iteration is None else str(iteration))
        while not os.path.exists(flag):
            time.sleep(0.05)
    if action not in ACTIONS:
        return
    if action == "full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.kill(os.getpid(), ACTIONS[action])


def fault_fires(name: str, iteration: int | None, action: str) -> bool:
    """Whether TORCHNEOX_FAULT asks for ``action`` (one of ONCE) here, the first time only."""
    if _matching(name, iteration) != action or (name, iteration) in _fired:
        return False
    _fired.add((name, iteration))
    return True
