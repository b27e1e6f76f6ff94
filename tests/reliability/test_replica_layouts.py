"""Replica groups beside pipeline stages (CPU, gloo): 2 groups of 2 processes, each group 2
pipeline stages; every stage's gradients are averaged with the same stage of the other group
(the same rank in each group). They train as one 4-process run of 2 stages x 2 data-parallel
ranks on the same global batch, bit for bit. Untied embeddings: tied, the 2 copies' gradients
are summed within a group before the groups' mean, in one run after the data-parallel mean, and
the weights differ in their last bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import losses, weights
from tests.reliability.test_replica_groups import ended, torchneox

torchft = pytest.importorskip("torchft")

KEYS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "train_iters": 2}
KEYS |= {"hidden_dropout": 0.0, "eval_iters": 1, "num_workers": 0, "pipe_parallel_size": 2}
KEYS |= {"no_weight_tying": True}


def test_two_groups_of_two_pipeline_stages_train_as_one_run(make_config, tmp_path):
    from torchft.coordination import LighthouseServer

    config = make_config(**KEYS)
    server = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=1000
    )
    one = tmp_path / "one"
    try:
        runs = {one: torchneox(config, [f"save={one}", "load=null"], 4, Path(f"{one}.out"))}
        for g in (0, 1):
            folder = tmp_path / f"g{g}"
            keys = [f"ft_lighthouse={server.address()}", f"ft_replica_group={g}"]
            keys += ["ft_replica_groups=2", f"save={folder}", "load=null", "ft_timeout_seconds=30"]
            env = {"TORCHFT_MANAGER_PORT": "0"}
            runs[folder] = torchneox(config, keys, 2, Path(f"{folder}.out"), env)
        for folder, run in runs.items():
            ended(run, folder)
    finally:
        server.shutdown()
    g0, g1 = tmp_path / "g0", tmp_path / "g1"
    assert losses(g0, "replica_groups") == {1: 2.0, 2: 2.0}
    assert losses(g0, "grad_norm") == losses(one, "grad_norm")
    for k, loss in losses(one).items():
        assert losses(g0)[k] == pytest.approx(loss, rel=1e-6, abs=0), k
    whole, w0, w1 = weights(one), weights(g0), weights(g1)
    for name, tensor in whole.items():
        assert torch.equal(w0[name], tensor), name
        assert torch.equal(w1[name], tensor), name
