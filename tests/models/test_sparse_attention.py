"""Block-sparse attention in the model: a layer equals dense SDPA under its layout expanded
to positions and ANDed with the causal mask; generation with a KV cache (dynamic and static)
equals recomputation; the counts equal the model; tensor-parallel ranks take their heads'
layouts; FlexAttention on CUDA equals the dense path."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import BASE
from torchneox.base.errors import HFError
from torchneox.config.derive import derive
from torchneox.config.load import load_mapping
from torchneox.config.sizes import count
from torchneox.inference.generate import Sampling, generate
from torchneox.models.args import model_args
from torchneox.models.hf.architectures import export_architecture
from torchneox.models.mixers import sparse
from torchneox.models.mixers.attention import AttentionBias, KVCache, StaticKVCache
from torchneox.models.mixers.sparse import SparseAttention
from torchneox.models.transformer import build_model

SPARSE = {
    "local": {"num_local_blocks": 2},
    "sparse_fixed": {"num_local_blocks": 2, "num_different_global_patterns": 2},
    "sparse_variable": {"num_random_blocks": 1, "local_window_blocks": [1, 2]},
    "bigbird": {"num_random_blocks": 2, "num_sliding_window_blocks": 1},
    "bslongformer": {"num_sliding_window_blocks": 1, "global_block_indices": [1]},
}


def sparse_model(kind: str, **keys):
    spec = {"block": 8, "different_layout_per_head": True} | SPARSE[kind]
    config = BASE | {
        "pos_emb": "rotary",
        "attention_config": [[[kind, "global"], "all"]],
        "sparsity_config": spec,
    }
    loaded = load_mapping(config | keys, kind)
    return loaded, build_model(model_args(loaded), seed=3)


def expanded(layout: torch.Tensor, block: int, t: int) -> torch.Tensor:
    """[heads, t, t]: each block of the layout repeated over its positions, causal."""
    full = layout.repeat_interleave(block, 1).repeat_interleave(block, 2)[:, :t, :t]
    return full & torch.ones(t, t, dtype=torch.bool).tril()


@pytest.mark.parametrize("kind", list(SPARSE))
def test_layer_equals_dense_sdpa_with_the_expanded_layout(kind):
    _, model = sparse_model(kind)
    layer = model.layers["0"].attention
    assert isinstance(layer, SparseAttention)
    assert not isinstance(model.layers["1"].attention, SparseAttention)
    x = torch.randn(2, 64, 64)
    got = layer(x, None, AttentionBias(None, is_causal=True))
    b, t, _ = x.shape
    q, k, v = (w(x).view(b, t, 4, 16).transpose(1, 2) for w in (layer.wq, layer.wk, layer.wv))
    mask = expanded(layer.layout.expand(4, -1, -1), 8, t)
    assert not mask.all()  # the layout does drop pairs
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None])
    want = layer.wo(dense.transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(got, want)
    # a sequence shorter than the layout takes its first blocks (no multiple of the block)
    short = layer(x[:, :21], None, AttentionBias(None, is_causal=True))
    torch.testing.assert_close(short, _reference(layer, x[:, :21], expanded(layer.layout, 8, 21)))


def _reference(layer, x, mask):
    b, t, _ = x.shape
    q, k, v = (w(x).view(b, t, 4, 16).transpose(1, 2) for w in (layer.wq, layer.wk, layer.wv))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None])
    return layer.wo(out.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("kind", ["bigbird", "sparse_fixed"])
@pytest.mark.parametrize("cache_kind", [KVCache, StaticKVCache])
def test_decoding_with_a_kv_cache_equals_recomputation(kind, cache_kind):
    _, model = sparse_model(kind, init_method_std=0.3)
    model.eval()
    tokens = torch.randint(0, 64, (2, 48))
    with torch.no_grad():
        whole = model(tokens)
        cache = cache_kind(model.args, 2, 48, torch.float32, "cpu")
        steps = [model(tokens[:, :17], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(17, 48)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("loop", ["dynamic", "static"])
def test_left_padded_prompts_decode_as_alone(loop):
    # a row's layout is taken at its own positions, not at its cache slots
    _, model = sparse_model("sparse_fixed", init_method_std=0.3)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [10, 11], [12, 13, 14]]
    batched = generate(model, prompts, Sampling(maximum_tokens=40, decode_loop=loop))
    alone = [generate(model, [p], Sampling(maximum_tokens=40, use_cache=False))[0] for p in prompts]
    assert batched == alone
    assert all(len(c) == 40 for c in batched)
    model.eval()
    pads, prompt = 8, torch.randint(0, 64, (1, 30))
    padded = torch.cat([torch.zeros(1, pads, dtype=torch.long), prompt], 1)
    valid = torch.arange(38)[None] >= pads
    positions = (torch.arange(38)[None] - pads).clamp(min=0)
    with torch.no_grad():
        got = model(padded, positions_BT=positions, key_valid_BS=valid)[:, pads:]
        torch.testing.assert_close(got, model(prompt), atol=1e-4, rtol=1e-4)


def test_the_layout_changes_what_a_token_sees():
    _, model = sparse_model("local")
    model.eval()
    tokens = torch.randint(0, 64, (1, 64))
    changed = tokens.clone()
    changed[:, :8] = (tokens[:, :8] + 1) % 64  # block 0, outside the local window of block 3+
    with torch.no_grad():
        a, b = (model.layers["0"](model.embed(t), None, AttentionBias(None, True))[0]
                for t in (tokens, changed))  # fmt: skip
    torch.testing.assert_close(a[:, 24:], b[:, 24:])
    assert not torch.allclose(a[:, 8:16], b[:, 8:16])


@pytest.mark.parametrize("kind", list(SPARSE))
def test_counts_equal_the_model_and_flops_count_the_attended_pairs(kind):
    loaded, model = sparse_model(kind)
    derived = derive(loaded)
    assert sum(p.numel() for p in model.parameters()) == derived["num_parameters"]
    dense = load_mapping(BASE | {"pos_emb": "rotary"}, "dense")
    assert derived["num_parameters"] == derive(dense)["num_parameters"]
    # scores and weighted values: 4 FLOPs per (query, key) pair per head dimension, forward;
    # global attention counts seq_length keys per token, a sparse layer the share of causal
    # pairs its layout keeps
    layout = model.layers["0"].attention.layout.expand(4, -1, -1)
    kept = expanded(layout, 8, 64).sum().item() / 4
    share = kept / (64 * 65 / 2)
    saved = 3 * 4 * 4 * 16 * 64 * (1 - share)
    padded = derived["padded_vocab_size"]
    gap = count(dense.config, padded).flops_per_token - count(loaded.config, padded).flops_per_token
    assert gap == pytest.approx(saved, abs=3)


def test_tensor_parallel_ranks_take_their_heads_layouts():
    _, model = sparse_model("bigbird")
    layer = model.layers["0"].attention
    whole = layer.layout.clone()
    assert not torch.equal(whole[0], whole[3])  # each head its own random blocks
    layer.keep_heads(1, 2)
    assert torch.equal(layer._head_layouts(), whole[2:4])


def _flex_and_dense(layer, x):
    """The layer's FlexAttention path and its dense path on the same queries, keys and values."""
    b, t, _ = x.shape
    q, k = layer._queries_keys(x)
    v = layer.wv(x).view(b, t, -1, layer.head_dim).transpose(1, 2)
    positions = torch.arange(t, device=x.device)
    dense = layer._attend(q, k, v, AttentionBias(None, False, positions=(positions, positions)))
    return layer._flex(q, k, v), dense


