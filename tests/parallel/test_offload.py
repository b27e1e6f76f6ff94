"""ZeRO-Offload (zero_optimization.offload_optimizer / offload_param, cpu_offload, cpu_adam)
through FSDP2's CPUOffloadPolicy: offloaded ZeRO-3 training equals the run without offload, on
one process, on 2 data-parallel ones (cpu_adam), with tensor and expert parallelism (MoE) and
with pipeline stages and context parallelism, and offloaded runs resume bit for bit. (Its refusals:
tests/config/test_bad_configs.py; explain: tests/config/features/test_offload.py.)"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers import (
    DP_KEYS,
    assert_resumes_bitwise,
    assert_same_training,
    losses,
    one_process,
    reference,
    train,
    trained_once,
    weights,
)

OFFLOAD = ["zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu"]


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(train_micro_batch_size_per_gpu=2, train_iters=4, **DP_KEYS)


@pytest.fixture(scope="module")
def baseline(config, tmp_path_factory):
    return one_process(config, tmp_path_factory)


def test_one_offloaded_process_equals_one_without_offload(config, tmp_path, baseline):
    """A lone process offloads too (FSDP2 over a mesh of one: ZeRO-Offload's one-GPU case)."""
    out = tmp_path / "alone"
    run = train(config, f"save={out}", "load=null", *OFFLOAD, "train_micro_batch_size_per_gpu=4")
    said = re.search(r"ZeRO-Offload: (\d+) of (\d+) parameter shards", run.stdout + run.stderr)
    assert said is not None and said[1] == said[2] and int(said[1]) > 0
    assert_same_training(out, baseline)


def test_a_cpu_adam_run_resumes_bit_for_bit_and_trains_as_adamw(
    tmp_path, tmp_path_factory, make_config
):
    """cpu_adam implies offload; resumed from the step-3 checkpoint of a run never stopped
    (both offloaded ZeRO-3 on 2 processes), steps 4-6 and the final weights are that run's, to
    the bit; and that run is a one-process AdamW run (DeepSpeedCPUAdam's adamw_mode)."""
    cfg = make_config("long.yml", train_micro_batch_size_per_gpu=2, train_iters=6, **DP_KEYS)
    cpu_adam = ["zero_optimization.stage=3", "optimizer.type=cpu_adam"]
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    run = train(cfg, f"save={whole}", "load=null", "checkpoint_factor=3", *cpu_adam, nproc=2)
    assert "ZeRO-Offload:" in run.stdout + run.stderr
    train(cfg, f"save={moved}", f"load={whole / 'global_step3'}", *cpu_adam, nproc=2)
    done, after = losses(whole), losses(moved)
    assert [after[k] for k in (4, 5, 6)] == [done[k] for k in (4, 5, 6)]
    resumed = weights(moved)
    for name, tensor in weights(whole).items():
        assert torch.equal(tensor, resumed[name]), name
    assert_same_training(whole, one_process(cfg, tmp_path_factory))  # Adam runs as AdamW


def test_offload_with_tensor_and_expert_parallelism_equals_one_process_and_resumes(
    moe_config, tmp_path
):
    """MoE on 4 processes: 2 data-parallel ranks that are the 2 expert-parallel ones, x tensor
    parallel 2, ZeRO-3 offloaded (FSDP2 over the dp axis of the run's 2-D mesh beside the
    tensor-parallel DTensors); the expert weights, ZeRO's to leave alone, stay where they are."""
    layout = [
        "moe_aux_loss_coeff=0.1",
        "expert_parallel_size=2",
        "model_parallel_size=2",
        "train_micro_batch_size_per_gpu=2",
        *OFFLOAD,
    ]
    out = tmp_path / "tp-ep"
    run = train(moe_config, f"save={out}", "load=null", "checkpoint_factor=3", *layout, nproc=4)
    said = re.search(
        r"ZeRO-Offload: (\d+) of \1 parameter shards.*; (\d+) expert", run.stdout + run.stderr
    )
    assert said is not None and int(said[2]) > 0, run.stdout[-1500:]
    assert_same_training(out, reference(trained_once(moe_config, "moe_aux_loss_coeff=0.1")))
    assert_resumes_bitwise(moe_config, out, 3, layout, nproc=4)


def test_offload_with_pipeline_and_context_parallelism_equals_one_process_and_resumes(
    config, tmp_path, baseline
):
    """Pipeline 2 x context parallel 2 (a lone data-parallel rank: FSDP2 shards each stage
    over the mesh's dp axis of one and offloads it), offloaded ZeRO-3, on 4 processes."""
    cfg = config
    layout = [
        "pipe_parallel_size=2",
        "context_parallel_size=2",
        "train_micro_batch_size_per_gpu=4",
        *OFFLOAD,
    ]
    out = tmp_path / "pp-cp"
    run = train(cfg, f"save={out}", "load=null", "checkpoint_factor=2", *layout, nproc=4)
    said = re.search(r"ZeRO-Offload: (\d+) of \1 parameter shards", run.stdout + run.stderr)
    assert said is not None and int(said[1]) > 0, run.stdout[-1500:]
    assert_same_training(out, baseline)
    assert_resumes_bitwise(cfg, out, 2, layout, nproc=4)
