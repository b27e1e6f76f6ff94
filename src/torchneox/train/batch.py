"""A micro-batch as the objectives see it (``Prepared``: inputs, labels, the loss mask and what
each objective adds), GPT-NeoX's shift of tokens into inputs and labels, and the terms of a
micro-batch's loss (``Terms``); shared by every objective, online RL's included."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from torchneox.data.loader import Batch


@dataclass
class Terms:
    """One micro-batch's loss (what is logged as lm_loss), the objective backward runs on, the
    extra terms it holds, and the objective's own metrics (all detached, for the logs)."""

    loss: torch.Tensor
    objective: torch.Tensor
    z_loss: torch.Tensor | None = None
    moe_aux_loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Prepared:
    """A micro-batch as the model sees it: inputs [B, T], the label of each position, whether
    it counts (the loss mask), and KTO's per-position rewards."""

    inputs: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor | None
    rewards: torch.Tensor | None = None
    reference_logp: torch.Tensor | None = None  # precomputed per position (precompute_model_name)
    positions: torch.Tensor | None = None  # inter_document_attention_masking: within documents
    segments: torch.Tensor | None = None  # ... and each token's document
    context: Any = None  # context parallelism: this rank's part of the sequence (ContextShard)
    counted: torch.Tensor | None = None  # ... and the whole micro-batch's tokens in the loss
    advantages: torch.Tensor | None = None  # reinforce: each row's advantage [B]
    raw_rewards: torch.Tensor | None = None  # ... its reward [B]
    old_logp: torch.Tensor | None = None  # ... the sampling policy's log-probabilities [B, T]
    whole: Prepared | None = None  # context parallelism: the micro-batch before its split (MTP)
    text: int | None = None  # ... with a soft prompt: the text's tokens after its placeholders

    @property
    def context_ranks(self) -> int:
        return 1 if self.context is None else self.context.ranks

    def model_inputs(self) -> dict[str, Any]:
        """What the model takes besides the inputs (nothing, unless documents are masked or
        the sequence is split)."""
        out: dict[str, Any] = {}
        if self.segments is not None:
            out = {"positions_BT": self.positions, "segments_BT": self.segments}
        if self.context is not None:
            out["context"] = self.context
        return out


def text_kept(logits: torch.Tensor, prep: Prepared) -> Prepared:
    """The labels, loss mask and per-position values (KTO's rewards, a precomputed or
    pipelined reference's log-probabilities, reinforce's sampling ones) of the positions a
    soft prompt left in (it takes the first n_tokens positions of the sequence, so the last n
    tokens' labels are not scored)."""
    kept = logits.shape[1]
    if kept >= prep.labels.shape[1]:
        return prep
    cut = {"labels": prep.labels[:, :kept]}
    for name in ("mask", "rewards", "reference_logp", "old_logp"):
        value = getattr(prep, name)
        if value is not None and value.dim() == 2:
            cut[name] = value[:, :kept]
    return dataclasses.replace(prep, **cut)


def text_span(n_tokens: int, text: int | None = None) -> slice:
    """The positions of the text in a sequence laid out with a soft prompt's ``n_tokens``
    placeholders first and padding after its ``text`` tokens (``soft_prompt.before_text``)."""
    return slice(n_tokens, None if text is None else n_tokens + text)


def past_prompt(prep: Prepared, n_tokens: int, text: int | None = None) -> Prepared:
    """A micro-batch laid out with a soft prompt's ``n_tokens`` placeholders first
    (``soft_prompt.before_text``: context parallelism) as the ``text`` tokens alone (the padding
    after them cut too): what a whole-sequence objective scores, the outputs cut alike."""
    cut, span = {}, text_span(n_tokens, text)
    for name in ("labels", "mask", "rewards", "reference_logp", "old_logp"):
        value = getattr(prep, name)
        if value is not None and value.dim() == 2:
            cut[name] = value[:, span]
    return dataclasses.replace(prep, **cut)


def shifted(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    eod_id: int | None,
    zero_masked: bool = False,
) -> Prepared:
    """GPT-NeoX's _get_batch: inputs are the tokens but the last; the labels are the label
    dataset's (masked positions, -100, read as 0) or the next tokens; the loss mask is
    label >= 0, and without end-of-document inputs under eod_mask_loss (``eod_id``)."""
    inputs = tokens[:, :-1]
    mask = None
    if labels is not None:
        mask = labels[:, 1:] >= 0
        target = torch.where(mask, labels[:, 1:], torch.zeros_like(labels[:, 1:]))
    else:
        target = tokens[:, 1:]
        if zero_masked:  # GPT-NeoX's label_mask_zero (dpo, rm): token ids are never negative
            target = target * (target >= 0)
    if eod_id is not None:
        not_eod = inputs != eod_id
        mask = not_eod if mask is None else mask & not_eod
    return Prepared(inputs, target, mask)


def cut(batch: Batch, length: int) -> Batch:
    """A training micro-batch's samples cut to ``length`` inputs (their first length + 1
    tokens: the inputs, positions, labels and loss mask of the first ``length`` positions);
    as GPT-NeoX, a length at or beyond the samples' leaves them whole."""
    if isinstance(batch, dict):
        return {k: v[:, : length + 1] for k, v in batch.items()}
    return batch[:, : length + 1]


def to_device(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, dict):
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)
