"""Replica groups under torchft (CPU, gloo): 2 groups of 2 processes, ZeRO-3 inside each. While
both are live they train as one 4-process hybrid-sharded run on the same global batch, bit for
bit. Then every process of group 1 is killed (kill -9) inside a step: group 0 never restarts and
its step counter goes on (the live groups it logs go 2 -> 1 -> 2); group 1, restarted with an
empty save folder, joins the next quorum, heals from group 0 over torchft's checkpoint transport
and ends with group 0's weights, bit for bit. Disk checkpoints cross over both ways: a group's
resumes into a run without groups, the one run's into a group. One scenario checks all of it,
its runs side by side where they can be: a launch of 4 processes costs more than its steps.
Every run is forked from the tests' server (tests/forked.py): no import of torch per run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.forked import Forked
from tests.helpers import losses, weights
from torchneox.cli import main

torchft = pytest.importorskip("torchft")

# each group: 2 ranks x 2 micro-batches of 1 = 4 sequences; the global batch of 2 groups: 8
KEYS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}
KEYS |= {"hidden_dropout": 0.0, "eval_iters": 1, "num_workers": 0, "no_weight_tying": True}
KILLED, HELD, LAST = 3, 5, 6  # group 1 dies in step 3; group 0 holds before step 5 for it
HYBRID = "zero_optimization={stage: 3, mics_shard_size: 2}"


def lighthouse():
    from torchft.coordination import LighthouseServer

    # a quorum may hold one group (group 0 goes on alone); a group that goes silent counts as
    # dead after 1 s (the default, 5 s, only slows the test)
    return LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=1000
    )


def status(server) -> str:
    """The lighthouse's own account of the next quorum (its dashboard's /status text)."""
    with urllib.request.urlopen(server.address() + "/status", timeout=5) as page:
        return page.read().decode()


def wait_for(ready, run: Forked, timeout: float = 120) -> None:
    """Until ``ready()`` (the group ``run`` still alive)."""
    end = time.monotonic() + timeout
    while not ready():
        assert run.poll() is None and time.monotonic() < end, "not ready in time"
        time.sleep(0.05)


def logged(folder: Path, step: int) -> bool:
    """Whether the run saving to ``folder`` logged ``step``."""
    metrics = folder / "metrics.jsonl"
    return metrics.is_file() and f'"iteration": {step},' in metrics.read_text()


def torchneox(config: str, keys: list[str], nproc: int, env=None) -> Forked:
    """``torchneox train CONFIG --nproc N --set KEY ...``, forked from the tests' server (no
    import of torch per run; tests/forked.py)."""
    args = ["train", config, "--nproc", str(nproc), *[a for k in keys for a in ("--set", k)]]
    return Forked(args, dict(os.environ, OMP_NUM_THREADS="1") | (env or {}))


def group(config: str, server, g: int, folder: Path, flags: Path, fault: str) -> Forked:
    """Replica group ``g`` of 2: 2 processes, ZeRO-3, saving to ``folder``."""
    env = {"TORCHFT_MANAGER_PORT": "0", "TORCHNEOX_FAULT": fault}
    env["TORCHNEOX_FAULT_FLAG"] = str(flags)
    keys = [f"ft_lighthouse={server.address()}", f"ft_replica_group={g}", "ft_replica_groups=2"]
    keys += [f"save={folder}", f"load={folder}", "ft_timeout_seconds=20"]
    keys += ["zero_optimization.stage=3", "checkpoint_factor=2"]
    return torchneox(config, keys, 2, env)


def alone(server) -> list[str]:
    """The keys of a replica group that is the only group of its run."""
    return [f"ft_lighthouse={server.address()}", "ft_replica_groups=1", "ft_timeout_seconds=20"]


def resume(config: str, folder: Path, step: Path, keys: list[str]) -> Forked:
    """One process, the groups' global batch (8 as 2 micro-batches of 4), from the checkpoint
    ``step`` to step KILLED."""
    keys = [*keys, f"save={folder}", f"load={step}", f"exit_interval={KILLED}"]
    keys += ["train_micro_batch_size_per_gpu=4"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHFT_MANAGER_PORT="0")
    return Forked(["train", config, *[a for k in keys for a in ("--set", k)]], env)


def ended(run: Forked, timeout: float = 240) -> str:
    """What the run printed, once it has ended (it must succeed)."""
    result = run.result(timeout)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text[-4000:]
    return text


@pytest.fixture(scope="module")
def config(make_module_config):
    return make_module_config(train_iters=LAST, **KEYS)


def run_scenario(config: str, tmp_path: Path, server, lone) -> tuple[str, str]:
    """The groups' run (group 1 killed and restarted), the one run, and the two resumed runs
    (on their own lighthouse, ``lone``), as many at once as can be; the groups' outputs."""
    flags, g0, g1, back = (tmp_path / n for n in ("flags", "g0", "g1", "g1-restarted"))
    flags.mkdir()
    hsdp = tmp_path / "hsdp"
    keys = [f"save={hsdp}", "load=null", f"exit_interval={KILLED}", "checkpoint_factor=2"]
    one = torchneox(config, [*keys, HYBRID], 4)
    # both groups wait before step 1 until both beat (a quorum then waits for both), and
    # group 0 again before step HELD, until restarted group 1 is waiting in a quorum
    first = group(config, server, 0, g0, flags, f"wait@step.start:1,wait@step.start:{HELD}")
    kill = f"wait@step.start:1,kill@step.backward:{KILLED}"
    second = group(config, server, 1, g1, flags, kill)
    wait_for(lambda: "[2 heartbeating]" in status(server), first)
    (flags / "1").touch()
    assert second.result(240).returncode != 0  # every process of group 1 killed inside step KILLED
    wait_for(lambda: logged(g0, HELD - 1), first)  # group 0 on alone, then held
    third = group(config, server, 1, back, flags, "")  # an empty save folder
    # disk checkpoints cross over: the groups' into a run without groups, the one run's into a
    # group alone in its quorum, each on to step KILLED
    ended(one)
    resumed = [
        resume(config, tmp_path / "no-groups", g0 / f"global_step{KILLED - 1}", []),
        resume(config, tmp_path / "a-group", hsdp / f"global_step{KILLED - 1}", alone(lone)),
    ]
    # the restarted group waits in a quorum for the held one (which still beats)
    asked = "[1/1 participants healthy][2 heartbeating]"
    wait_for(lambda: asked in status(server), third)
    (flags / str(HELD)).touch()
    out = ended(first), ended(third)
    for run in resumed:
        result = run.result(timeout=240)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_two_groups_of_two_survive_a_killed_group(config, tmp_path):
    g0, back, hsdp = tmp_path / "g0", tmp_path / "g1-restarted", tmp_path / "hsdp"
    server, lone = lighthouse(), lighthouse()
    try:
        out0, out1 = run_scenario(config, tmp_path, server, lone)
    finally:
        server.shutdown()
        lone.shutdown()
    steps = list(range(1, LAST + 1))
    # group 0: every step once, through the failure; the live groups 2 -> 1 -> 2
    assert sorted(losses(g0)) == steps, out0[-3000:]
    live = {k: 2.0 for k in steps} | {KILLED: 1.0, HELD - 1: 1.0}
    assert losses(g0, "replica_groups") == live
    assert f"step {KILLED}: not committed by the replica groups; trained again" in out0
    # restarted group 1 healed to group 0's state after step HELD - 1, and its first logged
    # step is HELD, the step of the quorum it healed in
    assert f"replica group 1: healed from a live group at step {HELD - 1}" in out1
    assert sorted(losses(back)) == [HELD, LAST]
    assert losses(back) == {k: v for k, v in losses(g0).items() if k >= HELD}
    assert not (back / f"global_step{HELD - 1}").exists()  # nothing of it came from disk
    healed = weights(back)
    for name, tensor in weights(g0).items():
        assert torch.equal(healed[name], tensor), name
    # before the kill the 2 groups of 2 are one 4-process hybrid-sharded run (ZeRO-3 within 2
    # groups of 2, replicated across them) on the same global batch: the same gradient norms
    # and weights, bit for bit. The logged loss may differ in its last bit: the groups log the
    # mean over the groups of each group's mean over its ranks, the one run one mean over its 4
    # ranks, and float sums in another order round differently.
    assert losses(g0, "grad_norm")[KILLED - 1] == losses(hsdp, "grad_norm")[KILLED - 1]
    for k in range(1, KILLED):
        assert losses(g0)[k] == pytest.approx(losses(hsdp)[k], rel=1e-6, abs=0), k
    at = weights(g0 / f"global_step{KILLED - 1}")
    for name, tensor in weights(hsdp / f"global_step{KILLED - 1}").items():
        assert torch.equal(at[name], tensor), name
    # each resumed run's step KILLED is the one run's (one process against four: float close)
    whole = weights(hsdp)
    for folder in (tmp_path / "no-groups", tmp_path / "a-group"):
        assert list(losses(folder)) == [KILLED], folder
        assert losses(folder)[KILLED] == pytest.approx(losses(hsdp)[KILLED], rel=1e-5), folder
        for name, tensor in weights(folder).items():
            torch.testing.assert_close(tensor, whole[name], rtol=1e-4, atol=5e-5)
    assert losses(tmp_path / "a-group", "replica_groups") == {KILLED: 1.0}


def test_the_lighthouse_verb_prints_its_address_and_stops_on_sigterm():
    args = [sys.executable, "-m", "torchneox", "lighthouse", "--port", "0", "--min-replicas", "2"]
    run = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = run.stdout.readline()
        assert line.startswith("lighthouse: http://"), line + run.stderr.read()
        address = line.split(": ", 1)[1].strip()
        with urllib.request.urlopen(address + "/status", timeout=10) as page:
            assert "need min_replicas 2" in page.read().decode()  # it serves, as asked
        run.send_signal(signal.SIGTERM)
        assert run.wait(30) == 0
    finally:
        run.kill()
        run.communicate()


def test_a_lighthouse_without_replicas_is_one_line(capsys):
    assert main(["lighthouse", "--port", "0", "--min-replicas", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchneox: error: ") and err.count("\n") == 1, err
    assert "--min-replicas must be 1 or more" in err
