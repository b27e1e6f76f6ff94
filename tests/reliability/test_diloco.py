"""DiLoCo through torchft.local_sgd (ft_diloco_*), 2 replica groups of one process each: each
group trains its own share with its own optimizer, and at the sync the outer step is the one
worked out by hand from the weights each group reached alone and the weights they started
from."""

from __future__ import annotations

import os

import pytest
import torch

from tests.forked import Forked
from tests.helpers import losses, weights

torchft = pytest.importorskip("torchft")

KEYS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_iters": 2}
KEYS |= {"hidden_dropout": 0.0, "eval_iters": 1, "num_workers": 0}
OUTER_LR, MOMENTUM = 0.5, 0.9


def lighthouse():
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=20000, heartbeat_timeout_ms=1000
    )


def group(config: str, server, g: int, folder, sync_every: int) -> Forked:
    keys = [f"ft_lighthouse={server.address()}", f"ft_replica_group={g}", "ft_replica_groups=2"]
    keys += [f"save={folder}", "load=null", "ft_timeout_seconds=30", "extra_save_iters=[0]"]
    keys += [f"ft_diloco_sync_every={sync_every}", f"ft_diloco_outer_lr={OUTER_LR}"]
    keys += [f"ft_diloco_outer_momentum={MOMENTUM}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHFT_MANAGER_PORT="0")
    return Forked(["train", config, *[a for k in keys for a in ("--set", k)]], env)


def test_the_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient(make_config, tmp_path):
    config = make_config(**KEYS)
    synced, alone = lighthouse(), lighthouse()
    try:
        # the groups syncing after their 2 steps, and the same groups never syncing (every 3
        # steps, after the run's 2): what each reached alone
        runs = [group(config, synced, g, tmp_path / f"g{g}", 2) for g in (0, 1)]
        runs += [group(config, alone, g, tmp_path / f"alone{g}", 3) for g in (0, 1)]
        for run in runs:
            result = run.result(timeout=240)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finally:
        synced.shutdown()
        alone.shutdown()
    start = weights(tmp_path / "g0" / "global_step0")
    reached = [weights(tmp_path / f"alone{g}") for g in (0, 1)]
    after = [weights(tmp_path / f"g{g}") for g in (0, 1)]
    for name, w0 in start.items():
        # the pseudo-gradients' mean over the groups, then SGD's first step with Nesterov
        # momentum: the momentum buffer is the gradient, the step lr x (g + momentum x g)
        g = ((w0 - reached[0][name]) + (w0 - reached[1][name])) / 2
        want = w0.add(g.add(g, alpha=MOMENTUM), alpha=-OUTER_LR)
        assert torch.equal(after[0][name], after[1][name]), name
        # bit for bit: a sum of two, a halving and SGD's own ops, in the same order
        assert torch.equal(after[0][name], want), name
        assert not torch.equal(want, (reached[0][name] + reached[1][name]) / 2), name
    # the live groups are logged at the sync
    assert losses(tmp_path / "g0", "replica_groups") == {2: 2.0}
