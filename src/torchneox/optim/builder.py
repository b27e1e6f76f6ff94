"""Optimizers from GPT-NeoX's ``optimizer`` dict, with weight decay on matrices only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from torchneox.config.features.eight_bit import eight_bit
from torchneox.config.features.optimizer import optimizer_spec
from torchneox.config.schema import OptimizerConfig
from torchneox.models.args import MupScales
from torchneox.optim.eight_bit import build_eight_bit_adam
from torchneox.optim.groups import param_groups
from torchneox.optim.neox import SM3, Lamb, MadgradWD

OTHER_OPTIMIZERS = {"sm3": SM3, "madgrad_wd": MadgradWD, "lamb": Lamb}


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): the sign of an interpolated momentum, decoupled weight decay."""

    def __init__(
        self, params: Iterable, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0
    ):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = m.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


def _mixes_dtensors(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    return len(kinds) > 1


def build_optimizer(
    model: nn.Module, o: OptimizerConfig, device_type: str, mup: MupScales | None = None
) -> torch.optim.Optimizer:
    """The optimizer the ``optimizer`` config group describes, over ``model``'s parameters;
    ``mup``: each group split by mup's rule, its ``lr_scale`` what the schedule's rate is
    multiplied by (train/mup_checks.py)."""
    spec = optimizer_spec(o)
    kind, params = spec.kind, dict(spec.torch_params)
    lr = spec.lr or 1e-3  # (the schedule sets every step's rate)
    groups = param_groups(model, spec.weight_decay)
    if mup is not None:
        from torchneox.optim.mup import mup_groups

        groups = mup_groups(model, groups, kind, lr, mup)
    fast = {"fused": True} if device_type in ("cuda", "cpu") else {"foreach": True}
    if _mixes_dtensors(model):  # tensor parallelism without FSDP: foreach/fused need one kind
        fast = {"foreach": False}
    if eight_bit(o):  # use_bnb_optimizer
        return build_eight_bit_adam(model, groups, spec, lr, o=o)
    if kind in ("adam", "adamw"):  # GPT-NeoX runs Adam with decoupled weight decay
        return torch.optim.AdamW(groups, lr=lr, **params, **fast)
    if kind in ("cpu_adam", "cpu_torch_adam"):  # DeepSpeedCPUAdam: AdamW unless adamw_mode false
        adam = torch.optim.AdamW if spec.params.get("adamw_mode", True) else torch.optim.Adam
        return adam(groups, lr=lr, **params, **fast)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, **params, foreach=fast.get("foreach", True))
    if kind == "lion":
        return Lion(groups, lr=lr, **params)
    if kind == "muon":
        from torchneox.optim.muon import build_muon

        return build_muon(model, spec, fast)
    if kind in OTHER_OPTIMIZERS:
        return OTHER_OPTIMIZERS[kind](groups, lr=lr, **params)
    raise AssertionError(f"unvalidated optimizer {kind}")


def shard_gradients_like_parameters(params: list[torch.Tensor]) -> None:
    """Give each DTensor gradient its parameter's placement. The vocabulary-parallel embedding's
    gradient arrives replicated (whole on every tensor rank); sharding it is a local slice that
    frees the rest before the optimizer runs."""
    from torch.distributed.tensor import DTensor

    for p in params:
        if (
            isinstance(p.grad, DTensor)
            and isinstance(p, DTensor)
            and p.grad.placements != p.placements
        ):
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _dtensor_squares(grads: list[Any]) -> list[torch.Tensor]:
    """The squared L2 norms of DTensor gradients, one reduction per (mesh, placements) group:
    the local shards' squares summed, then added over the mesh dimensions they are sharded
    on (a per-tensor ``full_tensor`` would run one all-reduce per gradient)."""
    groups: dict[tuple, list[Any]] = {}
    for g in grads:
        groups.setdefault((g.device_mesh, g.placements), []).append(g)
    out = []
    for (mesh, placements), members in groups.items():
        if any(p.is_partial() for p in placements):  # not reduced yet: DTensor's own norm
            out += [torch.linalg.vector_norm(g).full_tensor().float().pow(2) for g in members]
            continue
        local = torch._foreach_norm([g.to_local() for g in members])
        total = torch.stack(local).float().pow(2).sum()
        for dim, placement in enumerate(placements):
            if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over a tp shard
                torch.distributed.all_reduce(total, group=mesh.get_group(dim))
        out.append(total)
    return out


KERNEL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, flat: bool) -> Any:
    """The optimizer's state as checkpoints hold it: torch's nested form, its groups numbered,
    or (``flat``: pipeline stages, whose ranks hold different parameters) every entry keyed by
    its parameter's name, so no two stages write one key with different values (each stage's
    group 0 would overwrite the others')."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not trains_anything(optimizer):  # (torch's state dict refuses an empty optimizer)
        return {}
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    return get_optimizer_state_dict(model, optimizer, options=options)


def trains_anything(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` holds a parameter (a soft prompt's later pipeline stages hold
    none: their state is empty)."""
    return any(group["params"] for group in optimizer.param_groups)


def load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Any, flat: bool = False
) -> None:
    """Load a saved optimizer state (saved in any layout) and keep this run's kernel choices:
    torch restores each group's saved flags (fused, foreach, ...), which belong to the layout
    that saved them (a tensor-parallel run's AdamW without foreach, say), not to this run."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not trains_anything(optimizer):
        return
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    set_optimizer_state_dict(model, optimizer, state, options=options)
    for group in optimizer.param_groups:
        group.update({k: optimizer.defaults[k] for k in KERNEL_FLAGS if k in optimizer.defaults})


def clip_grad_norm(
    params: list[torch.Tensor], max_norm: float, group=None, repeated: frozenset[int] = frozenset()
) -> torch.Tensor:
    """Global L2 norm of the gradients (sharded DTensor gradients included), clipped to
    ``max_norm`` in place; returns the norm before clipping, as a plain tensor. ``group``: the
    pipeline group whose stages' norms add up to the model's; ``repeated``: the ids of
    parameters another stage holds too (counted there), clipped but not counted here."""
    from torch.distributed.tensor import DTensor

    squares = []
    counted = [p for p in params if id(p) not in repeated]
    plain = [p.grad for p in counted if not isinstance(p.grad, DTensor)]
    if plain:
        squares.append(torch.stack(torch._foreach_norm(plain)).float().pow(2).sum())
    squares += _dtensor_squares([p.grad for p in counted if isinstance(p.grad, DTensor)])
    device = squares[0].device if squares else params[0].device if params else "cpu"
    # (under ZeRO-Offload the sharded gradients are in host memory, expert-parallel ones not)
    total = (
        torch.stack([s.to(device) for s in squares]).sum()
        if squares
        else torch.zeros(()).to(device)
    )
    if group is not None:  # pipeline stages hold disjoint parameters: add their squares
        torch.distributed.all_reduce(total, group=group)
    total = total.sqrt()
    if max_norm != float("inf"):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        # one fused multiply over every gradient (a DTensor's local shard in place), the
        # coefficient staying on the device: no read-back to the host
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            by_kind.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), same in by_kind.items():
            torch._foreach_mul_(same, coef.to(device))
    return total
