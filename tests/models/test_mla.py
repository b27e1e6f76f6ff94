"""Multi-head latent attention (models/mixers/mla.py): it equals a hand-written DeepSeek-V3 MLA;
its KV cache holds the compressed latent and the rotary key, and decoding through it gives the
logits of the full forward; DeepSeek-V3's group-limited routing picks from the best groups."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import BASE, VARIANTS, build
from torchneox.base.errors import ConfigError
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.mixers.attention import AttentionBias, KVCache
from torchneox.models.mixers.mla import MLA, mla_scale
from torchneox.models.mixers.sparse import SparseAttention, sparse_mask
from torchneox.models.positions import rotary_tables
from torchneox.models.transformer import build_model

MLA_KEYS = BASE | VARIANTS["mla"]


def _spread(model: torch.nn.Module) -> None:
    """Weights large enough that the logits tell positions and tokens apart."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_mla_equals_a_hand_written_deepseek_mla():
    _, model = build("mla")
    _spread(model)
    layer: MLA = model.layers["0"].attention
    b, t = 2, 7
    x = torch.randn(b, t, 64, generator=torch.Generator().manual_seed(2))
    cos, sin = rotary_tables(8, 10000.0, t)
    out = layer(x, (cos, sin), AttentionBias(None, is_causal=True))

    def rot(v):  # rotate-half rotary over the last 8 dimensions
        first, second = v.chunk(2, dim=-1)
        return v * cos + torch.cat((-second, first), -1) * sin

    q = layer.wq_b(_rms(layer.wq_a(x), layer.q_norm.weight)).view(b, t, 4, 20).transpose(1, 2)
    kv = layer.wkv_a(x)
    latent, k_rope = _rms(kv[..., :24], layer.kv_norm.weight), rot(kv[..., 24:])[:, None]
    up = layer.wkv_b(latent).view(b, t, 4, 28).transpose(1, 2)
    k = torch.cat((up[..., :12], k_rope.expand(-1, 4, -1, -1)), -1)
    q = torch.cat((q[..., :12], rot(q[..., 12:])), -1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(20)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    want = layer.wo((scores.softmax(-1) @ up[..., 12:]).transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_the_cache_holds_the_latent_and_decoding_equals_the_full_forward():
    _, model = build("mla")
    _spread(model)
    model.eval()
    tokens = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.args, 2, 16, torch.float32, "cpu")
        # per layer and token: the 24-wide latent and the 8 rotary dimensions, one "head"
        assert cache.k.shape == (2, 2, 1, 16, 24) and cache.v.shape == (2, 2, 1, 16, 8)
        steps = [model(tokens[:, :9], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(9, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_yarn_mscale_enters_the_softmax_scale():
    keys = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                             "mscale": 1.0, "mscale_all_dim": 1.0}}  # fmt: skip
    args = model_args(load_mapping(MLA_KEYS | keys, "yarn"))
    mscale = 0.1 * math.log(4.0) + 1.0
    assert mla_scale(args) == pytest.approx(mscale**2 / math.sqrt(20))


@pytest.mark.parametrize(
    "bad",
    [{"pos_emb": "alibi"}, {"num_kv_heads": 2}, {"use_qk_layernorm": True}, {"head_dim": 8}],
)
def test_options_mla_does_not_have_are_refused(bad):
    with pytest.raises(ConfigError, match="MLA"):
        model_args(load_mapping(MLA_KEYS | bad, "bad"))


def test_group_limited_routing_picks_from_the_best_groups():
    keys = {
        "num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 8,
        "pos_emb": "rotary", "padded_vocab_size": 32, "moe_num_experts": 8, "moe_top_k": 2,
        "moe_router_type": "topk", "moe_score_func": "sigmoid", "moe_renormalize_top_k": True,
        "moe_expert_groups": 4, "moe_topk_groups": 1, "moe_routed_scaling_factor": 2.5,
    }  # fmt: skip
    moe = build_model(model_args(load_mapping(keys, "groups")), seed=0).layers["0"].mlp
    logits = torch.tensor([[3.0, -3.0, 2.0, 2.0, 0.0, 0.0, 1.0, -5.0]])
    with torch.no_grad():
        experts, gates, _ = moe._route_scored(logits)
    # groups (0,1) (2,3) (4,5) (6,7) score 3-3, 2+2, 0+0, 1-5: group 1 wins though expert 0 is best
    assert sorted(experts[0].tolist()) == [2, 3]
    torch.testing.assert_close(gates, torch.full((1, 2), 1.25))
    assert F.sigmoid(logits).argmax().item() == 0


HYBRID = {
    "num_layers": 5,
    "attention_config": [[["global", "mamba", "rwkv", "amlp", "local"], 1]],
    "sparsity_config": {"block": 8},
    "gmlp_attn_dim": 16,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}
"""MLA's global and block-sparse layers beside a layer of every other family."""


def test_mla_runs_in_the_attention_layers_of_a_hybrid_and_each_layer_equals_its_piece():
    loaded = load_mapping(MLA_KEYS | HYBRID, "hybrid")
    model = build_model(model_args(loaded), seed=0).eval()
    _spread(model)
    plain_keys = {k: v for k, v in MLA_KEYS.items() if not k.startswith("mla")} | HYBRID
    plain = build_model(model_args(load_mapping(plain_keys, "plain")), seed=1).eval()
    alone = build_model(model_args(load_mapping(MLA_KEYS, "mla")), seed=2).eval()
    assert type(model.layers["0"].attention) is MLA
    assert isinstance(model.layers["4"].attention, MLA) and isinstance(
        model.layers["4"].attention, SparseAttention
    )
    t = 64
    x = torch.randn(2, t, 64, generator=torch.Generator().manual_seed(4))
    rope, causal = model._rope(None, 0, t), AttentionBias(None, is_causal=True)
    with torch.no_grad():
        for i, kind in enumerate(["global", "mamba", "rwkv", "amlp"]):
            piece = alone.layers["0"] if kind == "global" else plain.layers[str(i)]
            piece.load_state_dict(model.layers[str(i)].state_dict())
            out, _ = model.layers[str(i)](x, rope, causal, None)
            torch.testing.assert_close(out, piece(x, rope, causal, None)[0], rtol=0, atol=0)
        # the local layer: MLA under the layer's layout, the blocks outside it masked
        sparse = model.layers["4"].attention
        dense = alone.layers["0"].attention
        dense.load_state_dict(sparse.state_dict())
        positions = torch.arange(t)[None]
        allowed = sparse_mask(sparse.layout, 8, positions, positions)
        allowed = allowed & torch.ones(t, t, dtype=torch.bool).tril()
        assert not allowed[..., -1, :-8].all()  # the layout leaves some blocks out
        masked = dense(x, rope, AttentionBias(allowed, is_causal=False))
        torch.testing.assert_close(sparse(x, rope, causal), masked, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(dense(x, rope, causal), masked, atol=1e-3)


def test_a_hybrids_cache_holds_mla_latents_and_recurrent_states_and_decoding_equals_the_whole():
    model = build_model(model_args(load_mapping(MLA_KEYS | HYBRID, "hybrid")), seed=0).eval()
    _spread(model)
    tokens = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.args, 2, 16, torch.float32, "cpu")
        assert cache.k.shape == (2, 2, 1, 16, 24)  # the two attention layers' latents
        steps = [model(tokens[:, :9], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(9, 12)]
    # (logits up to ~7; the recurrent layers' states sum in another order one token at a time,
    # as they do in the same hybrid without MLA)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-4)
