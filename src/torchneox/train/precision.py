"""fp32 / bf16 / fp16 training: autocast with fp32 master weights, and fp16 loss scaling."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from torchneox.config.features.loss_scale import loss_scale_spec
from torchneox.config.schema import PrecisionConfig
from torchneox.models.mixers.attention import cpu_attention_in_fp32, set_cpu_attention

DTYPES = {"fp32": torch.float32, "bfloat16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


@dataclass
class LossScaler:
    """DeepSpeed's dynamic loss scaler: halve on overflow once ``hysteresis`` overflows have
    been seen, double after ``window`` clean steps; a static scale when ``dynamic`` is False."""

    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    factor: float = 2.0
    current_hysteresis: int = 2
    step: int = 0
    last_overflow: int = -1
    skipped: int = 0

    @classmethod
    def from_config(cls, pr: PrecisionConfig, precision: str) -> LossScaler:
        """The scaler of the ``precision`` config group (none but fp16's is dynamic)."""
        if precision != "fp16":
            return cls()
        ls = loss_scale_spec(pr)
        if ls.static:
            return cls(scale=float(ls.static))
        hysteresis = int(ls.hysteresis)
        return cls(
            scale=2.0**ls.initial_scale_power,
            dynamic=True,
            window=int(ls.window),
            hysteresis=hysteresis,
            current_hysteresis=hysteresis,
            min_scale=float(ls.min_scale),
        )

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped += 1
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.current_hysteresis == 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.current_hysteresis -= 1
            self.last_overflow = self.step
        elif (self.step - self.last_overflow) % self.window == 0:
            self.current_hysteresis = self.hysteresis
            self.scale *= self.factor
        self.step += 1

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def choose_cpu_attention(
    model: torch.nn.Module,
    mode: str,
    args: Any,
    shape: tuple[int, int],
    masked: bool,
    dims: Any,
    precision: str,
    device: torch.device,
) -> None:
    """Training attention on the CPU under bf16/fp16 autocast in fp32 where ``cpu_attention``
    (``mode``) says so: auto times both at this run's shape (``shape``: the micro-batch and
    the sequence length; ``masked``: a mask beyond the causal one, as document masking and
    post-training batches have; this rank's heads); under context parallelism auto keeps the
    autocast dtype (each rank's queries meet every key there, a shape the measurement does not
    cover)."""
    if device.type != "cpu" or precision == "fp32" or (dims.cp > 1 and mode == "auto"):
        return
    micro_batch, length = shape
    masked = masked or args.sliding_window is not None or args.pos_emb in ("alibi", "rpe")
    fp32 = cpu_attention_in_fp32(
        mode, DTYPES[precision], micro_batch, args, length, masked, dims.tp
    )
    set_cpu_attention(model, fp32)
