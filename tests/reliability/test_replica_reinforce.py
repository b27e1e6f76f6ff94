"""REINFORCE trained by replica groups (torchft, CPU, gloo): 2 groups of 1 process sample their
rollouts as data-parallel ranks 0 and 1 of one run would (group g's prompts and sampling
generators), so while both are live they train as one 2-process run, bit for bit. Each batch
of rollouts trains 2 steps (rollout_updates 2). Group 1 is killed (kill -9) inside step 3, the
first step of the second batch; group 0 goes on alone. Restarted to resume its save folder,
group 1 loads its own checkpoint of step 2 (the first batch's rows, its baseline's history), then
heals from group 0 after step 3, in the middle of the second batch: it takes the live group's
model, optimizer and position, not its rollouts, drops the first batch's rows it loaded, and
samples its own share of the second batch again from the healed policy. Both end with the same
weights, bit for bit. The runs are forked from the tests' server (tests/forked.py): no import
of torch per run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.forked import Forked
from tests.helpers import losses, weights
from tests.reliability.test_replica_groups import ended, lighthouse, logged, status, wait_for
from tests.train.rl.test_reinforce_run import EXAMPLE, tiny

torchft = pytest.importorskip("torchft")

KILLED, HELD, LAST = 3, 4, 5  # group 1 dies in step 3; group 0 holds before step 4 for it


def keys() -> list[str]:
    """The shipped example, smaller: 2 prompts x 4 completions a step per group."""
    more = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    more |= {"train_iters": LAST, "lr_decay_iters": LAST, "checkpoint_factor": 2}
    return tiny(rollout_updates=2, **more)


def run(sets: list[str], nproc: int = 1, env: dict | None = None) -> Forked:
    argv = ["train", str(EXAMPLE), "--nproc", str(nproc), *[a for s in sets for a in ("--set", s)]]
    return Forked(argv, dict(os.environ, OMP_NUM_THREADS="1") | (env or {}))


def group(server, g: int, folder: Path, flags: Path, fault: str, load: str = "null") -> Forked:
    env = {"TORCHFT_MANAGER_PORT": "0", "TORCHNEOX_FAULT": fault}
    env["TORCHNEOX_FAULT_FLAG"] = str(flags)
    ft = [f"ft_lighthouse={server.address()}", f"ft_replica_group={g}", "ft_replica_groups=2"]
    ft += ["ft_timeout_seconds=20", f"save={folder}", f"load={load}"]  # (null: random weights)
    return run([*keys(), *ft], env=env)


def test_reinforce_groups_train_as_one_run_and_a_killed_group_heals_mid_batch(tmp_path):
    flags, g0, g1, one = (tmp_path / n for n in ("flags", "g0", "g1", "one"))
    flags.mkdir()
    server = lighthouse()
    try:
        whole = run([*keys(), f"save={one}", "load=null", f"exit_interval={KILLED - 1}"], 2)
        first = group(server, 0, g0, flags, f"wait@step.start:1,wait@step.start:{HELD}")
        second = group(server, 1, g1, flags, f"wait@step.start:1,kill@step.backward:{KILLED}")
        wait_for(lambda: "[2 heartbeating]" in status(server), first)
        (flags / "1").touch()
        assert second.result(240).returncode != 0  # killed inside step KILLED
        wait_for(lambda: logged(g0, HELD - 1), first)  # group 0 on alone, then held
        third = group(server, 1, g1, flags, "", load=str(g1))  # resumes step KILLED - 1
        wait_for(lambda: "[1/1 participants healthy][2 heartbeating]" in status(server), third)
        (flags / str(HELD)).touch()
        out0, out1 = ended(first), ended(third)
        ended(whole)
    finally:
        server.shutdown()
    # while both were live: one 2-process run's steps and weights (checkpoint of step 2)
    for k in range(1, KILLED):
        assert losses(g0)[k] == pytest.approx(losses(one)[k], rel=1e-6, abs=0), k
        assert losses(g0, "grad_norm")[k] == losses(one, "grad_norm")[k], k
    at = weights(g0 / f"global_step{KILLED - 1}")
    for name, tensor in weights(one / f"global_step{KILLED - 1}").items():
        assert torch.equal(at[name], tensor), name
    # group 1 loaded step 2 and healed after step 3, mid-batch: its own share of that batch
    # sampled again (the killed run logged steps 1 and 2, the restarted one HELD on)
    assert sorted(losses(g0)) == list(range(1, LAST + 1)), out0[-3000:]
    assert f"replica group 1: healed from a live group at step {HELD - 1}" in out1, out1[-3000:]
    assert sorted(losses(g1)) == [*range(1, KILLED), *range(HELD, LAST + 1)]
    assert losses(g1, "replica_groups") == {1: 2.0, 2: 2.0, HELD: 2.0, LAST: 2.0}
    # its rows at step HELD are new and its own: neither the first batch's it loaded nor a peer's
    stats = ("reward", "completion_length")
    mine = [losses(g1, key)[HELD] for key in stats]
    assert mine != [losses(g1, key)[KILLED - 1] for key in stats]
    assert mine != [losses(g0, key)[HELD] for key in stats]
    healed = weights(g1)
    for name, tensor in weights(g0).items():
        assert torch.equal(healed[name], tensor), name
