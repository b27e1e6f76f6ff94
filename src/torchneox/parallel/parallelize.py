"""The model a run trains, built so that no rank ever holds more of it than its own part.

Every model (the policy, and DPO's and KTO's reference) is built in four moves:

1. on the meta device: shapes only, no memory;
2. split as the layout says, in torchtitan's fixed order: fp8 swaps, tensor parallel, expert
   parallel, activation checkpointing, compile, then ZeRO (FSDP2) sharding;
3. materialised: each rank allocates only its shards (``to_empty``);
4. initialised where nothing will be loaded: each parameter drawn whole from the generator of
   its name, one parameter at a time, and only this rank's part kept, so every layout starts
   from the weights of a one-process run (``Transformer.init_weights``). A resumed run, a
   converted GPT-NeoX or Hugging Face checkpoint and the reference model draw nothing: their
   weights are loaded (or copied) into the shards afterwards.

ZeRO 0 without tensor or pipeline parallelism is DDP, which replicates the model and broadcasts
rank 0's weights when it wraps it: that model is materialised and initialised first, then
wrapped. With a pipeline each rank builds only its stages' layers the same way
(``pipeline.build_pipeline``)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from torchneox.config.features.fp8_plan import FP8Plan
from torchneox.config.features.offload import Offload
from torchneox.config.layout import Layout
from torchneox.models.args import ModelArgs
from torchneox.models.params import is_drawn, plain_name
from torchneox.models.sharing import tie_layers
from torchneox.models.transformer import Transformer
from torchneox.parallel.activation_ckpt import apply_activation_checkpointing, compile_blocks
from torchneox.parallel.data_parallel import apply_data_parallel, shard_frozen
from torchneox.parallel.dims import ParallelDims
from torchneox.parallel.expert_parallel import apply_expert_parallel
from torchneox.parallel.fp8 import apply_fp8
from torchneox.parallel.pipeline import Pipeline, build_pipeline, share_across_stages
from torchneox.parallel.shards import local_part
from torchneox.parallel.tensor_parallel import apply_tensor_parallel

EVERY_PARAMETER = None
"""``init=EVERY_PARAMETER``: draw every parameter (a run from scratch)."""
NO_PARAMETER: frozenset[str] = frozenset()
"""``init=NO_PARAMETER``: draw none (every weight is loaded or copied afterwards)."""


@dataclass(frozen=True)
class BuildOptions:
    """What the build needs beyond the model's shape and the layout: the seed the weights are
    drawn from, the dtypes ZeRO gathers weights and reduces gradients in, the linears fp8
    covers, and what torch.compile covers (off, blocks or model)."""

    seed: int = 0
    reduce_dtype: str = "fp32"
    param_dtype: str = "fp32"
    fp8: FP8Plan | None = None
    compile_scope: str = "off"
    offload: Offload | None = None
    """ZeRO-Offload: the shards, gradients and optimizer state in host memory (FSDP2's
    CPUOffloadPolicy); the shards are materialised there."""


@dataclass
class Footprint:
    """What building a model costs a rank: its parameters' bytes (its shards) and the largest
    parameter it draws whole to keep a part of it (the build's one temporary)."""

    parameter_bytes: int = 0
    largest_drawn_whole: int = 0


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
    drawn: int = 0
    """How many parameters this rank drew (none when every weight is loaded)."""


def split(
    model: Transformer, dims: ParallelDims, layout: Layout, options: BuildOptions
) -> list[str]:
    """Everything but ZeRO applied to ``model`` in place (on the meta device or not): fp8 swaps
    (first, as torchao asks: the swapped modules are then split), tensor and expert parallel,
    activation checkpointing, compile. Returns the expert parameters (ZeRO leaves them alone)."""
    if options.fp8 is not None:
        apply_fp8(model, options.fp8)
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh["tp"], layout.sequence_parallel)
    # fp8 swaps and tensor parallelism give modules tensors of their own: the sharers take the
    # owner's again, and a soft prompt's model is frozen again but for the prompt
    tie_layers(model)
    model.freeze_for_prompt()
    expert_params: list[str] = []
    if dims.ep > 1:
        expert_params = apply_expert_parallel(model, dims.mesh)
    if layout.checkpoint != "none":
        apply_activation_checkpointing(model, layout.every, layout.checkpoint)
    if options.compile_scope == "blocks":
        compile_blocks(model)
    elif options.compile_scope == "model":  # in place (names unchanged), inside any DDP wrapper
        model.compile()
    return expert_params


def replicated(dims: ParallelDims, layout: Layout) -> bool:
    """Whether data parallelism is DDP (ZeRO 0 without tensor or pipeline parallelism, whose
    DTensor parameters DDP does not take: those run ZeRO 0 as ZeRO 2, with the same results)."""
    return dims.batch_ranks > 1 and layout.zero == 0 and dims.tp == 1 and dims.pp == 1


