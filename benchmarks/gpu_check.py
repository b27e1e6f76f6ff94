"""One short run on a single GPU: bf16 training of a Pythia-shaped model (with and without
torch.compile) reporting tokens/s, MFU and the memory high-water mark next to what
`torchneox estimate` predicted for the same config, then generation speed.

    python benchmarks/gpu_check.py [--shape 1b] [--steps 15] [--micro-batch 8] [--seq 2048]
        [--fp8 tensorwise]     # also the compiled run in fp8 (torchao), beside bf16

Prints one JSON object per line. Needs a CUDA device; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from torchneox.config.load import load_mapping
from torchneox.data.indexed import IndexedDatasetWriter
from torchneox.estimate.search import estimate
from torchneox.inference.generate import Sampling, generate
from torchneox.reporting.hardware import ACCELERATORS, detect
from torchneox.train.trainer import Trainer

SHAPES = {
    "160m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
    "410m": {"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16},
    "1b": {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 8},
    "6.9b": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32},
}


def _accelerator_key() -> str:
    found = detect(torch.device("cuda"))
    return next((k for k, v in ACCELERATORS.items() if v == found), "h100")


def data(folder: Path, tokens: int) -> str:
    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(folder / "random", np.uint16)
    for _ in range(tokens // 4096 + 1):
        writer.add_document(rng.integers(0, 50000, size=4096))
    writer.finish()
    return str(folder / "random")


def run_keys(args, shape: str, prefix: str, lr: float = 2.5e-4) -> dict:
    """The Pythia-shaped bf16 training run on random tokens every GPU benchmark times."""
    return SHAPES[shape] | {
        "seq_length": args.seq,
        "max_position_embeddings": args.seq,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "padded_vocab_size": 50304,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "train_iters": args.steps + args.warmup,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.95]}},
        "precision": "bfloat16",
        "data_path": prefix,
        "split": "100,0,0",
        "eval_iters": 0,
        "num_workers": 1,
    }


def train(args, shape: str, compiled: bool, prefix: str, fp8: str | None = None) -> dict:
    keys = run_keys(args, shape, prefix) | {
        "compile": compiled,
        "compile_scope": args.compile_scope,
        "checkpoint_activations": args.checkpoint_activations,
        "fp8_recipe": fp8,
    }
    torch.cuda.reset_peak_memory_stats()
    loaded = load_mapping(keys, f"gpu-check-{shape}")
    est = estimate(loaded, gpus=1, gpu=_accelerator_key())
    trainer = Trainer(loaded, device="cuda")
    start = time.perf_counter()
    for _ in range(args.warmup):
        trainer.train_step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        out = trainer.train_step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / args.steps
    trainer.train_loader.close()
    tokens = args.micro_batch * args.seq / seconds
    tflops = trainer.derived["flops_per_token"] * tokens / 1e12
    peak = torch.cuda.max_memory_allocated()
    mem = est["memory_per_rank_bytes"]
    measured_acts = peak - (mem["total"] - mem["activations"])
    row = {
        "benchmark": "gpu_train",
        "device": torch.cuda.get_device_name(),
        "shape": shape,
        "parameters": trainer.derived["num_parameters"],
        "compile": trainer.derived["compile"],
        "fp8_recipe": fp8,
        "checkpoint_activations": args.checkpoint_activations,
        "micro_batch": args.micro_batch,
        "seq": args.seq,
        "step_s": round(seconds, 4),
        "tokens_per_sec": round(tokens),
        "tflops": round(tflops, 1),
        "mfu": round(tflops / trainer.peak_tflops, 4) if trainer.peak_tflops else None,
        "peak_source": trainer.peak_source,
        "max_memory_gib": round(peak / 2**30, 2),
        "estimated_memory_gib": round(mem["total"] / 2**30, 2),
        "measured_over_estimated": round(peak / mem["total"], 3),
        # activations measured = the peak less what the estimator counts exactly (parameters,
        # gradients, optimizer state, temporaries), against the activations it traced
        "activations_measured_gib": round(measured_acts / 2**30, 2),
        "activations_estimated_gib": round(mem["activations"] / 2**30, 2),
        "activation_error": round(measured_acts / mem["activations"] - 1, 3),
        "estimated_step_s_at_this_mfu": round(
            est["step_time_s"] * est["mfu"] / (tflops / trainer.peak_tflops), 4
        )
        if trainer.peak_tflops
        else None,
        "warmup_s": round(warm, 1),
        "last_loss": round(out["lm_loss"], 4),
    }
    del trainer
    torch.cuda.empty_cache()
    return row


def generation(shape: str) -> list[dict]:
    from torchneox.models.args import model_args
    from torchneox.models.transformer import build_model

    keys = SHAPES[shape] | {
        "seq_length": 2048,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "padded_vocab_size": 50304,
    }
    model = build_model(model_args(load_mapping(keys, "gen")), device="cuda", seed=0).to(
        torch.bfloat16
    )
    rows = []
    for batch in (1, 16):
        prompts = torch.randint(0, 50000, (batch, 128)).tolist()
        # the static loop replays one CUDA graph per token; dynamic attends over the keys so
        # far; recompute has no cache
        for loop in ("static", "dynamic", "recompute"):
            sampling = {"use_cache": loop != "recompute", "decode_loop": loop}
            if loop == "recompute":
                sampling["decode_loop"] = "dynamic"
            generate(model, prompts, Sampling(maximum_tokens=4, **sampling))
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = generate(model, prompts, Sampling(maximum_tokens=128, **sampling))
            torch.cuda.synchronize()
            s = time.perf_counter() - start
            row = {"benchmark": "gpu_generation", "shape": shape, "dtype": "bfloat16"}
            row |= {"batch": batch, "decode_loop": loop, "kv_cache": loop != "recompute"}
            rows.append(row | {"tokens_per_sec": round(sum(len(o) for o in out) / s, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--checkpoint-activations", action="store_true")
    parser.add_argument("--no-eager", action="store_true", help="only the compiled run")
    parser.add_argument("--no-compile", action="store_true", help="only the eager run")
    parser.add_argument(
        "--compile-scope", choices=("auto", "model", "blocks"), default="auto",
        help="what the compiled run compiles (auto: the whole model on one GPU)",
    )  # fmt: skip
    parser.add_argument("--no-generation", action="store_true")
    parser.add_argument(
        "--fp8",
        choices=("tensorwise", "rowwise"),
        help="also the compiled run with this torchao fp8 recipe, beside bf16",
    )
    parser.add_argument("--generation-shape", choices=SHAPES, default="160m")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    with tempfile.TemporaryDirectory() as tmp:
        prefix = data(Path(tmp), (args.steps + args.warmup + 2) * args.micro_batch * (args.seq + 1))
        modes = [
            m for m in (False, True) if not ((m and args.no_compile) or (not m and args.no_eager))
        ]
        for compiled in modes:
            print(json.dumps(train(args, args.shape, compiled, prefix)), flush=True)
        if args.fp8:
            row = train(args, args.shape, not args.no_compile, prefix, fp8=args.fp8)
            print(json.dumps(row), flush=True)
    if not args.no_generation:
        for row in generation(args.generation_shape):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
