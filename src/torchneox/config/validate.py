"""Checks that need more than one key's type: ranges, cross-key consistency, nested dicts.

Each check raises a one-line ConfigError naming the file, the key, what was given and what
to do. Values that are simply absent (a fragment such as local_setup.yml) are not errors
here; commands that need them (train, generate) ask for them.
"""

from __future__ import annotations

import math
import re
from typing import Any

from torchneox.base.errors import did_you_mean
from torchneox.config.checker import Checker
from torchneox.config.checks.ft import check_replicas
from torchneox.config.checks.guards import check_guards
from torchneox.config.checks.model import (
    ATTENTION_TYPES_OK,
    ATTENTION_TYPES_REFUSED,
    _attention_kinds,
    _check_model,
    _check_moe,
    _check_rope_scaling,
    layer_attention_types,
)
from torchneox.config.checks.muon import MUON_PARAMS, muon_param
from torchneox.config.checks.rl import check_reinforce
from torchneox.config.features.curriculum import check_curriculum
from torchneox.config.features.deepspeed_dicts import check_deepspeed_dicts
from torchneox.config.features.eight_bit import check_eight_bit
from torchneox.config.features.epochs import check_train_epochs
from torchneox.config.features.lora import check_lora
from torchneox.config.features.offload import OFFLOAD_KEYS, offload_problem
from torchneox.config.features.sharing import check_sharing
from torchneox.config.features.soft_prompt import check_soft_prompt
from torchneox.config.features.sparsity import ATTENTION_LAYER_TYPES
from torchneox.config.features.streaming import check_streaming
from torchneox.config.schema import NeoXConfig

SUPPORTED_OPTIMIZERS = (
    "adam", "adamw", "sgd", "lion", "sm3", "madgrad_wd", "lamb", "cpu_adam", "cpu_torch_adam",
    "muon",
)  # fmt: skip
REFUSED_OPTIMIZERS = {
    "onebitadam": "1-bit Adam (a DeepSpeed communication-compressed optimizer)",
    "onebitlamb": "1-bit LAMB (a DeepSpeed communication-compressed optimizer)",
    "zerooneadam": "0/1 Adam (a DeepSpeed communication-compressed optimizer)",
}
CPU_ADAM_PARAMS = (
    "lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adamw_mode",
    "fp32_optimizer_states",
)  # fmt: skip
OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "max_grad_norm", "bias_correction"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "amsgrad", "max_grad_norm", "bias_correction"),
    "sgd": ("lr", "momentum", "dampening", "nesterov", "weight_decay"),
    # DeepSpeedCPUAdam's arguments (GPT-NeoX builds it for both types)
    "cpu_adam": CPU_ADAM_PARAMS,
    "cpu_torch_adam": CPU_ADAM_PARAMS,
    "lion": ("lr", "betas", "weight_decay"),
    "sm3": ("lr", "momentum", "beta", "eps"),
    "madgrad_wd": ("lr", "momentum", "eps", "weight_decay"),
    "lamb": (
        "lr",
        "betas",
        "eps",
        "eps_inside_sqrt",
        "weight_decay",
        "bias_correction",
        "max_grad_norm",
        "max_coeff",
        "min_coeff",
        "amsgrad",
    ),
    "muon": ("lr", "weight_decay", "betas", "eps", *MUON_PARAMS),
}
OPTIMIZER_NAMES = "Adam, AdamW, SGD, Lion, SM3, madgrad_wd, LAMB or muon"
BOOL_PARAMS = (
    "amsgrad", "nesterov", "bias_correction", "eps_inside_sqrt", "adamw_mode",
    "fp32_optimizer_states",
)  # fmt: skip
ZERO_KEYS = (
    "stage",
    "allgather_partitions",
    "allgather_bucket_size",
    "overlap_comm",
    "reduce_scatter",
    "reduce_bucket_size",
    "contiguous_gradients",
    "cpu_offload",
    "cpu_offload_params",
    "cpu_offload_use_pin_memory",
    "offload_optimizer",
    "offload_param",
    "sub_group_size",
    "elastic_checkpoint",
    "round_robin_gradients",
    "load_from_fp32_weights",
    "ignore_unused_parameters",
    "legacy_stage1",
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "mics_shard_size",
    "mics_hierarchical_params_gather",
)
ZERO_OFFLOAD_KEYS = OFFLOAD_KEYS
FP16_KEYS = (
    "enabled",
    "fp16",
    "type",
    "auto_cast",
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
)
BF16_IGNORED = ("bf16", *FP16_KEYS[FP16_KEYS.index("loss_scale") :])
"""What GPT-NeoX's configs/rwkv/170M.yml also puts in bf16 (its fp16 block's keys): DeepSpeed
reads none of them for bf16, which has no loss scale."""
BF16_KEYS = ("enabled", "type", "immediate_grad_update", "check_grad_overflow", *BF16_IGNORED)
COMM_DTYPES = ("fp32", "fp16", "bf16", "bfloat16")


