"""``torchneox kernels``: the CPU kernel verdicts and matmul peaks this machine has cached
(models/cpu_kernels.py, reporting/hardware.py), timed again (``--remeasure``) or removed
(``--clear``)."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import torch

from torchneox.base.errors import ConfigError
from torchneox.models import cpu_kernels
from torchneox.models.cpu_kernels import Verdict, kernel_names


def _split(key: str) -> tuple[str, int | None, str, str]:
    """A cache key's CPU model, thread count, torch version and the rest (the shape or the
    precision)."""
    parts = key.split(" | ")
    if len(parts) < 4 or not parts[1].endswith(" threads") or not parts[2].startswith("torch "):
        return key, None, "", ""
    threads = parts[1].removesuffix(" threads")
    return (
        parts[0],
        int(threads) if threads.isdigit() else None,
        parts[2][6:],
        " | ".join(parts[3:]),
    )


def _here(key: str) -> int | None:
    """The thread count of a key measured on this CPU model with this torch (else None)."""
    cpu, threads, version, _ = _split(key)
    here = cpu == cpu_kernels.cpu_model() and version == torch.__version__
    return threads if here and threads else None


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value:.3g} ms"


def verdict_text(shape: str, v: Verdict) -> str:
    default, challenger = kernel_names(shape)
    chosen = challenger if v.challenger else default
    name = shape if shape.startswith("attention ") else f"linear {shape} (rows x in x out)"
    if v.default_ms is None or v.challenger_ms is None:
        times = "written by an older torchneox, without its times"
    else:
        margin = round((1 - cpu_kernels.MARGIN) * 100)
        times = (
            f"{default} {_ms(v.default_ms)}, {challenger} {_ms(v.challenger_ms)} a call "
            f"(medians); {challenger} {margin}% faster in {v.wins} of {v.rounds} rounds"
        )
    if v.measured:
        times += f"; timed {v.measured}" + (f" at load {v.load:g}" if v.load is not None else "")
    if v.challenger:
        times += "; confirmed by a second timing" if v.checked else "; timed again at next use"
    return f"  {name}: {chosen} ({times})"


def _field(entry: dict, key: str, kind: type | tuple) -> object:
    """``entry[key]`` where it is of ``kind`` (a hand-edited file may hold anything), else
    None."""
    value = entry.get(key)
    return value if isinstance(value, kind) and not isinstance(value, bool) else None


def peak_text(precision: str, entry: object) -> str:
    from torchneox.reporting.hardware import peak_value

    precision = precision.removesuffix(" | best kernel")
    tflops = peak_value(entry)
    if tflops is None:
        return f"  {precision}: unreadable entry (measured again at the next run)"
    text = f"  {precision}: {tflops:.3g} TFLOP/s"
    if not isinstance(entry, dict):
        return text
    trials, kernel = _field(entry, "trials", int), _field(entry, "kernel", str)
    median, slowest = _field(entry, "median", (int, float)), _field(entry, "slowest", (int, float))
    if trials and kernel and median is not None and slowest is not None:
        text += (
            f" (best of {trials} trials on the {kernel} kernel, median {median:.3g}, "
            f"slowest {slowest:.3g})"
        )
    if measured := _field(entry, "measured", str):
        load = _field(entry, "load", (int, float))
        text += f"; timed {measured}" + (f" at load {load:g}" if load is not None else "")
    if raised := _field(entry, "raised_by_a_step", str):
        text += f"; raised by a faster step {raised}"
    return text


def _machine(key: str) -> tuple[str, str]:
    cpu, threads, version, rest = _split(key)
    if threads is None:
        return "an unreadable key", key
    machine = f"{cpu} | {threads} threads | torch {version}"
    return machine + (" (this machine)" if machine == cpu_kernels.machine_key() else ""), rest


def _show(title: str, table: dict, line, path: Path, empty: str) -> None:
    """``table``'s entries (``line(rest, value)`` each) under their machines."""
    print(f"{title} ({path}):")
    machines: dict[str, list[str]] = {}
    for key, value in table.items():
        machine, rest = _machine(key)
        machines.setdefault(machine, []).append(line(rest, value))
    for machine, lines in machines.items():
        print(machine)
        print("\n".join(lines))
    if not table:
        print(f"  none yet: {empty}")


