"""Pipeline parallelism with torch.distributed.pipelining, for pipe_parallel_size >= 2.

The model is split into contiguous stages (the embedding on the first, the final norm and the
head on the last). Each rank builds only its stages' layers, on the meta device, and
initialises them; because every parameter draws from a generator seeded by its name, the
weights equal those of a one-process run. A rank holds one stage (gpipe, 1f1b) or several
(interleaved_1f1b, looped_bfs, interleaved_zero_bubble: ``pipeline_virtual_stages`` each; zbv:
two, in a V). A ``container`` Transformer holding the rank's layers under their usual names
is what the optimizer and the checkpoints see, so checkpoints stay layout-free.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from torchneox.config.layout import Layout
from torchneox.models.args import ModelArgs
from torchneox.models.transformer import Transformer

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

# each schedule by its torch.distributed.pipelining class, imported only by a pipeline run
# (the module brings torch._dynamo: half a second of every other process's start-up)
SINGLE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
MULTI = {
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


def layer_costs(args: ModelArgs, method: str) -> list[float]:
    """Relative cost of each block ('parameters': its parameter count, as built, whatever its
    family; the embedding and the head are charged by ``stage_layers``)."""
    if method != "parameters":
        return [1.0] * args.num_layers
    from torchneox.models.block import Block

    counts: dict[tuple[str, bool], float] = {}
    for layer in range(args.num_layers):
        kind = (args.layer_type(layer), args.is_moe_layer(layer))
        if kind not in counts:
            with torch.device("meta"):
                counts[kind] = float(sum(p.numel() for p in Block(args, layer).parameters()))
    return [counts[(args.layer_type(i), args.is_moe_layer(i))] for i in range(args.num_layers)]


def stage_layers(args: ModelArgs, num_stages: int, method: str) -> list[range]:
    """Contiguous layer ranges, one per stage, as even in cost as possible (each >= 1 layer)."""
    n = args.num_layers
    assert num_stages <= n, f"{num_stages} stages for {n} layers (check_layout refuses it)"
    costs = layer_costs(args, method)
    first = last = 0.0
    if method == "parameters":
        first = float(args.vocab_size * args.hidden_size)
        last = first
    cumulative = [first]  # (a tied model's last stage holds a copy of the embedding too)
    for c in costs:
        cumulative.append(cumulative[-1] + c)
    total = cumulative[-1] + last
    bounds = [0]
    for k in range(1, num_stages):
        target = total * k / num_stages
        cut = min(range(1, n), key=lambda i: abs(cumulative[i] - target))
        cut = max(cut, bounds[-1] + 1)  # every stage keeps a layer
        cut = min(cut, n - (num_stages - k))  # and leaves one for each later stage
        bounds.append(cut)
    bounds.append(n)
    return [range(bounds[k], bounds[k + 1]) for k in range(num_stages)]


def rank_stage_indices(schedule: str, pp_rank: int, pp_size: int, virtual: int) -> list[int]:
    if schedule in SINGLE:
        return [pp_rank]
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(virtual)]


def stage_module(full_meta: Transformer, layers: range, first: bool, last: bool) -> Transformer:
    """A copy of the meta model keeping only ``layers`` (and the ends it owns: the last stage
    of a tied model keeps a copy of the embedding, its head's weight, as does the last stage
    of a model with MTP modules, which embed the tokens ahead)."""
    part = copy.deepcopy(full_meta)
    for name in list(part.layers):
        if int(name) not in layers:
            del part.layers[name]
    _name_copies(part, layers)
    part.first_stage = first
    if not first:
        if not (last and embeds_on_last(full_meta.args)):
            part.embed = None
        part.pos_embed = None
        part.soft_prompt = None  # (the first stage puts it before the text, the last cuts it)
        part.prompt_passed = last and bool(full_meta.args.soft_prompt_tokens)
    if not last:
        part.final_norm = None
        part.output = None
        part.value_head = None
        part.mtp = None
    return part


def _name_copies(part: Transformer, layers: range) -> None:
    """Layer weight sharing: a layer whose owner is on another stage holds a copy of the
    owner's weights under the owner's name (drawn, stepped, saved and loaded as the owner's;
    ``layer_holders``); later sharers of that owner on the stage are tied to it as usual."""
    owners, named = part.args.layer_owners, {}
    if not owners:
        return
    for name, block in part.layers.items():
        owner = owners[int(name)]
        key = name if owner in layers or str(owner) in named else str(owner)
        named[key] = block
    if list(named) != list(part.layers):
        part.layers = torch.nn.ModuleDict(named)


def layer_holders(args: ModelArgs, layout: Layout, pp_size: int) -> dict[int, list[int]]:
    """Layer weight sharing: each owner layer whose weights more than one pipeline rank holds
    (the owner's stage, its sharers' stages) -> those ranks."""
    owners = args.layer_owners
    if not owners:
        return {}
    virtual = layout.virtual_stages
    per_rank = 2 if layout.schedule == "zbv" else (1 if layout.schedule in SINGLE else virtual)
    ranges = stage_layers(args, pp_size * per_rank, layout.partition_method)
    held: dict[int, set[int]] = {}
    for rank in range(pp_size):
        for index in rank_stage_indices(layout.schedule, rank, pp_size, virtual):
            for layer in ranges[index]:
                held.setdefault(owners[layer], set()).add(rank)
    return {o: sorted(ranks) for o, ranks in held.items() if len(ranks) > 1}


def embeds_on_last(args: ModelArgs) -> bool:
    """Whether the last stage holds a copy of the embedding (its tied head, its MTP modules)."""
    return args.tied_embeddings or args.mtp_depth > 0


@dataclass
class Pipeline:
    container: Transformer
    """The rank's parameters under their usual names (optimizer, checkpoints)."""
    parts: list[Transformer]
    stages: list[PipelineStage]
    schedule: object
    has_first: bool
    has_last: bool
    shared: StageShared | None = None
    """The parameters several stages hold (``share_across_stages``)."""
    make_schedule: Callable[[], object] | None = None
    """A fresh schedule over the same stages (``reschedule``)."""
    shape: tuple[int, ...] | None = None
    """The input shape the schedule last learnt its stages' shapes from."""
    last_rank: int = -1
    """The pipeline rank holding the last stage (zbv's V: the first; else the last rank)."""
    twins: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = field(default_factory=list)
    """(kept, copy): a parameter two stages of this rank hold (``StageShared.twins``): zbv's
    first stage's embedding (the container's) and the last stage's copy (a tied head's, MTP's),
    both on the first rank; the rank's first stage's rpe table and each later stage's."""

    def reschedule(self, shape: tuple[int, ...]) -> None:
        """A schedule learns the shapes its stages pass on at its first step and keeps them;
        a batch of another shape (curriculum learning's growing length) takes a fresh one,
        which learns them again (every rank sees the same shapes, so all switch together)."""
        if self.shape is not None and shape != self.shape and self.make_schedule is not None:
            self.schedule = self.make_schedule()
        self.shape = shape


