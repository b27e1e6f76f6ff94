"""The table of refusals (config/refusals.py) is the whole truth: every feature in every
layout, every pair of features, and every pair in every layout is put through the checks
`config explain` runs (load, validate, derive, the layout rules; nothing trained). A refused
combination has a line of the table among its parts, and its one-line message gives that
line's reason; each line of the table is refused; docs/parallelism.md holds the table."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

from torchneox.base.errors import ConfigError
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.layout import Layout, check_layout
from torchneox.config.load import load_mapping
from torchneox.config.refusals import BASE, FEATURES, LAYOUTS, REFUSALS, markdown, merged

REPO = Path(__file__).resolve().parents[2]


def explain(names: tuple[str, ...]) -> str | None:
    """The one-line refusal of BASE with the named features and layouts, or None (two layouts
    are the one of LAYOUTS made of them)."""
    layouts = {n for n in names if n in LAYOUTS}
    if len(layouts) > 1:
        both = next(n for n, case in LAYOUTS.items() if set(case.parts) == layouts)
        names = (*(n for n in names if n not in layouts), both)
        layouts = {both}
    world = LAYOUTS[layouts.pop()].world if layouts else 1
    keys = merged(BASE, *(FEATURES.get(n) or LAYOUTS[n].keys for n in names))
    try:
        loaded = load_mapping(keys, "x.yml")
        check_layout(loaded, Layout.from_derived(loaded.config, derive(loaded, world_size=world)))
    except ConfigError as e:
        return str(e)
    return None


def parts(names: tuple[str, ...]) -> set[str]:
    """The names and every simpler layout a layout holds."""
    out = set(names)
    for name in names:
        if name in LAYOUTS:
            out |= parts(LAYOUTS[name].parts)
    return out


def table_lines(names: tuple[str, ...]) -> list:
    held = parts(names)
    return [r for r in REFUSALS if {r.feature, *r.beside.split(" + ")} <= held]


def assert_explained(names: tuple[str, ...], message: str) -> None:
    lines = table_lines(names)
    assert lines, f"{' + '.join(names)} is refused and the table has no line for it: {message}"
    assert any(r.reason in message for r in lines), (message, [r.reason for r in lines])
    assert len(message.splitlines()) == 1 and message.startswith("x.yml: "), message


def test_every_feature_runs_alone():
    assert [f for f in FEATURES if explain((f,))] == []


def test_every_line_of_the_table_is_refused_with_its_reason():
    for r in REFUSALS:
        names = (r.feature, *r.beside.split(" + "))
        message = explain(names)
        assert message is not None, f"{r} runs: drop the line"
        assert r.reason in message, (r, message)


def test_every_refusal_in_the_grid_has_its_line():
    """Features in every layout, pairs alone and pairs in every layout (about 6,000 configs;
    a pair whose two features set one key, such as two objectives, is not a pair)."""
    refused: dict[tuple[str, ...], str] = {}
    alone = [(f, layout) for f in FEATURES for layout in LAYOUTS]
    pairs = [
        (f, g)
        for f, g in itertools.combinations(FEATURES, 2)
        if not set(FEATURES[f]) & set(FEATURES[g])
    ]
    for names in [(layout,) for layout in LAYOUTS] + alone + pairs:
        message = explain(names)
        if message is not None:
            refused[names] = message
            assert_explained(names, message)
    for (f, g), layout in itertools.product(pairs, LAYOUTS):
        if any(k in refused for k in ((f, layout), (g, layout), (f, g), (layout,))):
            continue  # refused by a part already
        message = explain((f, g, layout))
        if message is not None:
            assert_explained((f, g, layout), message)


def test_no_refusal_says_not_built_yet():
    found = subprocess.run(
        ["grep", "-rnE", "not built yet|not supported yet", str(REPO / "src")],
        capture_output=True,
        text=True,
    )
    assert found.stdout == "", found.stdout


def test_docs_parallelism_md_holds_the_table(capsys):
    assert main(["config", "refusals"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(REFUSALS)
    assert main(["config", "refusals", "--markdown"]) == 0
    printed = capsys.readouterr().out
    assert printed == markdown() and printed.count("\n") == len(REFUSALS) + 2
    doc = (REPO / "docs" / "parallelism.md").read_text()
    table = re.search(r"<!-- refusals -->\n(.*?)<!-- /refusals -->", doc, re.S)
    assert table is not None, "docs/parallelism.md lost its <!-- refusals --> markers"
    assert table.group(1) == printed, (
        "regenerate: torchneox config refusals --markdown, between the markers"
    )


HOLDS = {
    "tp2": {"tp": 2},
    "tp2 sp": {"tp": 2, "sequence_parallel": True},
    "pp2": {"pp": 2},
    "pp2 interleaved": {"pp": 2, "schedule": "interleaved_1f1b"},
    "pp2 zbv": {"pp": 2, "schedule": "zbv"},
    "tp2 sp pp2": {"tp": 2, "sequence_parallel": True, "pp": 2},
    "cp2": {"cp": 2},
    "pp2 cp2": {"pp": 2, "cp": 2},
    "ep2": {"ep": 2},
    "zero1": {"zero": 1, "dp": 2},
    "zero3": {"zero": 3, "dp": 2},
    "hybrid sharding": {"hybrid": True},
    "hybrid sharding ep2": {"hybrid": True, "ep": 2},
    "hybrid sharding cp2": {"hybrid": True, "cp": 2},
}


def test_each_layout_is_what_its_name_says():
    """(Else the grid would hold a layout that splits nothing.)"""
    assert set(HOLDS) == set(LAYOUTS)
    for name, fields in HOLDS.items():
        case = LAYOUTS[name]
        loaded = load_mapping(merged(BASE, case.keys), "x.yml")
        layout = Layout.from_derived(loaded.config, derive(loaded, world_size=case.world))
        assert {f: getattr(layout, f) for f in fields} == fields, name
