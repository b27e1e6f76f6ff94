"""Refresh tests/durations.json (seconds per test file, the order in which `make test` hands out
files: slowest first) from a pytest run's `--durations=0` output.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -n 2 --dist loadfile --durations=0 > run.txt
    .venv/bin/python tools/test_durations.py run.txt
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (?:call|setup|teardown)\s+(tests/\S+?\.py)::")


def per_file(text: str) -> dict[str, float]:
    """Seconds per test file: its tests' call, setup and teardown times added."""
    total: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if m := LINE.match(line):
            total[m.group(2)] += float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="a pytest run's output with --durations=0")
    parser.add_argument(
        "--into", type=Path, default=Path(__file__).parents[1] / "tests/durations.json"
    )
    args = parser.parse_args()
    seconds = per_file(args.output.read_text())
    if not seconds:
        parser.error(f"{args.output}: no --durations=0 lines in it")
    args.into.write_text(json.dumps(seconds, indent=0) + "\n")
    print(f"{args.into}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