@dataclass
class StageShared:
    """One parameter held by several pipeline stages, Megatron's way: each holding rank keeps
    a copy, drawn alike (every weight's generator is seeded by its name); the copies'
    gradients are summed over the holders before clipping, so every copy takes the same step
    and stays bitwise equal to the others, and the gradient norm counts it once (on the first
    holder). Checkpoints hold it once (the copies have one name)."""

    params: list[torch.nn.Parameter]
    groups: list[Any]
    """Per parameter: the process group of its holders."""
    repeated: set[int]
    """The ids of this rank's copies the gradient norm leaves out."""
    twins: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = field(default_factory=list)
    """(kept, copy): two stages on this rank holding one parameter (zbv puts the first and the
    last stage on the first rank), the kept one the container's (optimizer, checkpoints); the
    copy's gradient is added to the kept one's, and the copy takes the kept one's values
    before each batch (``refresh``: after a step, a load, an initialisation)."""

    def sync(self) -> None:
        """Each copy's gradient added to its kept parameter's on this rank, then the kept
        ones' summed over their holders."""
        self._add_twins()
        for param, group in zip(self.params, self.groups, strict=True):
            if param.grad is not None:
                torch.distributed.all_reduce(_local(param.grad), group=group)

    def _add_twins(self) -> None:
        from torch.distributed.tensor import DTensor

        for kept, twin in self.twins:
            grad, twin.grad = twin.grad, None
            if grad is None:
                continue
            if kept.grad is None:
                kept.grad = grad
                continue
            if isinstance(grad, DTensor) and grad.placements != kept.grad.placements:
                grad = grad.redistribute(kept.grad.device_mesh, kept.grad.placements)
            _local(kept.grad).add_(_local(grad))

    @torch.no_grad()
    def refresh(self) -> None:
        """Each copy of ``twins`` given its kept parameter's values (this rank's shard)."""
        for kept, twin in self.twins:
            _local(twin).copy_(_local(kept))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def share_across_stages(
    pipeline: Pipeline, mesh: DeviceMesh, args: ModelArgs, layout: Layout
) -> None:
    """Set ``pipeline.shared``: the groups of the ranks holding each parameter more than one
    stage reads (tied embeddings: the first stage's embedding, the last stage's head; rpe's
    table, every layer's; a shared layer's weights, its owner's and its sharers' stages); every
    rank takes part in making them: new process groups are collective."""
    pp_dim = mesh.mesh_dim_names.index("pp")
    rows = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.size(pp_dim)).tolist()
    pp_rank, pp_size = mesh["pp"].get_local_rank(), mesh.size(pp_dim)
    holders = {
        "embed.weight": sorted({0, pipeline.last_rank}) if embeds_on_last(args) else [],
        "rpe.weight": list(range(pp_size)) if args.pos_emb == "rpe" else [],
    }
    for owner, ranks in layer_holders(args, layout, pp_size).items():  # each shared layer's
        holders[f"layers.{owner}."] = ranks
    held = dict(pipeline.container.named_parameters())
    params, groups, repeated, made = [], [], set(), {}
    for prefix, ranks in holders.items():
        if len(ranks) < 2:  # (zbv: the first rank holds both ends, ``twins``)
            continue
        if tuple(ranks) not in made:
            made[tuple(ranks)] = (
                mesh["pp"].get_group()
                if len(ranks) == pp_size
                else torch.distributed.new_subgroups_by_enumeration(
                    [[row[r] for r in ranks] for row in rows]
                )[0]
            )
        for name, param in held.items():
            if pp_rank in ranks and name.startswith(prefix):
                params.append(param)
                groups.append(made[tuple(ranks)])
                if pp_rank != ranks[0]:
                    repeated.add(id(param))
    pipeline.shared = StageShared(params, groups, repeated, pipeline.twins)


