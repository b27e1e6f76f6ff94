"""Activation checkpointing and compilation, applied to the model from outside."""

from __future__ import annotations

import functools

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchneox.models.transformer import Transformer

# What selective checkpointing keeps from the forward pass: the outputs of the expensive ops
# (matrix multiplies and attention: recomputing them is most of a block's time) and of
# collectives (recomputing those would communicate again). Everything else (norms,
# activation functions, rotary, dropout, residual adds) is cheap and is recomputed.
_aten = torch.ops.aten
KEPT_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten.linear.default,
    torch.ops.mkldnn._linear_pointwise.default,  # the fp32 CPU linears on oneDNN (models/linear.py)
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: Transformer, every: int = 1, mode: str = "full") -> int:
    """Checkpoint every ``every``-th block: in backward its activations are recomputed instead
    of stored, all of them (``mode`` 'full') or only the cheap elementwise ones ('selective').
    Returns how many blocks are wrapped. Parameter names do not change in state dicts."""
    if mode not in ("full", "selective"):
        raise ValueError(f"unknown activation checkpointing mode {mode!r}")
    extra = {}
    if mode == "selective":
        extra["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, _selective_policy
        )
    wrapped = 0
    for i, name in enumerate(list(model.layers)):
        if i % every == 0:
            model.layers[name] = checkpoint_wrapper(
                model.layers[name], preserve_rng_state=True, **extra
            )
            wrapped += 1
    return wrapped


def compile_blocks(model: Transformer) -> None:
    """torch.compile each block in place (names unchanged): one graph per block, reused by all."""
    for block in model.layers.values():
        block.compile()
