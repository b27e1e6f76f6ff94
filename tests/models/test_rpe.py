"""pos_emb rpe: T5's relative position buckets as GPT-NeoX builds them (one [buckets, heads]
table shared by every layer, its bias scaled by sqrt(head_dim) and added to the attention
scores): the buckets equal Hugging Face's T5 decoder's, the bias the model adds equals the
table read by hand, cached decoding equals the whole forward, GPT-NeoX's checkpoint tensor
is imported, and the keys' mistakes are one line."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.t5.modeling_t5 import T5Attention

from tests.helpers import build
from torchneox.base.errors import ConfigError
from torchneox.config.load import load_mapping
from torchneox.interop.gpt_neox_files import merge_shards, model_state
from torchneox.models.args import model_args
from torchneox.models.mixers.attention import KVCache
from torchneox.models.positions import relative_position_buckets


@pytest.mark.parametrize(("buckets", "distance"), [(32, 128), (8, 16), (16, 40)])
def test_buckets_equal_t5_decoder(buckets, distance):
    q, k = torch.arange(300)[:, None], torch.arange(300)[None, :]
    theirs = T5Attention._relative_position_bucket(
        k - q, bidirectional=False, num_buckets=buckets, max_distance=distance
    )
    assert torch.equal(relative_position_buckets(q - k, buckets, distance), theirs)
    # by hand: 0..15 exact, then 16 + log(n / 16) / log(8) x 16, capped at 31
    ours = relative_position_buckets(torch.tensor([0, 15, 16, 20, 127, 200]), 32, 128)
    assert ours.tolist() == [0, 15, 16, 16 + int(math.log(20 / 16) / math.log(8) * 16), 31, 31]


def test_bias_is_the_table_scaled_and_masked():
    _, model = build("rpe")
    a = model.args
    bias = model._attention_bias(10, 0, None, torch.device("cpu")).mask[0]  # [heads, T, S]
    table = model.rpe.weight.detach()
    for q in range(10):
        for k in range(10):
            if k > q:
                assert torch.isinf(bias[:, q, k]).all() and (bias[:, q, k] < 0).all()
                continue
            bucket = relative_position_buckets(torch.tensor(q - k), 8, 16)
            want = table[bucket] * math.sqrt(a.hidden_size // a.num_heads)
            torch.testing.assert_close(bias[:, q, k], want)
    # the table is shared: one tensor, not one per layer
    assert sum(n.endswith("rpe.weight") for n, _ in model.named_parameters()) == 1
    assert tuple(table.shape) == (8, a.num_heads)


def test_rpe_changes_the_output_and_decodes_with_its_cache():
    """GPT-NeoX's table at decoding time would see a query of length 1 at position 0 (every
    key in bucket 0); here a cached token reads the buckets of its real distances."""
    _, model = build("rpe")
    model.eval()
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        whole = model(tokens)
        cache = KVCache(model.args, 2, 12, torch.float32, "cpu")
        first = model(tokens[:, :8], cache=cache)
        steps = [model(tokens[:, i : i + 1], cache=cache) for i in range(8, 12)]
        model.rpe.weight.mul_(2.0)
        changed = model(tokens)
    torch.testing.assert_close(first, whole[:, :8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), whole[:, 8:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(changed, whole)


def test_gpt_neox_checkpoint_tensor_is_read():
    loaded, model = build("rpe")
    args = model_args(loaded)
    table = torch.randn(8, args.num_heads)
    # GPT-NeoX splits the table by heads over tensor ranks and saves it with every layer
    assert torch.equal(
        merge_shards("attention.rpe.weight", list(table.chunk(2, dim=1)), args), table
    )
    layers = {
        0: {"word_embeddings.weight": model.embed.weight.detach()},
        5: {"norm.weight": torch.ones(64)},
    }
    for i in range(2):
        layers[i + 2] = {"attention.rpe.weight": table}
    layers[6] = {"final_linear.weight": torch.zeros(1)}
    out = model_state(layers, args, 1.0)
    assert torch.equal(out["rpe.weight"], table)


def test_max_distance_must_pass_the_exact_buckets():
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}
    with pytest.raises(
        ConfigError, match="rpe_max_distance: 8 must exceed rpe_num_buckets / 2 = 8"
    ):
        load_mapping(base | {"pos_emb": "rpe", "rpe_num_buckets": 16, "rpe_max_distance": 8}, "x")
