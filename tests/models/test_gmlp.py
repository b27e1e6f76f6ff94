"""gMLP and aMLP blocks (attention_config gmlp / amlp): GPT-NeoX's computation, causal
spatial gating, shorter inputs, the seq_length limit, decoding from the cache and padding."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import build
from torchneox.base.errors import ConfigError, HFError
from torchneox.config.derive import derive
from torchneox.config.sizes import count
from torchneox.inference.generate import Sampling, generate
from torchneox.models.hf.architectures import export_architecture
from torchneox.models.mixers.attention import AttentionBias


def randomised(model, seed: int = 0):
    """``model`` with every spatial projection drawn at random, the entries above the
    diagonal too (at initialisation W is zero and nothing crosses positions)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".sgu.proj." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def mixers(model):
    return [block.gmlp for block in model.layers.values() if hasattr(block, "gmlp")]


def neox_gmlp(m, x_BTH: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX's GMLPBlock.forward (megatron/model/gmlp.py) after the block's norm, written
    out from its source for [batch, seq, hidden] inputs: the causal seq x seq projection's
    top-left n x n part with the bias truncated to n (#1371), the tiny attention's softmax
    over scores scaled by d_attn^-0.5 with the upper triangle masked."""
    x = F.gelu(x_BTH @ m.input_linear.weight.T)  # activation gelu, biases never added
    n = x.shape[1]
    res, gate = x.chunk(2, dim=-1)
    gate = m.sgu.norm(gate)
    weight = m.sgu.proj.weight[:n, :n].masked_fill(torch.ones(n, n).triu(1).bool(), 0.0)
    gate = F.linear(gate.transpose(2, 1), weight, m.sgu.proj.bias[:n]).transpose(2, 1)
    if m.sgu.attn is not None:
        a = m.sgu.attn
        q, k, v = torch.chunk(x @ a.proj_qkv.weight.T + a.proj_qkv.bias, 3, dim=-1)
        w = torch.einsum("bnd,bmd->bnm", q, k) * q.shape[-1] ** -0.5
        w = w.masked_fill(torch.ones(n, n).triu(1).bool(), torch.finfo(w.dtype).min)
        out = torch.einsum("bnm,bmd->bnd", w.softmax(-1), v)
        gate = gate + out @ a.proj_ffn.weight.T + a.proj_ffn.bias
    return (gate * res) @ m.output_linear.weight.T


@pytest.mark.parametrize("variant", ["gmlp", "amlp"])
@pytest.mark.parametrize("length", [64, 23])
def test_mixer_computes_what_gpt_neox_computes(variant, length):
    _, model = build(variant)
    mixer = mixers(randomised(model))[0]
    x = torch.randn(3, length, 64)
    with torch.no_grad():
        ours = mixer(x, None, AttentionBias(None, is_causal=True))
        torch.testing.assert_close(ours, neox_gmlp(mixer, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["gmlp", "amlp"])
def test_spatial_gating_is_causal(variant):
    """No position's output depends on a later position's input (the gradient of output i
    with respect to inputs j > i is exactly zero), while earlier positions do count."""
    _, model = build(variant)
    mixer = mixers(randomised(model))[0]
    x = torch.randn(2, 64, 64, requires_grad=True)
    out = mixer(x, None, AttentionBias(None, is_causal=True))
    for i in (0, 17, 40, 63):
        (grad,) = torch.autograd.grad(out[:, i].sum(), x, retain_graph=True)
        assert torch.all(grad[:, i + 1 :] == 0), i
        assert torch.all(grad[:, : i + 1].abs().sum(-1) > 0), i


@pytest.mark.parametrize("variant", ["gmlp", "amlp", "gmlp-global-mix"])
def test_a_shorter_input_is_the_start_of_the_whole_one(variant):
    _, model = build(variant)
    model = randomised(model)
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens[:, :29]), model(tokens)[:, :29])


def test_longer_than_seq_length_is_one_line():
    _, model = build("gmlp")
    with pytest.raises(ConfigError) as err:
        model(torch.randint(0, 256, (1, 65)))
    assert err.value.key == "seq_length"
    assert "65 tokens is longer than seq_length 64" in str(err.value)
    assert "\n" not in str(err.value)


def test_initialisation_is_gpt_neox_s():
    _, model = build("amlp")
    m = mixers(model)[0]
    assert torch.all(m.sgu.proj.weight == 0) and torch.all(m.sgu.proj.bias == 1)
    for linear, fan_in in ((m.sgu.attn.proj_qkv, 512), (m.sgu.attn.proj_ffn, 16)):
        for p in (linear.weight, linear.bias):  # nn.Linear's own: uniform in +-1/sqrt(fan_in)
            assert p.abs().max() <= fan_in**-0.5 and p.abs().max() > 0.9 * fan_in**-0.5
    assert m.input_linear.weight.std().item() == pytest.approx(0.02, rel=0.05)  # init_method normal
    _, again = build("amlp")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", ["gmlp", "amlp", "gmlp-global-mix"])
@pytest.mark.parametrize("loop", ["dynamic", "static"])
def test_decoding_from_the_cache_equals_recomputing(variant, loop):
    """Batched, left-padded prompts: the cached decode (normalised gates, tiny attention's keys
    and values) gives the tokens of recomputing the whole prefix, and of each prompt alone."""
    _, model = build(variant)
    model = randomised(model, seed=1)
    prompts = [[5, 6, 7, 8, 9, 1, 2], [10, 11], [12, 13, 14]]
    cached = generate(model, prompts, Sampling(maximum_tokens=30, decode_loop=loop))
    recomputed = generate(model, prompts, Sampling(maximum_tokens=30, use_cache=False))
    assert cached == recomputed
    assert all(len(c) == 30 for c in cached)
    alone = [generate(model, [p], Sampling(maximum_tokens=30, use_cache=False))[0] for p in prompts]
    assert cached == alone
    assert len({tuple(c) for c in cached}) > 1


def test_padded_logits_equal_unpadded():
    """A left-padded row's logits are the unpadded prompt's (positions count from its first
    real token; the padding is never seen)."""
    _, model = build("amlp")
    model = randomised(model, seed=2)
    tokens = torch.randint(0, 256, (1, 20))
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), tokens], dim=1)
    valid = torch.arange(26)[None] >= 6
    positions = (torch.arange(26)[None] - 6).clamp(min=0)
    with torch.no_grad():
        alone = model(tokens)
        out = model(padded, positions_BT=positions, key_valid_BS=valid)
    torch.testing.assert_close(out[:, 6:], alone, rtol=1e-5, atol=1e-5)


def test_hugging_face_export_is_refused_in_one_line():
    """transformers has no gMLP: a model with such layers is not exported as something else."""
    _, model = build("gmlp-global-mix")
    with pytest.raises(HFError) as err:
        export_architecture(model.args)
    assert "attention_config gmlp layers (transformers has no gMLP)" in str(err.value)
    assert "\n" not in str(err.value)


def test_flops_per_token_count_the_gating_and_the_tiny_attention():
    loaded, _ = build("amlp")
    vocab = derive(loaded)["padded_vocab_size"]
    h, ff, s, a = 64, 256, 64, 16
    layer = 2 * (h * 2 * ff + ff * h) + 2 * s * ff  # projections, the s x s gating
    layer += 2 * (2 * ff * 3 * a + a * ff) + 2 * 2 * s * a  # tiny attention: projections, scores
    assert count(loaded.config, vocab).flops_per_token == 3 * (2 * layer + 2 * vocab * h)
