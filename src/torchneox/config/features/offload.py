"""ZeRO-Offload read once: GPT-NeoX's ``zero_optimization.offload_optimizer`` /
``offload_param`` (DeepSpeed's dicts), the older ``cpu_offload``, ``cpu_offload_params`` and
``cpu_offload_use_pin_memory``, and the optimizer types ``cpu_adam`` / ``cpu_torch_adam``
(DeepSpeed's CPU Adam, which steps parameters held in host memory: they imply offload).

torchneox offloads through FSDP2's ``CPUOffloadPolicy``: each rank's parameter shards, their
gradients and the optimizer state live in host memory and the optimizer step runs on the CPU,
in every layout of ZeRO 1-3 (tensor, pipeline, context and expert parallelism too: FSDP2
shards over the data-parallel axis of the run's one device mesh, a lone data-parallel rank
over that axis of one). Expert weights under expert parallelism are not ZeRO's to shard (each
rank holds its own experts whole), so they, their gradients and their state stay on the device.
FSDP2 has no optimizer-only offload, so ``offload_optimizer`` offloads the parameter shards
too (explain and docs/migrating-from-gpt-neox.md say so). NVMe (ZeRO-Infinity), partial
offload (``ratio``) and stage 0 are refused in one line; the trainer, explain and the
estimator read ``offload_spec``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchneox.base.errors import did_you_mean

if TYPE_CHECKING:
    from torchneox.config.derived import Derived
    from torchneox.config.schema import NeoXConfig

CPU_ADAM_TYPES = ("cpu_adam", "cpu_torch_adam")
OLD_KEYS = {"cpu_offload": "offload_optimizer", "cpu_offload_params": "offload_param"}
DICT_KEYS = ("offload_optimizer", "offload_param")
OFFLOAD_KEYS = ("cpu_offload", "cpu_offload_params", *DICT_KEYS)
"""The zero_optimization entries that switch offload on."""
PIN_KEY = "cpu_offload_use_pin_memory"
DEVICES = ("cpu", "nvme", "none")
NVME_ONLY = (
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
)
"""DeepSpeed's ZeRO-Infinity buffers: read for device nvme only (noted as no effect on cpu)."""
DICT_ENTRIES = ("device", "pin_memory", "ratio", *NVME_ONLY)


@dataclass(frozen=True)
class Offload:
    """What a config asks to offload. ``by``: the keys that ask (for messages and explain)."""

    enabled: bool = False
    pin_memory: bool = False
    by: tuple[str, ...] = ()
    optimizer_type: str | None = None  # cpu_adam / cpu_torch_adam when the optimizer asks


def _device(value: Any) -> str:
    """The device an entry names: a dict's ``device``, a bool (the old keys) cpu or none."""
    if isinstance(value, dict):
        return str(value.get("device", "none")).lower()
    return "cpu" if value else "none"


def offload_spec(zero: dict[str, Any] | None, optimizer: dict[str, Any] | None) -> Offload:
    """The offload a (validated) config asks for."""
    zero = zero or {}
    by = tuple(k for k in OFFLOAD_KEYS if _device(zero.get(k)) == "cpu")
    kind = str((optimizer or {}).get("type", "")).lower()
    cpu_adam = kind if kind in CPU_ADAM_TYPES else None
    if cpu_adam:
        by += (f"optimizer.type {cpu_adam}",)
    pin = bool(zero.get(PIN_KEY)) or any(
        isinstance(zero.get(k), dict) and bool(zero[k].get("pin_memory")) for k in DICT_KEYS
    )
    return Offload(bool(by), pin and bool(by), by, cpu_adam)


def offload_problem(
    zero: dict[str, Any] | None, optimizer: dict[str, Any] | None
) -> tuple[str, str] | None:
    """The first thing wrong with the offload entries: (the entry to name, the message), or
    None. The entry is a zero_optimization sub-key, or ``optimizer`` for cpu_adam."""
    zero = zero or {}
    for name in OFFLOAD_KEYS:
        problem = _entry_problem(name, zero.get(name))
        if problem is not None:
            return name, problem
    spec = offload_spec(zero, optimizer)
    if not spec.enabled:
        return None
    stage = zero.get("stage", 0)
    first = spec.by[0]
    where = "optimizer" if first.startswith("optimizer.") else first
    if stage == 0:
        return where, (
            f"{first} offloads from ZeRO's sharded optimizer, which stage 0 does not run (as in "
            "DeepSpeed); set zero_optimization.stage to 1, 2 or 3"
        )
    param = [k for k in ("offload_param", "cpu_offload_params") if k in spec.by]
    if param and stage != 3:
        return param[0], (
            f"{param[0]} needs zero_optimization.stage 3 (DeepSpeed offloads parameters at "
            "stage 3 only); at stage 1 or 2 use offload_optimizer, which here offloads the "
            "parameter shards too (FSDP2's CPU offload)"
        )
    return None


