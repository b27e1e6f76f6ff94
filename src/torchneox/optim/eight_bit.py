"""8-bit Adam (use_bnb_optimizer): over plain tensors bitsandbytes' Adam8bit where bitsandbytes
imports, else torchao's AdamW8bit; over DTensors (ZeRO 1-3, tensor, pipeline, expert
parallelism) torchao's, which steps each rank's part, every part quantised over the blocks one
process would (``row_placements``); both decoupled weight decay, as GPT-NeoX's Adam, over the
same decay / no-decay groups as every optimizer, with the StableEmbedding weight kept at 32-bit
state as bitsandbytes' StableEmbedding registers it (config/features/eight_bit.py: the rules
and the bytes)."""

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


def importable_library(o: OptimizerConfig | None = None, dtensors: bool | None = None) -> str:
    """The library ``o`` asks for (config/features/eight_bit.py: library_for; without ``o``,
    ZeRO 0's; ``dtensors``: whether the parameters are DTensors): bitsandbytes if it imports
    here, else torchao (one line if neither does)."""
    if library_for(o or OptimizerConfig(), dtensors) == "bitsandbytes":
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


def row_placements(p: torch.Tensor) -> list | None:
    """Where a DTensor parameter's 8-bit state is kept so that its blocks are the whole
    tensor's (the blocks one process quantises: 256 values in row-major order), or None where
    the parameter's own placements already give that. A part split on dim 0 only (ZeRO's
    shards, column-parallel and vocabulary-parallel weights, experts) is a range of whole rows;
    a part split on the last dim (row-parallel weights) is whole blocks where each rank's
    columns are a multiple of 256. Any other part (a [128, 128] attention output split in
    2 x 64 columns) is stepped in rows: every split axis moved to dim 0, one all-to-all for the
    gradient and the weight on the way in and one for the weight on the way back; its state
    stays in rows (placements decided from the shape and the mesh, the same on every rank)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor) or p.ndim < 2:
        return None
    columns, whole_rows = 1, True
    for size, placement in zip(p.device_mesh.shape, p.placements, strict=True):
        if size == 1 or placement.is_replicate() or placement.dim % p.ndim == 0:  # type: ignore[attr-defined]
            continue
        if placement.dim % p.ndim == p.ndim - 1:  # type: ignore[attr-defined]
            columns *= size
        else:
            whole_rows = False
    if whole_rows and (columns == 1 or p.shape[-1] % (BLOCK * columns) == 0):
        return None
    return [Replicate() if q.is_replicate() else Shard(0) for q in p.placements]


@functools.cache
def _torchao_class() -> type:
    from torchao.optim import AdamW8bit as TorchaoAdamW8bit

    class AdamW8bit(TorchaoAdamW8bit):
        """torchao's AdamW8bit, the parameters in ``keep_32bit`` at fp32 state, and each
        DTensor part whose values are not whole blocks of its tensor stepped in rows
        (``row_placements``), so that every rank quantises the blocks one process would."""

        def __init__(self, params: Any, keep_32bit: set[int], **kwargs: Any):
            self.keep_32bit = keep_32bit
            super().__init__(params, **kwargs)

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            """torchao keeps each group's rate as a tensor; the schedule sets a number."""
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)
            swapped = self._in_rows()
            try:
                loss = super().step(closure)
            finally:
                for group, i, p, rows in swapped:
                    group["params"][i] = p
                    del self.state[rows]
                    self.keep_32bit.discard(id(rows))
            for _, _, p, rows in swapped:  # the stepped rows back into the parameter's part
                p.to_local().copy_(rows.redistribute(p.device_mesh, p.placements).to_local())
            return loss

        def _in_rows(self) -> list[tuple[dict, int, torch.Tensor, torch.Tensor]]:
            """Each parameter to step in rows swapped for a copy in rows (its gradient too),
            which shares the parameter's state."""
            swapped = []
            for group in self.param_groups:
                for i, p in enumerate(group["params"]):
                    placements = row_placements(p) if p.grad is not None else None
                    if placements is None:
                        continue
                    rows = p.detach().redistribute(p.device_mesh, placements)
                    rows.grad = p.grad.redistribute(p.device_mesh, placements)
                    self.state[rows] = self.state[p]
                    if id(p) in self.keep_32bit:
                        self.keep_32bit.add(id(rows))
                    group["params"][i] = rows
                    swapped.append((group, i, p, rows))
            return swapped

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
    from torch.distributed.tensor import DTensor

    from torchneox.models.params import plain_name

    dtensors = any(isinstance(p, DTensor) for group in groups for p in group["params"])
    library = library or importable_library(o, dtensors)
    keep = {id(p) for n, p in model.named_parameters() if plain_name(n).endswith(STABLE_PARAMS)}
    p = spec.params
    kwargs = {"lr": lr, "betas": tuple(p.get("betas", (0.9, 0.999))), "eps": p.get("eps", 1e-8)}
    # (the dry run builds on fake tensors: bitsandbytes' quantisation maps are read as numbers)
    with unset_fake_temporarily():
        if library == "bitsandbytes":
            return _bnb_class()(groups, keep_32bit=keep, min_8bit_size=MIN_8BIT, **kwargs)
        return _torchao_class()(groups, keep_32bit=keep, block_size=BLOCK, **kwargs)
