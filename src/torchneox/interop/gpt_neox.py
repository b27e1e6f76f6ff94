"""``torchneox convert from-gpt-neox``: a GPT-NeoX (DeepSpeed) checkpoint -> a torchneox
checkpoint: the weights (gpt_neox_files.py reads and merges them), with ``--with-optimizer``
the optimizer state (gpt_neox_optim.py), the iteration, the data position and the RNG, so
that the run continues where GPT-NeoX stopped; the config from the checkpoint's configs/."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import NeoXCheckpointError
from torchneox.checkpoint import files as checkpoint_format
from torchneox.checkpoint.tensors import FRESH_HEADS
from torchneox.config.checks.model import layer_attention_types
from torchneox.config.derive import derive
from torchneox.config.features.eight_bit import eight_bit
from torchneox.config.features.optimizer import optimizer_spec
from torchneox.config.load import LoadedConfig, load_config, with_absolute_paths
from torchneox.config.paths import new_output_dir, refuse_non_empty
from torchneox.config.report import render_yaml
from torchneox.config.vocab import tokenizer_vocab_size
from torchneox.interop.gpt_neox_files import (
    GMLP_TYPES,
    NeoXLayout,
    load_file,
    merged_layers,
    model_state,
    resolve_step,
)
from torchneox.interop.gpt_neox_optim import optimizer_state
from torchneox.models.args import ModelArgs


def _check_schedule(saved: Any, derived: Any) -> None:
    """GPT-NeoX stores its schedule; it must be the one the config describes, or a continued
    run would follow another curve."""
    if not isinstance(saved, dict):
        return
    ours = {
        "start_lr": derived["lr"],
        "end_iter": derived.get("lr_decay_iters"),
        "warmup_iter": derived.get("warmup_iters"),
    }
    for key, value in ours.items():
        theirs = saved.get(key)
        if (
            value is not None
            and theirs is not None
            and abs(float(theirs) - float(value)) > 1e-9 * max(1.0, abs(float(value)))
        ):
            raise NeoXCheckpointError(
                f"the checkpoint's learning-rate schedule has {key} {theirs}, the config gives {value}; "
                "convert with the run's own config (or --set the schedule keys to match)"
            )


def neox_config(step_dir: Path, config_files: list[str], overrides: list[str]) -> LoadedConfig:
    files = config_files or sorted(str(p) for p in (step_dir / "configs").glob("*.y*ml"))
    if not files:
        raise NeoXCheckpointError(
            "no configs/ folder in the checkpoint; name the run's configs with --config",
            source=str(step_dir),
        )
    loaded = load_config(files, overrides)
    _refuse_sharing(loaded.config, step_dir)
    return loaded


def convert(
    folder: str | Path,
    out_dir: str | Path,
    config_files: list[str] | None = None,
    overrides: list[str] | None = None,
    step: int | None = None,
    with_optimizer: bool = False,
    progress: bool = False,
    force: bool = False,
) -> Path:
    step_dir = resolve_step(Path(folder), step)
    inputs = [folder, step_dir, *(config_files or [])]
    refuse_non_empty(Path(out_dir), force, "convert from-gpt-neox", inputs=inputs)  # before reading
    loaded = neox_config(step_dir, config_files or [], overrides or [])
    cfg = loaded.config
    layout = NeoXLayout.read(step_dir)
    if layout.tp != cfg.parallel.model_parallel_size:
        raise NeoXCheckpointError(
            f"has {layout.tp} tensor-parallel shards but the config says model_parallel_size "
            f"{cfg.parallel.model_parallel_size}; convert with --set model_parallel_size={layout.tp}",
            source=str(step_dir),
        )
    _check_gmlp(cfg, layout)
    states = [load_file(layout.rank_files[r]) for r in range(len(layout.rank_files))]
    world = None  # layer files alone: the world size the config gives, or the smallest layout
    if states:  # the run's own world: its data-parallel size sets the global batch
        dp = int(states[0].get("dp_world_size") or 1)
        world = max(cfg.parallel.pipe_parallel_size, 1) * cfg.parallel.model_parallel_size * dp
    derived = derive(loaded, world_size=world)
    args = ModelArgs.from_config(cfg, derived["padded_vocab_size"])
    if with_optimizer:
        _optimizer_readable(args, step_dir, cfg)
    layers = merged_layers(layout, states, args, progress)
    if _vocab_from_weights(loaded, layers):  # the tokenizer's file is not here
        derived = derive(loaded, world_size=world)
        args = ModelArgs.from_config(cfg, derived["padded_vocab_size"])
    bias_factor = float(layout.tp) if (cfg.model.gpt_j_residual and layout.tp > 1) else 1.0
    weights = _checked_model_state(layers, args, bias_factor, step_dir)
    iteration = int(states[0].get("iteration") or 0) if states else 0
    if states:
        _check_schedule(states[0].get("lr_scheduler"), derived)
    state: dict[str, Any] = {"model": _fp32(weights)}
    meta: dict[str, Any] = {"converted_from": f"GPT-NeoX {step_dir}", "iteration": 0}
    if with_optimizer:
        moments, opt_step = optimizer_state(states, layout, layers, args)
        del layers
        if moments:  # else the optimizer never stepped: the run continues with a fresh one
            _use_master_weights(weights, moments, bias_factor, args)
            state["model"] = weights = _fp32(weights)
            state["optimizer"] = _optimizer_state_dict(weights, moments, opt_step, args, cfg)
        rng = states[0].get("torch_rng_state")
        if isinstance(rng, torch.Tensor):
            state["rng"] = {"torch": rng}
        meta |= _training_meta(state, iteration, derived["train_batch_size"], cfg.training)
    # (weights only: iteration 0, a fresh run starts from them)
    yaml_text = render_yaml(with_absolute_paths(loaded), derived)
    out = Path(out_dir)
    with new_output_dir(out, force, "convert from-gpt-neox", inputs=inputs) as tmp:
        step = checkpoint_format.save_checkpoint(tmp, meta["iteration"], state, yaml_text, meta)
    return out / step.name


def _refuse_sharing(cfg: Any, step_dir: Path) -> None:
    """A config asking for layer weight sharing: GPT-NeoX's layers are distinct."""
    m = cfg.model
    if m.num_unique_layers is not None and m.num_unique_layers < (m.num_layers or 0):
        raise NeoXCheckpointError(
            f"GPT-NeoX shares no weights (it only checks num_unique_layers): its "
            f"{m.num_layers} layers are distinct; convert with --set num_unique_layers=null",
            source=str(step_dir),
        )


