"""DiLoCo's outer state (ft_diloco_sync_every), built before a resume so that a checkpoint can
fill it: the outer SGD (its momentum), the weights at the last sync, and how many steps the run
has taken since that sync. Disk checkpoints save and resume all three (``checkpoint_tensors``,
``checkpoint_meta``, ``resume``), so a DiLoCo run stopped anywhere in a sync period and resumed
goes on as the run never stopped. torchft's DiLoCo (``attach``) takes the outer optimizer from
here, and hands a healing group the outer momentum and the last sync's weights itself (it
registers them with the Manager)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchneox.checkpoint.manager import DILOCO
from torchneox.config.checks.ft import replicated
from torchneox.optim.builder import load_optimizer_state, optimizer_state


def outer_state(trainer: Any) -> OuterState | None:
    """The run's DiLoCo outer state (None: no DiLoCo)."""
    f = trainer.cfg.ft
    if not replicated(trainer.cfg) or not f.ft_diloco_sync_every:
        return None
    return OuterState(trainer.model, f, trainer.logger.line)


def _spread(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A rank's part of a parameter as the whole (a DTensor when the parameter is one), so that
    a checkpoint holds it in any layout's terms."""
    if not isinstance(like, DTensor):
        return local
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


class OuterState:
    """The outer SGD, the last sync's weights (torchft's backup, or a checkpoint's until
    torchft's DiLoCo is attached) and the steps since the last sync."""

    KEY = DILOCO

    def __init__(self, model: torch.nn.Module, f: Any, line: Any) -> None:
        self.model, self.f, self.line = model, f, line
        self.outer = torch.optim.SGD(
            model.parameters(),
            lr=f.ft_diloco_outer_lr,
            momentum=f.ft_diloco_outer_momentum,
            nesterov=f.ft_diloco_outer_nesterov,
        )
        self.diloco: Any = None
        self.local_step = 0
        self.last_sync: dict[str, torch.Tensor] | None = None  # read from a checkpoint

    # ------------------------------------------------------------------ torchft's DiLoCo

    def attach(self, manager: Any, inner: torch.optim.Optimizer, device: torch.device) -> Any:
        """torchft's DiLoCo over the whole model (the run's optimizer inside, this SGD
        outside), started where a resumed checkpoint left it."""
        from torchft.local_sgd import DiLoCo

        f = self.f
        self.diloco = DiLoCo(
            manager,
            [self.model],
            inner,
            self.outer,
            sync_every=f.ft_diloco_sync_every,
            backup_device=device,
            pin_memory=False,
        )
        self._apply()  # DiLoCo backed up the weights as they are now
        return self.diloco

    def _apply(self) -> None:
        """A resumed checkpoint's last sync and place in the sync period, into DiLoCo."""
        if self.last_sync is not None:
            backup = self.diloco._fragments[0].original_parameters
            with torch.no_grad():
                for name, tensor in self.last_sync.items():
                    backup[name].copy_(tensor)
            self.last_sync = None
        self.diloco._local_step = self.local_step

    def steps_since_sync(self) -> int:
        return self.diloco._local_step if self.diloco is not None else self.local_step

    # ------------------------------------------------------------------- disk checkpoints

    def checkpoint_tensors(self, with_optimizer: bool) -> dict[str, Any]:
        """What a checkpoint saves of it: the last sync's weights (each rank's part, as the
        whole) and, unless ``with_optimizer`` is false (no_save_optim), the outer momentum."""
        backup = self.diloco._fragments[0].original_parameters
        params = dict(self.model.named_parameters())
        out: dict[str, Any] = {
            "last_sync": {name: _spread(t, params[name]) for name, t in backup.items()}
        }
        if with_optimizer and self.outer.state:  # no outer step yet: no momentum to save
            out["outer"] = optimizer_state(self.model, self.outer, True)
        return out

    def checkpoint_meta(self, tensors: dict[str, Any]) -> dict[str, Any]:
        return {"steps_since_sync": self.steps_since_sync(), "has_outer": "outer" in tensors}

    def template(self, meta: dict[str, Any], with_optimizer: bool) -> dict[str, Any]:
        """Tensors to read a checkpoint's DiLoCo part into (``with_optimizer``: the outer
        momentum too, when it holds one)."""
        out: dict[str, Any] = {
            "last_sync": {n: torch.empty_like(p.detach()) for n, p in self.model.named_parameters()}
        }
        if with_optimizer and meta.get("has_outer"):
            for p in self.model.parameters():  # SGD makes its momentum at its first step
                self.outer.state[p]["momentum_buffer"] = torch.zeros_like(p.detach())
            out["outer"] = optimizer_state(self.model, self.outer, True)
        return out

    def resume(self, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        """A checkpoint's DiLoCo part (read into ``template``'s tensors)."""
        self.last_sync = {
            n: t.to_local() if isinstance(t, DTensor) else t
            for n, t in tensors["last_sync"].items()
        }
        if "outer" in tensors:
            load_optimizer_state(self.model, self.outer, tensors["outer"], True)
        every = self.f.ft_diloco_sync_every
        self.local_step = meta["steps_since_sync"]
        if self.local_step >= every:  # saved with a longer period: sync at the next step
            self.local_step = every - 1
        if self.diloco is not None:  # a rewind to the last checkpoint, mid-run
            self._apply()
        self.line(
            f"DiLoCo: resumed the weights of the last sync, "
            f"{'the outer momentum' if 'outer' in tensors else 'no outer momentum'} and "
            f"{meta['steps_since_sync']} steps since the sync"
        )
