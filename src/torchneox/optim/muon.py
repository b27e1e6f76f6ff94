"""``optimizer.type: muon``: torch's Muon on the blocks' hidden matrices, AdamW on the rest,
as one optimizer the trainer, the lr schedule and the checkpoints see.

Muon's Newton-Schulz orthogonalisation needs each matrix whole. A matrix sharded as a DTensor
(ZeRO 1-3's FSDP2 shards, tensor parallelism's row or column splits, both at once) has its
momentum-updated gradient gathered whole on every rank of its mesh (``full_tensor``), every rank
orthogonalises the same matrix, and each keeps the part of the update that its shard holds: the
update of every element is the one a single process computes. The momentum buffers stay
sharded like the parameters."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from torchneox.config.features.optimizer import OptimizerSpec, muon_matrix
from torchneox.models.params import plain_name
from torchneox.optim.groups import NO_DECAY

KERNEL_FLAGS = ("fused", "foreach", "capturable", "differentiable")


NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def newton_schulz(
    g: torch.Tensor, coefficients: tuple, steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Muon's orthogonalisation of the matrix ``g`` in ``dtype``: scaled to Frobenius norm 1
    (at most ``eps`` below), then ``steps`` quintic iterations X <- a X + (b A + c A^2) X,
    A = X X^T, on the wide orientation. In bf16 it is torch.optim.Muon's, operation for
    operation; fp32 is for processors without bf16 units, where bf16 products are ~100x
    slower."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(dtype).T if tall else g.to(dtype)
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """Muon's rate for a matrix of ``shape`` (rows, columns), as torch.optim.Muon scales it:
    match_rms_adamw 0.2 sqrt(max(rows, columns)) (Moonshot's: AdamW's update RMS),
    original sqrt(max(1, rows / columns)) (Keller Jordan's)."""
    rows, columns = shape[:2]
    if rule == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, columns)))
    return lr * math.sqrt(max(1, rows / columns))


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon's update, element for element, on plain tensors and on DTensor shards
    (the whole matrix orthogonalised, this rank's part of the update applied); a group's
    ``ns_dtype`` (bf16, torch's; or fp32) is the Newton-Schulz iteration's precision."""

    def __init__(self, params, ns_dtype: str = "bf16", **settings: Any):
        super().__init__(params, **settings)
        self.defaults["ns_dtype"] = ns_dtype
        for group in self.param_groups:
            group.setdefault("ns_dtype", ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf, momentum = state["momentum_buffer"], group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        whole = update.full_tensor() if isinstance(update, DTensor) else update
        dtype = NS_DTYPES[group["ns_dtype"]]
        ortho = newton_schulz(
            whole, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype
        )
        if isinstance(p, DTensor):  # this rank's part: DTensor's own split of a whole tensor
            mesh = p.device_mesh
            whole = DTensor.from_local(ortho, mesh, [Replicate()] * mesh.ndim, run_check=False)
            ortho = whole.redistribute(mesh, p.placements).to_local()
        local = p.to_local() if isinstance(p, DTensor) else p
        lr = group["lr"]
        local.mul_(1 - lr * group["weight_decay"])
        local.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


class MuonAdamW(torch.optim.Optimizer):
    """Muon over ``hidden`` and AdamW over ``rest``, one optimizer: its param_groups are the
    two optimizers' groups (Muon's first) and its state holds both, so the schedule's lr
    reaches every group and one state dict saves and loads both. An AdamW group's ``lr_ratio``
    (adamw_lr / lr) scales the schedule's rate for that group: this run's, as the kernel flags,
    when a saved state is loaded (the other settings are the saved ones, as torch loads them)."""

    def __init__(
        self,
        hidden: list[dict[str, Any]],
        rest: list[dict[str, Any]],
        muon: dict[str, Any],
        adamw: dict[str, Any],
    ):
        self.muon = ShardedMuon(hidden, **muon) if hidden else None
        self.adamw = torch.optim.AdamW(rest, **adamw) if rest else None
        self.ratios = [g.get("lr_ratio", 1.0) for g in rest]
        parts = [o for o in (self.muon, self.adamw) if o is not None]
        super().__init__([g for o in parts for g in o.param_groups], {})
        self._link()

    def _link(self) -> None:
        """The two optimizers read this one's groups and state (after a load replaced them)."""
        n = len(self.muon.param_groups) if self.muon is not None else 0
        for part, groups in (
            (self.muon, self.param_groups[:n]),
            (self.adamw, self.param_groups[n:]),
        ):
            if part is not None:
                part.param_groups, part.state = groups, self.state
        if self.adamw is not None:  # this run's kernels, not the saving layout's
            for group, ratio in zip(self.adamw.param_groups, self.ratios, strict=True):
                group.update({k: self.adamw.defaults[k] for k in KERNEL_FLAGS})
                group["lr_ratio"] = ratio

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        if self.muon is not None:
            self.muon.step()
        if self.adamw is not None:
            rates = [g["lr"] for g in self.adamw.param_groups]
            for g in self.adamw.param_groups:
                g["lr"] = g["lr"] * g.get("lr_ratio", 1.0)
            try:
                self.adamw.step()
            finally:
                for g, lr in zip(self.adamw.param_groups, rates, strict=True):
                    g["lr"] = lr
        return loss


def hidden_and_rest(model: nn.Module) -> tuple[list[torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """The trained parameters Muon steps (the blocks' 2-D weights but the MoE router's) and
    the others, with their names."""
    hidden, rest = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = plain_name(name).removeprefix("module.")
        if muon_matrix(plain, p.shape):
            hidden.append(p)
        else:
            rest.append((plain, p))
    return hidden, rest


def build_muon(model: nn.Module, spec: OptimizerSpec, fast: dict[str, Any]) -> MuonAdamW:
    """The ``muon`` optimizer over ``model``: ``fast`` is AdamW's kernel choice."""
    p, lr, decay = spec.params, spec.lr or 1e-3, spec.weight_decay
    hidden, rest = hidden_and_rest(model)
    ratio = float(p.get("adamw_lr", lr)) / lr
    matrices = [t for n, t in rest if t.ndim >= 2 and not n.endswith(NO_DECAY) and decay > 0]
    others = [t for n, t in rest if not any(t is m for m in matrices)]
    rest_groups = [
        {"params": matrices, "weight_decay": decay, "lr_ratio": ratio},
        {"params": others, "weight_decay": 0.0, "lr_ratio": ratio},
    ]
    muon = {
        "lr": lr,
        "weight_decay": decay,
        "momentum": float(p.get("momentum", 0.95)),
        "nesterov": bool(p.get("nesterov", True)),
        "ns_steps": int(p.get("ns_steps", 5)),
        "eps": float(p.get("ns_eps", 1e-7)),
        "adjust_lr_fn": p.get("adjust_lr_fn", "match_rms_adamw"),
        "ns_dtype": p.get("ns_dtype", "bf16"),
    }
    if "ns_coefficients" in p:
        muon["ns_coefficients"] = tuple(float(c) for c in p["ns_coefficients"])
    adamw = {"lr": lr, "betas": tuple(p.get("betas", (0.9, 0.999))), "eps": p.get("eps", 1e-8)}
    return MuonAdamW(
        [{"params": hidden}] if hidden else [],
        [g for g in rest_groups if g["params"]],
        muon,
        adamw | fast,
    )
