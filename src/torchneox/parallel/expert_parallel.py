"""Expert parallelism: each MoE layer's experts split over the ``ep`` mesh axis (a sub-axis of
data parallelism), tokens sent to the rank holding their expert and back with all-to-all.

Expert weights become DTensors sharded on dim 0 (experts) over ``ep``, so checkpoints hold
whole [experts, ...] tensors and load into any other layout. Their gradients are not reduced
by DDP (the all-to-all's backward already gathered every ep rank's tokens); they are summed
over the expert replicas (``dp_replicate``, and the context ranks) and divided by the ranks
that split the batch here, which
makes them the gradient of the global mean loss, as DDP's average does for the rest.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torchneox.models.lora import EXPERT_WEIGHTS
from torchneox.models.moe import LocalTokenDispatcher, MoE

EXPERT_PARAMS = (
    "experts_up",
    "experts_gate",
    "experts_down",
    "experts_up_bias",
    "experts_gate_bias",
    "experts_down_bias",
)


def expert_tensors(module: MoE) -> Iterator[tuple[nn.Module, str, str]]:
    """(owner, attribute, name in the MoE layer) of each of its tensors split over the experts:
    the expert weights and biases, and the A and B of their LoRA adapters ([E, in, rank] and
    [E, rank, out]: each expert's adapter on the rank holding the expert)."""
    for attr in EXPERT_PARAMS:
        yield module, attr, attr
    for weight in EXPERT_WEIGHTS:
        adapter = getattr(module, f"experts_{weight}_lora", None)
        if adapter is not None:
            for part in ("lora_A", "lora_B"):
                owner = getattr(adapter, part)
                yield owner, "weight", f"experts_{weight}_lora.{part}.weight"


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[str]:
    """Shard every MoE layer's experts (and their adapters) over mesh["ep"]; returns the
    expert parameters' names (for DDP to leave alone)."""
    ep_mesh = mesh["ep"]
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    names = []
    done: dict[int, nn.Parameter] = {}  # shared layers (num_unique_layers): one split each
    for module_name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        local = module.num_experts // size
        for owner, attr, name in list(expert_tensors(module)):
            param = getattr(owner, attr)
            if param is None:
                continue
            if id(param) not in done:
                shard = param.detach()[rank * local : (rank + 1) * local].clone()
                done[id(param)] = nn.Parameter(
                    DTensor.from_local(shard, ep_mesh, [Shard(0)], run_check=False),
                    requires_grad=param.requires_grad,
                )
            setattr(owner, attr, done[id(param)])
            names.append(f"{module_name}.{name}")  # (DDP leaves alone each name it goes by)
        module.dispatcher = AllToAllTokenDispatcher(ep_mesh.get_group(), size)
    return names


def sync_expert_gradients(model: nn.Module, replicas: DeviceMesh, batch_ranks: int) -> None:
    """Sum the expert gradients over the ranks holding the same experts (``replicas``: the
    expert replicas, and with context parallelism the context ranks beside them), then average
    over the ``batch_ranks`` that split the batch, as DDP does."""
    replicate = replicas.get_group() if replicas.size() > 1 else None
    seen: set[int] = set()  # a tensor that shared layers hold is reduced once
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        for owner, attr, _ in expert_tensors(module):
            param = getattr(owner, attr)
            if param is None or param.grad is None or id(param) in seen:
                continue
            seen.add(id(param))
            local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            if replicate is not None:
                dist.all_reduce(local, group=replicate)
            local.div_(batch_ranks)


class AllToAllTokenDispatcher(LocalTokenDispatcher):
    """Each rank holds ``num_experts / size`` experts: rows go to the rank holding their expert
    (all-to-all over ``group``) and their results come back the same way."""

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group, self.size = group, size

    def dispatch(self, rows: torch.Tensor, counts_t: torch.Tensor, counts: list[int]):
        return _send_to_experts(rows, counts_t, self.group, self.size)

    def combine(self, out_rows: torch.Tensor, route) -> torch.Tensor:
        return _send_back(out_rows, route, self.group)

    def local(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        return weight.to_local() if isinstance(weight, DTensor) else weight


def _send_to_experts(rows: torch.Tensor, counts_E: torch.Tensor, group, size: int):
    """Send expert-sorted rows to the ranks holding their experts. Returns the received rows
    sorted by local expert, the tokens per local expert, and what ``_send_back`` needs to send
    the results back (the split sizes both ways and the local sort)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    local = counts_E.numel() // size
    send_counts = counts_E.reshape(size, local)  # [destination rank, its local expert]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)  # [source, expert]
    send_splits = send_counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = all_to_all_single_autograd(rows, recv_splits, send_splits, group)
    # received: by source rank, each by local expert -> regroup by local expert (stable, so
    # each expert's rows stay in source order)
    expert_of_row = torch.arange(local, device=rows.device).repeat(size)
    expert_of_row = torch.repeat_interleave(expert_of_row, recv_counts.reshape(-1))
    order_t = torch.argsort(expert_of_row, stable=True)
    per_expert = recv_counts.sum(0).tolist()
    return received[order_t], per_expert, (send_splits, recv_splits, order_t)


def _send_back(out_rows: torch.Tensor, route, group) -> torch.Tensor:
    """Undo ``_send_to_experts``: back to source-major order, then to the ranks the rows came from."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    send_splits, recv_splits, order = route
    restored = torch.zeros_like(out_rows).index_copy(0, order, out_rows)
    return all_to_all_single_autograd(restored, send_splits, recv_splits, group)
