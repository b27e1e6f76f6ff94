"""What a config asks of fp8 (``fp8_recipe``, GPT-NeoX's ``te_fp8_*``), as a plan that
``parallel/fp8.py`` applies with torchao and ``config explain`` describes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FP8Plan:
    recipe: str
    """torchao's recipe: tensorwise, rowwise or rowwise_with_gw_hp."""
    scope: str
    """blocks: every linear of the transformer blocks; attention: their attention's only."""
    grad_format: str | None = None
    """The output gradients' fp8 (te_fp8_format: hybrid e5m2, e4m3 e4m3); None: the recipe's."""
    wgrad_high_precision: bool = False
    """te_fp8_wgrad false: the weight gradient's product stays in high precision."""
    key: str = "fp8_recipe"


def fp8_plan(pr: Any, m: Any) -> FP8Plan | None:
    """What the (validated) ``precision`` and ``model`` config groups ask of fp8 (fp8_recipe;
    Transformer Engine's te_fp8_* keys), or None."""
    recipe = pr.fp8_recipe
    if m.te_fp8_mha:  # its delayed-scaling keys are checked by config/validate.py
        return FP8Plan(
            recipe or "tensorwise",
            "attention",
            grad_format="e5m2" if m.te_fp8_format == "hybrid" else "e4m3",
            wgrad_high_precision=not m.te_fp8_wgrad,
            key="te_fp8_mha",
        )
    return FP8Plan(recipe, "blocks") if recipe else None