def validate(config: NeoXConfig, origin: dict[str, str]) -> None:
    check = Checker(config, origin)
    _check_refused(check)  # a feature that is not built is named before any check trips on it
    check.ranges()  # every key's range, declared on its field (fields.py), before cross-key checks
    _check_model(check)
    _check_rope_scaling(check)
    _check_moe(check)
    _check_parallel(check)
    _check_optimizer(check)
    check_eight_bit(check)
    _check_lr(check)
    _check_precision(check)
    _check_training(check)
    _check_data(check)
    check_streaming(check)
    check_train_epochs(check)
    check_curriculum(check)
    check_lora(check)
    check_deepspeed_dicts(check)
    _check_sharing(check)
    check_soft_prompt(check)
    _check_textgen(check)
    _check_post_training(check)
    check_reinforce(check)
    check_guards(check)
    check_replicas(check)


def _check_sharing(ch: Checker) -> None:
    kinds = layer_attention_types(ch.c, ch.origin)
    e = ch.c.moe
    moe = [
        e.moe_num_experts > 1 and i % e.moe_expert_interval == 0 and k in ATTENTION_LAYER_TYPES
        for i, k in enumerate(kinds)
    ]
    check_sharing(ch, kinds, moe)


def _check_refused(ch: Checker) -> None:
    """Features torchneox does not build, each named in one line, before the checks of sizes
    and layouts (a mamba config is told that mamba is not built, not that its heads do not
    divide its width)."""
    c = ch.c
    for kind in _attention_kinds(c.model.attention_config):
        if kind in ATTENTION_TYPES_REFUSED:
            ch.fail(
                "attention_config",
                f"'{kind}' attention ({ATTENTION_TYPES_REFUSED[kind]}) is not supported; "
                f"use one of {', '.join(ATTENTION_TYPES_OK)}",
            )
    _optimizer_type(ch)


def _check_post_training(ch: Checker) -> None:
    """The objectives and the data they read fit together (train_impl, dataset_impl,
    pack_impl, label and reward datasets), as GPT-NeoX's get_batch expects them."""
    c = ch.c
    d, impl = c.data, c.training.train_impl
    if d.dataset_impl == "pairwise" and impl not in ("dpo", "rm"):
        ch.fail(
            "dataset_impl",
            f"pairwise data is for train_impl dpo or rm; {impl!r} reads train_data_paths",
        )
    if impl in ("dpo", "rm") and d.dataset_impl != "pairwise":
        ch.fail(
            "train_impl",
            f"{impl!r} trains on chosen and rejected pairs: set dataset_impl: pairwise with "
            "pos_/neg_train_data_paths",
        )
    if d.dataset_impl == "pairwise" and d.pack_impl == "packed":
        ch.fail(
            "pack_impl", "pairwise data is not packed (as in GPT-NeoX); use unpacked or "
            "pack_until_overflow",
        )  # fmt: skip
    if d.pack_impl != "packed" and d.data_path:
        ch.fail(
            "pack_impl",
            f"{d.pack_impl!r} samples whole datasets: give train_data_paths (and valid_/test_) "
            "instead of data_path",
        )
    splits = ("train", "valid", "test")
    if any(getattr(d, f"{s}_reward_data_paths") for s in splits) and d.pack_impl != "unpacked":
        ch.fail("pack_impl", "reward datasets need pack_impl: unpacked (as in GPT-NeoX)")
    if c.textgen.precompute_model_name and impl in ("dpo", "kto") and d.pack_impl != "unpacked":
        ch.fail(
            "precompute_model_name",
            "precomputed log-probabilities line up with samples of one document: use "
            "pack_impl: unpacked (as GPT-NeoX)",
        )
    if impl == "kto":
        _check_kto(ch)
    if impl == "rm" and d.pos_train_data_paths and not d.pos_train_label_data_paths:
        ch.fail(
            "pos_train_label_data_paths",
            "a reward model reads its value where the label is set: give pos_/neg_ label "
            "datasets (preprocess --chat --for-rm writes them)",
        )


