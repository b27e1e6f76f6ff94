"""Run under torchrun by tests/inference/test_sample_policy.py: the model of MODEL_JSON built
as a run lays it out on gloo (LAYOUT: one of LAYOUTS), rollouts sampled from it with
``sample_policy`` under a lockstep over the world, written to OUT/rank{R}.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchneox.config.layout import Layout
from torchneox.config.load import load_mapping
from torchneox.inference.generate import Sampling, sample_policy
from torchneox.models.args import model_args
from torchneox.parallel.dims import ParallelDims, init_distributed, shutdown
from torchneox.parallel.parallelize import BuildOptions, build_parallel_model

# name -> (tensor-parallel ranks, ZeRO stage, sequence parallelism)
LAYOUTS = {
    "zero0": (1, 0, False),
    "zero3": (1, 3, False),
    "tp2": (2, 1, False),
    "tp2-sp": (2, 1, True),
}


def all_done(local_done: bool) -> bool:
    flag = torch.tensor(float(local_done))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def main() -> None:
    spec, layout_name, out = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2], sys.argv[3]
    world = init_distributed("cpu", None, 5)
    rank = dist.get_rank()
    tp, zero, sequence_parallel = LAYOUTS[layout_name]
    layout = Layout(
        world, world // tp, tp, 1, zero, 1, 1, "none", sequence_parallel=sequence_parallel
    )
    dims = ParallelDims.from_layout(layout, "cpu")
    dims.build_mesh()
    args = model_args(load_mapping(spec["model"], "model"))
    built = build_parallel_model(args, dims, layout, torch.device("cpu"), BuildOptions(seed=0))
    built.module.train()
    # the data-parallel ranks sample their own prompts, the tensor-parallel ones the same
    prompts = spec["prompts"][dims.dp_rank]
    rows = {}
    for name, s in spec["samplings"].items():
        sampling = Sampling(**(s | {"stop_ids": set(s["stop_ids"])}))
        generator = torch.Generator().manual_seed(spec["seed"])
        rows[name] = sample_policy(built.module, prompts, sampling, 0, generator, tp, all_done)
    rows["training"] = built.module.training
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    shutdown()


if __name__ == "__main__":
    main()
