"""What a config will cost before a GPU-hour is spent: parameters, FLOPs, memory per rank (by
part), whether it fits, step time at a stated MFU, and the nearest layouts that fit.

The memory model follows what torchneox holds, not a textbook: parameters, gradients and
optimizer state come from the model's real parameter shapes split the way tensor, pipeline and
FSDP sharding split them (exact per rank; a test compares with running processes), and the
activations from tracing the real model's forward on fake tensors (no memory, no compute) and
adding up what autograd saves for backward.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from torchneox.base.errors import ConfigError
from torchneox.config.derive import derive
from torchneox.config.layout import Layout, check_layout, layout_problem
from torchneox.config.load import LoadedConfig
from torchneox.config.sizes import is_moe_layer
from torchneox.models.moe import LocalTokenDispatcher
from torchneox.train.hardware import ACCELERATORS, Accelerator, peak_tflops

GIB = 2**30
PARAM_BYTES = 4  # parameters, gradients and optimizer moments are fp32 (autocast does the rest)
CUDA_RESERVE = 1.5 * GIB  # CUDA context, cuBLAS/NCCL workspaces
USABLE = 0.95  # of the rest: the allocator's fragmentation


# ----------------------------------------------------------------------------- parameters

_SPLIT_ROWS = ("attention.wq.", "attention.wk.", "attention.wv.", "mlp.up.", "mlp.gate.")


def _tp_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits a parameter on (None: replicated)."""
    if name in ("embed.weight", "output.weight") or any(s in name for s in _SPLIT_ROWS):
        return 0
    if name.endswith(("attention.wo.weight", "mlp.down.weight")):
        return 1
    return None


def _expert_sharded(name: str, ep: int) -> bool:
    """Expert weights under expert parallelism: split over ep, left alone by ZeRO/DDP."""
    from torchneox.parallel.expert_parallel import EXPERT_PARAMS

    return ep > 1 and name.rsplit(".", 1)[-1] in EXPERT_PARAMS


def _local_numel(shape: tuple[int, ...], name: str, tp: int, fsdp: int, ep: int = 1) -> int:
    """Elements rank 0 holds: the tensor-parallel shard, then FSDP's dim-0 chunk of it (torch
    chunks give rank 0 the rounded-up share); with expert parallelism, its share of the
    experts instead."""
    dims = list(shape)
    if _expert_sharded(name, ep):
        return math.prod(dims) // dims[0] * math.ceil(dims[0] / ep)
    dim = _tp_dim(name)
    if tp > 1 and dim is not None and dim < len(dims):
        dims[dim] = math.ceil(dims[dim] / tp)
    if fsdp > 1 and dims:
        dims[0] = math.ceil(dims[0] / fsdp)
    return math.prod(dims)


def _meta_model(loaded: LoadedConfig, vocab: int, layers: int | None = None, **changes):
    from torchneox.models.args import ModelArgs
    from torchneox.models.transformer import Transformer

    args = ModelArgs.from_config(loaded.config, vocab)
    if layers is not None:
        changes["num_layers"] = layers
    args = dataclasses.replace(args, **changes)
    with torch.device("meta"):
        return args, Transformer(args)


def _stage_params(
    loaded: LoadedConfig, vocab: int, pp: int, method: str
) -> list[list[tuple[str, tuple]]]:
    """(name, shape) of the parameters each pipeline stage holds."""
    from torchneox.parallel.pipeline import stage_layers

    args, model = _meta_model(loaded, vocab)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if pp <= 1:
        return [shapes]
    ranges = stage_layers(args, pp, method)
    stages = []
    for k, r in enumerate(ranges):
        keep = []
        for name, shape in shapes:
            if name.startswith("layers."):
                if int(name.split(".")[1]) in r:
                    keep.append((name, shape))
            elif name.startswith(("embed.", "pos_embed.")):
                if k == 0:
                    keep.append((name, shape))
            elif k == pp - 1:
                keep.append((name, shape))
        stages.append(keep)
    return stages


# ----------------------------------------------------------------------------- activations


