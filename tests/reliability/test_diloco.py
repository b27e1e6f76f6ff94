"""DiLoCo through torchft.local_sgd (ft_diloco_*), 2 replica groups of one process each: each
group trains its own share with its own optimizer, and at the sync the outer step is the one
worked out by hand from the weights each group reached alone and the weights they started
from. The outer state (the outer momentum, the last sync's weights, the place in the sync
period) is in disk checkpoints: the two groups resumed from their checkpoints in mid-period go
on bit for bit as the run never stopped. A group killed under DiLoCo and restarted with an empty
save folder heals from the live one at its next sync, outer state included, and the two end with
the same weights, bit for bit."""

from __future__ import annotations

import os
import time
import urllib.request

import pytest
import torch

from tests.forked import Forked
from tests.helpers import losses, weights

torchft = pytest.importorskip("torchft")

KEYS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}
KEYS |= {"hidden_dropout": 0.0, "eval_iters": 1, "num_workers": 0}
OUTER_LR, MOMENTUM = 0.5, 0.9
LAST = 5  # syncs after steps 2 and 4; the groups resume from their checkpoints of step 3


def lighthouse(min_replicas: int = 2):
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=20000, heartbeat_timeout_ms=1000
    )


def group(config: str, server, g: int, folder, sync_every: int, *more: str, env=None) -> Forked:
    keys = [f"ft_lighthouse={server.address()}", f"ft_replica_group={g}", "ft_replica_groups=2"]
    keys += [f"save={folder}", "load=null", "ft_timeout_seconds=30", "extra_save_iters=[0, 2, 3]"]
    keys += [f"ft_diloco_sync_every={sync_every}", f"ft_diloco_outer_lr={OUTER_LR}"]
    keys += [f"ft_diloco_outer_momentum={MOMENTUM}", *more]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHFT_MANAGER_PORT="0") | (env or {})
    return Forked(["train", config, *[a for k in keys for a in ("--set", k)]], env)


def wait_for(ready, runs: list[Forked], timeout: float = 120) -> None:
    """Until ``ready()`` (every run still going or ended well)."""
    end = time.monotonic() + timeout
    while not ready():
        assert all(r.poll() in (None, 0) for r in runs), "a run failed"
        assert time.monotonic() < end, "not ready in time"
        time.sleep(0.05)


def finished(runs: list[Forked]) -> list[str]:
    outs = []
    for run in runs:
        result = run.result(timeout=240)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        outs.append(result.stdout)
    return outs


def test_the_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient_and_resumes(
    make_config, tmp_path
):
    config = make_config(train_iters=LAST, **KEYS)
    synced, alone, back = lighthouse(), lighthouse(), lighthouse()
    try:
        # the groups syncing every 2 steps, and the same groups never syncing (every 3 steps,
        # stopped after 2, the schedule the same): what each reached alone
        runs = [group(config, synced, g, tmp_path / f"g{g}", 2) for g in (0, 1)]
        runs += [
            group(config, alone, g, tmp_path / f"alone{g}", 3, "exit_interval=2") for g in (0, 1)
        ]
        # both groups stopped after step 3 (one step into a sync period, the outer momentum
        # made at the sync of step 2) and resumed from their checkpoints, on to step LAST
        # (started once those are written: the launch overlaps the runs' last steps)
        at = [tmp_path / f"g{g}" / "global_step3" for g in (0, 1)]
        wait_for(lambda: all((a / "meta.json").is_file() for a in at), runs)
        again = [group(config, back, g, tmp_path / f"r{g}", 2, f"load={at[g]}") for g in (0, 1)]
        finished(runs)
        outs = finished(again)
    finally:
        synced.shutdown()
        alone.shutdown()
        back.shutdown()
    start = weights(tmp_path / "g0" / "global_step0")
    reached = [weights(tmp_path / f"alone{g}") for g in (0, 1)]
    after = [weights(tmp_path / f"g{g}" / "global_step2") for g in (0, 1)]
    for name, w0 in start.items():
        # the pseudo-gradients' mean over the groups, then SGD's first step with Nesterov
        # momentum: the momentum buffer is the gradient, the step lr x (g + momentum x g)
        g = ((w0 - reached[0][name]) + (w0 - reached[1][name])) / 2
        want = w0.add(g.add(g, alpha=MOMENTUM), alpha=-OUTER_LR)
        assert torch.equal(after[0][name], after[1][name]), name
        # bit for bit: a sum of two, a halving and SGD's own ops, in the same order
        assert torch.equal(after[0][name], want), name
        assert not torch.equal(want, (reached[0][name] + reached[1][name]) / 2), name
    # the live groups are logged at each sync
    assert losses(tmp_path / "g0", "replica_groups") == {2: 2.0, 4: 2.0}
    # the resumed groups: the steps after 3 and the weights, bit for bit the run never stopped
    # (the sync of step 4 applies the outer momentum to the step-2 weights it resumed)
    for g in (0, 1):
        whole, resumed = tmp_path / f"g{g}", tmp_path / f"r{g}"
        assert losses(resumed) == {k: v for k, v in losses(whole).items() if k > 3}
        same = weights(resumed)
        for name, tensor in weights(whole).items():
            assert torch.equal(same[name], tensor), (g, name)
    assert "DiLoCo: resumed the weights of the last sync, the outer momentum and 1 steps" in outs[0]


