"""The run's guards (config/keys/guards.py): the loss-spike guard, which warns of a spike or
rewinds to the last checkpoint and skips the spike's batches; the silent-data-corruption check,
which runs a step's forward and backward twice and compares the gradients bit for bit; and the
straggler report, which names a rank slower than the others."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchneox.base.errors import TrainingStopped
from torchneox.checkpoint.files import read_latest
from torchneox.config.keys.guards import GuardConfig
from torchneox.parallel.dims import ParallelDims

SIGNALS = {"loss": ("lm_loss",), "grad_norm": ("grad_norm",), "either": ("lm_loss", "grad_norm")}
LABELS = {"lm_loss": "the loss", "grad_norm": "the gradient norm"}


class SpikeGuard:
    """A step's loss (or gradient norm) above the mean + k x the standard deviation of the last
    ``spike_window`` steps' is a spike: warned of, or rewound (the run reloads its last
    checkpoint and moves its data past the batches since it, which are counted)."""

    def __init__(self, g: GuardConfig, line: Callable[[str], None]):
        self.g, self.line = g, line
        self.windows = {name: deque(maxlen=g.spike_window) for name in SIGNALS[g.spike_signal]}
        self.rewinds = 0
        self.skipped_batches = 0

    def spike(self, out: Mapping[str, float]) -> str | None:
        """What in the step ``out`` is a spike (None: nothing; the values join the windows)."""
        found = None
        for name, window in self.windows.items():
            value = out[name]
            if found is None and len(window) == window.maxlen and math.isfinite(value):
                mean, std = statistics.fmean(window), statistics.pstdev(window)
                if value > mean + self.g.spike_threshold * std:
                    found = (
                        f"{LABELS[name]} {value:.6g} is a spike: above the mean {mean:.6g} + "
                        f"{self.g.spike_threshold:g} x the standard deviation {std:.3g} of the "
                        f"last {len(window)} steps"
                    )
        if found is None:
            for name, window in self.windows.items():
                if math.isfinite(out[name]):
                    window.append(out[name])
        return found

    def check(self, trainer: Any, out: Mapping[str, float]) -> bool:
        """After a step: whether it was rewound (the trainer is back at its last checkpoint)."""
        if out.get("skipped"):  # a non-finite step the skip policy skipped
            return False
        why = self.spike(out)
        if why is None:
            return False
        step = trainer.iteration
        if self.g.spike_action == "warn":
            self.line(f"step {step}: {why} (spike_action warn: training goes on)")
            return False
        self.rewind(trainer, step, why)
        return True

    def rewind(self, trainer: Any, step: int, why: str) -> None:
        """Reload the last checkpoint, keeping the data where the spike left it."""
        checkpoints = trainer.checkpoints
        trainer.step.settle()
        checkpoints.wait()  # a background save in flight is finished: it may be the last one
        name = read_latest(checkpoints.save_dir)
        if name is None:
            raise TrainingStopped(
                f"step {step}: {why}; no checkpoint to rewind to was saved yet (spike_action "
                "rewind): stopping; save more often (save_interval) or raise spike_threshold"
            )
        limit = self.g.spike_max_rewinds
        if self.rewinds >= limit:
            raise TrainingStopped(
                f"step {step}: {why}; the {limit} rewind(s) spike_max_rewinds allows are used "
                f"up: stopping ({checkpoints.last_good()})"
            )
        position = trainer.train_loader.state_dict()
        resumed = checkpoints.resume(Path(checkpoints.save_dir) / name, trainer.state)
        trainer.train_loader.load_state_dict(position)  # past the spike's batches
        rewound = getattr(trainer.train_loader, "rewound", None)
        if rewound is not None:  # REINFORCE: past the rest of the spike's rollout batch too
            rewound()
        trainer.iteration = resumed.iteration
        skipped = step - resumed.iteration
        self.rewinds += 1
        self.skipped_batches += skipped
        self.line(
            f"step {step}: {why}; rewound to {resumed.step_dir} and skipping the {skipped} "
            f"batch(es) of steps {resumed.iteration + 1}-{step} (rewind {self.rewinds} of "
            f"{limit}; {self.skipped_batches} batch(es) skipped in all)"
        )


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a (DTensor) gradient this rank holds."""
    return t.to_local() if isinstance(t, DTensor) else t


