"""Evaluation: the mean loss over batches (one loop, for validation and test during training
and for ``torchneox eval``'s perplexity of any checkpoint), GPT-NeoX's eval rows, and its
``eval_tasks`` through lm-evaluation-harness."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchneox.base.errors import DataError
from torchneox.data.gpt_dataset import GPTDataset
from torchneox.data.indexed import IndexedDataset
from torchneox.data.loader import BatchLoader
from torchneox.models.mixers.attention import documents
from torchneox.models.transformer import Transformer
from torchneox.train.loss import lm_loss

Values = torch.Tensor | dict[str, torch.Tensor]
BatchLosses = Callable[[list[Any]], list[Any]]


@torch.no_grad()
def mean_loss(model: torch.nn.Module, batches: Iterable[list[Any]], losses_of: BatchLosses) -> Any:
    """The mean of the losses ``losses_of`` gives for each batch (or of each value, when it
    gives dicts of them: lm_loss and an objective's metrics), with ``model`` in eval mode
    (back in train mode after); None when there was no batch."""
    model.eval()
    try:
        losses = [loss for batch in batches for loss in losses_of(batch)]
    finally:
        model.train()
    if not losses:
        return None
    if isinstance(losses[0], dict):
        return {k: torch.stack([v[k] for v in losses]).mean() for k in losses[0]}
    return torch.stack(losses).mean()


def perplexity_of(loss: float) -> float:
    return math.exp(min(loss, 50))


class Evaluator:
    """Validation and test loss on their splits, every eval_interval steps and at the end, and
    the eval_tasks (built from the training and textgen config groups)."""

    def __init__(
        self,
        model: torch.nn.Module,
        eval_iters: int,
        losses_of: BatchLosses,
        mean_over_dp: Callable[[torch.Tensor], torch.Tensor],
        logger: Any,
        textgen: Any = None,
        harness: Any = None,
    ):
        self.model, self.eval_iters, self.losses_of = model, eval_iters, losses_of
        self.mean_over_dp, self.logger = mean_over_dp, logger
        self.textgen, self.harness = textgen, harness

    def loss(self, loader: BatchLoader, iters: int) -> float:
        """The mean loss of up to ``iters`` global batches of ``loader`` (NaN when it has none
        left), the same on every rank."""
        values = self.values(loader, iters)
        return float("nan") if values is None else values["lm_loss"]

    def values(self, loader: BatchLoader, iters: int) -> dict[str, float] | None:
        """lm_loss and the objective's metrics, each the mean over up to ``iters`` global
        batches of ``loader`` (None when it has none left), the same on every rank."""

        def batches():
            for _ in range(iters):
                if not loader.has_full_batch():
                    return
                yield loader.next()

        mean = mean_loss(self.model, batches(), self.losses_of)
        if mean is None:
            return None
        if not isinstance(mean, dict):
            mean = {"lm_loss": mean}
        return {k: self.mean_over_dp(v).item() for k, v in mean.items()}

    def split_row(
        self, name: str, loader: BatchLoader | None, iteration: int, when: str = ""
    ) -> dict[str, Any] | None:
        """Evaluate split ``name`` and log it, as GPT-NeoX's ``{name}_lm_loss``/``_ppl``."""
        if loader is None or self.eval_iters == 0:
            return None
        values = self.values(loader, self.eval_iters)
        if values is None:
            self.logger.line(f"{name}: no whole batch left in the {name} split; not evaluated")
            return None
        loss = values.pop("lm_loss")
        ppl = perplexity_of(loss)
        row = {"iteration": iteration, f"{name}_lm_loss": loss, f"{name}_ppl": ppl}
        row |= {f"{name}_{k}": v for k, v in values.items()}
        self.logger.record(row)
        when = when or f"at step {iteration}"
        extra = "".join(f" | {k} {v:.4g}" for k, v in values.items())
        self.logger.line(f"{name} {when}: loss {loss:.4f} | perplexity {ppl:.2f}{extra}")
        return row

    def tasks_row(self, iteration: int) -> dict[str, Any] | None:
        """GPT-NeoX's eval_tasks: the harness on the current weights; every rank runs the same
        requests (sharded weights need every rank's forward), rank 0 reports."""
        if self.harness is None:
            return None
        from torchneox.train.lm_eval import run_tasks

        tg = self.textgen
        limit = tg.eval_tasks_limit
        limit = int(limit) if limit is not None and limit >= 1 else limit
        results = run_tasks(self.harness, list(tg.eval_tasks), tg.eval_tasks_include_path, limit)
        self.model.train()
        row = {"iteration": iteration, "eval_tasks": results}
        self.logger.record(row)
        for task, metrics in results.items():
            shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items())
            self.logger.line(f"{task} at step {iteration}: {shown}")
        return row


def perplexity(
    model: Transformer,
    prefix: str,
    seq_length: int,
    batches: int,
    batch_size: int,
    seed: int = 1234,
    document_eod: int | None = None,
) -> dict[str, float]:
    """``torchneox eval --data-path``: the mean loss over ``batches`` batches of packed samples
    from all of the dataset's documents (in GPT-NeoX's sample order for ``seed``), and its
    perplexity; with ``document_eod`` (inter_document_attention_masking) each token sees only
    its own document, as in training."""
    ds = IndexedDataset(prefix)
    if len(ds) == 0:
        raise DataError(f"{prefix}: the dataset has no documents")
    vocab = model.args.vocab_size
    if ds.max_token() >= vocab:
        raise DataError(
            f"{prefix}: token id {ds.max_token()} is outside the model's vocabulary of {vocab}"
        )
    samples = GPTDataset(
        ds, "eval", np.arange(len(ds), dtype=np.int32), batches * batch_size, seq_length, seed
    )
    batches = min(batches, len(samples) // batch_size)
    if batches == 0:
        raise DataError(f"{prefix}: fewer than {batch_size} samples of {seq_length + 1} tokens")
    device = model.embed.weight.device

    def batch(b: int) -> list[torch.Tensor]:
        rows = [samples[i] for i in range(b * batch_size, (b + 1) * batch_size)]
        return [torch.from_numpy(np.stack(rows)).to(device)]

    def losses_of(tokens: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for t in tokens:
            extra = {}
            if document_eod is not None:
                positions, segments = documents(t[:, :-1], document_eod)
                extra = {"positions_BT": positions, "segments_BT": segments}
            logits = model(t[:, :-1], **extra)  # a soft prompt's model: the text it left in
            out.append(lm_loss(logits, t[:, 1 : logits.shape[1] + 1], None))
        return out

    loss = mean_loss(model, (batch(b) for b in range(batches)), losses_of).item()
    return {
        "dataset": str(Path(prefix)),
        "batches": batches,
        "tokens": batches * batch_size * seq_length,
        "lm_loss": loss,
        "ppl": perplexity_of(loss),
    }
