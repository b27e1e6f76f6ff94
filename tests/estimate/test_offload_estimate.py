"""`torchneox estimate` with ZeRO-Offload: the shards leave the device, the host memory per node
and the optimizer step on the host are the hand computation of docs/estimate.md."""

from __future__ import annotations

import math

import torch

from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.estimate.search import estimate
from torchneox.models.args import model_args
from torchneox.models.transformer import Transformer

OFFLOAD = ["zero_optimization.stage=3", "zero_optimization.offload_optimizer.device=cpu"]


def test_offload_moves_the_shards_to_host_memory_per_node(make_config, capsys):
    cfg = make_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1)
    on_device = estimate(load_config([cfg], ["zero_optimization.stage=3"]), gpus=4, nodes=2)
    loaded = load_config([cfg], OFFLOAD)
    offloaded = estimate(loaded, gpus=4, nodes=2)
    # by hand: rank 0 holds the rounded-up quarter of dim 0 of every parameter
    with torch.device("meta"):
        model = Transformer(model_args(loaded))
    shard = sum(math.ceil(p.shape[0] / 4) * p[0].numel() for p in model.parameters())
    host = offloaded["host_bytes_per_rank"]
    assert host == {
        "parameters": 4 * shard,
        "gradients": 4 * shard,
        "optimizer": 8 * shard,  # Adam's two fp32 moments
        "total": 16 * shard,
    }
    assert offloaded["host_bytes_per_node"] == 2 * 16 * shard  # 4 GPUs on 2 nodes
    # AdamW on the host: parameter read + written, gradient read, 2 moments read + written
    assert offloaded["host_step_s"] == 2 * shard * (12 + 2 * 8) / 100e9
    assert math.isclose(
        offloaded["step_time_s"], on_device["step_time_s"] + offloaded["host_step_s"]
    )
    device, before = offloaded["memory_per_rank_bytes"], on_device["memory_per_rank_bytes"]
    assert device["optimizer"] == 0
    assert device["parameters"] == before["parameters"] - 4 * shard == 0  # ZeRO-3: none kept
    assert device["gradients"] == before["gradients"] - 4 * shard
    assert device["temporary"] == before["temporary"]  # the gathered blocks stay on the device
    assert device["total"] == before["total"] - 16 * shard
    assert (
        main(
            [
                "estimate",
                cfg,
                "--gpus",
                "4",
                "--nodes",
                "2",
                *(arg for o in OFFLOAD for arg in ("--set", o)),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "host memory per node (ZeRO-Offload)" in text
    assert "of optimizer step on the host" in text
