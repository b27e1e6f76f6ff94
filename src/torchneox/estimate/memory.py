"""Bytes on the most loaded rank, by part (parameters, gradients, optimizer state,
activations, temporaries), and the step time a layout gives at a stated MFU."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from torchneox.config.checks.model import layer_attention_types
from torchneox.config.features.eight_bit import (
    dtensor_axis,
    eight_bit,
    eight_bit_optimizer_bytes,
    library_for,
)
from torchneox.config.features.lora import is_base_linear, lora_spec
from torchneox.config.features.optimizer import muon_matrix, optimizer_spec
from torchneox.config.layout import Layout
from torchneox.config.load import LoadedConfig
from torchneox.config.sizes import is_moe_layer
from torchneox.estimate.activations import Trace
from torchneox.estimate.host import offload_parts
from torchneox.estimate.parameters import PARAM_BYTES, expert_sharded, local_dims, local_numel
from torchneox.models.params import (
    SOFT_PROMPT,
    VALUE_HEAD,
    is_adapter,
    is_drawn,
    trains_with_lora,
)

GIB = 2**30
CUDA_RESERVE = 1.5 * GIB  # CUDA context, cuBLAS/NCCL workspaces
USABLE = 0.95  # of the rest: the allocator's fragmentation


def optimizer_bytes_per_param(loaded: LoadedConfig) -> int:
    return optimizer_spec(loaded.config.optimizer).state_tensors * PARAM_BYTES


def hidden_optimizer_bytes(loaded: LoadedConfig) -> int:
    """Bytes per element of a block's hidden matrix (muon: Muon's one momentum buffer)."""
    return optimizer_spec(loaded.config.optimizer).hidden_state_tensors * PARAM_BYTES


def optimizer_bytes_per_tensor(
    loaded: LoadedConfig,
) -> Callable[[list[tuple[str, int]]], int] | None:
    """8-bit Adam (use_bnb_optimizer): the state bytes of a list of tensor shards, by name and
    values (config/features/eight_bit.py), in place of a number of bytes per parameter."""
    if not eight_bit(loaded.config.optimizer):
        return None
    cfg = loaded.config
    library = library_for(cfg.optimizer, dtensor_axis(cfg) is not None) or "torchao"
    return functools.partial(eight_bit_optimizer_bytes, library)


def weight_bytes(loaded: LoadedConfig) -> Callable[[str], int]:
    """The bytes of one element of each parameter, by name: fp32's, but for a LoRA base
    stored in bf16 (lora.base_dtype), whose linear weights hold two."""
    spec = lora_spec(loaded.config)
    if spec is None or spec.base_dtype != "bf16":
        return lambda _: PARAM_BYTES
    return lambda name: 2 if is_base_linear(name) else PARAM_BYTES


def optimizer_bytes_per_dim(loaded: LoadedConfig) -> int:
    """Bytes per row, column, ... of each tensor shard: SM3's accumulators, one number for
    each index of each dimension (one for a scalar)."""
    return PARAM_BYTES if optimizer_spec(loaded.config.optimizer).kind == "sm3" else 0


def fsdp_ranks(layout: Layout) -> int:
    """The ranks ZeRO shards over: the data-parallel ones (with hybrid sharding, one group of
    them), with context parallelism times its ranks (they shard as data-parallel ones do); 1
    under DDP (ZeRO 0 without tensor or pipeline parallelism)."""
    sharded = layout.zero > 0 or layout.tp > 1 or layout.pp > 1
    return layout.shard_ranks * layout.cp if sharded else 1


def memory_per_rank(
    loaded: LoadedConfig,
    layout: Layout,
    stages: list[list[tuple[str, tuple]]],
    trace: Trace,
    method: str,
) -> dict[str, Any]:
    """Bytes on the most loaded rank, by part, and which stage that is."""
    opt_per_param = optimizer_bytes_per_param(loaded)
    per_dim = optimizer_bytes_per_dim(loaded)
    hidden = hidden_optimizer_bytes(loaded)
    per_tensor = optimizer_bytes_per_tensor(loaded)
    fsdp = fsdp_ranks(layout)
    stored = weight_bytes(loaded)
    worst: dict[str, Any] | None = None
    prompted = has_prompt(stages)
    for k, params in enumerate(stages):
        state = state_bytes(
            params, layout, fsdp, opt_per_param, per_dim, hidden, per_tensor, stored, prompted
        )
        parts, temporary = state["parts"], state["temporary"]
        host = offload_parts(parts, state["resident"]) if layout.offload else None
        last = k == len(stages) - 1
        acts = _activation_bytes(loaded, layout, trace, params, k, last)
        parts["activations"] = acts["stored_after_forward"] + acts["recompute"]
        if last:  # the gradient of the logits (a tied head has them too)
            seq = loaded.config.model.seq_length // layout.cp  # this rank's tokens
            temporary += layout.micro_batch * seq * math.ceil(trace.vocab / layout.tp) * 4
        parts["temporary"] = temporary
        parts = {key: int(v) for key, v in parts.items()}
        parts["total"] = sum(parts.values())
        if worst is None or parts["total"] > worst["bytes"]["total"]:
            worst = {
                "stage": k,
                "bytes": parts,
                "resident": state["resident"],
                "parameters_on_rank": state["local"],
                "activations_after_forward": int(acts["stored_after_forward"]),
                "host": host,  # ZeRO-Offload: the shards in host memory
                "shard_elements": state["elements"],
            }
    assert worst is not None
    return worst


def has_prompt(stages: list[list[tuple[str, tuple]]]) -> bool:
    """Whether the model whose stages' parameters these are has a soft prompt (on stage 0)."""
    return any(n == SOFT_PROMPT for params in stages for n, _ in params)


