"""GPT-NeoX's profiling keys: a torch profiler trace over steps profile_step_start..stop, and
a CUDA memory snapshot of the same window (``memory_profiling``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


class Profiler:
    """Started before the first step when ``profile`` or ``memory_profiling`` is set (else
    every call is a no-op); ``step`` after each step, ``stop`` after the last."""

    def __init__(
        self,
        lg: Any,
        save: str | None,
        device: torch.device,
        iteration: int,
        line: Callable[[str], None],
    ):
        self.lg, self.save, self.device, self.line = lg, save, device, line
        self.profiler = self._start(iteration) if lg.profile or lg.memory_profiling else None

    def _cuda_memory(self) -> bool:
        return bool(self.lg.memory_profiling) and self.device.type == "cuda"

    def _start(self, iteration: int) -> torch.profiler.profile:
        lg = self.lg
        folder = Path(lg.tensorboard_dir or lg.log_dir or self.save or ".") / "profile"
        if lg.memory_profiling and self.device.type != "cuda":
            self.line(
                "memory_profiling records CUDA memory snapshots; this run is on the CPU, so it is skipped"
            )
        if self._cuda_memory():
            torch.cuda.memory._record_memory_history(max_entries=100000)
        before = max(lg.profile_step_start - iteration - 1, 0)
        warmup = 1 if before else 0  # the step before the window warms the profiler up
        active = lg.profile_step_stop - lg.profile_step_start + 1
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=before - warmup, warmup=warmup, active=active, repeat=1
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder)),
            profile_memory=lg.memory_profiling,
        )
        profiler.start()
        return profiler

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def stop(self) -> None:
        if self.profiler is None:
            return
        self.profiler.stop()
        if self._cuda_memory():
            self._dump_memory_snapshot()

    def _dump_memory_snapshot(self) -> None:
        lg = self.lg
        folder = Path(lg.memory_profiling_path or lg.log_dir or self.save or ".")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "memory_snapshot.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.line(f"CUDA memory snapshot written to {path} (view it at pytorch.org/memory_viz)")
