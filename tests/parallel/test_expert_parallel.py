"""Expert parallelism on gloo: each MoE layer's experts split over data-parallel ranks (with
ZeRO-3 and tensor parallelism too) give the losses, the load-balancing loss, the gradient norms
and the weights of one process, and their checkpoints resume in one process."""

from __future__ import annotations

import json

import pytest

from tests.helpers import (
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    reference,
    train,
    trained_once,
)
from torchneox.cli import main

# Expert parallelism (the load-balancing loss, computed over the whole batch, included).
EP_LAYOUTS = {
    "dp2-ep2": (2, ["expert_parallel_size=2", "train_micro_batch_size_per_gpu=2"]),
    "dp2-ep2-zero3": (
        2,
        ["expert_parallel_size=2", "train_micro_batch_size_per_gpu=2", "zero_optimization.stage=3"],
    ),
    "dp4-ep4": (4, ["expert_parallel_size=4", "train_micro_batch_size_per_gpu=1"]),
    # the experts' 2 replicas, the other weights ZeRO-3 within 2 groups of 2 (hybrid sharding)
    "dp4-ep2-hybrid": (
        4,
        [
            "expert_parallel_size=2",
            "train_micro_batch_size_per_gpu=1",
            "zero_optimization={stage: 3, mics_shard_size: 2}",
        ],
    ),
    "dp2-ep2-tp2": (
        4,
        ["expert_parallel_size=2", "model_parallel_size=2", "train_micro_batch_size_per_gpu=2"],
    ),
}


@pytest.fixture(scope="module")
def moe_one_process(moe_config):
    return trained_once(moe_config, "moe_aux_loss_coeff=0.1")  # (test_offload's baseline too)


@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_expert_parallel_layouts_equal_one_process(moe_config, moe_one_process, tmp_path, layout):
    nproc, overrides = EP_LAYOUTS[layout]
    baseline = reference(moe_one_process)
    out = tmp_path / layout
    train(moe_config, f"save={out}", "load=null", "moe_aux_loss_coeff=0.1", *overrides, nproc=nproc)
    one_aux = losses(moe_one_process, "moe_aux_loss")
    assert losses(out, "moe_aux_loss") == pytest.approx(one_aux, rel=1e-5)
    assert_same_training(out, baseline)


LORA = json.dumps({"rank": 2, "alpha": 4, "target_modules": ["q_proj", "up_proj", "down_proj"]})


def test_lora_on_experts_split_over_two_expert_ranks_equals_one_process(moe_config, tmp_path):
    """Each expert's adapter on the rank holding the expert (A [E, in, r] and B [E, r, out]
    split by experts as the expert weights are): the adapters train as in one process, and
    the checkpoint holds them whole."""
    keys = [f"lora={LORA}", "train_iters=3", "load=null"]
    baseline = reference(trained_once(moe_config, *keys))
    assert any("experts_down_lora.lora_B" in n for n in baseline[2])
    out = tmp_path / "ep2-lora"
    layout = ["expert_parallel_size=2", "train_micro_batch_size_per_gpu=2"]
    train(moe_config, f"save={out}", *keys, *layout, nproc=2)
    assert_same_training(out, baseline)


def test_expert_parallel_checkpoint_resumes_in_one_process(moe_config, tmp_path):

    assert_resumes_like_whole(
        moe_config,
        tmp_path,
        [],
        ["expert_parallel_size=2", "train_micro_batch_size_per_gpu=2"],
        2,
        [],
    )


@pytest.mark.parametrize(
    "nproc, overrides, key, says",
    [
        (
            2,
            ["expert_parallel_size=3", "train_micro_batch_size_per_gpu=2"],
            "expert_parallel_size",
            "must divide the data-parallel",
        ),
    ],
)
def test_a_bad_expert_layout_is_refused_before_any_process_starts(
    moe_config, tmp_path, capsys, nproc, overrides, key, says
):
    sets = [x for o in [f"save={tmp_path}", *overrides] for x in ("--set", o)]
    assert main(["train", moe_config, "--nproc", str(nproc), *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{key}:" in err and says in err
    assert len(err.splitlines()) == 1  # one line, from the launcher, not one per worker
