"""Property-based: thousands of random and mutated configs through `config explain`. Each
either explains or gives one line starting with 'torchneox: error:'; nothing raises."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import shared_dir
from torchneox.cli import main
from torchneox.config.schema import KEYS

ROOT = Path(__file__).resolve().parents[2]
KEY_NAMES = sorted(KEYS)
# near-miss and nonsense keys: typos, other projects' names, hyphenated forms
ODD_KEYS = ["num-layers", "hidden_sise", "n_layer", "lr", "optimizer.params", "", "0", "zero_stage"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.sampled_from([0, 1, 2, 3, 4, 8, 64, 50304, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["1e-5", "fp16", "bfloat16", "rotary", "gelu", "swiglu", "nan", "inf", "3e"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.text(max_size=8) | st.sampled_from(["enabled", "stage", "type"]), inner, max_size=4
        ),
    ),
    max_leaves=8,
)
configs = st.dictionaries(
    st.sampled_from(KEY_NAMES) | st.sampled_from(ODD_KEYS), values, max_size=12
)


def base_configs() -> list[dict]:
    found = [yaml.safe_load((ROOT / "src/torchneox/configs/tiny_cpu.yml").read_text())]
    shared = shared_dir()
    if shared is not None:
        for path in sorted((shared / "neox_configs").glob("*.yml"))[:12]:
            with contextlib.suppress(yaml.YAMLError):
                loaded = yaml.safe_load(path.read_text())
                if isinstance(loaded, dict):
                    found.append(loaded)
    return found


BASES = base_configs()
WORK = Path(tempfile.mkdtemp(prefix="fuzz-"))


def explain_one(text: str, extra: list[str] | None = None) -> None:
    path = WORK / "fuzz.yml"
    path.write_text(text)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["config", "explain", str(path), *(extra or [])])
    if status == 0:
        assert "num_parameters" in out.getvalue() or out.getvalue()
    else:
        lines = err.getvalue().splitlines()
        assert status == 2, err.getvalue()
        assert len(lines) == 1 and lines[0].startswith("torchneox: error: "), err.getvalue()


# The same examples on every run, so that CI's verdict belongs to the change it tests;
# TORCHNEOX_FUZZ_RANDOM=1 explores fresh ones (how a 300-million-layer config was found to
# exhaust memory while validating), TORCHNEOX_FUZZ_EXAMPLES=1200 more of them (the exhaustive
# tier: make test runs 400 of each kind, a third of the time).
FUZZ = settings(
    max_examples=int(os.environ.get("TORCHNEOX_FUZZ_EXAMPLES", "400")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=None,
    derandomize=not os.environ.get("TORCHNEOX_FUZZ_RANDOM"),
)


@FUZZ
@given(configs)
def test_random_configs_explain_or_fail_in_one_line(config):
    explain_one(yaml.safe_dump(config, allow_unicode=True))


@FUZZ
@given(
    st.sampled_from(range(len(BASES))),
    st.dictionaries(st.sampled_from(KEY_NAMES), values, max_size=4),
    st.lists(st.sampled_from(KEY_NAMES), max_size=3),
    st.sampled_from([None, "1", "2", "3", "8", "0"]),
)
def test_mutated_real_configs_explain_or_fail_in_one_line(which, changes, dropped, world):
    config = dict(BASES[which]) | changes
    for name in dropped:
        config.pop(name, None)
    explain_one(yaml.safe_dump(config), ["--world-size", world] if world else None)


@settings(max_examples=300, deadline=None, database=None)
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_garbage_files_fail_in_one_line(data):
    path = WORK / "garbage.yml"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        status = main(["config", "explain", str(path)])
    assert status in (0, 2)
    if status:
        assert len(err.getvalue().splitlines()) == 1
