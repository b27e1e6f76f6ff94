"""Post-training through a pipeline: the objective as the schedule's loss on the last stage.

A pipeline schedule splits its input and its target along the batch into micro-batches and
calls the loss with one micro-batch's output and target. A post-training micro-batch is
prepared as the loop prepares it (for pairs: its chosen rows, then its rejected ones), the
micro-batches concatenated in order, so each chunk the schedule cuts is one micro-batch; the
target carries, per position, the label, the loss mask, KTO's reward (reinforce's advantage),
the reference's log-probability (computed first by a forward-only pass of the reference's own
pipeline), reinforce's raw reward and its sampling policy's log-probability.
The objective's metrics are kept on the last stage, then shared with the other stages.

With context parallelism every stage runs this rank's chunks of each sequence
(``context_split``) while the target stays whole: language modelling scores the rank's own
positions (its share of the micro-batch's loss, the tokens ahead read from the whole target for
MTP), the other objectives (sums over a sequence, a reward model's one position) the outputs
gathered whole, as the loop does without stages.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch

from torchneox.models.lora import adapters_off
from torchneox.models.mixers.attention import ContextShard
from torchneox.models.moe import MoE, RouterStats, balancing_loss
from torchneox.parallel.collectives import plain, sum_over_pp, sum_router_stats
from torchneox.parallel.context_parallel import gather_sequence, part_of, stage_shard
from torchneox.parallel.dims import ParallelDims
from torchneox.parallel.pipeline import evaluate_pipeline
from torchneox.train.batch import past_prompt, text_span
from torchneox.train.loss import kept_logp
from torchneox.train.objectives import LanguageModeling, Objective, Prepared
from torchneox.train.soft_prompt import before_text


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
        self.context: ContextShard | None = None
        """Context parallelism: the step's split (``context_split``), over ``mesh``."""
        self.mesh = None
        self.prompt = 0
        """Context parallelism with a soft prompt: its tokens, placeholders before the text in
        the target (``before_text``), cut from the gathered outputs before the objective."""
        self.text: int | None = None
        """... and the text's tokens (the padding after them cut too)."""

    def __call__(self, out: torch.Tensor, target: torch.Tensor, scaled: bool = True):
        """The objective to run backward on (scaled); unscaled (evaluation): the loss (under
        context parallelism each rank's share of it, the shares added by the reductions)."""
        terms = self._terms(out, decode_target(target))
        kept = {k: plain(v).detach().float() for k, v in terms.metrics.items()}
        if terms.z_loss is not None:
            kept["z_loss"] = plain(terms.z_loss).detach().float()
        self.metrics.append(kept)
        self.losses.append(plain(terms.loss).detach().float())
        return terms.objective * self.scale() if scaled else terms.loss

    def _terms(self, out, prep: Prepared):
        if self.context is None:
            return self.objective.terms(out, prep, None)
        if isinstance(getattr(self.objective, "inner", self.objective), LanguageModeling):
            return self.objective.terms(out, part_of(prep, self.context), None)
        cp = self.context.ranks  # every context rank computes the whole micro-batch's terms
        out = gather_sequence(out, self.context, self.mesh)
        if self.prompt:
            span = text_span(self.prompt, self.text)
            out, prep = out[:, span], past_prompt(prep, self.prompt, self.text)
        terms = self.objective.terms(out, prep, None)
        terms.loss = terms.loss / cp
        terms.metrics = {k: v / cp for k, v in terms.metrics.items()}
        return terms

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
        inner = getattr(self.objective, "inner", self.objective)  # (under DocumentMasked)
        if isinstance(inner, LanguageModeling) and inner.z_weight:
            names = (*names, "z_loss")  # lm_z_loss's term, logged beside the loss
        for name in names:
            values = [m[name] for m in kept if name in m]
            local = torch.stack(values).mean() if values else torch.zeros((), device=device)
            out[name] = sum_over_pp(local, dims)
        self.metrics = []
        return out


def prepared_batch(
    objective: Objective,
    micro_batches: list,
    prompt: int = 0,
    seq_length: int = 0,
    multiple: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, list[Prepared]]:
    """The inputs of every micro-batch and their targets, concatenated in order; ``prompt``:
    a soft prompt's tokens put before the text (``before_text``: under context parallelism
    the stages run the prompt's positions as the text's, padded to a ``multiple``)."""
    preps = [objective.prepare(b) for b in micro_batches]
    if prompt:
        preps = [before_text(p, prompt, seq_length, multiple) for p in preps]
    inputs = torch.cat([p.inputs for p in preps])
    return inputs, torch.cat([encode_target(p) for p in preps]), preps


