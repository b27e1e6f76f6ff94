"""``torchneox train ARGS`` in a fresh process forked from a server that has imported torchneox
once: what ``python -m torchneox train ARGS`` does, without importing torch again for every run. The tests'
one-process training runs go through it (tests/helpers.train); the server is the one
``train --nproc`` forks its ranks from (torchneox/cli/rank_server.py), and each run is a rank
of one (torchneox/cli/launch.run_rank) whose output goes to files."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from torchneox.cli.launch import PRELOAD, run_rank

_CONTEXT = multiprocessing.get_context("forkserver")


class Forked:
    """A running ``torchneox ARGS`` (``start``), with Popen's poll, kill and wait."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        _CONTEXT.set_forkserver_preload(PRELOAD)
        self.argv = ["torchneox", *argv]
        self._folder = tempfile.TemporaryDirectory(prefix="torchneox-run-")
        self.out, self.err = Path(self._folder.name, "stdout"), Path(self._folder.name, "stderr")
        target = _launcher if "--nproc" in argv else _child
        self.process = _CONTEXT.Process(
            target=target, args=(argv, env, str(self.out), str(self.err))
        )
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.kill()
            self.process.join()
            raise subprocess.TimeoutExpired(self.argv, timeout or 0)
        return self.process.exitcode

    def result(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Wait for it; its exit status and what it printed."""
        try:
            code = self.wait(timeout)
            return subprocess.CompletedProcess(
                self.argv, code, self.out.read_text(), self.err.read_text()
            )
        finally:
            self._folder.cleanup()


def run_cli(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return Forked(argv, env).result(timeout)


def _to_files(out: str, err: str) -> None:
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, fd)
        os.close(file)


def _child(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    _to_files(out, err)
    run_rank(argv, env)


def _launcher(argv: list[str], env: dict[str, str], out: str, err: str) -> None:
    """``torchneox train ... --nproc N`` as the user runs it (the launcher checks the config
    once, then starts and watches the ranks), except that the ranks are forked from this
    process, which has imported the trainer already (launch._rank_context), instead of from a
    fork server that would import it again."""
    _to_files(out, err)
    os.environ.clear()
    os.environ.update(env)
    from torchneox.cli import main

    sys.exit(main(argv))
