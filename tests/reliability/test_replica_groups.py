"""Replica groups under torchft (CPU, gloo), each group one process: without a failure they
train as one two-process data-parallel run on the same global batch, bit for bit; when group 1
is killed (kill -9) mid-run, group 0 steps on alone, and group 1, restarted with an empty save
folder, heals from group 0 and ends with the same weights, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from tests.forked import Forked
from tests.helpers import losses, train, weights

torchft = pytest.importorskip("torchft")

# each group's batch: 2 micro-batches of 2; the global batch of the 2 groups: 8 sequences
KEYS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
KEYS |= {"hidden_dropout": 0.0, "eval_iters": 1, "num_workers": 0}


def lighthouse(min_replicas: int):
    from torchft.coordination import LighthouseServer

    # a group that goes silent counts as dead after 1 s (the default, 5 s, only slows the test)
    return LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=20000, heartbeat_timeout_ms=1000
    )


def group(config: str, address: str, g: int, folder, fault: str | None = None) -> Forked:
    """Replica group ``g`` of 2, one process, saving to ``folder``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHFT_MANAGER_PORT="0")
    env.pop("TORCHNEOX_FAULT", None)
    if fault:
        env["TORCHNEOX_FAULT"] = fault
    keys = [f"ft_lighthouse={address}", f"ft_replica_group={g}", "ft_replica_groups=2"]
    keys += [f"save={folder}", f"load={folder}", "ft_timeout_seconds=20"]
    return Forked(["train", config, *[a for k in keys for a in ("--set", k)]], env)


def finished(run: Forked) -> str:
    result = run.result(timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(train_iters=4, **KEYS)


def test_two_groups_train_as_one_data_parallel_run(config, tmp_path):
    server = lighthouse(min_replicas=2)  # both groups in every quorum from the first step
    try:
        runs = [group(config, server.address(), g, tmp_path / f"g{g}") for g in (0, 1)]
        out = [finished(r) for r in runs]
    finally:
        server.shutdown()
    dp = tmp_path / "dp"
    train(config, f"save={dp}", "load=null", "zero_optimization.stage=0", nproc=2)
    assert "replica groups: 2 of 2 live from step 1" in out[0]
    # the gradients: each group's mean over its 4 sequences, summed over the 2 groups and
    # halved (exact), as the data-parallel run's all-reduce sums and halves its 2 ranks'
    want = losses(dp)
    assert sorted(want) == [1, 2, 3, 4]
    for g in (0, 1):
        assert losses(tmp_path / f"g{g}") == want
        assert losses(tmp_path / f"g{g}", "replica_groups") == dict.fromkeys(want, 2.0)
        got, whole = weights(tmp_path / f"g{g}"), weights(dp)
        for name, tensor in whole.items():
            assert torch.equal(got[name], tensor), name
