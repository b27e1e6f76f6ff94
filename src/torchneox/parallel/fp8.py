"""fp8 training through torchao's float8: the transformer blocks' linears swapped for
``Float8Linear`` (its weights stay fp32 or bf16 masters; inputs, weights and output gradients
are cast to fp8 with scales from their current values for each product).

Two ways in: ``fp8_recipe`` (torchneox's key: torchao's tensorwise, rowwise or
rowwise_with_gw_hp recipe, over every block linear), and GPT-NeoX's ``te_fp8_mha`` (fp8 for
the attention's linears, as TransformerEngine's fp8 MultiheadAttention), where ``te_fp8_format``
(hybrid: e5m2 output gradients) and ``te_fp8_wgrad`` (false: weight gradients in high
precision) map onto torchao's cast configs. TransformerEngine's delayed scaling (an amax
history) has no torchao counterpart: only its defaults (history 1, most_recent, margin 0:
the scale from the current tensor) are taken.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from torch import nn

from torchneox.base.errors import ConfigError
from torchneox.config.features.fp8_plan import FP8Plan
from torchneox.models.lora import attach_adapter, take_adapter


def torchao_config(plan: FP8Plan) -> Any:
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType

    config = Float8LinearConfig.from_recipe_name(plan.recipe)
    changes: dict[str, Any] = {}
    if plan.grad_format is not None:
        dtype = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}[plan.grad_format]
        grad = config.cast_config_grad_output
        grad = dataclasses.replace(grad, target_dtype=dtype)
        changes["cast_config_grad_output"] = grad  # and in the weight gradient's product
        changes["cast_config_grad_output_for_grad_weight"] = grad
    if plan.wgrad_high_precision:  # torchao wants one dtype named for the output gradient
        grad = changes.get("cast_config_grad_output", config.cast_config_grad_output)
        off = CastConfig(ScalingType.DISABLED, target_dtype=grad.target_dtype)
        changes["cast_config_input_for_grad_weight"] = CastConfig(ScalingType.DISABLED)
        changes["cast_config_grad_output_for_grad_weight"] = off
    return dataclasses.replace(config, **changes) if changes else config


def check_fp8_hardware(plan: FP8Plan, device: torch.device) -> None:
    """One line where fp8 cannot run here: no torchao, a GPU without fp8 units (what no
    layout runs, fp8 with tensor parallelism, is config/layout.py's check_layout)."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(
            "fp8 training runs on torchao's float8: pip install torchao (or torchneox[fp8])",
            key=plan.key,
        ) from None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"this GPU (compute capability {major}.{minor}) has no fp8 units: fp8 needs "
                "8.9 or newer (Ada, Hopper, Blackwell); train in bf16 instead",
                key=plan.key,
            )


def apply_fp8(model: nn.Module, plan: FP8Plan) -> int:
    """Swap the linears ``plan`` covers for torchao's Float8Linear in place (names and
    parameters unchanged, so checkpoints are the same files; a LoRA adapter stays beside its
    layer under the same names); the number swapped. torchao's
    kernels need both dimensions divisible by 16: other linears stay as they are."""
    from torchao.float8 import convert_to_float8_training

    swapped = []

    def covered(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear) or not name.startswith("layers."):
            return False
        if plan.scope == "attention" and ".attention." not in f".{name}":
            return False
        ok = module.in_features % 16 == 0 and module.out_features % 16 == 0
        if ok:
            swapped.append(name)
        return ok

    # a LoRA adapter is taken off its layer and put back beside the Float8Linear that
    # replaces it: the base product in fp8, the adapter's in the autocast dtype
    adapters = {n: take_adapter(m) for n, m in model.named_modules() if n.startswith("layers.")}
    adapters = {n: parts for n, parts in adapters.items() if parts is not None}
    scales = {n: model.get_submodule(n).lora_scale for n in adapters}
    convert_to_float8_training(model, module_filter_fn=covered, config=torchao_config(plan))
    modules = dict(model.named_modules())
    for name in swapped:
        modules[name].register_forward_pre_hook(_cpu_autocast_input)
    for name, parts in adapters.items():
        layer = modules[name]
        if name in swapped:
            attach_adapter(layer, parts, scales[name])
        else:  # still torchneox's Linear, which computes its adapter itself
            layer.lora_A, layer.lora_B, layer.lora_dropout = parts
    if not swapped:
        raise ConfigError(
            "no linear of the blocks has both dimensions divisible by 16, as torchao's fp8 "
            "kernels need: nothing would run in fp8",
            key=plan.key,
        )
    return len(swapped)


def _cpu_autocast_input(module: nn.Module, args: tuple) -> tuple | None:
    """Under the CPU's autocast, the input in its dtype, as torchao's Float8Linear casts it
    under CUDA's only: otherwise a product the recipe keeps in high precision
    (rowwise_with_gw_hp's weight gradient, te_fp8_wgrad false) would meet an fp32 input and a
    bf16 output gradient."""
    if torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda"):
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def _fp8_gathers(layer: nn.Module) -> bool:
    """Whether ``layer`` is a Float8Linear whose input and output gradient torchao's float8
    tensor-parallel styles may cast before their collectives: tensorwise dynamic scales (one
    scale per tensor: the same on every rank) and the weight gradient's product in fp8 too (a
    style hands the layer its input already in fp8, so a recipe keeping that product in high
    precision, rowwise_with_gw_hp or te_fp8_wgrad false, takes torch's own styles: the layer
    then casts each rank's part itself)."""
    if "torchao.float8" not in sys.modules:  # no Float8Linear without it (nor its import)
        return False
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(layer, Float8Linear) or "lora_A" in layer._modules:
        return False  # an adapter reads the layer's input, which must stay in high precision
    c = layer.config
    casts = (c.cast_config_input, c.cast_config_grad_output, c.cast_config_input_for_grad_weight)
    return all(
        x.scaling_type is ScalingType.DYNAMIC
        and x.scaling_granularity is ScalingGranularity.TENSORWISE
        for x in casts
    )


def column_style(layer: nn.Module, fp8_collectives: bool = True, **kw: Any) -> Any:
    """Tensor parallelism's split of ``layer`` by output features: torchao's
    Float8ColwiseParallel for an fp8 layer (its input cast to fp8 before it is gathered, its
    output gradient cast in backward), else torch's ColwiseParallel. ``fp8_collectives``
    false (gloo, which moves no fp8 tensor, under sequence parallelism, whose gathers and
    scatters the styles would run in fp8): torch's style, the layer casting its own parts."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    if fp8_collectives and _fp8_gathers(layer):
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel

        return Float8ColwiseParallel(**kw)
    return ColwiseParallel(**kw)


def row_style(layer: nn.Module, fp8_collectives: bool = True, **kw: Any) -> Any:
    """The split of ``layer`` by input features: torchao's Float8RowwiseParallel for an fp8
    layer, else torch's RowwiseParallel (``fp8_collectives``: as ``column_style``)."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    if fp8_collectives and _fp8_gathers(layer):
        from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

        return Float8RowwiseParallel(**kw)
    return RowwiseParallel(**kw)


def gather_input_style(layers: list[nn.Module], fp8_collectives: bool, **kw: Any) -> Any:
    """A sublayer's input gathered from its sequence shards (sequence parallelism): cast to
    fp8 first (torchao's PrepareFloat8ModuleInput: one fp8 all-gather) where every layer that
    reads it (``layers``) takes torchao's styles, else torch's PrepareModuleInput."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if fp8_collectives and layers and all(_fp8_gathers(x) for x in layers):
        from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

        return PrepareFloat8ModuleInput(**kw)
    return PrepareModuleInput(**kw)
