"""What a load checks of the tensors it reads: which ones a checkpoint may lack (the fresh heads
and LoRA adapters a model initialises instead), and that every floating weight is finite."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from torchneox.base.errors import ConfigError
from torchneox.models.params import is_adapter

FRESH_HEADS = ("value_head.weight", "soft_prompt.weight")
"""Weights a model may start without: a reward model's head, from a language model's
checkpoint (GPT-NeoX loads it non-strictly: rm_linear keeps its initialisation), and a soft
prompt, from a checkpoint of the model it tunes."""


class FreshNames(frozenset):
    """The fresh heads a checkpoint lacks (what iterating gives); ``in`` is also true of the
    LoRA adapters it lacks (a run with lora that fine-tunes its base's checkpoint)."""

    def __new__(cls, heads: list[str], held: set[str], prefix: str) -> FreshNames:
        names = super().__new__(cls, heads)
        names.held, names.prefix = held, prefix
        return names

    def __contains__(self, name: object) -> bool:
        if super().__contains__(name):
            return True
        return (
            isinstance(name, str) and is_adapter(name) and f"{self.prefix}.{name}" not in self.held
        )


def missing_heads(step_dir: Path, prefix: str = "model") -> FreshNames:
    """The fresh heads (and adapters) ``step_dir`` does not hold: what a model loading it must
    initialise."""
    held = set(dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)
    return FreshNames([k for k in FRESH_HEADS if f"{prefix}.{k}" not in held], held, prefix)


def refuse_non_finite(
    sd: dict[str, torch.Tensor],
    source: Path | str,
    names: dict[str, str] | None = None,
    remedy: str = "restore it from a copy, or use an earlier global_step folder",
) -> None:
    """Every floating weight finite (one pass each, this rank's shard of a sharded one): a
    checkpoint damaged in place with its sizes kept is refused in one line naming the tensor
    (as ``names`` calls it in the files, when given), never turned into a model that computes
    NaN."""
    for key, tensor in sd.items():
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        floating = local.is_floating_point() and local.element_size() > 1  # not fp8
        if floating and not bool(torch.isfinite(local).all()):
            name = (names or {}).get(key, key)
            raise ConfigError(
                f"tensor {name} holds NaN or infinite values: the weights are damaged ({remedy})",
                source=str(source),
            )