@pytest.mark.parametrize("kind", list(SPARSE))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_flex_block_mask_equals_the_dense_mask(kind, kv_heads, monkeypatch):
    # on the CPU FlexAttention runs forward only and unfused (eager): enough to hold the block
    # mask built from the layout to the dense mask, per head and under GQA
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(sparse, "_COMPILED_FLEX", flex_attention)
    _, model = sparse_model(kind, num_kv_heads=kv_heads)
    with torch.no_grad():
        flex, dense = _flex_and_dense(model.layers["0"].attention, torch.randn(2, 64, 64))
    torch.testing.assert_close(flex, dense)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA")
@pytest.mark.parametrize("kind", list(SPARSE))
def test_flex_attention_equals_the_dense_path_on_cuda(kind):
    _, model = sparse_model(kind, num_kv_heads=2)
    layer = model.layers["0"].attention.cuda()
    layer.init_buffers("cuda")
    x = torch.randn(2, 64, 64, device="cuda", requires_grad=True)
    # the layer takes FlexAttention for a whole causal sequence on CUDA
    whole = layer(x, None, AttentionBias(None, is_causal=True))
    flex, dense = _flex_and_dense(layer, x)
    torch.testing.assert_close(whole, layer.wo(flex.transpose(1, 2).reshape(2, 64, -1)))
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)
    (grad_flex,) = torch.autograd.grad(flex.square().sum(), x)
    (grad_dense,) = torch.autograd.grad(dense.square().sum(), x)
    torch.testing.assert_close(grad_flex, grad_dense, atol=1e-4, rtol=1e-4)


def test_export_to_hugging_face_is_refused_in_one_line():
    _, model = sparse_model("local")
    with pytest.raises(HFError, match=r"block-sparse layers \(local; Hugging Face attends"):
        export_architecture(model.args)
