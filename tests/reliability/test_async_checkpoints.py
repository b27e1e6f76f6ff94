"""async_checkpointing: a run that writes its checkpoints in the background trains, saves and
resumes bit for bit like one that writes them in the step, on one process and on two; and
kill -9 while a write is in flight, or while it is being finished, leaves the last finished
checkpoint to resume from, as the synchronous path does."""

from __future__ import annotations

import subprocess

from tests.reliability.test_kills import (
    assert_bitwise_equal,
    command,
    config_for,
    env,
    run_with_kills,
)
from torchneox.train import checkpoint

ASYNC = {"async_checkpointing": True}


def test_background_saves_equal_saves_in_the_step(make_config, tmp_path):
    for name, extra in (("whole", {}), ("background", ASYNC)):
        cfg = config_for(make_config, tmp_path, name, **extra)
        subprocess.run(command(cfg, 1), env=env(), check=True, capture_output=True, timeout=300)
    assert_bitwise_equal(tmp_path / "background", tmp_path / "whole")
    for step in (2, 4, 6, 8, 10, 12):  # every save finished, each the state of its own step
        saved = tmp_path / "background" / f"global_step{step}"
        assert not checkpoint.verify(saved)
        assert checkpoint.read_meta(saved)["iteration"] == step
    assert not list((tmp_path / "background").glob(".*partial"))


def test_kill_9_while_a_background_save_is_in_flight(make_config, tmp_path):
    whole = config_for(make_config, tmp_path, "whole")
    subprocess.run(command(whole, 1), env=env(), check=True, capture_output=True, timeout=300)
    killed = config_for(make_config, tmp_path, "killed", **ASYNC)
    faults = [
        "kill@save.staged:2",  # the first save's files being written: nothing to resume
        "kill@step.start:3",  # the write may be done, but it was never finished
        "kill@save.shards:4",  # every file written, no metadata yet
        "kill@save.renamed:6",  # renamed, 'latest' not moved
        "kill@save.staged:8",  # global_step6 stays the latest
    ]
    kills = run_with_kills(killed, 1, faults, [])
    assert kills == len(faults)
    assert_bitwise_equal(tmp_path / "killed", tmp_path / "whole")


def test_two_processes_save_in_the_background(make_config, tmp_path):
    zero3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 2}
    for name, extra in (("whole", zero3), ("background", zero3 | ASYNC)):
        cfg = config_for(make_config, tmp_path, name, **extra)
        subprocess.run(command(cfg, 2), env=env(), check=True, capture_output=True, timeout=300)
    assert_bitwise_equal(tmp_path / "background", tmp_path / "whole")
