"""Checkpoints written in the background (``async_checkpointing``).

At a save step every rank copies its state into memory of its own (torch distributed
checkpoint's ``async_save`` stages it) and a thread writes the files into the save's
``.global_stepN.partial`` directory while training goes on. At each later step boundary the
ranks agree whether every one of them has finished (one small collective, only while a save
is in flight); then the save is finished exactly as a synchronous one is: the config, the
metadata and the manifest written, the directory renamed, ``latest`` moved. So the guarantees
of docs/reliability.md hold unchanged: a kill at any moment leaves the last finished checkpoint
as ``latest`` (a partial directory is never read), and a write that fails stops the run with
the previous checkpoint kept. One save is in flight at a time: the next one, and the end of the
run, first wait for it.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchneox.base.errors import CheckpointWriteError, TrainingStopped
from torchneox.base.faults import fault_point
from torchneox.train.checkpoint import (
    prepare_partial,
    save_checkpoint,
    step_dir_name,
    write_failure,
)


class BackgroundSaves:
    """The run's one background save in flight, started by ``start`` and finished by
    ``finish`` (by every rank at the same step)."""

    def __init__(self, root: Path, config_yaml: str, line: Any):
        self.root, self.config_yaml, self.line = root, config_yaml, line
        self.pending: tuple[int, Future, dict] | None = None
        self._groups: tuple[Any, Any] | None = None

    def groups(self) -> tuple[Any, Any]:
        """(the writer thread's process group, the step-boundary poll's): gloo groups of their
        own, so that neither crosses the training's collectives (made once, collectively)."""
        if self._groups is None:
            if dist.is_initialized():
                self._groups = (dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
            else:
                self._groups = (None, None)
        return self._groups

    def start(self, iteration: int, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        """Stage ``tensors`` and begin writing them as global_step{iteration}."""
        self.finish(wait=True)
        final = self.root / step_dir_name(iteration)
        tmp = self.root / f".{final.name}.partial"
        writer_group, _ = self.groups()
        try:
            prepare_partial(self.root, tmp)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP warns when no process group is initialised
                future = dcp.async_save(
                    tensors,
                    checkpoint_id=str(tmp),
                    process_group=writer_group,
                    no_dist=not dist.is_initialized(),
                )
        except (OSError, CheckpointException) as e:
            raise TrainingStopped(write_failure(self.root, final, e)) from None
        self.pending = (iteration, future, meta)
        fault_point("save.staged", iteration)  # the files are being written behind the step

    def _done_everywhere(self, future: Future) -> bool:
        done = torch.tensor([1 if future.done() else 0])
        _, poll_group = self.groups()
        if poll_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=poll_group)
        return bool(done.item())

    def finish(self, wait: bool) -> bool:
        """Finish the save in flight once every rank has written it (``wait``: block until
        then); whether a save was finished."""
        if self.pending is None:
            return False
        iteration, future, meta = self.pending
        if not wait and not self._done_everywhere(future):
            return False
        self.pending = None

        def written(_state: Any, _tmp: Path) -> None:
            future.result()  # the write's own error, if it failed

        try:
            save_checkpoint(self.root, iteration, {}, self.config_yaml, meta, writer=written)
        except CheckpointWriteError as e:
            raise TrainingStopped(str(e)) from None
        return True
