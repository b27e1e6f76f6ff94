"""DeepSpeed dicts GPT-NeoX hands to DeepSpeed, read as GPT-NeoX's run would use them, and
s3_path (the checkpoint uploads):

- ``amp``: DeepSpeed runs apex AMP when amp.enabled is true and neither fp16 nor bf16 is
  (it refuses amp with them, and with ZeRO). opt_level O1/O2 map onto fp16 autocast with fp32
  master weights and apex's dynamic loss scale (2^16, doubled after 2000 clean steps, halved at
  every overflow); O0 is fp32; O3 (fp16 weights without fp32 master weights) is refused.
- ``scheduler``: no effect. GPT-NeoX always passes its own AnnealingLR to
  ``deepspeed.initialize``, and a client scheduler wins over the dict (DeepSpeed's
  ``_configure_lr_scheduler``); only onebitadam, refused here, leaves the schedule to the dict.
- ``sparse_attention``: no effect. DeepSpeed only parses it; GPT-NeoX's sparse layers are built
  from attention_config and sparsity_config.
- ``data_efficiency``: its seqlen_truncate curriculum is curriculum_learning (config/features/curriculum.py);
  the rest needs DeepSpeed's data analyzer, sampler or random-LTD layers and is refused.
"""

from __future__ import annotations

from typing import Any

from torchneox.base.errors import did_you_mean
from torchneox.config.derived import Derived
from torchneox.config.features.curriculum import SEQLEN_METRIC
from torchneox.config.numbers import number

AMP_USED = ("enabled", "opt_level", "loss_scale", "min_loss_scale")
AMP_IGNORED = (
    "cast_model_type",
    "patch_torch_functions",
    "keep_batchnorm_fp32",
    "master_weights",
    "cast_model_outputs",
    "num_losses",
    "verbosity",
    "max_loss_scale",
)
"""apex amp.initialize's other arguments: accepted, nothing here changes with them."""
AMP_LEVELS = {
    "O0": "fp32 (apex's O0 changes nothing)",
    "O1": "fp16 autocast with fp32 weights (apex O1)",
    "O2": "fp16 compute with fp32 master weights (apex O2)",
}
APEX_WINDOW = 2000
APEX_INITIAL_POWER = 16
DE_KEYS = ("enabled", "seed", "data_sampling", "data_routing")
SAMPLING_KEYS = ("enabled", "num_epochs", "num_workers", "curriculum_learning")
DS_ONLY = "DeepSpeed-only"


def amp_level(pr: Any) -> str | None:
    """apex's opt_level when amp is enabled (O1 when not given, apex's default), else None."""
    amp = pr.amp
    if not isinstance(amp, dict) or not amp.get("enabled", False):
        return None
    return str(amp.get("opt_level", "O1"))


def amp_fp16(pr: Any) -> bool:
    """Whether amp makes this run fp16 (enabled at O1 or O2)."""
    return amp_level(pr) in ("O1", "O2")


def amp_loss_scale(pr: Any) -> dict[str, float] | None:
    """apex's loss scaling in the fp16 dict's terms when amp makes the run fp16, else None."""
    if not amp_fp16(pr):
        return None
    amp = pr.amp
    scale = amp.get("loss_scale", "dynamic")
    return {
        "loss_scale": 0 if scale == "dynamic" else float(scale),
        "initial_scale_power": APEX_INITIAL_POWER,
        "loss_scale_window": APEX_WINDOW,
        "hysteresis": 1,
        "min_loss_scale": amp.get("min_loss_scale") or pr.min_scale,
    }


def check_deepspeed_dicts(ch: Any) -> None:
    """amp, data_efficiency and s3_path, each mistake in one line (scheduler and
    sparse_attention are not read: no effect)."""
    _check_amp(ch)
    _check_data_efficiency(ch)
    ck = ch.c.checkpoint
    if ck.s3_path is not None:
        path = ck.s3_path
        if not isinstance(path, str) or not path.startswith("s3://") or not path[5:].split("/")[0]:
            ch.fail("s3_path", f"{path!r} is not an S3 path; write s3://BUCKET/PREFIX")
        if not ck.save:
            ch.fail("s3_path", "nothing is saved to upload; set save (or remove s3_path)")


