"""StreamLoader: a rank's micro-batches of a streamed split, with BatchLoader's interface (next,
state_dict, load_state_dict, close), tokenized in ``num_workers`` processes and prepared a
batch ahead in a thread.

Its state is every data-parallel rank's position in every source (gathered when saved: rank 0
writes the checkpoint's metadata) beside the samples consumed. It resumes only with the
data-parallel size it was saved with: each rank read its own documents, so another size would
read others (refused in one line); the worker count is free to change (the order does not
depend on it).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from torchneox.base.errors import ConfigError
from torchneox.data.stream.encode import Encoder, Tokenize
from torchneox.data.stream.order import EmptySplit
from torchneox.data.stream.samples import StreamSplit

Gather = Callable[[Any], list[Any]]
"""Every rank's object, in rank order (the trainer's all_gather_object); None: one process."""


class StreamLoader:
    def __init__(
        self,
        split: StreamSplit,
        micro_batch: int,
        grad_accum: int,
        encoder: Encoder,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        workers: int = 0,
        prefetch: bool = False,
        fingerprint: str = "",
        gather: Gather | None = None,
        skip_bad: bool = False,
    ):
        self.split, self.micro_batch, self.grad_accum = split, micro_batch, grad_accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.fingerprint, self.gather = fingerprint, gather
        self.tokenize = Tokenize(encoder, workers)
        split.set_tokenize(self.tokenize)
        self.prefetch = prefetch
        self.consumed = 0
        self._position = split.state()  # after the last batch handed out
        self._bad = 0
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        self._peeked: Any = None  # an evaluation batch produced by has_full_batch
        self._empty: EmptySplit | None = None
        self.stats: dict[str, float] = {"skipped_records": 0.0} if skip_bad else {}
        self.console = ("skipped_records",) if skip_bad else ()

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    def _produce(self) -> tuple[list[torch.Tensor], dict[str, Any], int]:
        batches = []
        for _ in range(self.grad_accum):
            rows = [self.split.next() for _ in range(self.micro_batch)]
            batches.append(torch.from_numpy(np.stack(rows)))
        return batches, self.split.state(), self.split.bad_records

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item: Any = self._produce()
            except BaseException as e:  # handed to next(), raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def next(self) -> list[torch.Tensor]:
        """This rank's micro-batches ([mb, seq + 1] int64 each) of the next global batch."""
        if self._empty is not None:
            raise self._empty
        if self._peeked is not None:
            item: Any = self._peeked
            self._peeked = None
        elif not self.prefetch:
            item = self._produce()
        else:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream", daemon=True)
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
        batches, self._position, self._bad = item
        self.consumed += self.global_batch
        if self.stats:
            self.stats["skipped_records"] = float(self._bad)
        return batches

    def has_full_batch(self) -> bool:
        """A stream runs epoch after epoch; an evaluation split without documents (a small
        corpus's held-out share, on some rank) is not evaluated, on any rank."""
        if self.prefetch:
            return True
        if self._peeked is None and not self._empty:
            try:
                self._peeked = self._produce()
            except EmptySplit as e:
                self._empty = e
        if self.gather is None:
            return self._empty is None
        return not any(self.gather(self._empty is not None))

    def state_dict(self) -> dict[str, Any]:
        mine = (self.dp_rank, copy.deepcopy(self._position))
        everyone = self.gather(mine) if self.gather is not None else [mine]
        ranks: dict[int, Any] = {}
        for rank, position in everyone:
            ranks.setdefault(int(rank), position)
        return {
            "consumed_samples": self.consumed,
            "stream": {
                "data_parallel": self.dp_size,
                "fingerprint": self.fingerprint,
                "ranks": [ranks[r] for r in range(self.dp_size)],
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("stream")
        if saved is None:
            raise ConfigError(
                "the checkpoint's data was read from .bin/.idx datasets, this run streams raw "
                "text: resume with the data it was saved with, or start a new run"
            )
        if saved["data_parallel"] != self.dp_size:
            raise ConfigError(
                f"the checkpoint's streamed data was read by {saved['data_parallel']} "
                f"data-parallel ranks, this run has {self.dp_size}: each rank read its own "
                "documents, so a stream resumes with the data-parallel size it was saved with"
            )
        if saved["fingerprint"] != self.fingerprint:
            raise ConfigError(
                "the streamed data changed since the checkpoint was saved (paths, weights, "
                "split, seq_length, seed, jsonl_keys, the tokenizer or the shuffle): resume "
                "with the data keys it was saved with"
            )
        self._halt()
        self._peeked, self._empty = None, None
        self._position = copy.deepcopy(saved["ranks"][self.dp_rank])
        self.split.load(self._position)
        self.consumed = int(state["consumed_samples"])

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread, self._queue = None, queue.Queue(maxsize=2)
            self._stop = threading.Event()

    def close(self) -> None:
        self._halt()
        self.tokenize.close()
