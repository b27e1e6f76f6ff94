"""The typed config: one dataclass group per concern, one field per GPT-NeoX key.

Keys are flat in YAML (GPT-NeoX style) and grouped here. ``KEYS`` maps every key name to
the group that owns it; ``NeoXConfig.get``/``set`` reach a key by its flat name.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from torchneox.config.fields import KeyInfo, info
from torchneox.config.keys.ft import FaultToleranceConfig
from torchneox.config.keys.guards import GuardConfig
from torchneox.config.keys.io import (
    DataConfig,
    DeepSpeedConfig,
    LauncherConfig,
    LoggingConfig,
    RuntimeConfig,
    TextGenConfig,
    TokenizerConfig,
)
from torchneox.config.keys.model import ModelConfig, MoEConfig
from torchneox.config.keys.rl import RolloutConfig
from torchneox.config.keys.train import (
    CheckpointConfig,
    LRConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
)


@dataclass
class NeoXConfig:
    """A whole GPT-NeoX config, as torchneox reads it."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lr: LRConfig = dataclasses.field(default_factory=LRConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    guards: GuardConfig = dataclasses.field(default_factory=GuardConfig)
    ft: FaultToleranceConfig = dataclasses.field(default_factory=FaultToleranceConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    textgen: TextGenConfig = dataclasses.field(default_factory=TextGenConfig)
    launcher: LauncherConfig = dataclasses.field(default_factory=LauncherConfig)
    deepspeed: DeepSpeedConfig = dataclasses.field(default_factory=DeepSpeedConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def get(self, name: str) -> Any:
        return getattr(getattr(self, KEYS[name].group), name)

    def set(self, name: str, value: Any) -> None:
        setattr(getattr(self, KEYS[name].group), name, value)

    def to_flat(self) -> dict[str, Any]:
        """Every key with its value, in schema order."""
        return {name: self.get(name) for name in KEYS}


@dataclass(frozen=True)
class KeySpec:
    """Everything known about one key: where it lives, its type, default and meaning."""

    name: str
    group: str
    type: Any
    default: Any
    info: KeyInfo

    @property
    def help(self) -> str:
        return self.info.help


def _default_of(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def _build_index() -> dict[str, KeySpec]:
    index: dict[str, KeySpec] = {}
    for group_field in dataclasses.fields(NeoXConfig):
        group_cls = group_field.default_factory
        hints = typing.get_type_hints(group_cls)
        for field in dataclasses.fields(group_cls):
            assert field.name not in index, f"key {field.name} declared twice"
            index[field.name] = KeySpec(
                name=field.name,
                group=group_field.name,
                type=hints[field.name],
                default=_default_of(field),
                info=info(field),
            )
    return index


KEYS: dict[str, KeySpec] = _build_index()

GROUP_TITLES: dict[str, str] = {
    f.name: (f.default_factory.__doc__ or f.name).strip().splitlines()[0]
    for f in dataclasses.fields(NeoXConfig)
}
