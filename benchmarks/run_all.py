"""Every benchmark behind one command (`make bench`, `torchneox bench`): each runs with settings
that fit a few minutes, its JSON rows are stamped with the date and the machine and appended to
benchmarks/results.jsonl, and a summary is printed. On a CUDA machine the GPU check runs too.

    python benchmarks/run_all.py [--only NAME ...] [--list] [--results benchmarks/results.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# name: (script, arguments, needs a GPU)
BENCHMARKS = {
    "train_vs_hf": ("train_vs_hf.py", ["--shape", "14m", "--steps", "20"], False),
    "cpu_speed": (  # nanoGPT's recipe side by side, and the Pythia shapes against transformers
        "cpu_speed.py",
        ["--steps", "20", "--rounds", "3", "--shapes", "14m", "70m", "--pythia-scale", "0.5"],
        False,
    ),
    "generation": ("generation.py", ["--shape", "70m", "--tokens", "32"], False),
    "preprocess": ("preprocess.py", ["--mb", "5"], False),
    "index_build": ("index_build.py", ["--tokens", "1e8"], False),
    "pipeline_overhead": ("pipeline_overhead.py", ["--steps", "10"], False),
    "pipeline_bubble": (
        "pipeline_bubble.py",
        ["--stages", "2", "--micro-batches", "2", "8"],
        False,
    ),
    "pipeline_schedule": (  # any number of stages: blocks of fixed work (they sleep)
        "pipeline_bubble.py",
        ["--block-ms", "10", "--stages", "2", "4", "--micro-batches", "1", "4", "8"],
        False,
    ),
    "layouts": ("layouts.py", ["--steps", "4", "--seq", "128"], False),
    "activation_memory": ("activation_memory.py", [], False),
    "moe": ("moe.py", ["--train-steps", "20"], False),
    "async_checkpoint": ("async_checkpoint.py", ["--layers", "4", "--steps", "12"], False),
    "dry_run": ("dry_run.py", [], False),
    "replica_groups": ("replica_groups.py", [], False),  # a simulation from Llama 3's failures
    "convert_memory": ("convert_memory.py", ["--layers", "8", "--hidden", "768"], False),
    "kernel_cache": (  # a poisoned CPU kernel cache against a fresh one and both fixed kernels
        "kernel_cache.py",
        ["--layers", "2", "--hidden", "128", "--seq", "64", "--steps", "12", "--threads", "1"],
        False,
    ),
    "serve": (  # TTFT, inter-token latency, tokens/s and bandwidth use at 1, 4, 16 clients
        "serve.py",
        ["--shape", "70m", "--clients", "1", "4", "16", "--tokens", "32", "--requests", "1"],
        False,
    ),
    "gpu_check": ("gpu_check.py", ["--steps", "10"], True),
    "serve_gpu": (
        "serve.py",
        ["--shape", "1b", "--device", "cuda", "--dtype", "bf16", "--clients", "1", "4", "16"],
        True,
    ),
    "lora_gpu": ("lora_gpu.py", ["--big", "6.9b"], True),
}


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    return f"CPU ({os.cpu_count()} cores, {platform.machine()})"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every torchneox verb's mistakes
        self.exit(2, f"torchneox: error: bench: {message} (see --help)\n")


def main() -> int:
    parser = _Parser(prog="torchneox bench", description=__doc__)
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="NAME")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--results", default=str(HERE / "results.jsonl"))
    args = parser.parse_args()
    if args.list:
        for name, (script, extra, gpu) in BENCHMARKS.items():
            print(f"{name:<20} benchmarks/{script} {' '.join(extra)}{'  (GPU)' if gpu else ''}")
        return 0
    import torch

    has_gpu = torch.cuda.is_available()
    stamp = {"date": datetime.date.today().isoformat(), "machine": machine()}
    failed = []
    for name in args.only or list(BENCHMARKS):
        script, extra, gpu = BENCHMARKS[name]
        if gpu and not has_gpu:
            print(f"-- {name}: skipped (no GPU)", flush=True)
            continue
        print(f"-- {name}: benchmarks/{script} {' '.join(extra)}", flush=True)
        run = subprocess.run(
            [sys.executable, str(HERE / script), *extra],
            capture_output=True,
            text=True,
            check=False,
        )
        rows = []
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                rows.append(stamp | json.loads(line))
                print("   " + line, flush=True)
        if run.returncode != 0 or not rows:
            failed.append(name)
            print(f"   failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:]}")
            continue
        with open(args.results, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(
        f"results appended to {args.results}" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
