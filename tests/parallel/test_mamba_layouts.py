"""Mamba under every layout it takes: 2 processes equal 1 under ZeRO-1 and ZeRO-3 and as two
pipeline stages (a model mixing mamba and attention layers), a ZeRO-3 checkpoint resumes in
one process bitwise, and tensor parallelism is refused in one line."""

from __future__ import annotations

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    one_process,
    reference,
    train,
)

MIXED = {"attention_config": [[["mamba", "global"], 1]], "no_weight_tying": True}


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(
        "mamba.yml", train_micro_batch_size_per_gpu=2, train_iters=4, **DP_KEYS, **MIXED
    )


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


@pytest.mark.parametrize("stage", [1, 3])
def test_two_zero_processes_equal_one(config, tmp_path, baseline, stage):
    out = tmp_path / f"zero{stage}"
    train(config, f"save={out}", "load=null", f"zero_optimization.stage={stage}", nproc=2)
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert_same_training(out, baseline)


def test_two_pipeline_stages_equal_one(make_config, tmp_path):
    keys = {k: v for k, v in DP_KEYS.items() if k != "train_batch_size"} | MIXED
    keys |= {"attention_config": [[["mamba", "global"], 2]], "num_layers": 4}
    keys |= {"gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2}
    cfg = make_config("pp.yml", train_iters=3, **keys)
    train(cfg, f"save={tmp_path / 'one'}", "load=null")
    train(cfg, f"save={tmp_path / 'pp'}", "load=null", "pipe_parallel_size=2", nproc=2)
    assert_same_training(tmp_path / "pp", reference(tmp_path / "one"))


def test_zero3_checkpoint_resumes_in_one_process(make_config, tmp_path):
    cfg = make_config(
        "long.yml", train_micro_batch_size_per_gpu=2, train_iters=6, **DP_KEYS, **MIXED
    )
    one = ["train_micro_batch_size_per_gpu=4"]
    assert_resumes_like_whole(cfg, tmp_path, one, ["zero_optimization.stage=3"], 2, one)


def test_bf16_gathers_keep_a_log_and_d_in_fp32(config, tmp_path):
    """ZeRO-3 gathering weights in bf16: with mamba_selective_fp32_params (the default) the
    mixers are gathered in fp32, so the run differs from one gathering them in bf16 (which
    runs too: the scan reads every parameter in fp32)."""
    runs = []
    for flag in ("true", "false"):
        out = tmp_path / flag
        train(
            config, f"save={out}", "load=null", "precision=bfloat16", "zero_param_dtype=bf16",
            "zero_optimization.stage=3", f"mamba_selective_fp32_params={flag}", "train_iters=2",
            "eval_iters=0", nproc=2,
        )  # fmt: skip
        runs.append(losses(out))
    assert runs[0] != runs[1]


def test_stages_weigh_mamba_layers_by_their_parameters():
    """pipe_partition_method parameters: a mamba layer (3 h d_inner + ...) weighs less than an
    attention block with its MLP (12 h^2 at 4h): 2 attention then 6 mamba layers split 3 | 5
    (counted as attention blocks: 4 | 4)."""
    from tests.helpers import BASE
    from torchneox.config.load import load_mapping
    from torchneox.models.args import model_args
    from torchneox.parallel.pipeline import stage_layers

    mixed = {"num_layers": 8, "attention_config": [[["global"], 2], [["mamba"], 6]]}
    args = model_args(load_mapping(BASE | mixed, "test"))
    first, second = stage_layers(args, 2, "parameters")
    assert (len(first), len(second)) == (3, 5)
