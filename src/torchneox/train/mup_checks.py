"""use_mup's two one-off runs, as GPT-NeoX's train entry runs them instead of training: save_base_shapes (the base shapes file)
and coord_check (muP's coordinate check: each module's mean |output| over a few steps at
growing widths, with muP and with the standard parametrisation)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from mup.shape import make_base_shapes
from torch import nn

from torchneox.base.errors import ConfigError
from torchneox.config.derive import derive
from torchneox.config.features.mup import EMBED, mup_spec, read_base_shapes
from torchneox.config.load import LoadedConfig
from torchneox.config.paths import atomic_output, dataset_files
from torchneox.models.args import ModelArgs, MupScales
from torchneox.models.transformer import Transformer, build_model
from torchneox.optim.builder import build_optimizer

COORD_STEPS = 3
"""GPT-NeoX's coordinate check: 3 steps, the activations recorded at 4 forwards."""
BASE_SHAPES_HEADER = (
    "# muP base shapes (mup's format): null is not a width; a number is the base size of a width\n"
)


# ----------------------------------------------------------------------------- one-offs


def base_shapes(args: ModelArgs, delta: ModelArgs) -> dict[str, list[int | None]]:
    """mup's base shapes of the model ``args`` describes, against its delta (the same model
    wider): a dimension that differs between the two is a width. Built on the meta device."""

    def shapes(a: ModelArgs) -> dict[str, torch.Size]:
        with torch.device("meta"):
            return {n: p.shape for n, p in Transformer(a).named_parameters()}

    infshapes = make_base_shapes(shapes(args), shapes(delta))
    return {name: s.base_shape() for name, s in infshapes.items()}


def one_off(loaded: LoadedConfig, line: Callable[[str], None] = print) -> bool:
    """Run use_mup's one-off (save_base_shapes, else coord_check) if the config asks for one,
    as GPT-NeoX does instead of training; returns whether one ran."""
    spec = mup_spec(loaded)
    if spec is None or not (spec.save_base_shapes or spec.coord_check):
        return False
    if spec.save_base_shapes:
        path = write_base_shapes(loaded)
        line(f"muP base shapes written to {path}; no training (save_base_shapes)")
        return True
    written = coord_check(loaded)
    line(f"muP coordinate check written: {', '.join(map(str, written))}; no training")
    return True


def _args_at(loaded: LoadedConfig, width: int, vocab: int) -> ModelArgs:
    """The config's model at hidden_size ``width``, without muP."""
    cfg = loaded.config
    model = dataclasses.replace(cfg.model, hidden_size=width)
    training = dataclasses.replace(cfg.training, use_mup=False)
    return ModelArgs.from_config(dataclasses.replace(cfg, model=model, training=training), vocab)


def _refuse_existing(paths: list[Path], key: str) -> None:
    for path in paths:
        if path.exists():
            raise ConfigError(
                f"already exists; {key} would replace it: move it away or name another",
                source=str(path),
                key=key,
            )


def write_base_shapes(loaded: LoadedConfig) -> Path:
    """The base shapes of the config's model (delta: hidden_size x mup_width_scale) written to
    base_shapes_file."""
    spec = mup_spec(loaded)
    assert spec is not None and spec.base_shapes_file
    path = Path(spec.base_shapes_file)
    _refuse_existing([path], "base_shapes_file")
    cfg, vocab = loaded.config, derive(loaded)["padded_vocab_size"]
    width = cfg.model.hidden_size
    shapes = base_shapes(
        _args_at(loaded, width, vocab), _args_at(loaded, width * spec.width_scale, vocab)
    )
    inputs = [*loaded.files, *dataset_files(cfg.data)]
    with atomic_output(path, "save_base_shapes", inputs=inputs) as tmp:
        tmp.write_text(BASE_SHAPES_HEADER + yaml.safe_dump(shapes, indent=4))
    return path


def coord_widths(loaded: LoadedConfig) -> list[int]:
    """GPT-NeoX's widths: num_attention_heads x 4, 8, ... 256."""
    return [loaded.config.model.num_attention_heads * 2**p for p in range(2, 9)]


