"""Preprocessing throughput (tokens/s) with 1 worker and with N, on a synthetic jsonl corpus
or your own files.

    python benchmarks/preprocess.py --tokenizer-type HFTokenizer --vocab-file 20B_tokenizer.json \
        [--input FILE.jsonl ...] [--workers 1 2]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from torchneox.data.indexed import IndexedDataset
from torchneox.data.preprocess import PreprocessArgs, preprocess


def synthetic(path: Path, mb: float) -> None:
    rng = random.Random(0)
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "that",
        "with",
        "as",
        "on",
        "by",
        "at",
        "from",
        "his",
        "he",
        "it",
        "an",
        "be",
        "this",
        "are",
    ]
    with open(path, "w") as f:
        written = 0
        while written < mb * 1e6:
            line = json.dumps(
                {"text": " ".join(rng.choice(words) for _ in range(rng.randint(50, 500)))}
            )
            f.write(line + "\n")
            written += len(line) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", nargs="*")
    parser.add_argument("--mb", type=float, default=20.0, help="size of the synthetic corpus")
    parser.add_argument("--tokenizer-type", default="CharLevelTokenizer")
    parser.add_argument("--vocab-file")
    parser.add_argument("--merge-file")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        inputs = args.input
        if not inputs:
            inputs = [str(Path(tmp) / "synthetic.jsonl")]
            synthetic(Path(inputs[0]), args.mb)
        for workers in args.workers:
            start = time.perf_counter()
            (prefix,) = preprocess(
                PreprocessArgs(
                    inputs,
                    str(Path(tmp) / f"out{workers}"),
                    args.tokenizer_type,
                    args.vocab_file,
                    args.merge_file,
                    append_eod=True,
                    workers=workers,
                    log_interval=10**9,
                )
            )
            seconds = time.perf_counter() - start
            tokens = IndexedDataset(prefix).num_tokens
            print(
                json.dumps(
                    {
                        "benchmark": "preprocess",
                        "tokenizer": args.tokenizer_type,
                        "workers": workers,
                        "tokens": tokens,
                        "seconds": round(seconds, 2),
                        "tokens_per_sec": round(tokens / seconds),
                    }
                )
            )


if __name__ == "__main__":
    main()