def trained(params: list[tuple[str, tuple]], prompted: bool = False) -> list[tuple[str, tuple]]:
    """The parameters with gradients and optimizer state: all of them, or under
    soft_prompt_tuning the prompt alone (and a reward model's value head), under LoRA the
    adapters (and the prompt beside them; everything else is frozen). ``prompted``: the model
    has a soft prompt, on another pipeline stage than ``params``."""
    prompted = prompted or any(n == SOFT_PROMPT for n, _ in params)
    if prompted and not any_adapter(params):
        return [(n, s) for n, s in params if n in (SOFT_PROMPT, VALUE_HEAD)]
    if any_adapter(params):  # LoRA: the adapters alone (the base is frozen)
        return [(n, s) for n, s in params if trains_with_lora(n)]
    return params


def state_bytes(
    params: list[tuple[str, tuple]],
    layout: Layout,
    fsdp: int,
    opt_per_param: int,
    per_dim: int = 0,
    opt_hidden: int | None = None,
    per_tensor: Callable[[list[tuple[str, int]]], int] | None = None,
    stored: Callable[[str], int] | None = None,
    prompted: bool = False,
) -> dict[str, Any]:
    """A stage's parameters, gradients and optimizer state on one rank, and the temporary
    bytes ZeRO-3's gathered blocks and a whole embedding gradient add. ``per_dim``: optimizer
    bytes per index of each dimension of a shard (SM3's accumulators); ``opt_hidden``: per
    element of a block's hidden matrix, where it differs (muon's); ``per_tensor``: the
    optimizer bytes of the shards, from their names and values (8-bit Adam), in place of
    ``opt_per_param``; ``stored``: the bytes of an element of each parameter, by name (fp32's
    four where not given; a LoRA base in bf16 holds two); ``prompted``: the model has a soft
    prompt (only it trains, on whichever stage)."""
    tp, ep = layout.tp, layout.ep
    nbytes = stored or (lambda _: PARAM_BYTES)
    local = sum(local_numel(s, n, tp, 1, ep) for n, s in params)
    shard = sum(local_numel(s, n, tp, fsdp, ep) for n, s in params)
    shard_bytes = sum(local_numel(s, n, tp, fsdp, ep) * nbytes(n) for n, s in params)
    train = trained(params, prompted)
    trained_shard = sum(local_numel(s, n, tp, fsdp, ep) for n, s in train)
    resident = {
        "parameter_shard": shard_bytes,
        "gradient_shard": trained_shard * PARAM_BYTES,
        "optimizer": _optimizer_bytes(
            train, layout, fsdp, opt_per_param, per_dim, opt_hidden, per_tensor
        ),
    }
    parts = {
        "parameters": resident["parameter_shard"],
        "gradients": resident["gradient_shard"],
        "optimizer": resident["optimizer"],
    }
    temporary = _gathered(params, train, layout, fsdp, parts, nbytes)
    return {
        "parts": parts,
        "resident": resident,
        "local": local,
        "temporary": temporary,
        "elements": shard,
    }


