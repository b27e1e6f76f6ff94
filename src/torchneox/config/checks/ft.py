"""Checks of replica groups (torchft): the keys against each other, then, for training, that
torchft is installed and that the group's layout is one the replicas can average over."""

from __future__ import annotations

import importlib.util

from torchneox.base.errors import ConfigError
from torchneox.config.checker import Checker


def replicated(c) -> bool:
    """Whether the run is one replica group of several (ft_lighthouse set)."""
    return c.ft.ft_lighthouse is not None


def check_replicas(ch: Checker) -> None:
    f = ch.c.ft
    _check_diloco(ch)
    if not replicated(ch.c):
        given = {
            "ft_replica_groups": f.ft_replica_groups > 1,
            "ft_replica_group": f.ft_replica_group > 0,
            "ft_diloco_sync_every": f.ft_diloco_sync_every > 0,
        }
        for key in (k for k, on in given.items() if on):
            ch.fail(
                key,
                "replica groups agree through a torchft lighthouse: set ft_lighthouse to the "
                "address `torchneox lighthouse` prints",
            )
        return
    if f.ft_replica_group >= f.ft_replica_groups:
        ch.fail(
            "ft_replica_group",
            f"is {f.ft_replica_group}, but the groups are numbered 0 to "
            f"{f.ft_replica_groups - 1} (ft_replica_groups is {f.ft_replica_groups})",
        )
    if f.ft_min_replicas > f.ft_replica_groups:
        ch.fail(
            "ft_min_replicas",
            f"is {f.ft_min_replicas}, more than the {f.ft_replica_groups} replica groups "
            "(ft_replica_groups); no step could commit",
        )


DILOCO_OUTER = (
    ("ft_diloco_outer_lr", 0.7),
    ("ft_diloco_outer_momentum", 0.9),
    ("ft_diloco_outer_nesterov", True),
)


def _check_diloco(ch: Checker) -> None:
    """DiLoCo's outer keys mean something only with ft_diloco_sync_every; Nesterov momentum
    needs a momentum."""
    f = ch.c.ft
    if not f.ft_diloco_sync_every:
        for key, default in DILOCO_OUTER:
            if getattr(f, key) != default:
                ch.fail(key, "only means something with DiLoCo: set ft_diloco_sync_every")
        return
    if f.ft_diloco_outer_nesterov and f.ft_diloco_outer_momentum == 0:
        ch.fail(
            "ft_diloco_outer_nesterov",
            "Nesterov momentum needs ft_diloco_outer_momentum above 0 (or set it false)",
        )


def require_replicas(c) -> None:
    """Training as a replica group: torchft importable."""
    if replicated(c) and importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "replica groups need torchft: pip install 'torchneox[ft]' (or unset ft_lighthouse)",
            key="ft_lighthouse",
        )
