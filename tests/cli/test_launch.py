"""Two "nodes" on one machine: two torchrun invocations meeting at a c10d rendezvous on
127.0.0.1 train exactly like one process with the same global batch. A mistake the ranks of one
job all find is said once, with the exit status of one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import losses, train


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_one_machine(make_config, tmp_path):
    cfg = make_config(
        train_batch_size=8,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        train_iters=3,
        eval_iters=1,
        hidden_dropout=0.0,
        num_workers=0,
    )
    train(cfg, f"save={tmp_path / 'one'}", "load=null", "train_micro_batch_size_per_gpu=4")
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "test",
        "-m",
        "torchneox",
        "train",
        cfg,
        "--set",
        f"save={tmp_path / 'two'}",
        "--set",
        "load=null",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for _ in range(2)
    ]
    outputs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == [1, 2, 3]
    for k in two:
        assert two[k] == pytest.approx(one[k], rel=1e-5), k


def test_a_mistake_every_rank_finds_is_said_once_with_exit_2(make_config, tmp_path):
    """A data path that is not there, found by the ranks after they start: one line (not one
    per rank, nor the launcher's 'rank N exited'), exit 2 as in one process."""
    cfg = make_config(data_path=str(tmp_path / "nothing"), save=str(tmp_path / "r"))
    run = subprocess.run(
        [sys.executable, "-m", "torchneox", "train", cfg, "--nproc", "2"],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=240,
        check=False,
    )
    assert run.returncode == 2, run.stderr
    errors = [x for x in run.stderr.splitlines() if x.startswith("torchneox: error:")]
    assert errors == [f"torchneox: error: {tmp_path / 'nothing'}.idx: no such file (data path "
                      f"prefix '{tmp_path / 'nothing'}')"], run.stderr  # fmt: skip


def test_under_torchrun_each_line_is_said_by_the_first_rank_only(tmp_path, monkeypatch):
    """The ranks of one torchrun job agree through a folder named by its run id; distinct lines
    are each said once; outside a job of several ranks every line is said."""
    from torchneox.cli.exits import said_first

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.delenv("TORCHNEOX_ERRORS_SAID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert [said_first(x) for x in ("a", "a", "b", "a")] == [True, False, True, False]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert said_first("a") and said_first("a")


def test_the_fork_server_imports_torchao_where_8bit_adam_runs_it(make_config):
    """Each rank of a torchao 8-bit run would import torchao on its first step: the fork server
    imports it once; a run without it (or one process's bitsandbytes) does not pay for it."""
    from torchneox.cli.launch import _libraries
    from torchneox.config.load import load_config

    cfg = make_config(use_bnb_optimizer=True)
    tp = ["model_parallel_size=2", "global_num_gpus=2"]
    assert _libraries(load_config([cfg], tp)) == ["torchao.optim"]
    assert _libraries(load_config([make_config("plain.yml")], tp)) == []
