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

import pickle
import re
import sys
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import NeoXCheckpointError
from torchneox.config.derive import derive
from torchneox.config.load import LoadedConfig, load_config, with_absolute_paths
from torchneox.config.paths import new_output_dir, refuse_non_empty
from torchneox.config.report import render_yaml
from torchneox.models.args import ModelArgs
from torchneox.models.hf import _split_qkv
from torchneox.train import checkpoint

LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")
RANK_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt$")
ZERO_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
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


class Foreign:
    """An object of a DeepSpeed class (LossScaler, ZeroStageEnum, fragment_address, ...), read
    without DeepSpeed installed: its constructor arguments and pickled state."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Foreign:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, position: int) -> Any:
        if isinstance(self.state, dict) and name in self.state:
            return self.state[name]
        return self.args[position]


_FOREIGN: dict[str, type] = {}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "deepspeed":
            key = f"{module}.{name}"
            if key not in _FOREIGN:
                _FOREIGN[key] = type(name, (Foreign,), {"__module__": __name__})
            return _FOREIGN[key]
        return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


def _load(path: Path) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except Exception as e:  # a truncated or foreign file: name it
        raise NeoXCheckpointError(
            f"cannot read it as a torch checkpoint ({type(e).__name__}: {e})", source=str(path)
        ) from None


def _is_step_dir(path: Path) -> bool:
    return any(RANK_FILE.match(p.name) or LAYER_FILE.match(p.name) for p in path.iterdir())


def resolve_step(folder: Path, step: int | None) -> Path:
    if not folder.is_dir():
        raise NeoXCheckpointError("no such directory", source=str(folder))
    if step is not None:
        target = folder / f"global_step{step}"
        if not target.is_dir():
            steps = sorted(p.name for p in folder.glob("global_step*"))
            raise NeoXCheckpointError(
                f"has no global_step{step} (it has {', '.join(steps) or 'no global_step folders'})",
                source=str(folder),
            )
    elif _is_step_dir(folder):
        target = folder
    elif (folder / "latest").is_file():
        target = folder / (folder / "latest").read_text().strip()
    else:
        raise NeoXCheckpointError(
            "not a GPT-NeoX checkpoint: no 'latest' file, no mp_rank_*_model_states.pt and no "
            "layer_*-model_*-model_states.pt",
            source=str(folder),
        )
    if not target.is_dir() or not _is_step_dir(target):
        raise NeoXCheckpointError(
            f"{target.name} has no mp_rank_*_model_states.pt and no layer files", source=str(folder)
        )
    return target


@dataclass
class NeoXLayout:
    step_dir: Path
    pipeline_files: dict[tuple[int, int], Path]
    rank_files: dict[int, Path]
    zero_files: dict[tuple[int, int], Path]
    """ZeRO optimizer partitions by (data-parallel rank, tensor rank)."""

    @property
    def tp(self) -> int:
        if self.rank_files:
            return len(self.rank_files)
        return len({mp for _, mp in self.pipeline_files})

    @classmethod
    def read(cls, step_dir: Path) -> NeoXLayout:
        layers, ranks, zero = {}, {}, {}
        for p in step_dir.iterdir():
            if m := LAYER_FILE.match(p.name):
                layers[(int(m[1]), int(m[2]))] = p
            elif m := RANK_FILE.match(p.name):
                ranks[int(m[1])] = p
            elif m := ZERO_FILE.match(p.name):
                zero[(int(m[1]), int(m[2]))] = p
        layout = cls(step_dir, layers, ranks, zero)
        tensor_ranks = sorted(set(ranks) | {mp for _, mp in layers})
        if ranks and set(ranks) != set(tensor_ranks):
            missing = min(set(tensor_ranks) - set(ranks))
            raise NeoXCheckpointError(
                f"mp_rank_{missing:02d}_model_states.pt is missing (there are layer files of "
                f"tensor rank {missing})",
                source=str(step_dir),
            )
        if tensor_ranks != list(range(len(tensor_ranks))):
            raise NeoXCheckpointError(
                f"tensor-parallel ranks {tensor_ranks} are not 0..{len(tensor_ranks) - 1}",
                source=str(step_dir),
            )
        by_layer: dict[int, set[int]] = {}
        for layer, mp in layers:
            by_layer.setdefault(layer, set()).add(mp)
        for layer, mps in sorted(by_layer.items()):
            if mps != set(tensor_ranks):
                missing = min(set(tensor_ranks) - mps)
                raise NeoXCheckpointError(
                    f"layer_{layer:02d}-model_{missing:02d}-model_states.pt is missing (the other "
                    f"tensor ranks have layer {layer})",
                    source=str(step_dir),
                )
        return layout


def _module_tensors(layout: NeoXLayout, rank: int, rank_state: dict) -> dict[int, dict]:
    """pipe_parallel_size 0: the tensors of one tensor rank's module, by GPT-NeoX layer index."""
    module = rank_state.get("module")
    if not isinstance(module, dict):
        raise NeoXCheckpointError(
            "has no layer files and no module weights", source=str(layout.rank_files[rank])
        )
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in module.items():
        m = re.match(r"sequential\.(\d+)\.(.+)$", key)
        if m and isinstance(value, torch.Tensor):
            by_layer.setdefault(int(m[1]), {})[m[2]] = value
    return by_layer


