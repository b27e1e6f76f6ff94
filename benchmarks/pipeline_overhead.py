"""The cost of the pipeline path when there is nothing to pipeline: the same model and batch
as a plain module (what pipe_parallel_size 0 and 1 run) and as a one-stage pipeline schedule
(what GPT-NeoX ran for pipe_parallel_size 1). Prints the step times and their ratio.

    python benchmarks/pipeline_overhead.py [--layers 6] [--hidden 256] [--micro-batches 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchneox.config.layout import Layout
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.parallel.parallelize import EVERY_PARAMETER, materialise
from torchneox.parallel.pipeline import build_pipeline
from torchneox.train.loss import lm_loss


def timed(step, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    keys = {
        "num_layers": args.layers,
        "hidden_size": args.hidden,
        "num_attention_heads": 4,
        "seq_length": args.seq,
        "pos_emb": "rotary",
        "no_weight_tying": True,
        "padded_vocab_size": 512,
    }
    margs = model_args(load_mapping(keys, "bench"))
    tokens = torch.randint(0, 512, (args.micro_batch * args.micro_batches, args.seq + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    model = build_model(margs, seed=0)

    def plain() -> None:
        for x, y in zip(
            inputs.chunk(args.micro_batches), labels.chunk(args.micro_batches), strict=True
        ):
            (lm_loss(model(x), y, None) / args.micro_batches).backward()
        model.zero_grad(set_to_none=True)

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
    cpu = torch.device("cpu")
    rows = []
    plain_s = timed(plain, args.steps)
    for schedule in ("gpipe", "1f1b"):
        layout = Layout(
            gpus=1, dp=1, tp=1, pp=1, zero=0, micro_batch=args.micro_batch,
            gas=args.micro_batches, checkpoint="none", schedule=schedule,
            partition_method="uniform",
        )  # fmt: skip
        pipe = build_pipeline(
            margs,
            mesh,
            cpu,
            layout,
            lambda out, y: lm_loss(out, y, None),
            lambda part: materialise(part, cpu, 0, EVERY_PARAMETER),
        )

        def piped(pipe=pipe) -> None:
            pipe.schedule.step(inputs, target=labels, losses=[])
            pipe.container.zero_grad(set_to_none=True)

        s = timed(piped, args.steps)
        rows.append(
            {
                "benchmark": "pipeline_overhead",
                "schedule": schedule,
                "stages": 1,
                "micro_batches": args.micro_batches,
                "plain_step_s": round(plain_s, 4),
                "pipeline_step_s": round(s, 4),
                "ratio_pipeline_over_plain": round(s / plain_s, 3),
            }
        )
    for row in rows:
        print(json.dumps(row))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
