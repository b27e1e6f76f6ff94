"""The CPU kernel verdicts (models/cpu_kernels.py) never leave a run slower than the default
kernels: a verdict for the challenger needs a clear, repeated, interleaved margin; a cached one
is timed again at its next use and corrected, with a line, where the default wins; and
``torchneox kernels`` shows, re-times or removes them. Timings here are fed, never measured:
the verdicts' timer and clock are replaced by deterministic ones."""

from __future__ import annotations

import json
import time
import types

import pytest
import torch

from torchneox.cli import main
from torchneox.models import cpu_kernels
from torchneox.models import linear as lin
from torchneox.models.mixers import attention
from torchneox.reporting import hardware

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Both cache files in tmp_path, this process's verdicts forgotten (a new process)."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path / "kernels.json"))
    monkeypatch.setenv(hardware.CPU_PEAK_ENV, str(tmp_path / "peak.json"))
    new_process(monkeypatch)
    monkeypatch.setattr(cpu_kernels, "_warned", set())
    cpu_kernels.take_corrections()
    return tmp_path / "kernels.json", tmp_path / "peak.json"


def new_process(monkeypatch) -> None:
    """What this process decided is forgotten, as in a later process."""
    monkeypatch.setattr(lin, "_verdicts", {})
    monkeypatch.setattr(cpu_kernels, "_timed_here", {})
    monkeypatch.setattr(cpu_kernels, "second_timing", True)  # a fresh run's (trainer.py sets it)


def default_faster(kernels, rounds):
    """A timer that never runs the kernels: the default takes 1 ms a call, the challenger 2."""
    return {"default": [1e-3] * rounds, "challenger": [2e-3] * rounds}


def challenger_faster(kernels, rounds):
    return {"default": [2e-3] * rounds, "challenger": [1e-3] * rounds}


