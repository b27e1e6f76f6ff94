"""``torchneox convert from-gpt-neox``: GPT-NeoX (DeepSpeed) checkpoints -> torchneox checkpoints.

GPT-NeoX writes, per ``global_stepN/``:

- pipe_parallel_size >= 1: ``layer_LL-model_MM-model_states.pt`` per pipeline layer LL and tensor
  rank MM (layer 0 the embedding, 2 .. L+1 the blocks, L+3 the final norm, L+4 the output head),
  and ``mp_rank_MM_model_states.pt`` with the optimizer, scheduler, iteration and RNG state;
- pipe_parallel_size 0: ``mp_rank_MM_model_states.pt`` whose ``module`` holds everything as
  ``sequential.{index}.{name}``;
- ``configs/``: the YAML files the run was started with.

Tensor-parallel shards are merged along the dimension GPT-NeoX split them on. With
``gpt_j_residual`` and tensor parallelism GPT-NeoX adds the attention-output and MLP-output
biases once per tensor rank (its issue #962), so the merged model gets those biases multiplied
by the number of ranks: it then computes what GPT-NeoX computed.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchneox.config.derive import derive
from torchneox.config.errors import ConfigError
from torchneox.config.load import LoadedConfig, load_config
from torchneox.config.report import render_yaml
from torchneox.models.args import ModelArgs, model_args
from torchneox.models.hf import _split_qkv
from torchneox.train import checkpoint

LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
RANK_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
SPLIT_ROWS = (
    "word_embeddings.weight",
    "position_embeddings.weight",
    "final_linear.weight",
    "attention.query_key_value.weight",
    "attention.query_key_value.bias",
    "mlp.linear1.weight",
    "mlp.linear1.bias",
)
SPLIT_COLUMNS = ("attention.dense.weight", "mlp.linear2.weight")


class NeoXCheckpointError(ConfigError):
    pass


def _load(path: Path) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file: name it
        raise NeoXCheckpointError(
            f"cannot read it as a torch checkpoint ({type(e).__name__}: {e})", source=str(path)
        ) from None


def resolve_step(folder: Path, step: int | None) -> Path:
    if not folder.is_dir():
        raise NeoXCheckpointError("no such directory", source=str(folder))
    if step is not None:
        target = folder / f"global_step{step}"
    elif list(folder.glob("mp_rank_*_model_states.pt")):
        target = folder
    elif (folder / "latest").is_file():
        target = folder / (folder / "latest").read_text().strip()
    else:
        raise NeoXCheckpointError(
            "not a GPT-NeoX checkpoint: no 'latest' file and no mp_rank_*_model_states.pt",
            source=str(folder),
        )
    if not list(target.glob("mp_rank_*_model_states.pt")):
        raise NeoXCheckpointError(
            f"{target.name} has no mp_rank_*_model_states.pt", source=str(folder)
        )
    return target


@dataclass
class NeoXLayout:
    step_dir: Path
    pipeline_files: dict[tuple[int, int], Path]
    rank_files: dict[int, Path]

    @property
    def tp(self) -> int:
        return len(self.rank_files)

    @classmethod
    def read(cls, step_dir: Path) -> NeoXLayout:
        layers, ranks = {}, {}
        for p in step_dir.iterdir():
            if m := LAYER_FILE.match(p.name):
                layers[(int(m[1]), int(m[2]))] = p
            elif m := RANK_FILE.match(p.name):
                ranks[int(m[1])] = p
        if sorted(ranks) != list(range(len(ranks))):
            raise NeoXCheckpointError(
                f"tensor-parallel ranks {sorted(ranks)} are not 0..{len(ranks) - 1}",
                source=str(step_dir),
            )
        return cls(step_dir, layers, ranks)


def _shard_tensors(
    layout: NeoXLayout, rank: int, rank_state: dict
) -> dict[int, dict[str, torch.Tensor]]:
    """Tensors of one tensor rank, by GPT-NeoX layer index."""
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    if layout.pipeline_files:
        for (layer, r), path in sorted(layout.pipeline_files.items()):
            if r == rank:
                by_layer[layer] = {
                    k: v for k, v in _load(path).items() if isinstance(v, torch.Tensor)
                }
        return by_layer
    module = rank_state.get("module")
    if not isinstance(module, dict):
        raise NeoXCheckpointError(
            "has no layer files and no module weights", source=str(layout.rank_files[rank])
        )
    for key, value in module.items():
        m = re.match(r"sequential\.(\d+)\.(.+)$", key)
        if m and isinstance(value, torch.Tensor):
            by_layer.setdefault(int(m[1]), {})[m[2]] = value
    return by_layer


def _merge(name: str, shards: list[torch.Tensor], gated: bool) -> torch.Tensor:
    if len(shards) == 1:
        return shards[0]
    if gated and name.startswith("mlp.linear1"):  # each rank holds [its up part, its gate part]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if name.endswith(SPLIT_ROWS) or name in SPLIT_ROWS:
        return torch.cat(shards, dim=0)
    if name.endswith(SPLIT_COLUMNS):
        return torch.cat(shards, dim=1)
    for s in shards[1:]:
        if not torch.equal(s, shards[0]):
            raise NeoXCheckpointError(f"{name} should be the same on every tensor rank but is not")
    return shards[0]


def merged_layers(
    layout: NeoXLayout, states: list[dict], gated: bool
) -> dict[int, dict[str, torch.Tensor]]:
    per_rank = [_shard_tensors(layout, r, states[r]) for r in range(layout.tp)]
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer in per_rank[0]:
        out[layer] = {
            name: _merge(name, [rank[layer][name] for rank in per_rank], gated)
            for name in per_rank[0][layer]
        }
    return out


def _block(
    dst: str, src: dict[str, torch.Tensor], args: ModelArgs, bias_factor: float
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    names = {"input_layernorm": "attention_norm", "post_attention_layernorm": "mlp_norm"}
    for theirs, ours in names.items():
        for kind in ("weight", "bias"):
            if f"{theirs}.{kind}" in src:
                out[f"{dst}{ours}.{kind}"] = src[f"{theirs}.{kind}"]
    for kind in ("weight", "bias"):
        qkv = src.get(f"attention.query_key_value.{kind}")
        if qkv is not None:
            rows = 3 * args.num_heads * args.head_dim
            if qkv.shape[0] != rows or (kind == "weight" and qkv.shape[1] != args.hidden_size):
                raise NeoXCheckpointError(
                    f"{dst}: attention.query_key_value.{kind} has shape {tuple(qkv.shape)}, the config "
                    f"needs {(rows, args.hidden_size) if kind == 'weight' else (rows,)}; the weights do not "
                    "match the config"
                )
            for part, tensor in zip(
                ("wq", "wk", "wv"), _split_qkv(qkv, args.num_heads, args.head_dim), strict=True
            ):
                out[f"{dst}attention.{part}.{kind}"] = tensor
        linear1 = src.get(f"mlp.linear1.{kind}")
        if linear1 is not None:
            if args.gated:
                up, gate = linear1.chunk(2, dim=0)
                out[f"{dst}mlp.up.{kind}"], out[f"{dst}mlp.gate.{kind}"] = (
                    up.contiguous(),
                    gate.contiguous(),
                )
            else:
                out[f"{dst}mlp.up.{kind}"] = linear1
    for theirs, ours in (("attention.dense", "attention.wo"), ("mlp.linear2", "mlp.down")):
        if f"{theirs}.weight" in src:
            out[f"{dst}{ours}.weight"] = src[f"{theirs}.weight"]
        if f"{theirs}.bias" in src:
            out[f"{dst}{ours}.bias"] = src[f"{theirs}.bias"] * bias_factor
    return out


def model_state(
    layers: dict[int, dict[str, torch.Tensor]], args: ModelArgs, bias_factor: float
) -> dict[str, torch.Tensor]:
    """GPT-NeoX layer tensors -> torchneox parameter names."""
    n = args.num_layers
    expected = {0, *range(2, n + 2), n + 3}
    missing = sorted(expected - set(layers))
    if missing:
        raise NeoXCheckpointError(
            f"layer {missing[0]} is missing (a {n}-layer model needs layers 0, 2..{n + 1}, {n + 3})"
        )
    out = {"embed.weight": layers[0]["word_embeddings.weight"]}
    if "position_embeddings.weight" in layers[0]:
        out["pos_embed.weight"] = layers[0]["position_embeddings.weight"]
    for i in range(n):
        out |= _block(f"layers.{i}.", layers[i + 2], args, bias_factor)
    for kind in ("weight", "bias"):
        if f"norm.{kind}" in layers[n + 3]:
            out[f"final_norm.{kind}"] = layers[n + 3][f"norm.{kind}"]
    head = layers.get(n + 4, {}).get("final_linear.weight")
    if not args.tied_embeddings:
        if head is None:
            raise NeoXCheckpointError(
                f"no_weight_tying is set but layer {n + 4} (final_linear) is missing"
            )
        out["output.weight"] = head
    return out


def optimizer_order(
    args: ModelArgs, layers: dict[int, dict[str, torch.Tensor]]
) -> list[tuple[int, str]]:
    """(GPT-NeoX layer, tensor name) of each optimizer state index: first the weight-decay group
    (matrices, in module order), then the no-decay group (norms and biases, in module order)."""
    n = args.num_layers
    order = [0, *range(2, n + 2), n + 3, n + 4]
    block_order = (
        "input_layernorm",
        "attention.query_key_value",
        "attention.dense",
        "post_attention_layernorm",
        "mlp.linear1",
        "mlp.linear2",
    )
    decay, plain = [], []
    for layer in order:
        names = list(layers.get(layer, {}))
        if 2 <= layer < n + 2:
            names.sort(key=lambda x: (block_order.index(x.rsplit(".", 1)[0]), x.endswith("bias")))
        for name in names:
            is_norm = "norm" in name
            target = plain if (is_norm or name.endswith("bias")) else decay
            target.append((layer, name))
    return decay + plain


def _to_ours(
    layer: int, name: str, tensor: torch.Tensor, args: ModelArgs
) -> dict[str, torch.Tensor]:
    """One GPT-NeoX tensor (or a tensor of its shape) under torchneox's name(s)."""
    n = args.num_layers
    if layer == 0:
        return {"embed.weight" if name.startswith("word") else "pos_embed.weight": tensor}
    if layer == n + 3:
        return {f"final_norm.{name.rsplit('.', 1)[1]}": tensor}
    if layer == n + 4:
        return {"output.weight": tensor}
    return _block(f"layers.{layer - 2}.", {name: tensor}, args, 1.0)


