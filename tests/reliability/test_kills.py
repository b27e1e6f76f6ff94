"""kill -9 at many points (inside checkpoint saves, inside steps, and at random moments), with
one process and with two: rerunning the same command resumes from the last complete
checkpoint, and the final weights and the losses from there on equal those of a run never
interrupted, bit for bit (CPU, fp32)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import torch

from tests.forked import Forked, run_cli
from torchneox.checkpoint import files as checkpoint_format

STEPS = 12


def command(config: str, nproc: int) -> list[str]:
    cmd = [sys.executable, "-m", "torchneox", "train", config]
    return cmd + (["--nproc", str(nproc)] if nproc > 1 else [])


def start(config: str, nproc: int, environment: dict[str, str]) -> Forked | subprocess.Popen:
    """``torchneox train CONFIG`` started: one process forked from the tests' server
    (tests/forked.py), several as the user launches them."""
    if nproc == 1:
        return Forked(["train", config], environment)
    return subprocess.Popen(
        command(config, nproc),
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def run(config: str, nproc: int, environment: dict[str, str]) -> subprocess.CompletedProcess:
    """``torchneox train CONFIG`` to its end: its exit status and output."""
    if nproc == 1:
        return run_cli(["train", config], environment, timeout=300)
    return subprocess.run(command(config, nproc), env=environment, capture_output=True, timeout=300)


def env(fault: str | None = None) -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e.pop("TORCHNEOX_FAULT", None)
    if fault:
        e["TORCHNEOX_FAULT"] = fault
    return e


def last_losses(folder) -> dict[int, float]:
    """The loss logged last for each step (steps re-run after a kill log again)."""
    out = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "lm_loss" in row:
            out[row["iteration"]] = row["lm_loss"]
    return out


def load_flat(step) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(step)).read_metadata()
    flat = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if hasattr(v, "size")
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # loading in one process, as intended
        dcp.load(flat, checkpoint_id=str(step))
    return flat


def assert_bitwise_equal(killed, whole) -> None:
    got, want = last_losses(killed), last_losses(whole)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got == want  # exact float equality, every step
    a, b = load_flat(checkpoint_format.resolve(killed)), load_flat(checkpoint_format.resolve(whole))
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # weights and optimizer moments


def run_with_kills(config: str, nproc: int, faults: list[str], timed: list[float]) -> int:
    """Run the command once per fault (each must die by SIGKILL), then with kills after the
    given delays, then to the end; returns how many kills landed."""
    kills = 0
    for fault in faults:
        died = run(config, nproc, env(fault))
        assert died.returncode != 0, f"{fault}: the run did not die"
        if nproc == 1:
            assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
        kills += 1
    for delay in timed:
        proc = start(config, nproc, env())
        time.sleep(delay)
        if proc.poll() is None:
            proc.kill()
            kills += 1
        proc.wait(timeout=300)
    final = run(config, nproc, env())
    assert final.returncode == 0, final.stderr[-3000:]
    return kills


def config_for(make_config, tmp_path, name: str, **extra) -> str:
    folder = tmp_path / name
    return make_config(
        f"{name}.yml",
        train_iters=STEPS,
        checkpoint_factor=2,
        hidden_dropout=0.1,  # dropout masks must resume too
        save=str(folder),
        load=str(folder),
        **extra,
    )


def test_kill_9_anywhere_in_one_process(make_config, tmp_path):
    whole = config_for(make_config, tmp_path, "whole")
    began = time.perf_counter()
    assert run(whole, 1, env()).returncode == 0
    seconds = time.perf_counter() - began
    killed = config_for(make_config, tmp_path, "killed")
    faults = [
        "kill@step.start:1",  # before any checkpoint
        "kill@save.start:2",
        "kill@save.shards:2",  # shards written, no metadata
        "kill@save.meta:2",  # metadata written, no manifest
        "kill@save.manifest:2",  # complete but not renamed
        "kill@save.renamed:2",  # renamed, 'latest' not moved (the first save: no latest at all)
        "kill@step.backward:5",  # gradients computed, not applied
        "kill@save.shards:6",
        "kill@save.manifest:8",
        "kill@save.renamed:10",  # latest still names global_step8
        "kill@step.start:11",
    ]
    rng = random.Random(0)
    timed = [rng.uniform(0.5, 1.0) * seconds for _ in range(3)]
    kills = run_with_kills(killed, 1, faults, timed)
    assert kills >= 10
    assert_bitwise_equal(tmp_path / "killed", tmp_path / "whole")
    assert not checkpoint_format.verify(checkpoint_format.resolve(tmp_path / "killed"))


def test_kill_9_of_one_rank_in_two_processes(make_config, tmp_path):
    extra = {"train_micro_batch_size_per_gpu": 2, "distributed_timeout_minutes": 1.0}
    whole = config_for(make_config, tmp_path, "whole", **extra)
    assert run(whole, 2, env()).returncode == 0
    killed = config_for(make_config, tmp_path, "killed", **extra)
    faults = [
        "kill@save.shards:2:1",  # rank 1 dies after writing its shards
        "kill@save.meta:4:0",  # rank 0 dies before the manifest
        "kill@step.backward:5:1",
        "kill@save.renamed:6:0",
    ]
    assert run_with_kills(killed, 2, faults, []) == 4
    assert_bitwise_equal(tmp_path / "killed", tmp_path / "whole")
