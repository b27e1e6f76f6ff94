"""Tensor parallelism (Megatron-style) as a DTensor plan applied to the unchanged model.

Per block: q, k, v and the MLP's up/gate projections split by output columns (whole heads per
rank), the attention output and MLP down projections by input rows (one all-reduce each); MLA's
up projections split by heads as q is, its down projections and latents whole on every rank. The
embedding is split by vocabulary rows and the output head by vocabulary columns; the loss is
computed on the vocabulary shards (``loss_parallel``) without gathering the logits. With
``sequence_parallel`` the norms, dropout and residual stream are split along the sequence
between the blocks' matmuls.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from torchneox.models.linear import Linear
from torchneox.models.mixers.mla import MLA
from torchneox.models.mixers.sparse import SparseAttention
from torchneox.models.transformer import Transformer
from torchneox.parallel.families import FAMILY_SPLITS, split_family
from torchneox.parallel.fp8 import column_style, gather_input_style, row_style

COLUMN_SPLIT = (
    "attention.wq", "attention.wk", "attention.wv", "mlp.up", "mlp.gate",
    "attention.wq_b", "attention.wkv_b",  # MLA's up projections, by heads
)  # fmt: skip
"""Linear layers split by output features (weight and bias on dim 0). MLA's down projections
(wq_a, wkv_a) and its latents' norms are whole on every rank."""
ROW_SPLIT = ("attention.wo", "mlp.down")
"""Linear layers split by input features (weight on dim 1; the bias is whole)."""
VOCAB_SPLIT = ("embed", "output")
"""The embedding and the head, split by vocabulary (dim 0)."""