def shard(
    model: Transformer,
    dims: ParallelDims,
    layout: Layout,
    options: BuildOptions,
    expert_params: list[str],
) -> nn.Module:
    """ZeRO over the data-parallel ranks (a no-op with one, unless it offloads: FSDP2 then
    shards over a mesh of one); returns the module to call."""
    alone = dims.batch_ranks <= 1
    if alone and not offloads(options, layout):
        return model
    # a lone data-parallel rank among tensor or pipeline ranks shards over its axis of the
    # world's mesh (of one): FSDP2 joins it to the tensor-parallel mesh, which a mesh of its own
    # cannot be (DeviceMesh._concatenate wants one root)
    return apply_data_parallel(
        model,
        dims.shard_mesh()
        if dims.mesh is not None
        else init_device_mesh(dims.device_type, (1,), mesh_dim_names=("dp",)),
        layout.zero,
        options.reduce_dtype,
        tensor_parallel=dims.tp > 1 or dims.pp > 1,
        ignored=expert_params,
        param_dtype=options.param_dtype,
        offload=options.offload,
    )


def offloads(options: BuildOptions, layout: Layout) -> bool:
    """Whether ZeRO-Offload applies: asked for, under ZeRO 1-3 (config/features/offload.py)."""
    return options.offload is not None and options.offload.enabled and layout.zero > 0


def materialise(
    model: Transformer,
    device: torch.device,
    seed: int,
    init: Collection[str] | None,
    offload: bool = False,
) -> int:
    """Allocate this rank's part of every parameter on ``device`` (in host memory under
    ``offload``, where FSDP2's CPU offload keeps the shards) and draw those ``init`` names
    (None: all); the position tables are computed on ``device``. Returns how many were
    drawn."""
    host = offload and torch.device(device).type != "meta"  # (the dry run stays on meta)
    model.to_empty(device=torch.device("cpu") if host else device)
    return model.init_weights(device, seed=seed, only=init, part=local_part)


def footprint(model: nn.Module, init: Collection[str] | None = NO_PARAMETER) -> Footprint:
    """The bytes of this rank's parameters and the largest of the ``init`` ones (None: all) that
    drawing them takes whole (the shape's bytes, on the meta device too: what the dry run holds
    to ``estimate``'s build line)."""
    out = Footprint()
    for name, param in model.named_parameters():
        local, where = local_part(param)
        out.parameter_bytes += local.numel() * local.element_size()
        plain = plain_name(name)
        if where is not None and is_drawn(plain) and (init is None or plain in init):
            out.largest_drawn_whole = max(
                out.largest_drawn_whole, param.numel() * local.element_size()
            )
    return out


def build_parallel_model(
    args: ModelArgs,
    dims: ParallelDims,
    layout: Layout,
    device: torch.device,
    options: BuildOptions,
    pipeline_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    init: Collection[str] | None = EVERY_PARAMETER,
) -> ParallelModel:
    """The model of a run on this rank: built on the meta device, split, then its shards
    materialised and the ``init`` parameters drawn (None: all; ``NO_PARAMETER`` when every
    weight will be loaded). With a pipeline: this rank's stages and the schedule that runs them
    with ``pipeline_loss``."""
    if dims.pp > 1:
        drawn = [0]

        def prepare(part: Transformer) -> None:
            shard(part, dims, layout, options, split(part, dims, layout, options))
            drawn[0] += materialise(part, device, options.seed, init, offloads(options, layout))

        pipeline = build_pipeline(args, dims.mesh["pp"], device, layout, pipeline_loss, prepare)
        share_across_stages(pipeline, dims.mesh, args, layout)
        return ParallelModel(pipeline.container, pipeline.container, pipeline, drawn=drawn[0])
    with torch.device("meta"):
        model = Transformer(args)
    expert_params = split(model, dims, layout, options)
    if replicated(dims, layout):  # DDP broadcasts rank 0's weights as it wraps: values first
        drawn = materialise(model, device, options.seed, init)
        return ParallelModel(model, shard(model, dims, layout, options, expert_params), drawn=drawn)
    module = shard(model, dims, layout, options, expert_params)
    drawn = materialise(model, device, options.seed, init, offloads(options, layout))
    return ParallelModel(model, module, drawn=drawn)


def _freeze(model: Transformer, dims: ParallelDims, layout: Layout) -> None:
    """A model that only runs forward, split as the policy is: tensor and expert parallel,
    then sharded over the data-parallel ranks under ZeRO 1-3 (replicated under ZeRO 0)."""
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.mesh["tp"], layout.sequence_parallel)
        tie_layers(model)
    expert_params: list[str] = []
    if dims.ep > 1:
        expert_params = apply_expert_parallel(model, dims.mesh)
    model.requires_grad_(False)
    if dims.batch_ranks > 1 and layout.zero >= 1:
        shard_frozen(model, dims.shard_mesh(), expert_params)
    model.eval()


def build_reference(
    args: ModelArgs, dims: ParallelDims, layout: Layout, device: torch.device
) -> tuple[nn.Module, Pipeline | None]:
    """The frozen reference model of DPO and KTO: the policy's architecture split as the
    policy is (with a pipeline, into the same stages), in eval mode, without gradients (so
    without optimizer state), built on the meta device and materialised shard by shard with
    nothing drawn: its weights are loaded after (the policy's initial ones, or a
    checkpoint's). Returns the model (a pipeline's: the container of its stages) and the
    pipeline."""

    def prepare(part: Transformer) -> None:
        _freeze(part, dims, layout)
        materialise(part, device, 0, NO_PARAMETER)

    if dims.pp > 1:
        pipeline = build_pipeline(args, dims.mesh["pp"], device, layout, None, prepare)
        pipeline.container.requires_grad_(False)
        return pipeline.container.eval(), pipeline
    with torch.device("meta"):
        model = Transformer(args)
    prepare(model)
    return model, None
