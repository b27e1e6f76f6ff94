"""Parameters per rank from the model's real shapes (built on the meta device), split the way
tensor, expert, pipeline and FSDP sharding split them."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from torchneox.config.load import LoadedConfig
from torchneox.models.lora import is_expert_adapter
from torchneox.parallel.tensor_parallel import split_dim

PARAM_BYTES = 4  # parameters, gradients and optimizer moments are fp32 (autocast does the rest)


def expert_sharded(name: str, ep: int) -> bool:
    """Expert weights (and their LoRA adapters) under expert parallelism: split over ep, left
    alone by ZeRO/DDP."""
    return ep > 1 and (name.rsplit(".", 1)[-1] in _expert_params() or is_expert_adapter(name))


@functools.cache
def _expert_params() -> tuple[str, ...]:
    from torchneox.parallel.expert_parallel import EXPERT_PARAMS  # (torch.distributed's import)

    return EXPERT_PARAMS


# The layout search asks for the same (shape, name, layout) many millions of times: both are
# pure functions of their arguments, cached (a bounded cache: a long process meets many models)
@functools.lru_cache(maxsize=1 << 17)
def local_numel(shape: tuple[int, ...], name: str, tp: int, fsdp: int, ep: int = 1) -> int:
    """Elements rank 0 holds: the tensor-parallel shard, then FSDP's dim-0 chunk of it (torch
    chunks give rank 0 the rounded-up share); with expert parallelism, its share of the
    experts instead."""
    return math.prod(local_dims(shape, name, tp, fsdp, ep))


@functools.lru_cache(maxsize=1 << 17)
def local_dims(
    shape: tuple[int, ...], name: str, tp: int, fsdp: int, ep: int = 1
) -> tuple[int, ...]:
    """The shape of rank 0's shard (see local_numel)."""
    dims = list(shape)
    if expert_sharded(name, ep):
        return (math.ceil(dims[0] / ep), *dims[1:])
    dim = split_dim(name)
    if tp > 1 and dim is not None and dim < len(dims):
        dims[dim] = math.ceil(dims[dim] / tp)
    if fsdp > 1 and dims:
        dims[0] = math.ceil(dims[0] / fsdp)
    return tuple(dims)


def meta_model(loaded: LoadedConfig, vocab: int, layers: int | None = None, **changes):
    from torchneox.models.args import ModelArgs
    from torchneox.models.transformer import Transformer

    args = ModelArgs.from_config(loaded.config, vocab)
    if layers is not None:  # (a model of other depth: no layer weight sharing)
        changes |= {"num_layers": layers, "layer_owners": ()}
    args = dataclasses.replace(args, **changes)
    with torch.device("meta"):
        return args, Transformer(args)


def stage_params(
    loaded: LoadedConfig, vocab: int, pp: int, method: str
) -> list[list[tuple[str, tuple]]]:
    """(name, shape) of the parameters each pipeline stage holds."""
    from torchneox.parallel.pipeline import embeds_on_last, stage_layers

    args, model = meta_model(loaded, vocab)
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    if pp <= 1:
        return [shapes]
    ranges = stage_layers(args, pp, method)
    owners = args.layer_owners or tuple(range(args.num_layers))
    stages = []
    for k, r in enumerate(ranges):
        keep = []
        held = {owners[layer] for layer in r}  # (a sharer's stage holds a copy of its owner's)
        for name, shape in shapes:
            if name.startswith("layers."):
                if int(name.split(".")[1]) in held:
                    keep.append((name, shape))
            elif name.startswith(("embed.", "pos_embed.", "soft_prompt.")):
                # the first stage's; the last keeps a copy of the embedding for a tied head
                # or MTP modules (trained there too, its gradient summed with the first's)
                copied = name.startswith("embed.") and embeds_on_last(args)
                if k == 0 or (k == pp - 1 and copied):
                    keep.append((name, shape))
            elif k == pp - 1:
                keep.append((name, shape))
        stages.append(keep)
    return stages
