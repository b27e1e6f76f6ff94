"""Which of two CPU kernels runs a shape faster, timed once per machine and cached.

The fp32 linears (``cpu_matmul``, models/linear.py) and reduced-precision attention
(``cpu_attention``, models/attention.py) each have two ways to compute the same thing whose
speeds cross over with the shape and the processor. A verdict is measured the first time a
shape is met and written to ``~/.cache/torchneox/cpu_kernels.json`` (or
``$TORCHNEOX_CPU_KERNEL_CACHE``), keyed by the CPU model, the thread count and the torch
version; every later run on the machine reads it instead of timing again, so two runs compute
with the same kernels (a resumed run still equals an uninterrupted one bit for bit).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

CACHE_ENV = "TORCHNEOX_CPU_KERNEL_CACHE"
MARGIN = 0.95  # the challenger must take at most this share of the incumbent's time
ROUNDS = 4  # timed rounds of each kernel


@cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_key() -> str:
    return f"{cpu_model()} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def cache_file() -> Path:
    default = Path.home() / ".cache" / "torchneox" / "cpu_kernels.json"
    return Path(os.environ.get(CACHE_ENV, default))


def cached_verdict(shape: str, measure: Callable[[], bool]) -> bool:
    """This machine's verdict for ``shape`` (a name unique to the choice and the shape): read
    from the cache, else ``measure()``d and written there (under a lock: processes starting
    together measure once and agree)."""
    path, name = cache_file(), f"{_machine_key()} | {shape}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                table = json.loads(path.read_text())
            except (OSError, ValueError):
                table = {}
            if not isinstance(table, dict):
                table = {}
            if isinstance(table.get(name), bool):
                return table[name]
            table[name] = verdict = measure()
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            os.replace(tmp, path)
            return verdict
    except OSError:  # a read-only home: measured in this process only
        return measure()


def challenger_faster(incumbent: Callable[[], object], challenger: Callable[[], object]) -> bool:
    """Whether ``challenger`` takes at most MARGIN of ``incumbent``'s time, best of ROUNDS
    alternating rounds after a warm-up round; each round repeats a call until it has run a few
    milliseconds. The best round of each is the one least disturbed by whatever else runs."""
    kernels = {"incumbent": incumbent, "challenger": challenger}
    start = time.perf_counter()
    incumbent()
    reps = max(1, int(3e-3 / max(time.perf_counter() - start, 1e-9)))
    best = dict.fromkeys(kernels, float("inf"))
    for round_ in range(ROUNDS + 1):
        for name, run in kernels.items():
            start = time.perf_counter()
            for _ in range(reps):
                run()
            if round_:  # the first round warms both up
                best[name] = min(best[name], time.perf_counter() - start)
    return best["challenger"] <= MARGIN * best["incumbent"]


def fp32_attention_faster(
    dtype: torch.dtype, batch: int, heads: int, kv_heads: int, length: int, dim: int, masked: bool
) -> bool:
    """Whether causal attention's forward and backward on ``dtype`` queries, keys and values
    [batch, heads, length, dim] run faster computed in fp32 (the inputs cast up, the output
    cast back) than in ``dtype`` itself; ``masked``: by an explicit boolean mask rather than
    the causal flag. Large shapes are timed on fewer sequences (the work is per sequence)."""
    batch = min(batch, max(1, int(2e8 // (heads * length * length * dim))))
    g = torch.Generator().manual_seed(0)  # its own: the global RNG is left alone
    q = torch.randn(batch, heads, length, dim, generator=g).to(dtype)
    kv = [torch.randn(batch, kv_heads, length, dim, generator=g).to(dtype) for _ in range(2)]
    grad = torch.randn(batch, heads, length, dim, generator=g).to(dtype)
    mask = torch.ones(length, length, dtype=torch.bool).tril() if masked else None
    leaves = [t.requires_grad_(True) for t in (q, *kv)]

    def run(upcast: bool) -> None:
        args = [t.float() for t in leaves] if upcast else leaves
        out = F.scaled_dot_product_attention(
            *args, attn_mask=mask, is_causal=not masked, enable_gqa=kv_heads != heads
        )
        out.to(dtype).backward(grad)

    return challenger_faster(lambda: run(False), lambda: run(True))
