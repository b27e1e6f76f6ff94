"""How long a resumed run takes to start: `torchneox train --nproc N` under ZeRO-3 resumed from a
checkpoint of a model of --hidden x --layers, timed from the launch to the line that says the
run is ready to step and to its first step's row; each rank's peak memory as the run prints
it. Prints one JSON row per run (a fresh start,
then a resume). Works against any torchneox that has `train --nproc`, so it times an older
checkout the same way.

    python benchmarks/resume_start.py [--nproc 8] [--hidden 2048] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _runs import synthetic_dataset


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _largest_peak_mib(pid: int) -> int:
    """The largest resident high-water mark (VmHWM) among the launcher's processes, in MiB."""
    peak = 0
    for child in _descendants(pid):
        try:
            for line in Path(f"/proc/{child}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) // 1024)
        except OSError:
            continue
    return peak


def timed_run(config: Path, nproc: int, overrides: list[str]) -> dict:
    """Seconds from launch to the run being ready to step (its 'training ...' line) and to its
    first step's row, and the peak memory lines where the version prints them."""
    command = [sys.executable, "-m", "torchneox", "train", str(config), "--nproc", str(nproc)]
    for o in overrides:
        command += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    row: dict = {}
    for line in proc.stdout:
        now = round(time.perf_counter() - start, 2)
        if line.startswith("training ") and "ready_s" not in row:
            row["ready_s"] = now  # built, loaded, about to step (older versions say it too)
            row["ready_largest_rank_peak_mib"] = _largest_peak_mib(proc.pid)
        if "after building" in line:
            row["memory_after_building"] = line.strip()
        if line.startswith("step ") and "| loss" in line and "first_step_s" not in row:
            row["first_step_s"] = now
        if "after the first step" in line:
            row["memory_after_first_step"] = line.strip()
    proc.wait()
    row["total_s"] = round(time.perf_counter() - start, 2)
    if proc.returncode:
        raise SystemExit(f"the run failed with {proc.returncode}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--work", default=None, help="folder for data and runs (a temporary one)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="resume_start-"))
    config = work / "config.yml"
    config.write_text(
        json.dumps(
            {
                "num_layers": args.layers,
                "hidden_size": args.hidden,
                "num_attention_heads": 16,
                "seq_length": 64,
                "train_micro_batch_size_per_gpu": 1,
                "train_iters": 1,
                "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                "precision": "fp32",
                "zero_optimization": {"stage": 3},
                "tokenizer_type": "CharLevelTokenizer",
                "data_path": synthetic_dataset(work),
                "eval_iters": 0,
                "num_workers": 0,
                "log_interval": 1,
                "save": str(work / "run"),
                "load": str(work / "run"),
            }
        )
    )
    fresh = timed_run(config, args.nproc, ["extra_save_iters=[0]", "train_iters=1"])
    resumed = timed_run(config, args.nproc, ["train_iters=2"])
    for kind, row in (("fresh", fresh), ("resumed", resumed)):
        shape = {"nproc": args.nproc, "hidden": args.hidden, "layers": args.layers}
        print(json.dumps({"benchmark": "resume_start", "run": kind, **shape, **row}))


if __name__ == "__main__":
    main()
