"""Reading GPT-NeoX (DeepSpeed) checkpoint files into torchneox's parameter names.

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
from torchneox.models.args import ModelArgs
from torchneox.models.hf.weights import split_qkv

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


SPLIT_COLUMNS = ("attention.dense.weight", "mlp.linear2.weight", "attention.rpe.weight")


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


def load_file(path: Path) -> Any:
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


def merge_shards(name: str, shards: list[torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """One tensor from its tensor-parallel shards, joined along the dimension GPT-NeoX split."""
    if len(shards) == 1:
        return shards[0]
    if name.startswith("mixer."):
        raise NeoXCheckpointError(
            f"{name}: mamba layers saved with model_parallel_size {len(shards)} are not read "
            "(GPT-NeoX's split of in_proj pairs other channels than one rank's model); convert "
            "a run saved with model_parallel_size 1"
        )
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
                name: merge_shards(name, [rank[layer][name] for rank in per_rank], args)
                for name in per_rank[0][layer]
            }
        return out
    layers = sorted({layer for layer, _ in layout.pipeline_files})
    start = time.perf_counter()
    for i, layer in enumerate(layers):
        shards = []
        for rank in range(layout.tp):
            path = layout.pipeline_files[(layer, rank)]
            shards.append({k: v for k, v in load_file(path).items() if isinstance(v, torch.Tensor)})
        names = list(shards[0])
        for rank, shard in enumerate(shards[1:], 1):
            if set(shard) != set(names):
                raise NeoXCheckpointError(
                    f"holds {sorted(shard)}, tensor rank 0 holds {sorted(names)} for the same "
                    "layer: shards of two different runs?",
                    source=str(layout.pipeline_files[(layer, rank)]),
                )
        out[layer] = {name: merge_shards(name, [s[name] for s in shards], args) for name in names}
        del shards
        if progress:
            _progress(i + 1, len(layers), layout.tp, time.perf_counter() - start)
    return out


GMLP_TYPES = ("gmlp", "amlp")
GMLP_UNUSED = ("input_linear.bias", "output_linear.bias")
"""GMLPBlock's projection biases: GPT-NeoX builds them with skip_bias_add and drops them, so
they never reach its output (torchneox builds none)."""


def _gmlp_tensors(dst: str, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GMLPBlock's tensors (megatron/model/gmlp.py's names) under torchneox's: its norm is
    the block's gmlp_norm, the rest the gmlp mixer's (rmsnorm's scale is its weight)."""
    out = {}
    for name, tensor in src.items():
        if name in GMLP_UNUSED:
            continue
        module, _, kind = name.rpartition(".")
        kind = "weight" if kind == "scale" else kind
        ours = "gmlp_norm" if module == "norm" else f"gmlp.{module}"
        out[f"{dst}{ours}.{kind}"] = tensor
    return out


MAMBA_MIXER = ("A_log", "D", "in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")
"""GPT-NeoX's ParallelMambaBlock's parameters and modules, in its module order (the mixer's
own A_log and D first, then its linears and conv1d as registered; its layer's ``norm`` before
it all): torchneox's mamba mixer has the same names."""


def _mamba_tensors(dst: str, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ParallelMambaResidualLayer's tensors: ``norm.*`` and ``mixer.*`` -> ``mamba_norm.*`` and
    ``mamba.*`` (rmsnorm's scale is the weight, its offset the bias)."""
    kinds = {"scale": "weight", "weight": "weight", "offset": "bias", "bias": "bias"}
    out = {}
    for name, tensor in src.items():
        module, _, kind = name.partition(".")
        if module == "norm":
            out[f"{dst}mamba_norm.{kinds[kind]}"] = tensor
        elif module == "mixer":
            out[f"{dst}mamba.{kind}"] = tensor
    return out


def block_tensors(
    dst: str, src: dict[str, torch.Tensor], args: ModelArgs, bias_factor: float
) -> dict[str, torch.Tensor]:
    if args.layer_type(int(dst.split(".")[1])) in GMLP_TYPES:
        return _gmlp_tensors(dst, src)
    if any(name.startswith("mixer.") for name in src) or (
        args.layer_type(int(dst.split(".")[1])) == "mamba"
    ):
        return _mamba_tensors(dst, src)
    out: dict[str, torch.Tensor] = {}
    names = {
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "mlp_norm",
        "attention.qk_layernorm": "attention.qk_norm",  # use_qk_layernorm: one norm, [heads, d]
    }
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


RWKV_NAMES = (
    ("ln1.", "time_mix_norm."),
    ("ln2.", "channel_mix_norm."),
    ("att.ln_x.", "time_mix.out_norm."),
    ("att.", "time_mix."),
    ("ffn.", "channel_mix."),
)
"""GPT-NeoX's RWKVResidualLayer names -> torchneox's (the rest of each name is the same)."""


def rwkv_tensors(dst: str, src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in src.items():
        theirs, ours = next(((t, o) for t, o in RWKV_NAMES if name.startswith(t)), (None, None))
        if theirs is None:
            raise NeoXCheckpointError(f"{dst}: {name} is not a tensor of GPT-NeoX's RWKV layer")
        out[f"{dst}{ours}{name.removeprefix(theirs)}"] = tensor
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
        parts = split_qkv(qkv, heads, d)
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
    for name, tensor in layers[0].items():  # with StableEmbedding (use_bnb_optimizer): norm.*
        if name.startswith("position_embeddings."):
            out["pos_embed." + name.removeprefix("position_embeddings.")] = tensor
    if "attention.rpe.weight" in layers.get(2, {}):  # one table, saved with every layer
        out["rpe.weight"] = layers[2]["attention.rpe.weight"]
    for i in range(n):
        if args.layer_type(i) == "rwkv":
            out |= rwkv_tensors(f"layers.{i}.", layers[i + 2])
            continue
        out |= block_tensors(f"layers.{i}.", layers[i + 2], args, bias_factor)
    for kind in ("weight", "bias", "scale"):
        if f"norm.{kind}" in layers[n + 3]:
            out[f"final_norm.{'weight' if kind == 'scale' else kind}"] = layers[n + 3][
                f"norm.{kind}"
            ]
    if args.value_head:  # a reward model: rm_linear, absent from a language model's checkpoint
        value = layers.get(n + 4, {}).get("rm_linear.weight")
        if value is not None:
            out["value_head.weight"] = value
        return out
    head = layers.get(n + 4, {}).get("final_linear.weight")
    if not args.tied_embeddings:
        if head is None:
            raise NeoXCheckpointError(
                f"no_weight_tying is set but layer {n + 4} (final_linear) is missing"
            )
        out["output.weight"] = head
    return out
