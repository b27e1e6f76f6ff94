"""The collectives the training side runs, each named for what it computes. Every helper
takes the ParallelDims (or a mesh axis) it reduces over, and does nothing on one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from torchneox.models.moe import RouterStats
from torchneox.parallel.dims import ParallelDims


def plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a plain tensor as it is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def mean_over_dp(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """The mean of ``value`` over the data-parallel ranks (each holds part of the batch); with
    context parallelism each rank's value is its share of its micro-batches' and the shares
    are added first."""
    if not dims.distributed:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dims.batch_mesh.get_group())
    return value / dims.dp


def sum_over_dp(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """``value`` summed over the ranks that split the batch, in place."""
    if dims.distributed:
        dist.all_reduce(value, group=dims.batch_mesh.get_group())
    return value


def sum_over_pp(value: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """``value`` summed over the pipeline stages, in place (only the last one adds a loss)."""
    dist.all_reduce(value, group=dims.mesh["pp"].get_group())
    return value


def any_rank(flag: bool, dims: ParallelDims, device: torch.device) -> bool:
    """Whether ``flag`` is true on any rank (ranks may see a signal at different steps)."""
    if not dims.distributed:
        return flag
    t = torch.tensor(float(flag), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sum_router_stats(stats: RouterStats, mesh: DeviceMesh) -> RouterStats:
    """One MoE layer's router statistics summed over the ranks of ``mesh`` (the ranks that
    split the batch), as one process holding the whole batch would have them; the gradient
    reaches every rank's router through the all-reduce."""
    group = mesh.get_group()
    counts = stats.tokens_per_expert.float().detach().clone()
    dist.all_reduce(counts, group=group)
    prob_sum = _Summed.apply(stats.prob_sum, group)
    return RouterStats(counts, prob_sum, stats.tokens * mesh.size(), stats.top_k)


class _Summed(torch.autograd.Function):
    """A tensor summed over ``group``'s ranks, its gradient summed over them too (every rank's
    loss reads the sum). torch.distributed.nn's all_reduce does this and is deprecated."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def vocab_parallel_logsumexp(logits_NV: DTensor) -> DTensor:
    """logsumexp over the vocabulary of logits split by vocabulary over the tensor ranks,
    without gathering them: each rank's sum of exp(logit - max) over its shard, the shards'
    maxima and sums reduced (the sum differentiable: its gradient reaches each rank's shard
    as exp(logit - lse)). Replicated [N] on every rank."""
    mesh = logits_NV.device_mesh
    local = logits_NV.to_local().float()
    top = local.detach().amax(dim=-1)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=mesh.get_group())
    sums = (local - top.unsqueeze(-1)).exp().sum(dim=-1)
    whole = DTensor.from_local(sums, mesh, [Partial()]).redistribute(mesh, [Replicate()])
    return DTensor.from_local(top, mesh, [Replicate()]) + whole.log()