def _entry_problem(name: str, value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        if name in DICT_KEYS and isinstance(value, bool):
            return f"{name} is a mapping ({{device: cpu, pin_memory: ...}}), got {value!r}"
        return None
    if name in OLD_KEYS:
        return f"{name} must be true or false, got {value!r}"
    if not isinstance(value, dict):
        return f"{name} must be a mapping such as {{device: cpu}}, got {value!r}"
    for entry in value:
        if entry not in DICT_ENTRIES:
            return f"{name}: unknown entry {entry!r}{did_you_mean(str(entry), DICT_ENTRIES)}"
    device = str(value.get("device", "none")).lower()
    if device not in DEVICES:
        return f"{name}.device must be cpu, nvme or none, got {value.get('device')!r}"
    if device == "nvme":
        return (
            f"{name}.device nvme (ZeRO-Infinity's NVMe swapping) is DeepSpeed-only, torch has no "
            "equivalent; use device: cpu (host memory)"
        )
    ratio = value.get("ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
        return f"{name}.ratio must be a number in [0, 1], got {ratio!r}"
    if ratio != 1 and device == "cpu":
        return (
            f"{name}.ratio {ratio} (partial offload) is not built: FSDP2 offloads every shard; "
            "remove ratio"
        )
    if not isinstance(value.get("pin_memory", False), bool):
        return f"{name}.pin_memory must be true or false, got {value['pin_memory']!r}"
    return None


def offload_notes(zero: dict[str, Any] | None) -> dict[str, str]:
    """The offload entries that change nothing here -> why (config explain's notes)."""
    notes = {}
    if (zero or {}).get(PIN_KEY) and not offload_spec(zero, None).by:
        notes[f"zero_optimization.{PIN_KEY}"] = "nothing is offloaded"
    for name in DICT_KEYS:
        value = (zero or {}).get(name)
        if isinstance(value, dict):
            for entry in value.keys() & set(NVME_ONLY):
                notes[f"zero_optimization.{name}.{entry}"] = (
                    "ZeRO-Infinity's NVMe buffers; CPU offload has none"
                )
    return notes


BYTES = 4  # fp32 master shards, gradients and optimizer state


def host_bytes_per_rank(parameters: int, shard_ranks: int, state_tensors: int) -> dict[str, int]:
    """What one rank keeps in host memory under offload: its fp32 shard of the parameters,
    of their gradients and of the optimizer's state tensors (each a parameter's size)."""
    shard = -(-parameters // shard_ranks)
    return {
        "parameters": shard * BYTES,
        "gradients": shard * BYTES,
        "optimizer": shard * BYTES * state_tensors,
    }


def derive_offload(cfg: NeoXConfig, out: Derived) -> None:
    """``zero_offload``: cpu or none, what it does to the run and, with the parameter count
    known, the host memory each rank holds."""
    from torchneox.config.features.optimizer import optimizer_spec

    spec = offload_spec(cfg.optimizer.zero_optimization, cfg.optimizer.optimizer)
    why = describe_offload(spec)
    backend = out.get("distributed_backend")
    if spec.enabled and isinstance(backend, str):  # (parallel/dims.py: init_distributed)
        out.values["distributed_backend"] = backend.replace(
            " on GPU", " + gloo (the offloaded host tensors) on GPU", 1
        )
    params = out.get("num_parameters")
    if spec.enabled and params:
        # ZeRO's shard group (the data- and context-parallel ranks) x the tensor and
        # pipeline ranks, which split the model before ZeRO shards it
        zero_ranks = (cfg.optimizer.zero_optimization or {}).get("mics_shard_size") or (
            out.get("data_parallel_size", 1) * (out.get("context_parallel_size") or 1)
        )
        ranks = zero_ranks * (out.get("model_parallel_size") or 1) * out.get("pipeline_stages", 1)
        state = optimizer_spec(cfg.optimizer).state_tensors
        host = host_bytes_per_rank(params, ranks, state)
        out.put("zero_offload", "cpu", why)
        out.put(
            "offload_host_bytes_per_rank",
            sum(host.values()),
            f"{sum(host.values()) / 2**30:.3g} GiB of host memory per rank: 1/{ranks} of "
            f"{params:,} parameters in fp32 ({host['parameters'] / 2**30:.3g} GiB), their "
            f"gradients ({host['gradients'] / 2**30:.3g} GiB) and {state} optimizer state "
            f"tensors ({host['optimizer'] / 2**30:.3g} GiB); the optimizer step runs on the CPU",
        )
        return
    out.put("zero_offload", "cpu" if spec.enabled else "none", why)


def describe_offload(spec: Offload) -> str:
    """The reason explain prints for the derived value ``zero_offload``."""
    if not spec.enabled:
        return "none: parameters, gradients and optimizer state stay on the device"
    pinned = "pinned (page-locked) on GPUs" if spec.pin_memory else "not pinned"
    implied = (
        f"; optimizer.type {spec.optimizer_type} (DeepSpeed's CPU Adam) steps parameters held "
        "in host memory, so it implies offload; it runs as torch's AdamW"
        if spec.optimizer_type
        else ""
    )
    return (
        f"cpu, from {', '.join(spec.by)}: FSDP2's CPUOffloadPolicy keeps each rank's parameter "
        "shards (fp32), their gradients and the optimizer state in host memory ("
        f"{pinned}), copies the shards to the device for each gather and runs the optimizer "
        "step on the CPU; FSDP2 has no optimizer-only offload, so offload_optimizer offloads "
        f"the parameter shards too; expert weights under expert parallelism (not ZeRO's "
        f"shards) stay on the device{implied}"
    )