def _hold_layers(container: Transformer, part: Transformer) -> list[tuple]:
    """``part``'s blocks into ``container``; a copy of a shared layer that another stage of
    this rank holds already becomes its twins (parameter by parameter)."""
    twins = []
    for name, block in part.layers.items():
        if name in container.layers:
            mine = container.layers[name].parameters()
            twins.extend(zip(mine, block.parameters(), strict=True))
        else:
            container.layers[name] = block
    return twins


def build_pipeline(
    args: ModelArgs,
    pp_mesh: DeviceMesh,
    device: torch.device,
    layout: Layout,
    loss_fn,
    prepare: Callable[[Transformer], Any],
) -> Pipeline:
    """This rank's stages and the schedule that runs them (a layout
    ``config.layout.check_layout`` accepted). Each stage is cut from a meta model and handed
    to ``prepare``, which splits, shards, materialises and initialises it."""
    from torch.distributed.pipelining import PipelineStage, schedules

    schedule, virtual = layout.schedule, layout.virtual_stages
    pp_rank, pp_size = pp_mesh.get_local_rank(), pp_mesh.size()
    per_rank = 2 if schedule == "zbv" else (1 if schedule in SINGLE else virtual)
    total_stages = pp_size * per_rank
    ranges = stage_layers(args, total_stages, layout.partition_method)
    with torch.device("meta"):
        full = Transformer(args)
    indices = rank_stage_indices(schedule, pp_rank, pp_size, virtual)
    container = stage_module(full, range(0), False, False)
    parts, stages, twins = [], [], []
    for index in indices:
        first, last = index == 0, index == total_stages - 1
        part = stage_module(full, ranges[index], first, last)
        prepare(part)
        parts.append(part)
        twins += _hold_layers(container, part)
        if part.rpe is not None and not parts[:-1]:  # every stage's copy of rpe's table
            container.rpe = part.rpe
        elif part.rpe is not None:  # a later stage of this rank: its copy is a twin
            twins.append((container.rpe.weight, part.rpe.weight))
        if first:
            container.embed, container.pos_embed = part.embed, part.pos_embed
            container.soft_prompt = part.soft_prompt
        elif last and part.embed is not None and container.embed is not None:  # zbv: rank 0's
            twins.append((container.embed.weight, part.embed.weight))  # (the first's is kept)
        elif last and part.embed is not None:  # the tied head's or MTP's copy of the embedding
            container.embed = part.embed
        if last:
            container.final_norm, container.output = part.final_norm, part.output
            container.value_head, container.mtp = part.value_head, part.mtp
        stages.append(PipelineStage(part, index, total_stages, device, group=pp_mesh.get_group()))
    kind = getattr(schedules, SINGLE.get(schedule) or MULTI[schedule])

    def make_schedule() -> object:
        given = stages[0] if schedule in SINGLE else stages
        return kind(given, n_microbatches=layout.gas, loss_fn=loss_fn)

    has_first = 0 in indices
    has_last = total_stages - 1 in indices
    # the container is never run: its own position tables stay on the meta device
    return Pipeline(
        container, parts, stages, make_schedule(), has_first, has_last, make_schedule=make_schedule,
        last_rank=0 if schedule == "zbv" else pp_size - 1, twins=twins,
    )  # fmt: skip


