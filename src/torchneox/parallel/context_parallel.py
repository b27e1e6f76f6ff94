"""Context parallelism: the ranks of the ``cp`` mesh axis split every sample's sequence.

The sequence is cut into 2 x cp equal chunks and rank r keeps chunks r and 2cp-1-r, so under
causal attention every rank has the same work (an early chunk sees few keys, its partner late
in the sequence sees many). Each rank embeds, normalises, runs the MLPs and computes the loss of
its own tokens; every attention layer gathers the keys and values of the whole sequence from
the cp ranks (one all-gather forward, its reduce-scatter backward) and attends with its own
queries under a mask built from the tokens' positions in the whole sequence. This is torch's
context-parallel "allgather" method; torch's own implementation wraps only the CUDA flash,
efficient and cuDNN kernels with a plain causal flag, while this one runs wherever SDPA does
and keeps document masks, sliding windows and ALiBi.

The loss of a micro-batch is the sum over its ranks' tokens divided by the whole micro-batch's
count of tokens that count, so the ranks' losses add up to the one-process loss; their
gradients are reduced over the data-parallel and context-parallel ranks together.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_gather_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh

from torchneox.models.mixers.attention import ContextShard, Gather


def chunk_positions(length: int, ranks: int, rank: int, device: torch.device) -> torch.Tensor:
    """The positions rank ``rank`` of ``ranks`` holds of a sequence of ``length`` tokens."""
    size = length // (2 * ranks)
    first = torch.arange(rank * size, (rank + 1) * size, device=device)
    last = 2 * ranks - 1 - rank
    return torch.cat([first, torch.arange(last * size, (last + 1) * size, device=device)])


def shard_of(
    length: int,
    ranks: int,
    rank: int,
    gather: Gather,
    device: torch.device,
    segments: torch.Tensor | None = None,
) -> ContextShard:
    """Rank ``rank``'s ``ContextShard`` of a sequence of ``length`` tokens: its positions, the
    gathered keys' (every rank's, in rank order, as ``gather`` returns them) and, under document
    masking, the keys' documents from the whole sequence's ``segments`` [B, length]."""
    keys = torch.cat([chunk_positions(length, ranks, r, device) for r in range(ranks)])
    return ContextShard(
        index=chunk_positions(length, ranks, rank, device),
        keys=keys,
        length=length,
        gather=gather,
        key_segments=None if segments is None else segments[:, keys],
        rank=rank,
    )


def _gatherer(mesh: DeviceMesh) -> Gather:
    group = mesh.get_group()

    def gather(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, heads, T_local, D] of every cp rank, concatenated by rank along
        the sequence (one collective for both). MLA's latents and rotary keys [B, 1, T_local,
        *] differ in width: they travel side by side in one tensor."""
        if k.shape != v.shape:
            both = all_gather_tensor_autograd(torch.cat([k, v], dim=-1), gather_dim=2, group=group)
            return both.split([k.shape[-1], v.shape[-1]], dim=-1)
        both = all_gather_tensor_autograd(torch.stack([k, v]), gather_dim=3, group=group)
        return both[0], both[1]

    return gather


def split_sequence(prep, mesh: DeviceMesh):
    """This rank's part of a prepared micro-batch (``objectives.Prepared``): its chunks of the
    inputs, labels, loss mask and document positions, with the ``ContextShard`` the model
    takes and the whole micro-batch's count of tokens in the loss."""
    t = prep.inputs.shape[1]
    context = shard_of(
        t, mesh.size(), mesh.get_local_rank(), _gatherer(mesh), prep.inputs.device, prep.segments
    )
    return part_of(prep, context)


def part_of(prep, context: ContextShard):
    """The part of ``prep`` (whole sequences) at ``context``'s positions, with the whole
    micro-batch's count of tokens in the loss and the whole kept (the tokens ahead, for MTP)."""
    b, t = prep.inputs.shape
    index = context.index
    counted = prep.mask.sum() if prep.mask is not None else torch.tensor(b * t, device=index.device)

    def part(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[:, index]

    return type(prep)(
        inputs=prep.inputs[:, index],
        labels=prep.labels[:, index],
        mask=part(prep.mask),
        positions=part(prep.positions),
        segments=part(prep.segments),
        context=context,
        counted=counted,
        whole=prep,  # (multi-token prediction reads the tokens ahead, on any rank)
        text=prep.text,
    )


def stage_shard(length: int, mesh: DeviceMesh, device: torch.device) -> ContextShard:
    """The ``ContextShard`` every pipeline stage of this rank runs a batch of ``length``-token
    sequences under (the stages gather the keys' documents micro-batch by micro-batch)."""
    return shard_of(length, mesh.size(), mesh.get_local_rank(), _gatherer(mesh), device)


def gather_sequence(x: torch.Tensor, context: ContextShard, mesh: DeviceMesh) -> torch.Tensor:
    """[B, T / cp, ...] on each context rank: the whole sequence [B, T, ...] in order, on every
    rank. Backward returns to each rank the gradient of its own positions summed over the
    ranks: a loss that every rank computes from the whole gives each rank its tokens' gradient
    cp times, which the reduction over the context ranks averages back to one process's."""
    group = mesh.get_group()
    gathered = all_gather_tensor_autograd(x.contiguous(), gather_dim=1, group=group)
    return gathered[:, torch.argsort(context.keys)]