def _check_kto(ch: Checker) -> None:
    c = ch.c
    if not c.data.train_reward_data_paths:
        ch.fail(
            "train_reward_data_paths",
            "kto needs each document's reward (+1 desirable, -1 undesirable): preprocess "
            "--chat --reward-key writes them",
        )
    mb = c.training.train_micro_batch_size_per_gpu
    if mb is not None and (mb < 2 or mb % 2):
        ch.fail(
            "train_micro_batch_size_per_gpu",
            f"kto pairs the two halves of each micro-batch (each half's KL is the other's "
            f"reference point), so it needs an even micro-batch of at least 2, not {mb}",
        )
    splits = ("valid", "test")
    for s in splits:
        if getattr(c.data, f"{s}_data_paths") and not getattr(c.data, f"{s}_reward_data_paths"):
            ch.fail(f"{s}_reward_data_paths", f"kto evaluates {s} data with its rewards; give them")


def _check_parallel(ch: Checker) -> None:
    p = ch.c.parallel
    # (sizes are ranges declared on the fields; which layouts run is layout.py's check_layout)
    method = p.pipe_partition_method
    if not (method in ("parameters", "uniform") or method.startswith("type:")):
        ch.fail(
            "pipe_partition_method",
            f"{method!r} is not 'parameters', 'uniform' or 'type:REGEX'",
        )


def _optimizer_type(ch: Checker) -> str | None:
    opt = ch.c.optimizer.optimizer
    if opt is None:
        return None
    if "type" not in opt:
        ch.fail("optimizer", f"has no 'type' ({OPTIMIZER_NAMES})")
    kind = str(opt["type"]).lower()
    if kind in REFUSED_OPTIMIZERS:
        ch.fail(
            "optimizer",
            f"type {opt['type']!r} ({REFUSED_OPTIMIZERS[kind]}) is not supported; "
            f"use {OPTIMIZER_NAMES}",
        )
    if kind not in SUPPORTED_OPTIMIZERS:
        ch.fail(
            "optimizer",
            f"unknown type {opt['type']!r}{did_you_mean(kind, SUPPORTED_OPTIMIZERS)} "
            f"({OPTIMIZER_NAMES})",
        )
    return kind


