"""Where a training process runs and how it joins the others: its device, the process group,
whether a failed collective means a peer is gone; and what a resumed run's context keys
change."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch
import torch.distributed as dist

from torchneox.config.features.offload import offload_spec
from torchneox.parallel import flight_recorder
from torchneox.parallel.dims import init_distributed


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


MMAP_THRESHOLD = 4 << 20
"""glibc's mmap threshold, kept fixed at 4 MiB: a freed allocation larger than this goes back to
the system at once. glibc's default raises the threshold to the size of each large block freed
(up to 32 MiB), so every later temporary of that size stays in the heap after it is freed: a
ZeRO-3 rank of a 1.13 GiB model then peaked at 1.17 x its shards above its baseline, against
0.43 x with a fixed threshold. Not lower: below about 4 MiB each step's activations are mapped
and unmapped again (the demo's model trained at 10.6k tokens/s with 128 KiB, 13.3k with 1 MiB,
18.5k with 4 MiB and 19.0k with glibc's 32 MiB ceiling, on this project's 2-core machine)."""
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def fix_malloc_threshold(device: torch.device) -> bool:
    """On a CPU run under glibc, the mmap threshold fixed at MMAP_THRESHOLD (unless the user's
    MALLOC_MMAP_THRESHOLD_ already sets one); whether it was set."""
    if device.type != "cpu" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own allocator's rules
        return False


def is_lost_rank(error: RuntimeError) -> bool:
    """Whether a collective failed because a peer died or stopped answering (gloo/NCCL)."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or any(
        marker in text
        for marker in ("timed out", "timeout", "connection closed by peer", "connection reset")
    )


def join_processes(cfg: Any, device: torch.device) -> int:
    """The process group (gloo beside the GPU backend under ZeRO-Offload); the world size."""
    return init_distributed(
        device.type,
        cfg.parallel.distributed_backend,
        cfg.parallel.distributed_timeout_minutes,
        offload_spec(cfg.optimizer.zero_optimization, cfg.optimizer.optimizer).enabled,
    )


CONTEXT_KEYS = ("seq_length", "max_position_embeddings", "rotary_emb_base", "rope_scaling")
"""What continued pretraining at a longer context changes (the weights carry over as they are)."""


def context_changes(saved: Any, now: Any) -> list[str]:
    """'key old -> new' for each context key a resumed run changes."""
    out = []
    for key in CONTEXT_KEYS:
        before, after = getattr(saved.model, key), getattr(now.model, key)
        if before != after:
            out.append(f"{key} {before if before is not None else 'unset'} -> {after}")
    return out


def stream_loaders(cfg: Any, derived: Any, layout: Any, dims: Any) -> dict[str, Any]:
    """A streamed run's train/valid/test loaders for this rank (data/stream/), their positions
    gathered from every rank when a checkpoint is saved."""
    from torchneox.data.datasets import num_samples
    from torchneox.data.stream.build import build_loaders

    def gather(mine: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, mine)
        return out

    counts = num_samples(cfg, derived["train_batch_size"])
    many = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    share = {"dp_rank": dims.dp_rank, "dp_size": dims.dp, "gather": gather if many else None}
    return build_loaders(cfg, counts, layout.micro_batch, layout.gas, **share)


def lost_rank_message(trainer: Any, error: RuntimeError) -> str:
    """The one line of a rank whose collective did not complete: the step, the timeout, the
    last collective it entered (torch's flight recorder) and the last good checkpoint."""
    minutes = trainer.cfg.parallel.distributed_timeout_minutes
    first = str(error).strip().splitlines()[0]
    path, last = flight_recorder.dump(trainer.checkpoints.save_dir, trainer.dims.rank)
    where = ""
    if last is not None:
        where = f"; the last collective it entered: {last}"
        where += f" (flight record: {path})" if path is not None else ""
    return (
        f"rank {trainer.dims.rank}: a collective did not complete at step "
        f"{trainer.iteration + 1} (distributed_timeout_minutes is {minutes:g}): another rank "
        f"died or hangs ({first}){where}; {trainer.checkpoints.last_good()}; rerun the same "
        "command to resume once every rank is healthy"
    )
