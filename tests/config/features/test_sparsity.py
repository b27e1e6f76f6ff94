"""sparsity_config is a real key: GPT-NeoX's sparse.yml explains on its own, and every wrong
field, type or DeepSpeed rule is one line naming the file, the key and the field, exit 2."""

from __future__ import annotations

import pytest

from tests.conftest import shared_dir
from torchneox.cli import main

SIZED = (
    "{num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 64, "
    "attention_config: [[[%s, global], all]], sparsity_config: %s}"
)

CASES = [
    ("local", "{blok: 16}", "'blok' is not a field of sparsity_config; did you mean block?"),
    ("local", "{block: 24}", "block 24 does not divide seq_length 64"),
    ("local", "{block: 0}", "block is an integer >= 1, got 0"),
    ("bigbird", "{num_random_blocks: two}", "num_random_blocks is an integer >= 0, got 'two'"),
    ("bigbird", "{different_layout_per_head: 1}", "different_layout_per_head is true or false"),
    ("local", "{attention: sideways}", "attention is unidirectional or bidirectional"),
    ("local", "[16]", "expected a mapping, got [16]"),  # the loader's check
    ("sparse_variable", "{local_window_blocks: [0]}", "local_window_blocks is a list of block"),
    ("sparse_fixed", "{num_local_blocks: 4, num_global_blocks: 3}", "num_global_blocks 3 does"),
    (
        "sparse_fixed",
        "{num_different_global_patterns: 2}",
        "num_different_global_patterns > 1 needs different_layout_per_head: true",
    ),
    ("sparse_fixed", "{horizontal_global_attention: true}", "horizontal_global_attention needs"),
    (
        "bslongformer",
        "{global_block_indices: [0, 2], global_block_end_indices: [1]}",
        "global_block_end_indices has 1 entries, global_block_indices 2",
    ),
    (
        "sparse_variable",
        "{global_block_indices: [2], global_block_end_indices: [2]}",
        "global_block_end_indices: end 2 is not after its start 2",
    ),
]


@pytest.mark.parametrize(("kind", "spec", "fragment"), CASES)
def test_a_wrong_sparsity_config_is_one_line(write, capsys, kind, spec, fragment):
    path = write("a.yml", SIZED % (kind, spec))
    assert main(["config", "explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"a.yml: sparsity_config: {fragment}" in err


def test_positions_past_the_layout_are_refused(write, capsys):
    path = write("a.yml", SIZED % ("local", "{}"))
    assert main(["config", "explain", str(path), "--set", "max_position_embeddings=128"]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings: 128 is longer than seq_length 64" in err
    assert err.count("\n") == 1


def test_all_needs_a_pattern_that_divides_the_layers(write, capsys):
    path = write("a.yml", SIZED % ("local", "{}"))
    assert main(["config", "explain", str(path), "--set", "num_layers=3"]) == 2
    assert "'all' repeats ['local', 'global'] over 3 layers" in capsys.readouterr().err


@pytest.mark.skipif(shared_dir() is None, reason="../shared is not on this machine")
def test_gpt_neox_sparse_config_explains(capsys):
    sparse = shared_dir() / "neox_configs" / "sparse.yml"
    assert main(["config", "explain", str(sparse)]) == 0  # a fragment: no model to lay out yet
    sized = ["--set", "num_layers=4", "--set", "hidden_size=64", "--set", "num_attention_heads=4"]
    sized += ["--set", "seq_length=2048"]
    capsys.readouterr()
    assert main(["config", "explain", str(sparse), *sized]) == 0
    out = capsys.readouterr().out
    # a window of 32 blocks is blocks i-16..i (DeepSpeed halves it) of 128 blocks
    assert "local 24.2% (layers 0, 2)" in out
