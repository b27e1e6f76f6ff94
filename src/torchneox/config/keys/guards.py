"""Config group of the run's guards (torchneox's own keys; GPT-NeoX has none): the loss-spike
guard, the silent-data-corruption check and the straggler report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchneox.config.fields import extension


@dataclass
class GuardConfig:
    """Guards of a long run: loss spikes, silent data corruption, stragglers."""

    spike_action: Literal["off", "warn", "rewind"] = extension(
        "off",
        "What a loss spike does: off, not watched; warn, one line; rewind, the last checkpoint "
        "reloaded and the batches since it (the spike's included) skipped, counted and logged "
        "(PaLM's remedy). A spike is a value above the mean + spike_threshold x the standard "
        "deviation of the last spike_window steps; the loss and gradient norm are read back "
        "every step while it is on.",
    )
    spike_signal: Literal["loss", "grad_norm", "either"] = extension(
        "loss", "What the spike guard watches: the loss, the gradient norm, or either of them."
    )
    spike_window: int = extension(
        50, "Steps whose values the spike guard compares each step with (spikes left out).", ge=2
    )
    spike_threshold: float = extension(
        6.0,
        "k: a step's value above the window's mean + k x its standard deviation is a spike.",
        gt=0,
    )
    spike_max_rewinds: int = extension(
        3,
        "Rewinds (spike_action rewind) a run may make; at the next spike past them it stops in "
        "one line.",
        ge=0,
    )
    sdc_check_interval: int = extension(
        0,
        "Every this many steps, the step's forward and backward run twice on the same batch "
        "and each rank compares its gradients bit for bit before the update; a mismatch stops "
        "the run naming the rank and the step, nothing of the step saved (0: never).",
        ge=0,
    )
    straggler_factor: float | None = extension(
        None,
        "Every log_interval, each rank's step time (less what it waited for the others at the "
        "step's start) is gathered, and a rank slower than the median by this factor is named "
        "in one line (unset: not measured; one small collective a step when set).",
        gt=1,
    )
