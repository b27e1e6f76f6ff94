"""Block-sparse layers under parallel layouts: tensor parallelism splits the heads and each
rank takes its heads' layouts, so two tensor ranks train as one process does, as do two
context ranks (each takes the layout at its positions) and two pipeline stages (each layer
builds its layout from its own index), and two data-parallel ranks under ZeRO 1 and 3; a
stopped run resumes bit for bit; the dry run
rehearses a sparse model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import (
    DP_KEYS,
    assert_resumes_like_whole,
    assert_same_training,
    losses,
    one_process,
    train,
    trained_once,
    weights,
)

SPARSE_KEYS = {
    # a layout per head (random blocks differ by head and by layer) in two sparse types
    "num_layers": 3,
    "attention_config": [[["bigbird", "sparse_fixed", "global"], "all"]],
    "sparsity_config": {
        "block": 8,
        "different_layout_per_head": True,
        "num_random_blocks": 1,
        "num_sliding_window_blocks": 1,
        "num_local_blocks": 2,
        "num_different_global_patterns": 2,
    },
    "no_weight_tying": True,
}


@pytest.fixture(scope="module")
def sparse(make_module_config):
    return make_module_config(
        "sparse.yml", train_micro_batch_size_per_gpu=4, train_iters=4, **DP_KEYS, **SPARSE_KEYS
    )


LAYOUTS = {
    "tp2": ["model_parallel_size=2"],
    "cp2": ["context_parallel_size=2"],
    "pp2": ["pipe_parallel_size=2"],
    # data parallel 2: micro-batches of 2, accumulated twice
    "zero1": ["zero_optimization.stage=1", "train_micro_batch_size_per_gpu=2"],
    "zero3": ["zero_optimization.stage=3", "train_micro_batch_size_per_gpu=2"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_equal_one_process(sparse, tmp_path, tmp_path_factory, layout):
    # context parallelism: each rank's queries take the layout at their gathered positions
    baseline = one_process(sparse, tmp_path_factory, "gradient_accumulation_steps=2")
    out = tmp_path / "two"
    train(sparse, f"save={out}", "load=null", *LAYOUTS[layout], nproc=2)
    assert_same_training(out, baseline)


def test_resumes_bitwise(sparse, tmp_path):
    # the layouts are rebuilt from the config, not saved: a resumed run attends as before
    whole = ["train_micro_batch_size_per_gpu=4", "gradient_accumulation_steps=2", "train_iters=6"]
    moved = assert_resumes_like_whole(sparse, tmp_path, whole, whole, 1, whole)
    unstopped = trained_once(sparse, *whole)
    assert {k: v for k, v in losses(moved).items() if k > 3} == {
        k: v for k, v in losses(unstopped).items() if k > 3
    }
    after, before = weights(moved), weights(unstopped)
    assert all(torch.equal(after[name], before[name]) for name in before)


def test_the_dry_run_rehearses_a_sparse_model_with_several_threads(sparse, tmp_path):
    # the layouts explain and the estimate count are built without torch: a torch operation
    # in the process that forks the rehearsed ranks hung them (its thread pool does not fork)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    command = [sys.executable, "-m", "torchneox", "train", sparse, "--dry-run"]
    command += ["--set", f"save={tmp_path / 'run'}", "--set", "model_parallel_size=2"]
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "every rehearsed rank built and holds what estimate computes" in run.stdout
