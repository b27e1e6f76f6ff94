"""Which of two CPU kernels runs a shape faster, timed per machine and cached.

The fp32 linears (``cpu_matmul``, models/linear.py) and reduced-precision attention
(``cpu_attention``, models/mixers/attention.py) each have two ways to compute the same thing whose
speeds cross over with the shape and the processor: PyTorch's default and a challenger. A
verdict is measured the first time a shape is met and written to
``~/.cache/torchneox/cpu_kernels.json`` (or ``$TORCHNEOX_CPU_KERNEL_CACHE``), keyed by the CPU
model, the thread count and the torch version, with the times it rests on.

A verdict kept for every later run must never leave them slower than the default kernels, even
when it was timed while other work loaded the machine:

- the challenger is chosen only by a clear, repeated margin: ROUNDS interleaved rounds (the
  two kernels back to back, the order alternating), the challenger at most MARGIN of the
  default's time in at least WINS of them and in the medians; anything less keeps the default;
- a challenger verdict is timed once more the first time a later process uses it (a resumed
  run excepted: ``second_timing``); if the default wins that second timing the verdict is
  corrected in the file and a line says so (``take_corrections``, ``correction_line``), else
  it is marked confirmed and read as it is from then on;
- a default verdict is kept as it is (it can only cost what the default kernels cost).

Every later process reads the verdicts instead of timing again, so two runs compute with the
same kernels once a verdict is confirmed or corrected, and a resumed run, which never times a
verdict again, with those of the run it continues (it still equals an uninterrupted run bit
for bit). ``torchneox kernels`` shows the file, times it again or removes it.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

CACHE_ENV = "TORCHNEOX_CPU_KERNEL_CACHE"
MARGIN = 0.90  # the challenger must take at most this share of the default's time
ROUNDS = 7  # interleaved timed rounds of each kernel
WINS = 5  # rounds of ROUNDS the challenger must win by MARGIN

Timer = Callable[[dict[str, Callable[[], object]], int], dict[str, list[float]]]


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


def machine_key(threads: int | None = None) -> str:
    threads = torch.get_num_threads() if threads is None else threads
    return f"{cpu_model()} | {threads} threads | torch {torch.__version__}"


def cache_file() -> Path:
    default = Path.home() / ".cache" / "torchneox" / "cpu_kernels.json"
    return Path(os.environ.get(CACHE_ENV, default))


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


@dataclass
class Verdict:
    """A shape's verdict and what it rests on: each kernel's median time per call (ms), the
    rounds the challenger won by MARGIN, when and under what load (the 1-minute load average)
    it was timed, and whether a second timing in a later process confirmed it."""

    challenger: bool
    default_ms: float | None = None
    challenger_ms: float | None = None
    wins: int | None = None
    rounds: int | None = None
    measured: str | None = None
    load: float | None = None
    checked: bool = False

    @classmethod
    def from_json(cls, value: object) -> Verdict | None:
        """An entry of the file: a bare boolean (written before the times were kept: never
        confirmed) or this record; None for anything else."""
        if isinstance(value, bool):
            return cls(value)
        if not isinstance(value, dict) or not isinstance(value.get("challenger"), bool):
            return None
        verdict = cls(value["challenger"], checked=value.get("checked") is True)
        for f in fields(cls)[1:-1]:  # a value of the wrong type is left unknown
            v = value.get(f.name)
            kind = str if f.name == "measured" else (int, float)
            if isinstance(v, kind) and not isinstance(v, bool):
                setattr(verdict, f.name, v)
        return verdict


def time_rounds(kernels: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each kernel in ``rounds`` interleaved rounds, after one warm-up call
    of each: in a round the kernels run back to back (so both meet the same load), the first
    of them alternating from round to round; a round repeats a call until it has run a few
    milliseconds."""
    names = list(kernels)
    start = time.perf_counter()
    kernels[names[0]]()
    reps = max(1, int(3e-3 / max(time.perf_counter() - start, 1e-9)))
    for name in names[1:]:
        kernels[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            for _ in range(reps):
                kernels[name]()
            times[name].append((time.perf_counter() - start) / reps)
    return times


timer: Timer = time_rounds  # what every verdict is timed with (tests give deterministic times)


def judge(times: dict[str, list[float]]) -> Verdict:
    """The verdict of interleaved timings (``times``: seconds per call by round, of
    ``default`` and ``challenger``): the challenger only where it takes at most MARGIN of the
    default's time in WINS of ROUNDS rounds (scaled to the rounds given) and in the medians."""
    default, challenger = times["default"], times["challenger"]
    wins = sum(c <= MARGIN * d for d, c in zip(default, challenger, strict=True))
    d_med, c_med = statistics.median(default), statistics.median(challenger)
    needed = math.ceil(WINS / ROUNDS * len(default))
    return Verdict(
        challenger=wins >= needed and c_med <= MARGIN * d_med,
        default_ms=round(d_med * 1e3, 4),
        challenger_ms=round(c_med * 1e3, 4),
        wins=wins,
        rounds=len(default),
        measured=now(),
        load=load_average(),
    )


def compare(default: Callable[[], object], challenger: Callable[[], object]) -> Verdict:
    """Times ``default`` and ``challenger`` (the same work two ways) and judges them."""
    return judge(timer({"default": default, "challenger": challenger}, ROUNDS))


def challenger_faster(incumbent: Callable[[], object], challenger: Callable[[], object]) -> bool:
    """Whether ``challenger`` clearly beats ``incumbent`` (see ``judge``)."""
    return compare(incumbent, challenger).challenger


# ---------------------------------------------------------------------------- the cache file

# verdicts this process corrected: (shape, file, its times now: default ms, challenger ms)
_corrections: list[tuple[str, str, float | None, float | None]] = []
_warned: set[str] = set()
_timed_here: dict[tuple[str, str], bool] = {}  # verdicts this process timed, by (file, key)
second_timing = True  # False in a resumed run: it computes with the kernels of the run it continues


def take_corrections() -> list[tuple[str, str, float | None, float | None]]:
    """The verdicts this process corrected since the last call (for ``correction_line``)."""
    taken = list(_corrections)
    _corrections.clear()
    return taken


def read_table(path: Path) -> dict:
    """The JSON object in ``path`` ({} when missing); a damaged or unreadable file is ignored
    with a one-line warning (once per process), and rewritten by the next verdict."""
    try:
        table = json.loads(path.read_text())
        if isinstance(table, dict):
            return table
        problem = "not a JSON object"
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        problem = getattr(e, "strerror", None) or type(e).__name__
    if str(path) not in _warned:
        _warned.add(str(path))
        print(
            f"warning: {path} is damaged or unreadable ({problem}): ignored (timed afresh "
            "and rewritten when needed; `torchneox kernels --clear` removes it)",
            file=sys.stderr,
            flush=True,
        )
    return {}


def write_table(path: Path, table: dict) -> None:
    """``table`` written to ``path`` whole or not at all (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Holds ``path``'s lock file: processes starting together measure once and agree."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def as_verdict(result: Verdict | bool) -> Verdict:
    return result if isinstance(result, Verdict) else Verdict(bool(result), measured=now())


def cached_verdict(shape: str, measure: Callable[[], Verdict | bool]) -> bool:
    """This machine's verdict for ``shape`` (a name unique to the choice and the shape): read
    from the cache, else ``measure()``d and written there; an unconfirmed challenger verdict is
    measured again and confirmed or corrected (see the module's text)."""
    path, name = cache_file(), f"{machine_key()} | {shape}"
    if (str(path), name) in _timed_here:  # timed by this process: a second timing is for later
        return _timed_here[str(path), name]
    try:
        with locked(path):
            table = read_table(path)
            old = Verdict.from_json(table.get(name))
            if old is not None and (old.checked or not old.challenger or not second_timing):
                return old.challenger
            new = as_verdict(measure())
            if old is not None:  # a challenger verdict timed once: this is its second timing
                new.checked = True
            table[name] = asdict(new)
            _timed_here[str(path), name] = new.challenger
            written = str(path)
            try:
                write_table(path, table)
            except OSError:  # a full or read-only disk: kept in this process only
                written = ""
            if old is not None and not new.challenger:
                _corrections.append((shape, written, new.default_ms, new.challenger_ms))
            return new.challenger
    except OSError:  # no cache folder to be had (a read-only home): measured here only
        return as_verdict(measure()).challenger


def kernel_names(shape: str) -> tuple[str, str]:
    """The default and the challenger of a verdict's shape name."""
    return ("native", "fp32") if shape.startswith("attention ") else ("default", "oneDNN")


def shape_text(shape: str) -> str:
    return shape if shape.startswith("attention ") else f"linear {shape}"


def correction_line(corrections: list[tuple[str, str, float | None, float | None]]) -> str:
    """One line for the run's output on the verdicts corrected (``take_corrections``, from
    every rank)."""

    def times(shape: str, default_ms: float | None, challenger_ms: float | None) -> str:
        default, challenger = kernel_names(shape)
        if default_ms is None or challenger_ms is None:
            return shape_text(shape)
        return f"{shape_text(shape)}: {default} {default_ms:.3g} ms, {challenger} {challenger_ms:.3g} ms"

    shapes = "; ".join(
        times(shape, d, c) for shape, _, d, c in sorted(corrections, key=lambda c: c[0])
    )
    files = ", ".join(dict.fromkeys(path for _, path, _, _ in corrections if path))
    unwritten = any(not path for _, path, _, _ in corrections)
    saved = f"{files} updated" if files else ""
    if unwritten:  # a cache that could not be written keeps its old verdicts for later runs
        saved += ("; " if saved else "") + "the cache could not be rewritten (this run only)"
    many = len(corrections) > 1
    return (
        f"CPU kernel verdict{'s' if many else ''} corrected: the cached choice of the "
        f"non-default kernel lost to PyTorch's default when timed again at "
        f"{f'{len(corrections)} shapes' if many else 'one shape'} ({shapes}), which now run "
        f"on the default; {saved} (`torchneox kernels` shows every verdict)"
    )


# ------------------------------------------------------------------------ attention's timing


def fp32_attention_faster(
    dtype: torch.dtype, batch: int, heads: int, kv_heads: int, length: int, dim: int, masked: bool
) -> Verdict:
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

    return compare(lambda: run(False), lambda: run(True))
