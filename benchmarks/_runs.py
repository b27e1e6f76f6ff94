"""Shared by the multi-process benchmarks: a synthetic token dataset, a config for it, and
`torchneox train --nproc N` runs timed from their metrics.jsonl (median step time after the
warm-up steps)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from torchneox.data.indexed import IndexedDatasetWriter

VOCAB = 256  # character-level: token ids are bytes


def synthetic_dataset(folder: Path, tokens: int = 2_000_000) -> str:
    """Random byte tokens in 1000-token documents (timing only cares about shapes)."""
    prefix = folder / "synthetic"
    if not prefix.with_suffix(".idx").exists():
        writer = IndexedDatasetWriter(prefix, np.dtype(np.uint16))
        rng = np.random.default_rng(0)
        for doc in rng.integers(2, VOCAB, size=(tokens // 1000, 1000)):
            writer.add_document(doc)
        writer.finish()
    return str(prefix)


def add_common_arguments(parser, steps: int = 6) -> None:
    """Model size, steps and output options shared by the multi-process benchmarks."""
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--out", default=None, help="also append the JSON rows to this file")
    parser.add_argument("--work", default=None, help="folder for data and runs (a temporary one)")


def emit(row: dict, out: str | None) -> None:
    """Print one result row as JSON, and append it to ``out`` when given."""
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def model_keys(layers: int, hidden: int, heads: int, seq: int) -> dict:
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "seq_length": seq,
        "max_position_embeddings": seq,
        "pos_emb": "rotary",
        "no_weight_tying": True,
        "tokenizer_type": "CharLevelTokenizer",
        "make_vocab_size_divisible_by": 128,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "precision": "fp32",
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "split": "100,0,0",
        "eval_iters": 0,
        "eval_interval": 100000,
        "log_interval": 1,
        "num_workers": 0,
        "load": None,
    }


def timed_run(
    folder: Path,
    keys: dict,
    nproc: int,
    threads: int,
    steps: int,
    warmup: int = 2,
    entry: str | None = None,
    env: dict | None = None,
) -> dict:
    """Train ``steps`` steps with ``nproc`` processes of ``threads`` threads each; returns the
    median step time and tokens/s over the steps after ``warmup``. ``entry``: a script that
    runs the torchneox command line, started by torchrun instead of ``torchneox --nproc``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "config.yml"
    config.write_text(json.dumps(keys | {"train_iters": steps, "save": str(folder / "run")}))
    if entry:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(nproc), entry, "train", str(config)]
    else:
        cmd = [sys.executable, "-m", "torchneox", "train", str(config)]
        if nproc > 1:
            cmd += ["--nproc", str(nproc)]
    env = dict(
        os.environ,
        **(env or {}),
        OMP_NUM_THREADS=str(threads),
        TORCHNEOX_INDEX_CACHE=str(folder / "ix"),
    )
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
    rows = [json.loads(x) for x in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["iteration"] > warmup]
    tokens = keys["train_batch_size"] * keys["seq_length"]
    step = statistics.median(times)
    return {"step_time_s": round(step, 4), "tokens_per_sec": round(tokens / step, 1)}