@dataclass
class _Trace:
    """Bytes autograd saves, per sample (they grow with the micro-batch) and per micro-batch
    (the low-precision copies of the weights autocast makes), for one layer and the rest."""

    layer_replicated: float = 0.0  # hidden-wide tensors (norms, residual): not split by tp
    layer_split: float = 0.0  # heads, MLP width, vocabulary: split by tp
    layer_kept: float = 0.0  # outputs of what selective checkpointing keeps
    layer_input: float = 0.0
    rest_replicated: float = 0.0
    rest_split: float = 0.0
    layer_weights: float = 0.0  # per micro-batch: autocast's weight copies, split by tp
    rest_weights: float = 0.0
    vocab: int = 0  # the padded vocabulary: the logits' width
    # an MoE layer (balanced routing): attention and norms as above, and what its router and
    # experts keep, which tensor parallelism does not split (experts are whole on every rank)
    moe_replicated: float = 0.0
    moe_split: float = 0.0
    moe_kept: float = 0.0
    moe_experts: float = 0.0
    moe_weights: float = 0.0
    moe_expert_weights: float = 0.0  # autocast's copies of the experts: split by ep


def _trace_saved(
    loaded: LoadedConfig, vocab: int, layers: int, precision: str, batch: int = 1, moe: bool = False
) -> tuple[float, float, float, float]:
    """(replicated, split, kept, experts) bytes saved by a forward + loss on fake tensors: on
    (fake) CUDA tensors on a GPU machine, so autocast and attention pick what training picks
    there, else on the CPU, whose autocast keeps the same dtypes. ``moe``: every layer an MoE
    layer with balanced routing (else every layer dense)."""
    if torch.cuda.is_available():
        try:
            return _trace_on(loaded, vocab, layers, precision, "cuda", batch, moe)
        except Exception:  # a kernel with no fake implementation: trace on the CPU instead
            pass
    return _trace_on(loaded, vocab, layers, precision, "cpu", batch, moe)


