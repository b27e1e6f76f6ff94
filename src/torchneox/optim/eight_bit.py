"""8-bit Adam (use_bnb_optimizer): at ZeRO 0 bitsandbytes' Adam8bit where bitsandbytes imports,
else torchao's AdamW8bit; at ZeRO 1-3 torchao's, which steps FSDP2's DTensor shards (both
decoupled weight decay, as GPT-NeoX's Adam), over the same decay /
no-decay groups as every optimizer, with the StableEmbedding weight kept at 32-bit state as
bitsandbytes' StableEmbedding registers it (config/features/eight_bit.py: the rules and the bytes)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchneox.base.errors import ConfigError
from torchneox.config.features.eight_bit import BLOCK, MIN_8BIT, STABLE_PARAMS, library_for
from torchneox.config.features.optimizer import OptimizerSpec
from torchneox.config.schema import OptimizerConfig


def importable_library(o: OptimizerConfig | None = None) -> str:
    """The library ``o`` asks for (config/features/eight_bit.py: library_for; without ``o``,
    ZeRO 0's): bitsandbytes if it imports here, else torchao (one line if neither does)."""
    if library_for(o or OptimizerConfig()) == "bitsandbytes":
        try:
            import bitsandbytes.optim  # noqa: F401

            return "bitsandbytes"
        except Exception:  # an install whose native library does not load: torchao instead
            pass
    try:
        import torchao.optim  # noqa: F401
    except Exception as e:
        raise ConfigError(
            "use_bnb_optimizer needs bitsandbytes or torchao, and neither imports "
            f"({type(e).__name__}); pip install 'torchneox[bnb]' or drop use_bnb_optimizer",
            key="use_bnb_optimizer",
        ) from None
    return "torchao"


@functools.cache
def _bnb_class() -> type:
    import bitsandbytes as bnb

    class Adam8bit(bnb.optim.Adam8bit):
        """bitsandbytes' Adam8bit, the parameters in ``keep_32bit`` (StableEmbedding weights)
        at 32-bit state: what bnb.nn.StableEmbedding's GlobalOptimManager override does,
        without the process-wide manager."""

        def __init__(self, params: Any, keep_32bit: set[int], **kwargs: Any):
            super().__init__(params, **kwargs)
            self.keep_32bit = keep_32bit
            # a manager of its own: the process-wide one keys its overrides by id(), which a
            # parameter freed since (another model's) may have left to one of these
            self.mng = bnb.optim.GlobalOptimManager.__new__(bnb.optim.GlobalOptimManager)
            self.mng.initialize()

        def init_state(self, group=None, p=None, gindex=None, pindex=None) -> None:  # type: ignore[override]
            """bitsandbytes' one parameter's state; called bare (torchneox's checkpoint
            loader, as for SM3), every trained parameter's state without a step: the shapes
            a saved state is read into."""
            if group is not None:
                return super().init_state(group, p, gindex, pindex)
            for g, group in enumerate(self.param_groups):
                for i, p in enumerate(group["params"]):
                    if p.requires_grad and not self.state[p]:
                        super().init_state(group, p, g, i)
            return None

        def get_config(self, gindex: int, pindex: int, group: dict) -> dict:
            config = super().get_config(gindex, pindex, group)
            if id(group["params"][pindex]) in self.keep_32bit:
                config["optim_bits"] = 32
            return config

    return Adam8bit


@functools.cache
def _torchao_class() -> type:
    from torchao.optim import AdamW8bit as TorchaoAdamW8bit

    class AdamW8bit(TorchaoAdamW8bit):
        """torchao's AdamW8bit, the parameters in ``keep_32bit`` at fp32 state."""

        def __init__(self, params: Any, keep_32bit: set[int], **kwargs: Any):
            self.keep_32bit = keep_32bit
            super().__init__(params, **kwargs)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            """torchao keeps each group's rate as a tensor; the schedule sets a number."""
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
            return super().step(closure)

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            if id(p) in self.keep_32bit:
                return torch.zeros_like(p)
            return super()._new_buffer(p, signed)

    return AdamW8bit


def build_eight_bit_adam(
    model: nn.Module,
    groups: list[dict[str, Any]],
    spec: OptimizerSpec,
    lr: float,
    library: str | None = None,
    o: OptimizerConfig | None = None,
) -> torch.optim.Optimizer:
    """Adam with 8-bit moments over ``groups`` (each with its weight decay), with the betas
    and eps GPT-NeoX passes from optimizer.params; ``library``: bitsandbytes or torchao
    (default: the one ``o`` runs, config/features/eight_bit.py: library_for)."""
    from torchneox.models.params import plain_name

    library = library or importable_library(o)
    keep = {id(p) for n, p in model.named_parameters() if plain_name(n).endswith(STABLE_PARAMS)}
    p = spec.params
    kwargs = {"lr": lr, "betas": tuple(p.get("betas", (0.9, 0.999))), "eps": p.get("eps", 1e-8)}
    # (the dry run builds on fake tensors: bitsandbytes' quantisation maps are read as numbers)
    with unset_fake_temporarily():
        if library == "bitsandbytes":
            return _bnb_class()(groups, keep_32bit=keep, min_8bit_size=MIN_8BIT, **kwargs)
        return _torchao_class()(groups, keep_32bit=keep, block_size=BLOCK, **kwargs)
