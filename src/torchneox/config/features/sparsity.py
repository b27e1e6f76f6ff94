"""Block-sparse attention layouts (GPT-NeoX's ``local``, ``sparse_fixed``, ``sparse_variable``,
``bigbird`` and ``bslongformer`` layer types): ``sparsity_config`` read once and checked, and
each layer's block layout built by DeepSpeed's rules (DeeperSpeed
``deepspeed/ops/sparse_attention/sparsity_config.py``, with the arguments GPT-NeoX's
``configure_sparse_attention`` passes).

A layout is a bool array [heads, blocks, blocks] over ``seq_length`` positions (block
``block``): query block i may attend to key block j. The model ANDs it with the causal mask at
the positions of each call (models/mixers/sparse.py); the estimator counts the pairs it lets
through. It lives on this floor because ``config explain`` and ``estimate`` count from it, in
numpy: a torch operation in the process that forks the dry run's ranks hangs them (the
intra-op thread pool does not survive a fork).

Departures from DeepSpeed, all listed in docs/migrating-from-gpt-neox.md: each layer draws its
random blocks from its own generator (seeded by the layer's index), where DeepSpeed draws from
the process's ``random`` state once and reuses one layout for every layer; a window or a
number of random or global blocks larger than the sequence covers the whole of it (DeepSpeed
raises, and its causal BigBird fails as soon as ``num_random_blocks`` > 1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchneox.base.errors import did_you_mean

SPARSE_TYPES = ("local", "sparse_fixed", "sparse_variable", "bigbird", "bslongformer")
ATTENTION_LAYER_TYPES = ("global", "flash", *SPARSE_TYPES)
"""The attention_config types that are attention (dense or block-sparse)."""

FIELDS: dict[str, Any] = {
    "block": 16,
    "different_layout_per_head": False,
    "num_local_blocks": 4,
    "num_sliding_window_blocks": None,
    "num_global_blocks": 1,
    "num_different_global_patterns": 1,
    "num_random_blocks": None,
    "local_window_blocks": [4],
    "global_block_indices": [0],
    "global_block_end_indices": None,
    "attention": "unidirectional",
    "horizontal_global_attention": False,
}
"""Every field of sparsity_config and its default (GPT-NeoX's ``.get`` defaults; the number of
random blocks and the sliding window default by type). ``attention`` and
``horizontal_global_attention`` are torchneox's: GPT-NeoX fixes them to unidirectional and
off."""
BOOLS = ("different_layout_per_head", "horizontal_global_attention")
LISTS = ("local_window_blocks", "global_block_indices", "global_block_end_indices")
POSITIVE = ("block", "num_local_blocks", "num_sliding_window_blocks", "num_global_blocks")
POSITIVE += ("num_different_global_patterns",)
ATTENTION_MODES = ("unidirectional", "bidirectional")


@dataclass(frozen=True)
class Sparsity:
    """One layer type's layout settings, sparsity_config's fields with GPT-NeoX's defaults."""

    kind: str
    block: int
    per_head: bool
    local: int
    """num_local_blocks (sparse_fixed), the sliding window (local, bigbird, bslongformer)."""
    global_blocks: int
    patterns: int
    random_blocks: int
    windows: tuple[int, ...]
    global_starts: tuple[int, ...]
    global_ends: tuple[int, ...] | None
    bidirectional: bool
    horizontal: bool


def sparsity(kind: str, spec: dict[str, Any] | None) -> Sparsity:
    """The settings of layer type ``kind`` from sparsity_config ``spec`` (checked already)."""
    s = dict(FIELDS) | dict(spec or {})
    window = s["num_sliding_window_blocks"]
    if kind == "local":  # num_local_blocks, else num_sliding_window_blocks, else 4
        local = (spec or {}).get("num_local_blocks", window if window is not None else 4)
    elif kind == "sparse_fixed":
        local = s["num_local_blocks"]
    else:
        local = 3 if window is None else window
    default_random = 1 if kind == "bigbird" else 0
    ends = s["global_block_end_indices"]
    return Sparsity(
        kind=kind,
        block=s["block"],
        per_head=s["different_layout_per_head"] and kind != "local",
        local=local,
        global_blocks=s["num_global_blocks"],
        patterns=s["num_different_global_patterns"],
        random_blocks=default_random if s["num_random_blocks"] is None else s["num_random_blocks"],
        windows=tuple(s["local_window_blocks"]),
        global_starts=tuple(s["global_block_indices"]),
        global_ends=None if ends is None else tuple(ends),
        bidirectional=s["attention"] == "bidirectional",
        horizontal=s["horizontal_global_attention"],
    )


