"""GPT-NeoX's other optimizers, written in torch: SM3 and MADGRAD with decoupled weight decay
(GPT-NeoX's megatron/optimizers.py) and LAMB (DeepSpeed's FusedLamb, a CUDA kernel there).

Every update is written with tensor operations that DTensors run too: a ZeRO shard (or a
tensor-parallel one) steps its own slice, and the few reductions (LAMB's norms, SM3's
accumulators) are DTensor reductions over the whole tensor."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def _full_norm(t: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the whole tensor, a plain tensor (a DTensor's summed over its shards)."""
    norm = torch.linalg.vector_norm(t)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class _PerTensor(torch.optim.Optimizer):
    """An optimizer that updates each parameter tensor on its own: ``_init`` creates its
    state, ``_update`` steps it."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        self._init(p, state, group)
                    self._update(p, p.grad, state, group)
        return loss

    @torch.no_grad()
    def init_state(self) -> None:
        """Every trained parameter's state as before its first step, the parameters untouched:
        what a saved state is loaded into. (torch's loader otherwise makes the state with a
        step at lr 0, and MADGRAD's decay by (lr + eps) wd moves the weights at lr 0.)"""
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and not self.state[p]:
                    self._init(p, self.state[p], group)

    def _init(self, p, state, group) -> None:
        raise NotImplementedError

    def _update(self, p, grad, state, group) -> None:
        raise NotImplementedError


class MadgradWD(_PerTensor):
    """MADGRAD (Defazio & Jelassi 2021) with decoupled weight decay, GPT-NeoX's ``madgrad_wd``:
    with lr' = lr + eps and lambda_k = lr' sqrt(k + 1), each step p *= 1 - lr' wd, then
    s += lambda_k g, v += lambda_k g^2, z = x0 - s / (v^(1/3) + eps) and p moves to
    (1 - c) p + c z, c = 1 - momentum (p = z without momentum, x0 then recomputed from p)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-2,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eps: float = 1e-6,
    ):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "eps": eps}
        super().__init__(params, defaults)

    def _init(self, p, state, group) -> None:
        state["step"] = torch.tensor(0.0)
        state["grad_sum_sq"] = torch.zeros_like(p)
        state["s"] = torch.zeros_like(p)
        if group["momentum"] != 0:
            state["x0"] = p.detach().clone()

    def _update(self, p, grad, state, group) -> None:
        eps, momentum, decay = group["eps"], group["momentum"], group["weight_decay"]
        lr = group["lr"] + eps
        step = state["step"]
        lamb = lr * math.sqrt(step.item() + 1)
        grad_sum_sq, s = state["grad_sum_sq"], state["s"]
        if decay:
            p.mul_(1 - lr * decay)
        if momentum == 0:
            x0 = p.addcdiv(s, grad_sum_sq.pow(1 / 3).add_(eps))
        else:
            x0 = state["x0"]
        grad_sum_sq.addcmul_(grad, grad, value=lamb)
        rms = grad_sum_sq.pow(1 / 3).add_(eps)
        s.add_(grad, alpha=lamb)
        z = x0.addcdiv(s, rms, value=-1)
        if momentum == 0:
            p.copy_(z)
        else:
            p.mul_(momentum).add_(z, alpha=1 - momentum)
        step += 1


class Lamb(_PerTensor):
    """LAMB (You et al. 2019) as DeepSpeed's FusedLamb computes it, per parameter tensor:
    m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, u = m / (sqrt(v) + eps) + wd p
    (sqrt(v + eps) with eps_inside_sqrt), the trust ratio r = |p| / |u| clamped to
    [min_coeff, max_coeff] (1 where either norm is 0), and p -= lr_t r u, where
    lr_t = lr sqrt(1 - b2^t) / (1 - b1^t) with bias correction, else lr."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ):
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)

    def _init(self, p, state, group) -> None:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)

    def _update(self, p, grad, state, group) -> None:
        beta1, beta2 = group["betas"]
        step = state["step"]
        step += 1
        t = step.item()
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if group["eps_inside_sqrt"]:
            denom = v.add(group["eps"]).sqrt_()
        else:
            denom = v.sqrt().add_(group["eps"])
        update = m / denom
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        # the trust ratio stays on the device (no read-back per tensor)
        w_norm, u_norm = _full_norm(p), _full_norm(update)
        ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
        ratio = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
        step_size = group["lr"]
        if group["bias_correction"]:
            step_size *= math.sqrt(1 - beta2**t) / (1 - beta1**t)
        p.sub_(update.mul_(ratio * step_size))