def coord_check(loaded: LoadedConfig) -> list[Path]:
    """muP's coordinate check at GPT-NeoX's widths on the run's first training batches: the
    records (JSON lines) and, where matplotlib is installed, their plots, for muP (up) and the
    standard parametrisation (sp), in the current folder."""
    from torchneox.data.datasets import step_batch

    spec = mup_spec(loaded)
    assert spec is not None
    paths = {kind: Path(f"coord_check_{kind}.0.jsonl") for kind in ("up", "sp")}
    plots = {kind: Path(f"coord_check_{kind}.0.jpg") for kind in ("up", "sp")}
    _refuse_existing([*paths.values(), *plots.values()], "coord_check")
    train_iters = loaded.config.training.train_iters or 0
    if train_iters < COORD_STEPS + 1:
        raise ConfigError(
            f"coord_check reads {COORD_STEPS + 1} training batches", key="train_iters"
        )
    batches = [torch.from_numpy(step_batch(loaded, i)[1]).long() for i in range(1, COORD_STEPS + 2)]
    widths = coord_widths(loaded)
    bases = None
    if spec.base_shapes_file and Path(spec.base_shapes_file).is_file():
        bases = read_base_shapes(spec.base_shapes_file)
    records = {
        "up": coord_records(loaded, widths, batches, bases or _smallest_base(loaded, widths)),
        "sp": coord_records(loaded, widths, batches, None),
    }
    inputs = [*loaded.files, *dataset_files(loaded.config.data)]
    written = []
    for kind, rows in records.items():
        with atomic_output(paths[kind], "coord_check", inputs=inputs) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        written.append(paths[kind])
        if _plot(rows, plots[kind], kind, inputs):
            written.append(plots[kind])
    return written


def _smallest_base(loaded: LoadedConfig, widths: list[int]) -> dict[str, Any]:
    """Base shapes with the smallest width as the base (no base_shapes_file written yet)."""
    spec = mup_spec(loaded)
    assert spec is not None
    vocab = derive(loaded)["padded_vocab_size"]
    base = _args_at(loaded, widths[0], vocab)
    return base_shapes(base, _args_at(loaded, widths[0] * spec.width_scale, vocab))


def coord_records(
    loaded: LoadedConfig,
    widths: list[int],
    batches: list[torch.Tensor],
    bases: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """Each module's mean |output| ("l1") at each width and forward t (1..len(batches)),
    training between forwards on ``batches`` ([B, S+1] token ids) at the config's peak lr, in
    fp32 on the GPU where there is one; ``bases``: muP's base shapes (None: the standard
    parametrisation)."""
    cfg, d = loaded.config, derive(loaded)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[dict[str, Any]] = []
    for width in widths:
        args = _args_at(loaded, width, d["padded_vocab_size"])
        if bases is not None:
            t = cfg.training
            scales = MupScales(
                tuple((k, tuple(v)) for k, v in sorted(bases.items())),
                width / bases[EMBED][1],
                t.mup_init_scale,
                t.mup_attn_temp,
                t.mup_output_temp,
                t.mup_embedding_mult,
                t.base_shapes_file,
            )
            args = dataclasses.replace(args, mup=scales)
        torch.manual_seed(cfg.training.seed)
        model = build_model(args, device, seed=cfg.training.seed)
        model.train()
        optimizer = build_optimizer(model, cfg.optimizer, device.type, args.mup)
        for group in optimizer.param_groups:
            group["lr"] = d["lr"] * group.get("lr_scale", 1.0)
        for step, batch in enumerate(batches, 1):
            rows += _train_recorded(model, optimizer, batch.to(device), width, step)
    return rows


def _train_recorded(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, width: int, t: int
) -> list[dict[str, Any]]:
    """One training step on ``batch``, each module's mean |output| recorded in its forward."""
    rows: list[dict[str, Any]] = []

    def hook(name: str):
        def record(_module: nn.Module, _inputs: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point():
                l1 = output.detach().abs().mean().item()
                rows.append({"width": width, "module": name or "logits", "t": t, "l1": l1})

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    try:
        logits = model(batch[:, :-1])
    finally:
        for h in handles:
            h.remove()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return rows


def _plotted(module: str) -> bool:
    """What the plots show (the records hold every module): the embedding, each block's
    output, the final norm and the logits."""
    parts = module.split(".")
    return module in ("embed", "final_norm", "logits") or (len(parts) == 2 and parts[0] == "layers")


def _plot(rows: list[dict[str, Any]], path: Path, kind: str, inputs: list[str]) -> bool:
    """Mean |output| against width, one panel per forward, one line per module shown (mup's
    plot_coord_data's layout); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = sorted({r["t"] for r in rows})
    fig, axes = plt.subplots(1, len(steps), figsize=(3 * len(steps), 3), sharey=True, dpi=72)
    shown = [m for m in dict.fromkeys(r["module"] for r in rows) if _plotted(m)]
    for ax, t in zip(axes, steps, strict=True):
        for module in shown:
            points = [(r["width"], r["l1"]) for r in rows if r["t"] == t and r["module"] == module]
            ax.plot(*zip(*points, strict=True), marker=".", linewidth=0.8)
        ax.set(xscale="log", yscale="log", xlabel="width", title=f"t={t}")
        ax.minorticks_off()  # (a log axis's minor ticks take most of the drawing time)
    axes[0].set_ylabel("mean |output|")
    axes[-1].legend(shown, fontsize="x-small")
    fig.suptitle("muP" if kind == "up" else "standard parametrisation")
    with atomic_output(path, "coord_check", inputs=inputs) as tmp:
        fig.savefig(tmp, format="jpg")
    plt.close(fig)
    return True