def split_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits parameter ``name`` on (None: replicated), as
    the plan of ``apply_tensor_parallel`` splits it; the estimator reads it too."""
    module, _, leaf = name.rpartition(".")
    if module in VOCAB_SPLIT and leaf == "weight":
        return 0
    if name == "rpe.weight":  # [buckets, heads]: each rank its heads
        return 1
    if module.endswith(tuple(f"{c}.lora_B" for c in COLUMN_SPLIT)):  # LoRA: as the layer's
        return 0
    if module.endswith(tuple(f"{r}.lora_A" for r in ROW_SPLIT)):
        return 1
    if name.startswith("layers."):
        in_block = name.split(".", 2)[-1]
        if in_block in FAMILY_SPLITS:
            return FAMILY_SPLITS[in_block]
    if module.endswith(COLUMN_SPLIT):
        return 0
    if module.endswith(ROW_SPLIT) and leaf == "weight":
        return 1
    return None


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Split every layer over ``mesh`` (a layout ``config.layout.check_layout`` accepted).
    Tied embeddings: the head reads the embedding's
    vocabulary-split weight (one tensor, its gradient summed from both uses)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    model.sequence_shards = mesh.size() if sequence_parallel else 1
    top = {}
    # a pipeline stage may hold neither end; with sequence parallelism the hidden states pass
    # between stages as each tensor rank's sequence slice
    if model.embed is not None:
        top["embed"] = _embedding_plan(model, mesh, sequence_parallel)
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        )
    tied = model.output is None and model.value_head is None and model.final_norm is not None
    if tied:  # the head is the embedding's weight: its vocabulary shards give the logits'
        model.tied_head_input = functools.partial(_whole, mesh=mesh, seq=seq)
    if sequence_parallel and model.final_norm is not None:
        top["final_norm"] = SequenceParallel()
    if sequence_parallel and model.value_head is not None:
        # a reward model reads each sequence's last real position: the normalised slices are
        # gathered whole (every rank the same values; the gradient of its own slice back)
        top["value_head"] = PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True
        )
    if model.rpe is not None:  # the relative position table, split by heads
        top["rpe"] = ColwiseParallel(input_layouts=Replicate())
    if top:
        parallelize_module(model, mesh, top)
        _mark_split(model, list(top))
    _keep_heads(model, mesh)
    # fp8's collectives (sequence parallelism's gathers in fp8) need NCCL: gloo moves no fp8
    fp8 = mesh.device_type == "cuda" or not sequence_parallel
    mtp = list(model.mtp.values()) if model.mtp is not None else []  # MTP's blocks alike
    for block in [*model.layers.values(), *mtp]:
        # (an MoE layer's experts are whole on every tensor rank, and so are its tokens: each
        # rank computes the same expert outputs, see _moe_plan)
        present = [n for n in COLUMN_SPLIT + ROW_SPLIT if _linear(block, n)]
        plan = _block_plan(block, present, seq, sequence_parallel, fp8)
        adapters = _take_adapters(block, present)  # the plans split a layer's own weights
        parallelize_module(block, mesh, plan)
        _mark_split(block, present)
        _split_qk_norms(getattr(block, "attention", None), mesh)
        _split_adapters(block, adapters, mesh)
        split_family(block, mesh, sequence_parallel)
        if isinstance(getattr(block, "attention", None), MLA):
            block.attention.shared_key_grad = functools.partial(_sum_gradient, mesh=mesh)
        if isinstance(getattr(block, "attention", None), SparseAttention):
            # its layout per head follows the heads this rank holds
            block.attention.keep_heads(mesh.get_local_rank(), mesh.size())
    if sequence_parallel:
        for layer in mtp:
            _mtp_sequence_parallel(layer, mesh)


def _embedding_plan(model: Transformer, mesh: DeviceMesh, sequence_parallel: bool):
    """The embedding split by vocabulary rows. Positions added to the embeddings (learned,
    sinusoidal) are the whole sequence's, and a soft prompt goes before the text: under
    sequence parallelism the embeddings then stay whole until they are added (the prompt put
    first), and each rank keeps its slice (``embedded_output``)."""
    whole_first = sequence_parallel and (
        model.args.pos_emb in ("learned", "sinusoidal") or model.soft_prompt is not None
    )
    if whole_first:
        model.embedded_output = functools.partial(_sequence_slice, mesh=mesh)
    out = Shard(1) if sequence_parallel and not whole_first else Replicate()
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)


def _mtp_sequence_parallel(layer: nn.Module, mesh: DeviceMesh) -> None:
    """An MTP module's own norms and eh_proj under sequence parallelism: each rank's slice of
    the sequence (the hidden state and the embedding of the tokens ahead are sliced alike), the
    weights whole on every rank and their gradients summed over the slices."""
    names = ["enorm", "hnorm", "eh_proj", "shared_head.norm"]
    parallelize_module(layer, mesh, {n: SequenceParallel(use_local_output=True) for n in names})
    _mark_split(layer, ["eh_proj"])


def _block_plan(
    block: nn.Module, present: list[str], seq: Shard | Replicate, sequence_parallel: bool, fp8: bool
) -> dict:
    """The plan of a block's attention and MLP linears (and, with sequence parallelism, its
    norms and the sublayers' gathered inputs)."""
    # (fp8 layers: torchao's float8 styles, casting before the collectives; parallel/fp8.py)
    layer = block.get_submodule
    plan: dict = {n: column_style(layer(n), fp8) for n in present if n in COLUMN_SPLIT}
    plan |= {n: row_style(layer(n), fp8, output_layouts=seq) for n in present if n in ROW_SPLIT}
    if sequence_parallel and not block.reads_in_order:  # (the other families: families.py)
        plan["attention_norm"] = SequenceParallel()
        qkv = [layer(n) for n in present if n.startswith("attention.w") and n in COLUMN_SPLIT]
        mla = isinstance(getattr(block, "attention", None), MLA)
        plan["attention"] = gather_input_style(
            [] if mla else qkv,  # MLA's input meets its down projections, whole plain linears
            fp8,
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=mla,
        )
        up = [layer(n) for n in present if n in ("mlp.up", "mlp.gate")]
        plan["mlp"] = _moe_plan() if getattr(block, "is_moe", False) else _mlp_input(up, fp8)
        if block.mlp_norm is not None:
            plan["mlp_norm"] = SequenceParallel()
    return plan


def _mlp_input(up: list[nn.Module], fp8: bool) -> PrepareModuleInput:
    return gather_input_style(
        up, fp8, input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )


