"""Cluster runs rehearsed on this machine (`train --dry-run`): GPT-NeoX-20B on its 96 GPUs
(pipeline 4 x tensor 2, ZeRO-1), Pythia-12B on 256 (tensor 4, ZeRO-1) and a Llama-2-70B shape
on 512 (tensor 8 x pipeline 4, ZeRO-1); the wall time of each, the ranks built, and whether every
rank's bytes equal `estimate`'s and every process group agrees on its collectives.

    python benchmarks/dry_run.py [--only 20b 12b 70b] [--ranks all|0,5] [--out results.jsonl]

The configs are configs/neox-20b.yml, configs/pythia-12b.yml and configs/llama2-70b.yml (the
shapes and layouts of GPT-NeoX's own configs; each gives padded_vocab_size, so no tokenizer file
is needed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parent / "configs"
RUNS = {  # name: (config, world size, nodes)
    "20b": ("neox-20b.yml", 96, 12),
    "12b": ("pythia-12b.yml", 256, 32),
    "70b": ("llama2-70b.yml", 512, 64),
}


def rehearse(name: str, ranks: str | None) -> dict:
    config, world, nodes = RUNS[name]
    argv = [
        sys.executable, "-m", "torchneox", "train", str(CONFIGS / config),
        "--dry-run", "--world-size", str(world),
        "--nodes", str(nodes), "--json",
    ]  # fmt: skip
    if ranks:
        argv += ["--ranks", ranks]
    start = time.perf_counter()
    run = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if run.returncode not in (0, 1):
        raise SystemExit(f"{name}: {run.stderr.strip()[-2000:]}")
    report = json.loads(run.stdout)
    heaviest = max(
        report["ranks"], key=lambda r: r["bytes"]["parameters"] + r["bytes"]["optimizer"]
    )
    return {
        "benchmark": "dry_run",
        "config": config,
        "world_size": world,
        "nodes": nodes,
        "ranks_built": len(report["ranks"]),
        "wall_s": round(wall, 1),
        "slowest_rank_s": round(max(r["seconds"] for r in report["ranks"]), 1),
        "groups_compared": report["groups_checked"],
        "problems": report["problems"],
        "every_rank_stepped": all(r["stepped"] for r in report["ranks"]),
        "heaviest_rank": heaviest["rank"],
        "heaviest_rank_gib": {k: round(v / 2**30, 3) for k, v in heaviest["bytes"].items()},
        "bytes_equal_estimate": not any("estimate computes" in p for p in report["problems"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--ranks", default=None, help="passed to --ranks (default: the sample)")
    parser.add_argument("--out", default=None, help="also append the JSON rows to this file")
    args = parser.parse_args()
    for name in args.only:
        row = rehearse(name, args.ranks)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
