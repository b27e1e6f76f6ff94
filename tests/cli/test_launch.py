"""Two "nodes" on one machine: two torchrun invocations meeting at a c10d rendezvous on
127.0.0.1 train exactly like one process with the same global batch."""

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
