"""ZeRO-Offload (zero_optimization.offload_optimizer / offload_param, cpu_offload, cpu_adam)
through FSDP2's CPUOffloadPolicy: offloaded ZeRO-3 training on 2 processes equals the run
without offload, a checkpoint resumes under it, and what it cannot do is refused in one line."""

from __future__ import annotations

import re

import pytest

from tests.helpers import (
    DP_KEYS,
    assert_resumes_like_whole,
    assert_same_training,
    one_process,
    train,
)

OFFLOAD = ["zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu"]


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(train_micro_batch_size_per_gpu=2, train_iters=4, **DP_KEYS)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


def test_offloaded_zero3_on_two_processes_equals_one_without_offload(config, tmp_path, baseline):
    out = tmp_path / "offload"
    run = train(config, f"save={out}", "load=null", *OFFLOAD, nproc=2)
    said = re.search(r"ZeRO-Offload: (\d+) of (\d+) parameter shards", run.stdout + run.stderr)
    assert said is not None and said[1] == said[2] and int(said[1]) > 0
    assert_same_training(out, baseline)


def test_cpu_adam_offloads_and_resumes_like_a_run_never_stopped(tmp_path, make_config):
    cfg = make_config("long.yml", train_micro_batch_size_per_gpu=2, train_iters=6, **DP_KEYS)
    cpu_adam = ["zero_optimization.stage=3", "optimizer.type=cpu_adam"]
    one = ["train_micro_batch_size_per_gpu=4"]  # AdamW, as DeepSpeedCPUAdam's adamw_mode
    assert_resumes_like_whole(cfg, tmp_path, one, cpu_adam, 2, cpu_adam, then_nproc=2)
