"""Tensor parallelism for the layer families beside attention: mamba and gMLP/aMLP mixers
split over the tensor ranks by channels, RWKV's by heads (called from
``tensor_parallel.apply_tensor_parallel``).

mamba: in_proj split by output rows (as saved: the checkpoint is the one-process file), its
output gathered and each rank keeping its channels of x and of the gate z (the strided split
of the fused projection, taken from the activations: a checkpoint shard must be one block of
rows); the convolution, dt_proj, A_log and D split by channels; x_proj and out_proj by input
columns (one all-reduce each). gMLP: input_linear split by rows, its output gathered, the
gate's norm taken over the whole width (as one process), each rank keeping its channels of
both halves; output_linear by input columns; aMLP's tiny attention reads both whole halves
and its proj_ffn writes the rank's gate channels. RWKV: the time mix's receptance, key,
value and gate split by output rows (whole heads per rank), its output by input columns; the
decay's time_decay, time_decay_w2 and the bonus time_faaaa by heads, and ln_x (a GroupNorm of
one group per head) run on the rank's heads with its part of the weight and bias; the five
token-shift mixes and the decay's first low-rank factor stay whole. The channel mix: key by
rows, value by columns, receptance whole.

Every replicated computation feeding a split one passes ``Split.copy`` (identity forward,
the ranks' gradients summed backward), so replicated weights get the one-process gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from torchneox.parallel.fp8 import column_style, row_style

MAMBA_CHANNELS = ("conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias", "A_log", "D")
"""A mamba mixer's parameters split by channels (dim 0)."""
RWKV_HEADS = ("receptance", "key", "value", "gate")
"""The time mix's projections split by heads (output rows)."""
FAMILY_SPLITS = {
    "mamba.in_proj.weight": 0,
    "mamba.in_proj.bias": 0,
    "mamba.x_proj.weight": 1,
    "mamba.out_proj.weight": 1,
    "gmlp.input_linear.weight": 0,
    "gmlp.output_linear.weight": 1,
    "gmlp.sgu.attn.proj_ffn.weight": 0,
    "gmlp.sgu.attn.proj_ffn.bias": 0,
    **{f"mamba.{n}": 0 for n in MAMBA_CHANNELS},
    **{f"time_mix.{n}.weight": 0 for n in RWKV_HEADS},
    "time_mix.output.weight": 1,
    "time_mix.time_decay": 2,
    "time_mix.time_decay_w2": 1,
    "time_mix.time_faaaa": 0,
    "time_mix.out_norm.weight": 0,
    "time_mix.out_norm.bias": 0,
    "channel_mix.key.weight": 0,
    "channel_mix.value.weight": 1,
}
"""(parameter name in its block, the dim tensor parallelism splits) of these families."""


class Split:
    """What a split mixer calls (``mixer.tp``): the mesh's collectives, as autograd sees them."""

    def __init__(self, mesh: DeviceMesh):
        self.mesh, self.rank, self.size = mesh, mesh.get_local_rank(), mesh.size()

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """A column-split output (a DTensor split on its last dim) whole on every rank; its
        gradient, the same on every rank, is split back."""
        return t.redistribute(self.mesh, [Replicate()]).to_local()

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the same on every rank) as it is; backward, the ranks' gradients summed."""
        d = DTensor.from_local(t, self.mesh, [Replicate()], run_check=False)
        return d.to_local(grad_placements=[Partial()])

    def parts(self, t: torch.Tensor, n: int) -> list[torch.Tensor]:
        """This rank's channels of each of the ``n`` equal parts of ``t``'s last dim."""
        return [c.chunk(self.size, -1)[self.rank] for c in t.chunk(n, -1)]