def _check_gmlp(cfg: Any, layout: NeoXLayout) -> None:
    """What of a GPT-NeoX run with gmlp/amlp layers does not come in, in one line."""
    kind = next((k for k in layer_attention_types(cfg) if k in GMLP_TYPES), None)
    if kind is None:
        return
    if layout.tp > 1:
        raise NeoXCheckpointError(
            f"'{kind}' layers split over {layout.tp} tensor ranks do not import: GPT-NeoX "
            "normalised each rank's part of the gate on its own, which no one-process model "
            "computes",
            source=str(layout.step_dir),
        )


def _optimizer_readable(args: ModelArgs, step_dir: Path, cfg: Any) -> None:
    kind = optimizer_spec(cfg.optimizer).kind
    if eight_bit(cfg.optimizer):
        raise NeoXCheckpointError(
            "--with-optimizer reads FusedAdam's fp32 moments; the 8-bit state of a "
            "use_bnb_optimizer run does not import: convert the weights without it (the run "
            "continues with a fresh optimizer)",
            source=str(step_dir),
        )
    if kind not in ("adam", "adamw"):
        raise NeoXCheckpointError(
            f"--with-optimizer reads Adam's moments; the state of a {kind} run does not import "
            "yet: convert the weights without it (the run continues with a fresh optimizer)",
            source=str(step_dir),
        )
    if args.pos_emb == "rpe":
        raise NeoXCheckpointError(
            "--with-optimizer does not read the optimizer state of pos_emb rpe yet; convert "
            "the weights without it",
            source=str(step_dir),
        )


