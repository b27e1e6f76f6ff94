"""Replica groups beside pipeline stages (CPU, gloo): 2 groups of 2 processes, each group 2
pipeline stages; every stage's gradients are averaged with the same stage of the other group
(the same rank in each group). They train as one 4-process run of 2 stages x 2 data-parallel
ranks on the same global batch, bit for bit. Untied embeddings: tied, the 2 copies' gradients
are summed within a group before the groups' mean, in one run after the data-parallel mean, and
the weights differ in their last bits. The runs are forked from the tests' server
(tests/forked.py): no import of torch per run. Replica groups beside expert parallelism are
in test_replica_groups.py (its groups split their experts over 2 ranks)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.forked import Forked
from tests.helpers import losses, weights

torchft = pytest.importorskip("torchft")

KEYS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "train_iters": 2}
KEYS |= {"hidden_dropout": 0.0, "eval_iters": 0, "num_workers": 0, "pipe_parallel_size": 2}
KEYS |= {"no_weight_tying": True}


def start(config: str, keys: list[str], nproc: int) -> Forked:
    """``torchneox train CONFIG --nproc N --set KEY ...``, forked from the tests' server."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHFT_MANAGER_PORT="0")
    return Forked(
        ["train", config, "--nproc", str(nproc), *[a for k in keys for a in ("--set", k)]], env
    )


def test_two_groups_of_two_pipeline_stages_train_as_one_run(make_config, tmp_path):
    from torchft.coordination import LighthouseServer

    config = make_config(**KEYS)
    server = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=1000
    )
    one, g0, g1 = tmp_path / "one", tmp_path / "g0", tmp_path / "g1"
    try:
        runs = {one: start(config, [f"save={one}", "load=null"], 4)}
        for g, folder in enumerate((g0, g1)):
            keys = [f"ft_lighthouse={server.address()}", f"ft_replica_group={g}"]
            keys += ["ft_replica_groups=2", f"save={folder}", "load=null", "ft_timeout_seconds=30"]
            runs[folder] = start(config, keys, 2)
        for folder, run in runs.items():
            result = run.result(timeout=240)
            assert result.returncode == 0, (
                f"{folder}: {result.stdout[-2000:]}{result.stderr[-3000:]}"
            )
    finally:
        server.shutdown()
    assert losses(g0, "replica_groups") == {1: 2.0, 2: 2.0}
    assert losses(g0, "grad_norm") == losses(one, "grad_norm")
    for k, loss in losses(one).items():
        assert losses(g0)[k] == pytest.approx(loss, rel=1e-6, abs=0), k
    whole, w0, w1 = weights(one), weights(g0), weights(g1)
    for name, tensor in whole.items():
        assert torch.equal(w0[name], tensor), name
        assert torch.equal(w1[name], tensor), name
