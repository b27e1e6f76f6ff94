"""``use_bnb_optimizer`` read once: whether Adam runs with 8-bit state, which library's
optimizer that is (bitsandbytes' Adam8bit where bitsandbytes is installed, else torchao's
AdamW8bit), which parameters keep 32-bit state and the bytes the state takes (explain, the
trainer and the estimator all read this).

Both libraries quantise each moment block-wise: one uint8 per value and one fp32 scale (the
block's absolute maximum) per ``BLOCK`` values; a tensor of fewer than ``MIN_8BIT`` values keeps
fp32 moments (torchao also keeps them for a tensor whose size is not a multiple of the block).
GPT-NeoX's StableEmbedding (the learned position embedding under use_bnb_optimizer) registers
its weight for 32-bit state."""

from __future__ import annotations

import importlib.util
import math

from torchneox.config.checker import Checker
from torchneox.config.derived import Derived
from torchneox.config.features.optimizer import optimizer_spec
from torchneox.config.refusals import refusal
from torchneox.config.schema import NeoXConfig, OptimizerConfig

BLOCK = 256
"""Values per absmax scale: bitsandbytes 0.50's Optimizer2State (older bitsandbytes releases
used blocks of 2048) and torchao's Adam8bit/AdamW8bit."""
MIN_8BIT = 4096
"""Tensors with fewer values keep fp32 moments (bitsandbytes' min_8bit_size, which torchao
follows)."""
QMAP_BYTES = 256 * 4
"""One quantisation map (256 fp32 code values): torchao keeps one per state tensor,
bitsandbytes one per optimizer for each moment (shared by every tensor)."""
STABLE_PARAMS = ("pos_embed.weight",)
"""StableEmbedding weights: 32-bit state whatever their size (bitsandbytes' GlobalOptimManager
override that StableEmbedding registers)."""
LIBRARIES = ("bitsandbytes", "torchao")
ADAM_KINDS = ("adam", "adamw")


def eight_bit(o: OptimizerConfig) -> bool:
    """Whether the optimizer runs with 8-bit state: use_bnb_optimizer with Adam (GPT-NeoX
    swaps Adam only; torchneox's AdamW is the same update, so it is swapped too)."""
    return bool(o.use_bnb_optimizer) and optimizer_spec(o).kind in ADAM_KINDS


def installed_library() -> str | None:
    """The library the trainer will try first at ZeRO 0 (found without importing it: explain
    stays fast); the trainer falls back to torchao if bitsandbytes does not import."""
    for name in LIBRARIES:
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def sharded(o: OptimizerConfig) -> bool:
    """Whether ZeRO 1-3 shards the parameters the optimizer steps (FSDP2's DTensors)."""
    return int((o.zero_optimization or {}).get("stage", 0) or 0) > 0


def dtensor_axis(cfg: NeoXConfig) -> str | None:
    """What makes the parameters the optimizer steps DTensors, which bitsandbytes' kernels
    cannot take (None: plain tensors, DDP's or one process's): ZeRO 1-3's shards, or tensor,
    pipeline or expert parallelism (FSDP2 wraps every tensor- or pipeline-parallel model; the
    experts are split as DTensors)."""
    p = cfg.parallel
    for axis, on in (
        ("ZeRO 1-3", sharded(cfg.optimizer)),
        ("tensor parallelism", p.model_parallel_size > 1),
        ("pipeline parallelism", p.pipe_parallel_size > 1),
        ("expert parallelism", cfg.moe.expert_parallel_size > 1),
    ):
        if on:
            return axis
    return None


def library_for(o: OptimizerConfig, dtensors: bool | None = None) -> str | None:
    """The library whose 8-bit Adam a run with ``o`` steps: over plain tensors (ZeRO 0 alone,
    or with context parallelism) the installed one (bitsandbytes first, as GPT-NeoX); over
    DTensors (``dtensors``; by default ZeRO 1-3's) torchao, whose AdamW8bit steps each rank's
    part block by block; bitsandbytes' kernels cannot take a DTensor. None: the one it needs
    is not installed."""
    if not (sharded(o) if dtensors is None else dtensors):
        return installed_library()
    return "torchao" if importlib.util.find_spec("torchao") is not None else None


def keeps_32bit(library: str, name: str, numel: int) -> bool:
    """Whether the tensor ``name`` of ``numel`` values (this rank's) keeps fp32 moments."""
    if name.endswith(STABLE_PARAMS) or numel < MIN_8BIT:
        return True
    return library == "torchao" and numel % BLOCK != 0


