"""Effective training time at 1k and 10k GPUs, worked out from a published failure rate:
restarting the whole job from its last checkpoint against replica groups that survive each
other (torchft, docs/reliability.md "At scale"). A simulation, not a measurement: failures
arrive as a Poisson process at Llama 3's rate (419 unexpected interruptions in 54 days of
training on 16,384 GPUs), scaled to the run's GPU count.

- Restart from a checkpoint: every failure stops the whole job; it loses the work since its
  last save (the failure lands uniformly between saves) and the time to restart.
- Replica groups: a failure takes down one group; the others lose only the step in flight
  (detection and the step trained again: `--detect` seconds, measured in
  tests/reliability/test_replica_groups.py) and train on without its share until it is back
  (`--group-restart`, then it heals from a live peer); while it is out the run trains
  (groups - down) / groups of its throughput.

Effective training time = the training the run did, in full-job hours, over the wall-clock
hours. Prints one JSON row per (GPUs, way) and a Markdown table with --table.

    python benchmarks/replica_groups.py [--gpus 1024 10240] [--days 54] [--groups 8] \
        [--checkpoint-minutes 30] [--restart-minutes 10] [--group-restart-minutes 10] \
        [--detect 7] [--table]
"""

from __future__ import annotations

import argparse
import json
import random

LLAMA3 = {"interruptions": 419, "days": 54, "gpus": 16384}


def failures_per_hour(gpus: int) -> float:
    """Llama 3's interruption rate per GPU-hour, times this run's GPUs."""
    per_gpu_hour = LLAMA3["interruptions"] / (LLAMA3["days"] * 24 * LLAMA3["gpus"])
    return per_gpu_hour * gpus


def arrivals(rate: float, hours: float, rng: random.Random) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < hours:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def restart_from_checkpoint(times: list[float], hours: float, a: argparse.Namespace) -> float:
    """Full-job hours of training kept: each failure throws away the work since the last save
    and stops the job for the restart (a failure during a restart starts it again)."""
    every, restart = a.checkpoint_minutes / 60, a.restart_minutes / 60
    kept, busy_until, start = 0.0, 0.0, 0.0  # start: when the current stretch of training began
    for t in times:
        if t < busy_until:  # the job was restarting: the restart begins again
            busy_until = t + restart
            start = busy_until
            continue
        ran = t - start
        kept += ran - ran % every  # what the last save holds
        busy_until = t + restart
        start = busy_until
    if start < hours:
        kept += hours - start
    return kept / hours


def replica_groups(times: list[float], hours: float, a: argparse.Namespace) -> float:
    """Full-job hours of training done: each failure costs every live group the step in flight
    and takes its group out until it restarts and heals."""
    detect, back = a.detect / 3600, a.group_restart_minutes / 60
    lost = 0.0
    down: list[float] = []  # when each group that is out comes back
    for t in times:
        down = [d for d in down if d > t]
        if len(down) >= a.groups:  # every group is out: this failure changes nothing
            continue
        lost += detect * (a.groups - len(down)) / a.groups
        until = t + back
        # the missing share, from now until it is back (or the run ends)
        lost += (min(until, hours) - t) / a.groups
        down.append(until)
    return (hours - lost) / hours


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 10240])
    p.add_argument("--days", type=float, default=54)
    p.add_argument("--groups", type=int, default=8, help="replica groups the GPUs are split in")
    p.add_argument("--checkpoint-minutes", type=float, default=30, help="time between saves")
    p.add_argument("--restart-minutes", type=float, default=10, help="whole-job restart")
    p.add_argument("--group-restart-minutes", type=float, default=10, help="one group, healed")
    p.add_argument("--detect", type=float, default=7.0, help="seconds a failure costs the live")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--table", action="store_true", help="a Markdown table after the rows")
    a = p.parse_args()
    hours = a.days * 24
    rows = []
    for gpus in a.gpus:
        rng = random.Random(a.seed)
        runs = [arrivals(failures_per_hour(gpus), hours, rng) for _ in range(a.trials)]
        for way, fn in (("restart", restart_from_checkpoint), ("replica_groups", replica_groups)):
            effective = sum(fn(t, hours, a) for t in runs) / len(runs)
            failures = sum(map(len, runs)) / len(runs)
            row = {"gpus": gpus, "way": way, "effective": round(effective, 4)}
            row |= {"failures": round(failures, 1), "days": a.days, "groups": a.groups}
            rows.append(row)
            print(json.dumps(row))
    if a.table:
        print("\n| GPUs | failures in the run | restart from a checkpoint | replica groups |")
        print("|---|---|---|---|")
        for r, g in zip(rows[::2], rows[1::2], strict=True):
            print(
                f"| {r['gpus']:,} | {r['failures']:.0f} | {100 * r['effective']:.1f}% "
                f"| {100 * g['effective']:.1f}% |"
            )


if __name__ == "__main__":
    main()