def _moe_plan() -> PrepareModuleInputOutput:
    """An MoE layer under sequence parallelism: the sequence gathered before routing, so that
    every tensor rank routes the whole sequence as one process does (the router's choices, its
    statistics and the expert gradients are those of tensor parallelism without it), then each
    rank keeps its slice of the output (its gradient gathered whole on the way back)."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        use_local_input=True,
        output_layouts=(Replicate(), None),
        desired_output_layouts=(Shard(1), None),
        use_local_output=True,
    )


class _SumGradient(torch.autograd.Function):
    """The identity forward; backward, the gradient summed over the tensor ranks (Megatron's
    copy to the tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _sum_gradient(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """MLA's rotary key, whole on every rank, meets only the rank's heads: its gradient is the
    sum of every rank's."""
    return _SumGradient.apply(x, mesh.get_group())


def _whole(x: torch.Tensor, mesh: DeviceMesh, seq: Shard | Replicate) -> DTensor:
    """The tied head's input whole on every tensor rank (a DTensor: its product with the
    embedding's vocabulary-split weight is the logits split by vocabulary, and its gradient is
    summed over the ranks on the way back), as ColwiseParallel makes an untied head's."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [seq])
    return x.redistribute(mesh, [Replicate()])


def _sequence_slice(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's slice of the sequence of a tensor whole on every tensor rank (the gradient
    of the slices gathered on the way back)."""
    whole = DTensor.from_local(x, mesh, [Replicate()])
    return whole.redistribute(mesh, [Shard(1)]).to_local()


def _split_qk_norms(attention: nn.Module | None, mesh: DeviceMesh) -> None:
    """use_qk_layernorm over the heads this rank holds. Each head over its own dimensions
    (qk_norm_scope head, Qwen3's): the rank's heads normalised where they are, the weight
    replicated (its gradient summed over the ranks). Over all heads together (width, OLMo 2's;
    neox, GPT-NeoX's [heads, head_dim] norm): the queries (keys) gathered whole, normalised by
    the whole weight, and each rank's heads taken back."""
    scope = getattr(attention, "qk_norm_scope", None)
    if scope is None:
        return
    norms = [attention.qk_norm] if scope == "neox" else [attention.q_norm, attention.k_norm]
    whole = scope != "head"
    for norm in norms:
        distribute_module(
            norm,
            mesh,
            input_fn=_norm_input_whole if whole else _norm_input_heads,
            output_fn=_norm_output_whole if whole else _norm_output_heads,
        )


def _norm_input_heads(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return (DTensor.from_local(inputs[0], mesh, [Shard(2)]), *inputs[1:])  # [B, T, heads, ..]


def _norm_input_whole(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    x = DTensor.from_local(inputs[0], mesh, [Shard(2)])
    return (x.redistribute(mesh, [Replicate()]), *inputs[1:])


def _norm_output_heads(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return out.to_local()


def _norm_output_whole(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return out.redistribute(mesh, [Shard(2)]).to_local()


def _mark_split(owner: nn.Module, names: list[str]) -> None:
    """The linear layers the plan split told so: their products, of DTensors, take
    ``F.linear`` (models/linear.py: oneDNN is for plain tensors)."""
    for name in names:
        layer = owner.get_submodule(name)
        if isinstance(layer, Linear):
            layer.split = True


def _take_adapters(block: nn.Module, names: list[str]) -> dict[str, tuple[nn.Module, nn.Module]]:
    """The LoRA adapters (lora_A, lora_B, their dropout) of the layers ``names``, taken off."""
    out = {}
    for name in names:
        layer = block.get_submodule(name)
        if "lora_A" in layer._modules:
            out[name] = tuple(layer._modules.pop(k) for k in ("lora_A", "lora_B", "lora_dropout"))
    return out


def _split_adapters(block: nn.Module, adapters: dict, mesh: DeviceMesh) -> None:
    """Each adapter put back split as its layer is: a column-split layer's B by output rows
    (A whole), a row-split layer's A by input columns (B whole), so that B(A(x)) is laid out
    as the layer's own output (its row-split partial sums reduced with the layer's)."""
    for name, (a, b, dropout) in adapters.items():
        column = name in COLUMN_SPLIT
        for module, placement in (
            (a, Replicate() if column else Shard(1)),
            (b, Shard(0) if column else Replicate()),
        ):
            weight = module.weight
            module.weight = nn.Parameter(
                distribute_tensor(weight, mesh, [placement]), requires_grad=weight.requires_grad
            )
        layer = block.get_submodule(name)
        layer.lora_A, layer.lora_B, layer.lora_dropout = a, b, dropout


def _keep_heads(model: Transformer, mesh: DeviceMesh) -> None:
    """ALiBi's slopes cut to the heads this rank holds (whole heads per rank, in order)."""
    per_rank = model.args.num_heads // mesh.size()
    first = mesh.get_local_rank() * per_rank
    model.tp_heads = (first, first + per_rank)
    if model.args.pos_emb == "alibi":
        model.init_buffers(model.alibi.device)


def _linear(block: nn.Module, name: str) -> bool:
    """Whether ``block`` has a dense linear layer at ``name`` (an MoE layer has none)."""
    owner, _, leaf = name.rpartition(".")
    holder = getattr(block, owner, None)  # another family's block has no attention nor mlp
    return isinstance(getattr(holder, leaf, None), nn.Linear)


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Cross-entropy on vocabulary-sharded logits when tensor parallelism is on."""
    return loss_parallel() if enabled else contextlib.nullcontext()


def is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def placed_like(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar term added to ``like`` (a loss): as a DTensor with its placement when ``like``
    is one (a vocabulary-parallel loss), else as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, DTensor):
        return DTensor.from_local(value, like.device_mesh, like.placements)
    return value