def _check_optimizer(ch: Checker) -> None:
    o = ch.c.optimizer
    kind = _optimizer_type(ch)
    if kind is not None:
        opt = o.optimizer
        extra = sorted(set(opt) - {"type", "params"})
        if extra:
            ch.fail(
                "optimizer",
                f"unknown entry {extra[0]!r}{did_you_mean(extra[0], ['type', 'params'])}",
            )
        params = opt.get("params") or {}
        if not isinstance(params, dict):
            ch.fail("optimizer", f"params must be a mapping, got {params!r}")
        for name, value in list(params.items()):
            if name not in OPTIMIZER_PARAMS[kind]:
                ch.fail(
                    "optimizer",
                    f"params.{name} is not a parameter of {opt['type']}"
                    f"{did_you_mean(name, OPTIMIZER_PARAMS[kind])}",
                    path=f"params.{name}",
                )
            params[name] = _optimizer_param(ch, name, value, kind)
        opt["params"] = params
        if params.get("min_coeff", 0.01) > params.get("max_coeff", 10.0):
            ch.fail(
                "optimizer",
                f"params.min_coeff {params.get('min_coeff', 0.01)} is above params.max_coeff "
                f"{params.get('max_coeff', 10.0)}; LAMB's trust ratio is clamped between them",
                path="params.min_coeff",
            )
        lr = params.get("lr")
        if o.lr is not None and lr is not None and o.lr != lr:
            ch.fail("lr", f"{o.lr} contradicts optimizer.params.lr {lr}; give one of them")
        if "optimizer_type" in ch.origin and o.optimizer_type != kind:
            ch.fail(
                "optimizer_type",
                f"{o.optimizer_type!r} contradicts optimizer.type {opt['type']!r}; give one",
            )
    elif "optimizer_type" in ch.origin and o.optimizer_type not in SUPPORTED_OPTIMIZERS:
        ch.fail(
            "optimizer_type",
            f"{o.optimizer_type!r} ({REFUSED_OPTIMIZERS.get(o.optimizer_type, 'this optimizer')}) "
            "is not supported; use adam, sgd, lion, sm3, madgrad_wd, lamb or muon",
        )
    if (
        "gradient_clipping" in ch.origin
        and "clip_grad" in ch.origin
        and o.gradient_clipping != o.clip_grad
    ):
        ch.fail(
            "clip_grad",
            f"{o.clip_grad} contradicts gradient_clipping {o.gradient_clipping}; give one of them",
        )
    _check_zero(ch)
    _check_offload(ch)


def _check_offload(ch: Checker) -> None:
    """ZeRO-Offload's entries and what they need (config/features/offload.py)."""
    problem = offload_problem(ch.c.optimizer.zero_optimization, ch.c.optimizer.optimizer)
    if problem is not None:
        where, message = problem
        if where == "optimizer":
            ch.fail("optimizer", message, path="type")
        ch.fail("zero_optimization", message, path=where)


def _optimizer_param(ch: Checker, name: str, value: Any, kind: str) -> Any:
    def fail(message: str) -> None:
        ch.fail("optimizer", message, path=f"params.{name}")

    def number(v: Any) -> float:
        try:
            if isinstance(v, bool):
                raise ValueError
            return float(v)
        except (TypeError, ValueError):
            text = isinstance(v, str)  # GPT-NeoX's gmlp_small.yml: eps 1.0e_8, a string to YAML
            fail(
                f"params.{name} must be a number, got {'the text ' if text else ''}{value!r}"
                + ("; write it as a number (such as 1.0e-8)" if text else "")
            )
            raise AssertionError from None

    if kind == "muon" and name in MUON_PARAMS:
        return muon_param(name, value, fail)
    if name == "betas":
        if not isinstance(value, list | tuple) or len(value) != 2:
            fail(f"params.betas must be two numbers, got {value!r}")
        betas = [number(v) for v in value]
        if not all(0.0 <= b < 1.0 for b in betas):
            fail(f"params.betas must be in [0, 1), got {value!r}")
        return betas
    if name in BOOL_PARAMS:
        if not isinstance(value, bool):
            fail(f"params.{name} must be true or false, got {value!r}")
        if name == "amsgrad" and value and kind in ("cpu_adam", "cpu_torch_adam"):
            fail("params.amsgrad: true is not supported by DeepSpeed's CPU Adam; remove it")
        if name == "amsgrad" and value and kind == "lamb":
            fail("params.amsgrad: true is not a LAMB variant (DeepSpeed's FusedLamb refuses it)")
        if name == "bias_correction" and not value and kind != "lamb":
            fail(
                "params.bias_correction: false (Adam without bias correction) is not built: "
                "torch's Adam always corrects its moments; remove it or set it to true",
            )
        return value
    result = number(value)
    if not math.isfinite(result) or result < 0 or (name == "lr" and result == 0):
        fail(f"params.{name} must be {'> 0' if name == 'lr' else '>= 0'}, got {value!r}")
    if name in ("momentum", "beta") and kind in ("sm3", "madgrad_wd") and result >= 1:
        fail(f"params.{name} must be in [0, 1), got {value!r}")
    return result


