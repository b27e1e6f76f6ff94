"""Peak throughput of accelerators, for MFU and the estimator: one table, one place.

Dense (no sparsity) peaks in TFLOP/s from the vendors' data sheets; memory in GiB; the
interconnect is the per-GPU bandwidth between GPUs of one node in GB/s.
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from torchneox.models import cpu_kernels, linear


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_tflops: float
    fp16_tflops: float
    fp32_tflops: float
    memory_gib: float
    interconnect_gbps: float


ACCELERATORS: dict[str, Accelerator] = {
    "h200": Accelerator("NVIDIA H200 SXM", 989.0, 989.0, 67.0, 141.0, 900.0),
    "h100": Accelerator("NVIDIA H100 SXM", 989.0, 989.0, 67.0, 80.0, 900.0),
    "h100-pcie": Accelerator("NVIDIA H100 PCIe", 756.0, 756.0, 51.0, 80.0, 128.0),
    "a100-80gb": Accelerator("NVIDIA A100 SXM 80GB", 312.0, 312.0, 19.5, 80.0, 600.0),
    "a100-40gb": Accelerator("NVIDIA A100 SXM 40GB", 312.0, 312.0, 19.5, 40.0, 600.0),
    "a10g": Accelerator("NVIDIA A10G", 125.0, 125.0, 31.2, 24.0, 64.0),
    "l40s": Accelerator("NVIDIA L40S", 362.0, 362.0, 91.6, 48.0, 64.0),
    "v100": Accelerator("NVIDIA V100 SXM", 125.0, 125.0, 15.7, 32.0, 300.0),
    "mi300x": Accelerator("AMD MI300X", 1307.0, 1307.0, 163.4, 192.0, 896.0),
}


def detect(device: torch.device) -> Accelerator | None:
    """The table entry for a CUDA device, matched by its name."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "a100", "a10g", "l40s", "v100", "mi300x"):
        if key in name:
            if key == "a100":
                total = torch.cuda.get_device_properties(device).total_memory / 2**30
                return ACCELERATORS["a100-80gb" if total > 50 else "a100-40gb"]
            if key == "h100" and "pcie" in name:
                return ACCELERATORS["h100-pcie"]
            return ACCELERATORS[key]
    return None


def peak_tflops(acc: Accelerator, precision: str) -> float:
    return {"bfloat16": acc.bf16_tflops, "fp16": acc.fp16_tflops}.get(precision, acc.fp32_tflops)


@functools.lru_cache(maxsize=2)
def _product(dtype: torch.dtype, size: int, kernel: str) -> Callable[[], object]:
    """One ``size`` x ``size`` matmul in ``dtype`` by ``kernel`` (default, or onednn: oneDNN's
    product of models/linear.py), warmed up once: ``peak_trials``' interleaved trials reuse it
    (a 1024-wide bf16 product takes 0.3 s on a CPU without bf16 units) and clear it after."""
    # its own generator: measuring (the first run on a machine) must not move the global RNG
    # that dropout draws from, or that run would train differently from every later one
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    product = (lambda: linear._mm(a, b)) if kernel == "onednn" else (lambda: a @ b)
    product()
    return product


def _tflops(product: Callable[[], object], size: int, seconds: float) -> float:
    """TFLOP/s of ``product`` (a ``size``-cubed matmul) run for at least ``seconds``."""
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        product()
        count += 1
    return 2 * size**3 * count / (time.perf_counter() - start) / 1e12


def measure_cpu_tflops(
    dtype: torch.dtype = torch.float32,
    size: int = 512,
    seconds: float = 0.3,
    trials: int = 1,
    kernel: str = "default",
) -> float:
    """Achieved matmul TFLOP/s of this CPU (all threads torch uses): the best of ``trials``
    timings, so that a moment of competition for the cores does not lower the peak. ``kernel``
    onednn times oneDNN's product (models/linear.py) instead of PyTorch's default one."""
    product = _product(dtype, size, kernel)
    return max(_tflops(product, size, seconds) for _ in range(trials))


def peak_trials(
    dtype: torch.dtype, size: int = 1024, seconds: float = 0.2, trials: int = 5
) -> dict[str, list[float]]:
    """TFLOP/s of each kernel the run may use in ``dtype`` (for fp32 PyTorch's default and,
    where PyTorch has it, oneDNN) in ``trials`` interleaved timings: the kernels take turns,
    so a moment of competition for the cores lowers one trial of each, not a kernel's every
    trial. Each kernel is warmed up once (``_product``)."""
    kernels = ["default"]
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        kernels.append("onednn")
    out: dict[str, list[float]] = {k: [] for k in kernels}
    try:
        for _ in range(trials):
            for kernel in kernels:
                out[kernel].append(measure_cpu_tflops(dtype, size, seconds, 1, kernel=kernel))
    finally:
        _product.cache_clear()
    return out


def peak_record(trials: dict[str, list[float]]) -> dict:
    """The cache's record of a peak: the best trial of the faster kernel, and how noisy its
    trials were (the slowest and the median beside the best), when and under what load."""
    kernel = max(trials, key=lambda k: max(trials[k]))
    best = trials[kernel]
    return {
        "tflops": max(best),
        "kernel": kernel,
        "trials": len(best),
        "median": statistics.median(best),
        "slowest": min(best),
        "measured": cpu_kernels.now(),
        "load": cpu_kernels.load_average(),
    }


