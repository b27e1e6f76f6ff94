"""Data parallelism on gloo: 2 processes give the losses and weights of 1 process on the same
global batch, for every ZeRO stage, and checkpoints move between layouts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    one_process,
    train,
)
from torchneox.checkpoint import files as checkpoint_format
from torchneox.config.load import load_config


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(train_micro_batch_size_per_gpu=2, train_iters=4, **DP_KEYS)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_processes_equal_one(config, tmp_path, baseline, stage):
    out = tmp_path / f"zero{stage}"
    run = train(config, f"save={out}", "load=null", f"zero_optimization.stage={stage}", nproc=2)
    assert "data_parallel" not in run.stderr
    assert sorted(losses(out)) == [1, 2, 3, 4]
    assert_same_training(out, baseline)


def test_checkpoint_moves_from_two_sharded_processes_to_one(
    config, tmp_path, baseline, make_config
):
    cfg = make_config("long.yml", train_micro_batch_size_per_gpu=2, train_iters=6, **DP_KEYS)
    one = ["train_micro_batch_size_per_gpu=4"]
    moved = assert_resumes_like_whole(cfg, tmp_path, one, ["zero_optimization.stage=3"], 2, one)
    assert checkpoint_format.read_meta(moved / "global_step3")["world_size"] == 2


def test_world_size_that_does_not_fit_the_batch_is_refused(config, tmp_path):
    args = [
        sys.executable,
        "-m",
        "torchneox",
        "train",
        config,
        "--nproc",
        "2",
        "--set",
        "train_batch_size=6",
        "--set",
        "train_micro_batch_size_per_gpu=4",
    ]
    run = subprocess.run(
        args,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=300,
        check=False,
    )
    assert run.returncode == 2
    assert run.stderr.count("torchneox: error:") == 1  # checked once, before any process starts
    assert (
        "train_batch_size: 6 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps 2 x data-parallel size 2"
        in run.stderr
    )


def test_config_is_loadable_for_the_tests(config):
    assert load_config([config]).config.training.train_batch_size == 8


def test_bf16_gathered_weights_train_like_fp32_gathered_ones(config, tmp_path):
    """FSDP2 mixed precision: ZeRO 3 in bfloat16 gathers its weights in bf16 (auto), and
    trains as the run that gathers them in fp32 does, to bf16's tolerance."""
    runs = {}
    for gather in ("auto", "fp32"):
        out = tmp_path / gather
        keys = ["precision=bfloat16", "zero_optimization.stage=3", f"zero_param_dtype={gather}"]
        train(config, f"save={out}", "load=null", *keys, nproc=2)
        runs[gather] = losses(out)
    assert sorted(runs["auto"]) == [1, 2, 3, 4]
    assert runs["auto"] != runs["fp32"]  # the weights were gathered in another dtype
    for step, loss in runs["fp32"].items():
        assert runs["auto"][step] == pytest.approx(loss, rel=2e-2)


OTHER_OPTIMIZERS = {
    # SM3's and LAMB's eps keep a float-noise gradient (a key bias's) from a unit-size step
    "sm3": "{type: sm3, params: {lr: 0.01, momentum: 0.5, beta: 0.5, eps: 1.0e-6}}",
    "madgrad_wd": "{type: madgrad_wd, params: {lr: 0.01}}",
    "lamb": "{type: lamb, params: {lr: 0.003, eps: 1.0e-6, weight_decay: 0.1}}",
}


@pytest.mark.parametrize("optimizer,stage", [("sm3", 1), ("madgrad_wd", 1), ("lamb", 3)])
def test_two_sharded_processes_equal_one_with_the_other_optimizers(
    config, tmp_path, tmp_path_factory, optimizer, stage
):
    """Each rank steps its ZeRO shards (DTensors): SM3's accumulators reduced over the
    shards, LAMB's norms taken over the whole tensors, MADGRAD's elementwise update."""
    chosen = f"optimizer={OTHER_OPTIMIZERS[optimizer]}"
    baseline = one_process(config, tmp_path_factory, chosen)
    out = tmp_path / optimizer
    train(config, f"save={out}", "load=null", f"zero_optimization.stage={stage}", chosen, nproc=2)
    assert_same_training(out, baseline)


def test_sm3s_state_moves_from_two_sharded_processes_to_one(tmp_path, make_config):
    """SM3's accumulators (DTensors sharded along their own dimension only) and momentum saved
    by 2 ZeRO-3 ranks and read by one process: steps 4-6 are the unstopped run's."""
    cfg = make_config("long.yml", train_micro_batch_size_per_gpu=2, train_iters=6, **DP_KEYS)
    chosen = f"optimizer={OTHER_OPTIMIZERS['sm3']}"
    one = ["train_micro_batch_size_per_gpu=4", chosen]
    zero3 = ["zero_optimization.stage=3", chosen]
    assert_resumes_like_whole(cfg, tmp_path, one, zero3, 2, one)
