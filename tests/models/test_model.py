"""The decoder on its own: every architecture option builds, matches the analytic counts,
is causal, and generates the same with and without its KV cache."""

from __future__ import annotations

import pytest
import torch

from torchneox.config.derive import derive
from torchneox.config.load import load_mapping
from torchneox.config.sizes import count
from torchneox.inference.generate import Sampling, filter_logits, generate
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

BASE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "max_position_embeddings": 64,
    "tokenizer_type": "CharLevelTokenizer",
    "make_vocab_size_divisible_by": 64,
}

VARIANTS = {
    "neox-rotary": {"pos_emb": "rotary", "rotary_pct": 0.25, "gpt_j_residual": True},
    "gpt-j-tied": {"pos_emb": "rotary", "gpt_j_residual": True, "gpt_j_tied": True},
    "learned": {"pos_emb": "learned", "opt_pos_emb_offset": 2},
    "sinusoidal": {"pos_emb": "sinusoidal"},
    "alibi": {"pos_emb": "alibi"},
    "none": {"pos_emb": "none"},
    "rmsnorm-swiglu-gqa": {
        "pos_emb": "rotary",
        "norm": "rmsnorm",
        "activation": "swiglu",
        "num_kv_heads": 2,
        "use_bias_in_norms": False,
        "use_bias_in_attn_linear": False,
        "use_bias_in_mlp": False,
    },
    "mqa-geglu": {"pos_emb": "rotary", "activation": "geglu", "num_kv_heads": 1},
    "scalenorm-reglu": {"norm": "scalenorm", "activation": "reglu", "pos_emb": "rotary"},
    "nonparam-bilinear": {"norm": "non_parametric_layernorm", "activation": "bilinear"},
    "glu-mish": {"activation": "glu", "intermediate_size": 96, "mlp_multiple_of": 8},
    "relu-untied": {"activation": "relu", "no_weight_tying": True},
    "window": {"pos_emb": "rotary", "sliding_window_width": 8},
    "inits": {"init_method": "xavier_normal", "output_layer_init_method": "scaled_orthogonal"},
    "dropout": {"hidden_dropout": 0.1, "attention_dropout": 0.1, "pos_emb": "rotary"},
}


def build(variant: str, seed: int = 0):
    loaded = load_mapping(BASE | VARIANTS[variant], variant)
    return loaded, build_model(model_args(loaded), seed=seed)


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


@pytest.mark.parametrize(
    "variant", ["neox-rotary", "alibi", "learned", "window", "rmsnorm-swiglu-gqa"]
)
def test_generation_with_cache_equals_without(variant):
    _, model = build(variant)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    with_cache = generate(model, prompts, Sampling(maximum_tokens=12))
    without = generate(model, prompts, Sampling(maximum_tokens=12, use_cache=False))
    assert with_cache == without
    assert all(len(c) == 12 for c in with_cache)


def test_batched_prompts_equal_one_at_a_time():
    _, model = build("neox-rotary")
    prompts = [[5, 6, 7, 8, 9, 1, 2], [10, 11], [12, 13, 14]]
    batched = generate(model, prompts, Sampling(maximum_tokens=10))
    alone = [generate(model, [p], Sampling(maximum_tokens=10))[0] for p in prompts]
    assert batched == alone


def test_stop_token_ends_a_row():
    _, model = build("neox-rotary")
    first = generate(model, [[5, 6, 7]], Sampling(maximum_tokens=10))[0]
    stop = first[3]
    cut = generate(model, [[5, 6, 7]], Sampling(maximum_tokens=10, stop_ids={stop}))[0]
    assert cut == first[: first.index(stop)]


def test_sampling_is_seeded():
    _, model = build("neox-rotary")
    s = Sampling(temperature=1.0, top_k=20, top_p=0.9, maximum_tokens=15, seed=4)
    assert generate(model, [[1, 2, 3]], s) == generate(model, [[1, 2, 3]], s)
    other = Sampling(temperature=1.0, maximum_tokens=15, seed=5)
    assert generate(model, [[1, 2, 3]], s) != generate(model, [[1, 2, 3]], other)


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 0.0)).tolist() == [[False, False, True, True]]
    # 0.5 + 0.3 reaches 0.8: the rest is dropped
    assert torch.isinf(filter_logits(logits, 0, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(filter_logits(logits, 0, 0.1)).tolist() == [[False, True, True, True]]


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
