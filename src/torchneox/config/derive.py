"""Every value torchneox computes from a config, each with the one-line reason for it.

``derive`` is the only place these rules live; ``config explain`` prints its result and the
trainer, the estimator and the launcher read it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from torchneox.base.errors import ConfigError
from torchneox.config.derivations.model import derive_model
from torchneox.config.derivations.precision import derive_precision
from torchneox.config.derivations.rl import derive_rollouts
from torchneox.config.derivations.unread import unread_keys
from torchneox.config.derived import Derived
from torchneox.config.features.curriculum import curriculum
from torchneox.config.features.deepspeed_dicts import derive_deepspeed_dicts
from torchneox.config.features.eight_bit import derive_eight_bit
from torchneox.config.features.offload import PIN_KEY, derive_offload, offload_notes
from torchneox.config.features.optimizer import describe_optimizer, optimizer_spec
from torchneox.config.features.replicas import derive_replicas
from torchneox.config.features.streaming import describe, split_paths, streams
from torchneox.config.fields import Status
from torchneox.config.layout import Layout, compile_scope
from torchneox.config.load import LoadedConfig
from torchneox.config.schema import KEYS, NeoXConfig
from torchneox.config.validate import (
    BF16_IGNORED,
    ZERO_KEYS,
    ZERO_OFFLOAD_KEYS,
    split_fractions,
)


def derive(
    loaded: LoadedConfig,
    world_size: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Derived:
    """All derived values of ``loaded``. Raises ConfigError for contradictions."""
    env = os.environ if env is None else env
    cfg, out = loaded.config, Derived()
    _layout(loaded, out, world_size, env)
    _batch(loaded, out)
    derive_replicas(cfg, out)
    out.put("compile", *compile_scope(cfg, Layout.from_derived(cfg, out)))
    derive_precision(cfg, out)
    _optimizer(loaded, out)
    _schedule(cfg, out)
    derive_model(loaded, out)
    derive_offload(cfg, out)
    _data(cfg, out)
    derive_rollouts(loaded, out)
    _launch(loaded, out)
    derive_deepspeed_dicts(cfg, out)
    _no_effect(loaded, out)
    unread_keys(loaded, out)
    return out


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """DeepSpeed's hostfile: 'HOST slots=N' per line, '#' comments."""
    hosts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = [p for p in parts[1:] if p.startswith("slots=")]
        if not slots or not slots[0][6:].isdigit():
            raise ConfigError(
                f"{path}:{number}: expected 'HOST slots=N', got {line!r}", key="hostfile"
            )
        hosts.append((parts[0], int(slots[0][6:])))
    return hosts


def _launch(loaded: LoadedConfig, out: Derived) -> None:
    """The torchrun command that runs this config where GPT-NeoX's launcher keys say."""
    lc = loaded.config.launcher
    files = " ".join(loaded.files)
    hosts: list[tuple[str, int]] = []
    if lc.hostfile and Path(lc.hostfile).is_file():
        hosts = read_hostfile(lc.hostfile)
    if hosts:
        if lc.num_nodes and lc.num_nodes > 0:
            hosts = hosts[: lc.num_nodes]
        nodes = len(hosts)
        gpus = min(lc.num_gpus or hosts[0][1], min(s for _, s in hosts))
        head = lc.master_addr or hosts[0][0]
        why = f"from hostfile {lc.hostfile}: {nodes} host(s) x {gpus} GPU(s); run it on every host"
    elif lc.num_gpus:
        nodes, gpus = max(lc.num_nodes, 1), lc.num_gpus
        head = lc.master_addr or "HEAD_NODE"
        why = f"from num_gpus {gpus} and num_nodes {lc.num_nodes}; run it on every node"
    else:
        return
    if nodes == 1:
        cmd = f"torchrun --standalone --nproc-per-node {gpus} -m torchneox train {files}"
    else:
        cmd = (
            f"torchrun --nnodes {nodes} --nproc-per-node {gpus} --rdzv-backend c10d "
            f"--rdzv-endpoint {head}:{lc.master_port} --rdzv-id torchneox -m torchneox train {files}"
        )
    out.put("launch", cmd, why)


# ------------------------------------------------------------------------------ layout


