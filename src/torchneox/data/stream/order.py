"""The order a streamed source's documents are read in, by one data-parallel rank.

Epoch after epoch (without end): the units (files, parquet row groups) in an order drawn from
(seed, source, epoch), each unit's records in order. Of those records the split keeps its own
(data_path's split: a record is held out for valid or test by a hash of its unit and row, the
same every epoch and whatever the seed), and of the kept ones rank r of R reads the r-th of
every R. The rank's records are taken in windows of ``stream_shuffle_buffer``, each shuffled
by (seed, source, epoch, window): memory holds one window, whatever the corpus's size.

A window starts at a position, a plain dict (epoch, unit, row, byte, kept, window): reading
again from it gives the same window, which is how a checkpoint resumes the stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from torchneox.base.errors import DataError
from torchneox.data.stream.readers import Record, read_unit
from torchneox.data.stream.sources import Source

MASK = (1 << 64) - 1


class EmptySplit(DataError):
    """A source with no documents for a split (or a rank): an evaluation split is then not
    evaluated, a training split stops the run."""


def start() -> dict[str, int]:
    return {"epoch": 0, "unit": 0, "row": 0, "byte": 0, "kept": 0, "window": 0}


def unit_hash(unit: int, row: int) -> float:
    """splitmix64 of (unit, row), in [0, 1)."""
    z = ((unit << 32) + row + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


@dataclass(frozen=True)
class Placement:
    """Whose documents these are: the rank's, the split's, in which order."""

    seed: int
    index: int  # the source's place among its split's sources (its own random streams)
    rank: int = 0
    ranks: int = 1
    shuffle: bool = True
    buffer: int = 1024
    held: tuple[float, float] | None = None  # the hash range this split keeps; None: all


class DocStream:
    def __init__(self, source: Source, key: str, place: Placement):
        self.source, self.key, self.place = source, key, place

    def unit_order(self, epoch: int) -> np.ndarray:
        n = len(self.source.units)
        if not self.place.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.place.seed, self.place.index, epoch]).permutation(n)

    def _shuffled(self, window: list[Record], epoch: int, number: int) -> list[Record]:
        if not self.place.shuffle:
            return window
        p = self.place
        perm = np.random.default_rng([p.seed, p.index, epoch, number + 1]).permutation(len(window))
        return [window[i] for i in perm]

    def _keeps(self, unit: int, row: int) -> bool:
        if self.place.held is None:
            return True
        low, high = self.place.held
        return low <= unit_hash(unit, row) < high

    def windows(self, at: dict[str, int]) -> Iterator[tuple[dict[str, int], list[Record]]]:
        """(the window's start, its records shuffled) from the window starting at ``at`` on."""
        p, s = self.place, dict(at)
        while True:
            epoch, whole, got = s["epoch"], s["unit"] == s["row"] == s["kept"] == 0, 0
            order = self.unit_order(epoch)
            kept, number, window, first = s["kept"], s["window"], [], dict(s)
            for u in range(s["unit"], len(order)):
                unit = self.source.units[int(order[u])]
                at = (s["row"], s["byte"]) if u == s["unit"] else (0, 0)
                for row, byte, record in read_unit(unit, self.key, *at):
                    if not self._keeps(int(order[u]), row):
                        continue
                    kept += 1
                    if (kept - 1) % p.ranks != p.rank:
                        continue
                    window.append(record)
                    got += 1
                    if len(window) == p.buffer:
                        yield first, self._shuffled(window, epoch, number)
                        number += 1
                        window = []
                        first = dict(epoch=epoch, unit=u, row=row, byte=byte, kept=kept)
                        first["window"] = number
            if window:
                yield first, self._shuffled(window, epoch, number)
            if whole and not got:
                raise EmptySplit(
                    f"{self.source.path}: no documents for this split"
                    + (f" on data-parallel rank {p.rank} of {p.ranks}" if p.ranks > 1 else "")
                    + "; add data, or give the split its own paths"
                )
            s = start() | {"epoch": epoch + 1}