def _merge(name: str, shards: list[torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """One tensor from its tensor-parallel shards, joined along the dimension GPT-NeoX split."""
    if len(shards) == 1:
        return shards[0]
    if args.gated and name.startswith("mlp.linear1"):  # each rank: [its up part, its gate part]
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if name.startswith("attention.query_key_value") and args.num_kv_heads != args.num_heads:
        # grouped-query attention: each rank holds [its q heads; its k heads; its v heads]
        tp, d = len(shards), args.head_dim
        sizes = [args.num_heads // tp * d, args.num_kv_heads // tp * d, args.num_kv_heads // tp * d]
        parts = [s.split(sizes, dim=0) for s in shards]
        return torch.cat([p[j] for j in range(3) for p in parts], dim=0)
    if name.endswith(SPLIT_ROWS) or name in SPLIT_ROWS:
        return torch.cat(shards, dim=0)
    if name.endswith(SPLIT_COLUMNS):
        return torch.cat(shards, dim=1)
    for s in shards[1:]:
        if not torch.equal(s, shards[0]):
            raise NeoXCheckpointError(f"{name} should be the same on every tensor rank but is not")
    return shards[0]


def _progress(done: int, total: int, tp: int, seconds: float) -> None:
    """One line rewritten in place on a terminal; in a log, a line at each quarter."""
    text = f"read layer {done}/{total} ({tp} tensor shard{'s' if tp > 1 else ''} each), {seconds:.1f} s"
    if sys.stderr.isatty():
        print("\r" + text, end="\n" if done == total else "", file=sys.stderr, flush=True)
    elif done == total or done * 4 // total != (done - 1) * 4 // total:
        print(text, file=sys.stderr, flush=True)


def merged_layers(
    layout: NeoXLayout, states: list[dict], args: ModelArgs, progress: bool = False
) -> dict[int, dict[str, torch.Tensor]]:
    """Every GPT-NeoX layer with its tensor-parallel shards merged. Layer files are read one
    layer at a time (its shards, then merged and let go), so memory holds the merged model and
    one layer's shards, never every file at once."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    if not layout.pipeline_files:
        per_rank = [_module_tensors(layout, r, states[r]) for r in range(layout.tp)]
        for layer in per_rank[0]:
            out[layer] = {
                name: _merge(name, [rank[layer][name] for rank in per_rank], args)
                for name in per_rank[0][layer]
            }
        return out
    layers = sorted({layer for layer, _ in layout.pipeline_files})
    start = time.perf_counter()
    for i, layer in enumerate(layers):
        shards = []
        for rank in range(layout.tp):
            path = layout.pipeline_files[(layer, rank)]
            shards.append({k: v for k, v in _load(path).items() if isinstance(v, torch.Tensor)})
        names = list(shards[0])
        for rank, shard in enumerate(shards[1:], 1):
            if set(shard) != set(names):
                raise NeoXCheckpointError(
                    f"holds {sorted(shard)}, tensor rank 0 holds {sorted(names)} for the same "
                    "layer: shards of two different runs?",
                    source=str(layout.pipeline_files[(layer, rank)]),
                )
        out[layer] = {name: _merge(name, [s[name] for s in shards], args) for name in names}
        del shards
        if progress:
            _progress(i + 1, len(layers), layout.tp, time.perf_counter() - start)
    return out


def _block(
    dst: str, src: dict[str, torch.Tensor], args: ModelArgs, bias_factor: float
) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    names = {"input_layernorm": "attention_norm", "post_attention_layernorm": "mlp_norm"}
    for theirs, ours in names.items():
        for kind in ("weight", "bias", "scale"):  # rmsnorm's weight is called scale
            if f"{theirs}.{kind}" in src:
                out[f"{dst}{ours}.{'weight' if kind == 'scale' else kind}"] = src[
                    f"{theirs}.{kind}"
                ]
    for kind in ("weight", "bias"):
        qkv = src.get(f"attention.query_key_value.{kind}")
        if qkv is not None:
            out |= {
                f"{dst}attention.{k}.{kind}": t for k, t in _split_fused_qkv(dst, qkv, kind, args)
            }
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


def _split_fused_qkv(
    dst: str, qkv: torch.Tensor, kind: str, args: ModelArgs
) -> list[tuple[str, torch.Tensor]]:
    """GPT-NeoX's query_key_value as wq, wk, wv: per head [q, k, v] interleaved with one key/value
    head per query head; with grouped-query attention all of Q, then K, then V."""
    d, heads, kv = args.head_dim, args.num_heads, args.num_kv_heads
    rows = (heads + 2 * kv) * d
    if qkv.shape[0] != rows or (kind == "weight" and qkv.shape[1] != args.hidden_size):
        raise NeoXCheckpointError(
            f"{dst}: attention.query_key_value.{kind} has shape {tuple(qkv.shape)}, the config "
            f"needs {(rows, args.hidden_size) if kind == 'weight' else (rows,)}; the weights do not "
            "match the config"
        )
    if kv == heads:
        parts = _split_qkv(qkv, heads, d)
    else:
        parts = tuple(t.contiguous() for t in qkv.split([heads * d, kv * d, kv * d], dim=0))
    return list(zip(("wq", "wk", "wv"), parts, strict=True))


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
    for kind in ("weight", "bias", "scale"):
        if f"norm.{kind}" in layers[n + 3]:
            out[f"final_norm.{'weight' if kind == 'scale' else kind}"] = layers[n + 3][
                f"norm.{kind}"
            ]
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
        kind = name.rsplit(".", 1)[1]
        return {f"final_norm.{'weight' if kind == 'scale' else kind}": tensor}
    if layer == n + 4:
        return {"output.weight": tensor}
    return _block(f"layers.{layer - 2}.", {name: tensor}, args, 1.0)


def _frozen_optimizer(opt: Any) -> bool:
    """A FusedAdam state dict saved before the first step: no moments yet."""
    return isinstance(opt, dict) and opt.get("state") == {} and "param_groups" in opt


def zero_partitions(layout: NeoXLayout, states: list[dict], rank: int) -> dict | None:
    """The ZeRO-1/2 optimizer partitions of tensor rank ``rank`` put back together as one
    FusedAdam-style state dict ({"state": {index: {step, exp_avg, exp_avg_sq}}}, indices in the
    order of ``param_shapes``), None if the optimizer never stepped. Each data-parallel rank
    holds a contiguous slice of each parameter group, flattened; ``param_slice_mappings`` say
    where each parameter's fragment lies in it, so a parameter cut between two ranks is joined."""
    files = {dp: path for (dp, mp), path in layout.zero_files.items() if mp == rank}
    parts = []
    for dp in sorted(files):
        sd = _load(files[dp])
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(osd, dict) or "base_optimizer_state" not in osd:
            raise NeoXCheckpointError("is not a ZeRO optimizer partition", source=str(files[dp]))
        parts.append((files[dp], osd))
    if not parts:
        raise NeoXCheckpointError(
            f"has zero_pp_rank files, but none for tensor rank {rank}", source=str(layout.step_dir)
        )
    count = int((parts[0][1].get("partition_count") or [len(files)])[0])
    for path, osd in parts:
        if any(int(c) != count for c in osd.get("partition_count") or [count]):
            raise NeoXCheckpointError(
                f"was cut into {osd.get('partition_count')} partitions, {parts[0][0].name} into "
                f"{count}: partitions of two different runs?",
                source=str(path),
            )
    missing = sorted(set(range(count)) - set(files))
    if missing:
        raise NeoXCheckpointError(
            f"zero_pp_rank_{missing[0]}_mp_rank_{rank:02d}_optim_states.pt is missing (the "
            f"optimizer was cut into {count} data-parallel partitions)",
            source=str(layout.step_dir),
        )
    if len(files) != count:
        extra = sorted(set(files) - set(range(count)))
        raise NeoXCheckpointError(
            f"the optimizer was cut into {count} data-parallel partitions, but "
            f"{files[extra[0]].name} is there too: a file of another run?",
            source=str(layout.step_dir),
        )
    shapes = states[rank].get("param_shapes")
    if not isinstance(shapes, list) or not shapes:
        raise NeoXCheckpointError(
            "has no param_shapes: cannot place the ZeRO partitions",
            source=str(layout.rank_files[rank]),
        )
    if all(not osd["base_optimizer_state"].get("state") for _, osd in parts):
        return None
    out: dict[int, dict[str, Any]] = {}
    index = 0
    for group, group_shapes in enumerate(shapes):
        for name, shape in group_shapes.items():
            entry: dict[str, Any] = {}
            for kind in ("exp_avg", "exp_avg_sq", "fp32"):  # fp32: the master weights
                pieces = []
                for _, osd in parts:
                    where = osd["param_slice_mappings"][group].get(name)
                    if where is None:
                        continue
                    start = int(where.field("start", 1))
                    numel = int(where.field("numel", 0))
                    flat = (
                        osd["single_partition_of_fp32_groups"][group]
                        if kind == "fp32"
                        else osd["base_optimizer_state"]["state"][group][kind]
                    )
                    pieces.append(flat[start : start + numel])
                joined = torch.cat(pieces) if pieces else torch.empty(0)
                if joined.numel() != torch.Size(shape).numel():
                    raise NeoXCheckpointError(
                        f"the ZeRO partitions hold {joined.numel()} elements of {name}, its shape "
                        f"{tuple(shape)} needs {torch.Size(shape).numel()}: partitions of another run?",
                        source=str(layout.step_dir),
                    )
                entry[kind] = joined.reshape(shape).clone()
            entry["step"] = int(parts[0][1]["base_optimizer_state"]["state"][group]["step"])
            entry["name"] = name
            out[index] = entry
            index += 1
    return {"state": out}


def optimizer_state(
    rank_states: list[dict], layout: NeoXLayout, layers: dict, args: ModelArgs
) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """Adam moments by torchneox parameter name, and the step count; ({}, 0) for an optimizer
    that never stepped. Read from the mp_rank files (ZeRO 0) or the zero_pp_rank partitions."""
    if not rank_states:
        raise NeoXCheckpointError(
            "has layer files only (no mp_rank_*_model_states.pt): the optimizer state, iteration "
            "and data position are not there; convert without --with-optimizer",
            source=str(layout.step_dir),
        )
    opts = [state.get("optimizer") for state in rank_states]
    if all(_frozen_optimizer(o) for o in opts):
        return {}, 0  # saved before the first step (extra_save_iters 0): a fresh optimizer
    if all(o is None for o in opts) and layout.zero_files:
        opts = [zero_partitions(layout, rank_states, r) for r in range(layout.tp)]
        if all(o is None for o in opts):
            return {}, 0
    bad = next(
        (r for r, o in enumerate(opts) if not isinstance(o, dict) or not o.get("state")), None
    )
    if bad is not None:
        raise NeoXCheckpointError(
            f"keeps no optimizer state in mp_rank_{bad:02d}_model_states.pt and there are no "
            "zero_pp_rank_*_optim_states.pt partitions; convert without --with-optimizer",
            source=str(layout.rank_files[bad]),
        )
    order = optimizer_order(args, layers)
    if len(order) != len(opts[0]["state"]):
        raise NeoXCheckpointError(
            f"the optimizer holds {len(opts[0]['state'])} tensors, the model has {len(order)}",
            source=str(layout.rank_files[0]),
        )
    step = max(int(s.get("step", 0)) for s in opts[0]["state"].values())
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for index, (layer, name) in enumerate(order):
        saved_name = opts[0]["state"][index].get("name")
        if saved_name is not None and saved_name != f"{layer}.{name}":
            raise NeoXCheckpointError(
                f"optimizer entry {index} is {saved_name}, the model's is {layer}.{name}",
                source=str(layout.step_dir),
            )
        kinds = ["exp_avg", "exp_avg_sq"]
        if all("fp32" in o["state"][index] for o in opts):
            kinds.append("fp32")
        for kind in kinds:
            merged = _merge(name, [o["state"][index][kind] for o in opts], args)
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
    progress: bool = False,
    force: bool = False,
) -> Path:
    step_dir = resolve_step(Path(folder), step)
    refuse_non_empty(Path(out_dir), force, "convert from-gpt-neox")  # before reading
    loaded = neox_config(step_dir, config_files or [], overrides or [])
    cfg = loaded.config
    layout = NeoXLayout.read(step_dir)
    if layout.tp != cfg.parallel.model_parallel_size:
        raise NeoXCheckpointError(
            f"has {layout.tp} tensor-parallel shards but the config says model_parallel_size "
            f"{cfg.parallel.model_parallel_size}; convert with --set model_parallel_size={layout.tp}",
            source=str(step_dir),
        )
    states = [_load(layout.rank_files[r]) for r in range(len(layout.rank_files))]
    world = None  # layer files alone: the world size the config gives, or the smallest layout
    if states:  # the run's own world: its data-parallel size sets the global batch
        dp = int(states[0].get("dp_world_size") or 1)
        world = max(cfg.parallel.pipe_parallel_size, 1) * cfg.parallel.model_parallel_size * dp
    derived = derive(loaded, world_size=world)
    args = ModelArgs.from_config(cfg, derived["padded_vocab_size"])
    layers = merged_layers(layout, states, args, progress)
    bias_factor = float(layout.tp) if (cfg.model.gpt_j_residual and layout.tp > 1) else 1.0
    weights = _checked_model_state(layers, args, bias_factor, step_dir)
    iteration = int(states[0].get("iteration") or 0) if states else 0
    if states:
        _check_schedule(states[0].get("lr_scheduler"), derived)
    state: dict[str, Any] = {"model": _fp32(weights)}
    meta: dict[str, Any] = {"converted_from": f"GPT-NeoX {step_dir}", "iteration": iteration}
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
    yaml_text = render_yaml(with_absolute_paths(loaded), derived)
    out = Path(out_dir)
    with new_output_dir(out, force, "convert from-gpt-neox") as tmp:
        step = checkpoint.save_checkpoint(tmp, meta["iteration"], state, yaml_text, meta)
    return out / step.name


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
    missing = sorted(set(expected) - set(weights))
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
    return {k: weights[k].contiguous() for k in expected}


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
    from torchneox.train.optim import build_optimizer

    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(weights, assign=True)
    osd = get_optimizer_state_dict(model, build_optimizer(model, cfg, "cpu"))
    for name, entry in osd["state"].items():
        entry["exp_avg"].copy_(moments[name]["exp_avg"])
        entry["exp_avg_sq"].copy_(moments[name]["exp_avg_sq"])
        entry["step"].fill_(float(step))
    return osd
