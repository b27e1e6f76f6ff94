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

from torchneox.models.attention import ContextShard


def chunk_positions(length: int, ranks: int, rank: int, device: torch.device) -> torch.Tensor:
    """The positions rank ``rank`` of ``ranks`` holds of a sequence of ``length`` tokens."""
    size = length // (2 * ranks)
    first = torch.arange(rank * size, (rank + 1) * size, device=device)
    last = 2 * ranks - 1 - rank
    return torch.cat([first, torch.arange(last * size, (last + 1) * size, device=device)])


def _gatherer(mesh: DeviceMesh):
    group = mesh.get_group()

    def gather(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, heads, T_local, D] of every cp rank, concatenated by rank along
        the sequence (one collective for both)."""
        both = all_gather_tensor_autograd(torch.stack([k, v]), gather_dim=3, group=group)
        return both[0], both[1]

    return gather


def split_sequence(prep, mesh: DeviceMesh):
    """This rank's part of a prepared micro-batch (``objectives.Prepared``): its chunks of the
    inputs, labels, loss mask and document positions, with the ``ContextShard`` the model
    takes and the whole micro-batch's count of tokens in the loss."""
    ranks, rank = mesh.size(), mesh.get_local_rank()
    b, t = prep.inputs.shape
    device = prep.inputs.device
    index = chunk_positions(t, ranks, rank, device)
    keys = torch.cat([chunk_positions(t, ranks, r, device) for r in range(ranks)])
    counted = prep.mask.sum() if prep.mask is not None else torch.tensor(b * t, device=device)
    segments = prep.segments
    context = ContextShard(
        index=index,
        keys=keys,
        length=t,
        gather=_gatherer(mesh),
        key_segments=None if segments is None else segments[:, keys],
    )
    return type(prep)(
        inputs=prep.inputs[:, index],
        labels=prep.labels[:, index],
        mask=None if prep.mask is None else prep.mask[:, index],
        positions=None if prep.positions is None else prep.positions[:, index],
        segments=None if segments is None else segments[:, index],
        context=context,
        counted=counted,
        context_ranks=ranks,
    )