def _gathered(
    params: list[tuple[str, tuple]],
    train: list[tuple[str, tuple]],
    layout: Layout,
    fsdp: int,
    parts: dict[str, float],
    nbytes: Callable[[str], int],
) -> float:
    """What ZeRO, DDP and tensor parallelism hold whole beyond the shards: added to ``parts``
    where it stays from forward to backward, returned where it is temporary."""
    tp, ep = layout.tp, layout.ep
    # what ZeRO/DDP gather or bucket: all but the expert-parallel experts
    gathered = sum(
        local_numel(s, n, tp, 1) * nbytes(n) for n, s in params if not expert_sharded(n, ep)
    )
    buckets = sum(local_numel(s, n, tp, 1) for n, s in train if not expert_sharded(n, ep))
    per_block = _largest_block(params, tp, ep, nbytes)
    temporary = 0.0
    gathers = fsdp > 1 or layout.offload  # (offload: FSDP2 gathers onto the device even alone)
    if gathers and layout.zero in (0, 1, 2):
        parts["parameters"] += gathered  # kept gathered from forward to backward
    elif gathers:
        temporary += 2 * per_block  # ZeRO-3: the block in use and the next
    if gathers and layout.gas > 1:
        parts["gradients"] += buckets * PARAM_BYTES  # unsharded until the last micro-batch
    if fsdp == 1 and layout.dp * layout.cp > 1:
        parts["gradients"] += buckets * PARAM_BYTES  # DDP's gradient buckets
    if tp > 1 and fsdp == 1:
        # the vocabulary-parallel embedding's gradient arrives whole on every tensor rank
        embed = [math.prod(s) for n, s in params if n == "embed.weight"]
        temporary += sum(e - local_numel((e,), "embed.weight", tp, 1) for e in embed) * PARAM_BYTES
    return temporary


def _optimizer_bytes(
    train: list[tuple[str, tuple]],
    layout: Layout,
    fsdp: int,
    opt_per_param: int,
    per_dim: int,
    opt_hidden: int | None,
    per_tensor: Callable[[list[tuple[str, int]]], int] | None,
) -> int:
    """The optimizer state of the trained parameters' shards on one rank (state_bytes' terms)."""
    tp, ep = layout.tp, layout.ep
    if per_tensor is not None:
        return per_tensor([(n, local_numel(s, n, tp, fsdp, ep)) for n, s in train])
    trained_shard = sum(local_numel(s, n, tp, fsdp, ep) for n, s in train)
    hidden = sum(local_numel(s, n, tp, fsdp, ep) for n, s in train if muon_matrix(n, s))
    opt_hidden = opt_per_param if opt_hidden is None else opt_hidden
    indices = sum(sum(local_dims(s, n, tp, fsdp, ep)) or 1 for n, s in train)
    return (trained_shard - hidden) * opt_per_param + hidden * opt_hidden + indices * per_dim


def _largest_block(
    params: list[tuple[str, tuple]], tp: int, ep: int, nbytes: Callable[[str], int]
) -> int:
    """The bytes of the largest block ZeRO-3 gathers (its expert-parallel experts aside)."""
    blocks: dict[str, int] = {}
    for n, s in params:
        if n.startswith("layers."):
            layer = n.split(".", 2)[1]
            held = 0 if expert_sharded(n, ep) else local_numel(s, n, tp, 1) * nbytes(n)
            blocks[layer] = blocks.get(layer, 0) + held
    return max(blocks.values(), default=0)