class CorruptionCheck:
    """Every ``interval`` steps the step's forward and backward run twice on the same batch
    (the random generators set back between them) and each rank compares its gradients, and the
    losses, bit for bit, before the update. A mismatch on any rank stops every rank."""

    def __init__(
        self,
        interval: int,
        model: torch.nn.Module,
        dims: ParallelDims,
        device: torch.device,
        last_good: Callable[[], str],
    ):
        self.interval, self.model, self.dims, self.device = interval, model, dims, device
        self.last_good = last_good

    def due(self, iteration: int) -> bool:
        return iteration % self.interval == 0

    def __call__(self, iteration: int, micro_batches: list, gradients: Callable) -> Any:
        cuda = self.device.type == "cuda"
        rng = torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None
        loss, metrics = gradients(iteration, micro_batches)
        params = [p for p in self.model.parameters() if p.grad is not None]
        first = [local(p.grad).detach().clone() for p in params]
        first_loss = loss.detach().clone()
        for p in params:
            p.grad = None
        torch.set_rng_state(rng[0])
        if cuda:
            torch.cuda.set_rng_state(rng[1])
        loss, metrics = gradients(iteration, micro_batches)
        again = [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        same = len(again) == len(first) and torch.equal(loss.detach(), first_loss)
        same = same and all(torch.equal(a, b) for a, b in zip(first, again, strict=False))
        self._stop_unless_every_rank(same, iteration)
        return loss, metrics

    def _stop_unless_every_rank(self, same: bool, iteration: int) -> None:
        differ = torch.zeros(self.dims.world_size, device=self.device)
        differ[self.dims.rank] = float(not same)
        if self.dims.world_size > 1:
            dist.all_reduce(differ)
        ranks = [r for r, d in enumerate(differ.tolist()) if d]
        if not ranks:
            return
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        raise TrainingStopped(
            f"step {iteration}: silent data corruption: {which} computed other gradients when "
            "the step's forward and backward ran again on the same batch (sdc_check_interval); "
            f"stopping before the update, nothing of step {iteration} saved ({self.last_good()}); "
            f"check the hardware of {which} before resuming"
        )


class Stragglers:
    """Each rank's step time less what it waited for the others at the step's start (one small
    collective there), gathered every log_interval: a rank slower than the median by
    ``factor`` is named."""

    def __init__(
        self, factor: float, dims: ParallelDims, device: torch.device, line: Callable[[str], None]
    ):
        self.factor, self.dims, self.device, self.line = factor, dims, device, line
        self.own, self.steps, self.left = 0.0, 0, None  # left: when the last sync ended

    def sync(self) -> None:
        """At a step's start: the time since the last one's sync ended is this rank's own."""
        arrived = time.perf_counter()
        dist.all_reduce(torch.zeros(1, device=self.device))
        if self.left is not None:
            self.own += arrived - self.left
            self.steps += 1
        self.left = time.perf_counter()

    def report(self, iteration: int) -> None:
        """Every rank's mean time over the window; the ranks slower than the median named."""
        mine = self.own / max(self.steps, 1)
        times = torch.zeros(self.dims.world_size, dtype=torch.float64, device=self.device)
        times[self.dims.rank] = mine
        dist.all_reduce(times)
        self.own, self.steps = 0.0, 0
        seconds = times.tolist()
        median = statistics.median(seconds)
        slow = [r for r, s in enumerate(seconds) if median > 0 and s > self.factor * median]
        for r in slow:
            self.line(
                f"step {iteration}: straggler: rank {r} took {seconds[r]:.3g} s a step, "
                f"{seconds[r] / median:.2f} x the median {median:.3g} s of the "
                f"{len(seconds)} ranks (straggler_factor {self.factor:g})"
            )


class Guards:
    """The guards a run's config turns on, as the trainer calls them."""

    def __init__(self, g: GuardConfig, dims: ParallelDims, device: torch.device, line: Callable):
        self.spikes = SpikeGuard(g, line) if g.spike_action != "off" else None
        self.stragglers = None
        if g.straggler_factor is not None and dims.world_size > 1:
            self.stragglers = Stragglers(g.straggler_factor, dims, device, line)

    def step_start(self) -> None:
        if self.stragglers is not None:
            self.stragglers.sync()

    def rewound(self, trainer: Any, out: Mapping[str, float]) -> bool:
        return self.spikes is not None and self.spikes.check(trainer, out)

    def row(self, iteration: int) -> dict[str, Any]:
        """What a logged step's row gains (the stragglers named on the console)."""
        if self.stragglers is not None:
            self.stragglers.report(iteration)
        if self.spikes is None or self.spikes.g.spike_action != "rewind":
            return {}
        return {"rewinds": self.spikes.rewinds, "skipped_batches": self.spikes.skipped_batches}
