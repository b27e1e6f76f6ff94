"""Whether a model can be held at all, said in one line before it is built: a ``hidden_size``
(or depth, or vocabulary) too large for any machine, or for this one, is the user's mistake,
with what the model would take (its parameters' bytes, from derive's count), never an
allocation's traceback."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torchneox.base.errors import ConfigError, first_line

PARAM_BYTES = 4  # fp32 parameters (masters); gradients and optimizer state come on top
ADDRESSABLE_BYTES = 1 << 63  # torch counts a tensor's bytes in an int64; no machine holds more
ALLOCATION_FAILURES = ("can't allocate memory", "out of memory", "storage size calculation")


def _size(n: float) -> str:
    for unit, size in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30)):
        if n >= size:
            return f"{n / size:,.3g} {unit}" if n < 1e6 * size else f"{n / size:.3e} {unit}"
    return f"{n / (1 << 20):.3g} MiB"


def model_size(loaded: Any, num_parameters: int) -> str:
    """'hidden_size 1,000,000 with 2 layers: 2.4e+13 parameters take 87.3 TiB in fp32 (the
    parameters alone)'."""
    m = loaded.config.model
    return (
        f"hidden_size {m.hidden_size:,} with {m.num_layers:,} layers: {num_parameters:.4g} "
        f"parameters take {_size(num_parameters * PARAM_BYTES)} in fp32 (the parameters alone, "
        "before gradients and optimizer state)"
    )


def refuse_unaddressable(loaded: Any, num_parameters: int) -> None:
    """A model whose parameters pass 2^63 bytes: no layout of any machine holds it, and torch
    cannot even describe its tensors."""
    if num_parameters * PARAM_BYTES >= ADDRESSABLE_BYTES:
        raise ConfigError(
            f"{model_size(loaded, num_parameters)}, past the 2^63 bytes torch can address: "
            "is it a typo?",
            source=loaded.source("hidden_size"),
            key="hidden_size",
        )


def _kind(device: Any) -> str:
    return device if isinstance(device, str) else device.type


def free_bytes(device: Any) -> int | None:
    """Memory this device (a torch.device, or "cpu") has free now (the CPU's MemAvailable),
    or None where unknown."""
    if _kind(device) == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _too_large(loaded: Any, num_parameters: int, ranks: int, free: int, where: str) -> ConfigError:
    each = math.ceil(num_parameters * PARAM_BYTES / ranks)
    spread = f", at least {_size(each)} on each of this run's {ranks} ranks" if ranks > 1 else ""
    return ConfigError(
        f"{model_size(loaded, num_parameters)}{spread}, more than the {_size(free)} free "
        f"{where}: use a smaller model, or more GPUs (torchneox estimate CONFIG --gpus N says "
        "how many and how to lay them out)",
        source=loaded.source("hidden_size"),
        key="hidden_size",
    )


def refuse_what_cannot_fit(
    loaded: Any, num_parameters: int, ranks: int, local_ranks: int, device: Any
) -> None:
    """Before building: refused when even each rank's share of the parameters alone (ZeRO 3
    over every rank, the most any layout splits them) passes what this device has free."""
    refuse_unaddressable(loaded, num_parameters)
    free = free_bytes(device)
    share = math.ceil(num_parameters * PARAM_BYTES / ranks)
    here = local_ranks if _kind(device) == "cpu" else 1  # a machine's processes share memory
    if free is not None and share * here > free:
        raise _too_large(loaded, num_parameters, ranks, free, f"on this {_kind(device)}")


def allocation_failure(
    loaded: Any, num_parameters: int, device: Any, error: BaseException
) -> ConfigError | None:
    """The one line for a build that ran out of memory (what the check before it let through:
    gradients, optimizer state, a reference model), or None for any other error."""
    import torch

    text = str(error).lower()
    if not isinstance(error, torch.OutOfMemoryError) and not any(
        s in text for s in ALLOCATION_FAILURES
    ):
        return None
    return ConfigError(
        f"{model_size(loaded, num_parameters)}: building it ran out of memory on this "
        f"{device.type} ({first_line(error)[:120]}): use a smaller model, or more GPUs "
        "(torchneox estimate CONFIG --gpus N says how many and how to lay them out)",
        source=loaded.source("hidden_size"),
        key="hidden_size",
    )
