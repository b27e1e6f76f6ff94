"""Online REINFORCE end to end: the shipped example learns its task from rewards alone; a run
stopped and resumed equals one never stopped (mid-cycle too); a reward function that fails
stops the run in one line with nothing saved; rollouts asked of GPT-NeoX's data-server protocol
train exactly as the same completions sampled in the run, and a malicious answer is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.data.dataserver import start_server
from tests.helpers import losses, metric_rows, train, weights
from torchneox.cli import main
from torchneox.data.online import Group
from torchneox.train.rl import sources as rollout_sources

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "configs" / "reinforce_tiny.yml"
HERE = REPO / "configs" / "reinforce_tiny"


def tiny(**keys) -> list[str]:
    """The example's model and task, shorter (8 rows a step, 6 steps), its files by absolute
    paths: the overrides."""
    values = {
        "rollout_prompts": str(HERE / "prompts.jsonl"),
        "vocab_file": str(HERE / "tokenizer.json"),
        "reward_function": f"{HERE / 'reward.py'}:spell_neox",
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "train_iters": 6,
        "lr_decay_iters": 6,
        "checkpoint_factor": 3,
        "log_interval": 1,
    }
    values.update(keys)
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


def cli(*sets: str) -> int:
    """``torchneox train`` of the example in this process, with ``sets``."""
    args = ["train", str(EXAMPLE)]
    for s in sets:
        args += ["--set", s]
    return main(args)


def test_the_shipped_example_learns_its_task(tmp_path, monkeypatch):
    """configs/reinforce_tiny.yml as its comment runs it: the mean reward starts low and is at
    least 0.8 over the last 50 of its 300 steps."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    assert main(["train", str(EXAMPLE), "--set", f"save={out}", "--set", "log_interval=10"]) == 0
    reward = losses(out, "reward")
    assert sorted(reward) == list(range(10, 301, 10))
    assert reward[10] < 0.5
    assert min(reward[k] for k in range(250, 301, 10)) >= 0.8, reward
    row = metric_rows(out)[-1]
    assert {"kl", "reward_std", "completion_length", "rollout_tokens_per_sec"} <= set(row)


@pytest.mark.parametrize("updates", [1, 2], ids=["one update", "two updates, stopped mid-cycle"])
def test_a_stopped_run_resumes_bit_for_bit(tmp_path, updates):
    sets = tiny(rollout_updates=updates)
    whole, moved = tmp_path / "whole", tmp_path / "moved"
    train(str(EXAMPLE), *sets, f"save={whole}")
    train(str(EXAMPLE), *sets, f"save={moved}", "exit_interval=3")
    train(str(EXAMPLE), *sets, f"save={moved}", f"load={moved}")
    for key in ("lm_loss", "reward", "kl", "grad_norm"):
        done, after = losses(whole, key), losses(moved, key)
        assert [after[k] for k in (4, 5, 6)] == [done[k] for k in (4, 5, 6)], key
    if updates > 1:
        assert "clip_fraction" in metric_rows(moved)[-1]
    for name, value in weights(whole).items():
        assert torch.equal(weights(moved)[name], value), name


def test_a_reward_function_that_fails_stops_the_run_in_one_line(tmp_path, capsys):
    (tmp_path / "bad.py").write_text("def reward(prompts, completions):\n    return [0.5]\n")
    sets = tiny(reward_function=f"{tmp_path / 'bad.py'}:reward")
    assert cli(*sets, f"save={tmp_path / 'run'}") != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "bad.py:reward" in err and "nothing of this step was saved" in err
    assert not list((tmp_path / "run").glob("global_step*"))


HANGS = """
import pathlib
import time

HERE = pathlib.Path(__file__).parent


def reward(prompts, completions):
    try:  # "entered" inside the try: a Ctrl-C right after it must land here
        (HERE / "entered").touch()
        time.sleep(1000)
    except KeyboardInterrupt:  # the first Ctrl-C reaches it; it swallows it and hangs on
        (HERE / "interrupted").touch()
    time.sleep(1000)
"""


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {path.name} within {seconds} s"
        time.sleep(0.05)


def test_ctrl_c_twice_ends_a_run_whose_reward_function_hangs(tmp_path):
    """`torchneox train` as a terminal runs it: the first Ctrl-C reaches the reward function
    (as KeyboardInterrupt), the second ends the process though the function swallowed the
    first, in one line naming it."""
    (tmp_path / "hangs.py").write_text(HANGS)
    args = [sys.executable, "-m", "torchneox", "train", str(EXAMPLE)]
    sets = tiny(reward_function=f"{tmp_path / 'hangs.py'}:reward", train_iters=1)
    for s in [*sets, f"save={tmp_path / 'run'}"]:
        args += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        _wait_for(tmp_path / "entered", proc, 120)
        proc.send_signal(signal.SIGINT)
        _wait_for(tmp_path / "interrupted", proc, 30)
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=30)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and [x for x in err.splitlines() if "torchneox" in x] == [
        f"torchneox: interrupted: the reward function {tmp_path / 'hangs.py'}:reward did not "
        "return after SIGINT; a second SIGINT ended the run (nothing of this step was saved)"
    ], err[-3000:]