def any_adapter(params: list[tuple[str, tuple]]) -> bool:
    """Whether the model has LoRA adapters (then they alone train)."""
    return any(is_adapter(n) for n, _ in params)


def build_bytes(
    params: list[tuple[str, tuple]],
    layout: Layout,
    reference: bool,
    stored: Callable[[str], int] | None = None,
) -> int:
    """What a rank holds while the model is built (parallel/parallelize.py): its parameter
    shards (and the reference model's, for DPO and KTO), and, where the weights are split at
    all, the largest weight it draws whole to keep its part of it."""
    tp, ep, fsdp = layout.tp, layout.ep, fsdp_ranks(layout)
    nbytes = stored or (lambda _: PARAM_BYTES)
    shard = sum(local_numel(s, n, tp, fsdp, ep) * nbytes(n) for n, s in params)
    largest = 0
    if fsdp > 1 or tp > 1 or ep > 1:
        largest = max((math.prod(s) for n, s in params if is_drawn(n)), default=0) * PARAM_BYTES
    return shard * (2 if reference else 1) + largest


def _activation_bytes(
    loaded: LoadedConfig,
    layout: Layout,
    trace: Trace,
    params: list[tuple[str, tuple]],
    k: int,
    last: bool,
) -> dict[str, float]:
    """What stage ``k``'s micro-batches in flight leave for backward, and the block that
    checkpointing rebuilds during backward."""
    tp, ep = layout.tp, layout.ep
    layers = sorted({int(n.split(".")[1]) for n, _ in params if n.startswith("layers.")})
    in_flight = 1
    if layout.pp > 1:
        in_flight = layout.gas if layout.schedule == "gpipe" else min(layout.gas, layout.pp - k)
    rep_by = tp if layout.sequence_parallel else 1
    mb = layout.micro_batch
    dense = (
        mb * (trace.layer_replicated / rep_by + trace.layer_split / tp),
        trace.layer_weights / tp,  # per micro-batch in flight
        trace.layer_kept / tp,
    )
    moe = (
        mb * (trace.moe_replicated / rep_by + trace.moe_split / tp + trace.moe_experts),
        trace.moe_weights / tp + trace.moe_expert_weights / ep,
        trace.moe_kept / tp,
    )
    kinds = layer_attention_types(loaded.config)
    families = {
        kind: (mb * (f.replicated / rep_by + f.split / tp), f.weights / tp, f.kept / tp)
        for kind, f in trace.families.items()
    }
    stored = recompute = 0.0
    for position, layer in enumerate(layers):
        acts, weights, kept = families.get(kinds[layer]) or (
            moe if is_moe_layer(loaded.config.moe, layer) else dense
        )
        checkpointed = layout.checkpoint != "none" and position % layout.every == 0
        if not checkpointed:
            stored += acts + weights
            continue
        stored += mb * trace.layer_input / rep_by
        if layout.checkpoint == "selective":
            stored += mb * kept
        recompute = max(recompute, acts + weights)  # one block rebuilt in its backward
    rest = 0.0
    if last:
        rest = mb * (trace.rest_replicated / rep_by + trace.rest_split / tp)
        rest += trace.rest_weights / tp
    return {"stored_after_forward": in_flight * (stored + rest), "recompute": recompute}


def step_time(flops_per_step: float, layout: Layout, peak: float, mfu: float) -> float:
    """Seconds per step at ``mfu`` of the peak (model FLOPs), slowed by the pipeline bubble and
    by recomputation, which MFU does not count."""
    seconds = flops_per_step / (layout.gpus * peak * 1e12 * mfu)
    if layout.pp > 1 and layout.schedule in ("1f1b", "gpipe"):
        seconds /= 1 - (layout.pp - 1) / (layout.gas + layout.pp - 1)
    if layout.checkpoint == "full":
        seconds *= 4 / 3  # one more forward
    elif layout.checkpoint == "selective":
        seconds *= 1.03
    return seconds