def heartbeats(server, text: str) -> bool:
    """Whether the lighthouse's account of the next quorum (its /status page) says ``text``."""
    with urllib.request.urlopen(server.address() + "/status", timeout=5) as page:
        return text in page.read().decode()


def test_a_group_killed_under_diloco_heals_from_the_live_one_outer_state_and_all(
    make_config, tmp_path
):
    """Group 1 syncs at step 2, dies in step 3 (kill -9); group 0 syncs alone at step 4, then
    waits before step 5 until group 1, restarted with an empty save folder, has trained its own
    2 steps and waits in a quorum. At the sync of step 6 group 1 heals from group 0: its weights,
    the last sync's weights and the outer momentum (torchft's DiLoCo hands those over itself),
    and both apply the same outer step."""
    config = make_config(train_iters=6, **KEYS)
    flags, h0, h1, back = (tmp_path / n for n in ("flags", "h0", "h1", "h1-restarted"))
    flags.mkdir()
    server = lighthouse(min_replicas=1)
    try:
        fault = {"TORCHNEOX_FAULT_FLAG": str(flags)}
        held = fault | {"TORCHNEOX_FAULT": "wait@step.start:1,wait@step.start:5"}
        first = group(config, server, 0, h0, 2, env=held)
        killed = fault | {"TORCHNEOX_FAULT": "wait@step.start:1,kill@step.backward:3"}
        second = group(config, server, 1, h1, 2, env=killed)
        wait_for(lambda: heartbeats(server, "[2 heartbeating]"), [first, second])
        (flags / "1").touch()
        assert second.wait(240) != 0  # killed inside step 3
        metrics = h0 / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and '"iteration": 4,' in metrics.read_text(), [first])
        third = group(config, server, 1, back, 2)  # an empty save folder
        asked = "[1/1 participants healthy][2 heartbeating]"
        wait_for(lambda: heartbeats(server, asked), [first, third])
        (flags / "5").touch()
        out0, out1 = finished([first, third])
    finally:
        server.shutdown()
    # group 0: every step once; the live groups at its syncs 2 -> 1 -> 2
    assert sorted(losses(h0)) == list(range(1, 7)), out0[-3000:]
    assert losses(h0, "replica_groups") == {2: 2.0, 4: 1.0, 6: 2.0}
    assert "replica group 1: healed from a live group at step 6" in out1, out1[-3000:]
    # had the outer state not come over, group 1's outer step would start from its own
    # initial weights with no momentum, and the weights would differ
    healed = weights(back)
    for name, tensor in weights(h0).items():
        assert torch.equal(healed[name], tensor), name
