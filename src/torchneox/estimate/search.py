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
import functools
import itertools
import math
from typing import Any

from torchneox.base.errors import ConfigError
from torchneox.config.derive import derive
from torchneox.config.features.optimizer import optimizer_spec
from torchneox.config.features.replicas import replica_line
from torchneox.config.layout import Layout, check_layout, layout_problem
from torchneox.config.load import LoadedConfig
from torchneox.estimate.activations import trace_activations
from torchneox.estimate.host import host_estimate, render_host
from torchneox.estimate.memory import (
    CUDA_RESERVE,
    GIB,
    USABLE,
    build_bytes,
    memory_per_rank,
    step_time,
    weight_bytes,
)
from torchneox.estimate.parameters import stage_params
from torchneox.reporting.hardware import ACCELERATORS, Accelerator, peak_tflops
from torchneox.train.fits import refuse_unaddressable


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
    """The estimate of ``loaded`` on ``gpus`` accelerators named ``gpu`` (see render)."""
    _check_request(gpus, gpu, nodes, mfu)
    cfg = loaded.config
    d = derive(loaded, world_size=gpus)
    refuse_unaddressable(loaded, d["num_parameters"])  # (its meta model cannot be made)
    _check_batch(d)
    layout = Layout.from_derived(cfg, d)
    check_layout(loaded, layout)
    acc, precision = ACCELERATORS[gpu], d["precision"]
    peak = peak_tflops(acc, precision)
    method, vocab = cfg.parallel.pipe_partition_method, d["padded_vocab_size"]
    trace = trace_activations(loaded, vocab, precision, layout.cp)
    stages_for = functools.cache(lambda pp: stage_params(loaded, vocab, pp, method))
    mem = memory_per_rank(loaded, layout, stages_for(layout.pp), trace, method)
    tokens = d["train_batch_size"] * cfg.model.seq_length
    flops_step = d["flops_per_token"] * tokens
    host = _host(loaded, layout, mem, nodes)
    seconds = step_time(flops_step, layout, peak, mfu) + host.get("host_step_s", 0.0)
    usable, stages = _usable(acc), stages_for(layout.pp)
    out: dict[str, Any] = _parameters(d, stages) | {
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
        "build_bytes": _build_bytes(loaded, layout, stages),
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
        "activations_by_checkpointing_bytes": _by_checkpointing(
            loaded, layout, stages, trace, method
        ),
    }
    out |= host | _replicas(cfg, layout)  # ZeRO-Offload's host side; replica groups (ft_*)
    if not out["fits"] and alternatives:
        out["alternatives"] = _alternatives(
            loaded, layout, d, trace, stages_for, method, flops_step, peak, mfu, usable, nodes
        )[:alternatives]
    return out


def _replicas(cfg: Any, layout: Layout) -> dict[str, str]:
    """The replicate axis in one line (the memory above is one group's), where there is one."""
    line = replica_line(cfg, layout.gpus)
    return {} if line is None else {"replica_groups": line}


def _host(loaded: LoadedConfig, layout: Layout, mem: dict[str, Any], nodes: int) -> dict:
    """ZeRO-Offload's host memory and optimizer step (estimate/host.py); {} without it."""
    if mem["host"] is None:
        return {}
    state = optimizer_spec(loaded.config.optimizer).state_tensors
    return host_estimate(mem["host"], mem["shard_elements"], state, layout.gpus // nodes)


def _by_checkpointing(loaded: LoadedConfig, layout: Layout, stages, trace, method) -> dict:
    """Activation bytes per rank without checkpointing, selective and full."""
    return {
        mode: memory_per_rank(
            loaded, dataclasses.replace(layout, checkpoint=mode), stages, trace, method
        )["bytes"]["activations"]
        for mode in ("none", "selective", "full")
    }


def _check_request(gpus: int, gpu: str, nodes: int, mfu: float) -> None:
    if gpu not in ACCELERATORS:
        raise ConfigError(f"--gpu {gpu!r} is not one of {', '.join(ACCELERATORS)}")
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise ConfigError(f"--gpus {gpus} must be a positive multiple of --nodes {nodes}")
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu} must be in (0, 1]")


def _check_batch(d: Any) -> None:
    if d["train_micro_batch_size_per_gpu"] is None:  # a converted model's config has no batch
        raise ConfigError(
            "the estimate needs the batch: give train_micro_batch_size_per_gpu or "
            "train_batch_size (e.g. --set train_micro_batch_size_per_gpu=4)",
            key="train_micro_batch_size_per_gpu",
        )


