"""Training throughput: torchneox's loop against Hugging Face transformers' GPTNeoXForCausalLM
with a plain AdamW loop, same shape, batch, sequence length and dtype, in one run.

    python benchmarks/train_vs_hf.py [--shape 14m] [--steps 20] [--batch 8] [--seq 128] [--device cpu]

Prints one JSON line per side and one with the ratio (torchneox / transformers).
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
from torchneox.train.trainer import Trainer

SHAPES = {
    "14m": {"num_layers": 6, "hidden_size": 128, "num_attention_heads": 4},
    "70m": {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8},
    "160m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
}
VOCAB = 50304


def synthetic_data(folder: Path, tokens: int) -> str:
    rng = np.random.default_rng(0)
    writer = IndexedDatasetWriter(folder / "random", np.uint16)
    for _ in range(tokens // 1000):
        writer.add_document(rng.integers(0, 50000, size=1000))
    writer.finish()
    return str(folder / "random")


def torchneox_keys(shape: str, args, data: str) -> dict:
    """The torchneox config of a shape: the architecture of transformers' GPTNeoX defaults."""
    return SHAPES[shape] | {
        "seq_length": args.seq,
        "max_position_embeddings": 2048,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "padded_vocab_size": VOCAB,
        "train_micro_batch_size_per_gpu": args.batch,
        "train_iters": args.steps + args.warmup,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "weight_decay": 0.0,
        "gradient_clipping": 0.0,
        "precision": args.precision,
        "data_path": data,
        "split": "100,0,0",
        "eval_iters": 0,
        "log_interval": 10**6,
        "num_workers": 1,
        "save": None,
        "seed": 1,
        "compile": getattr(args, "compile", False),
    }


def torchneox_side(shape, args, data: str, save: str) -> float:
    keys = torchneox_keys(shape, args, data)
    trainer = Trainer(load_mapping(keys, "benchmark"), device=args.device)
    for _ in range(args.warmup):
        trainer.train_step()
    sync(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    sync(args.device)
    trainer.train_loader.close()
    return args.steps * args.batch * args.seq / (time.perf_counter() - start)


def hf_side(shape, args) -> float:
    import transformers

    s = SHAPES[shape]
    cfg = transformers.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=s["hidden_size"],
        num_hidden_layers=s["num_layers"],
        num_attention_heads=s["num_attention_heads"],
        intermediate_size=4 * s["hidden_size"],
        rotary_pct=0.25,
        max_position_embeddings=2048,
        use_parallel_residual=True,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.GPTNeoXForCausalLM(cfg).to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    rng = np.random.default_rng(0)
    dtype = {"fp32": None, "bfloat16": torch.bfloat16}[args.precision]

    def step() -> None:
        tokens = torch.from_numpy(rng.integers(0, 50000, size=(args.batch, args.seq + 1))).to(
            args.device
        )
        with torch.autocast(args.device, dtype=dtype, enabled=dtype is not None):
            out = model(input_ids=tokens[:, :-1], labels=tokens[:, :-1])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.loss.item()

    for _ in range(args.warmup):
        step()
    sync(args.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(args.device)
    return args.steps * args.batch * args.seq / (time.perf_counter() - start)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=SHAPES, default="14m")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", choices=("fp32", "bfloat16"), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = synthetic_data(
            Path(tmp), (args.steps + args.warmup + 2) * args.batch * (args.seq + 1) * 2
        )
        ours = torchneox_side(args.shape, args, data, tmp)
    theirs = hf_side(args.shape, args)
    common = {
        "shape": args.shape,
        "batch": args.batch,
        "seq": args.seq,
        "precision": args.precision,
        "device": args.device,
    }
    print(
        json.dumps(
            {"benchmark": "train", "side": "torchneox", "tokens_per_sec": round(ours, 1)} | common
        )
    )
    print(
        json.dumps(
            {"benchmark": "train", "side": "transformers", "tokens_per_sec": round(theirs, 1)}
            | common
        )
    )
    print(
        json.dumps(
            {"benchmark": "train", "ratio_torchneox_over_transformers": round(ours / theirs, 3)}
            | common
        )
    )


if __name__ == "__main__":
    main()
