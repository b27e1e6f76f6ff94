"""Run by tests/estimate/test_memory.py under torchrun: one training step, then the
bytes this rank holds in parameters, gradients (as the optimizer sees them) and optimizer
state, written to OUT/rank{R}.json."""

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
    shutdown()


if __name__ == "__main__":
    main()
