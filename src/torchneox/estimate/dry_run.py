"""The dry run (``train CONFIGS --dry-run --world-size N``): a run's parallel build rehearsed,
rank after rank on this machine (``rehearsal``, in a forked process per rank), before a
cluster's time is spent.

Reported per rank: its coordinates in the mesh, its pipeline stage and layers, the bytes of its
parameter, gradient and optimizer shards (measured, beside ``estimate``'s), the checkpoint
files it would write; across ranks: whether every rehearsed member of each process group calls
the same collectives in the same order with the same shapes, and which groups cross nodes.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from torchneox.base.errors import ConfigError
from torchneox.config.derive import derive
from torchneox.config.features.replicas import replica_line
from torchneox.config.layout import Layout
from torchneox.config.load import LoadedConfig
from torchneox.estimate.rehearsal import AXES, RankReport, mesh_sizes, rank_of, rehearse_rank


@dataclass
class DryRun:
    world: int
    nodes: int
    layout: Layout
    ranks: list[RankReport]
    problems: list[str]
    groups_checked: int
    replicas: str | None = None  # the replicate axis (ft_*): each group is this rehearsal


def sample_ranks(layout: Layout) -> list[int]:
    """The distinct ranks a run's shapes can differ on: the first and the last position along
    every axis (the last ones hold FSDP's and tensor parallelism's smaller remainders, the last
    stage the head); with hybrid sharding, the ends of the first two shard groups too."""
    sizes = mesh_sizes(layout)
    ends = [sorted({0, sizes[a] - 1}) for a in AXES]
    if layout.hybrid:  # the first shard group's ends and the second's start: both kinds of group
        shard = layout.shard_ranks
        ends[AXES.index("dp")] = sorted({0, shard - 1, shard, layout.dp - 1})
    corners = itertools.product(*ends)
    return sorted({rank_of(dict(zip(AXES, c, strict=True)), layout) for c in corners})


def parse_ranks(spec: str | None, world: int, layout: Layout) -> list[int]:
    if spec is None:
        return sample_ranks(layout)
    if spec == "all":
        return list(range(world))
    try:
        ranks = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--ranks {spec!r}: give 'all' or ranks like 0,5,17") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise ConfigError(f"--ranks {spec!r}: ranks run from 0 to {world - 1}")
    return ranks


# ----------------------------------------------------------------------------- the world


def check_agreement(reports: list[RankReport]) -> tuple[int, list[str]]:
    """Whether every rehearsed member of each process group calls the same collectives, in
    the same order, with the same shapes; (groups compared, disagreements)."""
    rehearsed = {r.rank for r in reports}
    calls: dict[tuple[int, ...], dict[int, list[tuple]]] = {}
    for r in reports:
        for c in r.collectives:
            calls.setdefault(c.group, {}).setdefault(r.rank, []).append((c.op, c.shapes))
    checked, problems = 0, []
    for group, by_rank in sorted(calls.items()):
        members = [m for m in group if m in rehearsed]
        if len(members) < 2:
            continue
        checked += 1
        first = by_rank.get(members[0], [])
        for m in members[1:]:
            other = by_rank.get(m, [])
            if other != first:
                problems.append(_disagreement(group, members[0], first, m, other))
                break
    return checked, problems


def _disagreement(group: tuple, a: int, first: list, b: int, other: list) -> str:
    i = next(
        (k for k, (x, y) in enumerate(zip(first, other, strict=False)) if x != y),
        min(len(first), len(other)),
    )

    def call(seq: list, rank: int) -> str:
        return (
            f"{seq[i][0]} {list(seq[i][1])}"
            if i < len(seq)
            else f"nothing (rank {rank} made {len(seq)})"
        )

    where = _group_name(group)
    return f"ranks {a} and {b} disagree on collective {i + 1} of {where}: {call(first, a)} vs {call(other, b)}"


def _group_name(group: tuple[int, ...]) -> str:
    if len(group) > 6:
        return f"the group of ranks {group[0]}, {group[1]} ... {group[-1]} ({len(group)} ranks)"
    return f"the group of ranks {', '.join(map(str, group))}"


def dry_run(
    loaded: LoadedConfig,
    world: int,
    nodes: int = 1,
    ranks: str | None = None,
    progress: Callable[[int, int, RankReport], None] | None = None,
    workers: int | None = None,
) -> DryRun:
    """The run rehearsed on ``world`` ranks over ``nodes`` nodes: ``ranks`` "all", a list like
    "0,5", or None for the first and last position along every mesh axis. Each rank is built
    in a fresh process forked from this one (torch keeps caches keyed by mesh shape, which a
    second rank's mesh of the same shape would hit), ``workers`` at a time (default: the
    CPU count)."""
    from torchneox.config.layout import require

    if world % nodes:
        raise ConfigError(f"--world-size {world} does not split over --nodes {nodes}")
    layout = require(loaded, derive(loaded, world_size=world))
    chosen = parse_ranks(ranks, world, layout)
    _JOB[:] = [loaded, world, nodes]
    pool_size = min(workers or os.cpu_count() or 1, len(chosen))
    reports: list[RankReport] = []
    context = multiprocessing.get_context("fork")
    with context.Pool(pool_size, maxtasksperchild=1) as pool:
        for report in pool.imap(_rehearse, chosen):
            reports.append(report)
            if progress is not None:
                progress(len(reports), len(chosen), report)
    checked, problems = check_agreement(reports)
    problems += _byte_problems(reports)
    replicas = replica_line(loaded.config, world)
    return DryRun(world, nodes, layout, reports, problems, checked, replicas)


_JOB: list = []  # (loaded, world, nodes): what forked workers inherit


def _rehearse(rank: int) -> RankReport:
    import logging
    import warnings

    warnings.simplefilter("ignore")  # torch's deprecation notes, once per rank
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    loaded, world, nodes = _JOB
    try:
        return rehearse_rank(loaded, world, rank, nodes)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _byte_problems(reports: list[RankReport]) -> list[str]:
    """A rank holding more than ``estimate`` computes, or a first shard rank holding other
    than it (estimate computes the shard rank 0 holds: torch gives it the rounded-up share)."""
    out = []
    for r in reports:
        for part in ("parameters", "gradients", "optimizer") if r.stepped else ("parameters",):
            got, want = r.bytes[part], r.expected[part]
            first = (
                r.coordinates["dp"] == 0 and r.coordinates["tp"] == 0 and r.coordinates["cp"] == 0
            )
            if got > want or (first and got != want):
                out.append(f"rank {r.rank}: {part} {got:,} bytes where estimate computes {want:,}")
        if r.bytes["build"] > r.expected["build"]:  # the builder held to estimate's build line
            out.append(
                f"rank {r.rank}: building the model holds {r.bytes['build']:,} bytes where "
                f"estimate computes {r.expected['build']:,}"
            )
    return out


# ----------------------------------------------------------------------------- the report

AXIS_NAMES = {"pp": "pipeline", "dp": "data", "cp": "context", "tp": "tensor"}


def _size(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:,.2f} {unit}"
    return f"{b:,.0f} B"


def _layers(layers: list[int]) -> str:
    if not layers:
        return "no layers"
    runs, start, prev = [], layers[0], layers[0]
    for cur in layers[1:]:
        if cur != prev + 1:
            runs.append((start, prev))
            start = cur
        prev = cur
    runs.append((start, prev))
    return "layers " + ", ".join(f"{a}-{b}" if b != a else f"{a}" for a, b in runs)


def render_rank(r: RankReport, nodes: int) -> list[str]:
    where = " ".join(f"{a} {r.coordinates[a]}" for a in AXES)
    stage = "stage" + ("s " if len(r.stages) > 1 else " ") + ", ".join(map(str, r.stages))
    ends = f" + {' + '.join(r.holds)}" if r.holds else ""
    lines = [f"rank {r.rank}" + (f" (node {r.node})" if nodes > 1 else "") + f": {where}"]
    lines.append(f"  {stage}: {_layers(r.layers)}{ends}; {r.tensors} parameter tensors")
    parts = []
    for part in ("parameters", "gradients", "optimizer"):
        got, want = r.bytes[part], r.expected[part]
        if part != "parameters" and not r.stepped:
            parts.append(f"{part} - (estimate {_size(want)})")
            continue
        same = "= estimate" if got == want else f"estimate {_size(want)}"
        parts.append(f"{part} {_size(got)} ({same})")
    lines.append("  holds " + ", ".join(parts))
    got, want = r.bytes["build"], r.expected["build"]
    same = "= estimate" if got == want else f"estimate {_size(want)}"
    lines.append(f"  building the model: {_size(got)} ({same})")
    counts = collections.Counter(c.op for c in r.collectives)
    calls = ", ".join(f"{op} x{n}" for op, n in counts.most_common())
    lines.append(f"  step: {r.step}" + (f"; collectives {calls}" if calls else ""))
    if r.files:
        shown = r.files[0] + (f" (+{len(r.files) - 1} more)" if len(r.files) > 1 else "")
        lines.append(
            f"  writes {shown}, up to {_size(r.bytes['parameters'] + r.expected['optimizer'])}"
        )
    return lines


def render(run: DryRun) -> str:
    lay = run.layout
    sizes = " x ".join(f"{AXIS_NAMES[a]} {mesh_sizes(lay)[a]}" for a in AXES)
    lines = [
        f"dry run: {run.world} ranks on {run.nodes} node(s), {sizes}, ZeRO-{lay.zero}; "
        f"{len(run.ranks)} rank(s) built on a fake process group and fake tensors"
    ]
    if run.replicas:
        lines.append(run.replicas)
    for r in run.ranks:
        lines += render_rank(r, run.nodes)
    lines.append(
        f"collectives: {run.groups_checked} process group(s) with two or more rehearsed members "
        "compared"
        + ("; every member calls the same ones in the same order" if not run.problems else "")
    )
    lines += _node_lines(run)
    if run.problems:
        lines.append(f"{len(run.problems)} problem(s):")
        lines += [f"  {p}" for p in run.problems]
    else:
        lines.append("every rehearsed rank built and holds what estimate computes")
    return "\n".join(lines)


def _node_lines(run: DryRun) -> list[str]:
    if run.nodes <= 1:
        return []
    spans: dict[str, int] = {}
    for r in run.ranks:
        for axis, n in r.spans.items():
            spans[axis] = max(spans.get(axis, 0), n)
    lines = [
        "nodes: "
        + ", ".join(f"{AXIS_NAMES[a]}-parallel groups span {n} node(s)" for a, n in spans.items())
    ]
    if spans.get("tp", 1) > 1:
        lines.append(
            "  tensor-parallel groups cross nodes: their all-reduces run on every layer; keep "
            "model_parallel_size within one node's GPUs"
        )
    return lines
