"""GPT-NeoX's optimizer state (DeepSpeed's fp32 partitions, ZeRO-1/2 shards) mapped onto
torchneox's parameters, in GPT-NeoX's parameter order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import NeoXCheckpointError
from torchneox.interop.gpt_neox_files import (
    MAMBA_MIXER,
    NeoXLayout,
    block_tensors,
    load_file,
    merge_shards,
)
from torchneox.models.args import ModelArgs


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
    mamba_order = ("norm", *(f"mixer.{p}" for p in MAMBA_MIXER))
    decay, plain = [], []
    for layer in order:
        names = list(layers.get(layer, {}))
        if 2 <= layer < n + 2 and args.layer_type(layer - 2) == "mamba":
            own = ("mixer.A_log", "mixer.D")  # the mixer's own parameters, not a module's
            names.sort(
                key=lambda x: (
                    mamba_order.index(x if x in own else x.rsplit(".", 1)[0]),
                    x.endswith("bias"),
                )
            )
        elif 2 <= layer < n + 2:
            names.sort(key=lambda x: (block_order.index(x.rsplit(".", 1)[0]), x.endswith("bias")))
        for name in names:
            is_norm = "norm" in name or name.endswith(("mixer.A_log", "mixer.D"))  # no decay
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
    return block_tensors(f"layers.{layer - 2}.", {name: tensor}, args, 1.0)


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
            merged = merge_shards(name, [o["state"][index][kind] for o in opts], args)
            for ours, tensor in _to_ours(layer, name, merged, args).items():
                moments.setdefault(ours, {})[kind] = tensor
    return moments, step
