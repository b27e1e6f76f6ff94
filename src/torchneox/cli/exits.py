"""What went wrong, as one line and an exit status: 2 for the user's mistake (a config, data
or command-line error), 1 for a run that stopped, 130 for Ctrl-C, 3 for a bug in torchneox (a
short report; the traceback with TORCHNEOX_TRACEBACK=1). Every verb runs inside ``guarded``,
each rank of ``train --nproc`` too."""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from torchneox.base.errors import ConfigError, DataError, TrainingStopped

EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 3


def _one_line(error: BaseException) -> str:
    """Messages from other libraries (YAML, torch) may span lines; the error is one line."""
    return re.sub(r"\s*\n\s*", " ", str(error).strip())


SAID_ENV = "TORCHNEOX_ERRORS_SAID"
"""A folder shared by the ranks of one job (train --nproc sets it): each distinct error line
is printed by the first rank that reaches it."""


def said_first(line: str) -> bool:
    """Whether this process is the first of its job to say ``line`` (always, outside a job of
    several ranks). Under torchrun the job's folder is named by its run id."""
    folder = os.environ.get(SAID_ENV)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if folder is None and run_id and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        folder = os.path.join(tempfile.gettempdir(), f"torchneox-said-{run_id}")
    if folder is None:
        return True
    try:
        os.makedirs(folder, exist_ok=True)
        name = hashlib.sha256(line.encode()).hexdigest()[:32]
        os.close(os.open(os.path.join(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # no shared folder to agree in: every rank says it
        return True
    return True


def guarded(run: Callable[[], int], argv: list[str]) -> int:
    """``run()``'s exit status, or what went wrong said in one line and its status."""
    try:
        return run()
    except (ConfigError, DataError) as e:
        line = f"torchneox: error: {_one_line(e)}"
        if said_first(line):  # the ranks of one job hit the same mistake: said once
            print(line, file=sys.stderr)
        return EXIT_USER_ERROR
    except TrainingStopped as e:
        line = f"torchneox: error: {_one_line(e)}"
        if said_first(line):  # every rank stopped for one reason (a step's check): said once
            print(line, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("torchneox: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `torchneox config keys | head`: the reader had enough
        from torchneox.reporting.metrics import silence_stdout

        silence_stdout()
        return 0
    except Exception as e:  # a bug: a short report, the traceback only when asked
        if os.environ.get("TORCHNEOX_TRACEBACK"):
            raise
        print(_internal_error_report(e, argv), file=sys.stderr)
        return EXIT_INTERNAL_ERROR


def _internal_error_report(error: Exception, argv: list[str]) -> str:
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "torchneox" in f.filename] or frames
    where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return (
        f"torchneox: internal error: {type(error).__name__}: {first} (at {where}, in "
        f"`torchneox {' '.join(argv[:2])}`). This is a bug in torchneox, not in what you typed: "
        "please report it with the command you ran; TORCHNEOX_TRACEBACK=1 shows the traceback."
    )
