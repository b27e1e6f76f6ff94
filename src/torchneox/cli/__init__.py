"""``torchneox VERB ...``: parse the command line, run the verb, and turn what went wrong into
one line and an exit status (2: the user's mistake, 1: the run stopped, 3: a bug)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from torchneox.base.errors import ConfigError, DataError, TrainingStopped
from torchneox.cli import verbs
from torchneox.cli.parser import build_parser

EXIT_USER_ERROR = 2


EXIT_INTERNAL_ERROR = 3


def _one_line(error: BaseException) -> str:
    """Messages from other libraries (YAML, torch) may span lines; the error is one line."""
    return re.sub(r"\s*\n\s*", " ", str(error).strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:  # everything after it belongs to benchmarks/run_all.py
            return verbs.cmd_bench(argparse.Namespace(rest=argv[1:]))
        args = parser.parse_args(argv)
        if args.verb == "config":
            handler = {"explain": verbs.cmd_config_explain, "keys": verbs.cmd_config_keys}[
                args.config_verb
            ]
        elif args.verb == "data":
            handler = {"batch": verbs.cmd_data_batch}[args.data_verb]
        elif args.verb == "checkpoint":
            handler = {"verify": verbs.cmd_checkpoint_verify}[args.checkpoint_verb]
        else:
            handler = {
                "demo": verbs.cmd_demo,
                "convert": verbs.cmd_convert,
                "generate": verbs.cmd_generate,
                "train": verbs.cmd_train,
                "preprocess": verbs.cmd_preprocess,
                "train-tokenizer": verbs.cmd_train_tokenizer,
                "plot": verbs.cmd_plot,
                "estimate": verbs.cmd_estimate,
                "bench": verbs.cmd_bench,
                "eval": verbs.cmd_eval,
                "kernels": verbs.cmd_kernels,
            }[args.verb]
        return handler(args)
    except (ConfigError, DataError) as e:
        print(f"torchneox: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except TrainingStopped as e:
        print(f"torchneox: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("torchneox: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `torchneox config keys | head`: the reader had enough
        from torchneox.train.metrics import silence_stdout

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
