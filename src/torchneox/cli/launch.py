"""``train --nproc N``: the same training command in N local processes, the ranks of one
standalone job on this machine.

The config and its layout are checked here, once, before any process starts. The ranks are
forked from one server process (multiprocessing's forkserver) that imports the trainer once:
N ranks cost one import of torch instead of N. On a 2-core machine 8 ranks spent 12 s
importing before their first step; now they start as soon as the one import is done. Each
rank gets the environment torchrun gives a worker of a standalone job (MASTER_ADDR,
MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE); runs over several machines are
started with torchrun itself (docs/parallelism.md).

While the ranks run, this process does what torchrun's agent does:
- SIGTERM, SIGINT and SIGHUP are passed on to every rank; they finish the step and save;
- when a rank fails, the others are asked to stop (SIGTERM, and SIGCONT for a frozen one) and
  killed after ``GRACE_SECONDS``;
- no rank outlives it: each rank watches this process and ends with it (kill -9 included).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from torchneox.cli.exits import EXIT_USER_ERROR, SAID_ENV

# what the fork server imports once, before it forks any rank
PRELOAD = ["torchneox.cli.rank_server"]
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_SECONDS = 30.0


def _refuse_before_starting(loaded: Any, args: argparse.Namespace) -> None:
    """What the trainer would refuse on every rank, refused once before any process starts:
    a post-training run with nothing to load, the config and layout, a model too large. It
    imports no torch (the rank server imports it meanwhile): a CPU's free memory is read only
    where the ranks will run on the CPU for sure (--device cpu, or no GPU driver here); the
    ranks check a GPU's themselves."""
    from torchneox.checkpoint.fine_tuning import (
        refuse_fine_tuning_nothing,
        refuse_saving_over_inputs,
    )
    from torchneox.config.derive import derive
    from torchneox.config.layout import require
    from torchneox.train.fits import refuse_unaddressable, refuse_what_cannot_fit

    if args.load_step is None:  # as the trainer does first
        refuse_fine_tuning_nothing(loaded)
    refuse_saving_over_inputs(loaded)
    derived = derive(loaded, world_size=args.nproc)
    layout = require(loaded, derived)
    if loaded.config.checkpoint.save_hf:
        from torchneox.checkpoint.hf_io import check_save_hf  # (imports torch: only when asked)

        check_save_hf(loaded, args.force, layout.pp)
    params = derived["num_parameters"]
    no_gpu = not any(Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/kfd"))
    if args.device == "cpu" or (args.device is None and no_gpu):
        refuse_what_cannot_fit(loaded, params, args.nproc, args.nproc, "cpu")
    else:
        refuse_unaddressable(loaded, params)


def launch_local(args: argparse.Namespace) -> int:
    """The same training command in ``--nproc`` local processes; the exit status."""
    from torchneox.config.load import load_config
    from torchneox.models.hf.folder import is_hf_folder

    loaded = load_config(args.files, args.overrides)
    if is_hf_folder(loaded.config.checkpoint.load):  # its config.json gives the model keys
        from torchneox.models.hf.folder import with_hf_folder

        loaded = with_hf_folder(loaded)
    _refuse_before_starting(loaded, args)  # config errors once, here
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    context = _rank_context(loaded)
    save = loaded.config.checkpoint.save
    latest = Path(save) / "latest" if save else None

    def newest() -> str | None:
        if latest is None or not latest.is_file():
            return None
        return latest.read_bytes().decode("utf-8", errors="replace").strip()

    before = newest()
    argv = _rank_argv(args)
    said = tempfile.mkdtemp(prefix="torchneox-said-")  # each distinct error line said once
    os.environ[SAID_ENV] = said
    try:
        ranks = _Ranks(context, argv, args.nproc)
        stopped_by = ranks.run()
    finally:
        os.environ.pop(SAID_ENV, None)
        shutil.rmtree(said, ignore_errors=True)
    if stopped_by is not None:
        saved = newest()
        if saved and saved != before and ranks.failed is None:
            print(
                f"stopped by {stopped_by.name}; every rank saved {Path(save) / saved}: rerun "
                "the same command to resume"
            )
            return 0
        print(
            f"torchneox: error: stopped by {stopped_by.name} before a checkpoint was saved",
            file=sys.stderr,
        )
        return 1
    if ranks.failed is not None:
        rank, code = ranks.failed
        if code == EXIT_USER_ERROR:  # the rank said the mistake in its one line, above
            return EXIT_USER_ERROR
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        print(f"torchneox: error: rank {rank} {how}; its output is above", file=sys.stderr)
        return 1
    return 0


def _rank_context(loaded: Any) -> Any:
    """Where the ranks are forked from: the fork server, which imports the trainer once while
    the rest is prepared here; or this process itself where it has imported the trainer
    already (a program that runs the CLI in its own process, as the tests' forked runs do):
    a second import would cost seconds and buy nothing."""
    if "torchneox.train.trainer" in sys.modules:
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, *_libraries(loaded)])
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return context


