"""Checkpoints written in the background (``async_checkpointing``).

At a save step every rank copies its state into memory of its own and it is written into the
save's ``.global_stepN.partial`` directory while training goes on: by a writer process per rank
(``async_checkpoint_writer: process``, the default; ``writer.py``: the copy sits in
shared memory and the writing shares nothing with the training loop), or by torch distributed
checkpoint's ``async_save`` thread (``thread``). At each later step boundary the ranks agree
whether every one of them has finished (one small collective, only while a save is in flight);
then the save is finished exactly as a synchronous one is: the config, the metadata and the
manifest written, the directory renamed, ``latest`` moved. So the guarantees of
docs/reliability.md hold unchanged: a kill at any moment leaves the last finished checkpoint
as ``latest`` (a partial directory is never read), and a write that fails stops the run with
the previous checkpoint kept. One save is in flight at a time: the next one, and the end of the
run, first wait for it.
"""

from __future__ import annotations

import os
import shutil
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
from torchneox.checkpoint.files import (
    prepare_partial,
    save_checkpoint,
    step_dir_name,
    write_failure,
)


class BackgroundSaves:
    """The run's one background save in flight, started by ``start`` and finished by
    ``finish`` (by every rank at the same step)."""

    def __init__(self, root: Path, config_yaml: str, line: Any, writer: str = "process"):
        self.root, self.config_yaml, self.line = root, config_yaml, line
        self.pending: tuple[int, Future | None, dict] | None = None
        self._groups: tuple[Any, Any] | None = None
        self.process = None
        if writer == "process":  # started with the run, so that it is ready by the first save
            from torchneox.checkpoint.writer import WriterProcess

            self.process = WriterProcess()

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
        future = None
        try:
            prepare_partial(self.root, tmp)
            if self.process is not None and not self._room_for(tensors):
                self.process.close()
                self.process = None
            if self.process is not None:
                self.process.start(tensors, str(tmp), writer_group)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # DCP warns without a process group
                    future = dcp.async_save(
                        tensors,
                        checkpoint_id=str(tmp),
                        process_group=writer_group,
                        no_dist=not dist.is_initialized(),
                    )
        except (OSError, CheckpointException) as e:
            if not dist.is_initialized() or dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left
            raise TrainingStopped(write_failure(self.root, final, e)) from None
        self.pending = (iteration, future, meta)
        fault_point("save.staged", iteration)  # the files are being written behind the step

    def _room_for(self, tensors: dict[str, Any]) -> bool:
        """Whether shared memory can hold the staged state (once its buffers exist, it can);
        if not, the run says so and the writer thread takes over."""
        assert self.process is not None
        if self.process.layout:
            return True
        need = sum(t.numel() * t.element_size() for t in _local_tensors(tensors))
        try:
            stats = os.statvfs("/dev/shm")
            free = stats.f_bavail * stats.f_frsize
        except OSError:
            free = 0
        if need <= 0.9 * free:
            return True
        self.line(
            f"async_checkpoint_writer: process needs {need / 2**30:.2f} GiB of shared memory "
            f"(/dev/shm) for the staged state and {free / 2**30:.2f} GiB is free; writing "
            "checkpoints with the writer thread instead (async_checkpoint_writer: thread)"
        )
        return False

    def _done_everywhere(self, future: Future | None) -> bool:
        mine = self.process.done() if future is None and self.process else future.done()
        done = torch.tensor([1 if mine else 0])
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
            if future is not None:
                future.result()  # the write's own error, if it failed
            else:  # every rank's writer answered: rank 0 writes the shards' metadata
                assert self.process is not None
                self.process.finish(self.groups()[0])

        try:
            save_checkpoint(self.root, iteration, {}, self.config_yaml, meta, writer=written)
        except CheckpointWriteError as e:
            raise TrainingStopped(str(e)) from None
        return True

    def close(self) -> None:
        """Stop the writer process (after the last save is finished)."""
        if self.process is not None:
            self.process.close()
            self.process = None


def _local_tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a nested state dict as this rank holds them (a DTensor's local shard)."""
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _local_tensors(v)]
    if isinstance(tree, torch.Tensor):
        return [tree.to_local() if hasattr(tree, "to_local") else tree]
    return []
