"""benchmarks/_kernel_floor.py claims to be the nanoGPT recipe's training step as bare kernels:
its gradients must be the ones autograd computes for the same model, on either attention."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _kernel_floor import KernelFloor

B, T, C, H, VOCAB = 3, 16, 32, 4, 65


def autograd_gradients(floor: KernelFloor) -> list[torch.Tensor]:
    """nanoGPT's GPT-2 forward on the floor's weights and batch, by autograd."""
    params = floor.groups[0]["params"] + floor.groups[1]["params"]
    for p in params:
        p.requires_grad_(True)
    x = F.embedding(floor.idx, floor.wte) + floor.wpe
    for layer in floor.layers:
        q, k, v = F.linear(F.layer_norm(x, [C], layer["ln1"]), layer["qkv"]).split(C, 2)
        q, k, v = (z.view(B, T, H, C // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, C), layer["proj"])
        hidden = F.gelu(F.linear(F.layer_norm(x, [C], layer["ln2"]), layer["fc"]))
        x = x + F.linear(hidden, layer["out"])
    logits = F.linear(F.layer_norm(x, [C], floor.lnf), floor.wte)
    return torch.autograd.grad(F.cross_entropy(logits.view(-1, VOCAB), floor.targets), params)


@pytest.mark.parametrize("math_attention", [False, True], ids=["flash", "math"])
def test_the_kernel_floor_computes_autograds_gradients(math_attention):
    floor = KernelFloor(VOCAB, T, 2, H, C, B)
    floor._math_attention = math_attention
    seen = {}
    floor._optimizer = lambda matrices, vectors: seen.update(grads=matrices + vectors)
    floor.step()
    expected = autograd_gradients(floor)
    assert len(seen["grads"]) == len(expected)
    for got, want in zip(seen["grads"], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_kernel_floor_steps_the_weights():
    floor = KernelFloor(VOCAB, T, 2, H, C, B)
    before = [p.clone() for p in floor.groups[0]["params"] + floor.groups[1]["params"]]
    floor.step()
    after = floor.groups[0]["params"] + floor.groups[1]["params"]
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(float(s) == 1.0 for g in floor.groups for s in g["steps"])
