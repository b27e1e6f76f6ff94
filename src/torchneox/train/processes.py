"""Where a training process runs and how it joins the others: its device, the process group,
whether a failed collective means a peer is gone; and what a resumed run's context keys
change."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from torchneox.config.features.offload import offload_spec
from torchneox.parallel.dims import init_distributed


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def is_lost_rank(error: RuntimeError) -> bool:
    """Whether a collective failed because a peer died or stopped answering (gloo/NCCL)."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(
        marker in text
        for marker in ("timed out", "timeout", "connection closed by peer", "connection reset")
    )


def join_processes(cfg: Any, device: torch.device) -> int:
    """The process group (gloo beside the GPU backend under ZeRO-Offload); the world size."""
    return init_distributed(
        device.type,
        cfg.parallel.distributed_backend,
        cfg.parallel.distributed_timeout_minutes,
        offload_spec(cfg.optimizer.zero_optimization, cfg.optimizer.optimizer).enabled,
    )


CONTEXT_KEYS = ("seq_length", "max_position_embeddings", "rotary_emb_base", "rope_scaling")
"""What continued pretraining at a longer context changes (the weights carry over as they are)."""


def context_changes(saved: Any, now: Any) -> list[str]:
    """'key old -> new' for each context key a resumed run changes."""
    out = []
    for key in CONTEXT_KEYS:
        before, after = getattr(saved.model, key), getattr(now.model, key)
        if before != after:
            out.append(f"{key} {before if before is not None else 'unset'} -> {after}")
    return out
