"""Mixture-of-experts layers in the layouts that split them further: through pipeline stages
(with expert parallelism per stage, shared experts and DeepSeek-V3's router bias), under
sequence parallelism, and with context parallelism beside expert parallelism. Each gives the
losses, gradient norms and weights of one process."""

from __future__ import annotations

import pytest

from tests.helpers import assert_same_training, losses, reference, train


def test_moe_under_sequence_parallelism_equals_one_process(moe_config, tmp_path):
    """The sequence gathered before routing: every tensor rank routes what one process
    routes, the balancing loss included."""
    keys = ["moe_aux_loss_coeff=0.1", "train_iters=3"]
    train(moe_config, f"save={tmp_path / 'one'}", "load=null", *keys)
    sp = ["model_parallel_size=2", "sequence_parallel=true"]
    train(moe_config, f"save={tmp_path / 'sp'}", "load=null", *keys, *sp, nproc=2)
    assert_same_training(tmp_path / "sp", reference(tmp_path / "one"))
    one_aux = losses(tmp_path / "one", "moe_aux_loss")
    assert losses(tmp_path / "sp", "moe_aux_loss") == pytest.approx(one_aux, rel=1e-5)
