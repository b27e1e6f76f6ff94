"""A training run's progress as it goes: every log_interval a full row (loss, tokens/s, MFU,
ETA) to the console and metrics.jsonl, one live line between them."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from torchneox.reporting.metrics import duration


class StepProgress:
    """The console and metrics rows of the steps: every log_interval a full row (tokens/s,
    MFU, ETA), between them one live line."""

    def __init__(self, trainer: Any, tokens_per_step: int):
        self.trainer, self.tokens_per_step = trainer, tokens_per_step
        self.start_iteration, self.last_row = trainer.iteration, None
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.window_tokens = 0
        self.run_start = time.perf_counter()
        self.curriculum = getattr(getattr(trainer.step, "gradients", None), "curriculum", None)

    def step_tokens(self, iteration: int) -> int:
        """The tokens a step trained: a curriculum's steps train on fewer."""
        if self.curriculum is None:
            return self.tokens_per_step
        seq = self.trainer.cfg.model.seq_length
        return self.tokens_per_step * min(self.curriculum.length(iteration), seq) // seq

    def report(self, out: Mapping[str, float]) -> None:
        tr, lg = self.trainer, self.trainer.cfg.logging
        self.window_steps += 1
        self.window_tokens += self.step_tokens(tr.iteration)
        done = tr.iteration - self.start_iteration
        eta = (time.perf_counter() - self.run_start) / done * (tr.train_iters - tr.iteration)
        if tr.iteration % lg.log_interval and tr.iteration != tr.train_iters:
            # between log rows the step's loss stays on the device (reading it would wait)
            tr.logger.live(f"step {tr.iteration}/{tr.train_iters} | ETA {duration(eta)}")
            return
        seconds = (time.perf_counter() - self.window_start) / self.window_steps
        self.last_row = tr.step_row(out, seconds, self.window_tokens // self.window_steps)
        tr.logger.record(self.last_row)
        shown = tr.console_metrics(out)
        tr.logger.line(tr.logger.step_text(self.last_row, tr.train_iters, eta, shown))
        if lg.wall_clock_breakdown:
            tr.logger.line("  " + tr.timers.report(self.window_steps))
        self.window_start, self.window_steps, self.window_tokens = time.perf_counter(), 0, 0