def _world_size(
    loaded: LoadedConfig, out: Derived, given: int | None, env: Mapping[str, str]
) -> int:
    cfg = loaded.config
    stages = max(cfg.parallel.pipe_parallel_size, 1)
    minimum = stages * cfg.parallel.model_parallel_size * cfg.parallel.context_parallel_size
    if given is not None:
        if given < 1:
            raise ConfigError(f"--world-size must be >= 1, got {given}")
        return out.put("world_size", given, f"{given}, from --world-size")
    if env.get("WORLD_SIZE"):
        n = int(env["WORLD_SIZE"])
        return out.put("world_size", n, f"{n}, from the launcher (WORLD_SIZE)")
    for name in ("world_size", "global_num_gpus"):
        value = cfg.get(name)
        if value:
            return out.put("world_size", value, f"{value}, from {name} in {loaded.source(name)}")
    launcher = cfg.launcher
    if launcher.num_gpus and launcher.num_nodes and launcher.num_nodes > 0:
        n = launcher.num_gpus * launcher.num_nodes
        return out.put(
            "world_size", n, f"{n} = num_gpus {launcher.num_gpus} x num_nodes {launcher.num_nodes}"
        )
    return out.put(
        "world_size",
        minimum,
        f"{minimum}: not given (--world-size or a launcher), so the smallest world the layout "
        f"needs, pipeline stages {stages} x model_parallel_size {cfg.parallel.model_parallel_size}"
        + _context_factor(cfg.parallel.context_parallel_size),
    )


def _context_factor(cp: int) -> str:
    return f" x context_parallel_size {cp}" if cp > 1 else ""


def _layout(loaded: LoadedConfig, out: Derived, given: int | None, env: Mapping[str, str]) -> None:
    cfg = loaded.config
    p = cfg.parallel
    world = _world_size(loaded, out, given, env)
    pp, mp, cp = p.pipe_parallel_size, p.model_parallel_size, p.context_parallel_size
    stages = max(pp, 1)
    if world % (stages * mp * cp):
        key = (
            "context_parallel_size"
            if cp > 1
            else "model_parallel_size"
            if mp > 1
            else "pipe_parallel_size"
        )
        raise ConfigError(
            f"world size {world} is not divisible by pipeline stages {stages} x "
            f"model_parallel_size {mp}{_context_factor(cp)} = {stages * mp * cp}; data-parallel "
            "ranks must fill the layout",
            source=loaded.source(key),
            key=key,
        )
    dp = world // (stages * mp * cp)
    out.put(
        "pipe_parallel_size",
        pp,
        f"{pp}, as given" if loaded.given("pipe_parallel_size") else "0, the default",
    )
    out.put("pipeline_stages", stages, f"{stages} = max(pipe_parallel_size, 1)")
    _pipeline(loaded, out)
    out.put(
        "model_parallel_size",
        mp,
        f"{mp} tensor-parallel ranks split every layer" if mp > 1 else "1: layers are not split",
    )
    out.put(
        "context_parallel_size",
        cp,
        f"{cp} ranks split every sample's sequence into {2 * cp} chunks, two each (the first and "
        "the last pair up, so every rank gets as much causal attention work); each attention "
        "layer gathers the whole sequence's keys and values"
        if cp > 1
        else "1: every rank holds whole sequences",
    )
    out.put(
        "data_parallel_size",
        dp,
        f"{dp} = world size {world} / (pipeline stages {stages} x model_parallel_size {mp}"
        f"{_context_factor(cp)})",
    )
    _zero(cfg, out, mp, dp)
    backend = "nccl on GPU, gloo on CPU"
    if loaded.given("distributed_backend"):
        backend = f"{p.distributed_backend} on GPU (as given), gloo on CPU"
    out.put("distributed_backend", backend, "chosen from the device the run finds")


