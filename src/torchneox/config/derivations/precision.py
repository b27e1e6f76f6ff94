"""The precision rows of ``config explain``: the compute dtype and why, the loss scale, the
dtypes gradients are reduced and ZeRO's weights gathered in, and the fp8 plan."""

from __future__ import annotations

from torchneox.config.derived import Derived
from torchneox.config.features.deepspeed_dicts import amp_fp16, amp_level
from torchneox.config.features.fp8_plan import fp8_plan
from torchneox.config.features.loss_scale import loss_scale_spec
from torchneox.config.schema import NeoXConfig


def derive_precision(cfg: NeoXConfig, out: Derived) -> None:
    pr = cfg.precision
    fp16_on = bool(pr.fp16 and pr.fp16.get("enabled", False))
    bf16_on = bool(pr.bf16 and pr.bf16.get("enabled", False))
    if pr.precision is not None:
        precision, why = pr.precision, f"{pr.precision}, from precision"
    elif fp16_on:
        precision, why = "fp16", "fp16, because fp16.enabled is true"
    elif bf16_on:
        precision, why = "bfloat16", "bfloat16, because bf16.enabled is true"
    elif amp_fp16(pr):  # apex AMP at O1/O2 (config/features/deepspeed_dicts.py)
        precision, why = "fp16", f"fp16, because amp.enabled is true ({amp_level(pr)})"
    else:
        precision, why = "fp32", "fp32: neither precision nor an enabled fp16/bf16 dict is given"
    if precision == "bfloat16":
        why += " (autocast in bf16, fp32 master weights)"
    if precision == "fp16":
        why += " (autocast in fp16, fp32 master weights, loss scaling)"
    out.put("precision", precision, why)
    if precision == "fp16":
        ls = loss_scale_spec(cfg.precision)
        if ls.static:
            out.put(
                "loss_scale",
                f"static {ls.static:g}",
                f"fp16.loss_scale {ls.static:g} fixes the scale",
            )
        else:
            out.put(
                "loss_scale",
                f"dynamic from 2^{ls.initial_scale_power:g}",
                f"loss_scale 0/unset means dynamic: start at 2^{ls.initial_scale_power:g}, "
                f"double after {ls.window:g} clean steps, halve after {ls.hysteresis} overflows, "
                f"never below {ls.min_scale:g}; an overflowing step is skipped",
            )
    if pr.communication_data_type:
        reduce, why = pr.communication_data_type, "from communication_data_type"
    elif pr.fp32_allreduce:
        reduce, why = "fp32", "fp32_allreduce: true"
    else:
        reduce = {"fp32": "fp32", "bfloat16": "bf16", "fp16": "fp32"}[precision]
        why = (
            "gradients are reduced in the master weights' dtype"
            if precision != "bfloat16"
            else ("bf16 like the compute; set fp32_allreduce: true for fp32 reduction")
        )
    out.put("gradient_reduce_dtype", reduce, why)
    gather = pr.zero_param_dtype
    if gather == "auto":
        gather = "bf16" if precision == "bfloat16" else "fp32"
        why = "auto: bf16 weights when training in bfloat16" if gather == "bf16" else "auto"
    else:
        why = "zero_param_dtype"
    out.put("zero_param_dtype", gather, why + "; FSDP2 gathers ZeRO's weights in it (not DDP)")
    _fp8(cfg, out)


def _fp8(cfg: NeoXConfig, out: Derived) -> None:
    plan = fp8_plan(cfg.precision, cfg.model)
    if plan is None:
        out.put("fp8", "off", "neither fp8_recipe nor te_fp8_mha is set")
    elif plan.scope == "attention":
        wgrad = ", weight gradients in high precision" if plan.wgrad_high_precision else ""
        why = f"te_fp8_mha on torchao's float8; output gradients {plan.grad_format} (te_fp8_format)"
        out.put("fp8", f"attention linears, {plan.recipe}", why + wgrad)
    else:
        out.put("fp8", f"block linears, {plan.recipe}", "fp8_recipe on torchao's float8")