def _vocab_from_weights(loaded: LoadedConfig, layers: dict) -> bool:
    """A config whose tokenizer file is not here (named at the training cluster's path, say):
    the vocabulary is the size the weights have (the embedding's rows), said on stderr with
    the option that passes the file for tokenizing. False when the file is read, or the
    config gives padded_vocab_size."""
    cfg = loaded.config
    embed = layers.get(0, {}).get("word_embeddings.weight")
    tok = cfg.tokenizer
    if embed is None or tok.padded_vocab_size is not None or tokenizer_vocab_size(cfg).exact:
        return False
    rows = int(embed.shape[0])
    cfg.set("padded_vocab_size", rows)
    loaded.origin["padded_vocab_size"] = "the rows of the checkpoint's word embeddings"
    gpt2 = tok.tokenizer_type in ("GPT2BPETokenizer", "HFGPT2Tokenizer")
    option = "--set vocab_file=PATH" + (" --set merge_file=PATH" if gpt2 else "")
    print(
        f"note: the checkpoint's config names the {tok.tokenizer_type} vocab_file "
        f"{tok.vocab_file}, which is not here: converted with the vocabulary size its weights "
        f"have ({rows}); to tokenize for this model, pass the tokenizer with {option} "
        "(generate, train, eval)",
        file=sys.stderr,
    )
    return True


def _training_meta(state: dict, iteration: int, tbs: int, t: Any) -> dict[str, Any]:
    """What a continued run needs besides the tensors: the iteration, and the train and
    validation positions that follow from it, as GPT-NeoX's own resume computes them."""
    return {
        "iteration": iteration,
        "has_optimizer": "optimizer" in state,
        "has_rng": "rng" in state,
        "loaders": {
            "train": {"consumed_samples": iteration * tbs},
            "valid": {"consumed_samples": (iteration // t.eval_interval) * t.eval_iters * tbs},
        },
    }


def _checked_model_state(
    layers: dict, args: ModelArgs, bias_factor: float, step_dir: Path
) -> dict[str, torch.Tensor]:
    """torchneox's state dict from the merged layers, checked name by name and shape by shape
    against the model the config builds (on the meta device: no second copy of the weights)."""
    from torchneox.models.transformer import Transformer

    try:
        weights = model_state(layers, args, bias_factor)
    except NeoXCheckpointError as e:
        if e.source is not None:
            raise
        raise NeoXCheckpointError(e.message, source=str(step_dir), key=e.key) from None
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    # a reward model converted from a language model's checkpoint: its head starts fresh
    missing = sorted(set(expected) - set(weights) - set(FRESH_HEADS))
    extra = sorted(set(weights) - set(expected))
    wrong = [k for k in expected if k in weights and weights[k].shape != expected[k]]
    if missing or extra or wrong:
        what = (
            f"{missing[0]} is missing"
            if missing
            else f"{extra[0]} is not in the model"
            if extra
            else f"{wrong[0]} has shape {tuple(weights[wrong[0]].shape)}, the config needs "
            f"{tuple(expected[wrong[0]])}"
        )
        raise NeoXCheckpointError(f"weights do not match the config: {what}", source=str(step_dir))
    return {k: weights[k].contiguous() for k in expected if k in weights}


def _fp32(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchneox keeps fp32 weights (bf16/fp16 run under autocast)."""
    return {k: v.float() for k, v in weights.items()}


def _use_master_weights(
    weights: dict[str, torch.Tensor], moments: dict, bias_factor: float, args: ModelArgs
) -> None:
    """ZeRO keeps fp32 master weights beside the (fp16/bf16) module weights: a continued run
    takes the masters, as DeepSpeed's optimizer steps them. In fp32 runs they are the weights."""
    scaled = {
        f"layers.{i}.{n}.bias" for i in range(args.num_layers) for n in ("attention.wo", "mlp.down")
    }
    for name, entry in moments.items():
        master = entry.pop("fp32", None)
        if master is None or weights[name].dtype == torch.float32:
            continue
        factor = bias_factor if name in scaled else 1.0
        weights[name] = master * factor


def _optimizer_state_dict(
    weights: dict[str, torch.Tensor], moments: dict, step: int, args: ModelArgs, cfg: Any
) -> dict[str, Any]:
    """The optimizer state torchneox saves (torch's FQN-keyed form) holding GPT-NeoX's moments."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from torchneox.models.transformer import Transformer
    from torchneox.optim.builder import build_optimizer

    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(weights, assign=True)
    osd = get_optimizer_state_dict(model, build_optimizer(model, cfg.optimizer, "cpu"))
    for name, entry in osd["state"].items():
        entry["exp_avg"].copy_(moments[name]["exp_avg"])
        entry["exp_avg_sq"].copy_(moments[name]["exp_avg_sq"])
        entry["step"].fill_(float(step))
    return osd