class _BalancedCounts(LocalTokenDispatcher):
    """The trace's dispatcher: fake tensors have no values, so every expert gets an equal
    share of the assignments (what the load-balancing loss aims for)."""

    def count(self, experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
        base, extra = divmod(experts.numel(), num_experts)
        counts = [base + (e < extra) for e in range(num_experts)]
        return torch.tensor(counts, device=experts.device), counts


def _trace_on(
    loaded: LoadedConfig,
    vocab: int,
    layers: int,
    precision: str,
    device: str,
    batch: int = 1,
    moe: bool = False,
) -> tuple[float, float, float, float]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchneox.models.moe import MoE
    from torchneox.parallel.activation_ckpt import KEPT_OPS
    from torchneox.train.loss import lm_loss
    from torchneox.train.precision import autocast

    args, _ = _meta_model(
        loaded, vocab, layers, **({"moe_interval": 1} if moe else {"moe_num_experts": 1})
    )
    seq = loaded.config.model.seq_length
    saved: dict[int, tuple[int, str]] = {}
    kept = [0]
    inside_moe = [0]

    excluded: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if StorageWeakRef(storage).cdata in excluded:
            return t
        if inside_moe[0]:  # experts are whole on every tensor-parallel rank
            kind = "experts"
        elif t.dim() > 0 and t.shape[-1] == args.hidden_size:
            kind = "replicated"
        else:
            kind = "split"
        saved[StorageWeakRef(storage).cdata] = (storage.nbytes(), kind)
        return t

    class KeptOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            if func in KEPT_OPS and isinstance(out, torch.Tensor):
                kept[0] += out.untyped_storage().nbytes()
            return out

    from torchneox.models.transformer import Transformer

    def enter(module, inputs):
        inside_moe[0] += 1

    def leave(module, inputs, output):
        inside_moe[0] -= 1

    with FakeTensorMode(allow_non_fake_inputs=True), torch.device(device):
        model = Transformer(args)
        model.train()
        for module in model.modules():
            if isinstance(module, MoE):
                module.dispatcher = _BalancedCounts()
                module.sinkhorn_tol = None  # no early stop: fake tensors cannot be compared
                module.register_forward_pre_hook(enter)
                module.register_forward_hook(leave)
        tokens = torch.zeros(batch, seq + 1, dtype=torch.long)
        # parameters saved for backward (a matmul keeps its weight) are not activations
        for tensor in [*model.parameters(), *model.buffers(), tokens]:
            excluded.add(StorageWeakRef(tensor.untyped_storage()).cdata)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks, KeptOps(), autocast(precision, device):
            lm_loss(model(tokens[:, :-1]), tokens[:, 1:], None, blocked=False)

    def total(kind: str) -> float:
        return sum(n for n, k in saved.values() if k == kind)

    return total("replicated"), total("split"), kept[0], total("experts")


def _layer_terms(loaded: LoadedConfig, vocab: int, precision: str, moe: bool) -> dict[str, float]:
    """Four traces (1 and 2 layers, micro-batch 1 and 2) separate what grows with the layers
    and with the micro-batch from what does not."""
    t = {(n, b): _trace_saved(loaded, vocab, n, precision, b, moe) for n in (1, 2) for b in (1, 2)}

    def per_sample(i: int) -> list[float]:  # for 1 and 2 layers
        return [t[(n, 2)][i] - t[(n, 1)][i] for n in (1, 2)]

    def per_batch(*kinds: int) -> list[float]:  # what does not grow with the micro-batch
        return [sum(2 * t[(n, 1)][i] - t[(n, 2)][i] for i in kinds) for n in (1, 2)]

    rep, split, kept, experts = (per_sample(i) for i in range(4))
    weights, expert_weights = per_batch(0, 1), per_batch(3)
    return {
        "replicated": rep[1] - rep[0],
        "split": split[1] - split[0],
        "kept": kept[1] - kept[0],
        "experts": experts[1] - experts[0],
        "weights": weights[1] - weights[0],
        "expert_weights": expert_weights[1] - expert_weights[0],
        "rest_replicated": 2 * rep[0] - rep[1],
        "rest_split": 2 * split[0] - split[1],
        "rest_weights": 2 * weights[0] - weights[1],
    }


def trace_activations(loaded: LoadedConfig, vocab: int, precision: str) -> _Trace:
    """Per dense layer, per MoE layer (when the model has them) and for the rest."""
    seq, h = loaded.config.model.seq_length, loaded.config.model.hidden_size
    dense = _layer_terms(loaded, vocab, precision, moe=False)
    trace = _Trace(
        layer_replicated=dense["replicated"],
        layer_split=dense["split"],
        layer_kept=dense["kept"],
        layer_input=seq * h * PARAM_BYTES,
        rest_replicated=dense["rest_replicated"],
        rest_split=dense["rest_split"],
        layer_weights=dense["weights"],
        rest_weights=dense["rest_weights"],
        vocab=vocab,
    )
    if loaded.config.moe.moe_num_experts > 1:
        moe = _layer_terms(loaded, vocab, precision, moe=True)
        trace.moe_replicated = moe["replicated"]
        trace.moe_split = moe["split"]
        trace.moe_kept = moe["kept"]
        trace.moe_experts = moe["experts"]
        trace.moe_weights = moe["weights"]
        trace.moe_expert_weights = moe["expert_weights"]
    return trace


# ----------------------------------------------------------------------------- the estimate


def _optimizer_bytes_per_param(loaded: LoadedConfig) -> int:
    opt = loaded.config.optimizer.optimizer or {"type": "Adam"}
    kind = str(opt.get("type", "adam")).lower()
    if kind == "sgd":
        return PARAM_BYTES if float(opt.get("params", {}).get("momentum", 0.0) or 0.0) else 0
    if kind == "lion":
        return PARAM_BYTES
    return 2 * PARAM_BYTES  # Adam/AdamW: two moments


def memory_per_rank(
    loaded: LoadedConfig,
    layout: Layout,
    stages: list[list[tuple[str, tuple]]],
    trace: _Trace,
    method: str,
) -> dict[str, Any]:
    """Bytes on the most loaded rank, by part, and which stage that is."""
    opt_per_param = _optimizer_bytes_per_param(loaded)
    fsdp = layout.dp if (layout.zero > 0 or layout.tp > 1 or layout.pp > 1) else 1
    tp, ep = layout.tp, layout.ep
    worst: dict[str, Any] | None = None
    for k, params in enumerate(stages):
        local = sum(_local_numel(s, n, tp, 1, ep) for n, s in params)
        shard = sum(_local_numel(s, n, tp, fsdp, ep) for n, s in params)
        # what ZeRO/DDP gather or bucket: all but the expert-parallel experts
        gathered = sum(_local_numel(s, n, tp, 1) for n, s in params if not _expert_sharded(n, ep))
        layers = sorted({int(n.split(".")[1]) for n, _ in params if n.startswith("layers.")})
        per_block = max(
            (
                sum(
                    _local_numel(s, n, tp, 1)
                    for n, s in params
                    if n.startswith(f"layers.{i}.") and not _expert_sharded(n, ep)
                )
                for i in layers
            ),
            default=0,
        )
        resident = {
            "parameter_shard": shard * PARAM_BYTES,
            "gradient_shard": shard * PARAM_BYTES,
            "optimizer": shard * opt_per_param,
        }
        parts = {
            "parameters": resident["parameter_shard"],
            "gradients": resident["gradient_shard"],
            "optimizer": resident["optimizer"],
        }
        temporary = 0.0
        if fsdp > 1 and layout.zero in (0, 1, 2):
            parts["parameters"] += gathered * PARAM_BYTES  # kept gathered from forward to backward
        elif fsdp > 1:
            temporary += 2 * per_block * PARAM_BYTES  # ZeRO-3: the block in use and the next
        if fsdp > 1 and layout.gas > 1:
            parts["gradients"] += gathered * PARAM_BYTES  # unsharded until the last micro-batch
        if fsdp == 1 and layout.dp > 1:
            parts["gradients"] += gathered * PARAM_BYTES  # DDP's gradient buckets
        if tp > 1 and fsdp == 1:
            # the vocabulary-parallel embedding's gradient arrives whole on every tensor rank
            embed = [math.prod(s) for n, s in params if n == "embed.weight"]
            temporary += (
                sum(e - _local_numel((e,), "embed.weight", tp, 1) for e in embed) * PARAM_BYTES
            )
        # activations of the micro-batches in flight on this stage
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
        stored = recompute = 0.0
        for position, layer in enumerate(layers):
            acts, weights, kept = moe if is_moe_layer(loaded.config, layer) else dense
            checkpointed = layout.checkpoint != "none" and position % layout.every == 0
            if not checkpointed:
                stored += acts + weights
                continue
            stored += mb * trace.layer_input / rep_by
            if layout.checkpoint == "selective":
                stored += mb * kept
            recompute = max(recompute, acts + weights)  # one block rebuilt in its backward
        last = k == len(stages) - 1
        rest = 0.0
        if last:
            rest = mb * (trace.rest_replicated / rep_by + trace.rest_split / tp)
            rest += trace.rest_weights / tp
        stored_after_forward = in_flight * (stored + rest)
        parts["activations"] = stored_after_forward + recompute
        if last:  # the gradient of the logits (a tied head has them too)
            seq = loaded.config.model.seq_length
            temporary += mb * seq * math.ceil(trace.vocab / tp) * 4
        parts["temporary"] = temporary
        parts = {key: int(v) for key, v in parts.items()}
        parts["total"] = sum(parts.values())
        if worst is None or parts["total"] > worst["bytes"]["total"]:
            worst = {
                "stage": k,
                "bytes": parts,
                "resident": resident,
                "parameters_on_rank": local,
                "activations_after_forward": int(stored_after_forward),
            }
    assert worst is not None
    return worst


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


def _usable(acc: Accelerator) -> float:
    return (acc.memory_gib * GIB - CUDA_RESERVE) * USABLE


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def estimate(
    loaded: LoadedConfig,
    gpus: int,
    gpu: str = "h100",
    nodes: int = 1,
    mfu: float = 0.4,
    alternatives: int = 5,
) -> dict[str, Any]:
    if gpu not in ACCELERATORS:
        raise ConfigError(f"--gpu {gpu!r} is not one of {', '.join(ACCELERATORS)}")
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise ConfigError(f"--gpus {gpus} must be a positive multiple of --nodes {nodes}")
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu} must be in (0, 1]")
    cfg = loaded.config
    d = derive(loaded, world_size=gpus)
    layout = Layout.from_derived(cfg, d)
    check_layout(loaded, layout)
    acc = ACCELERATORS[gpu]
    precision = d["precision"]
    peak = peak_tflops(acc, precision)
    method = cfg.parallel.pipe_partition_method
    vocab = d["padded_vocab_size"]
    trace = trace_activations(loaded, vocab, precision)
    stage_cache: dict[int, list] = {}

    def stages_for(pp: int) -> list:
        if pp not in stage_cache:
            stage_cache[pp] = _stage_params(loaded, vocab, pp, method)
        return stage_cache[pp]

    mem = memory_per_rank(loaded, layout, stages_for(layout.pp), trace, method)
    tokens = d["train_batch_size"] * cfg.model.seq_length
    flops_step = d["flops_per_token"] * tokens
    seconds = step_time(flops_step, layout, peak, mfu)
    usable = _usable(acc)
    stages = stages_for(layout.pp)
    out: dict[str, Any] = {
        "num_parameters": d["num_parameters"],
        "embedding_parameters": sum(
            math.prod(shape)
            for st in stages
            for n, shape in st
            if n.startswith(("embed.", "pos_embed.", "output."))
        ),
        "parameters_per_stage": [sum(math.prod(s) for _, s in st) for st in stages],
        "active_parameters": d.get("num_active_parameters") or d["num_parameters"],
        "flops_per_token": d["flops_per_token"],
        "flops_per_step": flops_step,
        "tokens_per_step": tokens,
        "layout": dataclasses.asdict(layout) | {"nodes": nodes},
        "precision": precision,
        "device": {
            "name": acc.name,
            "memory_bytes": int(acc.memory_gib * GIB),
            "peak_tflops": peak,
        },
        "memory_per_rank_bytes": mem["bytes"],
        "resident_bytes": mem["resident"],
        # what the forward passes leave for backward; "activations" adds the block that full
        # or selective checkpointing rebuilds during backward
        "activations_after_forward_bytes": mem["activations_after_forward"],
        "heaviest_stage": mem["stage"],
        "usable_memory_bytes": int(usable),
        "fits": mem["bytes"]["total"] <= usable,
        "mfu": mfu,
        "step_time_s": seconds,
        "tokens_per_day": tokens / seconds * 86400,
        "activations_by_checkpointing_bytes": {
            mode: memory_per_rank(
                loaded, dataclasses.replace(layout, checkpoint=mode), stages, trace, method
            )["bytes"]["activations"]
            for mode in ("none", "selective", "full")
        },
    }
    if not out["fits"] and alternatives:
        out["alternatives"] = _alternatives(
            loaded, layout, d, trace, stages_for, method, flops_step, peak, mfu, usable, nodes
        )[:alternatives]
    return out


