"""s3_path: each committed checkpoint uploaded to a real S3-compatible server (moto's server
mode, on loopback) under GPT-NeoX's key layout, byte for byte; a failed upload reported in one
line while the local checkpoint stays as it was and training goes on."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from torchneox.checkpoint import files as checkpoint_format
from torchneox.cli import main

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_server(monkeypatch):
    """An S3 endpoint on loopback and the AWS environment that points boto3 at it."""
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield endpoint
    server.stop()


def _objects(client, bucket: str) -> dict[str, bytes]:
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("background", [False, True], ids=["saved_in_step", "async_save"])
def test_each_save_is_uploaded_byte_for_byte_under_gpt_neox_keys(
    s3_server, make_config, tmp_path, capsys, background
):
    client = boto3.client("s3")
    client.create_bucket(Bucket="ckpts")
    save = tmp_path / "my-run"
    cfg = make_config(
        train_iters=4,
        checkpoint_factor=2,
        save=str(save),
        load=str(save),
        s3_path="s3://ckpts/runs/",
        s3_chunk_size=5 * 2**20,
        async_checkpointing=background,
        async_checkpoint_writer="thread",  # (only read with async_checkpointing)
    )
    assert main(["train", cfg, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    # GPT-NeoX's layout: s3_path/<basename of save>/global_stepN/<file under the step directory>
    expected = {
        f"runs/my-run/{step}/{name}": data
        for step in ("global_step2", "global_step4")
        for name, data in _files(save / step).items()
    }
    assert len(expected) > 6
    assert _objects(client, "ckpts") == expected
    assert "s3: 2 checkpoint(s) uploaded, the last to s3://ckpts/runs/my-run/global_step4/" in out


def test_a_failed_upload_is_one_line_and_the_checkpoint_is_untouched(
    s3_server, make_config, tmp_path, capsys
):
    save = tmp_path / "r"
    cfg = make_config(
        train_iters=2,
        checkpoint_factor=1,
        save=str(save),
        load=str(save),
        s3_path="s3://nobucket/x",
    )
    assert main(["train", cfg, "--device", "cpu"]) == 0  # training goes on to its end
    out = capsys.readouterr().out
    failures = [line for line in out.splitlines() if "failed" in line and "s3:" in line]
    assert len(failures) == 3, out  # one per save, then the summary at the end
    assert (
        f"s3: uploading {save / 'global_step1'} to s3://nobucket/x/r/global_step1/ failed: "
        in failures[0]
    )
    assert "NoSuchBucket" in failures[0] and "training goes on" in failures[0]
    assert "Traceback" not in out
    assert (save / "latest").read_text().strip() == "global_step2"
    for step in ("global_step1", "global_step2"):
        assert checkpoint_format.verify(save / step, content=True) == []


def test_an_unreachable_server_is_reported_with_the_s3_path(make_config, tmp_path, monkeypatch):
    from torchneox.checkpoint.s3 import S3Uploads

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    step = tmp_path / "save" / "global_step3"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    lines: list[str] = []
    uploads = S3Uploads("s3://b/p", 5 * 2**20, tmp_path / "save", lines.append)
    uploads.start(step)
    uploads.finish()
    assert lines[0].startswith(f"s3: uploading {step} to s3://b/p/save/global_step3/ failed: ")
    assert "Could not connect" in lines[0] and "\n" not in lines[0]
    assert (step / "meta.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("ckpts/x", "'ckpts/x' is not an S3 path; write s3://BUCKET/PREFIX"),
        ("s3:///x", "'s3:///x' is not an S3 path"),
    ],
)
def test_a_bad_s3_path_is_one_line(make_config, value, message, capsys):
    assert main(["config", "explain", make_config(s3_path=value)]) == 2
    err = capsys.readouterr().err
    assert "s3_path" in err and message in err and len(err.strip().splitlines()) == 1


def test_explain_shows_where_uploads_go(make_config, tmp_path, capsys):
    assert (
        main(["config", "explain", make_config(s3_path="s3://b/runs", save=str(tmp_path / "exp"))])
        == 0
    )
    out = capsys.readouterr().out
    assert "s3://b/runs/exp/global_stepN/" in out


def test_s3_path_without_save_is_refused(make_config, capsys):
    assert main(["config", "explain", make_config(s3_path="s3://b/p", save=None, load=None)]) == 2
    assert "s3_path: nothing is saved to upload; set save" in capsys.readouterr().err


def test_without_boto3_the_run_says_what_to_install(make_config, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    assert main(["train", make_config(s3_path="s3://b/p"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "pip install torchneox[s3]" in err and len(err.strip().splitlines()) == 1
