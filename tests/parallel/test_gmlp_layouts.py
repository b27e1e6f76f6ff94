"""A model of gMLP, aMLP and attention layers under every layout that runs it: 2 processes equal
1 under ZeRO-1 and ZeRO-3 and as 2 pipeline stages, and a sharded checkpoint resumes as if
never stopped."""

from __future__ import annotations

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    one_process,
    train,
)

GMLP_KEYS = {
    "num_layers": 4,
    "attention_config": [[["gmlp", "global", "amlp", "gmlp"], 1]],
    "gmlp_attn_dim": 16,
    "no_weight_tying": True,
    **DP_KEYS,
}


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(
        "gmlp.yml", train_micro_batch_size_per_gpu=2, train_iters=4, **GMLP_KEYS
    )


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


LAYOUTS = {
    "zero1": ["zero_optimization.stage=1"],
    "zero3": ["zero_optimization.stage=3"],
    "pp2": ["pipe_parallel_size=2", "train_micro_batch_size_per_gpu=4"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes_equal_one(config, tmp_path, baseline, layout):
    out = tmp_path / layout
    train(config, f"save={out}", "load=null", *LAYOUTS[layout], nproc=2)
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert_same_training(out, baseline)


def test_a_zero3_checkpoint_resumes_like_a_run_never_stopped(tmp_path, make_config):
    cfg = make_config("long.yml", train_micro_batch_size_per_gpu=2, train_iters=6, **GMLP_KEYS)
    one = ["train_micro_batch_size_per_gpu=4"]
    assert_resumes_like_whole(cfg, tmp_path, one, ["zero_optimization.stage=3"], 2, one)
