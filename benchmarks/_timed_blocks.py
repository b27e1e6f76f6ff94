"""`torchneox train` in which every transformer block takes a fixed wall time: its forward
sleeps F ms and its backward 2F ms (a backward does about twice a forward's work), on top of a
model too small to compute anything measurable. Sleeping stages do not compete for cores, so a
pipeline of more stages than the machine has cores keeps the timing of its schedule: what is
measured is torchneox's real pipeline (torch.distributed.pipelining schedules, point-to-point
sends over gloo), with the compute made uniform and known.

    TORCHNEOX_BENCH_BLOCK_MS=F torchrun --nproc-per-node P benchmarks/_timed_blocks.py train CONFIG
"""

from __future__ import annotations

import os
import time

import torch

from torchneox.cli import main
from torchneox.models import transformer

SECONDS = float(os.environ.get("TORCHNEOX_BENCH_BLOCK_MS", "10")) / 1000


class _FixedWork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SECONDS)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(2 * SECONDS)
        return grad


_block_forward = transformer.Block.forward


def _timed_forward(self, x, *args, **kwargs):
    return _FixedWork.apply(_block_forward(self, x, *args, **kwargs))


transformer.Block.forward = _timed_forward

if __name__ == "__main__":
    raise SystemExit(main())