def state_bytes(library: str, name: str, numel: int) -> int:
    """Bytes of Adam's two moments for one tensor: 8 per value in fp32; quantised, 1 per value
    and moment plus one fp32 scale per block and moment (torchao adds its two maps)."""
    if keeps_32bit(library, name, numel):
        return 8 * numel
    maps = 2 * QMAP_BYTES if library == "torchao" else 0
    return 2 * numel + 2 * 4 * math.ceil(numel / BLOCK) + maps


def eight_bit_optimizer_bytes(library: str, tensors: list[tuple[str, int]]) -> int:
    """Bytes of the state of an optimizer over ``tensors`` (name, values): each tensor's, and
    the two maps bitsandbytes keeps once (shared by its quantised tensors)."""
    total = sum(state_bytes(library, name, n) for name, n in tensors)
    quantised = any(not keeps_32bit(library, name, n) for name, n in tensors)
    return total + (2 * QMAP_BYTES if library == "bitsandbytes" and quantised else 0)


def describe(cfg: NeoXConfig) -> str:
    """What use_bnb_optimizer does to the optimizer (config explain)."""
    o = cfg.optimizer
    if not o.use_bnb_optimizer:
        return "off: use_bnb_optimizer is not set; Adam keeps fp32 moments"
    kind = optimizer_spec(o).kind
    if kind not in ADAM_KINDS:
        return (
            f"off: use_bnb_optimizer swaps Adam only (as GPT-NeoX does); {kind} keeps its own "
            "state (learned position embeddings still become StableEmbedding)"
        )
    axis = dtensor_axis(cfg)
    library = library_for(o, axis is not None)
    if library is None:
        return "none: neither bitsandbytes nor torchao is installed (pip install torchneox[bnb])"
    if axis is not None:
        return (
            f"torchao's AdamW8bit ({axis}: it takes the DTensor parameters, which bitsandbytes' "
            f"kernels cannot): moments in uint8 with one fp32 absmax per {BLOCK} values of each "
            f"rank's part; parts under {MIN_8BIT} values or not whole blocks and StableEmbedding "
            "weights keep fp32 moments; decoupled weight decay as GPT-NeoX's Adam"
        )
    rule = (
        f"moments in uint8 with one fp32 absmax per {BLOCK} values; tensors under "
        f"{MIN_8BIT} values and StableEmbedding weights keep fp32 moments; decoupled weight "
        "decay as GPT-NeoX's Adam"
    )
    if library == "bitsandbytes":
        return (
            f"bitsandbytes' Adam8bit (bitsandbytes is installed; else torchao's AdamW8bit): {rule}"
        )
    return f"torchao's AdamW8bit (bitsandbytes is not installed): {rule}"


def check_eight_bit(ch: Checker) -> None:
    """What 8-bit Adam cannot run with (validate)."""
    o = ch.c.optimizer
    if eight_bit(o) and optimizer_spec(o).params.get("amsgrad"):
        ch.fail(
            "use_bnb_optimizer",
            "8-bit Adam has no amsgrad (bitsandbytes' Adam8bit refuses it): drop "
            "optimizer.params.amsgrad or use_bnb_optimizer",
        )
    if o.use_bnb_optimizer and ch.c.training.use_mup:
        ch.fail(
            "use_bnb_optimizer",
            f"8-bit Adam with use_mup {refusal('8-bit adam', 'mup')}: choose one of the two",
        )


def derive_eight_bit(cfg: NeoXConfig, out: Derived) -> None:
    """explain's lines: the optimizer's state and the position embedding."""
    o = cfg.optimizer
    if not o.use_bnb_optimizer:
        return
    library = library_for(o, dtensor_axis(cfg) is not None) if eight_bit(o) else None
    why = describe(cfg)
    if cfg.model.pos_emb != "learned":
        why += f"; pos_emb {cfg.model.pos_emb}: no position table to make a StableEmbedding"
    out.put("eight_bit_adam", library or "off", why)
    if cfg.model.pos_emb == "learned":
        out.put(
            "position_embedding",
            "StableEmbedding",
            "use_bnb_optimizer: learned positions through StableEmbedding, as GPT-NeoX's "
            "bnb.nn.StableEmbedding: the lookup, then a LayerNorm in fp32 "
            "(pos_embed.norm), its weight with fp32 Adam state",
        )