class FakeClock:
    """A clock that moves only when a kernel runs: each call of a kernel takes the next of its
    durations (its first call is a warm-up)."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def install(self, monkeypatch) -> None:
        """cpu_kernels reads this clock (the rest of ``time`` as it is)."""
        fake = types.SimpleNamespace(**{k: getattr(time, k) for k in ("strftime", "gmtime")})
        fake.perf_counter = lambda: self.now
        monkeypatch.setattr(cpu_kernels, "time", fake)

    def kernel(self, name: str, durations: list[float]):
        seq = iter(durations)

        def run():
            self.calls.append(name)
            self.now += next(seq)

        return run


def test_one_lucky_round_keeps_the_default(monkeypatch):
    """A busy machine makes one round of the challenger look fast: the verdict was the best
    round of each, so one lucky round (0.7 against the default's steady 1.0) chose the
    challenger, and every later run kept it."""
    clock = FakeClock()
    clock.install(monkeypatch)
    default = clock.kernel("default", [1.0, 0.95] + [1.0] * 8)
    lucky = clock.kernel("challenger", [1.0, 1.02, 0.7] + [1.02] * 7)
    assert not cpu_kernels.challenger_faster(default, lucky)
    # the rounds interleave, the first of the two alternating; each kernel warmed up first
    rounds = clock.calls[2:]
    assert rounds[:4] == ["default", "challenger", "challenger", "default"]
    assert rounds.count("default") == rounds.count("challenger") == cpu_kernels.ROUNDS
    # a challenger that wins most rounds by the margin, and in the medians, is taken
    clock = FakeClock()
    clock.install(monkeypatch)
    default = clock.kernel("default", [1.0] * 10)
    clear = clock.kernel("challenger", [1.0, 1.1, 0.8, 0.7, 0.8, 0.75, 0.8, 0.8])
    assert cpu_kernels.challenger_faster(default, clear)


@pytest.mark.parametrize(
    "challenger, chosen",
    [
        ([0.85, 0.85, 0.85, 0.85, 0.85, 0.85, 0.85], True),  # 15% faster in every round
        ([0.95, 0.94, 0.96, 0.93, 0.95, 0.94, 0.95], False),  # 5%: within the noise
        ([0.5, 0.5, 0.5, 0.5, 1.2, 1.3, 1.2], False),  # 4 of 7 rounds: no clear majority
        ([0.5, 1.2, 0.8, 1.3, 0.8, 0.85, 0.89], True),  # 5 of 7 by 10%, and the median
    ],
)
def test_the_margin_rule(challenger, chosen):
    verdict = cpu_kernels.judge({"default": [1.0] * 7, "challenger": challenger})
    assert verdict.challenger is chosen
    assert verdict.rounds == 7 and verdict.default_ms == 1000.0


def train_cfg(make_config, tmp_path, name):
    return make_config(f"{name}.yml", train_iters=2, save=str(tmp_path / name), load=None)


def test_a_correction_the_cache_could_not_keep_says_so(caches, monkeypatch):
    """A full or read-only disk: the run takes the default, and its line does not claim the
    file was updated."""
    kernels, _ = caches
    kernels.write_text(json.dumps({f"{cpu_kernels.machine_key()} | 8x8x8": True}))
    monkeypatch.setattr(
        cpu_kernels, "write_table", lambda *a: (_ for _ in ()).throw(OSError(28, "full"))
    )
    measured = cpu_kernels.Verdict(False, default_ms=1.0, challenger_ms=2.0)
    assert cpu_kernels.cached_verdict("8x8x8", lambda: measured) is False
    line = cpu_kernels.correction_line(cpu_kernels.take_corrections())
    assert line.endswith(
        "which now run on the default; the cache could not be rewritten (this run only) "
        "(`torchneox kernels` shows every verdict)"
    ), line


@needs_onednn
def test_a_poisoned_cache_is_corrected_by_the_next_run(
    make_config, caches, tmp_path, monkeypatch, capsys
):
    """The cache said oneDNN for shapes where PyTorch's default kernel is faster (timed while
    other work loaded the machine): every later run used oneDNN and ran slower, silently."""
    kernels, _ = caches
    monkeypatch.setattr(cpu_kernels, "timer", default_faster)
    monkeypatch.setattr(hardware, "peak_trials", fake_peaks)  # MFU's peak: not timed either
    assert main(["train", train_cfg(make_config, tmp_path, "fresh")]) == 0
    fresh = json.loads(kernels.read_text())
    assert fresh and not any(v["challenger"] for v in fresh.values())
    # poisoned as an older torchneox wrote them: a bare "oneDNN is faster" for every shape
    kernels.write_text(json.dumps(dict.fromkeys(fresh, True)))
    new_process(monkeypatch)
    onednn_calls = []
    real = lin._mm
    monkeypatch.setattr(lin, "_mm", lambda *a: onednn_calls.append(1) or real(*a))
    capsys.readouterr()
    assert main(["train", train_cfg(make_config, tmp_path, "later")]) == 0
    out = capsys.readouterr().out
    assert onednn_calls == []  # the run took the faster, default kernel at every shape
    (line,) = [line for line in out.splitlines() if "corrected" in line]  # one line for all
    shapes = sorted(key.split(" | ")[-1] for key in fresh)
    assert line == (
        f"CPU kernel verdicts corrected: the cached choice of the non-default kernel lost to "
        f"PyTorch's default when timed again at {len(fresh)} shapes ("
        + "; ".join(f"linear {s}: default 1 ms, oneDNN 2 ms" for s in shapes)
        + f"), which now run on the default; {kernels} updated (`torchneox kernels` shows "
        "every verdict)"
    )
    after = json.loads(kernels.read_text())
    assert set(after) == set(fresh)
    assert all(v["challenger"] is False and v["checked"] is True for v in after.values())
    # and the run after that reads the corrected verdicts: no timing, nothing to say
    new_process(monkeypatch)
    monkeypatch.setattr(cpu_kernels, "timer", lambda *a: pytest.fail("timed again"))
    assert main(["train", train_cfg(make_config, tmp_path, "third")]) == 0
    assert "corrected" not in capsys.readouterr().out and onednn_calls == []


@needs_onednn
def test_a_resumed_run_keeps_the_kernels_of_the_run_it_continues(
    make_config, caches, tmp_path, monkeypatch, capsys
):
    """A second timing may move a verdict to the default: a resumed run that did so would
    compute with other kernels than the run it continues, and no longer equal it bit for bit.
    It reads the verdicts as they are (the next fresh run times them again)."""
    kernels, _ = caches
    monkeypatch.setattr(cpu_kernels, "timer", challenger_faster)
    monkeypatch.setattr(hardware, "peak_trials", fake_peaks)
    run_dir = str(tmp_path / "run")
    assert main(["train", make_config("a.yml", train_iters=2, save=run_dir, load=None)]) == 0
    assert all(not v["checked"] for v in json.loads(kernels.read_text()).values())
    new_process(monkeypatch)
    monkeypatch.setattr(cpu_kernels, "timer", lambda *a: pytest.fail("timed again"))
    onednn_calls = []
    real = lin._mm
    monkeypatch.setattr(lin, "_mm", lambda *a: onednn_calls.append(1) or real(*a))
    assert main(["train", make_config("b.yml", train_iters=3, save=run_dir, load=run_dir)]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert onednn_calls  # the kernels the run it continues used, not timed a second time
    assert all(not v["checked"] for v in json.loads(kernels.read_text()).values())


@needs_onednn
def test_a_challenger_verdict_is_confirmed_once_then_trusted(caches, monkeypatch):
    kernels, _ = caches
    timed = []

    def timer(kernels, rounds):
        timed.append(1)
        return challenger_faster(kernels, rounds)

    monkeypatch.setattr(cpu_kernels, "timer", timer)
    assert lin.onednn_selected(700, 64, 96, "auto") and len(timed) == 1
    (entry,) = json.loads(kernels.read_text()).values()
    assert entry["challenger"] and not entry["checked"] and entry["wins"] == 7
    assert lin.onednn_selected(700, 64, 96, "auto") and len(timed) == 1  # not in this process
    new_process(monkeypatch)  # the next process times it once more
    assert lin.onednn_selected(700, 64, 96, "auto") and len(timed) == 2
    assert all(v["checked"] for v in json.loads(kernels.read_text()).values())
    new_process(monkeypatch)  # confirmed: read, not timed
    assert lin.onednn_selected(700, 64, 96, "auto") and len(timed) == 2
    assert cpu_kernels.take_corrections() == []


def test_a_poisoned_attention_verdict_is_corrected(caches, monkeypatch):
    kernels, _ = caches
    args = types.SimpleNamespace(num_heads=4, num_kv_heads=4, head_dim=16)
    name = f"{cpu_kernels.machine_key()} | attention bfloat16 16x4x4x64x16 causal"
    kernels.write_text(json.dumps({name: True}))
    monkeypatch.setattr(cpu_kernels, "timer", default_faster)
    assert not attention.cpu_attention_in_fp32("auto", torch.bfloat16, 12, args, 64, False)
    corrected = cpu_kernels.take_corrections()
    assert corrected == [("attention bfloat16 16x4x4x64x16 causal", str(kernels), 1.0, 2.0)]
    assert cpu_kernels.correction_line(corrected).startswith(
        "CPU kernel verdict corrected: the cached choice of the non-default kernel lost to "
        "PyTorch's default when timed again at one shape (attention bfloat16 16x4x4x64x16 "
        "causal: native 1 ms, fp32 2 ms), which now run on the default; "
    )
    assert json.loads(kernels.read_text())[name]["challenger"] is False


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b"\xff\xfe\x00"])
def test_a_damaged_cache_is_ignored_with_one_line(caches, monkeypatch, capsys, damage):
    kernels, _ = caches
    kernels.write_bytes(damage)
    monkeypatch.setattr(cpu_kernels, "timer", default_faster)
    assert not cpu_kernels.cached_verdict("8x8x8", lambda: cpu_kernels.compare(None, None))
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"warning: {kernels} is damaged or unreadable") and "\n" not in err
    assert json.loads(kernels.read_text())[f"{cpu_kernels.machine_key()} | 8x8x8"]["wins"] == 0
    kernels.write_bytes(damage)
    assert main(["kernels"]) == 0  # the verb too: a warning (once a process), never an error
    assert "none yet" in capsys.readouterr().out


def fake_peaks(dtype, size=1024, seconds=0.2, trials=5):
    return {"default": [0.3, 0.4, 0.2], "onednn": [0.1, 0.5, 0.45]}


def test_the_verb_shows_remeasures_and_clears(caches, monkeypatch, capsys):
    kernels, peaks = caches
    here = cpu_kernels.machine_key()
    kernels.write_text(
        json.dumps(
            {
                f"{here} | 1024x128x384": True,
                f"{here} | 1024x512x128": False,
                "Another CPU | 8 threads | torch 2.0 | 64x64x64": True,
            }
        )
    )
    peaks.write_text(json.dumps({f"{here} | fp32 | best kernel": 0.25}))
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert f"CPU kernel verdicts ({kernels}):\n{here} (this machine)\n" in out
    assert "  linear 1024x128x384 (rows x in x out): oneDNN (written by an older torchneox" in out
    assert "timed again at next use" in out and "Another CPU | 8 threads | torch 2.0\n" in out
    assert "  fp32: 0.25 TFLOP/s" in out
    monkeypatch.setattr(cpu_kernels, "timer", default_faster)
    monkeypatch.setattr(hardware, "peak_trials", fake_peaks)
    assert main(["kernels", "--remeasure"]) == 0
    out = capsys.readouterr().out
    assert f"timed 3 entries again; rewrote {kernels} and {peaks}" in out
    table = json.loads(kernels.read_text())
    assert not table[f"{here} | 1024x128x384"]["challenger"]
    assert table["Another CPU | 8 threads | torch 2.0 | 64x64x64"] is True  # not this machine's
    assert (
        "  linear 1024x128x384 (rows x in x out): default (default 1 ms, oneDNN 2 ms a call "
        "(medians); oneDNN 10% faster in 0 of 7 rounds; timed " in out
    )
    peak = json.loads(peaks.read_text())[f"{here} | fp32 | best kernel"]
    assert peak | {"measured": None, "load": None} == {
        "tflops": 0.5,
        "kernel": "onednn",
        "trials": 3,
        "median": 0.45,
        "slowest": 0.1,
        "measured": None,
        "load": None,
    }
    assert (
        "fp32: 0.5 TFLOP/s (best of 3 trials on the onednn kernel, median 0.45, slowest 0.1)" in out
    )
    assert main(["kernels", "--clear"]) == 0
    assert not kernels.exists() and not peaks.exists()
    assert f"removed {kernels}\nremoved {peaks}\n" in capsys.readouterr().out
    assert main(["kernels"]) == 0 and "none yet" in capsys.readouterr().out
    assert main(["kernels", "--clear", "--remeasure"]) == 2


def test_the_peak_is_timed_interleaved_and_its_noise_kept(caches, monkeypatch):
    """Each kernel's trials were timed one after the other: a busy stretch lowered all of one
    kernel's trials. They now take turns, and the record keeps how far apart they were."""
    order = []

    def measure(dtype, size, seconds, trials, kernel="default"):
        order.append(kernel)
        return {"default": 0.2, "onednn": 0.3}[kernel] + len(order) / 100

    monkeypatch.setattr(hardware, "measure_cpu_tflops", measure)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    trials = hardware.peak_trials(torch.float32, trials=3)
    assert order == ["default", "onednn"] * 3
    record = hardware.peak_record(trials)
    assert (record["kernel"], record["trials"]) == ("onednn", 3)
    assert record["slowest"] == pytest.approx(0.32) and record["tflops"] == pytest.approx(0.36)
    _, peaks = caches
    peaks.write_text("{damaged")
    assert hardware.cpu_peak_tflops("fp32") == pytest.approx(0.46)  # measured, not an error
    assert json.loads(peaks.read_text())[hardware._cpu_key("fp32")]["median"] == pytest.approx(0.42)


