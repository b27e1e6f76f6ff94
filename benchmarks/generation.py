"""Generation speed with and without the KV cache, on a Pythia-shaped model (random weights).

    python benchmarks/generation.py [--shape 70m] [--tokens 64] [--batch 1 4] [--device cpu]

Prints one JSON object per line: shape, batch, cache, new tokens, seconds, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from torchneox.config.load import load_mapping
from torchneox.inference.generate import Sampling, generate
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

SHAPES = {
    "14m": {"num_layers": 6, "hidden_size": 128, "num_attention_heads": 4},
    "70m": {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8},
    "160m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=SHAPES, default="70m")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32, help="prompt length in tokens")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    keys = SHAPES[args.shape] | {
        "seq_length": 2048,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "padded_vocab_size": 50304,
    }
    model = build_model(model_args(load_mapping(keys, args.shape)), device=args.device, seed=0)
    for batch in args.batch:
        prompts = torch.randint(0, 50000, (batch, args.prompt)).tolist()
        for cache in (True, False):
            s = Sampling(maximum_tokens=args.tokens, use_cache=cache)
            generate(model, prompts, Sampling(maximum_tokens=2, use_cache=cache))  # warm-up
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            generate(model, prompts, s)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            print(
                json.dumps(
                    {
                        "benchmark": "generation",
                        "shape": args.shape,
                        "device": args.device,
                        "batch": batch,
                        "kv_cache": cache,
                        "new_tokens": batch * args.tokens,
                        "seconds": round(seconds, 3),
                        "tokens_per_sec": round(batch * args.tokens / seconds, 1),
                    }
                )
            )


if __name__ == "__main__":
    main()