def optimizer_state(
    rank_states: list[dict], layout: NeoXLayout, layers: dict, args: ModelArgs
) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """Adam moments by torchneox parameter name, and the step count."""
    opt = rank_states[0].get("optimizer")
    if isinstance(opt, dict) and opt.get("state") == {} and "param_groups" in opt:
        return {}, 0  # saved before the first step (extra_save_iters 0): a fresh optimizer
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not opt["state"]:
        raise NeoXCheckpointError(
            "keeps no optimizer state in mp_rank_00_model_states.pt (ZeRO stages 1-3 write it to "
            "zero_pp_rank_* files, which are not read yet); convert without --with-optimizer",
            source=str(layout.rank_files[0]),
        )
    order = optimizer_order(args, layers)
    if len(order) != len(opt["state"]):
        raise NeoXCheckpointError(
            f"the optimizer holds {len(opt['state'])} tensors, the model has {len(order)}",
            source=str(layout.rank_files[0]),
        )
    step = max(int(s.get("step", 0)) for s in opt["state"].values())
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for index, (layer, name) in enumerate(order):
        for kind in ("exp_avg", "exp_avg_sq"):
            merged = _merge(
                name, [r["optimizer"]["state"][index][kind] for r in rank_states], args.gated
            )
            for ours, tensor in _to_ours(layer, name, merged, args).items():
                moments.setdefault(ours, {})[kind] = tensor
    return moments, step


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
    return load_config(files, overrides)


