"""Time to build the GPT dataset indices (doc_idx, sample_idx, shuffle_idx) for a synthetic
dataset of N tokens, as GPT-NeoX's training start-up does.

    python benchmarks/index_build.py [--tokens 1e9] [--seq-length 2048] [--mean-doc 1000]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from torchneox.data.gpt_dataset import build_indices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--mean-doc", type=int, default=1000, help="mean document length in tokens")
    parser.add_argument("--epochs", type=float, default=1.0, help="samples asked, in epochs")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    docs = int(args.tokens / args.mean_doc)
    sizes = rng.integers(1, 2 * args.mean_doc, size=docs, dtype=np.int32)
    num_samples = int(sizes.sum(dtype=np.int64) * args.epochs / args.seq_length) - 1
    start = time.perf_counter()
    _doc_idx, _sample_idx, shuffle_idx = build_indices(
        sizes, np.arange(docs, dtype=np.int32), num_samples, args.seq_length, 1234
    )
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "benchmark": "index_build",
                "tokens": int(sizes.sum(dtype=np.int64)),
                "documents": docs,
                "seq_length": args.seq_length,
                "samples": int(len(shuffle_idx)),
                "seconds": round(seconds, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
