"""``torchneox plot``: training and validation loss (or another logged metric: a reinforce
run's reward, KL, completion length) of one or more runs, as a PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torchneox.base.errors import ConfigError
from torchneox.config.paths import atomic_output

Point = tuple[int, float]


def _row(raw: bytes, metric: str = "lm_loss") -> dict | None:
    """A metrics record, or None when the line is not one (not UTF-8, not JSON, not an object
    with an integer iteration and numeric values of ``metric`` and valid_``metric``)."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError both
        return None
    if not isinstance(row, dict) or type(row.get("iteration")) is not int:
        return None
    for key in (metric, f"valid_{metric}"):
        value = row.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            return None
    return row


def metrics_file(run: Path) -> Path:
    """What plot reads of a run: its metrics.jsonl (or the file given)."""
    return run / "metrics.jsonl" if run.is_dir() else run


def run_files(run: Path) -> list[Path]:
    """What a plot must not write over: the run's metrics and, in a run folder, its
    checkpoints (the ``latest`` pointer and every ``global_stepN`` folder)."""
    folder = run if run.is_dir() else run.parent
    return [metrics_file(run), folder / "latest", *sorted(folder.glob("global_step*"))]


def read_metrics(run: Path, metric: str = "lm_loss") -> tuple[list[Point], list[Point]]:
    """The training and validation values of ``metric`` in a run's metrics.jsonl. Lines that are no record
    (a line cut by a kill, damage) are skipped with one warning saying how many and where the
    first is; a file with nothing to plot is refused."""
    path = metrics_file(run)
    if not path.is_file():
        raise ConfigError("no metrics.jsonl here (is it a run's save or log_dir?)", source=str(run))
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as e:
        raise ConfigError(f"cannot read it ({e.strerror or e})", source=str(path)) from None
    train: list[Point] = []
    valid: list[Point] = []
    bad: list[int] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = _row(line, metric)
        if row is None:
            bad.append(number)
            continue
        if row.get(metric) is not None:
            train.append((row["iteration"], row[metric]))
        if row.get(f"valid_{metric}") is not None:
            valid.append((row["iteration"], row[f"valid_{metric}"]))
    if not train and not valid:
        records = sum(1 for line in lines if line.strip()) - len(bad)
        if records:
            why = f"no {metric} or valid_{metric} in it, nothing to plot"
        elif bad:
            why = (
                f"no line of it is a metrics record ({len(bad)} unreadable, the first is line "
                f"{bad[0]}); is it a run's metrics.jsonl?"
            )
        else:
            why = "empty: no step has been logged yet, nothing to plot"
        raise ConfigError(why, source=str(path))
    if bad:
        print(
            f"warning: {path}: skipped {len(bad)} unreadable line{'s' * (len(bad) > 1)} (the "
            f"first is line {bad[0]}); plotted the other {len(train) + len(valid)} points",
            file=sys.stderr,
        )
    return train, valid


def plot_runs(runs: list[Path], out: Path, metric: str = "lm_loss") -> None:
    curves = [
        (run, *read_metrics(run, metric)) for run in runs
    ]  # every file checked before drawing
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib (pip install 'torchneox[plot]')") from None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for run, train, valid in curves:
        name = run.name or str(run)
        color = None
        if train:
            color = ax.plot(*zip(*train, strict=True), label=f"{name} train")[0].get_color()
        if valid:
            ax.plot(*zip(*valid, strict=True), "o--", color=color, label=f"{name} valid")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)" if metric == "lm_loss" else metric)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_output(out, "plot", inputs=[metrics_file(r) for r in runs]) as tmp:
        fig.savefig(tmp, format=Path(out).suffix[1:] or "png")
    plt.close(fig)