def _check_amp(ch: Any) -> None:
    pr = ch.c.precision
    if pr.amp is None:
        return
    if not isinstance(pr.amp, dict):
        ch.fail("amp", f"must be a mapping with 'enabled', got {pr.amp!r}")
    for k in pr.amp:
        if k not in AMP_USED + AMP_IGNORED:
            ch.fail("amp", f"unknown entry {k!r}{did_you_mean(k, AMP_USED + AMP_IGNORED)}", path=k)
    if "enabled" not in pr.amp:
        ch.fail("amp", "must contain 'enabled' (GPT-NeoX requires it)")
    level = amp_level(pr)
    if level is None:
        return
    if level == "O3":
        ch.fail(
            "amp",
            "opt_level O3 (fp16 weights without fp32 master weights) is not built; use O2, "
            "or precision: fp16",
            path="opt_level",
        )
    if level not in AMP_LEVELS:
        ch.fail("amp", f"opt_level {level!r} is not one of O0, O1, O2, O3", path="opt_level")
    fp16_on = bool(pr.fp16 and pr.fp16.get("enabled", False))
    bf16_on = bool(pr.bf16 and pr.bf16.get("enabled", False))
    if fp16_on or bf16_on or pr.precision in ("fp16", "bfloat16"):
        ch.fail(
            "amp",
            "is enabled together with fp16/bf16, which DeepSpeed refuses; enable one of them",
        )
    if pr.precision is not None:
        ch.fail("amp", f"decides the precision; remove precision {pr.precision!r} (or amp)")
    stage = (ch.c.optimizer.zero_optimization or {}).get("stage", 0)
    if isinstance(stage, int) and stage > 0:
        ch.fail(
            "amp",
            f"DeepSpeed refuses apex AMP with ZeRO (stage {stage}); use fp16.enabled instead "
            "(DeepSpeed's advice: it performs like amp O2)",
        )
    scale = pr.amp.get("loss_scale", "dynamic")
    value = number(scale)  # text such as 6.5e4 (a string to YAML) counts as the number
    if scale != "dynamic" and (value is None or value <= 0):
        ch.fail(
            "amp", f"loss_scale must be 'dynamic' or a number > 0, got {scale!r}", path="loss_scale"
        )
    if scale != "dynamic":
        pr.amp["loss_scale"] = value


def _check_data_efficiency(ch: Any) -> None:
    de = ch.c.deepspeed.data_efficiency
    if de is None:
        return
    name = "data_efficiency"
    if not isinstance(de, dict):
        ch.fail(name, f"must be a mapping, got {de!r}")
    _known(ch, de, DE_KEYS, "")
    if not de.get("enabled", False):
        return
    routing = de.get("data_routing") or {}
    if isinstance(routing, dict) and routing.get("enabled", False):
        ch.fail(
            name,
            "data_routing (random layerwise token dropping) is DeepSpeed-only: it swaps in "
            "DeepSpeed's random-LTD layers; disable data_routing",
            path="data_routing",
        )
    sampling = de.get("data_sampling") or {}
    if not isinstance(sampling, dict) or not sampling.get("enabled", False):
        return
    _known(ch, sampling, SAMPLING_KEYS, "data_sampling.")
    cur = sampling.get("curriculum_learning") or {}
    if not isinstance(cur, dict) or not cur.get("enabled", False):
        return
    metrics = cur.get("curriculum_metrics") or {}
    other = [m for m in metrics if m != SEQLEN_METRIC] if isinstance(metrics, dict) else metrics
    if other or not metrics:
        ch.fail(
            name,
            f"curriculum metric(s) {', '.join(map(str, other)) or '(none)'} are DeepSpeed-only "
            "(its data analyzer's index files and sampler); only seqlen_truncate, the "
            "sequence-length curriculum, is built",
            path="data_sampling.curriculum_learning.curriculum_metrics",
        )
    metric = metrics[SEQLEN_METRIC]
    for key, wanted in (("difficulty_type", "value"), ("clustering_type", "single_cluster")):
        if metric.get(key, wanted) != wanted:
            ch.fail(
                name,
                f"seqlen_truncate's {key} {metric[key]!r} needs DeepSpeed's data analyzer; "
                f"use {wanted}",
                path=f"data_sampling.curriculum_learning.curriculum_metrics.{SEQLEN_METRIC}.{key}",
            )


def _known(ch: Any, mapping: dict, allowed: tuple[str, ...], where: str) -> None:
    for k in mapping:
        if k not in allowed:
            ch.fail(
                "data_efficiency",
                f"unknown entry {where}{k}{did_you_mean(str(k), allowed)}",
                path=f"{where}{k}",
            )


def derive_deepspeed_dicts(cfg: Any, out: Derived) -> None:
    """explain's rows: where checkpoints are uploaded, what amp maps onto."""
    ck = cfg.checkpoint
    if ck.s3_path and ck.save:
        from os.path import abspath, basename

        where = f"{ck.s3_path.rstrip('/')}/{basename(abspath(ck.save))}/global_stepN/"
        out.put(
            "s3_upload",
            where,
            f"after each save rank 0 uploads the checkpoint there in the background, in parts of "
            f"{ck.s3_chunk_size:,} bytes (boto3; the AWS environment and AWS_ENDPOINT_URL); "
            "the run waits for the last upload at its end; a failed upload is reported and "
            "training goes on",
        )
    if "curriculum" in out.values and not (cfg.training.curriculum_learning or {}).get("enabled"):
        out.reasons["curriculum"] = (
            f"from data_efficiency's {SEQLEN_METRIC} metric; " + out.reasons["curriculum"]
        )
    level = amp_level(cfg.precision)
    if level is not None:
        why = AMP_LEVELS.get(level, level)
        if level in ("O1", "O2"):
            why += (
                f"; apex's loss scaling: dynamic from 2^{APEX_INITIAL_POWER}, doubled after "
                f"{APEX_WINDOW} clean steps, halved at each overflow"
                if cfg.precision.amp.get("loss_scale", "dynamic") == "dynamic"
                else f"; static loss scale {cfg.precision.amp['loss_scale']:g}"
            )
        out.put("amp", level, why)
    for k in (cfg.precision.amp or {}).keys() & set(AMP_IGNORED):
        out.no_effect[f"amp.{k}"] = "apex's own option; fp16 autocast runs as torchneox's fp16"
