"""Activation checkpointing: full and selective give the gradients of no checkpointing (with
dropout, whose masks must replay), and differ in what backward recomputes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.parallel.activation_ckpt import apply_activation_checkpointing
from torchneox.train.loss import lm_loss

KEYS = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "padded_vocab_size": 128,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "pos_emb": "rotary",
}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def grads_and_backward_ops(mode: str | None, every: int = 1):
    model = build_model(model_args(load_mapping(KEYS, "test")), seed=0)
    if mode is not None:
        assert apply_activation_checkpointing(model, every, mode) == 4 // every
    model.train()
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:], None)
    counter = OpCounter()
    with counter:
        loss.backward()
    names = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    return {n: p.grad for n, p in names.items()}, counter.ops


@pytest.fixture(scope="module")
def plain():
    return grads_and_backward_ops(None)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_gives_the_gradients_of_none(plain, mode):
    grads, _ = grads_and_backward_ops(mode)
    for name, g in plain[0].items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)


def test_full_recomputes_matmuls_and_selective_only_elementwise_work(plain):
    _, none_ops = plain
    _, full_ops = grads_and_backward_ops("full")
    _, sel_ops = grads_and_backward_ops("selective")
    # with dropout, CPU attention is bmm-softmax-bmm; _linear_pointwise: a linear on oneDNN
    matmuls = ("mm", "addmm", "bmm", "_linear_pointwise")
    recomputed = lambda ops, op: ops[op] - none_ops[op]  # noqa: E731
    # full: every block's forward runs again in backward, matmuls and attention included
    assert sum(recomputed(full_ops, op) for op in matmuls) >= 4 * 6  # qkv, dense, 2 MLP, 2 attn
    assert recomputed(full_ops, "_safe_softmax") == 4
    # selective: no matmul runs again; the norms, gelu, softmax and dropout do
    assert all(recomputed(sel_ops, op) == 0 for op in matmuls)
    assert recomputed(sel_ops, "_safe_softmax") == 4
    assert recomputed(sel_ops, "bernoulli_") == recomputed(full_ops, "bernoulli_") > 0
    assert recomputed(sel_ops, "native_layer_norm") == 4 * 2
    assert recomputed(sel_ops, "gelu") == 4


def test_every_other_block_is_checkpointed(plain):
    grads, ops = grads_and_backward_ops("full", every=2)
    assert ops["native_layer_norm"] - plain[1]["native_layer_norm"] == 2 * 2
    for name, g in plain[0].items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=name)
