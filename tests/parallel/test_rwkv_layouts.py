"""RWKV-6 under every layout that splits it: 2 data-parallel processes give the losses,
gradients and weights of 1 under ZeRO-1 and ZeRO-3, pipeline stages of a model mixing RWKV
and attention layers equal one process, and a run stopped under ZeRO-3 on 2 processes
resumes on 1 exactly as if never stopped."""

from __future__ import annotations

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_like_whole,
    assert_same_training,
    one_process,
    reference,
    train,
)

RWKV = {"attention_config": [[["rwkv"], 2]]}
MIXED = [[["rwkv"], 1], [["global"], 1], [["rwkv"], 1], [["global"], 1]]


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(
        "rwkv.yml", train_micro_batch_size_per_gpu=2, train_iters=4, **RWKV, **DP_KEYS
    )


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


@pytest.mark.parametrize("stage", [1, 3])
def test_two_processes_equal_one(config, tmp_path, baseline, stage):
    out = tmp_path / f"zero{stage}"
    train(config, f"save={out}", "load=null", f"zero_optimization.stage={stage}", nproc=2)
    assert_same_training(out, baseline)


def test_pipeline_stages_of_a_mixed_model_equal_one_process(make_config, tmp_path):
    cfg = make_config(
        "mixed.yml",
        num_layers=4,
        attention_config=MIXED,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=4,
        train_iters=3,
        eval_iters=1,
        hidden_dropout=0.0,
        num_workers=0,
        no_weight_tying=True,
    )
    train(cfg, f"save={tmp_path / 'one'}", "load=null")
    train(cfg, f"save={tmp_path / 'pp2'}", "load=null", "pipe_parallel_size=2", nproc=2)
    assert_same_training(tmp_path / "pp2", reference(tmp_path / "one"))


def test_zero3_checkpoint_resumes_on_one_process_like_a_run_never_stopped(make_config, tmp_path):
    cfg = make_config(
        "rwkv6.yml", train_micro_batch_size_per_gpu=2, train_iters=6, **RWKV, **DP_KEYS
    )
    one = ["train_micro_batch_size_per_gpu=4"]
    assert_resumes_like_whole(cfg, tmp_path, one, ["zero_optimization.stage=3"], 2, one)
