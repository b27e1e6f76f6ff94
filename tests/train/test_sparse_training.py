"""GPT-NeoX's sparse.yml (local attention every other layer) trains from the CLI, scaled down
with --set, and its loss falls."""

from __future__ import annotations

import pytest

from tests.conftest import shared_dir
from tests.helpers import losses
from torchneox.cli import main

SHARED = shared_dir()


@pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
def test_gpt_neox_sparse_config_trains_scaled_down(make_config, tmp_path, capsys):
    base = make_config(train_iters=16, warmup=0.1, gpt_j_residual=False)
    sparse = str(SHARED / "neox_configs" / "sparse.yml")
    scaled = [
        "num_layers=2",
        "hidden_size=64",
        "seq_length=64",
        # sparse.yml's window of 32 blocks covers all 4 blocks of 64 positions: 2 leave gaps
        "sparsity_config.num_local_blocks=2",
    ]
    assert (
        main(["config", "explain", base, sparse, *(a for o in scaled for a in ("--set", o))]) == 0
    )
    explained = capsys.readouterr().out
    assert "local 63.1% (layer 0)" in explained  # blocks i-1 and i of 4: 1312 of 2080 pairs
    assert main(["train", base, sparse, *(a for o in scaled for a in ("--set", o))]) == 0
    got = losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 17))
    assert got[16] < got[1] - 0.5
