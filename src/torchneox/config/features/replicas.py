"""The replicate axis (torchft's replica groups, the ft_* keys) as ``config explain``,
``estimate`` and the dry run say it: how many groups, this run's place among them, how they
average, and that every per-rank figure is one group's (each group holds the same)."""

from __future__ import annotations

from typing import Any

from torchneox.config.checks.ft import replicated


def sync_words(cfg: Any) -> str:
    f = cfg.ft
    if f.ft_diloco_sync_every:
        return (
            f"DiLoCo: pseudo-gradients averaged over the live groups every "
            f"{f.ft_diloco_sync_every} steps, applied by outer SGD (lr {f.ft_diloco_outer_lr})"
        )
    return "gradients averaged over the live groups every step"


def replica_line(cfg: Any, ranks: int) -> str | None:
    """One line on the replica groups of a run whose group has ``ranks`` ranks (None: no
    groups)."""
    if not replicated(cfg):
        return None
    f = cfg.ft
    return (
        f"replica groups: {f.ft_replica_groups} (torchft, lighthouse {f.ft_lighthouse}), this run "
        f"is group {f.ft_replica_group}, each {ranks} rank{'s' if ranks != 1 else ''} with this "
        "layout, "
        f"{f.ft_replica_groups * ranks} in all; {sync_words(cfg)}; the memory here is one "
        "group's, and each group holds the same"
    )


def derive_replicas(cfg: Any, out: Any) -> None:
    """``replica_groups`` (Layout) and ``replicated_batch_size`` (Batch) in config explain."""
    if not replicated(cfg):
        return
    f, world = cfg.ft, out["world_size"]
    out.put("replica_groups", f.ft_replica_groups, replica_line(cfg, world))
    tbs = out["train_batch_size"] if "train_batch_size" in out.values else None
    if tbs:
        dp = out["data_parallel_size"]
        first = f.ft_replica_group * dp
        out.put(
            "replicated_batch_size",
            tbs * f.ft_replica_groups,
            f"{tbs * f.ft_replica_groups} = train_batch_size {tbs} x {f.ft_replica_groups} "
            f"replica groups; group {f.ft_replica_group} reads the share of data-parallel ranks "
            f"{first}..{first + dp - 1} of {dp * f.ft_replica_groups}; a missing group's share "
            "is skipped",
        )
