"""Each block-sparse type's layout equals DeepSpeed's rules (DeeperSpeed
sparsity_config.py, with the arguments GPT-NeoX's configure_sparse_attention passes), written
out here block by block from the rules' formulas, random blocks drawn in DeepSpeed's order
from the layer's generator."""

from __future__ import annotations

import random

import pytest
import torch

from torchneox.config.features.sparsity import build_layout, causal_density, layout_seed, sparsity


def expected(n: int, heads: int, allowed) -> torch.Tensor:
    """[heads, n, n] from a predicate allowed(h, i, j)."""
    return torch.tensor(
        [[[bool(allowed(h, i, j)) for j in range(n)] for i in range(n)] for h in range(heads)]
    )


def random_picks(layer: int, heads: int, n: int, k: int, causal_range: bool) -> list:
    """picks[h][i]: the random blocks of row i of head h, drawn as DeepSpeed draws them (per
    head, row after row, random.sample of k from the row's range)."""
    rng = random.Random(layout_seed(layer))
    return [
        [set(rng.sample(range(i + 1) if causal_range else range(n), k)) for i in range(n)]
        for _ in range(heads)
    ]


def layout(kind: str, spec: dict, heads: int, seq: int, layer: int = 0) -> torch.Tensor:
    got = torch.from_numpy(build_layout(sparsity(kind, spec), heads, seq, layer))
    return got.expand(heads, -1, -1) if got.shape[0] == 1 else got


