"""The block that holds a mixer, written once for every layer family.

A block is ``x + mixer(norm(x))`` then, where the family has one, ``x + mlp(mlp_norm(x))``
(GPT-NeoX's transformer layer also has the parallel residual of gpt_j_residual and OLMo 2's
normalised outputs). Which mixer a layer holds is its ``attention_config`` type, as GPT-NeoX
selects it per layer; each family names its sublayers, and those names are the parameters'
(``layers.{i}.attention.wq.weight``, ``layers.{i}.mamba.in_proj.weight``, ...):

    family     layer types                              sublayers (norm, mixer, norm, mlp)
    attention  global, flash, and the block-sparse     attention_norm attention mlp_norm mlp
               types (mixers/attention.py, sparse.py;
               mla.py under mla_kv_lora_rank)
    mamba      mamba (mixers/mamba.py)                  mamba_norm mamba (no MLP)
    rwkv       rwkv (mixers/rwkv.py)                    time_mix_norm time_mix channel_mix_norm
                                                        channel_mix
    gmlp       gmlp, amlp (mixers/gmlp.py)              gmlp_norm gmlp (no MLP)

Every mixer is called as ``mixer(x, rope, bias, cache)`` and returns a tensor shaped like
``x``: attention reads the rotary tables, the mask and the KV cache; a recurrent mixer keeps
its state in ``cache.state(layer)`` and ignores the rest.

Under context parallelism (``bias.gather`` set) a mixer that reads the sequence in order runs
one of two ways. Mamba's and RWKV's mixers (``passes_state``) take their own rank's chunks and
pass their recurrent state between the ranks (models/mixers/state_passing.py). gMLP's spatial
gating, which mixes every position, runs over the whole sequence: every rank's part is gathered
and put in order (one all-gather forward, its reduce-scatter backward), and each rank keeps the
outputs of its own positions (``_whole_sequence``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchneox.config.features.sparsity import SPARSE_TYPES
from torchneox.models.args import ModelArgs
from torchneox.models.init import InitFn
from torchneox.models.mixers import mamba, rwkv
from torchneox.models.mixers.attention import Attention, AttentionBias, KVCache
from torchneox.models.mixers.gmlp import GMLP, gmlp_init
from torchneox.models.mixers.mla import MLA
from torchneox.models.mixers.sparse import SparseAttention, SparseMLA
from torchneox.models.mlp import MLP
from torchneox.models.moe import MoE, RouterStats
from torchneox.models.norms import build_norm

Builder = Callable[[ModelArgs, int], nn.Module]


def _mlp_or_moe(args: ModelArgs, layer: int) -> nn.Module:
    return MoE(args) if args.is_moe_layer(layer) else MLP(args)


@dataclass(frozen=True)
class Family:
    """A layer family: its sublayers' names and how each is built."""

    norm: str
    mixer: str
    build_mixer: Builder
    mlp_norm: str | None = None
    mlp: str | None = None
    build_mlp: Builder | None = None
    mlp_is_mixer: bool = False
    """The second sublayer is called as a mixer is (RWKV's channel mix keeps a state)."""
    init_rule: Callable[[ModelArgs, str], InitFn | None] | None = None
    """The family's own initialisation of a parameter (its name in the block, after
    ``layers.{i}.``), or None where init_method's rule applies."""
    layer_init_rule: Callable[[ModelArgs, int, str], InitFn | None] | None = None
    """As ``init_rule``, for a family whose initialisations depend on the layer's index."""
    build_norm: Callable[[ModelArgs], nn.Module] | None = None
    """The family's own norms (None: the config's ``norm``)."""
    norm_first_input: bool = False
    """On layer 0, the block's input is normalised by the first norm before anything else
    (GPT-NeoX's RWKV applies ln1 twice there)."""


def _attention(args: ModelArgs, layer: int) -> nn.Module:
    """Dense attention, or block-sparse where the layer's type has a layout (its parameters
    are the same); under mla_kv_lora_rank multi-head latent attention, block-sparse alike."""
    if args.mla:
        return SparseMLA(args, layer) if args.sparsity(layer) else MLA(args, layer)
    return SparseAttention(args, layer) if args.sparsity(layer) else Attention(args, layer)


ATTENTION = Family(
    "attention_norm", "attention", _attention, "mlp_norm", "mlp", _mlp_or_moe
)  # fmt: skip
MAMBA = Family("mamba_norm", "mamba", mamba.Mamba, init_rule=mamba.init_rule)
RWKV = Family(
    "time_mix_norm", "time_mix", rwkv.TimeMix, "channel_mix_norm", "channel_mix",
    rwkv.ChannelMix, mlp_is_mixer=True, layer_init_rule=rwkv.init_rule,
    build_norm=rwkv.layer_norm, norm_first_input=True,
)  # fmt: skip
GMLP_FAMILY = Family("gmlp_norm", "gmlp", GMLP, init_rule=gmlp_init)

FAMILIES: dict[str, Family] = {
    "global": ATTENTION,
    "flash": ATTENTION,
    **dict.fromkeys(SPARSE_TYPES, ATTENTION),  # block-sparse: attention with a layout
    "mamba": MAMBA,
    "rwkv": RWKV,
    "gmlp": GMLP_FAMILY,
    "amlp": GMLP_FAMILY,
}
"""The family of each attention_config layer type."""