def _check_zero(ch: Checker) -> None:
    zero = ch.c.optimizer.zero_optimization
    if zero is None:
        return
    for name in zero:
        if name not in ZERO_KEYS:
            ch.fail(
                "zero_optimization",
                f"unknown entry {name!r}{did_you_mean(name, ZERO_KEYS)}",
                path=name,
            )
    shard = zero.get("mics_shard_size")
    if shard is not None and (isinstance(shard, bool) or not isinstance(shard, int) or shard < 1):
        ch.fail(
            "zero_optimization",
            f"mics_shard_size must be a positive integer, got {shard!r}",
            path="mics_shard_size",
        )
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        ch.fail("zero_optimization", f"stage must be 0, 1, 2 or 3, got {stage!r}", path="stage")
    given = ch.c.optimizer.zero_stage
    if "zero_stage" in ch.origin and given is not None and given != stage:
        ch.fail("zero_stage", f"{given!r} contradicts zero_optimization.stage {stage}; give one")


def _check_lr(ch: Checker) -> None:
    lr = ch.c.lr
    if lr.override_lr_scheduler and lr.use_checkpoint_lr_scheduler:
        ch.fail(
            "use_checkpoint_lr_scheduler",
            "cannot be true together with override_lr_scheduler; choose where the schedule comes from",
        )
    opt = ch.c.optimizer.optimizer or {}
    peak = (opt.get("params") or {}).get("lr", ch.c.optimizer.lr)
    if peak is not None and lr.min_lr > peak:
        ch.fail("min_lr", f"{lr.min_lr} is above the peak learning rate {peak}")
    if lr.lr_decay_style.startswith("infinite_"):
        for name in ("constant_lr", "min_lr"):
            if getattr(lr, name) <= 0:
                ch.fail(
                    name,
                    f"must be above 0 for lr_decay_style {lr.lr_decay_style}: its last phase "
                    "decays exponentially from constant_lr to min_lr (GPT-NeoX PR #1194)",
                )
        if lr.cooldown_iters_perc + lr.constant_iters_perc + lr.warmup >= 1:
            ch.fail(
                "constant_iters_perc",
                "warmup, cooldown_iters_perc and constant_iters_perc leave no step for the "
                "exponential decay to min_lr; make their sum less than 1",
            )


def _check_precision(ch: Checker) -> None:
    pr = ch.c.precision
    for name, allowed in (("fp16", FP16_KEYS), ("bf16", BF16_KEYS)):
        entries = getattr(pr, name)
        for k in entries or {}:
            if k not in allowed:
                ch.fail(name, f"unknown entry {k!r}{did_you_mean(k, allowed)}", path=k)
    fp16_on = bool(pr.fp16 and pr.fp16.get("enabled", False))
    bf16_on = bool(pr.bf16 and pr.bf16.get("enabled", False))
    if fp16_on and bf16_on:
        ch.fail("bf16", "both fp16 and bf16 are enabled; enable one")
    if fp16_on and pr.precision not in (None, "fp16"):
        ch.fail("precision", f"{pr.precision!r} contradicts fp16.enabled: true")
    if bf16_on and pr.precision not in (None, "bfloat16"):
        ch.fail("precision", f"{pr.precision!r} contradicts bf16.enabled: true")
    if pr.fp16:
        for k in (
            "loss_scale",
            "initial_scale_power",
            "loss_scale_window",
            "hysteresis",
            "min_loss_scale",
        ):
            v = pr.fp16.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or v < 0):
                ch.fail("fp16", f"{k} must be a number >= 0, got {v!r}", path=k)
    if pr.communication_data_type is not None and pr.communication_data_type not in COMM_DTYPES:
        ch.fail(
            "communication_data_type",
            f"{pr.communication_data_type!r} is not one of {', '.join(COMM_DTYPES)}",
        )
    bf16_training = pr.precision == "bfloat16" or (pr.precision is None and bf16_on)
    if pr.zero_param_dtype == "bf16" and not bf16_training:
        ch.fail(
            "zero_param_dtype", "bf16 weights are for precision: bfloat16; use auto or fp32"
        )  # fmt: skip
    _check_fp8(ch)


