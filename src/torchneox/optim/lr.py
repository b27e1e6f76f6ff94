"""GPT-NeoX's learning-rate schedule (its AnnealingLR): linear warmup, then constant, linear,
cosine or exponential decay, never below min_lr; and ``wsd`` (warmup-stable-decay, GPT-NeoX's
pending PR #1375): the peak held, then a half cosine to min_lr over the last
``wsd_decay_ratio`` of the steps after warmup; ``infinite_cosine`` and ``infinite_inv_sqrt``
(its pending PR #1194): a cooldown to ``constant_lr`` (a half cosine, or the inverse square
root 1/sqrt(1 + timescale t) - 1 scaled to reach it), held there, then an exponential decay
that reaches min_lr at ``lr_decay_iters``.

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


def half_cosine(high: float, low: float, done: float, span: float) -> float:
    """From ``high`` to ``low`` along a half cosine, ``done`` of ``span`` steps in."""
    return low + (high - low) / 2.0 * (math.cos(math.pi * done / span) + 1)


@dataclass(frozen=True)
class Infinite:
    """GPT-NeoX PR #1194's phases after warmup: ``cooldown`` steps to the rate ``constant``,
    held for ``hold`` steps, then exponential to min_lr at lr_decay_iters (the steps are
    cooldown_iters_perc and constant_iters_perc of lr_decay_iters)."""

    constant: float
    cooldown: float
    hold: float
    timescale: float

    def lr(self, style: str, peak: float, floor: float, done: float, end: float) -> float:
        """The rate ``done`` steps after warmup (of ``end``), never below ``floor`` but in
        the inverse square root cooldown, which GPT-NeoX returns unfloored."""
        if done <= self.cooldown and self.cooldown > 0:
            t = done / self.cooldown
            if style == "infinite_cosine":
                return max(half_cosine(peak, self.constant, done, self.cooldown), floor)

            def inv(t: float) -> float:
                return 1 / math.sqrt(1 + self.timescale * t) - 1

            return peak + (self.constant - peak) / inv(1) * inv(t)
        done = max(0.0, done - self.cooldown)
        if done <= self.hold:
            return max(self.constant, floor)
        span = end - self.cooldown - self.hold
        decayed = self.constant * math.exp(
            math.log(floor / self.constant) / span * (done - self.hold)
        )
        return max(decayed, floor)


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
    infinite: Infinite | None = None
    """infinite_cosine / infinite_inv_sqrt: the phases after warmup."""

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
            Infinite(
                lr.constant_lr,
                lr.cooldown_iters_perc * derived["lr_decay_iters"],
                lr.constant_iters_perc * derived["lr_decay_iters"],
                lr.timescale,
            )
            if lr.lr_decay_style.startswith("infinite_")
            else None,
        )

    def lr_at(self, step: int) -> float:
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.peak * max(1, step) / self.warmup_iters
        done = (min(step, self.decay_iters) if self.hold else step) - self.warmup_iters
        span = self.decay_iters - self.warmup_iters
        if self.infinite is not None:
            return self.infinite.lr(self.style, self.peak, self.min_lr, done, span)
        if self.style == "linear":
            lr = self.peak * (span - done) / span
        elif self.style == "cosine":
            lr = half_cosine(self.peak, self.min_lr, done, span)
        elif self.style == "exponential":
            lr = self.peak * math.exp(-0.693 * done / span)  # halves over the span
        elif self.style == "wsd":
            decay = int(span * self.wsd_ratio)
            stable = span - decay
            lr = self.peak
            if done > stable:  # as cosine, over the decay steps alone
                lr = half_cosine(self.peak, self.min_lr, done - stable, max(decay, 1))
        else:
            lr = self.peak
        return max(lr, self.min_lr)

    def lr_for_update(self, iteration: int) -> float:
        """The rate the optimizer step of ``iteration`` (1-based) uses, as in GPT-NeoX."""
        return self.lr_at(iteration - 1)
