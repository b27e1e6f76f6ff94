"""The streaming loader (data/stream/): tokens/s it delivers with 1 and N workers, and its
resident memory over a large corpus measured from outside the process.

    python benchmarks/stream.py --vocab-file 20B_tokenizer.json [--mb 20] [--workers 1 2]
    python benchmarks/stream.py --vocab-file 20B_tokenizer.json --memory-gb 1

Throughput: a synthetic jsonl (benchmarks/preprocess.py's) streamed in samples of seq_length
2048 + 1 (micro-batch 8), the train loader as a run builds it (shuffled, a batch ahead, the
given workers), timed after its first batch (the workers' start). Memory: a child process
streams a corpus of --memory-gb once through; this one reads the resident memory of it and of
its workers (/proc/PID/status VmRSS) every half second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from preprocess import synthetic

from torchneox.config.load import load_config
from torchneox.data.stream.build import build_loaders

SEQ, MICRO = 2048, 8


def run_config(folder: Path, corpus: Path, vocab: str, workers: int) -> object:
    keys = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": SEQ,
        "train_micro_batch_size_per_gpu": MICRO,
        "train_iters": 10**6,
        "tokenizer_type": "HFTokenizer",
        "vocab_file": vocab,
        "train_data_paths": [str(corpus)],
        "num_workers": workers,
    }
    path = folder / f"stream{workers}.json"
    path.write_text(json.dumps(keys))
    return load_config([str(path)]).config


def loader(cfg: object):
    counts = {"train": 10**9, "valid": 0, "test": 0}
    return build_loaders(cfg, counts, MICRO, 1)["train"]


def throughput(folder: Path, corpus: Path, vocab: str, workers: int, seconds: float) -> dict:
    train = loader(run_config(folder, corpus, vocab, workers))
    try:
        train.next()  # the workers started, the first window tokenized
        start, batches = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            train.next()
            batches += 1
        elapsed = time.perf_counter() - start
    finally:
        train.close()
    tokens = batches * MICRO * SEQ
    return {"workers": workers, "tokens": tokens, "tokens_per_sec": round(tokens / elapsed)}


def stream_once(config_path: str, tokens: int) -> None:
    """The child of --memory-gb: stream the corpus once through (until its second epoch
    begins; at most ``tokens`` tokens), printing progress."""
    train = loader(load_config([config_path]).config)
    done, start = 0, time.perf_counter()
    while done < tokens:
        train.next()
        if train.state_dict()["stream"]["ranks"][0]["sources"][0]["window"]["epoch"] > 0:
            print(f"the corpus read once: {done:,} tokens", flush=True)
            break
        done += MICRO * SEQ
        if done % (MICRO * SEQ * 500) == 0:
            print(f"{done:,} tokens, {done / (time.perf_counter() - start):,.0f}/s", flush=True)
    train.close()


def rss_kib(pid: int) -> int:
    """The resident memory of ``pid`` and of its children (the workers, whichever of its
    threads started them)."""
    total, pids = 0, [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            pids += [int(c) for c in (task / "children").read_text().split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def memory(folder: Path, vocab: str, gb: float, workers: int, corpus: Path | None) -> dict:
    corpus = corpus or folder / "large.jsonl"
    if not corpus.is_file() or corpus.stat().st_size < gb * 1e9:
        synthetic(corpus, gb * 1000)
    size = corpus.stat().st_size
    cfg = folder / "large.json"
    run_config(folder, corpus, vocab, workers)
    (folder / f"stream{workers}.json").rename(cfg)
    tokens = size  # a bound: fewer tokens than bytes
    code = (
        f"import sys; sys.argv = ['x']; import stream; stream.stream_once({str(cfg)!r}, {tokens})"
    )
    here = str(Path(__file__).resolve().parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", code], env=env)
    samples, start = [], time.perf_counter()
    while child.poll() is None:
        samples.append((time.perf_counter() - start, rss_kib(child.pid)))
        time.sleep(0.5)
    assert child.returncode == 0
    steady = [r for t, r in samples if t > 30]
    return {
        "corpus_bytes": size,
        "seconds": round(time.perf_counter() - start),
        "rss_mib_at_30s": round(steady[0] / 1024) if steady else None,
        "rss_mib_max_after_30s": round(max(steady) / 1024) if steady else None,
        "rss_mib_last": round(samples[-2][1] / 1024),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab-file", required=True, help="a tokenizer.json (HFTokenizer)")
    parser.add_argument("--mb", type=float, default=20.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--memory-gb", type=float)
    parser.add_argument("--corpus", type=Path, help="--memory-gb: the corpus file (kept)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.memory_gb:
            print(
                json.dumps(
                    memory(folder, args.vocab_file, args.memory_gb, args.workers[-1], args.corpus)
                )
            )
            return
        corpus = folder / "synthetic.jsonl"
        synthetic(corpus, args.mb)
        for workers in args.workers:
            out = throughput(folder, corpus, args.vocab_file, workers, args.seconds)
            print(json.dumps({"benchmark": "stream", **out}), flush=True)


if __name__ == "__main__":
    main()
