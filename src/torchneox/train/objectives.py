"""What a batch's loss is. Pretraining's objective is GPT-NeoX's language-modelling loss:
the mean next-token cross-entropy (optionally without the positions after an end-of-document
token, ``eod_mask_loss``), plus PaLM's z-loss when ``lm_z_loss`` is set and the MoE routers'
load-balancing loss weighted by ``moe_aux_loss_coeff``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchneox.models.moe import RouterStats, balancing_loss
from torchneox.train.loss import lm_loss, lm_loss_and_z


@dataclass
class Terms:
    """One micro-batch's loss (what is logged), the objective backward runs on, and the
    extra terms it holds (detached, for the logs)."""

    loss: torch.Tensor
    objective: torch.Tensor
    z_loss: torch.Tensor | None = None
    moe_aux_loss: torch.Tensor | None = None


@dataclass
class LanguageModeling:
    eod_id: int | None = None  # eod_mask_loss: the end-of-document token, else None
    z_weight: float = 0.0  # lm_z_loss
    aux_weight: float = 0.0  # moe_aux_loss_coeff

    def mask(self, inputs_BT: torch.Tensor) -> torch.Tensor | None:
        """Which positions count: all, or (eod_mask_loss) those whose input is not the EOD."""
        return (inputs_BT != self.eod_id) if self.eod_id is not None else None

    def terms(
        self,
        logits: torch.Tensor,
        labels_BT: torch.Tensor,
        mask_BT: torch.Tensor | None,
        router_stats: list[RouterStats] | None = None,
        placed=None,
    ) -> Terms:
        """``router_stats``: every MoE layer's statistics over the whole batch (summed over the
        ranks that split it); ``placed(term, like)`` puts a term beside a distributed loss."""
        if self.z_weight:
            loss, z = lm_loss_and_z(logits, labels_BT, mask_BT)
            out = Terms(loss, loss + self.z_weight * z, z_loss=z.detach())
        else:
            loss = lm_loss(logits, labels_BT, mask_BT)
            out = Terms(loss, loss)
        if router_stats:
            aux = torch.stack([balancing_loss(s) for s in router_stats]).mean()
            weighted = self.aux_weight * aux
            out.objective = out.objective + (placed(weighted, loss) if placed else weighted)
            out.moe_aux_loss = aux.detach().float()
        return out
