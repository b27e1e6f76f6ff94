"""Post-training through a pipeline: the objective as the schedule's loss on the last stage.

A pipeline schedule splits its input and its target along the batch into micro-batches and
calls the loss with one micro-batch's output and target. A post-training micro-batch is
prepared as the loop prepares it (for pairs: its chosen rows, then its rejected ones), the
micro-batches concatenated in order, so each chunk the schedule cuts is one micro-batch; the
target carries, per position, the label, the loss mask, KTO's reward (reinforce's advantage),
the reference's log-probability (computed first by a forward-only pass of the reference's own
pipeline), reinforce's raw reward and its sampling policy's log-probability.
The objective's metrics are kept on the last stage, then shared with the other stages.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchneox.parallel.collectives import plain, sum_over_pp
from torchneox.parallel.dims import ParallelDims
from torchneox.train.objectives import LanguageModeling, Objective, Prepared


def encode_target(prep: Prepared) -> torch.Tensor:
    """[B, T, 6] float32: labels are exact in float32 below 2^24 (every vocabulary). The
    channels: label, loss mask, KTO's reward (or reinforce's advantage, on every position),
    the reference's log-probability, reinforce's raw reward (every position) and the sampling
    policy's log-probability."""
    zeros = torch.zeros_like(prep.labels, dtype=torch.float32)

    def per_row(values: torch.Tensor | None) -> torch.Tensor:
        return zeros if values is None else values.float()[:, None].expand_as(zeros)

    mask = prep.mask.float() if prep.mask is not None else torch.ones_like(zeros)
    rewards = prep.rewards.float() if prep.rewards is not None else per_row(prep.advantages)
    parts = [prep.labels.float(), mask, rewards]
    parts.append(prep.reference_logp.float() if prep.reference_logp is not None else zeros)
    parts.append(per_row(prep.raw_rewards))
    parts.append(prep.old_logp.float() if prep.old_logp is not None else zeros)
    return torch.stack(parts, dim=-1)


def decode_target(target: torch.Tensor) -> Prepared:
    """The micro-batch as the objective reads it (rewards are 0 where there are none)."""
    labels = target[..., 0].round().long()
    mask = target[..., 1] > 0.5
    out = Prepared(labels, labels, mask, rewards=target[..., 2], reference_logp=target[..., 3])
    out.advantages, out.raw_rewards = target[:, 0, 2], target[:, 0, 4]
    out.old_logp = target[..., 5]
    return out


class PipelinedObjective:
    """The pipeline schedule's loss for ``objective`` (scaled by ``scale()`` for fp16), keeping
    each micro-batch's metrics."""

    def __init__(self, objective: Objective, scale: Callable[[], float]):
        self.objective, self.scale = objective, scale
        self.metrics: list[dict[str, torch.Tensor]] = []
        self.losses: list[torch.Tensor] = []
        """Each call's loss (the objective less lm_z_loss's term), as the logs show it."""

    def __call__(self, out: torch.Tensor, target: torch.Tensor, scaled: bool = True):
        """The objective to run backward on (scaled); unscaled (evaluation): the loss."""
        prep = decode_target(target)
        terms = self.objective.terms(out, prep, None)
        kept = {k: plain(v).detach().float() for k, v in terms.metrics.items()}
        if terms.z_loss is not None:
            kept["z_loss"] = plain(terms.z_loss).detach().float()
        self.metrics.append(kept)
        self.losses.append(plain(terms.loss).detach().float())
        return terms.objective * self.scale() if scaled else terms.loss

    def mean_loss(self, micro_batches: int) -> torch.Tensor:
        """The mean loss of the last ``micro_batches`` calls (on the last stage)."""
        mean = torch.stack(self.losses[-micro_batches:]).mean()
        self.losses = []
        return mean

    def shared_metrics(
        self, names: tuple[str, ...], dims: ParallelDims, device, micro_batches: int
    ) -> dict:
        """The means of the metrics of the last ``micro_batches`` calls (a schedule's first
        step calls the loss once more, to learn the shapes), known on every pipeline rank."""
        out = {}
        kept = self.metrics[-micro_batches:]
        if isinstance(self.objective, LanguageModeling) and self.objective.z_weight:
            names = (*names, "z_loss")  # lm_z_loss's term, logged beside the loss
        for name in names:
            values = [m[name] for m in kept if name in m]
            local = torch.stack(values).mean() if values else torch.zeros((), device=device)
            out[name] = sum_over_pp(local, dims)
        self.metrics = []
        return out


def prepared_batch(
    objective: Objective, micro_batches: list[dict[str, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor, list[Prepared]]:
    """The inputs of every micro-batch and their targets, concatenated in order."""
    preps = [objective.prepare(b) for b in micro_batches]
    inputs = torch.cat([p.inputs for p in preps])
    return inputs, torch.cat([encode_target(p) for p in preps]), preps