def split_family(block: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split ``block``'s mamba, gMLP or RWKV mixer over ``mesh`` (attention: nothing here);
    with ``sequence_parallel`` the block's norms run on each rank's slice of the sequence, each
    mixer reads the sequence gathered whole (as attention does: it reads it in order) and its
    output is reduce-scattered back to the slices (``sequence_plan``)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    if hasattr(block, "time_mix"):
        _split_rwkv(block, mesh, seq)
        if sequence_parallel:
            parallelize_module(block, mesh, sequence_plan(block))
        return
    mixer = getattr(block, "mamba", None) or getattr(block, "gmlp", None)
    if mixer is None:
        return
    name = "mamba" if hasattr(block, "mamba") else "gmlp"
    layer = mixer.get_submodule  # (fp8 layers: torchao's float8 styles, parallel/fp8.py)
    plan: dict = {
        "mamba": lambda: {
            "in_proj": column_style(layer("in_proj"), use_local_output=False),
            "x_proj": row_style(layer("x_proj")),
            "out_proj": row_style(layer("out_proj"), output_layouts=seq),
        },
        "gmlp": lambda: {
            "input_linear": column_style(layer("input_linear"), use_local_output=False),
            "output_linear": row_style(layer("output_linear"), output_layouts=seq),
        },
    }[name]()
    if name == "gmlp" and mixer.sgu.attn is not None:
        plan["sgu.attn.proj_ffn"] = column_style(layer("sgu.attn.proj_ffn"))
    parallelize_module(mixer, mesh, plan)
    if name == "mamba":
        for param in MAMBA_CHANNELS:
            _shard(mixer, param, 0, mesh)
    _mark_split(mixer, plan)
    mixer.tp = Split(mesh)
    if sequence_parallel:
        parallelize_module(block, mesh, sequence_plan(block))


def sequence_plan(block: nn.Module) -> dict:
    """A family block under sequence parallelism: its norms on the rank's slice (their weights'
    gradients summed over the slices), each mixer's input gathered whole; the mixer's output
    leaves it as the slices (the split output layers reduce-scatter; RWKV's channel mix, whose
    receptance gates the all-reduced value, keeps its rank's slice of the whole product)."""
    from torch.distributed.tensor.parallel import (
        PrepareModuleInput,
        PrepareModuleInputOutput,
        SequenceParallel,
    )

    family, gathered = block.family, ((Shard(1), None, None, None), (Replicate(), None, None, None))
    plan: dict = {family.norm: SequenceParallel(use_local_output=True)}
    plan[family.mixer] = PrepareModuleInput(
        input_layouts=gathered[0], desired_input_layouts=gathered[1], use_local_output=True
    )
    if family.mlp is not None:  # RWKV's channel mix
        plan[family.mlp_norm] = SequenceParallel(use_local_output=True)
        plan[family.mlp] = PrepareModuleInputOutput(
            input_layouts=gathered[0],
            desired_input_layouts=gathered[1],
            use_local_input=True,
            output_layouts=Replicate(),
            desired_output_layouts=Shard(1),
            use_local_output=True,
        )
    return plan


def _split_rwkv(block: nn.Module, mesh: DeviceMesh, seq: Shard | Replicate) -> None:
    """The time mix split by heads, the channel mix by its inner width (module docstring)."""
    time, channel = block.time_mix, block.channel_mix
    plan: dict = {n: column_style(time.get_submodule(n)) for n in RWKV_HEADS}
    plan["output"] = row_style(time.output, output_layouts=seq)
    parallelize_module(time, mesh, plan)
    for param in ("time_decay", "time_decay_w2", "time_faaaa", "out_norm.weight", "out_norm.bias"):
        _shard(time, param, FAMILY_SPLITS[f"time_mix.{param}"], mesh)
    _mark_split(time, plan)
    time.tp = Split(mesh)
    plan = {"key": column_style(channel.key), "value": row_style(channel.value)}
    parallelize_module(channel, mesh, plan)
    _mark_split(channel, plan)


def _shard(owner: nn.Module, name: str, dim: int, mesh: DeviceMesh) -> None:
    """Parameter ``name`` of ``owner`` (when it has one) split on ``dim`` over ``mesh``."""
    module_name, _, leaf = name.rpartition(".")
    module = owner.get_submodule(module_name) if module_name else owner
    tensor = getattr(module, leaf)
    if tensor is not None:
        split = distribute_tensor(tensor.data, mesh, [Shard(dim)])
        setattr(module, leaf, nn.Parameter(split, requires_grad=tensor.requires_grad))


def _mark_split(owner: nn.Module, names) -> None:
    for layer in names:
        owner.get_submodule(layer).split = True
