"""GPT-NeoX's learning-rate schedule (its AnnealingLR): linear warmup, then constant, linear,
cosine or exponential decay, never below min_lr; and ``wsd`` (warmup-stable-decay, GPT-NeoX's
pending PR #1375): the peak held, then a half cosine to min_lr over the last
``wsd_decay_ratio`` of the steps after warmup.

Past ``lr_decay_iters`` GPT-NeoX keeps evaluating the formula (its cosine climbs back up, its
exponential keeps falling to min_lr); so does torchneox by default, and ``hold_lr_after_decay``
keeps the rate where the decay ended instead.

GPT-NeoX steps its scheduler after each optimizer step, so the update of iteration k uses
``lr_at(k - 1)`` and its log shows ``lr_at(k)``. Since its #1379 (in the ea7aefd target)
warmup is ``peak * max(1, step) / warmup``: the first update already moves the weights, with
the rate of the second (before, it used 0 and changed nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Schedule:
    peak: float
    min_lr: float
    warmup_iters: float
    decay_iters: int
    style: str
    hold: bool = False
    """Past decay_iters, stay at the rate the decay ended on (GPT-NeoX: False)."""
    wsd_ratio: float = 0.1
    """wsd: the share of the steps after warmup that decay (the rest hold the peak)."""

    @classmethod
    def from_config(cls, lr: Any, derived: Any) -> Schedule:
        """The schedule of the ``lr`` config group and the derived values (peak, warmup and
        decay steps)."""
        return cls(
            derived["lr"],
            lr.min_lr,
            derived["warmup_iters"],
            derived["lr_decay_iters"],
            lr.lr_decay_style,
            lr.hold_lr_after_decay,
            lr.wsd_decay_ratio,
        )

    def lr_at(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.peak * max(1, step) / self.warmup_iters
        done = (min(step, self.decay_iters) if self.hold else step) - self.warmup_iters
        span = self.decay_iters - self.warmup_iters
        if self.style == "linear":
            lr = self.peak * (span - done) / span
        elif self.style == "cosine":
            lr = self.min_lr + (self.peak - self.min_lr) / 2.0 * (
                math.cos(math.pi * done / span) + 1
            )
        elif self.style == "exponential":
            lr = self.peak * math.exp(-0.693 * done / span)  # halves over the span
        elif self.style == "wsd":
            decay = int(span * self.wsd_ratio)
            stable = span - decay
            lr = self.peak
            if done > stable:  # as cosine, over the decay steps alone
                progress = (done - stable) / max(decay, 1)
                lr = self.min_lr + (self.peak - self.min_lr) / 2.0 * (
                    math.cos(math.pi * progress) + 1
                )
        else:
            lr = self.peak
        return max(lr, self.min_lr)

    def lr_for_update(self, iteration: int) -> float:
        """The rate the optimizer step of ``iteration`` (1-based) uses, as in GPT-NeoX."""
        return self.lr_at(iteration - 1)
