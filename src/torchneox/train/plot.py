"""``torchneox plot``: training and validation loss of one or more runs, as a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from torchneox.base.errors import ConfigError
from torchneox.config.paths import atomic_output


def metrics_file(run: Path) -> Path:
    """What plot reads of a run: its metrics.jsonl (or the file given)."""
    return run / "metrics.jsonl" if run.is_dir() else run


def read_metrics(run: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    path = metrics_file(run)
    if not path.is_file():
        raise ConfigError("no metrics.jsonl here (is it a run's save or log_dir?)", source=str(run))
    train, valid = [], []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines):  # cut by a kill during a write: what came before stands
                continue
            raise ConfigError(f"line {number} is not JSON", source=str(path)) from None
        if row.get("lm_loss") is not None:
            train.append((row["iteration"], row["lm_loss"]))
        if row.get("valid_lm_loss") is not None:
            valid.append((row["iteration"], row["valid_lm_loss"]))
    return train, valid


def plot_runs(runs: list[Path], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib (pip install 'torchneox[plot]')") from None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for run in runs:
        train, valid = read_metrics(run)
        name = run.name or str(run)
        if train:
            line = ax.plot(*zip(*train, strict=True), label=f"{name} train")[0]
            if valid:
                ax.plot(
                    *zip(*valid, strict=True), "o--", color=line.get_color(), label=f"{name} valid"
                )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_output(out, "plot", inputs=[metrics_file(r) for r in runs]) as tmp:
        fig.savefig(tmp, format=Path(out).suffix[1:] or "png")
    plt.close(fig)