def is_multi(schedule: object) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return isinstance(schedule, PipelineScheduleMulti)


@torch.no_grad()
def evaluate_pipeline(
    p: Pipeline,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    microbatches: int,
    pp_mesh: DeviceMesh,
    loss_fn,
    reduce: bool = True,
    kwargs: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor | list[torch.Tensor]:
    """Forward only, stage after stage, micro-batch by micro-batch (the training schedules'
    eval paths are not all usable); the mean loss on the rank holding the last stage, else 0.
    ``reduce=False``: what ``loss_fn`` gave for each micro-batch, on the last stage (else []).
    ``kwargs``: the model's other inputs [B, ...] (document masking's), cut as the inputs."""
    group = pp_mesh.get_group()
    owners = [0] * (p.stages[0].num_stages)
    rank_indices = torch.tensor([s.stage_index for s in p.stages], dtype=torch.long)
    gathered = [torch.zeros(len(p.stages), dtype=torch.long) for _ in range(pp_mesh.size())]
    torch.distributed.all_gather(gathered, rank_indices, group=group)
    for rank, indices in enumerate(gathered):
        for index in indices.tolist():
            owners[index] = rank
    me = pp_mesh.get_local_rank()
    parts = {s.stage_index: part for s, part in zip(p.stages, p.parts, strict=True)}
    losses = []
    extras = {k: v.chunk(microbatches) for k, v in (kwargs or {}).items()}
    chunks = zip(inputs.chunk(microbatches), labels.chunk(microbatches), strict=True)
    for m, (x_in, y) in enumerate(chunks):
        extra = {k: v[m] for k, v in extras.items()}
        hidden = None
        for index in range(len(owners)):
            if owners[index] != me:
                continue
            if index == 0:
                hidden = x_in
            elif owners[index - 1] != me:
                shape = torch.tensor([0, 0, 0], dtype=torch.long)
                torch.distributed.recv(shape, group_src=owners[index - 1], group=group)
                hidden = torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=x_in.device)
                torch.distributed.recv(hidden, group_src=owners[index - 1], group=group)
            hidden = parts[index](hidden, **extra)
            if index == len(owners) - 1:
                losses.append(loss_fn(hidden, y, None))
            elif owners[index + 1] != me:
                out = hidden.float().contiguous()
                torch.distributed.send(
                    torch.tensor(list(out.shape), dtype=torch.long),
                    group_dst=owners[index + 1],
                    group=group,
                )
                torch.distributed.send(out, group_dst=owners[index + 1], group=group)
    if not reduce:
        return losses
    if not losses:
        return torch.zeros((), device=inputs.device)
    return torch.stack(
        [(x.full_tensor() if hasattr(x, "full_tensor") else x).float() for x in losses]
    ).mean()


class PipelineLogits(torch.nn.Module):
    """A pipeline's stages as one module from tokens to logits, the logits known on every
    pipeline rank (forward only, without a cache: ``eval_tasks``'s scoring during training).
    Every pipeline rank calls it with the same tokens, as the harness gives every rank the
    same requests."""

    cacheless = True

    def __init__(self, pipeline: Pipeline, pp_mesh: DeviceMesh, device: torch.device):
        super().__init__()
        self.pipeline, self.pp_mesh, self.device = pipeline, pp_mesh, device
        self.args = pipeline.container.args  # (what sampling reads: positions, soft prompt)

    def train(self, mode: bool = True) -> PipelineLogits:
        self.training = mode
        for part in self.pipeline.parts:
            part.train(mode)
        return self

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, **given: torch.Tensor | None) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        assert given.get("cache") is None, "a pipeline's stages keep no cache"
        kwargs = {k: v for k, v in given.items() if v is not None}

        def keep(out: torch.Tensor, _y, _m) -> torch.Tensor:
            return out.full_tensor() if isinstance(out, DTensor) else out

        contexts = [part.stage_context for part in self.pipeline.parts]
        for part in self.pipeline.parts:  # (whole sequences on every context rank)
            part.stage_context = None
        try:
            kept = evaluate_pipeline(
                self.pipeline, tokens, tokens, 1, self.pp_mesh, keep, reduce=False, kwargs=kwargs
            )
        finally:
            for part, context in zip(self.pipeline.parts, contexts, strict=True):
                part.stage_context = context
        group = self.pp_mesh.get_group()
        shape = torch.zeros(3, dtype=torch.long, device=tokens.device)
        if kept:
            shape += torch.tensor(kept[0].shape, device=tokens.device)
        torch.distributed.all_reduce(shape, group=group)  # (only the last stage's is not 0)
        logits = kept[0].float() if kept else torch.zeros(*shape.tolist(), device=tokens.device)
        torch.distributed.all_reduce(logits, group=group)
        return logits