def _pipeline(loaded: LoadedConfig, out: Derived) -> None:
    """Whether a pipeline schedule runs (pipe_parallel_size is the number of stages), and which."""
    p = loaded.config.parallel
    pp = p.pipe_parallel_size
    runs = pp >= 2
    if runs:
        why = (
            f"pipe_parallel_size {pp} >= 2: the model is split into {pp} stages run by the "
            f"'{p.pipeline_schedule}' schedule (torch.distributed.pipelining)"
        )
    elif pp == 1:
        why = (
            "pipe_parallel_size 1 means one stage, so the model runs as a plain module with no "
            "pipeline schedule. GPT-NeoX sends 1 through DeepSpeed's PipelineEngine although its own "
            "comment says 0 and 1 both avoid it; here 0 and 1 run the same way and write the same "
            "checkpoints"
        )
    else:
        why = "pipe_parallel_size 0: one stage, run as a plain module with no pipeline schedule"
    out.put("pipeline_schedule_runs", runs, why)
    out.put(
        "pipeline_schedule",
        p.pipeline_schedule if runs else None,
        f"'{p.pipeline_schedule}'" + (" (default)" if not loaded.given("pipeline_schedule") else "")
        if runs
        else "none: a single stage needs no schedule",
    )


def _zero(cfg: NeoXConfig, out: Derived, mp: int, dp: int) -> None:
    zero = (cfg.optimizer.zero_optimization or {}).get("stage", 0)
    zero_what = {
        0: "gradients all-reduced, every rank keeps full optimizer state (DDP)",
        1: "optimizer state sharded over data-parallel ranks (FSDP2, parameters kept gathered)",
        2: "gradients and optimizer state sharded (FSDP2, parameters kept gathered)",
        3: "parameters, gradients and optimizer state sharded, parameters regathered per layer (FSDP2)",
    }[zero]
    why = f"{zero}, from zero_optimization.stage: {zero_what}"
    if zero == 0 and mp > 1 and dp > 1:
        why += "; with tensor parallelism it runs as stage 2 (DDP takes no DTensor parameters), with the same results"
    shard = (cfg.optimizer.zero_optimization or {}).get("mics_shard_size")
    if zero and isinstance(shard, int) and 0 < shard < dp and not dp % shard:
        why += (
            f"; hybrid sharding (mics_shard_size {shard}): sharded within {dp // shard} groups "
            f"of {shard} data-parallel ranks, replicated across them (FSDP2 HSDP)"
        )
    out.put("zero_stage", zero, why)


# ------------------------------------------------------------------------------- batch


def _batch(loaded: LoadedConfig, out: Derived) -> None:
    t = loaded.config.training
    dp = out["data_parallel_size"]
    tbs = t.train_batch_size if loaded.given("train_batch_size") else None
    mb = t.train_micro_batch_size_per_gpu
    if mb is None and t.batch_size is not None:
        mb = t.batch_size
    gas = t.gradient_accumulation_steps if loaded.given("gradient_accumulation_steps") else None
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    if tbs is None and mb is None:
        for name in names:
            out.put(name, None, "unknown: give train_micro_batch_size_per_gpu or train_batch_size")
        return
    tbs, mb, gas, how = _batch_triple(loaded, tbs, mb, gas, dp)
    for name, value, reason in zip(names, (tbs, mb, gas), how, strict=True):
        if reason == "given":
            reason = f"{value}, as given"
        out.put(name, value, reason)
    _pipeline_micro_batches(loaded, out, gas)
    seq = loaded.config.model.seq_length
    if seq:
        out.put(
            "tokens_per_step",
            tbs * seq,
            f"{tbs * seq:,} = train_batch_size {tbs} x seq_length {seq}",
        )
    if t.train_epochs is not None:  # counted from the data by data/epochs.py
        how = loaded.source("train_iters") if t.train_iters else "counted from the data at train"
        out.put("train_iters", t.train_iters, how)
    if (cur := curriculum(loaded.config)) is not None:
        why = "each training step's samples cut to it, from step 1; evaluation sees seq_length"
        out.put("curriculum", cur.describe(), why)