def machine_cpu_tflops(dtype: torch.dtype, size: int = 1024, seconds: float = 0.2, trials: int = 5):
    """The machine's matmul peak in ``dtype``: for fp32 the faster of PyTorch's default kernel
    and oneDNN (where PyTorch has it), whichever the run uses."""
    return peak_record(peak_trials(dtype, size, seconds, trials))["tflops"]


CPU_PEAK_ENV = "TORCHNEOX_CPU_PEAK_CACHE"
DTYPES = {"fp32": torch.float32, "bfloat16": torch.bfloat16, "fp16": torch.float16}


def cpu_peak_file() -> Path:
    default = Path.home() / ".cache" / "torchneox" / "cpu_peak.json"
    return Path(os.environ.get(CPU_PEAK_ENV, default))


def _cpu_key(precision: str, threads: int | None = None) -> str:
    # "best kernel": peaks cached before fp32 counted oneDNN are not reused
    return f"{cpu_kernels.machine_key(threads)} | {precision} | best kernel"


def peak_value(entry: object) -> float | None:
    """The TFLOP/s of a cache entry (a number, as written before the record, or a record)."""
    value = entry.get("tflops") if isinstance(entry, dict) else entry
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return float(value) if ok and math.isfinite(value) else None


def cpu_peak_tflops(precision: str) -> float:
    """This CPU's matmul peak in ``precision``, measured once (the best of several interleaved
    timings of a 1024 x 1024 GEMM, on the faster kernel) and cached per CPU model, thread count
    and torch version, so that MFU is measured against the same figure every run."""
    path, key = cpu_peak_file(), _cpu_key(precision)
    cached = peak_value(cpu_kernels.read_table(path).get(key))
    if cached is not None:
        return cached
    record = peak_record(peak_trials(DTYPES.get(precision, torch.float32)))
    store_cpu_peak(key, record)
    return record["tflops"]


def store_cpu_peak(key: str, record: dict) -> None:
    """``record`` written under ``key``, whole or not at all (kept in this process only where
    the file cannot be written)."""
    path = cpu_peak_file()
    try:
        with cpu_kernels.locked(path):
            table = cpu_kernels.read_table(path)
            table[key] = record
            cpu_kernels.write_table(path, table)
    except OSError:
        pass  # a read-only home: measured again next time


def raise_cpu_peak(precision: str, tflops: float) -> None:
    """Record a higher peak than the cached one (a step ran faster than the measured peak)."""
    key = _cpu_key(precision)
    entry = cpu_kernels.read_table(cpu_peak_file()).get(key)
    if (peak_value(entry) or 0.0) >= tflops:
        return
    record = dict(entry) if isinstance(entry, dict) else {}
    store_cpu_peak(key, record | {"tflops": tflops, "raised_by_a_step": cpu_kernels.now()})


REDUCED_UNITS = {"bfloat16": "AVX512-BF16 or AMX", "fp16": "AVX512-FP16 or AMX-FP16"}


def cpu_precision_warning(precision: str) -> str | None:
    """A warning line where ``precision``'s matmuls run slower on this CPU than fp32's (a CPU
    without bf16 or fp16 units: bf16 about 150x slower per GEMM on one AVX2 machine), so that
    choosing it trains slower, not faster; None where it pays or for fp32."""
    if precision not in REDUCED_UNITS:
        return None
    low, full = cpu_peak_tflops(precision), cpu_peak_tflops("fp32")
    if low >= full:
        return None
    return (
        f"warning: precision {precision} on this CPU ({cpu_kernels.cpu_model()}): its "
        f"{precision} matmuls run at {low:.3g} TFLOP/s against fp32's {full:.3g} (it has no "
        f"{REDUCED_UNITS[precision]} units), so this run is slower than it would be in fp32; "
        "set precision fp32 here, or train on a GPU"
    )


# ------------------------------------------------------------------------------ memory


def peak_memory(device: torch.device) -> list[float]:
    """This process's peak memory so far, in bytes: on a GPU what torch allocated and reserved
    there; on the CPU the resident set's high-water mark (VmHWM; 0 where /proc is missing)."""
    if device.type == "cuda":
        return [
            float(torch.cuda.max_memory_allocated(device)),
            float(torch.cuda.max_memory_reserved(device)),
        ]
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return [float(line.split()[1]) * 1024]
    except OSError:
        pass
    return [0.0]


def memory_line(when: str, device: torch.device, peaks: list[list[float]]) -> str:
    """'peak memory after building: ...' for every rank (``peaks``: each rank's
    ``peak_memory``)."""

    def mib(b: float) -> str:
        return f"{b / 2**20:,.0f}"

    if device.type == "cuda":
        what = "GPU memory allocated / reserved (MiB)"
        values = [f"{mib(a)}/{mib(r)}" for a, r in peaks]
    else:
        what = "resident memory (MiB)"
        values = [mib(p[0]) for p in peaks]
    ranks = "rank 0" if len(peaks) == 1 else f"ranks 0-{len(peaks) - 1}"
    return f"peak {what} {when}, {ranks}: {', '.join(values)}"
