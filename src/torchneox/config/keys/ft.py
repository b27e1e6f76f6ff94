"""Replica groups that survive each other (torchft): torchneox's own keys, none of them
GPT-NeoX's. Each group is an ordinary run; the groups average their gradients through
torchft's managed process group and agree on every step through its lighthouse."""

from __future__ import annotations

from dataclasses import dataclass

from torchneox.config.fields import extension


@dataclass
class FaultToleranceConfig:
    """Replica groups with torchft: groups that keep training when another fails."""

    ft_lighthouse: str | None = extension(
        None,
        "Address of the torchft lighthouse the replica groups agree through (what `torchneox "
        "lighthouse` prints, e.g. http://host:29510); unset: no replica groups.",
    )
    ft_replica_group: int = extension(
        0, "This run's replica group, 0 to ft_replica_groups - 1 (its share of each batch).", ge=0
    )
    ft_replica_groups: int = extension(
        1,
        "Replica groups the run expects: each step's global batch is this many times one "
        "group's batch (the batch keys describe one group); a missing group's share is skipped.",
        ge=1,
    )
    ft_min_replicas: int = extension(
        1, "Fewest live replica groups a step may commit with (fewer: the step is retried).", ge=1
    )
    ft_timeout_seconds: float = extension(
        60.0,
        "How long a replica group waits for a quorum, a collective or a peer's weights before it "
        "gives up on that step and retries.",
        gt=0,
    )
    ft_diloco_sync_every: int = extension(
        0,
        "DiLoCo through torchft.local_sgd: each group steps its own optimizer (the inner one) "
        "on its share, and every this many steps the groups average how far their weights moved "
        "since the last sync (the pseudo-gradient) and the outer optimizer, SGD, applies it; "
        "0: the gradients are averaged every step.",
        ge=0,
    )
    ft_diloco_outer_lr: float = extension(
        0.7, "DiLoCo's outer SGD learning rate (ft_diloco_sync_every).", gt=0
    )
    ft_diloco_outer_momentum: float = extension(
        0.9, "DiLoCo's outer SGD momentum (ft_diloco_sync_every).", ge=0
    )
    ft_diloco_outer_nesterov: bool = extension(
        True, "Nesterov momentum in DiLoCo's outer SGD (ft_diloco_sync_every; needs a momentum)."
    )
