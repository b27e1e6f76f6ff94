"""Checkpoints copied to S3 after each save (``s3_path``, ``s3_chunk_size``), as GPT-NeoX's
``upload_checkpoint``: rank 0 uploads every file of a committed step directory to
``s3_path/<save's basename>/global_stepN/<file>`` in multipart uploads of ``s3_chunk_size``
bytes. Nothing is read back.

GPT-NeoX uploads while every rank waits at a barrier; here one background thread uploads
while training goes on. A save waits for the previous upload before it starts the next one
(and before rotation may delete a directory), and the run waits for the last one at its end.
A failed upload is one line naming the s3 path and the cause; the local checkpoint is never
touched and training goes on (the end of the run repeats what failed)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from torchneox.base.errors import ConfigError, first_line


def split_s3_path(s3_path: str) -> tuple[str, str]:
    """(bucket, key prefix) of ``s3://bucket/prefix``; a ConfigError for anything else."""
    if not s3_path.startswith("s3://") or not s3_path[5:].split("/")[0]:
        raise ConfigError(f"{s3_path!r} is not an S3 path; write s3://BUCKET/PREFIX", key="s3_path")
    bucket, _, prefix = s3_path[5:].partition("/")
    return bucket, prefix.strip("/")


def remote_dir(s3_path: str, save: str | Path, step_dir_name: str) -> str:
    """Where a step directory goes: GPT-NeoX's ``s3_path/<basename of save>/global_stepN``."""
    name = os.path.basename(os.path.abspath(save))
    return f"{s3_path.rstrip('/')}/{name}/{step_dir_name}"


def require_boto3() -> Any:
    """boto3, or a one-line ConfigError saying what to install (asked on every rank, so that
    all of them stop, not rank 0 alone)."""
    try:
        import boto3
    except ImportError:
        raise ConfigError(
            "uploading checkpoints needs boto3, which is not installed; "
            "pip install torchneox[s3] (or remove s3_path)",
            key="s3_path",
        ) from None
    return boto3


class S3Uploads:
    """The run's uploads: one at a time, in a background thread (rank 0 only)."""

    def __init__(self, s3_path: str, chunk_size: int, save: Path, line: Any) -> None:
        self.s3_path, self.chunk_size, self.save, self.line = s3_path, chunk_size, save, line
        self.bucket, self.prefix = split_s3_path(s3_path)
        # credentials, region and AWS_ENDPOINT_URL from the environment or ~/.aws
        self.client = require_boto3().client("s3")
        self.thread: threading.Thread | None = None
        self.done: list[str] = []
        self.failed: list[str] = []

    def start(self, step_dir: Path) -> None:
        """Upload the committed ``step_dir`` behind the training (after the previous upload)."""
        self.wait()
        self.thread = threading.Thread(
            target=self._upload, args=(step_dir,), name="s3-upload", daemon=True
        )
        self.thread.start()

    def wait(self) -> None:
        """Block until the upload in flight, if any, has finished (or failed)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def finish(self) -> None:
        """Wait for the last upload and say what reached S3 (and what did not)."""
        self.wait()
        if self.done:
            self.line(f"s3: {len(self.done)} checkpoint(s) uploaded, the last to {self.done[-1]}")
        if self.failed:
            self.line(
                f"s3: {len(self.failed)} upload(s) failed ({', '.join(self.failed)}); the local "
                "checkpoints are complete: copy them yourself or rerun with a reachable s3_path"
            )

    def _upload(self, step_dir: Path) -> None:
        remote = remote_dir(self.s3_path, self.save, step_dir.name)
        start = time.monotonic()
        try:
            files = sorted(p for p in step_dir.rglob("*") if p.is_file())
            for path in files:
                self._upload_file(path, remote, step_dir)
        except Exception as e:  # any failure of the copy is reported, not raised
            self.failed.append(remote)
            self.line(
                f"s3: uploading {step_dir} to {remote}/ failed: {_reason(e)}; the local "
                "checkpoint is kept and training goes on"
            )
            return
        self.done.append(remote + "/")
        seconds = time.monotonic() - start
        self.line(f"s3: uploaded {step_dir} to {remote}/ ({len(files)} files, {seconds:.1f}s)")

    def _upload_file(self, path: Path, remote: str, step_dir: Path) -> None:
        from boto3.s3.transfer import TransferConfig

        key = remote[len(f"s3://{self.bucket}/") :] + "/" + path.relative_to(step_dir).as_posix()
        config = TransferConfig(
            multipart_threshold=1,  # always multipart, as GPT-NeoX
            multipart_chunksize=self.chunk_size,
            use_threads=False,
        )
        self.client.upload_file(str(path), self.bucket, key, Config=config)


def _reason(error: BaseException) -> str:
    """The first line of botocore's own error in the chain (the server's answer, or the
    endpoint it could not reach); boto3 wraps it in a message naming the file again."""
    seen: BaseException | None = error
    while seen is not None:
        if type(seen).__module__.startswith("botocore"):
            return first_line(seen)
        seen = seen.__cause__ or seen.__context__
    return first_line(error)
