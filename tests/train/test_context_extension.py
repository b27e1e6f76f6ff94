"""Context extension: a run trained at a short context continues at a 4x longer one from its
checkpoint, with the rotary change the config asks (rope scaling or a new base), on samples of
the new length; the resumed run says what changed."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import losses, train
from torchneox.checkpoint.weights import load_model
from torchneox.models.positions import rotary_tables

SHORT = ["seq_length=32", "max_position_embeddings=32", "train_iters=3"]
LONG = ["seq_length=128", "max_position_embeddings=128", "train_iters=5"]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ("rope_scaling={type: linear, factor: 4}", "rope_scaling unset -> {'type': 'linear'"),
        ("rotary_emb_base=500000", "rotary_emb_base 10000 -> 500000"),
    ],
    ids=["linear-scaling", "new-base"],
)
def test_a_short_context_run_continues_at_a_longer_one(make_config, tmp_path, change, said):
    cfg = make_config(rotary_pct=1.0, gpt_j_residual=False)
    run = tmp_path / "run"
    train(cfg, f"save={run}", f"load={run}", *SHORT)
    _, short = load_model(run)
    longer = train(cfg, f"save={run}", f"load={run}", *LONG, change)
    lines = [x for x in longer.stdout.splitlines() + longer.stderr.splitlines() if "context" in x]
    assert any("seq_length 32 -> 128" in x and said in x for x in lines), lines
    assert "4 x 128 tokens" in longer.stdout + longer.stderr
    assert sorted(losses(run)) == [1, 2, 3, 4, 5]
    loaded, extended = load_model(run)
    args = extended.args
    assert args.max_positions == 128 and extended.rope_cos.shape[0] == 128
    expected, _ = rotary_tables(args.rotary_dims, args.rotary_base, 128, args.rope_scaling)
    torch.testing.assert_close(extended.rope_cos, expected)
    if "linear" in change:  # positions stretched 4x: position 4p turns as p did
        torch.testing.assert_close(extended.rope_cos[::4], short.rope_cos[:32], atol=1e-5, rtol=0)
    assert loaded.config.model.seq_length == 128
