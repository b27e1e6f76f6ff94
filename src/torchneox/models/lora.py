"""LoRA adapters on a model (config/features/lora.py reads the key): where they go, what
trains, the merged model and the base alone.

An adapted ``Linear`` (models/linear.py) holds ``lora_A``/``lora_B`` as PEFT names them. An
MoE layer's experts, whose weights are [E, in, out] tensors rather than linears, get one
adapter per expert: ``mlp.experts_up_lora.lora_A.weight`` [E, in, rank] and ``lora_B.weight``
[E, rank, out] (``ExpertAdapter``), so that expert e computes x W_e + scale x (x A_e) B_e, as
PEFT adapts each expert's linear of a Mixtral-style model. Any other layer (torchao's
Float8Linear, which replaces a linear under fp8) keeps its adapter beside it through
``attach_adapter``: the base product is the layer's own, the adapter's in the autocast dtype.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from torchneox.config.features.lora import is_base_linear
from torchneox.models.linear import Linear, linear, merge_adapter

ADAPTER_PARTS = ("lora_A", "lora_B", "lora_dropout")
EXPERT_WEIGHTS = ("up", "gate", "down")


class _Weight(nn.Module):
    """A module holding one tensor named ``weight`` (the names PEFT gives an adapter's A, B)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class ExpertAdapter(nn.Module):
    """Every expert's adapter of one expert weight [E, in, out]: A [E, in, rank] (drawn as
    PEFT draws A, U(-1/sqrt(in), 1/sqrt(in)) per expert), B [E, rank, out] zeros."""

    def __init__(self, experts: int, fan_in: int, fan_out: int, rank: int, scale: float, p: float):
        super().__init__()
        self.lora_A = _Weight(experts, fan_in, rank)
        self.lora_B = _Weight(experts, rank, fan_out)
        self.lora_dropout = nn.Dropout(p)
        self.lora_scale = scale
        self.lora_off = False


def expert_adapter_init(tensor: torch.Tensor, generator: torch.Generator) -> None:
    """An expert adapter's A [E, in, rank]: PEFT's kaiming-uniform (a = sqrt(5)) of each
    expert's [rank, in], i.e. uniform in +-1/sqrt(in)."""
    bound = 1 / math.sqrt(tensor.shape[1])
    tensor.uniform_(-bound, bound, generator=generator)


def is_expert_adapter(name: str) -> bool:
    return name.endswith(("_lora.lora_A.weight", "_lora.lora_B.weight"))


def adapted_weight(layer: str) -> str:
    """The parameter an adapter module adapts (layers.0.attention.wq -> .weight;
    layers.0.mlp.experts_up_lora -> layers.0.mlp.experts_up)."""
    return layer.removesuffix("_lora") if layer.endswith("_lora") else f"{layer}.weight"


def merge_any(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float):
    """An adapter merged into its weight in fp32: W + scale x B @ A for a linear's [out, in],
    W_e + scale x A_e @ B_e for each expert's [in, out]."""
    if weight.dim() == 3:
        return weight.float() + scale * torch.bmm(a.float(), b.float())
    return merge_adapter(weight, a, b, scale)


def add_adapters(model: nn.Module) -> None:
    """LoRA adapters on the targeted layers of every block (an MoE layer's mlp.up/gate/down:
    each expert's and the shared expert's); every other parameter frozen but those a LoRA run
    trains (``trains``); a base stored in bf16 where lora.base_dtype says."""
    a = model.args
    scale = a.lora_alpha / a.lora_rank
    for name, module in list(model.named_modules()):
        if not name.startswith("layers."):
            continue
        rest = name.split(".", 2)[2] if name.count(".") >= 2 else ""
        shared = rest.replace("mlp.shared_expert.", "mlp.", 1)
        if isinstance(module, Linear) and (rest in a.lora_targets or shared in a.lora_targets):
            module.add_adapter(a.lora_rank, scale, a.lora_dropout)
        if rest == "mlp" and hasattr(module, "experts_up"):
            for w in EXPERT_WEIGHTS:
                weight = getattr(module, f"experts_{w}")
                if weight is not None and f"mlp.{w}" in a.lora_targets:
                    e, fan_in, fan_out = weight.shape
                    adapter = ExpertAdapter(e, fan_in, fan_out, a.lora_rank, scale, a.lora_dropout)
                    setattr(module, f"experts_{w}_lora", adapter)
    if a.lora_base_dtype == "bf16":  # the frozen base's linear weights kept in bfloat16
        for name, module in model.named_modules():
            for leaf in ("weight", "bias"):
                param = module._parameters.get(leaf)
                if param is not None and is_base_linear(f"{name}.{leaf}"):
                    setattr(module, leaf, nn.Parameter(param.bfloat16(), requires_grad=False))


def adapted_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module holding an adapter (lora_A): linears, Float8Linears,
    expert adapters."""
    return [(n, m) for n, m in model.named_modules() if "lora_A" in m._modules]


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with each LoRA adapter merged into the weight it adapts
    (W + scale x B @ A) and no adapter tensors: the plain model that computes the same."""
    sd = model.state_dict()
    params = dict(model.named_parameters())
    merged = {}
    for name, module in adapted_modules(model):
        target = adapted_weight(name)
        if isinstance(module, ExpertAdapter):
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            weight = getattr(owner, name.rsplit(".", 1)[1].removesuffix("_lora"))
        else:
            weight = params.get(target, getattr(module, "weight", None))
        a, b = module.lora_A.weight, module.lora_B.weight
        out = merge_any(weight, a, b, module.lora_scale).detach()
        merged[target] = out if weight.dtype == torch.bfloat16 else out.to(weight.dtype)
    return {k: merged.get(k, v) for k, v in sd.items() if not k.endswith(ADAPTER_TENSORS)}


ADAPTER_TENSORS = ("lora_A.weight", "lora_B.weight")


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """``model`` computes its base, every LoRA adapter left out (DPO's and KTO's reference)."""
    layers = [m for _, m in adapted_modules(model)]
    for layer in layers:
        layer.lora_off = True
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_off = False


def take_adapter(layer: nn.Module) -> tuple[nn.Module, ...] | None:
    """A layer's adapter (lora_A, lora_B, lora_dropout) taken off it (None: it has none)."""
    if "lora_A" not in layer._modules:
        return None
    return tuple(layer._modules.pop(k) for k in ADAPTER_PARTS)


def attach_adapter(layer: nn.Module, parts: tuple[nn.Module, ...], scale: float) -> None:
    """An adapter put on a layer that does not compute one itself (torchao's Float8Linear):
    a forward hook adds scale x B(A(dropout(x))) to its output, in the input's dtype."""
    layer.lora_A, layer.lora_B, layer.lora_dropout = parts
    layer.lora_scale, layer.lora_off = scale, False
    layer.register_forward_hook(_adapter_hook)


def _adapter_hook(layer: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    if layer.lora_off:
        return out
    x = args[0]
    low = linear(layer.lora_dropout(x), layer.lora_A.weight, mode="default")
    return out + layer.lora_scale * linear(low, layer.lora_B.weight, mode="default").to(out.dtype)


def expert_term(
    adapter: ExpertAdapter | None, rows: torch.Tensor, counts: list[int], local, pick
) -> torch.Tensor | None:
    """An expert weight's adapter's part of the rows' outputs (None without one, or while
    ``adapters_off``): ``pick(x, w)`` is the experts' product for those shapes (the
    per-expert loop or the grouped GEMM), ``local`` this device's part of an expert tensor."""
    if adapter is None or adapter.lora_off:
        return None
    x, a = adapter.lora_dropout(rows), local(adapter.lora_A.weight)
    low = pick(x, a)(x, a, counts, None)
    b = local(adapter.lora_B.weight)
    return adapter.lora_scale * pick(low, b)(low, b, counts, None)
