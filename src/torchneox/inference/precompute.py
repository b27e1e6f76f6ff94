"""GPT-NeoX's ``text_gen_type: precompute``: a reference model's log-probabilities, computed once
for every document of the datasets DPO or KTO trains on, so training runs without a second model.

For a dataset PREFIX it writes PREFIX_{precompute_model_name}.bin/.idx (float32), as GPT-NeoX's
precompute_logits writes it: per document, the document padded with 0 (or cut) to seq_length +
1 tokens and the log-probability of each of its tokens after the first, seq_length values. As
in GPT-NeoX, documents are taken in groups of micro-batch x data-parallel size up to a multiple
of 8, the last group wrapping around to the first documents (training reads the first ones), and
a file that exists already is kept.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from torchneox.base.errors import ConfigError
from torchneox.config.paths import dataset_files, refuse_overlap
from torchneox.config.schema import NeoXConfig
from torchneox.data.indexed import IndexedDataset, IndexedDatasetWriter, paths


def precompute_paths(cfg: NeoXConfig) -> list[str]:
    """The datasets whose log-probabilities training reads: train, test and valid (GPT-NeoX's
    order), or for pairs the chosen and rejected ones of each split."""
    d = cfg.data
    if d.train_data_paths:
        keys = ("train_data_paths", "test_data_paths", "valid_data_paths")
    else:
        keys = tuple(
            f"{side}_{s}_data_paths" for s in ("train", "valid", "test") for side in ("pos", "neg")
        )
    return [p for k in keys for p in (getattr(d, k) or [])]


@torch.no_grad()
def document_logprobs(
    model: torch.nn.Module, docs: list[np.ndarray], seq_length: int, device: torch.device
) -> np.ndarray:
    """[len(docs), seq_length] log-probabilities of each document's tokens after the first."""
    tokens = torch.zeros(len(docs), seq_length + 1, dtype=torch.long)
    for row, doc in enumerate(docs):
        cut = torch.from_numpy(np.asarray(doc[: seq_length + 1], dtype=np.int64))
        tokens[row, : len(cut)] = cut
    tokens = tokens.to(device)
    logits = model(tokens[:, :-1]).float()
    labels = tokens[:, 1:]
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
    )
    return (-losses).reshape(len(docs), seq_length).cpu().numpy()


def precompute_logprobs(
    model: torch.nn.Module,
    cfg: NeoXConfig,
    group: int,
    device: torch.device,
    line: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
) -> list[Path]:
    """Write every dataset's log-probabilities under ``precompute_model_name``; ``group`` is
    micro-batch x data-parallel size. Returns the prefixes written (existing ones are kept)."""
    name = cfg.textgen.precompute_model_name
    if not name:
        raise ConfigError(
            "text_gen_type 'precompute' needs precompute_model_name, the suffix of the files it "
            "writes and training reads",
            key="precompute_model_name",
        )
    seq = cfg.model.seq_length
    if seq is None:
        raise ConfigError("precomputing needs seq_length", key="seq_length")
    positions = getattr(getattr(model, "args", None), "max_positions", None)
    if positions is not None and seq > positions:
        raise ConfigError(
            f"{seq} is beyond the model's {positions} positions: precompute with the seq_length "
            "the model was trained with (or fewer)",
            key="seq_length",
        )
    prefixes = list(dict.fromkeys(precompute_paths(cfg)))
    outputs = [f"{p}_{name}{ext}" for p in prefixes for ext in (".bin", ".idx")]
    refuse_overlap(outputs, dataset_files(cfg.data), "precompute")
    model.eval()
    written = []
    for prefix in prefixes:
        out = Path(f"{prefix}_{name}")
        if paths(out)[1].is_file():
            line(f"{out}.idx exists: kept")
            continue
        dataset = IndexedDataset(prefix)
        total = math.ceil(math.ceil(len(dataset) / 8.0) * 8 / group) * group
        writer = IndexedDatasetWriter(out, np.float32)
        start = shown = time.perf_counter()
        try:
            for first in range(0, total, group):
                docs = [dataset[j % len(dataset)] for j in range(first, first + group)]
                for row in document_logprobs(model, docs, seq, device):
                    writer.add_document(row)
                done, now = first + group, time.perf_counter()
                if now - shown > 5 or done >= total:  # progress every few seconds
                    rate = done / max(now - start, 1e-9)
                    eta = (total - done) / max(rate, 1e-9)
                    line(f"{prefix}: {done}/{total} documents, {rate:.1f}/s, ETA {eta:.0f}s")
                    shown = now
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        written.append(out)
    return written
