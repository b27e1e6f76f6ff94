"""Training throughput of each parallel layout for one model and global batch, on the CPU cores
of this machine: every layout gets the same cores (threads per rank = cores / ranks), so the
rows compare how well each layout turns the same hardware into tokens/s.

    python benchmarks/layouts.py [--cores 8] [--steps 6] [--out results.jsonl] [--oversubscribe]

With --oversubscribe, layouts of more ranks than cores run too (one thread per rank, several
ranks per core, flagged): their rows compare those layouts with each other, not with the rest.

What it shows on CPU (gloo, shared memory) differs from a GPU cluster, where tensor parallelism
rides NVLink inside a node and data parallelism overlaps its all-reduce with backward; see
docs/parallelism.md for how to read the numbers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from _runs import add_common_arguments, emit, model_keys, synthetic_dataset, timed_run

# name: (data, tensor, pipeline, ZeRO stage)
LAYOUTS = {
    "one process": (1, 1, 1, 0),
    "dp2": (2, 1, 1, 0),
    "tp2": (1, 2, 1, 0),
    "pp2": (1, 1, 2, 0),
    "dp4": (4, 1, 1, 0),
    "dp4 zero3": (4, 1, 1, 3),
    "tp4": (1, 4, 1, 0),
    "pp4": (1, 1, 4, 0),
    "dp2 x tp2": (2, 2, 1, 1),
    "dp2 x pp2": (2, 1, 2, 1),
    "tp2 x pp2": (1, 2, 2, 0),
    "dp8": (8, 1, 1, 0),
    "dp4 x tp2": (4, 2, 1, 1),
    "dp2 x tp2 x pp2": (2, 2, 2, 1),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument(
        "--oversubscribe",
        action="store_true",
        help="also run the layouts with more ranks than cores (one thread each, flagged)",
    )
    add_common_arguments(parser)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="layouts-"))
    data = synthetic_dataset(work)
    base = model_keys(args.layers, args.hidden, 8, args.seq) | {"data_path": data}
    for i, (name, (dp, tp, pp, zero)) in enumerate(LAYOUTS.items()):
        world = dp * tp * pp
        if world > args.cores and not args.oversubscribe:
            continue
        threads = max(1, args.cores // world)
        keys = base | {
            "train_batch_size": args.global_batch,
            "gradient_accumulation_steps": args.micro_batches,
            "train_micro_batch_size_per_gpu": args.global_batch // (dp * args.micro_batches),
            "model_parallel_size": tp,
            "pipe_parallel_size": pp,
            "zero_optimization": {"stage": zero},
        }
        got = timed_run(work / f"layout{i}", keys, world, threads, args.steps)
        row = {
            "benchmark": "layout_throughput",
            "layout": name,
            "ranks": world,
            "threads_per_rank": threads,
            "oversubscribed": world * threads > args.cores,
            "zero_stage": zero,
            "layers": args.layers,
            "hidden": args.hidden,
            "seq": args.seq,
            "global_batch": args.global_batch,
            **got,
        }
        emit(row, args.out)


if __name__ == "__main__":
    main()
