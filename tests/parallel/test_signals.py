"""SIGTERM (Slurm preemption): the current step finishes, a checkpoint is saved, the process
exits cleanly, and the same command resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import losses, train
from torchneox.checkpoint import files as checkpoint_format


def start(config, save, nproc=1):
    # with 2, `torchneox train --nproc 2`: its launcher passes the signal on to both ranks and
    # exits 0 once every rank has saved
    args = [sys.executable, "-m", "torchneox", "train", config]
    args += ["--nproc", str(nproc)] if nproc > 1 else []
    args += ["--set", f"save={save}", "--set", f"load={save}"]
    return subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        start_new_session=True,
    )


def wait_for_steps(save, count, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        metrics = save / "metrics.jsonl"
        if (
            metrics.is_file()
            and sum('"lm_loss"' in x for x in metrics.read_text().splitlines()) >= count
        ):
            return
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.05)
    raise AssertionError("training did not start")


@pytest.mark.parametrize(
    ("nproc", "sig"),
    [(1, signal.SIGTERM), (2, signal.SIGTERM), (1, signal.SIGINT)],
    ids=["sigterm-1", "sigterm-2", "sigint-1"],
)
def test_a_signal_saves_and_the_same_command_resumes(make_config, tmp_path, nproc, sig):
    common = {
        "train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "hidden_dropout": 0.0,
        "eval_iters": 0,
        "log_interval": 1,
        "num_workers": 0,
        "seq_length": 64,
        "lr_decay_iters": 300,
    }
    cfg = make_config(train_iters=300, train_micro_batch_size_per_gpu=4 // nproc, **common)
    save = tmp_path / "run"
    proc = start(cfg, save, nproc)
    wait_for_steps(save, 3, proc)
    os.killpg(proc.pid, sig) if nproc > 1 else proc.send_signal(sig)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "saving after this step" in output
    stopped = checkpoint_format.read_meta(checkpoint_format.resolve(save))["iteration"]
    assert 3 <= stopped < 300
    assert max(losses(save)) == stopped
    # the same config continued for 2 steps (in one process) gives the losses of a run never stopped
    more = [f"exit_interval={stopped + 2}", "train_micro_batch_size_per_gpu=4"]
    train(cfg, f"save={save}", f"load={save}", *more)
    train(cfg, f"save={tmp_path / 'whole'}", "load=null", *more)
    after, whole = losses(save), losses(tmp_path / "whole")
    for k in (stopped + 1, stopped + 2):
        assert after[k] == pytest.approx(whole[k], rel=1e-5), k


def _processes_with(marker: str) -> list[int]:
    """Pids of the processes whose environment (as they were started) holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:  # gone meanwhile
                continue
            if marker.encode() in environ:
                found.append(int(entry))
    return found


def test_no_rank_outlives_a_launcher_killed_with_kill_9(make_config, tmp_path):
    """`kill -9` of `train --nproc 2`'s launcher ends both ranks within seconds (torchrun's
    leaves them running, orphaned, to the end of training)."""
    cfg = make_config(train_iters=100_000, train_micro_batch_size_per_gpu=2)  # an hour's run
    save = tmp_path / "run"
    marker = f"TORCHNEOX_TEST_MARK={os.getpid()}-{time.time_ns()}"
    name, value = marker.split("=")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchneox", "train", cfg, "--nproc", "2", "--set", f"save={save}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1", **{name: value}),
    )
    wait_for_steps(save, 2, proc)
    assert len(_processes_with(marker)) >= 3  # the launcher, its fork server and the 2 ranks
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while _processes_with(marker) and time.time() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []
