"""Muon against AdamW on nanoGPT's character-level Shakespeare recipe (configs/shakespeare_char.yml),
scaled to a few minutes on one CPU core: the same model, data order, steps, schedule, weight
decay and peak lr (1e-3); muon's hidden matrices take Muon (adjust_lr_fn match_rms_adamw, its
default, so that AdamW's lr carries over; the Newton-Schulz iteration in fp32), the rest
AdamW with the recipe's betas. Prints one
JSON line per optimizer with its validation curve; --plot draws both with `torchneox plot`.

    OMP_NUM_THREADS=1 python benchmarks/muon_shakespeare.py [--steps 600] [--plot docs/images/muon_vs_adamw.png]

Not part of run_all (a few minutes): run it when the optimizer changes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from shakespeare import ROOT, prepare

from torchneox.cli import main as cli
from torchneox.config.load import load_config
from torchneox.train.trainer import Trainer

OPTIMIZERS = {
    "adamw": "{type: AdamW, params: {lr: 1.0e-3, betas: [0.9, 0.99], eps: 1.0e-8}}",
    # Newton-Schulz in fp32: a CPU without bf16 units runs torch's bf16 products ~100x slower
    "muon": "{type: muon, params: {lr: 1.0e-3, betas: [0.9, 0.99], eps: 1.0e-8, ns_dtype: fp32}}",
}


def run(name: str, prefix: str, out: Path, steps: int, every: int) -> dict:
    settings = [
        f"data_path={prefix}",
        f"save={out / name}",
        "load=null",
        f"optimizer={OPTIMIZERS[name]}",
        f"train_iters={steps}",
        f"eval_interval={every}",
        "eval_iters=10",
        f"log_interval={every}",
        f"checkpoint_factor={steps}",
        "num_workers=0",
    ]
    trainer = Trainer(load_config([ROOT / "configs" / "shakespeare_char.yml"], settings))
    start = time.perf_counter()
    summary = trainer.run()
    seconds = time.perf_counter() - start
    rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    curve = {r["iteration"]: round(r["valid_lm_loss"], 4) for r in rows if "valid_lm_loss" in r}
    return {
        "benchmark": "muon_shakespeare",
        "optimizer": name,
        "steps": summary["iteration"],
        "valid_lm_loss": round(summary["valid"]["valid_lm_loss"], 4),
        "valid_curve": curve,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--text", default=str(ROOT.parent / "shared/data/corpora/tinyshakespeare.txt")
    )
    parser.add_argument("--out", default=str(ROOT / "runs" / "muon_shakespeare"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=50, help="steps between evaluations")
    parser.add_argument("--plot", help="a PNG of both runs' curves (torchneox plot)")
    parser.add_argument(
        "--only", choices=list(OPTIMIZERS), help="run one (the other's run already in --out)"
    )
    args = parser.parse_args()
    out = Path(args.out)
    prefix = prepare(Path(args.text), out)
    for name in [args.only] if args.only else OPTIMIZERS:
        print(json.dumps(run(name, prefix, out, args.steps, args.every)), flush=True)
    if args.plot:
        sys.exit(cli(["plot", str(out / "adamw"), str(out / "muon"), "--out", args.plot]))


if __name__ == "__main__":
    main()
