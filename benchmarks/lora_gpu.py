"""LoRA on one GPU: what a full finetune, LoRA with an fp32 base and LoRA with the base stored
in bf16 (``lora.base_dtype``) hold and how fast they train, beside what ``torchneox estimate``
predicts; and whether the two LoRA runs compute the same losses bit for bit (bf16 autocast casts
an fp32 base to the same bf16 values the bf16 base holds).

    python benchmarks/lora_gpu.py [--shape 1b] [--steps 8] [--micro-batch 4] [--seq 2048]
        [--big 6.9b]    # also the LoRA runs of a shape whose full finetune does not fit

Prints one JSON object per line. Random tokens, the base drawn (no checkpoint): memory and
speed do not depend on the weights. Numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import SHAPES, _accelerator_key, data, run_keys

from torchneox.config.load import load_mapping
from torchneox.estimate.search import estimate
from torchneox.train.trainer import Trainer

LORA = {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
MODES = {
    "full": None,
    "lora_fp32_base": LORA | {"base_dtype": "fp32"},
    "lora_bf16_base": LORA | {"base_dtype": "bf16"},
}


def keys(args, shape: str, prefix: str, lora: dict | None) -> dict:
    return run_keys(args, shape, prefix, lr=1e-3) | {
        "checkpoint_activations": args.checkpoint_activations,
        "lora": lora,
    }


def run(args, shape: str, mode: str, prefix: str) -> dict:
    loaded = load_mapping(keys(args, shape, prefix, MODES[mode]), f"lora-gpu-{shape}-{mode}")
    est = estimate(loaded, gpus=1, gpu=_accelerator_key())
    row = {"benchmark": "lora_gpu", "shape": shape, "mode": mode}
    row["estimated_memory_gib"] = round(est["memory_per_rank_bytes"]["total"] / 2**30, 2)
    row["estimate_fits"] = est["fits"]
    if not est["fits"]:
        return row | {"ran": False}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        trainer = Trainer(loaded, device=args.device)
        built = time.perf_counter() - start
        losses = []
        for k in range(args.warmup + args.steps):
            if k == args.warmup:
                torch.cuda.synchronize()
                start = time.perf_counter()
            losses.append(trainer.train_step()["lm_loss"])
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        return row | {"ran": False, "out_of_memory": str(e).splitlines()[0][:200]}
    seconds = (time.perf_counter() - start) / args.steps
    trainer.train_loader.close()
    held = {
        str(dtype): sum(p.numel() * p.element_size() for p in trainer.model.parameters()
                        if p.dtype == dtype) / 2**30
        for dtype in {p.dtype for p in trainer.model.parameters()}
    }  # fmt: skip
    peak = torch.cuda.max_memory_allocated()
    del trainer
    torch.cuda.empty_cache()
    return row | {
        "ran": True,
        "device": torch.cuda.get_device_name(),
        "build_s": round(built, 1),
        "step_s": round(seconds, 4),
        "tokens_per_sec": round(args.micro_batch * args.seq / seconds),
        "weights_gib_by_dtype": {k: round(v, 2) for k, v in held.items()},
        "max_memory_gib": round(peak / 2**30, 2),
        "measured_over_estimated": round(peak / est["memory_per_rank_bytes"]["total"], 3),
        "losses": losses,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--big", choices=SHAPES, help="also this shape (LoRA runs; full estimated)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--checkpoint-activations", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prefix = data(Path(tmp), (args.steps + args.warmup + 2) * args.micro_batch * (args.seq + 1))
        for shape in [args.shape] + ([args.big] if args.big else []):
            rows = {mode: run(args, shape, mode, prefix) for mode in MODES}
            for row in rows.values():
                print(json.dumps(row), flush=True)
            a, b = rows["lora_fp32_base"], rows["lora_bf16_base"]
            if a.get("ran") and b.get("ran"):
                same = a["losses"] == b["losses"]
                print(json.dumps({"shape": shape, "bf16_base_losses_bitwise_equal": same}))


if __name__ == "__main__":
    main()
