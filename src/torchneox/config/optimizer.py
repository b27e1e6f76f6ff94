"""GPT-NeoX's ``optimizer`` dict read once: which optimizer, its learning rate, the keyword
arguments torch takes, and how many state tensors it keeps per parameter. The optimizer the
trainer builds, the derived values explain shows and the estimator's optimizer bytes all read
this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchneox.config.schema import OptimizerConfig

# not keyword arguments of the torch optimizers: clipping comes from gradient_clipping, the
# top-level weight_decay wins (as in GPT-NeoX), bias correction is always on (false is refused)
NOT_TORCH_PARAMS = ("lr", "max_grad_norm", "weight_decay", "bias_correction")


@dataclass(frozen=True)
class OptimizerSpec:
    kind: str  # adam | adamw | sgd | lion
    type_name: str | None  # as the config spells it (None: no optimizer dict, Adam)
    lr: float | None  # optimizer.params.lr, else lr
    weight_decay: float
    params: dict[str, Any] = field(default_factory=dict)  # optimizer.params as given
    torch_params: dict[str, Any] = field(default_factory=dict)

    @property
    def state_tensors(self) -> int:
        """Tensors of a parameter's size the optimizer keeps: Adam's two moments, Lion's one,
        SGD's momentum buffer when it has momentum."""
        if self.kind == "sgd":
            return 1 if float(self.params.get("momentum", 0.0) or 0.0) else 0
        return 1 if self.kind == "lion" else 2


def optimizer_spec(o: OptimizerConfig) -> OptimizerSpec:
    """The optimizer the ``optimizer`` config group describes."""
    opt = o.optimizer
    params = dict((opt or {}).get("params") or {})
    lr = params.get("lr", o.lr)
    return OptimizerSpec(
        kind=str(opt["type"]).lower() if opt is not None else "adam",
        type_name=str(opt["type"]) if opt is not None else None,
        lr=lr,
        weight_decay=o.weight_decay,
        params=params,
        torch_params={k: v for k, v in params.items() if k not in NOT_TORCH_PARAMS},
    )
