"""Training with checkpoints written in the step (the default) against in the background
(`async_checkpointing: true`, with the writer process and with the writer thread): the run's
wall time, and the step time of steps that run while a background save is in flight against
steps that do not (with the spread of the latter: the noise).

    python benchmarks/async_checkpoint.py [--layers 8] [--hidden 512] [--steps 24] [--every 4]

Each run trains the same model from scratch on a synthetic token dataset in its own process,
one row of metrics per step (`step_time_s` is the step alone; a synchronous save is outside it
but inside the wall time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from torchneox.data.indexed import IndexedDatasetWriter


def dataset(prefix: Path) -> str:
    writer = IndexedDatasetWriter(prefix, np.dtype(np.uint16))
    rng = np.random.default_rng(0)
    for _ in range(400):
        writer.add_document(rng.integers(1, 255, 1000))
    writer.finish()
    return str(prefix)


def run(root: Path, name: str, keys: dict) -> dict:
    cfg = root / f"{name}.yml"
    cfg.write_text(json.dumps(keys | {"save": str(root / name), "log_dir": str(root / name)}))
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "torchneox", "train", str(cfg)], check=True, capture_output=True
    )
    wall = time.perf_counter() - start
    rows = [json.loads(x) for x in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps = {r["iteration"]: r["step_time_s"] for r in rows if "step_time_s" in r}
    return {"wall_s": wall, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4, help="checkpoint_factor")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        keys = {
            "num_layers": args.layers,
            "hidden_size": args.hidden,
            "num_attention_heads": 8,
            "seq_length": 128,
            "pos_emb": "rotary",
            "no_weight_tying": True,
            "train_micro_batch_size_per_gpu": 4,
            "train_iters": args.steps,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
            "tokenizer_type": "CharLevelTokenizer",
            "make_vocab_size_divisible_by": 64,
            "data_path": dataset(root / "tokens"),
            "split": "100,0,0",
            "checkpoint_factor": args.every,
            "log_interval": 1,
            "eval_interval": 10**6,
            "eval_iters": 0,
        }
        sync = run(root, "sync", keys)
        writers = {
            kind: run(
                root, kind, keys | {"async_checkpointing": True, "async_checkpoint_writer": kind}
            )
            for kind in ("process", "thread")
        }
    # the step right after each save runs while its files are written
    after_save = [s + 1 for s in range(args.every, args.steps, args.every)]
    row = {
        "benchmark": "async_checkpoint",
        "layers": args.layers,
        "hidden": args.hidden,
        "saves": args.steps // args.every,
        "sync_wall_s": round(sync["wall_s"], 2),
        "sync_step_ms": _ms(statistics.median(t for s, t in sync["steps"].items() if s > 1)),
        # the same steps of the run that saves in the step: after a save, none in flight
        "sync_step_ms_after_save": _ms(
            statistics.median(sync["steps"][s] for s in after_save if s in sync["steps"])
        ),
    }
    for kind, result in writers.items():
        steps = result["steps"]
        in_flight = [steps[s] for s in after_save if s in steps]
        quiet = [t for s, t in steps.items() if s not in after_save and s > 1]
        row |= {
            f"{kind}_wall_s": round(result["wall_s"], 2),
            f"{kind}_step_ms_save_in_flight": _ms(statistics.median(in_flight)),
            f"{kind}_step_ms_no_save": _ms(statistics.median(quiet)),
            f"{kind}_step_ms_no_save_stdev": _ms(statistics.stdev(quiet)),
        }
    print(json.dumps(row))


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 1)


if __name__ == "__main__":
    main()
