"""ZeRO-Offload in the estimate: what FSDP2's CPU offload moves from the device to host memory,
the host memory per node, and the optimizer step's time on the host.

The step-time model is deliberately simple: the optimizer step on the CPU is bound by host
memory bandwidth, so its time is the bytes it touches divided by one constant. Per element of a
rank's shard the step reads and writes the fp32 parameter (8 bytes), reads its fp32 gradient
(4) and reads and writes each optimizer state tensor (8 each: Adam's two moments make 28 bytes
an element); a node's ranks share its memory bandwidth, so a node's step takes the bytes of
all its ranks' shards over ``HOST_BANDWIDTH``. Not counted: the host-device copies (each
gather's shard up, each gradient shard down), which FSDP2 overlaps with compute where it can."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HOST_BANDWIDTH = 100e9
"""Bytes per second a node's CPUs stream through its memory in an optimizer step: the order of
a two-socket server's sustained DRAM bandwidth (STREAM triad, 8-12 channels per socket)."""
STEP_BYTES_PER_ELEMENT = 12  # parameter read and written, gradient read (fp32)
STATE_BYTES_PER_ELEMENT = 8  # each optimizer state tensor read and written (fp32)


def offload_parts(parts: dict[str, float], resident: dict[str, float]) -> dict[str, float]:
    """Move the resident shards (parameters, gradients, optimizer state) off the device's
    ``parts`` in place; returns what a rank holds in host memory. What FSDP2 keeps on the
    device stays: ZeRO-1/2's gathered parameters, ZeRO-3's gathered blocks, gradients held
    unsharded while micro-batches accumulate."""
    parts["parameters"] -= resident["parameter_shard"]
    parts["gradients"] -= resident["gradient_shard"]
    parts["optimizer"] -= resident["optimizer"]
    return {
        "parameters": resident["parameter_shard"],
        "gradients": resident["gradient_shard"],
        "optimizer": resident["optimizer"],
    }


def host_estimate(
    host_per_rank: dict[str, float], shard_elements: int, state_tensors: int, ranks_per_node: int
) -> dict[str, Any]:
    """The host memory per rank and per node, and the optimizer step's seconds on the host."""
    touched = shard_elements * (STEP_BYTES_PER_ELEMENT + STATE_BYTES_PER_ELEMENT * state_tensors)
    per_rank = int(sum(host_per_rank.values()))
    return {
        "host_bytes_per_rank": {k: int(v) for k, v in host_per_rank.items()} | {"total": per_rank},
        "host_bytes_per_node": per_rank * ranks_per_node,
        "ranks_per_node": ranks_per_node,
        "host_step_bytes_per_node": touched * ranks_per_node,
        "host_step_s": touched * ranks_per_node / HOST_BANDWIDTH,
    }


def render_host(est: dict[str, Any], gib: Callable[[float], str]) -> tuple[list[str], str]:
    """The estimate's host line and what its time line adds (nothing without offload)."""
    if "host_step_s" not in est:
        return [], ""
    host = est["host_bytes_per_rank"]
    line = (
        f"host memory per node (ZeRO-Offload): {gib(est['host_bytes_per_node'])} = "
        f"{est['ranks_per_node']} ranks x {gib(host['total'])} (parameters "
        f"{gib(host['parameters'])}, gradients {gib(host['gradients'])}, optimizer "
        f"{gib(host['optimizer'])})"
    )
    time = (
        f" (with {est['host_step_s']:,.2f} s of optimizer step on the host: "
        f"{est['host_step_bytes_per_node'] / 1e9:,.1f} GB touched per node at "
        f"{HOST_BANDWIDTH / 1e9:g} GB/s)"
    )
    return [line], time
