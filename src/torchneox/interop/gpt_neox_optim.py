"""GPT-NeoX's optimizer state (DeepSpeed's fp32 partitions, ZeRO-1/2 shards) mapped onto
torchneox's parameters, in GPT-NeoX's parameter order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import NeoXCheckpointError
from torchneox.interop.gpt_neox_files import (
    GMLP_TYPES,
    GMLP_UNUSED,
    MAMBA_MIXER,
    NeoXLayout,
    block_tensors,
    load_file,
    merge_shards,
    rwkv_tensors,
)
from torchneox.models.args import ModelArgs

RWKV_ORDER = (
    "ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias",
    *(f"att.time_maa_{m}" for m in ("x", "w", "k", "v", "r", "g", "w1", "w2")),
    "att.time_decay", "att.time_decay_w1", "att.time_decay_w2", "att.time_faaaa",
    *(f"att.{m}.weight" for m in ("receptance", "key", "value", "output", "gate")),
    "att.ln_x.weight", "att.ln_x.bias",
    "ffn.time_maa_k", "ffn.time_maa_r",
    *(f"ffn.{m}.weight" for m in ("key", "receptance", "value")),
)  # fmt: skip
"""RWKVResidualLayer's parameters in the order module.modules() meets them (megatron/model/
rwkv/v6/rwkv.py registers ln1, ln2, att's own tensors, its linears and ln_x, then ffn's)."""
GMLP_ORDER = (
    "norm", "input_linear", "sgu.norm", "sgu.proj", "sgu.attn.proj_qkv", "sgu.attn.proj_ffn",
    "output_linear",
)  # fmt: skip
"""GMLPBlock's modules in the order module.modules() meets them (megatron/model/gmlp.py)."""
TRANSFORMER_ORDER = (
    "input_layernorm",
    "attention.query_key_value",
    "attention.dense",
    "post_attention_layernorm",
    "mlp.linear1",
    "mlp.linear2",
)
MAMBA_ORDER = ("norm", *(f"mixer.{p}" for p in MAMBA_MIXER))
MAMBA_OWN = ("mixer.A_log", "mixer.D")  # the mixer's own parameters, not a module's


def _in_module_order(kind: str, names: list[str]) -> list[str]:
    """A block's GPT-NeoX tensor names in module order (each module's weight before its
    bias), for a layer of type ``kind``."""
    if kind == "rwkv":
        return sorted(names, key=RWKV_ORDER.index)
    if kind in GMLP_TYPES:
        order = GMLP_ORDER
    elif kind == "mamba":
        order = MAMBA_ORDER
    else:
        order = TRANSFORMER_ORDER

    def key(x: str) -> tuple[int, bool]:
        module = x if x in MAMBA_OWN else x.rsplit(".", 1)[0]
        return order.index(module), x.endswith(("bias", "offset"))

    return sorted(names, key=key)


def _no_decay(kind: str, name: str) -> bool:
    """Whether GPT-NeoX's get_params_for_weight_decay_optimization puts ``name`` in its
    no-decay group: a LayerNorm's, RMSNorm's or ScaleNorm's tensors, every bias, Mamba's A_log
    and D (_no_weight_decay). RWKV's ln_x is a GroupNorm, which decays its weight."""
    if kind == "rwkv":
        return name.startswith(("ln1.", "ln2.")) or name.endswith(".bias")
    return "norm" in name or name.endswith(("bias", *MAMBA_OWN))


def optimizer_order(
    args: ModelArgs, layers: dict[int, dict[str, torch.Tensor]]
) -> list[tuple[int, str]]:
    """(GPT-NeoX layer, tensor name) of each optimizer state index: first the weight-decay group
    (matrices, in module order), then the no-decay group (norms and biases, in module order)."""
    n = args.num_layers
    order = [0, *range(2, n + 2), n + 3, n + 4]
    decay, plain = [], []
    for layer in order:
        names = list(layers.get(layer, {}))
        kind = args.layer_type(layer - 2) if 2 <= layer < n + 2 else ""
        if kind:
            names = _in_module_order(kind, names)
        for name in names:
            target = plain if _no_decay(kind, name) else decay
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
    if args.layer_type(layer - 2) == "rwkv":
        return rwkv_tensors(f"layers.{layer - 2}.", {name: tensor})
    return block_tensors(f"layers.{layer - 2}.", {name: tensor}, args, 1.0)