class SM3(_PerTensor):
    """SM3 (Anil et al. 2019), GPT-NeoX's: a tensor of shape (n1, ..., nk) keeps one
    accumulator per dimension, shaped (n1, 1, ...), (1, n2, 1, ...), ...; each step
    nu = min over the accumulators (broadcast) scaled by beta, + (1 - beta) g^2; accumulator i
    becomes the max of nu over every other dimension (the max with its old value when
    beta > 0); the update g / sqrt(nu + eps), mixed with the last one by momentum, times lr.
    No weight decay (GPT-NeoX's SM3 takes none)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.1,
        momentum: float = 0.0,
        beta: float = 0.0,
        eps: float = 1e-30,
    ):
        super().__init__(params, {"lr": lr, "momentum": momentum, "beta": beta, "eps": eps})

    def _init(self, p, state, group) -> None:
        state["step"] = torch.tensor(0.0)
        for i, acc in enumerate(_accumulators(p)):
            state[f"accumulator_{i}"] = acc
        if group["momentum"] > 0:
            state["momentum_buffer"] = torch.zeros_like(p)

    def _update(self, p, grad, state, group) -> None:
        beta, momentum = group["beta"], group["momentum"]
        accs = [state[f"accumulator_{i}"] for i in range(max(p.ndim, 1))]
        nu = accs[0]
        for acc in accs[1:]:
            nu = torch.minimum(nu, acc)  # broadcast to p's shape
        nu = nu * beta + grad * grad * (1 - beta)
        for i, acc in enumerate(accs):
            reduced = _max_except(nu, i)
            if beta > 0:
                reduced = torch.maximum(acc, reduced)
            _assign(acc, reduced)
        update = nu.add_(group["eps"]).rsqrt_().mul_(grad)
        if momentum > 0:
            buffer = state["momentum_buffer"]
            buffer.mul_(momentum).add_(update, alpha=1 - momentum)
            update = buffer
        p.sub_(update, alpha=group["lr"])
        state["step"] += 1


def _accumulators(p: torch.Tensor) -> list[torch.Tensor]:
    """SM3's zero accumulators for ``p``: one per dimension, the size of that dimension and 1
    elsewhere (one of p's shape for a scalar). A DTensor's keep the shardings of p that fall
    on their own dimension and are replicated over the rest of the mesh."""
    shapes = [list(p.shape)] if p.ndim == 0 else []
    for i in range(p.ndim):
        shapes.append([1] * i + [p.shape[i]] + [1] * (p.ndim - 1 - i))
    if not hasattr(p, "device_mesh"):
        return [torch.zeros(s, dtype=p.dtype, device=p.device) for s in shapes]
    from torch.distributed.tensor import Replicate, distribute_tensor

    out = []
    for i, shape in enumerate(shapes):
        placements = [
            q if _shards(q) and q.dim == i else Replicate()  # FSDP's _StridedShard too
            for q in p.placements
        ]
        zeros = torch.zeros(shape, dtype=p.dtype, device=p.to_local().device)
        out.append(distribute_tensor(zeros, p.device_mesh, placements, src_data_rank=None))
    return out


def _shards(placement) -> bool:
    return not placement.is_replicate() and not placement.is_partial()


def _max_except(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The max of ``t`` over every dimension but ``dim``, keeping them as size 1."""
    others = [d for d in range(t.ndim) if d != dim]
    return t.amax(dim=others, keepdim=True) if others else t


def _assign(acc: torch.Tensor, value: torch.Tensor) -> None:
    """acc <- value, a DTensor's value brought to the accumulator's placements first."""
    if hasattr(acc, "device_mesh") and value.placements != acc.placements:
        value = value.redistribute(acc.device_mesh, acc.placements)
    acc.copy_(value)
