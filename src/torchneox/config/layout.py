"""The run's parallel layout, typed and derived once, and every rule a layout must keep.

``Layout.from_derived`` reads the sizes ``derive`` computed; ``check_layout`` holds every
rule about which layouts run (the refusals of config/refusals.py's table beside an axis,
context parallelism's divisibility of the sequence, what
an explicit pipeline schedule needs, how experts split). ``train`` (and ``train --nproc``
before it starts any process), ``estimate`` (for the layout given and for each alternative it
proposes) and ``config explain`` call it; the parallel code builds from a checked layout and
repeats none of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchneox.base.errors import ConfigError
from torchneox.config import sizes
from torchneox.config.checker import source_of
from torchneox.config.checks.ft import require_replicas
from torchneox.config.checks.model import layer_attention_types
from torchneox.config.derived import Derived
from torchneox.config.features.offload import offload_spec
from torchneox.config.features.sparsity import ATTENTION_LAYER_TYPES
from torchneox.config.load import LoadedConfig
from torchneox.config.refusals import refusal
from torchneox.config.schema import NeoXConfig
from torchneox.config.sizes import rwkv_widths

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""Pipeline schedules that run one stage per rank; the others run several."""

# the config key each layout field comes from, for the changes an estimate proposes
KEYS = {
    "tp": "model_parallel_size",
    "pp": "pipe_parallel_size",
    "zero": "zero_optimization.stage",
    "micro_batch": "train_micro_batch_size_per_gpu",
    "checkpoint": "checkpoint_activations",
    "dp_shard": "zero_optimization.mics_shard_size",
    "cp": "context_parallel_size",
}


@dataclass(frozen=True)
class Layout:
    """How a run's processes split the work. ``gpus``: every process (GPUs, or CPU processes)."""

    gpus: int
    dp: int
    tp: int
    pp: int
    zero: int
    micro_batch: int | None
    gas: int | None
    checkpoint: str  # none | full | selective
    every: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # the pipeline schedule (what runs only when pp >= 2)
    ep: int = 1  # expert parallelism: experts split over this many data-parallel ranks
    virtual_stages: int = 1
    dp_shard: int | None = None
    """Hybrid sharding (zero_optimization.mics_shard_size): ZeRO shards within groups of this
    many data-parallel ranks, replicated across the groups; None: over all of them."""
    cp: int = 1
    """Context parallelism: the ranks that split each sample's sequence (beside dp, tp, pp)."""
    partition_method: str = "parameters"
    """How the layers are cut into pipeline stages (pipe_partition_method)."""
    offload: bool = False
    """ZeRO-Offload (config/features/offload.py): FSDP2 keeps the shards and optimizer in host memory."""

    @property
    def shard_ranks(self) -> int:
        """The data-parallel ranks one ZeRO shard group spans."""
        return self.dp_shard or self.dp

    @property
    def hybrid(self) -> bool:
        return self.dp_shard is not None and self.dp_shard < self.dp

    @classmethod
    def from_derived(cls, cfg: NeoXConfig, derived: Derived) -> Layout:
        d, t = derived, cfg.training
        tp, cp = d["model_parallel_size"], d["context_parallel_size"]
        return cls(
            gpus=d["data_parallel_size"] * tp * d["pipeline_stages"] * cp,
            dp=d["data_parallel_size"],
            tp=tp,
            pp=d["pipeline_stages"],
            zero=d["zero_stage"],
            micro_batch=d["train_micro_batch_size_per_gpu"],
            gas=d["gradient_accumulation_steps"],
            checkpoint=t.checkpoint_activations_mode if t.checkpoint_activations else "none",
            every=t.checkpoint_num_layers,
            sequence_parallel=cfg.parallel.sequence_parallel and tp > 1,
            schedule=d["pipeline_schedule"] or "1f1b",
            ep=cfg.moe.expert_parallel_size,
            virtual_stages=cfg.parallel.pipeline_virtual_stages,
            dp_shard=(cfg.optimizer.zero_optimization or {}).get("mics_shard_size"),
            cp=cp,
            partition_method=cfg.parallel.pipe_partition_method,
            offload=d.get("zero_offload") == "cpu",
        )

    @property
    def stages_per_rank(self) -> int:
        if self.schedule == "zbv":
            return 2
        return 1 if self.schedule in SINGLE_STAGE_SCHEDULES else self.virtual_stages

    @property
    def total_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def changes_from(self, other: Layout) -> dict[str, Any]:
        """The config keys (and values) that turn ``other`` into this layout."""
        out = {
            key: getattr(self, f)
            for f, key in KEYS.items()
            if getattr(self, f) != getattr(other, f)
        }
        if "checkpoint_activations" in out:
            mode = out.pop("checkpoint_activations")
            out["checkpoint_activations"] = mode != "none"
            if mode != "none":
                out["checkpoint_activations_mode"] = mode
        return out