def _recorded(monkeypatch) -> list[list[Group]]:
    """Every rollout batch sampled in the run, as it was sampled."""
    seen: list[list[Group]] = []
    make = rollout_sources.SampledRollouts.make

    def record(self, index):
        groups = make(self, index)
        seen.append(groups)
        return groups

    monkeypatch.setattr(rollout_sources.SampledRollouts, "make", record)
    return seen


def test_served_rollouts_train_as_the_same_completions_sampled_in_the_run(tmp_path, monkeypatch):
    """The data-server source against a real server on loopback: served the completions (and
    rewards) the run sampled, a second run computes the same losses, advantages (the reward
    history's baseline) and weights; the sampling keys it does not read are named."""
    sets = tiny(train_iters=3, kl_div_beta=0.1, advantage_normalization="none")
    sampled = _recorded(monkeypatch)
    assert cli(*sets, f"save={tmp_path / 'sampled'}") == 0
    assert len(sampled) == 3
    log = tmp_path / "requests.log"
    with start_server(tmp_path, sampled, log=log, sequence=True) as (_, port):
        served = [f"save={tmp_path / 'served'}", "rollout_prompts=null", "dataset_impl=online"]
        run = train(str(EXAMPLE), *sets, *served, f"online_dataserver_ports={port}")
    # the example's reward function and sampling keys are not read, and said so
    assert (
        "warning: reward_function, rollout_max_new_tokens have no effect here: the data servers "
        "sample the rollouts and send their rewards (no rollout_prompts)\n"
    ) in run.stdout
    assert log.read_text().split() == ["train"] * 3
    for key in ("lm_loss", "reward", "advantage", "kl", "grad_norm"):
        assert losses(tmp_path / "served", key) == losses(tmp_path / "sampled", key), key
    for name, value in weights(tmp_path / "sampled").items():
        assert torch.equal(weights(tmp_path / "served")[name], value), name


def test_a_malicious_answer_stops_the_run_in_one_line_and_runs_nothing(tmp_path, capsys):
    sets = tiny(rollout_prompts=None, dataset_impl="online")
    marker = tmp_path / "marker"
    with start_server(tmp_path, [], mode="malicious", marker=marker) as (_, port):
        assert cli(*sets, f"online_dataserver_ports={port}", f"save={tmp_path / 'r'}") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"data server localhost:{port}: the answer holds a posix.system" in err, err
    assert not marker.exists()


def test_a_reward_model_scores_the_rollouts(tmp_path, monkeypatch, capsys):
    """reward_model: a train_impl rm checkpoint's value of each sampled completion is its
    reward (the scorer of train/rl/rewards.py, tested where it reads the value); one with
    another tokenizer than the policy's is refused before step 1."""
    from tests.train.rl.test_rewards import _saved
    from torchneox.train.rl.rewards import RewardModelScorer

    _saved(tmp_path / "char", "rm")  # the character tokenizer's 512 ids
    sets = tiny(reward_function=None, reward_model=str(tmp_path / "char"))
    assert cli(*sets, f"save={tmp_path / 'refused'}") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("torchneox: error: reward_model: "), err
    assert "the reward model's tokenizer (CharLevelTokenizer) is not the policy's" in err
    _saved(
        tmp_path / "rm", "rm", tokenizer_type="HFTokenizer", vocab_file=str(HERE / "tokenizer.json")
    )
    sampled = _recorded(monkeypatch)
    sets = tiny(reward_function=None, reward_model=str(tmp_path / "rm"), train_iters=2)
    assert cli(*sets, f"save={tmp_path / 'run'}") == 0
    scorer = RewardModelScorer(str(tmp_path / "rm"), "cpu")
    for step, groups in enumerate(sampled, 1):
        prompts = [g.prompt for g in groups for _ in g.completions]
        want = scorer(prompts, [c for g in groups for c in g.completions])
        got = [r for g in groups for r in g.rewards]
        assert got == pytest.approx(want, abs=1e-6)
        assert losses(tmp_path / "run", "reward")[step] == pytest.approx(sum(want) / len(want))
    assert len({r for g in sampled[0] for r in g.rewards}) > 1


def test_prompts_longer_than_the_room_keep_their_last_tokens(tmp_path, capsys):
    """seq_length 32 and 20 new tokens leave a prompt 13 tokens: the longer prompts of the
    example keep their last 13 (one note says how many), and the run trains in bfloat16."""
    sets = tiny(rollout_max_new_tokens=20, train_iters=1, precision="bfloat16")
    assert cli(*sets, f"save={tmp_path / 'run'}") == 0
    long = sum(len(json.loads(x)["prompt"]) > 13 for x in (HERE / "prompts.jsonl").open())
    assert long > 0
    note = f"rollout_prompts: {long} prompt(s) longer than seq_length + 1 - "
    assert note + "rollout_max_new_tokens = 13 tokens keep their last 13" in capsys.readouterr().out
    assert 0 <= losses(tmp_path / "run", "reward")[1] <= 1