def _batch_triple(
    loaded: LoadedConfig, tbs: int | None, mb: int | None, gas: int | None, dp: int
) -> tuple[int, int, int, tuple[str, str, str]]:
    """train_batch_size = micro-batch x gradient_accumulation_steps x data-parallel size: the
    one missing from the given ones, and how each was found ("given" or the arithmetic)."""

    def error(message: str) -> ConfigError:
        return ConfigError(
            message, source=loaded.source("train_batch_size"), key="train_batch_size"
        )

    if tbs is not None and mb is not None and gas is not None:
        if tbs != mb * gas * dp:
            raise error(
                f"{tbs} != train_micro_batch_size_per_gpu {mb} x gradient_accumulation_steps {gas} "
                f"x data-parallel size {dp} = {mb * gas * dp}; fix one, or leave one out to derive it"
            )
        how = ("given", "given", "given")
    elif tbs is not None and mb is not None:
        if tbs % (mb * dp):
            raise error(
                f"{tbs} is not divisible by train_micro_batch_size_per_gpu {mb} x data-parallel "
                f"size {dp} = {mb * dp}, so gradient_accumulation_steps would not be whole"
            )
        gas = tbs // (mb * dp)
        how = ("given", "given", f"{gas} = {tbs} / ({mb} x data-parallel {dp})")
    elif tbs is not None:
        gas = gas or 1
        if tbs % (gas * dp):
            raise error(
                f"{tbs} is not divisible by gradient_accumulation_steps {gas} x data-parallel "
                f"size {dp} = {gas * dp}, so the micro-batch would not be whole"
            )
        mb = tbs // (gas * dp)
        gas_how = "given" if loaded.given("gradient_accumulation_steps") else "1, the default"
        how = ("given", f"{mb} = {tbs} / ({gas} x data-parallel {dp})", gas_how)
    else:
        assert mb is not None
        gas_how = "given" if gas is not None else "1, the default"
        gas = gas or 1
        tbs = mb * gas * dp
        how = (f"{tbs} = {mb} x {gas} x data-parallel {dp}", "given", gas_how)
    return tbs, mb, gas, how


def _pipeline_micro_batches(loaded: LoadedConfig, out: Derived, gas: int) -> None:
    """The default 1f1b schedule needs a micro-batch per stage: with fewer, gpipe runs (the
    limits of a schedule given explicitly are config/layout.py's)."""
    if not out["pipeline_schedule_runs"]:
        return
    p = loaded.config.parallel
    stages = p.pipe_parallel_size
    if p.pipeline_schedule == "1f1b" and gas < stages and not loaded.given("pipeline_schedule"):
        out.put(
            "pipeline_schedule",
            "gpipe",
            f"'gpipe': the default 1f1b needs a micro-batch per stage ({stages}) and "
            f"gradient_accumulation_steps is {gas}; with so few the two run the same way",
        )


# --------------------------------------------------------------------------- optimizer


def _refuse_another_optimizer_type(loaded: LoadedConfig, built: str) -> None:
    """optimizer_type given as another optimizer than the optimizer dict builds: GPT-NeoX
    derives the key from the dict (Adam without one), so the value asked for would silently
    not run."""
    asked = loaded.config.optimizer.optimizer_type
    if loaded.given("optimizer_type") and asked != built:
        raise ConfigError(
            f"{asked} would not run: the optimizer dict gives the optimizer ({built}; adam when "
            "there is none), as GPT-NeoX derives optimizer_type from it; write optimizer: "
            f"{{type: {asked}, params: {{lr: ...}}}} instead",
            source=loaded.source("optimizer_type"),
            key="optimizer_type",
        )


def _optimizer(loaded: LoadedConfig, out: Derived) -> None:
    o = loaded.config.optimizer
    spec = optimizer_spec(loaded.config.optimizer)
    params = spec.params
    if spec.type_name is None:
        out.put("optimizer_type", "adam", "adam: no optimizer dict given, GPT-NeoX's default")
    else:
        out.put("optimizer_type", spec.kind, f"from optimizer.type {spec.type_name!r}")
    _refuse_another_optimizer_type(loaded, out["optimizer_type"])
    if "lr" in params:
        out.put("lr", params["lr"], f"{params['lr']:g}, from optimizer.params.lr")
    elif o.lr is not None:
        out.put("lr", o.lr, f"{o.lr:g}, from lr")
    else:
        out.put("lr", None, "unknown: give optimizer.params.lr")
    decay = o.weight_decay
    why = f"{decay:g} on weight matrices, none on biases and norm weights"
    if "weight_decay" in params and params["weight_decay"] != decay:
        why += (
            f" (optimizer.params.weight_decay {params['weight_decay']:g} is overridden by "
            "weight_decay, as GPT-NeoX does)"
        )
    out.put("weight_decay", decay, why)
    if out["optimizer_type"] == "adam":
        out.reasons["optimizer_type"] += (
            "; runs as AdamW (decoupled weight decay), as GPT-NeoX does"
        )
    elif spec.kind in ("sm3", "madgrad_wd", "lamb", "cpu_adam", "cpu_torch_adam", "muon"):
        out.reasons["optimizer_type"] += "; " + describe_optimizer(spec)
        if spec.kind == "sm3":
            out.reasons["weight_decay"] = f"{decay:g}, unused: SM3 takes no weight decay"
    derive_eight_bit(loaded.config, out)
    clip = o.gradient_clipping
    if loaded.given("clip_grad") and not loaded.given("gradient_clipping"):
        clip = o.clip_grad
    out.put(
        "gradient_clipping", clip, f"clip to global norm {clip:g}" if clip else "0: no clipping"
    )


