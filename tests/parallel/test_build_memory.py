"""A run of any size starts: no rank ever holds the whole model. Four processes (eight for a DPO
run, whose policy and reference each rank holds a shard of) build a model of
more than 1 GiB of fp32 weights under ZeRO-3 (and with tensor parallelism, and a DPO run's
reference beside its policy, with tensor parallelism); each stops itself as its first step begins, and every rank's peak
resident memory (VmHWM, read from /proc from outside) is held against the same run's with a
tiny model. Building the whole model on each rank before sharding it (as before) puts the
whole model's bytes on every rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import post_training_data
from torchneox.config.derive import derive
from torchneox.config.load import load_config

NPROC = 4  # each rank keeps a quarter: its peak stays far under the whole model
# about 303 M parameters: 1.21 GB of fp32 weights, in blocks whose largest weight (the MLP's)
# is 64 MiB, the one tensor a rank draws whole at a time
BIG = {"num_layers": 6, "hidden_size": 2048, "num_attention_heads": 16}
TINY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
ZERO3 = {"zero_optimization": {"stage": 3}, "train_iters": 1, "save": None, "load": None}


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def built_peaks(config: str, *overrides: str, nproc: int = NPROC) -> tuple[list[int], str]:
    """Each rank's peak resident bytes when it reaches its first step (it stops itself there),
    and what the run printed until then."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHNEOX_FAULT="stop@step.start:1")
    command = [sys.executable, "-m", "torchneox", "train", config, "--nproc", str(nproc)]
    for o in overrides:
        command += ["--set", o]
    launcher = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline, peaks = time.monotonic() + 240, []
        while time.monotonic() < deadline:
            stopped = [
                p for p in _descendants(launcher.pid) if _status(p).get("State", "")[:1] == "T"
            ]
            if len(stopped) == nproc:
                peaks = [int(_status(p)["VmHWM"].split()[0]) * 1024 for p in sorted(stopped)]
                break
            if launcher.poll() is not None:
                break
            time.sleep(0.2)
    finally:
        for pid in _descendants(launcher.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        out, _ = launcher.communicate()
    assert peaks, f"the ranks did not all reach their first step:\n{out[-3000:]}"
    return peaks, out


def model_bytes(config: str) -> int:
    return derive(load_config([config]))["num_parameters"] * 4


def assert_below(peaks: list[int], base: list[int], whole: int) -> None:
    above = [p - b for p, b in zip(peaks, base, strict=True)]
    assert max(above) < 0.6 * whole, (
        f"ranks peaked {[round(a / 2**20) for a in above]} MiB above the tiny run; the model "
        f"is {whole / 2**20:.0f} MiB"
    )


def assert_built_in_shards(big: str, tiny: str, *overrides: str, nproc: int = NPROC) -> str:
    """The ranks' peaks held against the tiny run's; what the big run printed."""
    whole = model_bytes(big)
    assert whole >= 2**30
    base, _ = built_peaks(tiny, *overrides, nproc=nproc)
    peaks, out = built_peaks(big, *overrides, nproc=nproc)
    assert_below(peaks, base, whole)
    return out


def test_no_rank_holds_the_whole_model_while_building(make_config, tmp_path):
    big = make_config("big.yml", **BIG, **ZERO3)
    tiny = make_config("tiny.yml", **TINY, **ZERO3)
    # saved as the first step begins (step 0: the weights as built), then resumed: the
    # resumed run draws nothing, its weights read into each rank's shards (held against the
    # same tiny baseline: its step-0 save of a tiny model adds nothing that matters)
    saved = tmp_path / "saved"
    whole = model_bytes(big)
    base, _ = built_peaks(tiny, "extra_save_iters=[0]", f"save={tmp_path / 'tiny_saved'}")
    peaks, out = built_peaks(big, "extra_save_iters=[0]", f"save={saved}")
    assert_below(peaks, base, whole)
    assert "parameter tensors drawn from seed 1234, each rank keeping only its shards" in out
    assert (saved / "global_step0").is_dir()
    peaks, out = built_peaks(big, f"load={saved}")
    assert f"weights: read from {saved / 'global_step0'} into each rank's shards; none" in out
    assert_below(peaks, base, whole)


def test_a_dpo_runs_reference_is_built_in_shards_too(tmp_path):
    keys = post_training_data(tmp_path, only=("dpo",))["dpo"]
    common = {
        "model_parallel_size": 2,  # (with tensor parallelism: 4 data x 2 tensor ranks)
        "seq_length": 64,
        "max_position_embeddings": 64,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
        "precision": "fp32",
        "num_workers": 0,
    } | ZERO3
    paths = []
    for name, size in (("big", BIG), ("tiny", TINY)):
        path = tmp_path / f"dpo_{name}.yml"
        path.write_text(json.dumps(keys | common | size))
        paths.append(str(path))
    out = assert_built_in_shards(*paths, nproc=8)  # two models' shards: an eighth of each
    assert "1 steps of 4 x 64 tokens" in out  # 8 processes: 4 data ranks of 2 tensor ranks