def _alternatives(
    loaded, layout, d, trace, stages_for, method, flops_step, peak, mfu, usable, nodes
):
    """Layouts of the same GPUs and global batch that fit, fewest changes first, then fastest."""
    cfg = loaded.config
    heads = cfg.model.num_attention_heads
    kv = cfg.model.num_kv_heads or heads
    per_node = layout.gpus // nodes
    tbs = d["train_batch_size"]
    found = []
    for tp, pp, zero, ckpt in itertools.product(
        [x for x in _divisors(per_node) if heads % x == 0 and kv % x == 0],
        [x for x in _divisors(layout.gpus) if x <= cfg.model.num_layers],
        (0, 1, 2, 3),
        ("none", "selective", "full"),
    ):
        if layout.gpus % (tp * pp):
            continue
        dp = layout.gpus // (tp * pp)
        for mb in _divisors(layout.micro_batch):
            if tbs % (mb * dp):
                continue
            gas = tbs // (mb * dp)
            if pp > 1 and gas < pp:
                continue  # more bubble than work, whatever the schedule
            cand = dataclasses.replace(
                layout, tp=tp, pp=pp, dp=dp, zero=zero, checkpoint=ckpt, micro_batch=mb, gas=gas
            )
            if cand == layout or layout_problem(cfg, cand) is not None:
                continue
            mem = memory_per_rank(loaded, cand, stages_for(pp), trace, method)
            if mem["bytes"]["total"] > usable:
                continue
            changes = cand.changes_from(layout)
            seconds = step_time(flops_step, cand, peak, mfu)
            found.append(
                {
                    "changes": changes,
                    "memory_per_rank_bytes": mem["bytes"]["total"],
                    "step_time_s": seconds,
                }
            )
    found.sort(key=lambda f: (len(f["changes"]), f["step_time_s"]))
    return found


