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

BLOCK_BYTES = 4 << 20  # rows of fp32 logits per block: a few MiB, the size of a core's cache


class _BlockedCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy [N] of logits [N, V] (any float dtype) against labels [N]."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, rows: int) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            block = logits[start : start + rows].float()
            lse[start : start + rows] = torch.logsumexp(block, dim=-1)
        picked = logits.gather(1, labels[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, labels, lse)
        ctx.rows = rows
        return lse - picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels, lse = ctx.saved_tensors
        rows = ctx.rows
        grad = grad.float()
        # the logits are not needed after the loss: their storage becomes their gradient
        for start in range(0, logits.shape[0], rows):
            stop = start + rows
            scale = grad[start:stop, None]
            block = logits[start:stop].float()  # a view when the logits are fp32
            block.sub_(lse[start:stop, None]).exp_().mul_(scale)  # softmax, scaled
            block.scatter_add_(1, labels[start:stop, None], -scale)  # less the one-hot
            if logits.dtype != torch.float32:
                logits[start:stop].copy_(block)
        return logits, None, None


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


def lm_loss(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    mask_BT: torch.Tensor | None,
    *,
    blocked: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy over the (unmasked) tokens, computed in fp32. `blocked=False` keeps
    F.cross_entropy on the CPU too (the estimate traces what a GPU runs)."""
    flat = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    labels = labels_BT.reshape(-1)
    if blocked and _blockable(flat):
        rows = max(1, BLOCK_BYTES // (4 * flat.shape[-1]))
        losses = _BlockedCrossEntropy.apply(flat, labels, rows)
        if mask_BT is None:
            return losses.mean()
    else:
        if mask_BT is None:
            return F.cross_entropy(flat.float(), labels)
        losses = F.cross_entropy(flat.float(), labels, reduction="none")
    mask = mask_BT.reshape(-1).float()
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)
