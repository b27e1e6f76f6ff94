"""The language-model loss: mean cross-entropy over the unmasked tokens, computed in fp32.

On the CPU the softmax runs over blocks of rows small enough to stay in cache, and the
backward pass writes the gradient into the logits' own storage: ATen's log_softmax + nll_loss
pair streams the whole logits tensor through memory six times (log-probabilities out and back,
a zero-filled gradient, the softmax gradient), which is most of a small model's step when the
vocabulary is 50k wide. The numbers are those of F.cross_entropy (same fp32 arithmetic, per
row). Elsewhere, and for vocabulary-parallel (DTensor) logits, F.cross_entropy is used as is.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from torchneox.parallel.collectives import plain, vocab_parallel_logsumexp

BLOCK_BYTES = 4 << 20  # rows of fp32 logits per block: a few MiB, the size of a core's cache


class _BlockedCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy [N] and logsumexp [N] of logits [N, V] (any float dtype) against
    labels [N]."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, labels: torch.Tensor, rows: int, with_z: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            block = logits[start : start + rows].float()
            lse[start : start + rows] = torch.logsumexp(block, dim=-1)
        picked = logits.gather(1, labels[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, labels, lse)
        ctx.rows, ctx.with_z = rows, with_z
        return lse - picked, lse

    @staticmethod
    def backward(
        ctx, grad: torch.Tensor, grad_lse: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        logits, labels, lse = ctx.saved_tensors
        rows = ctx.rows
        grad = grad.float()
        # d lse / d logits is the softmax, d loss / d logits the softmax less the one-hot
        total = grad + grad_lse.float() if ctx.with_z else grad
        # the logits are not needed after the loss: their storage becomes their gradient
        for start in range(0, logits.shape[0], rows):
            stop = start + rows
            block = logits[start:stop].float()  # a view when the logits are fp32
            block.sub_(lse[start:stop, None]).exp_().mul_(total[start:stop, None])
            block.scatter_add_(1, labels[start:stop, None], -grad[start:stop, None])
            if logits.dtype != torch.float32:
                logits[start:stop].copy_(block)
        return logits, None, None, None


def _blockable(logits_NV: torch.Tensor) -> bool:
    """Plain contiguous CPU logits; with a backward, the logits' storage becomes their gradient
    (nothing reads them after the loss), so a leaf that needs a gradient, or a view of one, is
    a caller's own tensor and takes F.cross_entropy instead."""
    return (
        logits_NV.device.type == "cpu"
        and not isinstance(logits_NV, DTensor)
        and logits_NV.is_contiguous()
        and not (
            logits_NV.requires_grad
            and (logits_NV if logits_NV._base is None else logits_NV._base).is_leaf
        )
    )


def _token_terms(
    flat_NV: torch.Tensor, labels_N: torch.Tensor, blocked: bool, with_z: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token cross-entropy and (``with_z``) logsumexp, in fp32."""
    if blocked and _blockable(flat_NV):
        rows = max(1, BLOCK_BYTES // (4 * flat_NV.shape[-1]))
        losses, lse = _BlockedCrossEntropy.apply(flat_NV, labels_N, rows, with_z)
        return losses, lse if with_z else None
    losses = F.cross_entropy(flat_NV.float(), labels_N, reduction="none")
    if with_z and isinstance(flat_NV, DTensor):  # split by vocabulary (tensor parallelism)
        return losses, vocab_parallel_logsumexp(flat_NV)
    return losses, torch.logsumexp(flat_NV.float(), dim=-1) if with_z else None


def _mean(
    values_N: torch.Tensor, mask_BT: torch.Tensor | None, total: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean over the masked tokens; ``total``: divide the sum by this count instead (the
    tokens of a whole micro-batch this process holds part of)."""
    if mask_BT is None:
        return values_N.mean() if total is None else plain(values_N).sum() / total
    values_N = plain(values_N)  # vocabulary-parallel per-token values: whole, beside the mask
    mask = mask_BT.reshape(-1).float()
    count = mask.sum() if total is None else total
    return (values_N * mask).sum() / count.clamp(min=1.0)


def lm_loss(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    mask_BT: torch.Tensor | None,
    *,
    blocked: bool = True,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over the (unmasked) tokens, computed in fp32. `blocked=False` keeps
    F.cross_entropy on the CPU too (the estimate traces what a GPU runs); ``total``: the
    count to divide by (context parallelism: the whole micro-batch's)."""
    flat = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    labels = labels_BT.reshape(-1)
    if not (blocked and _blockable(flat)) and mask_BT is None and total is None:
        return F.cross_entropy(flat.float(), labels)
    losses, _ = _token_terms(flat, labels, blocked, with_z=False)
    return _mean(losses, mask_BT, total)


def lm_loss_and_z(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    mask_BT: torch.Tensor | None,
    total: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy and PaLM's z-loss term, the mean of logsumexp(logits)^2 over the
    same tokens (``lm_z_loss`` weighs it into the objective)."""
    flat = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    losses, lse = _token_terms(flat, labels_BT.reshape(-1), True, with_z=True)
    assert lse is not None
    return _mean(losses, mask_BT, total), _mean(lse.square(), mask_BT, total)


def token_logp(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, fp32: bool) -> torch.Tensor:
    """The log-probability of each label [B, T] (GPT-NeoX's ``get_logp``: minus the per-token
    cross-entropy), computed in fp32 when ``fp32`` (dpo_fp32, kto_fp32), else in the logits'
    dtype; a plain tensor for vocabulary-parallel logits too."""
    b, t, v = logits_BTV.shape
    flat, labels = logits_BTV.reshape(-1, v), labels_BT.reshape(-1)
    if fp32:
        losses, _ = _token_terms(flat, labels, True, with_z=False)
    else:
        losses = F.cross_entropy(flat, labels, reduction="none")
    return -plain(losses).reshape(b, t)


def kept_logp(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``token_logp`` of a model that may keep fewer positions than the labels (a soft
    prompt's: the text's first seq_length - n_tokens), [B, T] with 0 where nothing was kept
    (out of the loss mask once ``text_kept`` cuts the micro-batch)."""
    kept = logits_BTV.shape[1]
    logp = token_logp(logits_BTV, labels_BT[:, :kept], fp32)
    return F.pad(logp, (0, labels_BT.shape[1] - kept))
