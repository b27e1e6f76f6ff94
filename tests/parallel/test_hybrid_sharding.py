"""Hybrid sharding (DeepSpeed's zero_optimization.mics_shard_size, FSDP2's HSDP): ZeRO state
sharded within groups of data-parallel ranks and replicated across them. On 4 processes (2
groups of 2) it equals one process, alone and with tensor parallelism (8 processes); its
checkpoints resume as plain ZeRO-3 and on one process."""

from __future__ import annotations

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_like_whole,
    assert_same_training,
    one_process,
    train,
)

HYBRID = "zero_optimization={stage: 3, mics_shard_size: 2}"


@pytest.fixture(scope="module")
def config(make_module_config):
    keys = DP_KEYS | {"no_weight_tying": True}
    return make_module_config(train_micro_batch_size_per_gpu=1, train_iters=3, **keys)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


@pytest.mark.parametrize("stage", [1, 3])
def test_two_groups_of_two_equal_one_process(config, tmp_path, baseline, stage):
    out = tmp_path / "hsdp"
    zero = f"zero_optimization={{stage: {stage}, mics_shard_size: 2}}"
    run = train(config, f"save={out}", "load=null", zero, nproc=4)
    said = f"hybrid sharding: ZeRO {stage} state sharded within 2 groups of 2 data-parallel ranks"
    assert said in run.stdout + run.stderr
    # the flattened data-parallel axis is the mesh _flatten returned, not sliced from the root
    assert "Slicing a flattened dim" not in run.stderr
    assert_same_training(out, baseline)


def test_with_tensor_parallelism(config, tmp_path, baseline):
    out = tmp_path / "hsdp_tp"
    train(config, f"save={out}", "load=null", HYBRID, "model_parallel_size=2", nproc=8)
    assert_same_training(out, baseline)


@pytest.mark.parametrize(
    ("then", "nproc"),
    [(["zero_optimization.stage=3", "train_micro_batch_size_per_gpu=2"], 2),
     (["train_micro_batch_size_per_gpu=4"], 1)],
    ids=["as-zero3", "as-one-process"],
)  # fmt: skip
def test_checkpoints_resume_in_other_layouts(make_config, tmp_path, then, nproc):
    cfg = make_config("long.yml", train_micro_batch_size_per_gpu=1, train_iters=6, **DP_KEYS)
    one = ["train_micro_batch_size_per_gpu=4"]
    assert_resumes_like_whole(cfg, tmp_path, one, [HYBRID], 4, then, nproc)


@pytest.mark.parametrize(
    ("zero", "said"),
    [
        (
            "{stage: 3, mics_shard_size: 3}",
            "mics_shard_size 3 must divide the data-parallel size 4",
        ),
        ("{stage: 0, mics_shard_size: 2}", "it needs stage 1, 2 or 3"),
        ("{stage: 3, mics_shard_size: two}", "mics_shard_size must be a positive integer"),
    ],
    ids=["not-dividing", "stage-0", "not-a-number"],
)
def test_a_shard_group_that_cannot_be_built_is_one_line(config, zero, said):
    import subprocess
    import sys

    args = [sys.executable, "-m", "torchneox", "train", config, "--nproc", "4"]
    args += ["--set", f"zero_optimization={zero}", "--set", "load=null"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    lines = [x for x in run.stderr.splitlines() if x.startswith("torchneox:")]
    assert run.returncode == 2 and len(lines) == 1 and said in lines[0], run.stderr