def context_split(
    inputs: torch.Tensor, target: torch.Tensor, extra: dict, pipelines: list, mesh
) -> tuple[torch.Tensor, torch.Tensor, dict, ContextShard]:
    """Context parallelism through pipeline stages: this rank's chunks of a step's sequences
    (inputs, next tokens, the documents' positions), the ``ContextShard`` they run under set
    on every stage of ``pipelines`` (the policy's, the reference's). A float target (the
    prepared micro-batches') stays whole: ``PipelinedObjective`` takes its part or gathers."""
    context = stage_shard(inputs.shape[1], mesh, inputs.device)
    for pipeline in pipelines:
        for part in pipeline.parts:
            part.stage_context = context
    index = context.index
    target = target if target.is_floating_point() else target[:, index]
    return inputs[:, index], target, {k: v[:, index] for k, v in extra.items()}, context


class _AuxGradient(torch.autograd.Function):
    """The hidden states unchanged, and the balancing loss ``aux`` given the gradient
    ``scale`` on the way back (Megatron's way of adding a stage's term to a loss that only
    the last stage computes; the schedule then divides every gradient by the micro-batches)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class StageRouters:
    """MoE layers through pipeline stages: each stage's router statistics, taken as its hidden
    states leave it (``Transformer.router_sink``). Per micro-batch: the statistics summed over
    the ranks that split the batch (the stage's data- and context-parallel ranks run the same
    schedule), the stage's balancing losses weighted by ``moe_aux_loss_coeff`` / the model's MoE
    layers into the gradients, and both kept for the logs and the router bias.

    A schedule's first step runs each stage once more, on placeholder inputs, to learn the
    shapes: only the last ``micro_batches`` calls of a step count."""

    def __init__(self, gradients, parts: list, aux_weight: float, moe_layers: int):
        self.gradients, self.aux_weight, self.moe_layers = gradients, aux_weight, moe_layers
        self.calls: list[list[tuple[torch.Tensor, list[torch.Tensor]]]] = [[] for _ in parts]
        for k, part in enumerate(parts):
            part.router_sink = functools.partial(self._sink, k)

    def _sink(self, part: int, hidden: torch.Tensor, stats: list[RouterStats]) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: routed, nothing kept
            return hidden
        dims = self.gradients.dims
        whole = stats
        if dims.batch_ranks > 1:
            whole = [sum_router_stats(s, dims.batch_mesh) for s in stats]
        aux = torch.stack([balancing_loss(s) for s in whole]).sum()
        self.calls[part].append((aux.detach(), [s.tokens_per_expert.detach() for s in stats]))
        if self.aux_weight:
            scale = self.aux_weight * self.gradients.scale() / self.moe_layers
            hidden = _AuxGradient.apply(hidden, aux, scale)
        return hidden

    def collect(
        self, micro_batches: int, counts: list[torch.Tensor], index: dict[int, int]
    ) -> torch.Tensor:
        """Add the step's tokens per expert to ``counts`` (``index``: by a module's id, its place)
        and return the step's mean balancing loss (as the logs show it, every stage's
        layers counted); forget the step's calls."""
        dims = self.gradients.dims
        total = torch.zeros((), device=self.gradients.device)
        for part, calls in zip(self.gradients.parts.pipeline.parts, self.calls, strict=True):
            kept = calls[-micro_batches:] if calls else []  # (a stage without MoE layers)
            layers = [index[id(m)] for m in part.modules() if isinstance(m, MoE)]
            for aux, loads in kept:
                total = total + aux.float()
                for i, load in zip(layers, loads, strict=True):
                    counts[i] += load
            calls.clear()
        local = total / (micro_batches * self.moe_layers * dims.cp)
        return sum_over_pp(local, dims)


def reference_logp(gradients, inputs, labels, extra: dict) -> torch.Tensor | None:
    """The frozen reference's log-probability of each label, by its own pipeline pass (forward
    only; lora's: the policy's stages, their adapters left out), on the last stage (else
    None). Under context parallelism its outputs are gathered whole for the labels."""
    parts, split = gradients.parts, gradients.pipelined
    fp32, context = getattr(gradients.objective, "fp32", True), split.context

    def logp(out: torch.Tensor, y: torch.Tensor, _) -> torch.Tensor:
        if context is not None:
            out = gather_sequence(out, context, split.mesh)
        return kept_logp(out, y, fp32)

    ref = parts.reference_pipeline
    base = adapters_off(parts.model) if ref is None else contextlib.nullcontext()
    with base:
        per_micro_batch = evaluate_pipeline(
            ref or parts.pipeline, inputs, labels, gradients.grad_accum,
            gradients.dims.mesh["pp"], logp, reduce=False, kwargs=extra,
        )  # fmt: skip
    return torch.cat(per_micro_batch) if per_micro_batch else None
