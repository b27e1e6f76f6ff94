"""What a wrong CPU kernel cache costs a run (issue 45): the median step time of the same
fp32 training run on the CPU with

- ``fresh``: an empty cache (the run times its shapes);
- ``poisoned``: that cache with every verdict flipped to oneDNN, as an older torchneox wrote
  verdicts timed while other work loaded the machine (the run times each once more, keeps
  the faster kernel and corrects the file);
- ``onednn`` and ``default``: ``cpu_matmul`` fixed to either kernel (``onednn`` is what the
  poisoned cache cost every run before it was timed again).

Both cache files live in the work folder, never the user's. Prints one JSON row per case.

    python benchmarks/kernel_cache.py [--layers 8] [--hidden 256] [--seq 256] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _runs import add_common_arguments, emit, model_keys, synthetic_dataset, timed_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_common_arguments(parser, steps=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="kernel-cache-"))
    cache = work / "cpu_kernels.json"
    env = {
        "TORCHNEOX_CPU_KERNEL_CACHE": str(cache),
        "TORCHNEOX_CPU_PEAK_CACHE": str(work / "cpu_peak.json"),
    }
    keys = model_keys(args.layers, args.hidden, max(1, args.hidden // 64), args.seq)
    keys |= {"data_path": synthetic_dataset(work), "train_batch_size": args.batch}
    keys |= {"train_micro_batch_size_per_gpu": args.batch}
    base = {"benchmark": "kernel_cache", "layers": args.layers, "hidden": args.hidden}
    base |= {"seq": args.seq, "batch": args.batch, "threads": args.threads}

    def run(case: str, **extra) -> dict:
        row = timed_run(work / case, keys | extra, 1, args.threads, args.steps, env=env)
        return base | {"case": case} | row

    emit(run("fresh"), args.out)
    fresh = json.loads(cache.read_text())
    cache.write_text(json.dumps(dict.fromkeys(fresh, True)))
    row = run("poisoned")
    after = json.loads(cache.read_text())
    row["verdicts"] = len(after)
    row["corrected_to_default"] = sum(
        isinstance(v, dict) and not v["challenger"] and v["checked"] for v in after.values()
    )
    emit(row, args.out)
    emit(run("onednn", cpu_matmul="onednn"), args.out)
    emit(run("default", cpu_matmul="default"), args.out)


if __name__ == "__main__":
    main()
