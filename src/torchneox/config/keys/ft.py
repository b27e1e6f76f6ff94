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
