"""`torchneox plot` reads what it can of a metrics.jsonl and says what it could not: an empty
or unreadable file is one line and exit 2; a partly unreadable one is plotted with one
warning naming how many lines were skipped and the first of them."""

from __future__ import annotations

import json

import pytest

from torchneox.cli import main

pytest.importorskip("matplotlib")


def _rows(*iterations: int) -> bytes:
    return b"".join(
        json.dumps({"iteration": i, "lm_loss": 5.0 - i / 10}).encode() + b"\n" for i in iterations
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "metrics.jsonl: empty: no step has been logged yet, nothing to plot"),
        (b"\n\n", "metrics.jsonl: empty: no step has been logged yet"),
        (
            b"\x89PNG\r\n\x1a\n\x00\xff\xfe\x00binary\x00",
            "metrics.jsonl: no line of it is a metrics record (3 unreadable, the first is line 1)",
        ),
        (b'{"iteration": 1}\n', "metrics.jsonl: no lm_loss or valid_lm_loss in it"),
    ],
)
def test_an_empty_or_unreadable_metrics_file_is_one_line(tmp_path, capsys, content, message):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(content)
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "loss.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert message in err
    assert not (tmp_path / "loss.png").exists()


def test_a_partly_unreadable_metrics_file_plots_the_rest_with_one_warning(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    damaged = _rows(1, 2, 3) + b"\xff\xfe\x00\x01\n" + b"[1, 2]\n" + _rows(5, 6)
    (tmp_path / "run" / "metrics.jsonl").write_bytes(damaged)
    assert main(["plot", str(tmp_path / "run"), "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"warning: {tmp_path / 'run' / 'metrics.jsonl'}: skipped 2 unreadable lines (the first "
        "is line 4); plotted the other 5 points"
    ]


def test_plot_draws_another_metric_such_as_a_reinforce_runs_reward(tmp_path, capsys):
    from torchneox.reporting.plot import read_metrics

    (tmp_path / "run").mkdir()
    rows = [{"iteration": i, "lm_loss": 1.0, "reward": i / 10} for i in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "run" / "metrics.jsonl").write_text(text)
    assert read_metrics(tmp_path / "run", "reward") == ([(1, 0.1), (2, 0.2), (3, 0.3)], [])
    out = tmp_path / "reward.png"
    assert main(["plot", str(tmp_path / "run"), "--metric", "reward", "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert (
        main(["plot", str(tmp_path / "run"), "--metric", "kl", "--out", str(out), "--force"]) == 2
    )
    assert "metrics.jsonl: no kl or valid_kl in it, nothing to plot" in capsys.readouterr().err
