"""``cpu_attention``: training attention on the CPU under bf16 autocast computed in fp32 where
that is faster; the same values to bf16 rounding, forward-only calls untouched, the verdict
timed once per machine and shape, and the config key reaching every layer."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import losses
from torchneox.config.load import load_config, load_mapping
from torchneox.models import cpu_kernels
from torchneox.models.args import model_args
from torchneox.models.mixers import attention
from torchneox.models.mixers.attention import Attention, AttentionBias
from torchneox.train.trainer import Trainer

KEYS = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16}
ARGS = model_args(load_mapping(KEYS, "test"))


def _layer(fp32: bool) -> Attention:
    torch.manual_seed(0)
    layer = Attention(ARGS, 0)
    layer.cpu_fp32 = fp32
    return layer


def _sdpa_dtypes(monkeypatch) -> list[torch.dtype]:
    seen, real = [], F.scaled_dot_product_attention
    monkeypatch.setattr(
        F,
        "scaled_dot_product_attention",
        lambda q, *a, **k: seen.append(q.dtype) or real(q, *a, **k),
    )
    return seen


def _run(layer: Attention, x: torch.Tensor, bias: AttentionBias):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x, None, bias)
    out.float().square().sum().backward()
    return out, x.grad, layer.wq.weight.grad


@pytest.mark.parametrize("masked", [False, True])
def test_fp32_attention_equals_native_to_bf16_rounding(monkeypatch, masked):
    seen = _sdpa_dtypes(monkeypatch)
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(16, 16, dtype=torch.bool).tril()[None, None] if masked else None
    bias = AttentionBias(mask, is_causal=not masked)
    native = _run(_layer(False), x, bias)
    assert seen == [torch.bfloat16]
    ours = _run(_layer(True), x, bias)
    assert seen[1:] == [torch.float32]  # computed in fp32 ...
    assert ours[0].dtype == torch.bfloat16  # ... and handed on in the autocast dtype
    for a, b in zip(ours, native, strict=True):
        torch.testing.assert_close(
            a.float(), b.float(), rtol=0.02, atol=0.02 * b.abs().max().item()
        )


def test_forward_only_and_fp32_runs_are_left_alone(monkeypatch):
    seen = _sdpa_dtypes(monkeypatch)
    layer, x, bias = _layer(True), torch.randn(2, 8, 64), AttentionBias(None, is_causal=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x, None, bias)  # evaluation and generation: the autocast dtype
    layer(x, None, bias)  # fp32 training: nothing to cast
    assert seen == [torch.bfloat16, torch.float32]


def test_auto_times_each_shape_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path / "kernels.json"))
    monkeypatch.setattr(cpu_kernels, "_timed_here", {})
    timed = []

    def fake(dtype, batch, heads, kv_heads, length, dim, masked):
        timed.append((batch, heads, kv_heads, length, dim, masked))
        return length <= 64

    monkeypatch.setattr(attention, "fp32_attention_faster", fake)
    bf16 = torch.bfloat16
    assert attention.cpu_attention_in_fp32("auto", bf16, 12, ARGS, 64, False)
    assert attention.cpu_attention_in_fp32("auto", bf16, 9, ARGS, 64, False)  # batch bucket 16
    assert not attention.cpu_attention_in_fp32("auto", bf16, 12, ARGS, 1024, True, tp=2)
    assert timed == [(16, 4, 4, 64, 16, False), (16, 2, 2, 1024, 16, True)]
    assert attention.cpu_attention_in_fp32("auto", bf16, 16, ARGS, 64, False)  # from the cache
    assert len(timed) == 2 and len(json.loads((tmp_path / "kernels.json").read_text())) == 2
    assert attention.cpu_attention_in_fp32("fp32", bf16, 1, ARGS, 4096, False)
    assert not attention.cpu_attention_in_fp32("native", bf16, 1, ARGS, 8, False)
    assert not attention.cpu_attention_in_fp32("fp32", torch.float32, 1, ARGS, 8, False)
    assert len(timed) == 2
    with pytest.raises(ValueError, match="cpu_attention"):
        attention.cpu_attention_in_fp32("bf16", bf16, 1, ARGS, 8, False)


def test_timing_a_shape_gives_a_verdict_and_leaves_the_rng_alone():
    before = torch.get_rng_state()
    for masked in (False, True):
        verdict = cpu_kernels.fp32_attention_faster(torch.bfloat16, 2, 4, 2, 32, 16, masked)
        assert verdict.challenger in (True, False)
    assert torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("compiled", [False, True])
def test_config_key_reaches_every_layer_and_trains_alike(make_config, tmp_path, compiled):
    runs = {}
    for mode in ("native", "fp32"):
        keys = {"precision": "bfloat16", "cpu_attention": mode, "compile": compiled}
        cfg = make_config(train_iters=3, save=str(tmp_path / mode), **keys)
        trainer = Trainer(load_config([cfg]), device="cpu")
        layers = [m for m in trainer.model.modules() if isinstance(m, Attention)]
        assert layers and all(m.cpu_fp32 == (mode == "fp32") for m in layers)
        trainer.run()
        runs[mode] = losses(tmp_path / mode)
    assert set(runs["fp32"]) == set(runs["native"])
    for step, loss in runs["native"].items():
        assert runs["fp32"][step] == pytest.approx(loss, rel=2e-2)
    fp32 = Trainer(load_config([make_config(cpu_attention="fp32")]), device="cpu")
    assert not any(getattr(m, "cpu_fp32", False) for m in fp32.model.modules())
