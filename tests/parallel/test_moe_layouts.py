"""Mixture-of-experts layers in the layouts that split them further: through pipeline stages
(expert parallelism per stage), with context parallelism beside expert parallelism, and under
sequence parallelism; with shared experts, DeepSeek-V3's router bias and a multi-token
prediction module. Each gives the losses, MTP losses, gradient norms, balancing losses and
weights of one process, and each resumes in its own layout bitwise: the router bias, the
balancing loss and the MTP module are in what a checkpoint keeps."""

from __future__ import annotations

import pytest

from tests.helpers import assert_resumes_bitwise, assert_same_training, losses, reference, train

DEEPSEEK = [
    "moe_aux_loss_coeff=0.1",
    "moe_score_func=sigmoid",
    "moe_renormalize_top_k=true",
    "moe_router_bias_update_rate=0.01",
    "moe_shared_expert_intermediate_size=32",
    "moe_shared_expert_gate=true",
    "mtp_num_layers=1",
    "mtp_loss_scaling_factor=0.3",
    "train_iters=6",
    "extra_save_iters=[1,3,5]",
]
# two steps in each layout, each resuming the one before: micro-batches of 2 on each of 2
# data-parallel ranks, or 4 on one, are one process's micro-batches of 4
LEGS = [
    (4, ["pipe_parallel_size=2", "expert_parallel_size=2", "train_micro_batch_size_per_gpu=2"]),
    (
        4,
        [
            "context_parallel_size=2",
            "expert_parallel_size=2",
            "train_micro_batch_size_per_gpu=2",
            "zero_optimization.stage=3",
        ],
    ),
    (2, ["model_parallel_size=2", "sequence_parallel=true"]),
]


def test_moe_layouts_equal_one_process_and_resume_into_each_other(moe_config, tmp_path):
    """Steps 1-2 on two pipeline stages x two expert-parallel ranks per stage (each stage's
    balancing loss reaches the gradients, its load moves its layers' bias); steps 3-4 resumed on
    two context ranks x two expert-parallel ranks (each context rank's tokens reach its own
    group's experts, under ZeRO-3); steps 5-6 resumed on two tensor ranks with sequence
    parallelism (the sequence gathered before routing). Together they equal one process never
    stopped, the MTP module (an MoE block, its statistics among the others') too: on the last
    stage, reading the tokens ahead from the whole sequence on each context rank, on each
    sequence slice. And each layout, resumed from its own first step's checkpoint, gives its
    second step's losses (MTP's and the balancing loss too), gradient norm and weights (the
    router bias among them) to the bit."""
    train(moe_config, f"save={tmp_path / 'one'}", "load=null", *DEEPSEEK)
    moved = tmp_path / "moved"
    for k, (nproc, layout) in enumerate(LEGS):
        stop = "exit_interval=null" if k == len(LEGS) - 1 else f"exit_interval={2 * k + 2}"
        train(moe_config, f"save={moved}", f"load={moved}", *DEEPSEEK, *layout, stop, nproc=nproc)
    one = reference(tmp_path / "one")
    assert sorted(losses(moved)) == [1, 2, 3, 4, 5, 6]
    assert_same_training(moved, one)
    one_aux = losses(tmp_path / "one", "moe_aux_loss")
    assert losses(moved, "moe_aux_loss") == pytest.approx(one_aux, rel=1e-5)
    assert losses(moved, "mtp_loss_1") == pytest.approx(
        losses(tmp_path / "one", "mtp_loss_1"), rel=1e-5
    )
    biases = [name for name in one[2] if name.endswith("router_bias")]
    assert biases and all(one[2][name].abs().sum() > 0 for name in biases)
    keys = ("lm_loss", "grad_norm", "moe_aux_loss", "mtp_loss_1")
    for k, (nproc, layout) in enumerate(LEGS):
        resume = [*DEEPSEEK, *layout]
        assert_resumes_bitwise(moe_config, moved, 2 * k + 1, resume, nproc, 2 * k + 2, keys)