def test_the_verb_names_a_cache_it_cannot_write(tmp_path, monkeypatch, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(blocked / "kernels.json"))
    monkeypatch.setenv(hardware.CPU_PEAK_ENV, str(tmp_path / "peak.json"))
    for argv in (["kernels", "--remeasure"], ["kernels", "--clear"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"torchneox: error: {blocked / 'kernels.json'}: cannot ")


def test_a_hand_edited_cache_is_shown_not_an_internal_error(caches, monkeypatch, capsys):
    kernels, peaks = caches
    here = cpu_kernels.machine_key()
    cpu_zero = here.replace(f"{torch.get_num_threads()} threads", "0 threads")
    kernels.write_text(
        json.dumps(
            {
                f"{here} | 64x64x64": {"challenger": True, "wins": "many", "measured": 3},
                f"{here} | 64x64x32": {"challenger": "yes"},
                f"{cpu_zero} | 64x64x16": True,
                f"{here} | attention float99 1x2x3x4x5 causal": True,
            }
        )
    )
    peaks.write_text(json.dumps({f"{here} | fp32 | best kernel": {"tflops": 0.3, "median": "x"}}))
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "  linear 64x64x64 (rows x in x out): oneDNN (written by an older torchneox" in out
    assert "  64x64x32: unreadable entry (timed again)" in out
    assert "  fp32: 0.3 TFLOP/s\n" in out
    monkeypatch.setattr(cpu_kernels, "timer", default_faster)
    monkeypatch.setattr(hardware, "peak_trials", fake_peaks)
    assert main(["kernels", "--remeasure"]) == 0  # 64x64x64/32 and the peak; the rest kept
    assert "timed 3 entries again" in capsys.readouterr().out
    table = json.loads(kernels.read_text())
    assert table[f"{here} | 64x64x32"]["challenger"] is False
    assert table[f"{cpu_zero} | 64x64x16"] is True
    assert table[f"{here} | attention float99 1x2x3x4x5 causal"] is True