def render(est: dict[str, Any]) -> str:
    """The estimate as text."""

    def gib(b: float) -> str:
        return f"{b / GIB:,.1f} GiB"

    lay = est["layout"]
    mem = est["memory_per_rank_bytes"]
    lines = [
        f"model: {est['num_parameters']:,} parameters ({est['embedding_parameters']:,} in embeddings"
        + (
            f"; {est['active_parameters']:,} reach each token)"
            if est["active_parameters"] != est["num_parameters"]
            else ")"
        ),
        "  per pipeline stage: " + ", ".join(f"{p:,}" for p in est["parameters_per_stage"]),
        f"compute: {est['flops_per_token'] / 1e9:,.2f} GFLOP per token, "
        f"{est['flops_per_step'] / 1e15:,.2f} PFLOP per step of {est['tokens_per_step']:,} tokens",
        f"layout: {lay['gpus']} x {est['device']['name']} on {lay['nodes']} node(s): "
        f"data {lay['dp']} x tensor {lay['tp']} x pipeline {lay['pp']}"
        + (f" (experts split over {lay['ep']} of the data ranks)" if lay["ep"] > 1 else "")
        + f", ZeRO-{lay['zero']}, "
        f"micro-batch {lay['micro_batch']} x {lay['gas']} accumulation steps, "
        f"activation checkpointing {lay['checkpoint']}, {est['precision']}",
        f"memory on the most loaded rank (pipeline stage {est['heaviest_stage']}):",
    ]
    for part in ("parameters", "gradients", "optimizer", "activations", "temporary"):
        lines.append(f"  {part:<12} {gib(mem[part]):>12}")
    lines.append(
        f"  {'total':<12} {gib(mem['total']):>12}  of {gib(est['usable_memory_bytes'])} usable "
        f"-> {'fits' if est['fits'] else 'does NOT fit'}"
    )
    acts = est["activations_by_checkpointing_bytes"]
    lines.append(
        "  activations with checkpointing none / selective / full: "
        + " / ".join(gib(acts[m]) for m in ("none", "selective", "full"))
    )
    lines.append(
        f"time: {est['step_time_s']:,.2f} s per step, {est['tokens_per_day'] / 1e9:,.2f}B tokens "
        f"per day at {est['mfu']:.0%} MFU"
    )
    if "alternatives" in est:
        if not est["alternatives"]:
            lines.append("no layout of these GPUs fits this model and global batch: add GPUs")
        else:
            lines.append("layouts that fit (fewest changes first):")
            for alt in est["alternatives"]:
                sets = " ".join(f"--set {k}={v}" for k, v in alt["changes"].items())
                lines.append(
                    f"  {sets}: {gib(alt['memory_per_rank_bytes'])}, {alt['step_time_s']:,.2f} s/step"
                )
    return "\n".join(lines)
