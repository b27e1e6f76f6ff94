"""A process of its own that writes a rank's checkpoint shards (``async_checkpoint_writer:
process``).

torch distributed checkpoint saves in four parts: every rank plans which pieces of its state
it holds, rank 0 turns the plans into one global plan (which rank writes what, under which file
prefix) and the checkpoint's metadata, each rank writes its pieces, and rank 0 writes the
metadata with where each piece landed. Here the training processes plan, collectively and at
once (small objects), and copy the pieces they write into shared memory; the writing, the part
that takes time, runs in a writer process started once per rank, so neither its Python nor its
file I/O share the training loop's interpreter; rank 0 writes the metadata when every rank's
writer has answered. The files are those ``dcp.save`` writes for the same state.

The writer watches its parent: if the training process is gone (killed), it exits at once, even
in the middle of a write, so it never outlives the run by more than a moment; a half-written
directory it leaves is a partial one, never read.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem

from torchneox.base.errors import first_line
from torchneox.base.faults import fault_point
from torchneox.checkpoint.files import os_reason

Key = tuple[str, tuple[int, ...] | None]


def _key(item: WriteItem) -> Key:
    offset = item.index.offset
    return item.index.fqn, None if offset is None else tuple(offset)


Layout = dict[Key, tuple[int, torch.dtype, tuple[int, ...]]]
"""Where each staged tensor sits in the one shared buffer: byte offset, dtype, shape."""


def _piece(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]):
    size = torch.Size(shape).numel() * dtype.itemsize
    return flat[offset : offset + size].view(dtype).view(shape)


class _Staged(SavePlanner):
    """The writer process's planner: it only hands the file writer the staged pieces."""

    def __init__(self, flat: torch.Tensor, layout: Layout, objects: dict[Key, bytes]):
        self.flat, self.layout, self.objects = flat, layout, objects

    def resolve_data(self, write_item: WriteItem) -> Any:
        key = _key(write_item)
        if key in self.objects:
            return io.BytesIO(self.objects[key])
        return _piece(self.flat, *self.layout[key])

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:  # pragma: no cover
        raise NotImplementedError("the writer process only writes a finished plan")

    create_local_plan = create_global_plan = finish_plan = set_up_planner  # type: ignore


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.2)
        if os.getppid() != parent:
            os._exit(0)  # the training process is gone: stop writing now


def _serve(conn: Any, parent: int) -> None:
    """The writer process: write each plan it is sent; answer its results or its error."""
    torch.set_num_threads(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        writer, plan, staged = request
        try:
            fault_point("writer.write")
            written = writer.write_data(plan, _Staged(*staged))
            written.wait()
            conn.send(written.value())
        except Exception as e:  # sent back, raised in the training process
            conn.send(OSError(os_reason(e)))
        del request, staged


class WriterProcess:
    """This rank's writer process and the state staged for it (buffers reused across saves)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        self.flat = torch.empty(0, dtype=torch.uint8)
        """The staged tensors, in one shared-memory buffer (one file descriptor, however many
        tensors; reused while the state keeps its shapes)."""
        self.layout: Layout = {}
        self.pending: tuple[FileSystemWriter, Metadata | None] | None = None
        self.answer: Any = None

    def _stage(self, values: dict[Key, Any]) -> tuple[torch.Tensor, Layout, dict[Key, bytes]]:
        """Copy this rank's pieces: tensors into the shared buffer, objects as their bytes."""
        layout: Layout = {}
        objects: dict[Key, bytes] = {}
        end = 0
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                objects[key] = value.getvalue()  # a pickled object
                continue
            layout[key] = (end, value.dtype, tuple(value.shape))
            end += -(-value.numel() * value.element_size() // 64) * 64  # aligned for any dtype
        if layout != self.layout:
            self.flat = torch.empty(end, dtype=torch.uint8).share_memory_()
            self.layout = layout
        for key, where in layout.items():
            _piece(self.flat, *where).copy_(values[key].detach())
        return self.flat, layout, objects

    def start(self, state: dict[str, Any], path: str, group: Any) -> None:
        """Plan ``state``'s save into ``path`` with the other ranks (collective over ``group``),
        copy this rank's pieces and hand them to the writer process."""
        rank = dist.get_rank(group) if group is not None else 0
        writer = FileSystemWriter(path)
        planner = DefaultSavePlanner()
        planner.set_up_planner(
            state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0
        )
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
        plans: list[SavePlan] = [local]
        if group is not None:
            plans = [None] * dist.get_world_size(group) if rank == 0 else None  # type: ignore
            dist.gather_object(local, plans, dst=0, group=group)
        metadata = None
        central: list[Any] = [None]
        if rank == 0:
            plans, metadata = planner.create_global_plan(plans)
            plans = writer.prepare_global_plan(plans)
        if group is not None:
            dist.scatter_object_list(central, plans if rank == 0 else None, src=0, group=group)
        else:
            central = plans
        plan = planner.finish_plan(central[0])
        self.answer = None
        self.pending = (writer, metadata)
        try:
            staged = self._stage({_key(item): planner.resolve_data(item) for item in plan.items})
        except RuntimeError as e:  # no room in /dev/shm, a file-size limit: this save fails,
            # as every rank learns when it is finished (a collective), like a failed write
            self.answer = OSError(f"staging the state in shared memory failed: {first_line(e)}")
            return
        self.conn.send((writer, plan, staged))

    def done(self) -> bool:
        """Whether the writer has answered (the shards are written, or the write failed)."""
        if self.answer is None and self.conn.poll():
            self.answer = self.conn.recv()
        return self.answer is not None or not self.proc.is_alive()

    def finish(self, group: Any) -> None:
        """Wait for the write, then (rank 0, with every rank's results) write the metadata;
        raises OSError when any rank's write failed."""
        while not self.done():
            time.sleep(0.01)
        answer = self.answer
        if answer is None:
            answer = OSError(f"the checkpoint writer process died (exit code {self.proc.exitcode})")
        assert self.pending is not None
        writer, metadata = self.pending
        self.pending, self.answer = None, None
        mine = answer if isinstance(answer, list) else str(answer)
        everyone = [mine]
        if group is not None:
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
        failed = [(r, a) for r, a in enumerate(everyone) if not isinstance(a, list)]
        if failed:
            rank, error = failed[0]
            raise OSError(f"on rank {rank}: {error}")
        if metadata is not None:  # rank 0
            writer.finish(metadata, everyone)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
