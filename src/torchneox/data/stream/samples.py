"""A rank's samples of a streamed split: each source's documents packed as GPT-NeoX packs them
(each document's ids then EOD, concatenated, cut into samples of seq_length + 1 tokens, the
last token of a sample the first of the next, documents running across samples), the sources
mixed by weight as GPT-NeoX blends (each sample from the source furthest behind its share).

A .bin/.idx source in the mix gives its GPTDataset's samples (GPT-NeoX's order), the rank's
every R-th. Every source's position is a plain dict; the split's state is theirs and the count
each source gave, so a checkpoint resumes every source where it was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from torchneox.base.errors import DataError
from torchneox.data.blend import normalize
from torchneox.data.gpt_dataset import GPTDataset
from torchneox.data.stream.encode import Encoded
from torchneox.data.stream.order import DocStream, start
from torchneox.data.stream.readers import Record

TokenizeFn = Callable[[list[Record]], Iterator[Encoded]]


class PackedSource:
    """The packed samples of one streamed source for one rank."""

    def __init__(self, docs: DocStream, seq_length: int, skip_bad: bool):
        self.docs, self.seq, self.skip_bad = docs, seq_length, skip_bad
        self.tokenize: TokenizeFn | None = None  # set by the loader (its workers)
        self.bad = 0
        self.load({"window": start(), "k": 0, "offset": 0})

    def load(self, position: dict[str, Any]) -> None:
        self.position = {
            "window": dict(position["window"]),
            "k": int(position["k"]),
            "offset": int(position["offset"]),
        }
        self._queue: deque[list[Any]] = deque()  # [window, k, ids]
        self._head = 0
        self._stream: Iterator[tuple[dict, int, np.ndarray]] | None = None

    def state(self) -> dict[str, Any]:
        if self._stream is None:
            return {**self.position, "window": dict(self.position["window"])}
        if self._queue:
            window, k, _ = self._queue[0]
            return {"window": dict(window), "k": k, "offset": self._head}
        return {"window": dict(self._next[0]), "k": self._next[1], "offset": 0}

    def _documents(self) -> Iterator[tuple[dict, int, np.ndarray]]:
        assert self.tokenize is not None
        at = self.position
        skip, lapped, last = at["k"], 0, at["window"]["epoch"]
        for window, records in self.docs.windows(at["window"]):
            if window["epoch"] > last:
                lapped, last = lapped + 1, window["epoch"]
                if lapped > 1:
                    raise DataError(
                        f"{self.docs.source.path}: a whole epoch without text to train on "
                        f"(every document empty or bad: {self.bad} bad)"
                    )
            for k, (ids, fault) in enumerate(self.tokenize(records[skip:]), start=skip):
                self._next = (window, k + 1)
                if ids is None:
                    if not self.skip_bad:
                        raise DataError(fault + "; fix it, or set skip_bad_records: true")
                    self.bad += 1
                    continue
                if len(ids):
                    lapped = 0
                    yield window, k, ids
            skip = 0

    def sample(self) -> np.ndarray:
        if self._stream is None:
            self._next = (self.position["window"], self.position["k"])
            self._stream = self._documents()
            self._head = self.position["offset"]
        need = self.seq + 1
        have = sum(len(q[2]) for q in self._queue) - self._head
        while have < need:
            window, k, ids = next(self._stream)
            self._queue.append([window, k, ids])
            have += len(ids)
        parts, left, head = [], need, self._head
        for _, _, ids in self._queue:
            part = ids[head : head + left]
            parts.append(part)
            left -= len(part)
            head = 0
            if not left:
                break
        self._head += self.seq
        while self._queue and self._head >= len(self._queue[0][2]):
            self._head -= len(self._queue.popleft()[2])
        return np.concatenate(parts).astype(np.int64)


class IndexedSource:
    """A .bin/.idx dataset in a streamed mix: its samples in GPT-NeoX's order, the rank's every
    ``ranks``-th."""

    def __init__(self, dataset: GPTDataset, rank: int, ranks: int):
        self.dataset, self.rank, self.ranks = dataset, rank, ranks
        self.taken, self.bad = 0, 0

    def sample(self) -> np.ndarray:
        out = self.dataset[self.taken * self.ranks + self.rank]
        self.taken += 1
        assert isinstance(out, np.ndarray)
        return out

    def state(self) -> dict[str, Any]:
        return {"taken": self.taken}

    def load(self, position: dict[str, Any]) -> None:
        self.taken = int(position["taken"])


class StreamSplit:
    """One rank's samples of a split: its sources mixed by weight, in GPT-NeoX's blend order."""

    def __init__(self, sources: list[Any], weights: list[float], names: list[str]):
        self.sources, self.weights, self.names = sources, normalize(weights), names
        self.taken = [0] * len(sources)
        self.skipped = 0  # bad records skipped before the position last loaded

    def next(self) -> np.ndarray:
        x = max(float(sum(self.taken)), 1.0)
        errors = [w * x - t for w, t in zip(self.weights, self.taken, strict=True)]
        best = int(np.argmax(errors))  # the first on ties
        self.taken[best] += 1
        return self.sources[best].sample()

    def state(self) -> dict[str, Any]:
        return {
            "taken": list(self.taken),
            "sources": [s.state() for s in self.sources],
            "skipped": self.bad_records,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.taken = [int(t) for t in state["taken"]]
        self.skipped = int(state.get("skipped", 0))
        for source in self.sources:
            source.bad = 0
        for source, position in zip(self.sources, state["sources"], strict=True):
            source.load(position)

    @property
    def bad_records(self) -> int:
        return self.skipped + sum(s.bad for s in self.sources)

    def set_tokenize(self, tokenize: TokenizeFn) -> None:
        for s in self.sources:
            if isinstance(s, PackedSource):
                s.tokenize = tokenize
