"""Run by tests/estimate/test_memory.py under torchrun: one training step, then the
bytes this rank holds in parameters, gradients (as the optimizer sees them) and optimizer
state, and what autograd saved for backward during the step's first micro-batch (forward and
loss), written to OUT/rank{R}.json."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from torchneox.config.load import load_config
from torchneox.parallel.dims import shutdown
from torchneox.train.trainer import Trainer


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure_activations(trainer: Trainer, seen: dict) -> None:
    """Count the bytes of the distinct storages autograd saves during the first micro-batch's
    forward and loss, parameters (also as FSDP gathers them), buffers and the batch itself
    left out."""
    from torch.multiprocessing.reductions import StorageWeakRef

    forward = trainer.step.gradients._forward

    def key(t: torch.Tensor) -> int:
        return StorageWeakRef(t.untyped_storage()).cdata

    def measured(batch, sums):
        kept = {key(t) for t in [*trainer.model.parameters(), *trainer.model.buffers()]}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            # FSDP's gathered weights are parameters too, but not the sharded ones it holds
            weight = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
            if key(t) not in kept and not weight and t.is_floating_point():
                saved[key(t)] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(batch, sums)
        seen.setdefault("activations", sum(saved.values()))
        return out

    trainer.step.gradients._forward = measured


def main() -> None:
    config, out, *overrides = sys.argv[1:]
    trainer = Trainer(load_config([config], overrides), device="cpu")
    seen = {}
    step = trainer.optimizer.step

    def measured_step(*args, **kwargs):
        for n, p in trainer.model.named_parameters():
            if p.grad is not None and local_bytes(p.grad) != local_bytes(p):
                print(
                    "MISMATCH",
                    n,
                    p.grad.placements if hasattr(p.grad, "placements") else None,
                    p.placements if hasattr(p, "placements") else None,
                    flush=True,
                )
        seen["gradient_shard"] = sum(
            local_bytes(p.grad) for p in trainer.model.parameters() if p.grad is not None
        )
        return step(*args, **kwargs)

    trainer.optimizer.step = measured_step
    activations: dict = {}
    measure_activations(trainer, activations)
    trainer.train_step()
    seen["parameter_shard"] = sum(local_bytes(p) for p in trainer.model.parameters())
    seen["optimizer"] = sum(
        local_bytes(v)
        for state in trainer.optimizer.state.values()
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and k != "step"
    )
    rank = int(os.environ.get("RANK", "0"))
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    Path(out, f"activations{rank}.json").write_text(json.dumps(activations))
    shutdown()


if __name__ == "__main__":
    main()