def _libraries(loaded: Any) -> list[str]:
    """What the fork server imports too for this run, beyond the trainer: torchao's optimizers
    where 8-bit Adam runs torchao's (each rank would import them, seconds each, on its first
    step; one that does not import is left to the ranks, which say why)."""
    from torchneox.config.features.eight_bit import dtensor_axis, eight_bit, library_for

    cfg, o = loaded.config, loaded.config.optimizer
    torchao = eight_bit(o) and library_for(o, dtensor_axis(cfg) is not None) == "torchao"
    return ["torchao.optim"] if torchao else []


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The train command each rank runs: the launcher's, without --nproc."""
    argv = ["train", *args.files]
    for override in args.overrides:
        argv += ["--set", override]
    if args.device:
        argv += ["--device", args.device]
    if args.load_step is not None:
        argv += ["--load-step", str(args.load_step)]
    if args.force:
        argv.append("--force")
    return argv


class _Ranks:
    """The ranks of one local job, watched until every one has exited."""

    def __init__(self, context: Any, argv: list[str], nproc: int):
        port = _free_port()
        self.processes = [
            context.Process(
                target=run_rank,
                args=(argv, dict(os.environ) | _rank_env(rank, nproc, port)),
                name=f"torchneox rank {rank}",
            )
            for rank in range(nproc)
        ]
        self.failed: tuple[int, int] | None = None  # (rank, exit code) of the first failure
        self.signal: signal.Signals | None = None
        self.deadline: float | None = None

    def run(self) -> signal.Signals | None:
        """Start the ranks, wait for all of them; the signal that stopped them, if any."""
        old = {s: signal.signal(s, self._forward) for s in FORWARDED}
        try:
            for process in self.processes:
                process.start()
            live = {p.sentinel: (rank, p) for rank, p in enumerate(self.processes)}
            while live:
                timeout = None if self.deadline is None else max(0.0, self.deadline - time.time())
                for sentinel in multiprocessing.connection.wait(list(live), timeout):
                    rank, process = live.pop(sentinel)
                    process.join()
                    if process.exitcode != 0 and self.failed is None:
                        self.failed = (rank, process.exitcode)
                        self._stop_the_others()
                if self.deadline is not None and time.time() >= self.deadline:
                    for _, process in live.values():
                        process.kill()
                    self.deadline = None  # their sentinels follow at once
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        return self.signal

    def _forward(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum)
        self._signal_live(signum)

    def _stop_the_others(self) -> None:
        self._signal_live(signal.SIGTERM, signal.SIGCONT)  # SIGCONT: a frozen rank acts too
        self.deadline = time.time() + GRACE_SECONDS

    def _signal_live(self, *signums: int) -> None:
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                for signum in signums:
                    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                        os.kill(process.pid, signum)


def run_rank(argv: list[str], env: dict[str, str]) -> None:
    """One rank, in a process forked from the server: the launcher's environment with this
    rank's variables, its own process group (a terminal's Ctrl-C reaches the launcher, which
    passes it on once), and the training command."""
    os.setsid()
    for s in (signal.SIGTERM, signal.SIGHUP):  # the server ignores them (rank_server.py)
        signal.signal(s, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # as `python -u`: lines appear as printed
    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():  # the server read it once, at its start
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    launcher = multiprocessing.parent_process()
    if launcher is not None:
        threading.Thread(target=_end_with, args=(launcher.sentinel,), daemon=True).start()

    from torchneox.cli.exits import guarded
    from torchneox.cli.parser import build_parser

    code = guarded(lambda: train_here(build_parser().parse_args(argv)), argv)
    import atexit

    atexit._run_exitfuncs()  # a forked process ends without running them
    sys.exit(code)


def train_here(args: argparse.Namespace) -> int:
    """The train verb in this process: one rank of a launched run, or the whole run."""
    from torchneox.config.load import load_config
    from torchneox.parallel.dims import shutdown
    from torchneox.train.trainer import Trainer

    loaded = load_config(args.files, args.overrides)
    try:
        Trainer(loaded, device=args.device, load_step=args.load_step, force=args.force).run()
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown()
    return 0


def _end_with(sentinel: int) -> None:
    """End this rank when the launcher is gone (kill -9 of the launcher ends the job)."""
    multiprocessing.connection.wait([sentinel])
    os.kill(os.getpid(), signal.SIGKILL)


def _rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
