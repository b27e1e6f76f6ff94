"""The decoder on its own: every architecture option builds, matches the analytic counts,
is causal, and generates the same with and without its KV cache."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import BASE, VARIANTS, build
from torchneox.config.derive import derive
from torchneox.config.load import load_mapping
from torchneox.config.sizes import count
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_builds_and_matches_analytic_counts(variant):
    loaded, model = build(variant)
    derived = derive(loaded)
    assert sum(p.numel() for p in model.parameters()) == derived["num_parameters"]
    assert count(loaded.config, derived["padded_vocab_size"]).total == derived["num_parameters"]
    assert not any(p.isnan().any() for p in model.parameters())


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "dropout"])
def test_outputs_are_causal(variant):
    _, model = build(variant)
    model.eval()
    tokens = torch.randint(0, 256, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_sliding_window_limits_what_a_token_sees():
    _, model = build("window")
    model.eval()
    tokens = torch.randint(0, 256, (1, 30))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    # two layers of window 8: position 0 can reach at most position 14
    torch.testing.assert_close(a[0, 15:], b[0, 15:])
    assert not torch.allclose(a[0, 1:8], b[0, 1:8])


def test_init_is_seeded_and_methods_differ():
    _, a = build("neox-rotary", seed=1)
    _, b = build("neox-rotary", seed=1)
    _, c = build("neox-rotary", seed=2)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(a.embed.weight, c.embed.weight)
    # defaults: normal(0.02) everywhere, scaled_normal (0.02 / sqrt(2 x layers)) on outputs
    assert a.layers["0"].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert a.layers["0"].mlp.down.weight.std().item() == pytest.approx(0.02 / 2, rel=0.1)
    loaded = load_mapping(
        BASE | {"init_method": "small_init", "output_layer_init_method": "wang_init"}, "x"
    )
    model = build_model(model_args(loaded), seed=0)
    assert model.layers["1"].mlp.up.weight.std().item() == pytest.approx(
        (2 / (5 * 64)) ** 0.5, rel=0.1
    )
    assert model.layers["1"].attention.wo.weight.std().item() == pytest.approx(
        2 / 2 / 64**0.5, rel=0.1
    )


def test_gpt_neox_gelus():
    """bias_gelu_fusion: GPT-NeoX's bias_gelu (tanh, its constant, its hand-written derivative);
    onnx_safe: erf with a rounded sqrt(2). Both differ from the exact gelu."""
    from torch.nn import functional as F

    from torchneox.models.mlp import onnx_gelu, tanh_gelu

    x = torch.linspace(-6, 6, 2001, dtype=torch.float64, requires_grad=True)
    y = tanh_gelu(x)
    torch.testing.assert_close(y, F.gelu(x, approximate="tanh"), rtol=1e-8, atol=1e-9)
    (grad,) = torch.autograd.grad(y.sum(), x)
    t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    want = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
    torch.testing.assert_close(grad, want.detach(), rtol=0, atol=0)
    assert (y - F.gelu(x)).abs().max() > 1e-4
    torch.testing.assert_close(onnx_gelu(x), x * 0.5 * (torch.erf(x / 1.41421) + 1.0))
    assert (onnx_gelu(x) - F.gelu(x)).abs().max() > 1e-7


def test_activation_follows_gpt_neox_switches():
    from torchneox.config.load import load_mapping
    from torchneox.models.args import model_args

    base = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "seq_length": 4}
    for extra, want in [
        ({}, "gelu"),
        ({"bias_gelu_fusion": True}, "gelu_tanh"),
        ({"onnx_safe": True}, "gelu_onnx"),
        ({"bias_gelu_fusion": True, "activation": "swiglu"}, "swiglu"),
    ]:
        assert model_args(load_mapping(base | extra, "x")).activation == want


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_gpt_neox_qk_norm_is_one_norm_for_queries_and_keys(norm):
    """use_qk_layernorm as GPT-NeoX builds it: one module over [heads, head_dim] applied to the
    queries and to the keys, after the projections and before rotary; rmsnorm normalises each
    head, layernorm all the heads together."""
    _, model = build(f"qk-norm-neox-{norm}")
    attention = model.layers["0"].attention
    assert attention.q_norm is None and attention.qk_norm.weight.shape == (4, 16)
    with torch.no_grad():
        attention.qk_norm.weight.copy_(torch.randn(4, 16))
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        q, k = attention._queries_keys(x)
        for projection, got in ((attention.wq, q), (attention.wk, k)):
            raw = projection(x).view(2, 5, 4, 16)
            if norm == "rmsnorm":
                scaled = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + 1e-8)
                expected = scaled * attention.qk_norm.weight
            else:
                flat = raw.reshape(2, 5, 64)
                normed = (flat - flat.mean(-1, keepdim=True)) / torch.sqrt(
                    flat.var(-1, unbiased=False, keepdim=True) + 1e-5
                )
                expected = normed.view(2, 5, 4, 16) * attention.qk_norm.weight
                expected = expected + attention.qk_norm.bias
            torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["neox-rotary", "learned", "alibi", "window", "qwen3-like"])
def test_documents_in_a_packed_sample_see_only_themselves(variant):
    """inter_document_attention_masking: with each token's document and its position in it, a
    document's logits in a packed row are those of the document run alone, whatever the other
    documents hold."""
    from torchneox.models.mixers.attention import documents

    _, model = build(variant)
    model.eval()
    eod = 0
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(1, 256, (n,), generator=g) for n in (7, 9, 5))
    row = torch.cat([a, torch.tensor([eod]), b, torch.tensor([eod]), c])[None]
    positions, segments = documents(row, eod)
    assert positions[0, :8].tolist() == list(range(8)) and positions[0, 8].item() == 0
    assert segments[0].tolist() == [0] * 8 + [1] * 10 + [2] * 5
    with torch.no_grad():
        packed = model(row, positions_BT=positions, segments_BT=segments)
        alone = model(torch.cat([b, torch.tensor([eod])])[None])
        torch.testing.assert_close(packed[0, 8:18], alone[0], atol=1e-5, rtol=1e-5)
        other = row.clone()
        other[0, :7] = torch.randint(1, 256, (7,), generator=g)
        changed = model(other, positions_BT=positions, segments_BT=segments)
        torch.testing.assert_close(changed[0, 8:], packed[0, 8:], atol=1e-6, rtol=1e-6)
        assert not torch.allclose(model(other)[0, 8:], model(row)[0, 8:])  # unmasked: it leaks