def _schedule(cfg: NeoXConfig, out: Derived) -> None:
    lr, t = cfg.lr, cfg.training
    if t.train_iters is None:
        out.put("lr_decay_iters", None, "unknown: train_iters is not set")
        return
    # GPT-NeoX's order: lr_decay_iters, then lr_decay_fraction, then train_iters; at least 1
    if lr.lr_decay_iters is not None:
        iters, why = max(1, lr.lr_decay_iters), f"{lr.lr_decay_iters}, as given"
        if lr.lr_decay_fraction is not None:
            why += " (it wins over lr_decay_fraction, as in GPT-NeoX)"
    elif lr.lr_decay_fraction is not None:
        iters = max(1, math.floor(t.train_iters * lr.lr_decay_fraction))
        why = f"{iters} = train_iters {t.train_iters} x lr_decay_fraction {lr.lr_decay_fraction}"
    else:
        iters, why = max(1, t.train_iters), f"{t.train_iters}, defaults to train_iters"
    out.put("lr_decay_iters", iters, why)
    warm = lr.warmup * iters
    why = f"{warm:g} = warmup {lr.warmup} x lr_decay_iters {iters}"
    if 0 < warm < 1:
        steep = (
            f"less than one step, so the first update uses lr / {warm:g} = {1 / warm:.3g} x "
            "lr (GPT-NeoX's formula, max(1, step) / warmup); raise warmup or set it to 0"
        )
        why += f"; {steep}"
        out.notes.append(f"warmup of {warm:g} steps is {steep}")
    out.put("warmup_iters", warm, why)
    peak = out.get("lr")
    shape = {
        "constant": "stays at the peak",
        "linear": "falls linearly",
        "cosine": "follows a half cosine",
        "exponential": "decays exponentially",
        "wsd": (
            f"holds the peak, then (the last {lr.wsd_decay_ratio:g} of the steps after "
            "warmup) follows a half cosine"
        ),
        "infinite_cosine": (
            f"cools down along a half cosine to constant_lr {lr.constant_lr:g} over "
            f"{lr.cooldown_iters_perc:g} of the steps, holds it for {lr.constant_iters_perc:g}, "
            "then decays exponentially"
        ),
        "infinite_inv_sqrt": (
            f"cools down as 1/sqrt(1 + {lr.timescale:g} t) to constant_lr {lr.constant_lr:g} "
            f"over {lr.cooldown_iters_perc:g} of the steps, holds it for "
            f"{lr.constant_iters_perc:g}, then decays exponentially"
        ),
    }[lr.lr_decay_style]
    out.put(
        "lr_schedule",
        lr.lr_decay_style,
        f"after warmup the rate {shape} "
        + (
            ""
            if lr.lr_decay_style.startswith("infinite_")
            else f"from {peak if peak is not None else 'the peak'} "
        )
        + f"to min_lr {lr.min_lr:g} by step {iters}",
    )


