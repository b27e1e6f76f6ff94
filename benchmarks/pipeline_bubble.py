"""Pipeline bubble against theory. For p stages and m micro-batches, a 1F1B or GPipe step
leaves each stage idle for a fraction (p-1)/(m+p-1) of it. Measured: the step time T_p of
`torchneox train` with pipe_parallel_size p (one thread per stage) against T_1, the same model,
batch and micro-batches in one process on one thread; perfect pipelining would take T_1 / p,
so the measured idle fraction is 1 - T_1 / (p T_p). The difference from theory is what the
stage imbalance (embedding on the first stage, head on the last) and the point-to-point
sends cost on top of the bubble.

    python benchmarks/pipeline_bubble.py [--stages 2 4] [--micro-batches 1 2 4 8] [--schedule 1f1b]

Needs p free cores for p stages: on fewer, idle stages lend their core to busy ones and the
bubble looks smaller than it is. `--block-ms F` measures the schedule alone on any machine:
each transformer block then takes a fixed F ms forward and 2F ms backward of wall time
(sleeping, see _timed_blocks.py) in a model too small to compute anything measurable, so p may
exceed the cores:

    python benchmarks/pipeline_bubble.py --block-ms 10 --stages 2 4 8
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from _runs import add_common_arguments, emit, model_keys, synthetic_dataset, timed_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument(
        "--virtual-stages", type=int, default=2, help="per rank, for the interleaved schedules"
    )
    parser.add_argument(
        "--block-ms",
        type=float,
        default=None,
        help="fixed work per block (F ms forward, 2F backward) instead of computing",
    )
    add_common_arguments(parser)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    work = Path(args.work or tempfile.mkdtemp(prefix="bubble-"))
    data = synthetic_dataset(work)
    timed = {}
    if args.block_ms is not None:  # the schedule alone: a tiny model whose blocks take F ms
        args.hidden, args.seq, args.micro_batch = 32, 16, 1
        timed = {
            "entry": str(Path(__file__).with_name("_timed_blocks.py")),
            "env": {"TORCHNEOX_BENCH_BLOCK_MS": str(args.block_ms)},
        }
    interleaved = args.schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
    for m in args.micro_batches:
        keys = model_keys(args.layers, args.hidden, 4, args.seq) | {
            "data_path": data,
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": m,
            "train_batch_size": args.micro_batch * m,
        }
        if args.schedule != "1f1b":  # the default; it becomes gpipe below one micro-batch per stage
            keys["pipeline_schedule"] = args.schedule
        if interleaved:
            keys["pipeline_virtual_stages"] = args.virtual_stages
        one = timed_run(work / f"p1-m{m}", keys, 1, 1, args.steps, **timed)
        for p in args.stages:
            if args.schedule not in ("gpipe", "1f1b") and m % p:
                continue
            v = args.virtual_stages if interleaved else 1
            got = timed_run(
                work / f"p{p}-m{m}", keys | {"pipe_parallel_size": p}, p, 1, args.steps, **timed
            )
            row = {
                "benchmark": "pipeline_bubble",
                "schedule": args.schedule if m >= p else "gpipe",
                "block_ms": args.block_ms,
                "stages": p,
                "virtual_stages": v,
                "micro_batches": m,
                "layers": args.layers,
                "hidden": args.hidden,
                "cores": cores,
                "one_process_step_s": one["step_time_s"],
                "pipeline_step_s": got["step_time_s"],
                "measured_idle_fraction": round(
                    1 - one["step_time_s"] / (p * got["step_time_s"]), 3
                ),
                "theory_idle_fraction": round((p - 1) / (v * m + p - 1), 3),
                "oversubscribed": p > cores and args.block_ms is None,
            }
            emit(row, args.out)


if __name__ == "__main__":
    main()
