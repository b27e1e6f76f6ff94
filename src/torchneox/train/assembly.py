"""The one builder of a run's model and step, used by the trainer and by the dry run's
rehearsal (``estimate/rehearsal.py``), so that what the dry run builds and steps is what training
builds and steps.

``build_run`` builds the model (and the reference) shard by shard (``parallel/parallelize.py``)
with its objective; ``add_step`` then builds what trains it: the optimizer, the learning-rate
schedule, and the step with its two halves, the gradients and the update. Between the two the
dry run gives its meta-device model fake storage; training has materialised it already."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from torchneox.config.derived import Derived
from torchneox.config.features.curriculum import curriculum
from torchneox.config.features.fp8_plan import FP8Plan
from torchneox.config.features.offload import offload_spec
from torchneox.config.layout import Layout
from torchneox.config.load import LoadedConfig
from torchneox.models.args import ModelArgs
from torchneox.optim.builder import build_optimizer
from torchneox.optim.lr import Schedule
from torchneox.parallel.dims import ParallelDims
from torchneox.parallel.parallelize import (
    BuildOptions,
    ParallelModel,
    build_parallel_model,
    build_reference,
)
from torchneox.reporting.metrics import Timers
from torchneox.train.guards import CorruptionCheck
from torchneox.train.objectives import Objective, objective_for
from torchneox.train.precision import LossScaler, choose_cpu_attention
from torchneox.train.step import GradientPolicy, Gradients, TrainStep, Update


@dataclass
class Run:
    """One rank's run: its layout and process groups, the model and what trains it."""

    loaded: LoadedConfig
    derived: Derived
    layout: Layout
    dims: ParallelDims
    device: torch.device
    args: ModelArgs
    scaler: LossScaler
    objective: Objective
    parts: ParallelModel = field(init=False)
    optimizer: torch.optim.Optimizer | None = None
    schedule: Schedule | None = None
    step: TrainStep | None = None

    @property
    def precision(self) -> str:
        return self.derived["precision"]


def build_run(
    loaded: LoadedConfig,
    derived: Derived,
    layout: Layout,
    dims: ParallelDims,
    device: torch.device,
    init: Collection[str] | None,
    eod_id: int | None,
    fp8: FP8Plan | None = None,
    compile_scope: str | None = None,
) -> Run:
    """The run's model on this rank, built on the meta device, parallelized, then its shards
    materialised on ``device`` with the ``init`` parameters drawn (None: all); the reference
    model beside it when the objective needs one. ``eod_id``: the tokenizer's end of document
    where the loss or the attention masks at it; ``compile_scope``: what torch.compile
    covers (None: as derived; the dry run passes "off", fake tensors cannot run compiled
    code)."""
    cfg, d = loaded.config, derived
    torch.manual_seed(cfg.training.seed)
    args = ModelArgs.from_config(cfg, d["padded_vocab_size"])
    scaler = LossScaler.from_config(cfg.precision, d["precision"])
    run = Run(loaded, d, layout, dims, device, args, scaler, objective_for(cfg, eod_id))
    options = BuildOptions(
        seed=cfg.training.seed,
        reduce_dtype=d["gradient_reduce_dtype"],
        param_dtype=d["zero_param_dtype"],
        fp8=fp8,
        compile_scope=d["compile"] if compile_scope is None else compile_scope,
        offload=offload_spec(cfg.optimizer.zero_optimization, cfg.optimizer.optimizer),
    )

    def pipeline_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert run.step is not None, "the pipeline runs after add_step"
        return run.step.pipeline_loss(logits, target)

    run.parts = build_parallel_model(args, dims, layout, device, options, pipeline_loss, init)
    t = cfg.training
    choose_cpu_attention(
        run.parts.model,
        cfg.precision.cpu_attention,
        args,
        (layout.micro_batch, cfg.model.seq_length),
        cfg.model.inter_document_attention_masking or t.train_impl != "normal",
        dims,
        d["precision"],
        device,
    )
    if run.objective.needs_reference and not args.lora_rank:  # lora's: the policy's base
        run.parts.reference, run.parts.reference_pipeline = build_reference(
            args, dims, layout, device
        )
    return run


def add_step(
    run: Run,
    timers: Timers,
    line: Callable[[str], None],
    last_good: Callable[[], str],
    settle_every: int | None,
    read_back: bool = True,
) -> None:
    """The optimizer over the run's parameters, the learning-rate schedule and the step.
    ``settle_every``: the steps between the checks of values left on the device (None: only
    when asked); ``read_back=False`` keeps every check on the device (the dry run: fake
    tensors have no values to read)."""
    cfg, d = run.loaded.config, run.derived
    run.optimizer = build_optimizer(run.parts.model, cfg.optimizer, run.device.type, run.args.mup)
    run.schedule = Schedule.from_config(cfg.lr, d)
    gradients = Gradients(
        run.parts,
        run.objective,
        run.dims,
        run.device,
        run.precision,
        run.layout.gas,
        timers,
        lambda: run.scaler.scale,
    )
    gradients.curriculum = curriculum(cfg)
    pp_group: Any = run.dims.mesh["pp"].get_group() if run.parts.pipeline is not None else None
    update = Update(
        run.parts.model,
        run.optimizer,
        run.scaler,
        GradientPolicy(d["gradient_clipping"], cfg.training.skip_nonfinite_steps),
        run.precision,
        pp_group,
        line,
        last_good,
        settle_every,
        read_back,
    )
    if run.parts.pipeline is not None:
        update.stage_shared = run.parts.pipeline.shared
    check = None
    if cfg.guards.sdc_check_interval:
        interval = cfg.guards.sdc_check_interval
        check = CorruptionCheck(interval, run.parts.model, run.dims, run.device, last_good)
    run.step = TrainStep(gradients, update, check)