@pytest.mark.parametrize("window", [1, 3, 4, 32])
def test_local_is_a_causal_sliding_window_of_half_the_blocks(window):
    # LocalSlidingWindowSparsityConfig, unidirectional: row i sees blocks i - window//2 .. i
    n = 8
    got = layout("local", {"num_local_blocks": window}, 2, 16 * n)
    assert torch.equal(got, expected(n, 2, lambda h, i, j: i - window // 2 <= j <= i))
    # num_sliding_window_blocks is read when num_local_blocks is absent; default 4
    alias = layout("local", {"num_sliding_window_blocks": window}, 2, 16 * n)
    assert torch.equal(alias, got)
    default = layout("local", {}, 1, 16 * n)
    assert torch.equal(default, expected(n, 1, lambda h, i, j: i - 2 <= j <= i))


@pytest.mark.parametrize(
    ("n", "local", "glob", "patterns", "bidirectional", "horizontal"),
    [
        (10, 4, 1, 1, False, False),  # GPT-NeoX's defaults, a short last window
        (12, 4, 2, 2, False, False),  # two global blocks, a pattern per head
        (10, 4, 1, 4, True, True),  # bidirectional with horizontal global attention
    ],
)
def test_sparse_fixed(n, local, glob, patterns, bidirectional, horizontal):
    spec = {
        "block": 16,
        "num_local_blocks": local,
        "num_global_blocks": glob,
        "num_different_global_patterns": patterns,
        "different_layout_per_head": patterns > 1,
        "attention": "bidirectional" if bidirectional else "unidirectional",
        "horizontal_global_attention": horizontal,
    }
    heads = 4
    full = n - n % local  # the windows of num_local_blocks blocks

    def global_starts(h):
        first = local - (1 + h % patterns) * glob  # each head's representative blocks
        starts = [w + first for w in range(0, full, local)]
        if full < n:  # the last short window's, kept inside the sequence
            starts.append(min(full + first, n - glob))
        return starts

    def allowed(h, i, j):
        same_window = i // local == j // local and (bidirectional or j <= i)
        for g in global_starts(h):
            if g <= j < g + glob and (bidirectional or i >= g):
                return True
            if horizontal and g <= i < g + glob:
                return True
        return same_window

    got = layout("sparse_fixed", spec, heads, 16 * n)
    assert torch.equal(got, expected(n, heads, allowed))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("ends", [None, [2, 8]])
def test_sparse_variable(per_head, ends):
    n, heads, k, layer = 12, 2, 2, 3
    windows, starts = [2, 3], [0, 6]
    spec = {
        "num_random_blocks": k,
        "local_window_blocks": windows,
        "global_block_indices": starts,
        "global_block_end_indices": ends,
        "different_layout_per_head": per_head,
    }
    # windows: [0, 2), [2, 5), then windows of the last size: [5, 8), [8, 11), [11, 12)
    bounds = [0, 2, 5, 8, 11, 12]
    window_of = [max(w for w, b in enumerate(bounds) if b <= i) for i in range(n)]
    picks = random_picks(layer, heads if per_head else 1, n, k, causal_range=False)
    spans = [(s, s + 1) for s in starts] if ends is None else list(zip(starts, ends, strict=True))

    def allowed(h, i, j):
        rnd = j in picks[h if per_head else 0][i]
        local = window_of[i] == window_of[j] and j <= i
        glob = any(s <= j < e and i >= s for s, e in spans)  # vertical, from its own row on
        return rnd or local or glob

    got = layout("sparse_variable", spec, heads, 16 * n, layer)
    assert torch.equal(got, expected(n, heads, allowed))


@pytest.mark.parametrize("per_head", [False, True])
def test_bigbird(per_head):
    n, heads, k, window, glob, layer = 10, 3, 2, 3, 2, 5
    spec = {
        "different_layout_per_head": per_head,
        "num_random_blocks": k,
        "num_sliding_window_blocks": window,
        "num_global_blocks": glob,
    }
    # unidirectional BigBird draws among the blocks up to its row (DeepSpeed fails when the
    # row has fewer than num_random_blocks; torchneox takes them all)
    rng = random.Random(layout_seed(layer))
    picks = [
        [set(rng.sample(range(i + 1), min(k, i + 1))) for i in range(n)]
        for _ in range(heads if per_head else 1)
    ]

    def allowed(h, i, j):
        rnd = j in picks[h if per_head else 0][i]
        near = abs(i - j) <= window // 2
        return j <= i and (rnd or near or i < glob or j < glob)

    got = layout("bigbird", spec, heads, 16 * n, layer)
    assert torch.equal(got, expected(n, heads, allowed))


@pytest.mark.parametrize("ends", [None, [3, 7]])
def test_bslongformer(ends):
    n, window, starts = 10, 5, [1, 5]
    spec = {
        "num_sliding_window_blocks": window,
        "global_block_indices": starts,
        "global_block_end_indices": ends,
    }
    spans = [(s, s + 1) for s in starts] if ends is None else list(zip(starts, ends, strict=True))

    def allowed(h, i, j):
        glob = any(s <= i < e or s <= j < e for s, e in spans)  # global rows and columns
        return j <= i and (abs(i - j) <= window // 2 or glob)

    got = layout("bslongformer", spec, 2, 16 * n)
    assert torch.equal(got, expected(n, 2, allowed))


def test_gpt_neox_defaults_per_type():
    # the defaults GPT-NeoX's configure_sparse_attention passes when sparsity_config is empty
    n = 6
    assert sparsity("bigbird", None).random_blocks == 1
    assert sparsity("sparse_variable", None).random_blocks == 0
    assert sparsity("bslongformer", None).local == sparsity("bigbird", None).local == 3
    assert sparsity("sparse_fixed", None).local == sparsity("local", None).local == 4
    local = layout("local", {}, 1, 16 * n)
    assert torch.equal(local, expected(n, 1, lambda h, i, j: i - 2 <= j <= i))


def test_each_layer_draws_its_own_random_blocks():
    spec = sparsity("bigbird", {"num_random_blocks": 3, "num_sliding_window_blocks": 1})
    a, b = (torch.from_numpy(build_layout(spec, 1, 16 * 32, layer)) for layer in (0, 1))
    assert not torch.equal(a, b)  # DeepSpeed reuses one layout for every layer
    assert torch.equal(a, torch.from_numpy(build_layout(spec, 1, 16 * 32, 0)))  # each is fixed


def test_causal_density_counts_the_pairs_the_layout_lets_through():
    block, n = 4, 3
    full = torch.ones(1, n, n, dtype=torch.bool).numpy()
    assert causal_density(full, block) == 1.0
    diagonal = torch.eye(n, dtype=torch.bool)[None].numpy()
    # each diagonal block holds block * (block + 1) / 2 causal pairs, of L (L + 1) / 2
    assert causal_density(diagonal, block) == pytest.approx(n * 10 / (12 * 13 / 2))
