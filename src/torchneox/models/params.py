"""A parameter's name, its kind (drawn or set, an adapter's, the soft prompt) and its
initialisation: the rules every layout applies alike, whole or by shards."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from torch import nn

from torchneox.models.args import ModelArgs
from torchneox.models.block import special_init
from torchneox.models.init import InitFn, init_function
from torchneox.models.lora import expert_adapter_init, is_expert_adapter


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


SOFT_PROMPT = "soft_prompt.weight"
VALUE_HEAD = "value_head.weight"
"""A reward model's head (one value per position)."""
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
"""What activation checkpointing and torch.compile insert into parameter names."""

ADAPTER_TENSORS = ("lora_A.weight", "lora_B.weight")
"""A LoRA adapter's parameters, under the layer it adapts (layers.0.attention.wq.lora_A.weight)."""

OUTPUT_LAYERS = (
    "attention.wo.weight",
    "mlp.down.weight",
    "mlp.experts_down",
    "mlp.shared_expert.down.weight",
)
"""The parameters output_layer_init_method initialises (the rest: init_method)."""


def is_drawn(name: str) -> bool:
    """Whether initialisation draws parameter ``name`` from a generator (a norm's parameters
    and the biases are set in place: every norm module's name ends in "norm")."""
    module, _, leaf = name.rpartition(".")
    return not (module.endswith("norm") or leaf == "bias" or leaf.endswith("_bias"))


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's."""
    return name.endswith(ADAPTER_TENSORS)


def trains_with_lora(name: str) -> bool:
    """Whether a run with lora trains parameter ``name`` (and its checkpoints hold it): the
    adapters, a reward model's value head and a soft prompt."""
    return is_adapter(name) or name.endswith((VALUE_HEAD, SOFT_PROMPT))


def plain_name(name: str) -> str:
    """A parameter's name in the unwrapped model (what its seed and the checkpoints use)."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


PartFn = Callable[[torch.Tensor], tuple[torch.Tensor, tuple[slice, ...] | None]]
"""This process's tensor of a parameter and where it sits in the whole one (None: it is whole);
the model holds whole tensors (``whole``), a sharded one is told from outside
(parallel/shards.py ``local_part``)."""


def whole(param: torch.Tensor) -> tuple[torch.Tensor, None]:
    return param, None


def _soft_prompt_init(args: ModelArgs) -> InitFn:
    """The soft prompt uniform in [-init_range, init_range] (init_string's embeddings replace
    it where the run gives one: train/soft_prompt.py)."""
    r = args.soft_prompt_range

    def init(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return tensor.uniform_(-r, r, generator=generator)

    return init


def _own_init(args: ModelArgs, name: str) -> InitFn | None:
    """The initialisation of a parameter with one of its own (None: the default rules): a
    mixer's, the soft prompt's, PEFT's for a LoRA A, GPT-NeoX's xavier normal for the relative
    position table."""
    if name == SOFT_PROMPT:
        return _soft_prompt_init(args)
    if is_expert_adapter(name) and name.endswith("lora_A.weight"):  # per expert, as PEFT's
        return expert_adapter_init
    if name.endswith("lora_A.weight"):  # PEFT's: kaiming-uniform with a = sqrt(5)
        return _kaiming_uniform
    if name == "rpe.weight":  # GPT-NeoX's ParallelRelativePositionBias
        return init_function("xavier_normal", args.init_std, args.num_layers, args.hidden_size)
    return None if is_adapter(name) else special_init(args, name)


def init_parameter(
    args: ModelArgs,
    name: str,
    param: torch.Tensor,
    seed: int,
    draw_on: torch.device | None = None,
    part: PartFn = whole,
) -> None:
    """Initialise ``param`` (named ``name`` in the unwrapped model) as one process would: by
    its mixer's own rule where it has one (mamba's A_log, D and dt bias, RWKV's mixes and
    decays), else a norm's scale to one, biases to zero, weights by init_method or
    output_layer_init_method; every drawn tensor is drawn whole from the generator of its name
    (then, for a shard, only its part kept) on ``draw_on`` (default: where the parameter is;
    a run whose shards live in host memory draws where the model computes, as it would
    without offload). ``part`` gives this process's part of ``param``."""
    module, _, leaf = name.rpartition(".")
    local, where = part(param)
    if name.endswith("lora_B.weight"):  # PEFT's: zeros, so the adapted model starts as its base
        local.zero_()
        return
    init = _own_init(args, name)
    if init is None and not is_drawn(name):
        scale = module.endswith("norm") and leaf in ("weight", "g")
        local.fill_(1.0 if scale else 0.0)
        return
    if where is not None and local.numel() == 0:  # an empty shard: nothing of it is kept
        return
    factor = 1.0
    if init is None:
        method = args.output_init_method if name.endswith(OUTPUT_LAYERS) else args.init_method
        init = init_function(method, args.init_std, args.num_layers, args.hidden_size)
        if args.mup is not None:  # muP's re-drawn weights (models/mup.py)
            from torchneox.models.mup import init_factor

            factor = init_factor(args.mup, name, param.shape)
    if draw_on is None or torch.device(draw_on).type == local.device.type:
        draw_on = local.device
    generator = torch.Generator(device=draw_on).manual_seed(_param_seed(seed, name))
    if where is None and draw_on == local.device and local.dtype != torch.bfloat16:
        init(local, generator)
    else:
        # drawn in fp32 where the parameter is stored lower (a LoRA base in bf16): the rounded
        # weights of the fp32 draw
        dtype = torch.float32 if local.dtype == torch.bfloat16 else local.dtype
        whole = torch.empty(param.shape, dtype=dtype, device=draw_on)
        init(whole, generator)
        local.copy_(whole if where is None else whole[where])
    if factor != 1.0:
        local.mul_(factor)


class SoftPrompt(nn.Module):
    """soft_prompt_tuning's ``n_tokens`` vectors, put before the text's embeddings."""

    def __init__(self, n_tokens: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_tokens, hidden_size))


def _kaiming_uniform(tensor: torch.Tensor, generator: torch.Generator) -> None:
    nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