def _parameters(d: Any, stages: list) -> dict[str, Any]:
    return {
        "num_parameters": d["num_parameters"],
        "embedding_parameters": sum(
            math.prod(shape)
            for st in stages
            for n, shape in st
            if n.startswith(("embed.", "pos_embed.", "output."))
        ),
        "parameters_per_stage": [sum(math.prod(s) for _, s in st) for st in stages],
        "active_parameters": d.get("num_active_parameters") or d["num_parameters"],
        # decoding's cache (MLA: its latents), every layer, in the run's precision
        "kv_cache_bytes_per_token": d.get("kv_cache_bytes_per_token"),
    }


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
        if layout.gpus % (tp * pp * layout.cp):
            continue
        dp = layout.gpus // (tp * pp * layout.cp)  # the context-parallel ranks stay as given
        for mb in _divisors(layout.micro_batch):
            if tbs % (mb * dp):
                continue
            gas = tbs // (mb * dp)
            if pp > 1 and gas < pp:
                continue  # more bubble than work, whatever the schedule
            base = dataclasses.replace(
                layout, tp=tp, pp=pp, dp=dp, zero=zero, checkpoint=ckpt, micro_batch=mb, gas=gas
            )
            for shard in _shard_groups(base, per_node, nodes):
                cand = dataclasses.replace(base, dp_shard=shard)
                if cand == layout or layout_problem(cfg, cand) is not None:
                    continue
                mem = memory_per_rank(loaded, cand, stages_for(pp), trace, method)
                if mem["bytes"]["total"] > usable:
                    continue
                found.append(
                    {
                        "changes": cand.changes_from(layout),
                        "memory_per_rank_bytes": mem["bytes"]["total"],
                        "step_time_s": step_time(flops_step, cand, peak, mfu)
                        + _host(loaded, cand, mem, nodes).get("host_step_s", 0.0),
                    }
                )
    found.sort(key=lambda f: (len(f["changes"]), f["step_time_s"]))
    return found


def _shard_groups(layout: Layout, per_node: int, nodes: int) -> list[int | None]:
    """ZeRO over all data-parallel ranks, and on several nodes hybrid sharding within one
    node's ranks (the gathers then stay inside the node; the replicas all-reduce across)."""
    out: list[int | None] = [None]
    within = per_node // layout.tp if per_node % layout.tp == 0 else 0
    if nodes > 1 and layout.zero > 0 and 1 < within < layout.dp and layout.dp % within == 0:
        out.append(within)
    return out


def _build_bytes(loaded: LoadedConfig, layout: Layout, stages: list) -> int:
    """What the most loaded rank holds as the model is built, before the first step
    (parallel/parallelize.py): its shards (with the DPO/KTO reference's) and the largest weight
    drawn whole."""
    from torchneox.train.objectives import objective_for

    # lora's reference is the policy's base: no second model
    lora = loaded.config.training.lora is not None
    reference = objective_for(loaded.config, 0).needs_reference and not lora
    stored = weight_bytes(loaded)
    return max(build_bytes(params, layout, reference, stored) for params in stages)


def gib(b: float) -> str:
    return f"{b / GIB:,.1f} GiB"


def _kv_cache_text(est: dict[str, Any]) -> str:
    """What decoding keeps per token (MLA: its latents), where the model attends."""
    kv = est.get("kv_cache_bytes_per_token")
    return f"; a KV cache of {kv:,} bytes per token" if kv else ""


def render(est: dict[str, Any]) -> str:
    """The estimate as text."""
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
        f"{est['flops_per_step'] / 1e15:,.2f} PFLOP per step of {est['tokens_per_step']:,} tokens"
        + _kv_cache_text(est),
        f"layout: {lay['gpus']} x {est['device']['name']} on {lay['nodes']} node(s): "
        f"data {lay['dp']} x tensor {lay['tp']} x pipeline {lay['pp']}"
        + (f" x context {lay['cp']}" if lay["cp"] > 1 else "")
        + (f" (experts split over {lay['ep']} of the data ranks)" if lay["ep"] > 1 else "")
        + f", ZeRO-{lay['zero']}, "
        f"micro-batch {lay['micro_batch']} x {lay['gas']} accumulation steps, "
        f"activation checkpointing {lay['checkpoint']}, {est['precision']}",
        *([est["replica_groups"]] if "replica_groups" in est else []),
        f"memory on the most loaded rank (pipeline stage {est['heaviest_stage']})"
        + (", on the device: its shards are offloaded" if "host_step_s" in est else "")
        + ":",
    ]
    for part in ("parameters", "gradients", "optimizer", "activations", "temporary"):
        lines.append(f"  {part:<12} {gib(mem[part]):>12}")
    lines.append(
        f"  {'total':<12} {gib(mem['total']):>12}  of {gib(est['usable_memory_bytes'])} usable "
        f"-> {'fits' if est['fits'] else 'does NOT fit'}"
    )
    lines.append(
        f"  {'build':<12} {gib(est['build_bytes']):>12}  while the model is built: the "
        "parameter shards and the largest weight drawn whole"
    )
    acts = est["activations_by_checkpointing_bytes"]
    lines.append(
        "  activations with checkpointing none / selective / full: "
        + " / ".join(gib(acts[m]) for m in ("none", "selective", "full"))
    )
    host, host_time = render_host(est, gib)
    lines += host
    lines.append(
        f"time: {est['step_time_s']:,.2f} s per step, {est['tokens_per_day'] / 1e9:,.2f}B tokens "
        f"per day at {est['mfu']:.0%} MFU{host_time}"
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
