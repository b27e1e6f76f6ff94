"""Activation memory from tracing the real model's forward (and loss) on fake tensors: no
memory, no compute, only what autograd saves for backward, per layer and for the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from torchneox.config.checks.model import layer_attention_types
from torchneox.config.features.sparsity import ATTENTION_LAYER_TYPES
from torchneox.config.load import LoadedConfig
from torchneox.estimate.parameters import PARAM_BYTES, meta_model
from torchneox.models.moe import LocalTokenDispatcher


@dataclass
class Trace:
    """Bytes autograd saves, per sample (they grow with the micro-batch) and per micro-batch
    (the low-precision copies of the weights autocast makes), for one layer and the rest."""

    layer_replicated: float = 0.0  # hidden-wide tensors (norms, residual): not split by tp
    layer_split: float = 0.0  # heads, MLP width, vocabulary: split by tp
    layer_kept: float = 0.0  # outputs of what selective checkpointing keeps
    layer_input: float = 0.0
    rest_replicated: float = 0.0
    rest_split: float = 0.0
    layer_weights: float = 0.0  # per micro-batch: autocast's weight copies, split by tp
    rest_weights: float = 0.0
    vocab: int = 0  # the padded vocabulary: the logits' width
    # an MoE layer (balanced routing): attention and norms as above, and what its router and
    # experts keep, which tensor parallelism does not split (experts are whole on every rank)
    moe_replicated: float = 0.0
    moe_split: float = 0.0
    moe_kept: float = 0.0
    moe_experts: float = 0.0
    moe_weights: float = 0.0
    moe_expert_weights: float = 0.0  # autocast's copies of the experts: split by ep
    families: dict[str, FamilyTrace] = field(default_factory=dict)
    """A layer of each non-attention type the model has (mamba, rwkv, gmlp, amlp)."""


@dataclass(frozen=True)
class FamilyTrace:
    """What a layer of one non-attention family saves (as Trace's layer_* fields)."""

    replicated: float
    split: float
    kept: float
    weights: float


def _trace_saved(
    loaded: LoadedConfig,
    vocab: int,
    layers: int,
    precision: str,
    batch: int = 1,
    moe: bool = False,
    cp: int = 1,
    kind: str | None = None,
) -> tuple[float, float, float, float]:
    """(replicated, split, kept, experts) bytes saved by a forward + loss on fake tensors: on
    (fake) CUDA tensors on a GPU machine, so autocast and attention pick what training picks
    there, else on the CPU, whose autocast keeps the same dtypes. ``moe``: every layer an MoE
    layer with balanced routing (else every layer dense). ``cp``: as context-parallel rank 0 of
    ``cp`` holds it (its share of the tokens, every rank's keys and values). ``kind``: every
    layer of that attention_config type (else global attention)."""
    if torch.cuda.is_available():
        try:
            return _trace_on(loaded, vocab, layers, precision, "cuda", batch, moe, cp, kind)
        except Exception:  # a kernel with no fake implementation: trace on the CPU instead
            pass
    return _trace_on(loaded, vocab, layers, precision, "cpu", batch, moe, cp, kind)


class _BalancedCounts(LocalTokenDispatcher):
    """The trace's dispatcher: fake tensors have no values, so every expert gets an equal
    share of the assignments (what the load-balancing loss aims for)."""

    def count(self, experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
        base, extra = divmod(experts.numel(), num_experts)
        counts = [base + (e < extra) for e in range(num_experts)]
        return torch.tensor(counts, device=experts.device), counts


def route_evenly(moe: Any) -> None:
    """An MoE layer made to route fake tokens: every expert an equal share (fake tensors have
    no values to route by), Sinkhorn without its early stop (they cannot be compared). Expert
    parallelism's dispatcher is left as it is (its all-to-all is sized by the routing)."""
    from torchneox.parallel.expert_parallel import AllToAllTokenDispatcher

    if not isinstance(moe.dispatcher, AllToAllTokenDispatcher):
        moe.dispatcher = _BalancedCounts()
    moe.sinkhorn_tol = None


class _SavedBytes:
    """What autograd saves during a traced forward, by kind: ``replicated`` (hidden-wide, not
    split by tensor parallelism), ``split``, ``experts`` (inside an MoE layer: whole on every
    tensor rank), and the outputs of the ops selective checkpointing keeps."""

    def __init__(self, hidden: int):
        from torch.multiprocessing.reductions import StorageWeakRef

        self.ref, self.hidden = StorageWeakRef, hidden
        self.saved: dict[int, tuple[int, str]] = {}
        self.excluded: set[int] = set()  # parameters, buffers and inputs are not activations
        self.kept = 0
        self.inside_moe = 0

    def exclude(self, tensors: list[torch.Tensor]) -> None:
        self.excluded |= {self.ref(t.untyped_storage()).cdata for t in tensors}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = self.ref(t.untyped_storage()).cdata
        if key in self.excluded:
            return t
        if self.inside_moe:
            kind = "experts"
        elif t.dim() > 0 and t.shape[-1] == self.hidden:
            kind = "replicated"
        else:
            kind = "split"
        self.saved[key] = (t.untyped_storage().nbytes(), kind)
        return t

    def enter(self, module, inputs) -> None:
        self.inside_moe += 1

    def leave(self, module, inputs, output) -> None:
        self.inside_moe -= 1

    def kept_ops(self):
        """A dispatch mode that adds up the outputs of the ops selective checkpointing keeps."""
        from torch.utils._python_dispatch import TorchDispatchMode

        from torchneox.parallel.activation_ckpt import KEPT_OPS

        recorder = self

        class KeptOps(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, a=(), kw=None):
                out = func(*a, **(kw or {}))
                if func in KEPT_OPS and isinstance(out, torch.Tensor):
                    recorder.kept += out.untyped_storage().nbytes()
                return out

        return KeptOps()

    def total(self, kind: str) -> float:
        return sum(n for n, k in self.saved.values() if k == kind)


def _trace_on(
    loaded: LoadedConfig,
    vocab: int,
    layers: int,
    precision: str,
    device: str,
    batch: int = 1,
    moe: bool = False,
    cp: int = 1,
    kind: str | None = None,
) -> tuple[float, float, float, float]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torchneox.models.moe import MoE
    from torchneox.models.transformer import Transformer
    from torchneox.train.loss import lm_loss
    from torchneox.train.precision import autocast

    changes: dict[str, Any] = {"moe_interval": 1} if moe else {"moe_num_experts": 1}
    changes["layer_types"] = (kind or "global",) * layers
    # F.linear's ops (what selective checkpointing keeps), not a per-machine oneDNN verdict: the
    # traces of every shape alike (both kernels save the same tensors)
    changes["cpu_matmul"] = "default"
    args, _ = meta_model(loaded, vocab, layers, **changes)
    seq = loaded.config.model.seq_length
    rec = _SavedBytes(args.hidden_size)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device(device):
        model = Transformer(args)
        model.train()
        # with LoRA's frozen base, the first layer saves less than the rest (its input needs no
        # gradient), which the per-layer differences do not model: traced as every weight
        # trained, an upper bound of the adapters' activations
        model.requires_grad_(True)
        for module in model.modules():
            if isinstance(module, MoE):
                route_evenly(module)
                module.register_forward_pre_hook(rec.enter)
                module.register_forward_hook(rec.leave)
        tokens = torch.zeros(batch, seq // cp + 1, dtype=torch.long)
        context = _traced_context(seq, cp, torch.device(device)) if cp > 1 else None
        # parameters saved for backward (a matmul keeps its weight) are not activations
        rec.exclude([*model.parameters(), *model.buffers(), tokens])
        hooks = torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t)
        with hooks, rec.kept_ops(), autocast(precision, device):
            logits = model(tokens[:, :-1], context=context)
            lm_loss(logits, tokens[:, 1 : logits.shape[1] + 1], None, blocked=False)  # (a prompt)
    return rec.total("replicated"), rec.total("split"), rec.kept, rec.total("experts")


def _traced_context(seq: int, cp: int, device: torch.device):
    """Context-parallel rank 0's part of a sequence, its gather standing in for the all-gather
    (a fresh tensor of every rank's keys and values, as the collective returns)."""
    from torchneox.parallel.context_parallel import shard_of

    def gather(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (the recurrent mixers' states travel with an empty second tensor)
        return torch.cat([k] * cp, dim=2), torch.cat([v] * cp, dim=2)

    return shard_of(seq, cp, 0, gather, device)


def _layer_terms(
    loaded: LoadedConfig,
    vocab: int,
    precision: str,
    moe: bool,
    cp: int = 1,
    kind: str | None = None,
) -> dict[str, float]:
    """Four traces (1 and 2 layers, micro-batch 1 and 2) separate what grows with the layers
    and with the micro-batch from what does not."""
    t = {
        (n, b): _trace_saved(loaded, vocab, n, precision, b, moe, cp, kind)
        for n in (1, 2)
        for b in (1, 2)
    }

    def per_sample(i: int) -> list[float]:  # for 1 and 2 layers
        return [t[(n, 2)][i] - t[(n, 1)][i] for n in (1, 2)]

    def per_batch(*kinds: int) -> list[float]:  # what does not grow with the micro-batch
        return [sum(2 * t[(n, 1)][i] - t[(n, 2)][i] for i in kinds) for n in (1, 2)]

    rep, split, kept, experts = (per_sample(i) for i in range(4))
    weights, expert_weights = per_batch(0, 1), per_batch(3)
    return {
        "replicated": rep[1] - rep[0],
        "split": split[1] - split[0],
        "kept": kept[1] - kept[0],
        "experts": experts[1] - experts[0],
        "weights": weights[1] - weights[0],
        "expert_weights": expert_weights[1] - expert_weights[0],
        "rest_replicated": 2 * rep[0] - rep[1],
        "rest_split": 2 * split[0] - split[1],
        "rest_weights": 2 * weights[0] - weights[1],
    }


def trace_activations(loaded: LoadedConfig, vocab: int, precision: str, cp: int = 1) -> Trace:
    """Per dense layer, per MoE layer (when the model has them), per layer of each other
    family it has, and for the rest, on one of ``cp`` context-parallel ranks."""
    seq, h = loaded.config.model.seq_length // cp, loaded.config.model.hidden_size
    dense = _layer_terms(loaded, vocab, precision, moe=False, cp=cp)
    trace = Trace(
        layer_replicated=dense["replicated"],
        layer_split=dense["split"],
        layer_kept=dense["kept"],
        layer_input=seq * h * PARAM_BYTES,
        rest_replicated=dense["rest_replicated"],
        rest_split=dense["rest_split"],
        layer_weights=dense["weights"],
        rest_weights=dense["rest_weights"],
        vocab=vocab,
    )
    if loaded.config.moe.moe_num_experts > 1:
        moe = _layer_terms(loaded, vocab, precision, moe=True, cp=cp)
        trace.moe_replicated = moe["replicated"]
        trace.moe_split = moe["split"]
        trace.moe_kept = moe["kept"]
        trace.moe_experts = moe["experts"]
        trace.moe_weights = moe["weights"]
        trace.moe_expert_weights = moe["expert_weights"]
    for kind in dict.fromkeys(layer_attention_types(loaded.config)):
        if kind not in ATTENTION_LAYER_TYPES:
            terms = _layer_terms(loaded, vocab, precision, moe=False, cp=cp, kind=kind)
            trace.families[kind] = FamilyTrace(
                terms["replicated"], terms["split"], terms["kept"], terms["weights"]
            )
    return trace
