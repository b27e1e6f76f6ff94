"""What a run reports: console lines, metrics.jsonl, TensorBoard, W&B, Comet, and timers."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torchneox.base.errors import ConfigError
from torchneox.config.schema import LoggingConfig
from torchneox.reporting import hardware


class Timers:
    """Accumulated wall time per phase between two log lines (wall_clock_breakdown)."""

    def __init__(self, enabled: bool, sync=None):
        self.enabled = enabled
        self.sync = sync
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        if self.sync:
            self.sync()
        start = time.perf_counter()
        yield
        if self.sync:
            self.sync()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def report(self, steps: int) -> str:
        parts = [f"{k} {v / max(steps, 1) * 1000:.1f}" for k, v in self.totals.items()]
        self.totals = {}
        return "time per step (ms): " + ", ".join(parts)


def duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def silence_stdout() -> None:
    """Standard output went away: later prints, and the interpreter's final flush, must not
    fail again (they go to /dev/null)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _drop_cut_line(path: Path) -> None:
    """A run killed while writing metrics.jsonl can leave its last line cut; a resumed run must
    not append after it (the file would stay unreadable there for good)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        f.truncate(f.read().rfind(b"\n") + 1)


def _start_comet(lg: Any, log_dir: Path | None, resolved: dict[str, Any]) -> Any:
    """A Comet experiment as GPT-NeoX starts one (workspace, project, name, tags, others, the
    resolved config as parameters). comet_ml's own settings apply: COMET_API_KEY, and
    COMET_START_ONLINE=false for an offline archive (written to log_dir/comet)."""
    try:
        import comet_ml
    except ImportError:
        raise ConfigError(
            "needs the comet_ml package (pip install 'torchneox[comet]')", key="use_comet"
        ) from None
    settings = comet_ml.ExperimentConfig(
        auto_output_logging=False,
        name=lg.comet_experiment_name,
        tags=list(lg.comet_tags or []) or None,
        offline_directory=str(log_dir / "comet") if log_dir else None,
    )
    experiment = comet_ml.start(
        workspace=lg.comet_workspace, project=lg.comet_project, experiment_config=settings
    )
    experiment.log_parameters(resolved)
    if lg.comet_others:
        experiment.log_others(lg.comet_others)
    return experiment


class MetricsLogger:
    """metrics.jsonl always; TensorBoard, W&B and Comet when the config asks for them."""

    def __init__(
        self, lg: LoggingConfig, log_dir: Path | None, resolved: dict[str, Any], rank0: bool = True
    ):
        """``lg``: the logging config group; ``resolved``: every key's value (what W&B and
        Comet record of the run)."""
        self.rank0 = rank0
        self.tty = sys.stdout.isatty()
        self.file = None
        self.path: Path | None = None
        self.tb = None
        self.wandb = None
        self.comet = None
        if not rank0:
            return
        # opened at the first row: a run refused while it starts writes nothing there
        self.path = log_dir / "metrics.jsonl" if log_dir is not None else None
        if lg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "needs the tensorboard package (pip install 'torchneox[tensorboard]')",
                    key="tensorboard_dir",
                ) from None
            self.tb = SummaryWriter(lg.tensorboard_dir)
        if lg.use_wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError(
                    "needs the wandb package (pip install 'torchneox[wandb]')", key="use_wandb"
                ) from None
            if lg.wandb_host != "https://api.wandb.ai":
                os.environ.setdefault("WANDB_BASE_URL", lg.wandb_host)
            self.wandb = wandb.init(
                project=lg.wandb_project,
                group=lg.wandb_group,
                entity=lg.wandb_team,
                name=lg.wandb_run_name,
                config=resolved,
                dir=str(log_dir) if log_dir else None,
            )
        if lg.use_comet:
            self.comet = _start_comet(lg, log_dir, resolved)

    def record(self, row: dict[str, Any]) -> None:
        if not self.rank0:
            return
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        if self.file is None and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _drop_cut_line(self.path)
            self.file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        if self.file:
            self.file.write(json.dumps(clean) + "\n")
            self.file.flush()
        step = row["iteration"]
        if self.tb:
            for name, value in clean.items():
                if name != "iteration" and isinstance(value, int | float):
                    self.tb.add_scalar(name, value, step)
        if self.wandb:
            self.wandb.log({k: v for k, v in clean.items() if k != "iteration"}, step=step)
        if self.comet:
            numbers = {
                k: v for k, v in clean.items() if k != "iteration" and isinstance(v, int | float)
            }
            self.comet.log_metrics(numbers, step=step)

    def step_text(
        self, row: dict[str, Any], total: int, eta_s: float, metrics: tuple[str, ...] = ()
    ) -> str:
        parts = [
            f"step {row['iteration']}/{total}",
            f"loss {row['lm_loss']:.4f}",
            f"lr {row['lr']:.3e}",
            f"grad {row['grad_norm']:.3f}",
        ]
        if row.get("loss_scale") is not None:
            parts.append(f"scale {row['loss_scale']:g}")
        if row.get("z_loss") is not None:
            parts.append(f"z {row['z_loss']:.3f}")
        if row.get("moe_aux_loss") is not None:
            counts = [c for layer in row["moe_tokens_per_expert"] for c in layer]
            mean = sum(counts) / max(len(counts), 1)
            parts.append(
                f"moe aux {row['moe_aux_loss']:.3f}, busiest expert {max(counts) / max(mean, 1):.2f}x mean"
            )
        # the objective's own metrics (DPO's rewards, KTO's KL, a reward model's accuracy)
        parts += [
            f"{k} {row[k]:,.0f}" if abs(row[k]) >= 1e4 else f"{k} {row[k]:.4g}" for k in metrics
        ]
        parts += [
            f"{row['tokens_per_sec']:,.0f} tok/s",
            f"{row['tflops']:.3g} TFLOP/s",
            f"MFU {row['mfu'] * 100:.1f}%" if row.get("mfu") is not None else "MFU ?",
            f"{row['step_time_s'] * 1000:.0f} ms/step",
            f"ETA {duration(eta_s)}",
        ]
        return " | ".join(parts)

    stdout_lost = False
    """Set when standard output went away (a closed pipe, a dropped terminal): the trainer then
    saves and stops, as for SIGTERM, instead of running on unseen or dying mid-step."""

    def _print(self, text: str, end: str = "\n") -> None:
        if self.stdout_lost:
            return
        try:
            print(text, end=end, flush=True)
        except (BrokenPipeError, OSError):
            self.stdout_lost = True
            silence_stdout()

    def live(self, text: str) -> None:
        """A progress line that the next one overwrites (terminals only)."""
        if self.rank0 and self.tty:
            self._print("\r" + text + "\x1b[K", end="")

    def line(self, text: str) -> None:
        """A permanent line (replacing any live one)."""
        if self.rank0:
            self._print(("\r" if self.tty else "") + text + ("\x1b[K" if self.tty else ""))

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.comet:
            self.comet.end()
            self.comet = None
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


class Throughput:
    """Tokens per second, TFLOP/s per process and model FLOPs utilisation (MFU) against the
    peak: peak_theoretical_tflops when given, else the known GPU's, else (on a CPU) the
    measured matmul peak of this machine."""

    def __init__(
        self,
        given_peak: float | None,
        device: Any,
        precision: str,
        flops_per_token: float,
        world_size: int,
        line: Any,
    ):
        self.given_peak, self.device, self.precision = given_peak, device, precision
        self.flops_per_token, self.world_size, self.line = flops_per_token, world_size, line
        self.peak_tflops, self.peak_source = self._peak()

    def _peak(self) -> tuple[float | None, str]:
        if self.given_peak:
            return self.given_peak, f"peak_theoretical_tflops {self.given_peak:g}"
        acc = hardware.detect(self.device)
        if acc is not None:
            peak = hardware.peak_tflops(acc, self.precision)
            return peak, f"{acc.name} {self.precision} peak {peak:g} TFLOP/s"
        if self.device.type == "cpu":
            peak = hardware.cpu_peak_tflops(self.precision)
            return peak, f"this CPU's measured {self.precision} matmul peak {peak:.3g} TFLOP/s"
        return None, "unknown device: set peak_theoretical_tflops for MFU"

    def measure(self, tokens_per_step: int, seconds: float) -> dict[str, Any]:
        tokens_per_sec = tokens_per_step / seconds
        tflops = self.flops_per_token * tokens_per_sec / self.world_size / 1e12
        return {"tokens_per_sec": tokens_per_sec, "tflops": tflops, "mfu": self._mfu(tflops)}

    def _mfu(self, tflops: float) -> float | None:
        """Never above 1: a measured CPU peak that a step beat was too low, and is raised (and
        cached) to what the step achieved."""
        if not self.peak_tflops:
            return None
        if tflops > self.peak_tflops and self.device.type == "cpu" and not self.given_peak:
            hardware.raise_cpu_peak(self.precision, tflops)
            self.line(
                f"a step ran at {tflops:.3g} TFLOP/s, above the measured peak "
                f"{self.peak_tflops:.3g}: the peak is raised to it"
            )
            self.peak_tflops = tflops
        return min(tflops / self.peak_tflops, 1.0)