def check_sparsity(spec: Any, kinds: list[str], seq_length: int | None) -> tuple[str, str] | None:
    """The first mistake of sparsity_config ``spec`` for the layer types ``kinds``, as (field,
    message), or None. Fields are checked whether or not a sparse layer reads them."""
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        return "", f"must be a mapping of fields ({', '.join(FIELDS)}), got {spec!r}"
    for name, value in spec.items():
        problem = _field_problem(name, value)
        if problem:
            return name, problem
    for kind in sorted(set(kinds) & set(SPARSE_TYPES)):
        problem = _rule_problem(sparsity(kind, spec), seq_length)
        if problem:
            return problem
    return None


def _field_problem(name: str, value: Any) -> str | None:
    if name not in FIELDS:
        return f"{name!r} is not a field of sparsity_config{did_you_mean(name, list(FIELDS))}"
    if name in BOOLS:
        return None if isinstance(value, bool) else f"{name} is true or false, got {value!r}"
    if name == "attention":
        ok = value in ATTENTION_MODES
        return None if ok else f"attention is unidirectional or bidirectional, got {value!r}"
    if name in LISTS:
        if value is None and name == "global_block_end_indices":
            return None
        ok = isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value)
        ok = ok and (name != "local_window_blocks" or (value and min(value) > 0))
        return None if ok else f"{name} is a list of block indices (integers >= 0), got {value!r}"
    if value is None and name in ("num_sliding_window_blocks", "num_random_blocks"):
        return None
    low = 1 if name in POSITIVE else 0
    if not _is_int(value) or value < low:
        return f"{name} is an integer >= {low}, got {value!r}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rule_problem(s: Sparsity, seq_length: int | None) -> tuple[str, str] | None:
    """DeepSpeed's checks of the arguments (and the sequence length a multiple of the block)."""
    if seq_length and seq_length % s.block:
        return "block", (
            f"block {s.block} does not divide seq_length {seq_length} (DeepSpeed's rule for "
            "block-sparse layouts); set a block that divides it"
        )
    if s.horizontal and not s.bidirectional and s.kind in ("sparse_fixed", "sparse_variable"):
        return (
            "horizontal_global_attention",
            "horizontal_global_attention needs attention: bidirectional (DeepSpeed's rule)",
        )
    if s.kind == "sparse_fixed":
        if s.local % s.global_blocks:
            return "num_global_blocks", (
                f"num_global_blocks {s.global_blocks} does not divide num_local_blocks {s.local} (DeepSpeed's rule)"
            )
        if s.patterns > 1 and not s.per_head:
            return (
                "num_different_global_patterns",
                "num_different_global_patterns > 1 needs different_layout_per_head: true",
            )
        if s.patterns > s.local // s.global_blocks:
            return "num_different_global_patterns", (
                f"num_different_global_patterns {s.patterns} is more than num_local_blocks / num_global_blocks = "
                f"{s.local // s.global_blocks}"
            )
    if s.kind in ("sparse_variable", "bslongformer") and s.global_ends is not None:
        if len(s.global_ends) != len(s.global_starts):
            return "global_block_end_indices", (
                f"global_block_end_indices has {len(s.global_ends)} entries, global_block_indices "
                f"{len(s.global_starts)}; give one end per start"
            )
        for start, end in zip(s.global_starts, s.global_ends, strict=True):
            if start >= end:
                return "global_block_end_indices", (
                    f"global_block_end_indices: end {end} is not after its start {start}"
                )
    return None


def layout_seed(layer: int) -> int:
    """The seed of layer ``layer``'s random blocks (each layer its own layout)."""
    return 1_000_003 * (layer + 1)


