"""One rank of a dry run (see ``dry_run``): the run built as rank r of N builds it, with the
training code itself, on torch's fake process group (collectives return at once) and on fake
tensors (shapes without memory or compute); one fake step (forward, backward, gradient
clipping, the optimizer step) with every collective it calls recorded; and what the rank
holds, measured on the built tensors, beside what ``estimate`` computes for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from torchneox.config.derive import derive
from torchneox.config.layout import Layout
from torchneox.config.load import LoadedConfig
from torchneox.estimate.memory import (
    build_bytes,
    has_prompt,
    hidden_optimizer_bytes,
    optimizer_bytes_per_dim,
    optimizer_bytes_per_param,
    optimizer_bytes_per_tensor,
    state_bytes,
    weight_bytes,
)
from torchneox.estimate.parameters import stage_params

if TYPE_CHECKING:
    from torchneox.train.assembly import Run

AXES = ("pp", "dp", "cp", "tp")
STEPPED = "forward, backward, gradient clipping and the optimizer step ran on fake tensors"


@dataclass(frozen=True)
class Collective:
    op: str
    group: tuple[int, ...]
    """The global ranks of the process group it runs on (sender, receiver for "p2p")."""
    shapes: tuple


@dataclass
class RankReport:
    rank: int
    node: int
    coordinates: dict[str, int]
    stages: list[int]
    layers: list[int]
    holds: list[str]
    """The ends of the model on this rank: "embedding", "head"."""
    tensors: int
    bytes: dict[str, int]
    """Measured: parameters, gradients, optimizer (this rank's shards)."""
    expected: dict[str, int]
    """``estimate``'s for the same stage(s): the shard rank 0 of each group holds."""
    files: list[str]
    step: str
    """What the fake step ran, or why it could not."""
    stepped: bool = False
    """Whether the fake step ran to the end (gradients and optimizer state measured)."""
    collectives: list[Collective] = field(default_factory=list)
    spans: dict[str, int] = field(default_factory=dict)
    """The nodes each axis' process group of this rank spans."""
    seconds: float = 0.0


# ----------------------------------------------------------------------------- the ranks


def mesh_sizes(layout: Layout) -> dict[str, int]:
    return {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}


def rank_of(coordinates: dict[str, int], layout: Layout) -> int:
    """The global rank at ``coordinates`` (the mesh is row-major over pp, dp, cp, tp)."""
    sizes, rank = mesh_sizes(layout), 0
    for axis in AXES:
        rank = rank * sizes[axis] + coordinates[axis]
    return rank


# ----------------------------------------------------------------------------- the world


def _join(rank: int, world: int) -> None:
    """Become rank ``rank`` of ``world`` on the fake backend (leaving any earlier group)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a collective's group: a ProcessGroup (as c10d ops get it, boxed) or
    a registered group name (as the functional collectives get it)."""
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(group)
    return tuple(dist.get_process_group_ranks(group))


def _as_group(a: Any) -> dist.ProcessGroup | None:
    if isinstance(a, dist.ProcessGroup):
        return a
    if isinstance(a, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(a)
        except RuntimeError:  # another c10d class (a ReduceOp)
            return None
    return None


class RecordingFakeMode(FakeTensorMode):
    """Fake tensors that record every collective run on them while ``recording``: the c10d ops
    FSDP and the process groups call and the functional ones DTensor and tensor parallelism
    call. Recorded where fake tensors run their ops, so the collectives DTensor issues inside
    its own dispatch (the loss-parallel reductions) are seen too; a mode stacked above DTensor
    would miss those."""

    NAMESPACES = ("c10d", "_c10d_functional")

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.calls: list[Collective] = []
        self.recording = False

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name().split("::")[-1]
        if self.recording and func.namespace in self.NAMESPACES and not name.startswith("wait"):
            self.calls.append(_describe(name, list(args) + list(kwargs.values())))
        return super().dispatch(func, types, args, kwargs)


def _describe(name: str, args: list[Any]) -> Collective:
    shapes: list[tuple] = []
    group: tuple[int, ...] = ()
    for a in args:
        for t in a if isinstance(a, list | tuple) else [a]:
            if isinstance(t, torch.Tensor):
                shapes.append(tuple(t.shape))
    for a in reversed(args):
        if (pg := _as_group(a)) is not None:
            group = group_ranks(pg)
            break
    else:  # functional collectives name their group last
        names = [a for a in args if isinstance(a, str)]
        if names:
            group = group_ranks(names[-1])
    op = name.strip("_").replace("_base", "")
    return Collective(OP_NAMES.get(op, op), group, tuple(shapes))


OP_NAMES = {  # c10d's and the functional collectives' names for the same operation
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
}


# ----------------------------------------------------------------------------- one rank


def _build(loaded: LoadedConfig, world: int) -> tuple[Run, str]:
    """This rank's run as the trainer builds it (``train/assembly.py``), on the meta device,
    nothing drawn; and a note on what the rehearsal cannot record."""
    from torchneox.config.layout import require
    from torchneox.parallel.dims import ParallelDims
    from torchneox.parallel.parallelize import NO_PARAMETER, replicated
    from torchneox.train.assembly import build_run

    d = derive(loaded, world_size=world)
    layout = require(loaded, d)
    dims = ParallelDims.from_layout(layout, "cpu")
    dims.build_mesh()
    # compile off: compiled code cannot run on fake tensors; fake tokens have no values, so
    # any end-of-document id
    meta = torch.device("meta")
    run = build_run(loaded, d, layout, dims, meta, NO_PARAMETER, 0, compile_scope="off")
    note = ""
    if replicated(dims, layout):
        note = "DDP is not built on meta tensors: its gradient all-reduce is not recorded"
    return run, note


def _fake_empty(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = torch.empty(t._local_tensor.shape, dtype=t.dtype)
        return DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return torch.empty(t.shape, dtype=t.dtype)


def _materialize(modules: list[nn.Module]) -> None:
    """Give meta modules fake storage on the CPU (inside an active FakeTensorMode): FSDP's
    through its own ``to_empty``; others tensor by tensor (``to_empty`` cannot swap a meta
    parameter for a fake one)."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            module.to_empty(device="cpu")
            continue
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and p.is_meta:
                    sub._parameters[name] = nn.Parameter(_fake_empty(p), p.requires_grad)
            for name, b in list(sub._buffers.items()):
                if b is not None and b.is_meta:
                    sub._buffers[name] = _fake_empty(b)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _measured(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params if p.grad is not None]
    out = {"gradients": _bytes(grads)}
    states = []
    for state in optimizer.state.values() if optimizer is not None else []:
        states += [v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)]
    # a tensor several states share (bitsandbytes' quantisation maps) is held once
    out["optimizer"] = _bytes(list({id(v): v for v in states}.values()))
    return out


def _build_footprint(run: Run) -> int:
    """What this rank held as the builder built its model from scratch: the parameter shards
    (the reference's too) and the largest weight it drew whole (parallelize.footprint)."""
    from torchneox.parallel.parallelize import EVERY_PARAMETER, footprint

    spent = footprint(run.parts.model, init=EVERY_PARAMETER)
    if run.parts.reference is not None:
        spent.parameter_bytes += footprint(run.parts.reference).parameter_bytes
    return spent.parameter_bytes + spent.largest_drawn_whole


def _fake_step(run: Run, record: Any) -> str:
    """One training step on fake tensors, by the trainer's own step (``TrainStep``): a
    micro-batch's forward and backward (a pipeline's stages through ``RehearsedSchedule``),
    the loss and metrics shared, the gradients clipped and applied by the optimizer."""
    from torchneox.estimate.activations import route_evenly

    cfg = run.loaded.config
    if cfg.training.train_impl != "normal":
        return "not rehearsed: the fake step feeds language-modelling batches only"
    if run.dims.ep > 1:
        return "not rehearsed: expert parallelism sizes its all-to-all by the routing's values"
    assert run.step is not None and run.schedule is not None
    for moe in run.step.gradients.moe_layers:
        route_evenly(moe)
    if run.parts.pipeline is not None:
        run.parts.pipeline.schedule = RehearsedSchedule(run, record)
    tokens = torch.zeros(run.layout.micro_batch, cfg.model.seq_length + 1, dtype=torch.long)
    run.step(1, run.schedule.lr_for_update(1), [tokens])
    return STEPPED


def _stage_owners(run: Run) -> dict[int, int]:
    """The global rank holding each pipeline stage in this rank's pipeline group."""
    from torchneox.parallel.pipeline import rank_stage_indices

    lay = run.layout
    members = dist.get_process_group_ranks(run.dims.mesh["pp"].get_group())
    owners = {}
    for pp_rank, rank in enumerate(members):
        for index in rank_stage_indices(lay.schedule, pp_rank, lay.pp, lay.virtual_stages):
            owners[index] = rank
    return owners


class RehearsedSchedule:
    """What stands in for a pipeline schedule on the fake process group (whose receives bring
    nothing): each of this rank's stages forward, then backward, on the batch, a stage's input
    from another rank an empty tensor of the hidden states' shape; the activations and
    gradients a stage exchanges with its neighbours recorded as point-to-point transfers. The
    step around it (inputs, loss, metrics, gradients applied) is the trainer's."""

    def __init__(self, run: Run, record: Any):
        self.run, self.record = run, record
        self.owners = _stage_owners(run)

    def step(self, *args: torch.Tensor, target: Any = None, losses: Any = None) -> None:
        run, record, owners = self.run, self.record, self.owners
        p, me, last = run.parts.pipeline, dist.get_rank(), max(self.owners)
        seq = run.loaded.config.model.seq_length // run.dims.cp
        shape = (run.layout.micro_batch, seq, run.args.hidden_size)
        pending = []
        for part, stage in zip(p.parts, p.stages, strict=True):
            s = stage.stage_index
            if s == 0:
                x = args[0]
            else:
                x = torch.empty(shape, requires_grad=True)
                if owners[s - 1] != me:
                    record(Collective("p2p", (owners[s - 1], me), (shape,)))
            out = part(x)
            if s == last:
                loss = run.step.pipeline_loss(out, target)
                losses.append(loss)
                pending.append((s, loss, None))
                continue
            if owners[s + 1] != me:
                record(Collective("p2p", (me, owners[s + 1]), (tuple(out.shape),)))
            pending.append((s, out, torch.empty_like(out)))
        for s, out, grad in reversed(pending):
            if s != last and owners[s + 1] != me:
                record(Collective("p2p", (owners[s + 1], me), (tuple(out.shape),)))
            out.backward(grad)
            if s != 0 and owners[s - 1] != me:
                record(Collective("p2p", (me, owners[s - 1]), (shape,)))


def rehearse_rank(loaded: LoadedConfig, world: int, rank: int, nodes: int) -> RankReport:
    """Rank ``rank`` of ``world`` built and stepped on the fake process group."""
    from torchneox.reporting.metrics import Timers
    from torchneox.train.assembly import add_step

    start = time.perf_counter()
    _join(rank, world)
    run, note = _build(loaded, world)
    model = run.parts.model
    modules = list(run.parts.pipeline.parts) if run.parts.pipeline else [model]
    if run.parts.reference is not None:
        refs = run.parts.reference_pipeline
        modules += list(refs.parts) if refs else [run.parts.reference]
    recorder = RecordingFakeMode()
    measured: dict[str, int] = {}
    with recorder:
        _materialize(modules)
        run.device = torch.device("cpu")  # the fake tensors' device
        held = _bytes(list(model.parameters()))  # (sharded: FSDP gathers during the step)
        # values stay on the device: fake tensors have none to read back
        add_step(run, Timers(False, None), lambda text: None, lambda: "", None, read_back=False)
        optimizer = run.optimizer
        clear = optimizer.zero_grad

        def measure_then_clear(set_to_none: bool = True) -> None:
            measured.update(_measured(model, optimizer))  # the gradients, as the update ends
            clear(set_to_none=set_to_none)

        optimizer.zero_grad = measure_then_clear
        recorder.recording = True
        try:
            step = _fake_step(run, recorder.calls.append)
        except Exception as e:  # an op torch cannot run on fake tensors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            step = f"stopped, {type(e).__name__}: {first[:160]}"
        recorder.recording = False
        measured = {"parameters": held} | (measured or _measured(model, optimizer))
    measured["build"] = _build_footprint(run)
    if note:
        step += f" ({note})"
    report = _report(loaded, run, rank, nodes, world, measured, step)
    report.collectives, report.stepped = recorder.calls, step.startswith(STEPPED)
    report.seconds = time.perf_counter() - start
    return report


def _coordinates(rank: int, layout: Layout) -> dict[str, int]:
    sizes, out = mesh_sizes(layout), {}
    for axis in reversed(AXES):
        rank, out[axis] = divmod(rank, sizes[axis])
    return {a: out[a] for a in AXES}


def _stage_count(layout: Layout) -> int:
    from torchneox.parallel.pipeline import SINGLE

    if layout.pp <= 1:
        return 1
    per_rank = 2 if layout.schedule == "zbv" else (1 if layout.schedule in SINGLE else 0)
    return layout.pp * (per_rank or layout.virtual_stages)


def expected_bytes(loaded: LoadedConfig, built: Run, stages: list[int]) -> dict[str, int]:
    """What ``estimate`` computes for the shards of ``stages`` (those of shard rank 0)."""
    from torchneox.estimate.memory import fsdp_ranks

    lay = built.layout
    method = loaded.config.parallel.pipe_partition_method
    params = stage_params(loaded, built.derived["padded_vocab_size"], _stage_count(lay), method)
    opt = optimizer_bytes_per_param(loaded)
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}
    reference = built.parts.reference is not None
    whole = [p for k in stages for p in params[k]]
    prompted = has_prompt(params)
    for k in stages:
        per_dim = optimizer_bytes_per_dim(loaded)
        hidden = hidden_optimizer_bytes(loaded)
        per_tensor = optimizer_bytes_per_tensor(loaded)
        resident = state_bytes(
            params[k],
            lay,
            fsdp_ranks(lay),
            opt,
            per_dim,
            hidden,
            per_tensor,
            weight_bytes(loaded),
            prompted=prompted,
        )["resident"]
        out["parameters"] += resident["parameter_shard"]
        out["gradients"] += resident["gradient_shard"]
        out["optimizer"] += resident["optimizer"]
    out["build"] = build_bytes(whole, lay, reference, weight_bytes(loaded))
    return out


def _files(loaded: LoadedConfig, rank: int) -> list[str]:
    """The checkpoint files this rank writes at the run's first save."""
    from torchneox.checkpoint.files import CONFIG_FILE, MANIFEST_FILE, META_FILE
    from torchneox.checkpoint.manager import save_iterations

    ck = loaded.config.checkpoint
    if not ck.save:
        return []
    first = min(save_iterations(ck, loaded.config.training.train_iters))
    step_dir = f"{ck.save}/global_step{first}"
    files = [f"{step_dir}/__{rank}_0.distcp"]
    if rank == 0:
        files += [f"{step_dir}/{n}" for n in (".metadata", CONFIG_FILE, META_FILE, MANIFEST_FILE)]
        files.append(f"{ck.save}/latest")
    return files


def _spans(built: Run, per_node: int) -> dict[str, int]:
    sizes, out = mesh_sizes(built.layout), {}
    for axis in AXES:
        if sizes[axis] > 1:
            ranks = dist.get_process_group_ranks(built.dims.axis(axis).get_group())
            out[axis] = len({r // per_node for r in ranks})
    return out


def _report(
    loaded: LoadedConfig,
    built: Run,
    rank: int,
    nodes: int,
    world: int,
    measured: dict[str, int],
    step: str,
) -> RankReport:
    model, pipeline = built.parts.model, built.parts.pipeline
    stages = [s.stage_index for s in pipeline.stages] if pipeline else [0]
    ends = (("embedding", model.embed), ("head", model.final_norm))
    holds = [name for name, part in ends if part is not None]
    per_node = world // nodes
    return RankReport(
        rank=rank,
        node=rank // per_node,
        coordinates=_coordinates(rank, built.layout),
        stages=stages,
        layers=sorted(int(n) for n in model.layers),
        holds=holds,
        tensors=sum(1 for _ in model.parameters()),
        bytes=measured,
        expected=expected_bytes(loaded, built, stages),
        files=_files(loaded, rank),
        step=step,
        spans=_spans(built, per_node) if built.dims.mesh is not None else {},
    )
