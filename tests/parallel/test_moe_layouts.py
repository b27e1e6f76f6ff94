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


def test_context_parallelism_beside_expert_parallelism_equals_one_process(moe_config, tmp_path):
    """Two context ranks x two expert-parallel ranks: each context rank's tokens reach the
    experts of its own group; the expert gradients are summed over the context ranks too."""
    keys = ["moe_aux_loss_coeff=0.1", "train_iters=3"]
    train(moe_config, f"save={tmp_path / 'one'}", "load=null", *keys)
    # micro-batches of 2 on each of the 2 data-parallel ranks: one process's micro-batches of 4
    layout = [
        "context_parallel_size=2",
        "expert_parallel_size=2",
        "train_micro_batch_size_per_gpu=2",
    ]
    train(moe_config, f"save={tmp_path / 'cp'}", "load=null", *keys, *layout, nproc=4)
    assert_same_training(tmp_path / "cp", reference(tmp_path / "one"))
    one_aux = losses(tmp_path / "one", "moe_aux_loss")
    assert losses(tmp_path / "cp", "moe_aux_loss") == pytest.approx(one_aux, rel=1e-5)