def _data(cfg: NeoXConfig, out: Derived) -> None:
    d = cfg.data
    if cfg.training.train_impl == "reinforce":
        out.put("data", "rollouts", "none read: reinforce trains on its rollouts (below)")
    elif d.data_path:
        fractions = split_fractions(d.split)
        parts = ", ".join(
            f"{name} {f:.1%}" for name, f in zip(("train", "valid", "test"), fractions, strict=True)
        )
        held = " (streamed: each by a hash of its file and line or row)" if streams(d) else ""
        out.put("data", d.data_path, f"one dataset split by documents '{d.split}'{held}: {parts}")
    elif d.train_data_paths:
        n = len(d.train_data_paths)
        how = (
            "by document counts"
            if d.weight_by_num_documents
            else ("by train_data_weights" if d.train_data_weights else "equally")
        )
        out.put("data", d.train_data_paths, f"{n} training dataset(s), blended {how}")
    else:
        out.put("data", None, "no data_path or train_data_paths given")
    if streams(d) and cfg.training.train_impl != "reinforce":
        for split in ("train", "valid", "test"):
            for i, path in enumerate(split_paths(d, split)):
                if d.data_path and split != "train":
                    break  # data_path: one source, its documents held out by hash
                out.put(f"data source {split} {i}", path, describe(path, d))
    if (
        d.pack_impl == "unpacked"
        and d.train_data_paths
        and not d.train_label_data_paths
        and cfg.training.train_impl in ("normal", "kto")
    ):
        out.notes.append(
            "pack_impl unpacked without label datasets: each sample is padded with token 0, "
            "and the padding counts in the loss as in GPT-NeoX (its labels are the shifted "
            "tokens); give train_label_data_paths (preprocess --chat writes them) to leave it out"
        )


# ---------------------------------------------------------------------------- notes


def _no_effect(loaded: LoadedConfig, out: Derived) -> None:
    cfg = loaded.config
    for name in loaded.origin:
        spec = KEYS.get(name)
        if spec is None:
            continue
        value = cfg.get(name)
        if spec.info.status is Status.NO_EFFECT and value != spec.default:
            out.no_effect[name] = spec.info.why
        elif spec.info.status is Status.DERIVED and name not in (
            "padded_vocab_size",
            "world_size",
            "global_num_gpus",
        ):
            out.no_effect[name] = "GPT-NeoX sets this at launch; torchneox derives its own value"
    for sub in (cfg.precision.bf16 or {}).keys() & set(BF16_IGNORED):
        out.no_effect[f"bf16.{sub}"] = "DeepSpeed reads it for fp16 only; bf16 has no loss scale"
    for sub in cfg.optimizer.zero_optimization or {}:
        if sub in (*ZERO_OFFLOAD_KEYS, PIN_KEY):
            continue  # offload: explained by zero_offload (its NVMe-only entries noted below)
        if sub not in ("stage", "mics_shard_size") and sub in ZERO_KEYS:
            out.no_effect[f"zero_optimization.{sub}"] = (
                "DeepSpeed ZeRO tuning; FSDP2 sizes its own communication"
            )
    out.no_effect |= offload_notes(cfg.optimizer.zero_optimization)
    params = (cfg.optimizer.optimizer or {}).get("params") or {}
    if "max_grad_norm" in params:
        out.no_effect["optimizer.params.max_grad_norm"] = "clipping comes from gradient_clipping"
    situational = {
        "sequence_parallel": (
            cfg.parallel.sequence_parallel and cfg.parallel.model_parallel_size == 1,
            "it needs model_parallel_size > 1",
        ),
        "rotary_pct": (
            cfg.model.pos_emb != "rotary" and loaded.given("rotary_pct"),
            "pos_emb is not rotary",
        ),
        "pipeline_schedule": (
            not out["pipeline_schedule_runs"] and loaded.given("pipeline_schedule"),
            "no schedule runs with fewer than 2 pipeline stages",
        ),
        "checkpoint_num_layers": (
            not cfg.training.checkpoint_activations and loaded.given("checkpoint_num_layers"),
            "checkpoint_activations is false",
        ),
        "checkpoint_activations_mode": (
            not cfg.training.checkpoint_activations and loaded.given("checkpoint_activations_mode"),
            "checkpoint_activations is false",
        ),
        "moe_top_k": (
            cfg.moe.moe_num_experts == 1 and loaded.given("moe_top_k"),
            "moe_num_experts is 1",
        ),
    }
    for name, (applies, why) in situational.items():
        if applies:
            out.no_effect[name] = why