def _refuse(message: str, key: str, cause: str, path: str | None = None) -> ConfigError:
    """A broken rule: ``key`` is what to change, ``cause`` the layout key that makes it fail
    (the file named is the one that set ``key``, else the one that set ``cause``; ``path``: the
    entry of ``key`` meant, so that a ``--set key.entry=...`` is named rather than the file)."""
    error = ConfigError(message, key=key)
    error.cause, error.path = cause, path
    return error


def layout_problem(cfg: NeoXConfig, layout: Layout) -> ConfigError | None:
    """The first rule ``layout`` breaks for ``cfg``'s model, as the error to raise, or None."""
    for rule in RULES:
        problem = rule(cfg, layout)
        if problem is not None:
            return problem
    return None


def check_layout(loaded: LoadedConfig, layout: Layout) -> None:
    """Raise the first rule ``layout`` breaks: one line naming the file, the key and what to
    do."""
    problem = layout_problem(loaded.config, layout)
    if problem is not None:
        given = [k for k in (problem.key, getattr(problem, "cause", None)) if loaded.given(k)]
        path = getattr(problem, "path", None) if given and given[0] == problem.key else None
        source = source_of(loaded.origin, given[0], path) if given else None
        raise ConfigError(problem.message, source=source, key=problem.key)


def _whole_heads(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    m = cfg.model
    for name, heads in (
        ("num_attention_heads", m.num_attention_heads),
        ("num_kv_heads", m.num_kv_heads),
    ):
        if heads and heads % lay.tp:
            return _refuse(
                f"{lay.tp} does not divide {name} {heads}; tensor parallelism splits whole heads",
                key="model_parallel_size",
                cause="model_parallel_size",
            )
    return _whole_mlp(cfg, lay)


def _whole_mlp(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    """A dense MLP's width splits evenly over the tensor ranks (MoE experts stay whole)."""
    m = cfg.model
    if lay.tp == 1 or not m.hidden_size or not m.num_layers:
        return None
    types = layer_attention_types(cfg)
    dense = [
        i
        for i, kind in enumerate(types)
        if kind in ATTENTION_LAYER_TYPES and not sizes.is_moe_layer(cfg.moe, i)
    ]
    width = sizes.mlp_widths(m).down
    if dense and width % lay.tp:
        return _refuse(
            f"{lay.tp} does not divide the MLP width {width} of layer {dense[0]}; tensor "
            "parallelism splits it evenly (set intermediate_size or mlp_multiple_of)",
            key="model_parallel_size",
            cause="intermediate_size",
        )
    return None


ZERO_BUBBLE = ("zbv", "interleaved_zero_bubble")


def _multi_token(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    """The zero-bubble schedules split a stage's backward in two (torch.distributed.pipelining's
    input and weight halves); the second depth's MTP module, or a tied head after the first,
    breaks that split."""
    depth = cfg.model.mtp_num_layers or 0
    tied = not cfg.model.no_weight_tying
    if depth > int(not tied) and lay.pp > 1 and lay.schedule in ZERO_BUBBLE:
        fix = "no_weight_tying: true" if depth == 1 else "mtp_num_layers: 1"
        return _refuse(
            f"{depth} with pipeline_schedule {lay.schedule}{' and tied embeddings' * tied}: "
            f"multi-token prediction {refusal('mtp', 'pp2 zbv')}; use {fix}, or another "
            "pipeline_schedule",
            key="mtp_num_layers",
            cause="pipeline_schedule",
        )
    return None


def _hybrid_sharding(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    size = lay.dp_shard
    if size is None:
        return None
    key = "zero_optimization"
    if lay.zero == 0:
        return _refuse(
            "mics_shard_size (hybrid sharding) shards ZeRO's state: it needs stage 1, 2 or 3",
            key=key,
            cause=key,
            path="mics_shard_size",
        )
    if lay.dp % size:
        return _refuse(
            f"mics_shard_size {size} must divide the data-parallel size {lay.dp} (each group "
            "of that many ranks holds one whole copy of the sharded state)",
            key=key,
            cause="model_parallel_size",
            path="mics_shard_size",
        )
    return None


def _pipeline(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    if lay.pp < 2:
        return None
    if cfg.model.num_layers and lay.total_stages > cfg.model.num_layers:
        return _refuse(
            f"{lay.total_stages} stages but only {cfg.model.num_layers} layers; each stage "
            "needs one",
            key="pipe_parallel_size",
            cause="pipe_parallel_size",
        )
    return _micro_batches(lay)


def _micro_batches(lay: Layout) -> ConfigError | None:
    """The schedules' own limits on the micro-batch count (``derive`` already fell back from
    the default 1f1b to gpipe where too few micro-batches would make 1f1b fail)."""
    if lay.gas is None:
        return None
    if lay.schedule == "1f1b" and lay.gas < lay.pp:
        problem = f"needs at least one micro-batch per stage ({lay.pp})"
    elif lay.stages_per_rank > 1 and lay.gas % lay.pp:
        problem = f"needs a multiple of pipe_parallel_size ({lay.pp}) micro-batches"
    else:
        return None
    return _refuse(
        f"{lay.gas} micro-batches per step, but pipeline_schedule {lay.schedule} {problem}; "
        "raise gradient_accumulation_steps or use pipeline_schedule: gpipe",
        key="gradient_accumulation_steps",
        cause="pipeline_schedule",
    )


def _experts(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    experts = cfg.moe.moe_num_experts
    if lay.ep > 1 and (lay.dp % lay.ep or experts <= 1 or experts % lay.ep):
        return _refuse(
            f"{lay.ep} must divide the data-parallel size {lay.dp} and moe_num_experts "
            f"{experts} (and the model needs MoE layers)",
            key="expert_parallel_size",
            cause="moe_num_experts",
        )
    return None


def _context_parallel(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    if lay.cp == 1:
        return None
    key, seq = "context_parallel_size", cfg.model.seq_length
    if seq and seq % (2 * lay.cp):
        return _refuse(
            f"seq_length {seq} must be a multiple of 2 x context_parallel_size = {2 * lay.cp} "
            "(each rank takes two equal chunks of every sequence)",
            key=key,
            cause="seq_length",
        )
    return None


def compile_scope(cfg: NeoXConfig, layout: Layout) -> tuple[str, str]:
    """What ``compile`` compiles in ``layout`` ('off', 'model' or 'blocks'), and why."""
    t = cfg.training
    if not t.compile:
        return "off", "compile is false"
    if t.compile_scope != "auto":
        return t.compile_scope, f"compile_scope {t.compile_scope}"
    splits = _splits_model(layout)
    if splits is None:
        return "model", "auto: one graph for the whole model (the layout does not split it)"
    return "blocks", f"auto: each block, because {splits} splits the model"


def _splits_model(lay: Layout) -> str | None:
    """The layout's part that wraps or splits the model below its top level, or None."""
    for name, splits in (
        ("tensor parallelism", lay.tp > 1),
        ("the pipeline", lay.pp > 1),
        ("expert parallelism", lay.ep > 1),
        ("context parallelism", lay.cp > 1),
        (f"ZeRO stage {lay.zero} (FSDP2, wrapped per block)", lay.zero > 0 and lay.dp > 1),
    ):
        if splits:
            return name
    return None


def _compile_model(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    t = cfg.training
    splits = _splits_model(lay)
    if not t.compile or t.compile_scope != "model" or splits is None:
        return None
    beside = {"tensor parallelism": "tp2", "the pipeline": "pp2", "expert parallelism": "ep2"}
    beside |= {"context parallelism": "cp2"}
    reason = refusal("whole-model compile", beside.get(splits, "zero3"))
    return _refuse(
        f"compile_scope model {reason} ({splits}); use compile_scope blocks (or auto)",
        key="compile_scope",
        cause="compile_scope",
    )


def _layer_families(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    """Every layer family runs under context parallelism (a sequential mixer runs over the
    gathered sequence, models/block.py); tensor parallelism splits each family's own way
    (parallel/families.py)."""
    if lay.tp == 1:
        return None
    kinds = set(layer_attention_types(cfg))
    ffn = rwkv_widths(cfg.model).ffn_dim if "rwkv" in kinds else 0
    if ffn % lay.tp:  # the time mix splits by heads (whole heads: _whole_heads)
        return _refuse(
            f"cannot split rwkv layers' channel mix of width {ffn} into {lay.tp} equal parts; "
            f"set intermediate_size to a multiple of {32 * lay.tp}",
            key="model_parallel_size",
            cause="attention_config",
        )
    return None


def offload_rule(cfg: NeoXConfig, lay: Layout) -> ConfigError | None:
    """The layouts offload runs in (a rule of config/layout.py): ZeRO 1-3 over the
    data-parallel ranks (one or more; hybrid sharding, tensor, pipeline, context and expert
    parallelism included)."""
    if not lay.offload:
        return None
    spec = offload_spec(cfg.optimizer.zero_optimization, cfg.optimizer.optimizer)
    first = spec.by[0] if spec.by else "offload_optimizer"
    key, path = (
        ("optimizer", "type") if first.startswith("optimizer.") else ("zero_optimization", first)
    )

    def refuse(message: str, cause: str) -> ConfigError:
        error = ConfigError(message, key=key)
        error.cause, error.path = cause, path
        return error

    if lay.zero == 0:
        return refuse(
            f"{first} (ZeRO-Offload) needs zero_optimization.stage 1, 2 or 3", "zero_optimization"
        )
    return None


RULES = (
    _layer_families,
    _whole_heads,
    _pipeline,
    _experts,
    _multi_token,
    _hybrid_sharding,
    _context_parallel,
    _compile_model,
    offload_rule,
)
"""Every layout rule, in the order they are checked."""


def require(loaded: LoadedConfig, derived: Derived) -> Layout:
    """What training needs beyond what `derive` checks, and the checked layout (`train --nproc`
    runs it before it starts any process)."""
    cfg = loaded.config
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters"):
        if cfg.get(name) is None and not (name == "train_iters" and cfg.training.train_epochs):
            raise ConfigError("training needs it; add it to a config file or --set it", key=name)
    if derived["train_batch_size"] is None:
        raise ConfigError(
            "training needs train_micro_batch_size_per_gpu or train_batch_size",
            key="train_micro_batch_size_per_gpu",
        )
    if derived["lr"] is None:
        raise ConfigError("training needs a learning rate (optimizer.params.lr)", key="optimizer")
    layout = Layout.from_derived(cfg, derived)
    check_layout(loaded, layout)
    require_replicas(cfg)
    return layout
