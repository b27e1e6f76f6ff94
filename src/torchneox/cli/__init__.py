"""``torchneox VERB ...``: parse the command line, run the verb, and turn what went wrong into
one line and an exit status (2: the user's mistake, 1: the run stopped, 3: a bug; cli/exits.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from torchneox.cli import verbs
from torchneox.cli.exits import guarded
from torchneox.cli.lighthouse import cmd_lighthouse
from torchneox.cli.parser import build_parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded(lambda: _run(argv), argv)


def _run(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:  # everything after it belongs to benchmarks/run_all.py
        return verbs.cmd_bench(argparse.Namespace(rest=argv[1:]))
    args = build_parser().parse_args(argv)
    if args.verb == "config":
        handler = {
            "explain": verbs.cmd_config_explain,
            "keys": verbs.cmd_config_keys,
            "refusals": verbs.cmd_config_refusals,
        }[args.config_verb]
    elif args.verb == "data":
        handler = {"batch": verbs.cmd_data_batch}[args.data_verb]
    elif args.verb == "checkpoint":
        handler = {"verify": verbs.cmd_checkpoint_verify}[args.checkpoint_verb]
    else:
        handler = {
            "demo": verbs.cmd_demo,
            "convert": verbs.cmd_convert,
            "generate": verbs.cmd_generate,
            "serve": verbs.cmd_serve,
            "train": verbs.cmd_train,
            "preprocess": verbs.cmd_preprocess,
            "train-tokenizer": verbs.cmd_train_tokenizer,
            "plot": verbs.cmd_plot,
            "estimate": verbs.cmd_estimate,
            "bench": verbs.cmd_bench,
            "eval": verbs.cmd_eval,
            "kernels": verbs.cmd_kernels,
            "lighthouse": cmd_lighthouse,
        }[args.verb]
    return handler(args)
