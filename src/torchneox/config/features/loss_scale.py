"""GPT-NeoX's fp16 loss-scale settings read once (``fp16`` dict first, then the top-level
keys): explain's description and the trainer's LossScaler both read this."""

from __future__ import annotations

from dataclasses import dataclass

from torchneox.config.features.deepspeed_dicts import amp_loss_scale
from torchneox.config.schema import PrecisionConfig


@dataclass(frozen=True)
class LossScaleSpec:
    static: float  # 0: dynamic
    initial_scale_power: float
    window: int
    hysteresis: int
    min_scale: float

    @property
    def dynamic(self) -> bool:
        return not self.static


def loss_scale_spec(pr: PrecisionConfig) -> LossScaleSpec:
    """fp16's loss scale as the ``precision`` config group sets it."""
    fp16 = pr.fp16 or amp_loss_scale(pr) or {}  # apex's loss scaling when amp makes it fp16
    return LossScaleSpec(
        static=fp16.get("loss_scale", pr.loss_scale) or 0,
        initial_scale_power=fp16.get("initial_scale_power", 16),
        window=fp16.get("loss_scale_window", pr.loss_scale_window),
        hysteresis=fp16.get("hysteresis", pr.hysteresis),
        min_scale=fp16.get("min_loss_scale", pr.min_scale),
    )