def _verdict_line(shape: str, value: object) -> str:
    verdict = Verdict.from_json(value)
    return verdict_text(shape, verdict) if verdict else f"  {shape}: unreadable entry (timed again)"


def _remeasure(kernels: dict, peaks: dict) -> tuple[dict, dict, int]:
    """Every entry of this CPU and torch timed again at its thread count."""
    from torchneox.reporting import hardware

    count, threads_before = 0, torch.get_num_threads()
    try:
        for key in list(kernels):
            threads, shape = _here(key), _split(key)[3]
            measure = _measure_for(shape)
            if threads is None or measure is None:
                continue
            torch.set_num_threads(threads)
            try:
                kernels[key] = asdict(cpu_kernels.as_verdict(measure()))
            except (RuntimeError, MemoryError) as e:  # a hand-made shape too large to time
                print(f"  {shape}: kept as it was (cannot time it: {str(e)[:80]})")
                continue
            count += 1
        for key in list(peaks):
            threads, precision = _here(key), _split(key)[3].split(" | ")[0]
            if threads is None or precision not in hardware.DTYPES:
                continue
            torch.set_num_threads(threads)
            trials = hardware.peak_trials(hardware.DTYPES[precision])
            peaks[key] = hardware.peak_record(trials)
            count += 1
    finally:
        torch.set_num_threads(threads_before)
    return kernels, peaks, count


def _measure_for(shape: str):
    """The timing behind a verdict's shape name (models/linear.py, models/mixers/attention.py)."""
    from torchneox.models.linear import measure_onednn_faster

    words = shape.split()
    try:
        if len(words) == 4 and words[0] == "attention" and words[3] in ("masked", "causal"):
            dtype = getattr(torch, words[1])
            dims = [int(x) for x in words[2].split("x")]
            if isinstance(dtype, torch.dtype) and len(dims) == 5:
                masked = words[3] == "masked"
                return lambda: cpu_kernels.fp32_attention_faster(dtype, *dims, masked)
        dims = [int(x) for x in shape.split("x")]
        if len(dims) == 3:
            return lambda: measure_onednn_faster(*dims)
    except (ValueError, AttributeError):
        pass
    return None


def _write(path: Path, table: dict) -> None:
    try:
        cpu_kernels.write_table(path, table)
    except OSError as e:
        raise ConfigError(f"cannot write it ({e.strerror})", source=str(path)) from None


def cmd_kernels(args: argparse.Namespace) -> int:
    from torchneox.reporting import hardware

    kernel_path, peak_path = cpu_kernels.cache_file(), hardware.cpu_peak_file()
    if args.clear:
        for path in (kernel_path, peak_path):
            try:
                path.unlink()
                print(f"removed {path}")
            except FileNotFoundError:
                print(f"{path}: nothing to remove")
            except OSError as e:
                raise ConfigError(f"cannot remove it ({e.strerror})", source=str(path)) from None
        print("the next run on the CPU times its kernels and peak again")
        return 0
    kernels = cpu_kernels.read_table(kernel_path)
    peaks = cpu_kernels.read_table(peak_path)
    if args.remeasure:
        print("timing this machine's verdicts and peaks again (keep the machine otherwise idle)")
        with ExitStack() as locks:
            for path in dict.fromkeys((kernel_path, peak_path)):
                try:
                    locks.enter_context(cpu_kernels.locked(path))
                except OSError as e:
                    raise ConfigError(f"cannot lock it ({e.strerror})", source=str(path)) from None
            kernels, peaks, count = _remeasure(kernels, peaks)
            _write(kernel_path, kernels)
            _write(peak_path, peaks)
        if count:
            print(f"timed {count} entries again; rewrote {kernel_path} and {peak_path}")
        else:
            print("nothing of this machine is cached: a run on the CPU times what it meets")
    _show("CPU kernel verdicts", kernels, _verdict_line, kernel_path, RUN_TIMES)
    _show("CPU matmul peaks for MFU", peaks, peak_text, peak_path, "a run on the CPU measures it")
    return 0


RUN_TIMES = "a run on the CPU times the shapes it meets"
