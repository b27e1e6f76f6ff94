"""Character-level tiny Shakespeare with configs/shakespeare_char.yml: the validation loss at
2000 steps (nanoGPT's CPU recipe reaches about 1.88) and the training tokens/s.

    python benchmarks/shakespeare.py [--text ../shared/data/corpora/tinyshakespeare.txt] [--out runs/shakespeare]

The text is split into documents at blank lines (a speech each), newlines inside kept, each
ending with end-of-text; the split is 90/10 by documents.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from torchneox.config.load import load_config
from torchneox.data.preprocess import PreprocessArgs, preprocess
from torchneox.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def prepare(text: Path, out: Path) -> str:
    """The text as speeches in a jsonl file, preprocessed character-level; the data prefix."""
    out.mkdir(parents=True, exist_ok=True)
    speeches = [s.strip("\n") for s in re.split(r"\n\n+", text.read_text()) if s.strip()]
    (out / "shakespeare.jsonl").write_text(
        "".join(json.dumps({"text": s}) + "\n" for s in speeches)
    )
    (prefix,) = preprocess(
        PreprocessArgs(
            [str(out / "shakespeare.jsonl")],
            str(out / "shakespeare"),
            "CharLevelTokenizer",
            append_eod=True,
        )
    )
    return prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--text", default=str(ROOT.parent / "shared/data/corpora/tinyshakespeare.txt")
    )
    parser.add_argument("--out", default=str(ROOT / "runs" / "shakespeare"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    out = Path(args.out)
    prefix = prepare(Path(args.text), out)
    settings = [f"data_path={prefix}", f"save={out / 'run'}", "load=null", *args.overrides]
    trainer = Trainer(load_config([ROOT / "configs" / "shakespeare_char.yml"], settings))
    start = time.perf_counter()
    summary = trainer.run()
    seconds = time.perf_counter() - start
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    speed = [r["tokens_per_sec"] for r in rows if "tokens_per_sec" in r]
    print(
        json.dumps(
            {
                "benchmark": "shakespeare_char",
                "steps": summary["iteration"],
                "valid_lm_loss": round(summary["valid"]["valid_lm_loss"], 4),
                "tokens_per_sec_median": round(sorted(speed)[len(speed) // 2]),
                "seconds": round(seconds, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
