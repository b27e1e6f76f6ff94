"""Context parallelism for the recurrent mixers (mamba, RWKV's time and channel mixes): each
rank runs its own chunks and the ranks pass their states on, instead of every rank running
the whole sequence.

Under context parallelism a rank holds two chunks of every sequence, chunk r and chunk
2 cp - 1 - r of 2 cp equal chunks (parallel/context_parallel.py). A recurrence that is linear in
its state, h_t = a_t * h_{t-1} + b_t, is run over each chunk from a zero state; then

    h_t = local_t + (a_1 ... a_t) * h_in

where h_in is the state the chunks before leave. Each rank gives every other its chunks' last
local state and their whole decay (a_1 ... a_L), one small all-gather, and every rank composes
the incoming state of each chunk in sequence order from those; the mixer adds the incoming
state's term to its outputs (RWKV) or runs the chunk from it (mamba, whose last local state is
a weighted sum of its inputs that needs no scan). A convolution or a token shift that reads the
positions just before a chunk takes them from the chunks before (``halo``, one more small
all-gather). Gradients flow
through the gathers (``bias.gather`` is an all-gather whose backward is its reduce-scatter), so
each rank's loss reaches every state it read.

Communication goes through ``AttentionBias.gather`` (models/ holds no torch.distributed): it takes
[B, heads, T_local, D] tensors and returns every rank's, concatenated in rank order on dim 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchneox.models.mixers.attention import AttentionBias


@dataclass(frozen=True)
class Chunks:
    """This rank's two chunks of a context-parallel sequence."""

    size: int
    """The positions of one chunk."""
    ranks: int
    """The context ranks (2 x ranks chunks in all)."""
    mine: tuple[int, int]
    """The chunks this rank holds, in the order of its positions."""
    documents: torch.Tensor | None
    """[B, T] each position's document in sequence order (inter_document_attention_masking)."""

    @property
    def count(self) -> int:
        return 2 * self.ranks

    def slot(self, chunk: int) -> int:
        """Where chunk ``chunk`` sits among the gathered chunks (rank order, 2 per rank)."""
        return 2 * chunk if chunk < self.ranks else 2 * (self.count - 1 - chunk) + 1

    def span(self, k: int) -> slice:
        """This rank's positions of its ``k``-th chunk (0 or 1)."""
        return slice(k * self.size, (k + 1) * self.size)

    def starts(self, chunk: int) -> int:
        return chunk * self.size


def passes(bias: AttentionBias | None, cache) -> bool:
    """Whether a recurrent mixer's forward runs its own chunks and passes its state on: a
    context-parallel training forward (a cached decode never runs under context parallelism)."""
    return bias is not None and bias.gather is not None and cache is None


def chunks_of(bias: AttentionBias) -> Chunks:
    """The chunks of this rank under ``bias`` (a context-parallel forward's)."""
    assert bias.positions is not None and bias.gather is not None
    mine, keys = bias.positions  # (read for their sizes: the estimate traces on fake tensors)
    size, ranks, rank = mine.numel() // 2, keys.numel() // mine.numel(), bias.context_rank
    documents = None
    if bias.documents is not None:  # the gathered keys' documents, put in sequence order
        documents = bias.documents[:, torch.argsort(keys)]
    return Chunks(size, ranks, (rank, 2 * ranks - 1 - rank), documents)


def _gathered(bias: AttentionBias, t: torch.Tensor) -> torch.Tensor:
    """[B, 2 x ranks, ...] every rank's ``t`` [B, 2, ...] (its two chunks' values)."""
    b, two, *rest = t.shape
    flat = t.reshape(b, 1, two, -1)
    out, _ = bias.gather(flat, flat[..., :0])
    return out.reshape(b, -1, *rest)


def halo(x_BTD: torch.Tensor, width: int, chunks: Chunks, bias: AttentionBias) -> torch.Tensor:
    """[B, 2, width, D] the ``width`` inputs just before each of this rank's chunks (zeros
    before the sequence's start). A chunk shorter than ``width`` (a short sequence over many
    ranks) hands on all it has, and the inputs come from as many chunks before as it takes."""
    take = min(width, chunks.size)
    tails = torch.stack([x_BTD[:, chunks.span(k)][:, -take:] for k in (0, 1)], 1)
    every = _gathered(bias, tails)  # [B, 2 x ranks, take, D]
    zeros = x_BTD.new_zeros(x_BTD.shape[0], width, *x_BTD.shape[2:])
    out = []
    for chunk in chunks.mine:
        first = max(chunk - -(-width // take), 0)  # the earliest chunk the window reaches
        before = [every[:, chunks.slot(c)] for c in range(first, chunk)]
        out.append(torch.cat([zeros, *before], 1)[:, -width:])
    return torch.stack(out, 1)


def shifted(x_BTD: torch.Tensor, chunks: Chunks, bias: AttentionBias) -> torch.Tensor:
    """x_{t-1} at each of this rank's positions (a token shift: zeros before the sequence)."""
    before = halo(x_BTD, 1, chunks, bias)
    parts = [torch.cat([before[:, k], x_BTD[:, chunks.span(k)][:, :-1]], 1) for k in (0, 1)]
    return torch.cat(parts, 1)


def incoming(last: torch.Tensor, decay: torch.Tensor, chunks: Chunks, bias: AttentionBias):
    """[B, 2, ...] the state entering each of this rank's chunks: ``last`` [B, 2, ...] each of
    its chunks' last state run from a zero state, ``decay`` [B, 2, ...] each chunk's whole
    decay (what it does to a state entering it; any shape that broadcasts against a state's,
    sent as it is: RWKV's per key channel, mamba's per channel and state)."""
    b = last.shape[0]
    flat = [last.reshape(b, 2, -1), decay.reshape(b, 2, -1)]
    every = _gathered(bias, torch.cat(flat, -1))  # [B, 2 x ranks, both sizes], one gather
    lasts, decays = every.split([flat[0].shape[-1], flat[1].shape[-1]], -1)
    state, shape = torch.zeros_like(last[:, 0]), (b, *decay.shape[2:])
    entering = []
    for chunk in range(chunks.count):
        entering.append(state)
        at = chunks.slot(chunk)
        state = decays[:, at].reshape(shape) * state + lasts[:, at].reshape(state.shape)
    return torch.stack([entering[chunk] for chunk in chunks.mine], 1)