def build_layout(s: Sparsity, heads: int, seq_length: int, layer: int) -> np.ndarray:
    """Layer ``layer``'s layout, bool [heads, blocks, blocks] (one head's when every head shares
    it: [1, blocks, blocks]), by DeepSpeed's rules for ``s.kind``."""
    n = seq_length // s.block
    rng = random.Random(layout_seed(layer))
    count = heads if s.per_head else 1
    layout = np.zeros((count, n, n), dtype=bool)
    for h in range(count):
        one = layout[h]
        if s.kind == "local":
            _sliding(one, s.local, s.bidirectional)
        elif s.kind == "sparse_fixed":
            _fixed_local(one, s)
            _fixed_global(one, s, h)
        elif s.kind == "sparse_variable":
            _random(one, s.random_blocks, rng, causal_range=False)
            _variable_local(one, s)
            _global_columns(one, s, first_row_at_start=not s.bidirectional)
        elif s.kind == "bigbird":
            _random(one, s.random_blocks, rng, causal_range=not s.bidirectional)
            _sliding(one, s.local, bidirectional=True)
            g = min(s.global_blocks, n)
            one[:g, :] = True
            one[:, :g] = True
        else:  # bslongformer
            _sliding(one, s.local, bidirectional=True)
            _global_columns(one, s, first_row_at_start=False, rows=True)
        if not s.bidirectional and s.kind in ("bigbird", "bslongformer"):
            layout[h] = np.tril(one)
    return layout


def _sliding(one: np.ndarray, window: int, bidirectional: bool) -> None:
    n, w = one.shape[0], window // 2
    for row in range(n):
        one[row, max(0, row - w) : (min(row + w + 1, n) if bidirectional else row + 1)] = True


def _random(one: np.ndarray, k: int, rng: random.Random, causal_range: bool) -> None:
    n = one.shape[0]
    for row in range(n):
        population = range(row + 1) if causal_range else range(n)
        one[row, rng.sample(population, min(k, len(population)))] = True


def _windows(one: np.ndarray, start: int, end: int, bidirectional: bool) -> None:
    for row in range(start, end):
        one[row, start : (end if bidirectional else row + 1)] = True


def _fixed_local(one: np.ndarray, s: Sparsity) -> None:
    n = one.shape[0]
    for i in range(0, n, s.local):
        _windows(one, i, min(i + s.local, n), s.bidirectional)


def _fixed_global(one: np.ndarray, s: Sparsity, h: int) -> None:
    n, g = one.shape[0], s.global_blocks
    first = s.local - (1 + h % s.patterns) * g
    end = n - n % s.local
    starts = list(range(first, end, s.local))
    if end < n:  # the last, short window
        starts.append(max(0, min(end + first, n - g)))
    for i in starts:
        one[0 if s.bidirectional else i :, i : i + g] = True
        if s.horizontal:
            one[i : i + g, :] = True


def _variable_local(one: np.ndarray, s: Sparsity) -> None:
    n, start = one.shape[0], 0
    for size in s.windows:
        _windows(one, start, min(start + size, n), s.bidirectional)
        start += size
    for i in range(start, n, s.windows[-1]):  # the rest in windows of the last size
        _windows(one, i, min(i + s.windows[-1], n), s.bidirectional)


def _global_columns(
    one: np.ndarray, s: Sparsity, first_row_at_start: bool, rows: bool = False
) -> None:
    """Global blocks: columns every later (or every) row attends to; ``rows`` (or horizontal
    global attention): the global blocks attend to every block."""
    n = one.shape[0]
    ends = s.global_ends or tuple(i + 1 for i in s.global_starts)
    for start, end in zip(s.global_starts, ends, strict=True):
        if start >= n:
            continue
        end = min(end, n)
        if rows or s.horizontal:
            one[start:end, :] = True
        one[start if first_row_at_start else 0 :, start:end] = True


def causal_density(layout: np.ndarray, block: int) -> float:
    """The share of a causal [seq, seq] attention matrix's (query, key) pairs with key <= query
    that ``layout`` [heads, blocks, blocks] lets through, averaged over its heads."""
    n = layout.shape[-1]
    below = np.tril(layout, -1).sum(axis=(-2, -1)) * block * block  # whole blocks
    diagonal = np.diagonal(layout, axis1=-2, axis2=-1).sum(-1) * (block * (block + 1) // 2)
    causal_pairs = n * block * (n * block + 1) / 2
    return float((below + diagonal).mean()) / causal_pairs
