"""Mixture of experts: the MoE layer's forward + backward throughput with grouped GEMMs against
the per-expert loop, how balanced routing stays over a short training run (topk against
sinkhorn routing, with the load-balancing loss), and (``--balancing``) DeepSeek-V3's
auxiliary-loss-free router bias against the auxiliary loss on one small MoE: the busiest
expert's load and the validation loss.

    python benchmarks/moe.py [--experts 8 32] [--tokens 4096] [--hidden 256] [--train-steps 40]
    python benchmarks/moe.py --balancing [--train-steps 300]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from torchneox.config.load import load_mapping
from torchneox.data import builtin
from torchneox.data.preprocess import PreprocessArgs, preprocess
from torchneox.models.args import model_args
from torchneox.models.moe import MoE
from torchneox.train.trainer import Trainer


def layer_speed(experts: int, tokens: int, hidden: int, top_k: int, grouped: bool) -> float:
    keys = {
        "num_layers": 1,
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "seq_length": 128,
        "padded_vocab_size": 128,
        "moe_num_experts": experts,
        "moe_top_k": top_k,
        "moe_router_type": "topk",
    }
    layer = MoE(model_args(load_mapping(keys, "bench")))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layer.grouped = grouped
    x = torch.randn(tokens, hidden, requires_grad=True)

    def step() -> None:
        layer(x)[0].sum().backward()

    for _ in range(2):
        step()
    start, n = time.perf_counter(), 5
    for _ in range(n):
        step()
    return tokens * n / (time.perf_counter() - start)


SMALL_MOE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "pos_emb": "rotary",
    "no_weight_tying": True,
    "moe_num_experts": 8,
    "moe_top_k": 2,
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 0.003}},
    "tokenizer_type": "CharLevelTokenizer",
}
"""The small MoE both routing benchmarks train."""


def routing_balance(router: str, steps: int, folder: Path) -> dict:
    prefix = data(folder)
    keys = SMALL_MOE | {
        "moe_router_type": router,
        "train_iters": steps,
        "data_path": str(prefix),
        "split": "100,0,0",
        "eval_iters": 0,
        "num_workers": 0,
        "log_interval": 1,
        "save": str(folder / router),
    }
    Trainer(load_mapping(keys, f"moe-{router}"), device="cpu").run()
    rows = [json.loads(x) for x in (folder / router / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "moe_tokens_per_expert" in r]

    def busiest(r: dict) -> float:
        counts = [c for layer in r["moe_tokens_per_expert"] for c in layer]
        return max(counts) / (sum(counts) / len(counts))

    return {
        "benchmark": "moe_routing_balance",
        "router": router,
        "steps": steps,
        "busiest_expert_over_mean_first": round(busiest(rows[0]), 2),
        "busiest_expert_over_mean_last": round(busiest(rows[-1]), 2),
        "aux_loss_last": round(rows[-1]["moe_aux_loss"], 4),
        "lm_loss_last": round(rows[-1]["lm_loss"], 4),
    }


BALANCING = {
    "neither": {},
    "aux loss 0.01": {"moe_aux_loss_coeff": 0.01},
    "bias 0.001": {"moe_router_bias_update_rate": 0.001},
    "bias 0.01": {"moe_router_bias_update_rate": 0.01},
    "sigmoid, bias 0.01": {
        "moe_score_func": "sigmoid",
        "moe_renormalize_top_k": True,
        "moe_router_bias_update_rate": 0.01,
    },
}
"""The variants compared, on the top-k router (softmax scores unless said)."""


def balancing(name: str, steps: int, prefix: str, folder: Path, seed: int = 1234) -> dict:
    """One variant trained ``steps`` steps: the busiest expert's assignments over the mean
    (the largest over the layers, averaged over the last quarter of the steps), the last
    step's auxiliary loss (logged whatever its weight) and the validation loss at the end."""
    keys = (
        SMALL_MOE
        | {
            "moe_router_type": "topk",
            "train_iters": steps,
            "data_path": prefix,
            "split": "95,5,0",
            "eval_interval": steps,
            "eval_iters": 8,
            "num_workers": 0,
            "log_interval": 1,
            "seed": seed,
            "save": str(folder / f"{name.replace(' ', '_').replace(',', '')}-{seed}"),
        }
        | BALANCING[name]
    )
    Trainer(load_mapping(keys, "moe-balancing"), device="cpu").run()
    rows = [json.loads(x) for x in (Path(keys["save"]) / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "moe_max_load" in r]
    tail = steps_rows[-max(1, len(steps_rows) // 4) :]
    valid = [r["valid_lm_loss"] for r in rows if "valid_lm_loss" in r]
    return {
        "benchmark": "moe_balancing",
        "variant": name,
        "seed": seed,
        "steps": steps,
        "busiest_expert_over_mean_first": round(steps_rows[0]["moe_max_load"], 2),
        "busiest_expert_over_mean_last_quarter": round(
            sum(r["moe_max_load"] for r in tail) / len(tail), 2
        ),
        "aux_loss_last": round(steps_rows[-1]["moe_aux_loss"], 4),
        "valid_lm_loss": round(valid[-1], 4),
    }


def data(folder: Path) -> str:
    builtin.write_jsonl("pydocs", folder / "docs.jsonl", max_bytes=400_000)
    (prefix,) = preprocess(
        PreprocessArgs(
            [str(folder / "docs.jsonl")],
            str(folder / "docs"),
            "CharLevelTokenizer",
            append_eod=True,
        )
    )
    return str(prefix)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--balancing", action="store_true", help="only the balancing comparison")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234])
    parser.add_argument("--variants", nargs="+", default=list(BALANCING), choices=list(BALANCING))
    args = parser.parse_args()
    if args.balancing:
        with tempfile.TemporaryDirectory() as tmp:
            prefix = data(Path(tmp))
            for seed in args.seeds:
                for name in args.variants:
                    row = balancing(name, args.train_steps, prefix, Path(tmp), seed)
                    print(json.dumps(row), flush=True)
        return
    for e in args.experts:
        loop = layer_speed(e, args.tokens, args.hidden, args.top_k, grouped=False)
        grouped = layer_speed(e, args.tokens, args.hidden, args.top_k, grouped=True)
        row = {
            "benchmark": "moe_layer",
            "experts": e,
            "top_k": args.top_k,
            "tokens": args.tokens,
            "hidden": args.hidden,
            "loop_tokens_per_sec": round(loop),
            "grouped_tokens_per_sec": round(grouped),
            "grouped_over_loop": round(grouped / loop, 3),
        }
        print(json.dumps(row), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for router in ("topk", "sinkhorn"):
            print(json.dumps(routing_balance(router, args.train_steps, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
