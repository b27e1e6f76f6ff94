"""Block-sparse layers under parallel layouts: tensor parallelism splits the heads and each
rank takes its heads' layouts, so two tensor ranks train as one process does, as do two
context ranks (each takes the layout at its positions) and two pipeline stages (each layer
builds its layout from its own index); the dry run rehearses a sparse model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_same_training,
    one_process,
    train,
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
}
# (ZeRO 1 and 3, and resuming bit for bit: tests/parallel/test_layer_families.py, whose model
# has a block-sparse layer among every other family)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_equal_one_process(sparse, tmp_path, tmp_path_factory, layout):
    # context parallelism: each rank's queries take the layout at their gathered positions
    baseline = one_process(sparse, tmp_path_factory, "gradient_accumulation_steps=2")
    out = tmp_path / "two"
    train(sparse, f"save={out}", "load=null", *LAYOUTS[layout], nproc=2)
    assert_same_training(out, baseline)


def test_the_dry_run_rehearses_a_sparse_model_with_several_threads(sparse, tmp_path):
    # the layouts explain and the estimate count are built without torch: a torch operation
    # in the process that forks the rehearsed ranks hung them (its thread pool does not fork)
    env = dict(os.environ, OMP_NUM_THREADS="2")
    command = [sys.executable, "-m", "torchneox", "train", sparse, "--dry-run"]
    command += ["--set", f"save={tmp_path / 'run'}", "--set", "model_parallel_size=2"]
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "every rehearsed rank built and holds what estimate computes" in run.stdout