def convert(
    folder: str | Path,
    out_dir: str | Path,
    config_files: list[str] | None = None,
    overrides: list[str] | None = None,
    step: int | None = None,
    with_optimizer: bool = False,
) -> Path:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from torchneox.models.transformer import build_model
    from torchneox.train.optim import build_optimizer

    step_dir = resolve_step(Path(folder), step)
    loaded = neox_config(step_dir, config_files or [], overrides or [])
    cfg = loaded.config
    if cfg.model.num_kv_heads and cfg.model.num_kv_heads != cfg.model.num_attention_heads:
        raise NeoXCheckpointError(
            "grouped-query attention (num_kv_heads) checkpoints are not read yet",
            key="num_kv_heads",
        )
    derived = derive(
        loaded,
        world_size=max(cfg.parallel.pipe_parallel_size, 1) * cfg.parallel.model_parallel_size,
    )
    args = model_args(loaded)
    layout = NeoXLayout.read(step_dir)
    if layout.tp != cfg.parallel.model_parallel_size:
        raise NeoXCheckpointError(
            f"has {layout.tp} tensor-parallel shards but the config says model_parallel_size "
            f"{cfg.parallel.model_parallel_size}",
            source=str(step_dir),
        )
    states = [_load(layout.rank_files[r]) for r in range(layout.tp)]
    layers = merged_layers(layout, states, args.gated)
    bias_factor = float(layout.tp) if (cfg.model.gpt_j_residual and layout.tp > 1) else 1.0
    model = build_model(args, device="cpu")
    try:
        model.load_state_dict(model_state(layers, args, bias_factor), strict=True)
    except (RuntimeError, KeyError) as e:
        raise NeoXCheckpointError(
            f"weights do not match the config: {str(e).splitlines()[-1].strip()}",
            source=str(step_dir),
        ) from None
    iteration = int(states[0].get("iteration") or 0)
    _check_schedule(states[0].get("lr_scheduler"), derived)
    state: dict[str, Any] = {"model": model.state_dict()}
    meta: dict[str, Any] = {"converted_from": f"GPT-NeoX {step_dir}", "iteration": iteration}
    if with_optimizer:
        moments, opt_step = optimizer_state(states, layout, layers, args)
        if moments:  # else the optimizer never stepped: the run continues with a fresh one
            optimizer = build_optimizer(model, cfg, "cpu")
            osd = get_optimizer_state_dict(model, optimizer)
            for name, entry in osd["state"].items():
                entry["exp_avg"].copy_(moments[name]["exp_avg"])
                entry["exp_avg_sq"].copy_(moments[name]["exp_avg_sq"])
                entry["step"].fill_(float(opt_step))
            state["optimizer"] = osd
        rng = states[0].get("torch_rng_state")
        if isinstance(rng, torch.Tensor):
            state["rng"] = {"torch": rng}
        tbs = derived["train_batch_size"]
        t = cfg.training
        meta |= {
            "has_optimizer": "optimizer" in state,
            "has_rng": "rng" in state,
            "loaders": {
                "train": {"consumed_samples": iteration * tbs},
                "valid": {"consumed_samples": (iteration // t.eval_interval) * t.eval_iters * tbs},
            },
        }
    else:
        meta["iteration"] = 0  # weights only: a fresh run starts from them
    yaml_text = render_yaml(loaded, derived)
    return checkpoint.save_checkpoint(Path(out_dir), meta["iteration"], state, yaml_text, meta)
