"""Parallelism applied to a one-device model from outside, in torchtitan's fixed order: tensor
parallel, expert parallel, activation checkpointing, compile, data parallel; and the model a
run trains, whole or as this rank's pipeline stages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchneox.config.fp8_plan import FP8Plan
from torchneox.config.layout import Layout
from torchneox.models.args import ModelArgs
from torchneox.models.transformer import Transformer, build_model
from torchneox.parallel.activation_ckpt import apply_activation_checkpointing, compile_blocks
from torchneox.parallel.data_parallel import apply_data_parallel, shard_frozen
from torchneox.parallel.dims import ParallelDims
from torchneox.parallel.expert_parallel import apply_expert_parallel
from torchneox.parallel.fp8 import apply_fp8
from torchneox.parallel.pipeline import Pipeline, build_pipeline
from torchneox.parallel.tensor_parallel import apply_tensor_parallel


@dataclass
class ParallelModel:
    """``model``: the parameters (what the optimizer and checkpoints see; with a pipeline, a
    container of this rank's stages); ``module``: what a forward calls; ``pipeline``: the
    stages and their schedule when pipe_parallel_size >= 2."""

    model: nn.Module
    module: nn.Module
    pipeline: Pipeline | None = None
    reference: nn.Module | None = None
    """A frozen copy (DPO, KTO): sharded as the policy is, without gradients or optimizer."""
    reference_pipeline: Pipeline | None = None
    """With a pipeline: the reference's stages (``reference`` is their container)."""


def parallelize(
    model: Transformer,
    dims: ParallelDims,
    layout: Layout,
    training: Any,
    reduce_dtype: Any,
    param_dtype: str = "fp32",
    fp8: FP8Plan | None = None,
    compile_scope: str = "off",
) -> nn.Module:
    """Apply the layout to ``model`` in place; returns the module to call. ``training``: the
    training config group (activation checkpointing, compile); ``param_dtype``: what ZeRO
    (FSDP2) gathers the weights in; ``fp8``: the linears torchao's float8 runs; ``compile_scope``:
    what torch.compile covers (config/layout.py's compile_scope: off, blocks or model)."""
    if fp8 is not None:  # first, as torchao asks: the swapped modules are then sharded
        apply_fp8(model, fp8)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh["tp"], layout.sequence_parallel)
    expert_params: list[str] = []
    if dims.ep > 1:
        expert_params = apply_expert_parallel(model, dims.mesh)
    if training.checkpoint_activations:
        apply_activation_checkpointing(
            model, training.checkpoint_num_layers, training.checkpoint_activations_mode
        )
    if compile_scope == "blocks":
        compile_blocks(model)
    elif compile_scope == "model":  # in place (names unchanged), inside any DDP wrapper
        model.compile()
    if dims.batch_ranks > 1:
        return apply_data_parallel(
            model,
            dims.shard_mesh(),
            layout.zero,
            reduce_dtype,
            tensor_parallel=dims.tp > 1 or dims.pp > 1,  # DDP takes neither
            ignored=expert_params,
            param_dtype=param_dtype,
        )
    return model


def build_parallel_model(
    args: ModelArgs,
    dims: ParallelDims,
    layout: Layout,
    training: Any,
    reduce_dtype: Any,
    device: torch.device,
    partition_method: str,
    pipeline_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    param_dtype: str = "fp32",
    fp8: FP8Plan | None = None,
    compile_scope: str = "off",
) -> ParallelModel:
    """The model of a run, initialised from ``training.seed`` and parallelized; with a
    pipeline, this rank's stages and the schedule that runs them with ``pipeline_loss``."""

    def prepare(model: Transformer) -> nn.Module:
        return parallelize(
            model, dims, layout, training, reduce_dtype, param_dtype, fp8, compile_scope
        )

    if dims.pp > 1:
        pipeline = build_pipeline(
            args,
            dims.mesh["pp"],
            device,
            layout.schedule,
            layout.virtual_stages,
            layout.gas,
            partition_method,
            pipeline_loss,
            training.seed,
            prepare=prepare,
        )
        return ParallelModel(pipeline.container, pipeline.container, pipeline)
    model = build_model(args, device=device, seed=training.seed)
    return ParallelModel(model, prepare(model))


def _freeze(model: Transformer, dims: ParallelDims, layout: Layout) -> None:
    """A model that only runs forward, split as the policy is: tensor and expert parallel,
    then sharded over the data-parallel ranks under ZeRO 1-3 (replicated under ZeRO 0)."""
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh["tp"], layout.sequence_parallel)
    expert_params: list[str] = []
    if dims.ep > 1:
        expert_params = apply_expert_parallel(model, dims.mesh)
    model.requires_grad_(False)
    if dims.batch_ranks > 1 and layout.zero >= 1:
        shard_frozen(model, dims.shard_mesh(), expert_params)
    model.eval()


def build_reference(
    args: ModelArgs,
    dims: ParallelDims,
    layout: Layout,
    device: torch.device,
    seed: int,
    partition_method: str = "parameters",
) -> tuple[nn.Module, Pipeline | None]:
    """The frozen reference model of DPO and KTO: the policy's architecture split as the
    policy is (with a pipeline, into the same stages), in eval mode, without gradients (so
    without optimizer state). Its weights are loaded after (the policy's initial ones, or a
    checkpoint's). Returns the model (a pipeline's: the container of its stages) and the
    pipeline."""
    if dims.pp > 1:
        pipeline = build_pipeline(
            args, dims.mesh["pp"], device, layout.schedule, layout.virtual_stages, layout.gas,
            partition_method, None, seed, prepare=lambda part: _freeze(part, dims, layout),
        )  # fmt: skip
        pipeline.container.requires_grad_(False)
        return pipeline.container.eval(), pipeline
    model = build_model(args, device=device, seed=seed)
    _freeze(model, dims, layout)
    return model, None
