"""Activation checkpointing and compilation, applied to the model from outside."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torchneox.models.transformer import Transformer


def apply_activation_checkpointing(model: Transformer, every: int = 1) -> int:
    """Recompute the activations of every ``every``-th block in backward instead of storing
    them; returns how many blocks are wrapped. Parameter names do not change in state dicts."""
    wrapped = 0
    for i, name in enumerate(list(model.layers)):
        if i % every == 0:
            model.layers[name] = checkpoint_wrapper(model.layers[name], preserve_rng_state=True)
            wrapped += 1
    return wrapped


def compile_blocks(model: Transformer) -> None:
    """torch.compile each block in place (names unchanged): one graph per block, reused by all."""
    for block in model.layers.values():
        block.compile()