def family_of(args: ModelArgs, layer: int) -> Family:
    return FAMILIES[args.layer_type(layer)]


def special_init(args: ModelArgs, name: str) -> InitFn | None:
    """The initialisation of parameter ``name`` its layer's family asks for (None: the
    model's default rule)."""
    if name.startswith("mtp."):  # an MTP module's block: the last layer's kind
        layer, rest = str(args.num_layers - 1), name.split(".", 2)[2]
    elif name.startswith("layers."):
        layer, _, rest = name.removeprefix("layers.").partition(".")
    else:
        return None
    family = family_of(args, int(layer))
    if family.layer_init_rule is not None:
        return family.layer_init_rule(args, int(layer), rest)
    return family.init_rule(args, rest) if family.init_rule is not None else None


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        family = self.family = family_of(args, layer)
        attention = family is ATTENTION  # GPT-NeoX's residual options are its transformer's
        # (kept as a flag: a copied block, as a pipeline stage's, holds a copy of its family)
        self.reads_in_order = not attention  # a sequential mixer (see _mix)
        self.parallel_residual = attention and args.parallel_residual
        self.norm_output = attention and args.norm_position == "output"
        self.is_moe = family.build_mlp is _mlp_or_moe and args.is_moe_layer(layer)

        self.norm_input = family.norm_first_input and layer == 0

        def norm() -> nn.Module:
            if family.build_norm is not None:
                return family.build_norm(args)
            return build_norm(args.norm, args.hidden_size, args.norm_eps, args.norm_bias)

        setattr(self, family.norm, norm())
        setattr(self, family.mixer, family.build_mixer(args, layer))
        if family.mlp is not None:
            shared = attention and args.shared_norm  # gpt_j_tied: one norm feeds both
            setattr(self, family.mlp_norm, None if shared else norm())
            setattr(self, family.mlp, family.build_mlp(args, layer))
        self.dropout = nn.Dropout(args.hidden_dropout)

    def sublayers(self) -> tuple[nn.Module, nn.Module, nn.Module | None, nn.Module | None]:
        """(norm, mixer, mlp norm, mlp) of this block's family (None where it has none)."""
        f = self.family
        return (
            getattr(self, f.norm),
            getattr(self, f.mixer),
            getattr(self, f.mlp_norm) if f.mlp_norm else None,
            getattr(self, f.mlp) if f.mlp else None,
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        bias: AttentionBias,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, RouterStats | None]:
        """The block's output, and its router's statistics when its MLP is an MoE layer."""
        norm, mixer, mlp_norm, mlp = self.sublayers()
        if self.norm_input:
            x = norm(x)
        if self.norm_output:  # OLMo 2: each sublayer's output normalised, then added
            x = x + self.dropout(norm(self._mix(mixer, x, rope, bias, cache)))
            mlp_out, stats = self._mlp(mlp, x, rope, bias, cache)
            return x + self.dropout(mlp_norm(mlp_out)), stats
        normed = norm(x)
        mixed = self.dropout(self._mix(mixer, normed, rope, bias, cache))
        if mlp is None:
            return x + mixed, None
        if self.parallel_residual:
            mlp_in = normed if mlp_norm is None else mlp_norm(x)
            mlp_out, stats = self._mlp(mlp, mlp_in, rope, bias, cache)
            return x + mixed + self.dropout(mlp_out), stats
        x = x + mixed
        mlp_out, stats = self._mlp(mlp, mlp_norm(x), rope, bias, cache)
        return x + self.dropout(mlp_out), stats

    def _mlp(
        self, mlp: nn.Module, x: torch.Tensor, *context
    ) -> tuple[torch.Tensor, RouterStats | None]:
        if self.is_moe:
            return mlp(x)
        if self.family.mlp_is_mixer:
            return self._mix(mlp, x, *context), None
        return mlp(x), None

    def _mix(
        self,
        mixer: nn.Module,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        bias: AttentionBias,
        cache: KVCache | None,
    ) -> torch.Tensor:
        if bias.gather is None or not self.reads_in_order or getattr(mixer, "passes_state", False):
            return mixer(x, rope, bias, cache)  # (a mixer that passes_state does CP itself)
        return _whole_sequence(mixer, x, bias)


def _whole_sequence(mixer: nn.Module, x_BTH: torch.Tensor, bias: AttentionBias) -> torch.Tensor:
    """A sequential mixer under context parallelism: this rank's outputs of the mixer run over
    the whole sequence (every rank's part gathered, in sequence order). Each rank's loss reads
    only its own positions, so the gathered input's gradient, summed back over the ranks by
    the all-gather's reduce-scatter, is the one-process gradient of this rank's inputs."""
    mine, keys = bias.positions
    gathered, _ = bias.gather(x_BTH[:, None], x_BTH[:, None])  # [B, 1, T, H], by rank
    order = torch.argsort(keys)
    documents = bias.documents[:, order] if bias.documents is not None else None
    out = mixer(gathered[:, 0, order], None, AttentionBias(None, True, documents=documents), None)
    return out[:, mine]
