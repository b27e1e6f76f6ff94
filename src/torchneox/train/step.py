"""One optimizer step: the forward and backward passes over a global batch's micro-batches
(or the pipeline schedule over them), then the gradients applied: unscaled, clipped, and
skipped or stopped on when they are not finite.

With a fused optimizer outside fp16 nothing is read back to the host during a step: whether
the loss and gradient norm are finite is decided on the device, where the fused update skips
a non-finite step itself (its ``found_inf``), and the steps are checked against
skip_nonfinite_steps (counted, reported, stopped on) when they are settled: every
``settle_every`` steps (the log interval), before a save, and when a step's values are read.
fp16's dynamic loss scale and the other optimizers decide on the host each step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from torchneox.base.errors import TrainingStopped
from torchneox.base.faults import fault_fires, fault_point
from torchneox.config.features.curriculum import Curriculum
from torchneox.data.loader import Batch
from torchneox.models.lora import adapters_off
from torchneox.models.mixers.attention import documents
from torchneox.models.moe import MoE
from torchneox.optim.builder import clip_grad_norm, shard_gradients_like_parameters
from torchneox.parallel.collectives import (
    mean_over_dp,
    plain,
    sum_over_dp,
    sum_over_pp,
    sum_router_stats,
)
from torchneox.parallel.context_parallel import gather_sequence, split_sequence
from torchneox.parallel.data_parallel import set_gradient_sync
from torchneox.parallel.dims import ParallelDims
from torchneox.parallel.expert_parallel import sync_expert_gradients
from torchneox.parallel.parallelize import ParallelModel
from torchneox.parallel.pipeline import evaluate_pipeline
from torchneox.parallel.tensor_parallel import loss_context, placed_like
from torchneox.reporting.metrics import Timers
from torchneox.train.batch import cut, text_span, to_device
from torchneox.train.loss import lm_loss
from torchneox.train.objectives import DocumentMasked, LanguageModeling, Objective
from torchneox.train.pipelined import (
    PipelinedObjective,
    StageRouters,
    context_split,
    prepared_batch,
    reference_logp,
)
from torchneox.train.precision import LossScaler, autocast
from torchneox.train.soft_prompt import before_text


@dataclass
class GradientPolicy:
    """How gradients are applied: clipped to ``clip`` (0: not clipped); non-finite ones, outside
    fp16 (whose loss scaler skips them), skipped up to ``skip_nonfinite_steps`` times."""

    clip: float
    skip_nonfinite_steps: int


class StepValues(Mapping):
    """A step's logged values (``lm_loss``, ``lr``, ``grad_norm``, ``skipped`` and the
    objective's metrics), read from the device together on first use, after the pending steps
    are settled (so a value read is one the skip policy has seen)."""

    def __init__(
        self, known: dict[str, float], lazy: dict[str, torch.Tensor], settle: Callable[[], None]
    ):
        self._known, self._lazy, self._settle = known, lazy, settle
        self._values: dict[str, float] | None = None

    def _read(self) -> dict[str, float]:
        if self._values is None:
            self._settle()
            names = list(self._lazy)
            read = [plain(self._lazy[n]).detach().double().reshape(()) for n in names]
            values = torch.stack(read).tolist() if read else []
            self._values = self._known | dict(zip(names, values, strict=True))
        return self._values

    def __getitem__(self, name: str) -> float:
        return self._read()[name]

    def __iter__(self) -> Iterator[str]:
        return iter([*self._known, *self._lazy])

    def __len__(self) -> int:
        return len(self._known) + len(self._lazy)


class Gradients:
    """The half of a step that produces gradients: each micro-batch forward and backward (or
    the pipeline schedule over them), with the reference model's outputs, the router
    statistics and the objective's metrics; and the evaluation losses, the same way without
    backward. ``scale``: the loss scale the backward runs at (fp16's, else 1)."""

    def __init__(
        self,
        parts: ParallelModel,
        objective: Objective,
        dims: ParallelDims,
        device: torch.device,
        precision: str,
        grad_accum: int,
        timers: Timers,
        scale: Callable[[], float],
    ):
        self.parts, self.objective, self.dims = parts, objective, dims
        self.device, self.precision, self.grad_accum = device, precision, grad_accum
        self.timers, self.scale = timers, scale
        self.moe_layers = [m for m in parts.model.modules() if isinstance(m, MoE)]
        self.pipelined = PipelinedObjective(objective, scale)
        self.pipeline_metrics: dict[str, torch.Tensor] = {}
        self.moe_counts: list[torch.Tensor] = []  # this step's tokens per expert, per MoE layer
        self.routers = None  # a pipeline's MoE layers: their statistics, stage by stage
        args = parts.model.args
        if parts.pipeline is not None and args.moe_num_experts > 1:
            layers = sum(args.is_moe_layer(i) for i in range(args.num_layers))
            layers += args.mtp_depth * args.is_moe_layer(args.num_layers - 1)  # MTP's blocks
            aux_weight = getattr(objective, "aux_weight", 0.0)
            self.routers = StageRouters(self, parts.pipeline.parts, aux_weight, layers)
        self.curriculum: Curriculum | None = None  # curriculum_learning: each step's length
        self.whole: Any = None  # the micro-batch being run, whole (``_prepare``)

    def __call__(
        self, iteration: int, micro_batches: list[Batch]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Accumulate one global batch's gradients in the model. Returns its loss (the mean
        over the micro-batches and the data-parallel ranks) and its other logged values, each
        averaged the same way."""
        sums: dict[str, torch.Tensor] = {}
        if self.curriculum is not None:  # GPT-NeoX's forward_step: tokens, labels, mask cut
            micro_batches = [cut(b, self.curriculum.length(iteration)) for b in micro_batches]
        self.moe_counts = [
            torch.zeros(m.num_experts, dtype=torch.long, device=self.device)
            for m in self.moe_layers
        ]
        if self.parts.pipeline is not None:
            total = self._pipeline_batch(micro_batches, train=True) * self.grad_accum
            for name, value in self.pipeline_metrics.items():
                sums[name] = value * self.grad_accum
            if self.routers is not None:
                index = {id(m): i for i, m in enumerate(self.moe_layers)}
                aux = self.routers.collect(self.grad_accum, self.moe_counts, index)
                sums["moe_aux_loss"] = aux * self.grad_accum
        else:
            total = torch.zeros((), device=self.device)
            for m, tokens in enumerate(micro_batches):
                total += self.forward_backward(tokens, m == len(micro_batches) - 1, sums)
        if self.dims.ep > 1:
            replicas = self.dims.axis("expert_replicas")
            sync_expert_gradients(self.parts.model, replicas, self.dims.batch_ranks)
        fault_point("step.backward", iteration)
        total = self._faults(iteration, total)
        loss = mean_over_dp(total / self.grad_accum, self.dims)
        return loss, self.averaged_metrics(sums)

    def _faults(self, iteration: int, total: torch.Tensor) -> torch.Tensor:
        """The guards' tests (base/faults.py): a spike (the loss and gradients x 1000) or one
        bit of the first gradient flipped."""
        grads = [p.grad for p in self.parts.model.parameters() if p.grad is not None]
        if fault_fires("step.backward", iteration, "spike"):
            torch._foreach_mul_(grads, 1000.0)
            return total * 1000.0
        if fault_fires("step.backward", iteration, "flip") and grads:
            first = grads[0].to_local() if hasattr(grads[0], "to_local") else grads[0]
            first.view(-1)[:1].view(torch.uint8)[0] ^= 1  # the lowest bit of its first value
        return total

    def _autocast(self):
        return autocast(self.precision, self.device.type)

    def _loss_context(self):
        return loss_context(self.dims.tp > 1)

    # ------------------------------------------------------------------ forward/backward

    def _prepare(self, batch: Batch) -> Any:
        """The objective's micro-batch, with context parallelism this rank's part of it (the
        whole one kept in ``self.whole`` for an objective of whole sequences)."""
        prep = self.whole = self.objective.prepare(batch)
        if self.dims.cp > 1:
            args = self.parts.model.args
            if args.soft_prompt_tokens:  # the prompt's positions first, then split
                prep = before_text(prep, args.soft_prompt_tokens, args.seq_length, 2 * self.dims.cp)
            prep = split_sequence(prep, self.dims.mesh["cp"])
        return prep

    def _mtp_inputs(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the model takes for multi-token prediction in training (nothing without)."""
        return {"mtp_tokens_BT": inputs} if getattr(self.objective, "mtp_depth", 0) else {}

    def _terms(self, out: torch.Tensor, prep: Any, stats: Any = None, placed: Any = None) -> Any:
        """The objective's terms. Under context parallelism language modelling takes each
        rank's tokens; the post-training objectives (sums over a whole sequence, a reward
        model's last position) take the outputs gathered whole (``gather_sequence``), every
        context rank computing the same terms: the logged loss and metrics are each rank's
        1/cp share of them, as the reductions over the context ranks add the shares."""
        reference = self._reference(prep)
        objective = getattr(self.objective, "inner", self.objective)
        if self.dims.cp == 1 or isinstance(objective, LanguageModeling):
            return self.objective.terms(out, prep, reference, stats, placed)
        mesh, context, cp = self.dims.mesh["cp"], prep.context, self.dims.cp
        out = gather_sequence(out, context, mesh)
        if reference is not None:
            reference = gather_sequence(reference, context, mesh)
        n = self.parts.model.args.soft_prompt_tokens  # (the prompt's outputs, before the text)
        text = text_span(n, prep.text)  # (then the padding)
        out, reference = out[:, text], None if reference is None else reference[:, text]
        terms = self.objective.terms(out, self.whole, reference, stats, placed)
        terms.loss = terms.loss / cp
        terms.metrics = {k: v / cp for k, v in terms.metrics.items()}
        return terms

    def _forward(self, batch: Batch, sums: dict) -> Any:
        prep = self._prepare(batch)
        stats = whole = None
        # (context parallelism: the whole sequence's inputs, for the tokens ahead)
        kwargs = prep.model_inputs() | self._mtp_inputs((prep.whole or prep).inputs)
        if self.moe_layers:
            out, stats = self.parts.module(prep.inputs, router_stats=True, **kwargs)
            # the load-balancing loss sees the whole batch: the router statistics summed
            # over the ranks that split it (one process's loss, in any layout)
            whole = stats
            if self.dims.batch_ranks > 1:
                whole = [sum_router_stats(s, self.dims.batch_mesh) for s in stats]
        else:
            out = self.parts.module(prep.inputs, **kwargs)
        terms = self._terms(out, prep, whole, placed_like)
        for name in ("z_loss", "moe_aux_loss"):
            value = getattr(terms, name)
            if value is not None:
                sums[name] = sums.get(name, 0) + value
        for name, value in terms.metrics.items():
            sums[name] = sums.get(name, 0) + plain(value).detach().float()
        for i, s in enumerate(stats or []):
            self.moe_counts[i] += s.tokens_per_expert
        return terms

    @torch.no_grad()
    def update_router_bias(self) -> None:
        """DeepSeek-V3's router bias moved by this step's load, the same on every rank: each
        layer's tokens per expert summed over the ranks that split the batch."""
        layers = [i for i, m in enumerate(self.moe_layers) if m.router_bias is not None]
        if not layers or not self.moe_counts:
            return
        load = torch.stack([self.moe_counts[i] for i in layers])
        if self.dims.batch_ranks > 1:
            load = sum_over_dp(load, self.dims)
        for i, layer_load in zip(layers, load, strict=True):
            self.moe_layers[i].update_router_bias(layer_load)

    @torch.no_grad()
    def _reference(self, prep: Any) -> torch.Tensor | None:
        """The frozen reference model's output on the micro-batch, when the objective needs it."""
        if not self.objective.needs_reference:
            return None
        if self.parts.reference is None:  # lora: the policy's base, its adapters left out
            with adapters_off(self.parts.model):
                return self.parts.module(prep.inputs, **prep.model_inputs())
        return self.parts.reference(prep.inputs, **prep.model_inputs())

    def forward_backward(self, batch: Batch, last: bool, sums: dict) -> torch.Tensor:
        batch = to_device(batch, self.device)
        set_gradient_sync(self.parts.module, last)
        with self._loss_context():
            with self.timers("forward"), self._autocast():
                terms = self._forward(batch, sums)
            with self.timers("backward"):
                (terms.objective * (self.scale() / self.grad_accum)).backward()
        return plain(terms.loss.detach())

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss the pipeline schedule runs backward on (scaled for fp16): language
        modelling on the next tokens, or (a float target) the post-training objective."""
        if target.is_floating_point():
            return self.pipelined(logits, target)
        # (a soft prompt's model scores the text it kept: seq_length less the prompt)
        return lm_loss(logits, target[:, : logits.shape[1]], None) * self.scale()

    def _documents(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """inter_document_attention_masking: each token's document and its position in it,
        the model's inputs beside the tokens on every stage (the schedules cut them into the
        micro-batches as they cut the tokens)."""
        if not isinstance(self.objective, DocumentMasked):
            return {}
        positions, segments = documents(inputs, self.objective.eod_id)
        return {"positions_BT": positions, "segments_BT": segments}

    def _pipeline_inputs(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, ...]:
        """The pipeline's input and target for a global batch (``_pipeline_tensors``), the
        model's other inputs (``_documents``) and the last stage's (MTP's tokens ahead: the
        whole sequences'), each context rank's part of the sequences in every stage."""
        inputs, target, preps = self._pipeline_tensors(micro_batches)
        extra, ahead = self._documents(inputs), self._mtp_inputs(inputs)
        if self.dims.cp > 1:
            pipelines = [p for p in (self.parts.pipeline, self.parts.reference_pipeline) if p]
            self.pipelined.mesh = mesh = self.dims.mesh["cp"]
            self.pipelined.prompt = self.parts.model.args.soft_prompt_tokens
            self.pipelined.text = preps[0].text if preps else None
            inputs, target, extra, self.pipelined.context = context_split(
                inputs, target, extra, pipelines, mesh
            )
        if preps and self.objective.needs_reference:
            labels = torch.cat([p.labels for p in preps])
            logp = reference_logp(self, inputs, labels, extra)
            if logp is not None:  # (the last stage: the one that computes the loss)
                target[..., 3] = logp
        return inputs, target, extra, ahead

    def _pipeline_tensors(self, micro_batches: list[Batch]) -> tuple[torch.Tensor, ...]:
        """Tokens and next tokens; or (post-training, a loss mask, lm_z_loss's or MTP's terms,
        a soft prompt before context-split text) the micro-batches prepared, their target a
        float tensor (``encode_target``), and the ``Prepared`` of each."""
        objective = getattr(self.objective, "inner", self.objective)  # (under DocumentMasked)
        lm = objective if isinstance(objective, LanguageModeling) else None
        plain_lm = lm is not None and lm.eod_id is None and not lm.z_weight and not lm.mtp_depth
        args = self.parts.model.args
        prompt = args.soft_prompt_tokens if self.dims.cp > 1 else 0
        if not isinstance(micro_batches[0], dict) and plain_lm and not prompt:
            tokens = torch.cat(micro_batches).to(self.device, non_blocking=True)
            return tokens[:, :-1], tokens[:, 1:], []
        batches = [to_device(b, self.device) for b in micro_batches]
        return prepared_batch(objective, batches, prompt, args.seq_length, 2 * self.dims.cp)

    def _pipeline_batch(self, micro_batches: list[Batch], train: bool) -> torch.Tensor:
        """One global batch through the pipeline; the mean loss, known on every rank (the
        objective's metrics in ``self.pipeline_metrics``)."""
        p = self.parts.pipeline
        if p.shared is not None:  # zbv's copy of the embedding on the first rank: its values
            p.shared.refresh()
        with self._loss_context(), self._autocast():
            inputs, target, extra, ahead = self._pipeline_inputs(micro_batches)
            cp = self.dims.cp  # (a context rank's loss: its tokens' mean / cp, or its share)
            if not train:
                loss_fn = lambda out, y, _: lm_loss(out, y[:, : out.shape[1]], None) / cp  # noqa: E731
                if target.is_floating_point():
                    loss_fn = lambda out, y, _: self.pipelined(out, y, scaled=False)  # noqa: E731
                local = evaluate_pipeline(
                    p, inputs, target, self.grad_accum, self.dims.mesh["pp"], loss_fn, kwargs=extra
                )
                self._share_pipeline_metrics()
                return sum_over_pp(local, self.dims)  # (only the last stage adds a loss)
            losses: list[torch.Tensor] = []
            args = (inputs,) if p.has_first else ()
            kwargs = {"target": target, "losses": losses} if p.has_last else {}
            if p.has_last:  # the last stage's MTP modules embed the tokens ahead
                kwargs |= ahead
            p.reschedule(tuple(inputs.shape))
            with self.timers("pipeline"):
                p.schedule.step(*args, **extra, **kwargs)
        local = torch.zeros((), device=self.device)
        if p.has_last and target.is_floating_point():  # the objective's loss, as logged
            local = self.pipelined.mean_loss(self.grad_accum)  # (a context rank's share)
        elif p.has_last:
            local = torch.stack([plain(x).detach().float() for x in losses]).mean()
            local = local / (self.scale() * self.dims.cp)  # cp: its tokens' share
        self._share_pipeline_metrics()
        return sum_over_pp(local, self.dims)

    def _share_pipeline_metrics(self) -> None:
        names, gas = self.objective.metric_names, self.grad_accum
        self.pipeline_metrics = self.pipelined.shared_metrics(names, self.dims, self.device, gas)

    def averaged_metrics(self, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The step's other logged values, each a mean over the data-parallel ranks: the MoE
        balancing loss, the z-loss, the objective's metrics (as GPT-NeoX averages them)."""
        out = {}
        if self.moe_layers or self.routers is not None:
            aux = sums.get("moe_aux_loss", torch.zeros((), device=self.device))
            out["moe_aux_loss"] = mean_over_dp(aux / self.grad_accum, self.dims)
        if "z_loss" in sums:  # lm_z_loss is set
            out["z_loss"] = mean_over_dp(sums["z_loss"] / self.grad_accum, self.dims)
        for name, value in sums.items():
            if name not in ("z_loss", "moe_aux_loss"):
                out[name] = mean_over_dp(value / self.grad_accum, self.dims)
        return out

    # ------------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def eval_losses(self, micro_batches: list[Batch]) -> list[dict[str, torch.Tensor]]:
        """The loss (and the objective's metrics) of each micro-batch of a global batch (one
        mean for a pipeline)."""
        if self.parts.pipeline is not None:
            loss = self._pipeline_batch(micro_batches, train=False)
            # (evaluation scores the next token only: no MTP term)
            kept = {k: v for k, v in self.pipeline_metrics.items() if not k.startswith("mtp_")}
            return [{"lm_loss": loss, **kept}]
        values = []
        for batch in micro_batches:
            prep = self._prepare(to_device(batch, self.device))
            with self._loss_context(), self._autocast():
                out = self.parts.module(prep.inputs, **prep.model_inputs())
                terms = self._terms(out, prep)
            row = {"lm_loss": plain(terms.loss)}
            values.append(row | {k: plain(v).float() for k, v in terms.metrics.items()})
        return values


class Update:
    """The half of a step that applies the gradients: unscaled, clipped, checked for
    non-finite values (skipped up to skip_nonfinite_steps, or the run stopped naming the last
    good checkpoint), then the optimizer's step; and the deferred checks of the steps whose
    values stayed on the device (``settle``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: LossScaler,
        policy: GradientPolicy,
        precision: str,
        pp_group: Any,
        line: Callable[[str], None],
        last_good: Callable[[], str],
        settle_every: int | None = 1,
        read_back: bool = True,
    ):
        self.model, self.optimizer, self.scaler, self.policy = model, optimizer, scaler, policy
        self.precision, self.pp_group = precision, pp_group
        self.line, self.last_good = line, last_good
        self.settle_every, self.read_back = settle_every, read_back
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # unchecked steps
        self.stage_shared: Any = None
        """A pipeline's parameters held by several stages (parallel/pipeline.StageShared)."""

    @property
    def deferred(self) -> bool:
        """Whether the step's checks wait on the device: the fused update can skip a step
        there (every group fused: a loaded optimizer state brings its groups' flags); fp16's
        loss scale is decided on the host. Always without ``read_back`` (the dry run)."""
        return (self.precision != "fp16" and self._fused) or not self.read_back

    @property
    def _fused(self) -> bool:
        return all(g.get("fused") for g in self.optimizer.param_groups)

    def __call__(
        self, iteration: int, lr: float, loss: torch.Tensor
    ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Apply the accumulated gradients at ``lr``; the step's values known on the host
        and those left on the device (read when first used)."""
        for group in self.optimizer.param_groups:  # muP's groups: their own share of it
            group["lr"] = lr * group.get("lr_scale", 1.0)
        known: dict[str, float] = {"lr": lr}
        lazy: dict[str, torch.Tensor] = {}
        if self.deferred:
            norm, skipped = self._apply_on_device(iteration, loss)
            lazy = {"lm_loss": loss, "grad_norm": norm, "skipped": skipped}
        else:
            value = loss.item()
            bad = _nonfinite(loss=value)
            grad_norm, skipped_now = self.apply_gradients(iteration, bad)
            known |= {"lm_loss": value, "grad_norm": grad_norm, "skipped": float(skipped_now)}
        if self.settle_every and iteration % self.settle_every == 0:
            self.settle()
        return known, lazy

    def _apply_on_device(
        self, iteration: int, loss: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and apply the gradients with no read-back: the fused update skips the step
        where the loss or the norm is not finite. The norm and the skip flag, on the device.
        (An unfused optimizer comes here only in the dry run, which never reads either.)"""
        norm = self.clip_gradients()  # where the gradients are (host memory under offload)
        bad = (~torch.isfinite(loss.float().to(norm.device)) | ~torch.isfinite(norm)).float()
        if self._fused:
            self.optimizer.found_inf = bad  # read by the fused kernel: 1 leaves weights, state
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        norm, bad = norm.to(loss.device), bad.to(loss.device)  # read with the loss
        self.pending.append((iteration, loss, norm))
        return norm, bad

    def settle(self) -> None:
        """Check the pending steps, in order, against the skip policy: a non-finite one is
        counted and reported, or (its allowance used up) the run stops naming it."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        read = torch.stack([torch.stack([plain(x).double(), n.double()]) for _, x, n in pending])
        for (iteration, _, _), (loss, norm) in zip(pending, read.tolist(), strict=True):
            bad = _nonfinite(loss, norm)
            if bad is not None:
                self._skip_or_stop(iteration, bad)
            self.scaler.update(bad is not None)

    def clip_gradients(self) -> torch.Tensor:
        """Unscale the gradients and clip them; their norm before clipping (not read back)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        shard_gradients_like_parameters(params)
        repeated: frozenset[int] = frozenset()
        if self.stage_shared is not None:  # copies on several stages: their gradients summed
            self.stage_shared.sync()
            repeated = frozenset(self.stage_shared.repeated)
        if self.scaler.scale != 1.0:
            torch._foreach_div_([p.grad for p in params], self.scaler.scale)
        clip = self.policy.clip
        return clip_grad_norm(params, clip if clip > 0 else float("inf"), self.pp_group, repeated)

    def apply_gradients(self, iteration: int, bad: str | None) -> tuple[float, bool]:
        """Unscale, clip and apply the gradients; returns the gradient norm and whether the step
        was skipped. Non-finite values: in fp16 the loss scaler skips the step and lowers the
        scale; otherwise up to skip_nonfinite_steps steps are skipped, then the run stops."""
        norm = self.clip_gradients().item()
        bad = bad or _nonfinite(norm=norm)
        if bad is not None and self.precision != "fp16":
            self._skip_or_stop(iteration, bad)
        overflow = bad is not None
        if not overflow:
            self.optimizer.step()
        self.scaler.update(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        return norm, overflow

    def _skip_or_stop(self, iteration: int, bad: str) -> None:
        limit = self.policy.skip_nonfinite_steps
        if self.scaler.skipped >= limit:
            more = (
                f" (the {limit} skips allowed by skip_nonfinite_steps are used up)"
                if limit
                else " (skip_nonfinite_steps lets a run skip such steps instead)"
            )
            raise TrainingStopped(
                f"step {iteration}: {bad}{more}; stopping without applying it ({self.last_good()})"
            )
        self.line(
            f"step {iteration}: {bad}; step skipped ({self.scaler.skipped + 1} of {limit} "
            "allowed by skip_nonfinite_steps)"
        )


class TrainStep:
    """One optimizer step: ``gradients`` over a global batch, then ``update`` applies them."""

    def __init__(self, gradients: Gradients, update: Update, check: Any = None):
        self.gradients, self.update = gradients, update
        self.check = check  # sdc_check_interval: train/guards.py's CorruptionCheck

    def __call__(self, iteration: int, lr: float, micro_batches: list[Batch]) -> StepValues:
        """Train on one global batch and apply the gradients; the step's logged values."""
        loss, metrics = self.checked_gradients(iteration, micro_batches)
        return self.apply(iteration, lr, loss, metrics)

    def checked_gradients(
        self, iteration: int, micro_batches: list[Batch]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step's gradients; at sdc_check_interval's steps computed twice and compared (a
        mismatch stops this process: with replica groups, its group leaves the quorum)."""
        if self.check is not None and self.check.due(iteration):
            return self.check(iteration, micro_batches, self.gradients)
        return self.gradients(iteration, micro_batches)

    def apply(
        self, iteration: int, lr: float, loss: torch.Tensor, metrics: dict[str, torch.Tensor]
    ) -> StepValues:
        """Apply the gradients accumulated (replica groups: once the quorum committed them)."""
        with self.gradients.timers("optimizer"):
            known, lazy = self.update(iteration, lr, loss)
        self.gradients.update_router_bias()
        if self.gradients.curriculum is not None:
            known = known | {"curriculum_seqlen": self.gradients.curriculum.length(iteration)}
        return StepValues(known, metrics | lazy, self.update.settle)

    def settle(self) -> None:
        self.update.settle()

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.gradients.pipeline_loss(logits, target)

    def eval_losses(self, micro_batches: list[Batch]) -> list[dict[str, torch.Tensor]]:
        return self.gradients.eval_losses(micro_batches)


def _nonfinite(loss: float = 0.0, norm: float = 0.0) -> str | None:
    """What is not finite in a step (the loss first), as its messages say it; None if both are."""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if not math.isfinite(norm):
        return f"the gradient norm is {norm}"
    return None
