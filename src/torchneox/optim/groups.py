"""Which parameters decay: GPT-NeoX's two parameter groups, shared by every optimizer."""

from __future__ import annotations

from typing import Any

from torch import nn

NO_DECAY = ("A_log",)
"""Matrices that never decay (GPT-NeoX marks them _no_weight_decay)."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (weights, embeddings) decay; biases and norm parameters (1-D) do not, nor
    mamba's A_log (GPT-NeoX's _no_weight_decay). An empty group is left out: torch's
    distributed state dict drops it, and a resumed optimizer would find it without its
    settings (weight_decay 0 resumed with a KeyError)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            matrix = p.ndim >= 2 and not name.endswith(NO_DECAY)
            (decay if matrix and weight_decay > 0 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    groups.append({"params": no_decay, "weight_decay": 0.0})
    # (a pipeline stage with nothing to train, a soft prompt's later one, keeps one empty group)
    return [g for g in groups if g["params"]] or groups[1:]