def _unused(args: ModelArgs, layer: int, name: str) -> bool:
    """A GMLPBlock's projection bias, which GPT-NeoX's optimizer holds (always at zero
    gradient) and torchneox does not build."""
    n = args.num_layers
    return 2 <= layer < n + 2 and args.layer_type(layer - 2) in GMLP_TYPES and name in GMLP_UNUSED


def _frozen_optimizer(opt: Any) -> bool:
    """A FusedAdam state dict saved before the first step: no moments yet."""
    return isinstance(opt, dict) and opt.get("state") == {} and "param_groups" in opt


def zero_partitions(layout: NeoXLayout, states: list[dict], rank: int) -> dict | None:
    """The ZeRO-1/2 optimizer partitions of tensor rank ``rank`` put back together as one
    FusedAdam-style state dict ({"state": {index: {step, exp_avg, exp_avg_sq}}}, indices in the
    order of ``param_shapes``), None if the optimizer never stepped. Each data-parallel rank
    holds a contiguous slice of each parameter group, flattened; ``param_slice_mappings`` say
    where each parameter's fragment lies in it, so a parameter cut between two ranks is joined."""
    parts = _zero_files(layout, rank)
    shapes = states[rank].get("param_shapes")
    if not isinstance(shapes, list) or not shapes:
        raise NeoXCheckpointError(
            "has no param_shapes: cannot place the ZeRO partitions",
            source=str(layout.rank_files[rank]),
        )
    if all(not osd["base_optimizer_state"].get("state") for _, osd in parts):
        return None
    out: dict[int, dict[str, Any]] = {}
    for group, group_shapes in enumerate(shapes):
        for name, shape in group_shapes.items():
            entry = {
                kind: _joined(layout, parts, group, name, shape, kind)
                for kind in ("exp_avg", "exp_avg_sq", "fp32")  # fp32: the master weights
            }
            entry["step"] = int(parts[0][1]["base_optimizer_state"]["state"][group]["step"])
            entry["name"] = name
            out[len(out)] = entry
    return {"state": out}


def _zero_files(layout: NeoXLayout, rank: int) -> list[tuple[Path, dict]]:
    """(path, optimizer state dict) of each data-parallel partition of tensor rank ``rank``,
    in partition order, once they are known to be one run's complete set."""
    files = {dp: path for (dp, mp), path in layout.zero_files.items() if mp == rank}
    parts = []
    for dp in sorted(files):
        sd = load_file(files[dp])
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
    return parts


def _joined(
    layout: NeoXLayout, parts: list, group: int, name: str, shape: Any, kind: str
) -> torch.Tensor:
    """Parameter ``name``'s ``kind`` state, its fragments from every partition joined."""
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
    return joined.reshape(shape).clone()


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
    unused = {i for i, (layer, name) in enumerate(order) if _unused(args, layer, name)}
    held = set(opts[0]["state"])
    if held - set(range(len(order))) or set(range(len(order))) - unused - held:
        raise NeoXCheckpointError(
            f"the optimizer holds {len(opts[0]['state'])} tensors, the model has {len(order)}",
            source=str(layout.rank_files[0]),
        )
    step = max(int(s.get("step", 0)) for s in opts[0]["state"].values())
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for index, (layer, name) in enumerate(order):
        if index in unused:  # moments of a tensor that never reaches the output: dropped
            continue
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
            merged = merge_shards(name, [o["state"][index][kind] for o in opts], args)
            for ours, tensor in _to_ours(layer, name, merged, args).items():
                moments.setdefault(ours, {})[kind] = tensor
    return moments, step