def _check_fp8(ch: Checker) -> None:
    m = ch.c.model
    if not m.te_fp8_mha:
        return
    delayed = (
        "torchao scales fp8 from each tensor's current amax; TransformerEngine's delayed "
        "scaling over an amax history is not built: "
    )
    if m.te_fp8_amax_history_len != 1:
        ch.fail("te_fp8_amax_history_len", delayed + "set te_fp8_amax_history_len 1")
    if m.te_fp8_amax_compute_algo != "most_recent":
        ch.fail("te_fp8_amax_compute_algo", delayed + "set te_fp8_amax_compute_algo most_recent")
    if m.te_fp8_margin:
        ch.fail("te_fp8_margin", "torchao's fp8 scales have no margin; set te_fp8_margin 0")


def _check_training(ch: Checker) -> None:
    t, ck = ch.c.training, ch.c.checkpoint
    if (
        t.batch_size is not None
        and t.train_micro_batch_size_per_gpu is not None
        and t.batch_size != t.train_micro_batch_size_per_gpu
    ):
        ch.fail(
            "batch_size",
            f"{t.batch_size} contradicts train_micro_batch_size_per_gpu "
            f"{t.train_micro_batch_size_per_gpu}; give one of them",
        )
    if (
        ck.checkpoint_scale == "log"
        and ck.checkpoint_factor is not None
        and ck.checkpoint_factor < 2
    ):
        ch.fail("checkpoint_factor", "must be >= 2 with checkpoint_scale: log (it is the base)")
    nodes = ch.c.launcher.num_nodes
    if nodes is not None and nodes != -1 and nodes < 1:
        ch.fail("num_nodes", f"must be -1 (every node) or >= 1, got {nodes}")
    lg = ch.c.logging
    if lg.profile_step_stop < lg.profile_step_start:
        ch.fail(
            "profile_step_stop",
            f"{lg.profile_step_stop} is before profile_step_start {lg.profile_step_start}",
        )


def split_shares(split: str) -> list[float]:
    """The train, validation and test shares of GPT-NeoX's ``split`` ('949,50,1' or
    '949/50/1'; missing parts are 0), as given. Raises ValueError. The one parser of the key:
    validation, explain and the datasets all read it."""
    parts = [p.strip() for p in split.replace("/", ",").split(",") if p.strip()]
    if not 1 <= len(parts) <= 3:
        raise ValueError("needs one to three comma-separated numbers")
    values = [float(p) for p in parts]
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise ValueError("needs non-negative numbers with a positive sum")
    return values + [0.0] * (3 - len(values))


def split_fractions(split: str) -> list[float]:
    """'949,50,1' -> [0.949, 0.05, 0.001]. Raises ValueError."""
    values = split_shares(split)
    total = sum(values)
    return [v / total for v in values]


def _check_data(ch: Checker) -> None:
    d = ch.c.data
    try:
        split_fractions(d.split)
    except ValueError as e:
        ch.fail("split", f"{d.split!r} {e} (train, validation, test), like '949,50,1'")
    if d.data_path and d.train_data_paths:
        ch.fail("train_data_paths", "given together with data_path; use one way to name the data")
    for kind in ("train", "valid", "test"):
        paths = getattr(d, f"{kind}_data_paths")
        weights = getattr(d, f"{kind}_data_weights")
        if weights is not None:
            if paths is None or len(weights) != len(paths):
                ch.fail(
                    f"{kind}_data_weights",
                    f"has {len(weights)} weights for {len(paths or [])} {kind}_data_paths",
                )
            if any(w < 0 for w in weights) or sum(weights) <= 0:
                ch.fail(f"{kind}_data_weights", f"must be >= 0 with a positive sum, got {weights}")


PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _check_textgen(ch: Checker) -> None:
    name = ch.c.textgen.precompute_model_name
    if name is not None and not PLAIN_NAME.fullmatch(name):
        ch.fail(
            "precompute_model_name",
            f"{name!r} must be a plain name (letters, digits, '.', '_', '-', starting with a "
            "letter or digit; no '/' or '..'): it names the files written beside each dataset, "
            "DATASET_{name}.bin/.idx",
        )
