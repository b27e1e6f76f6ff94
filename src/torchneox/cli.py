"""``torchneox VERB ...``: parse the command line and hand over. Nothing else lives here."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from torchneox.config.errors import ConfigError

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def _add_config_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="GPT-NeoX YAML config files, merged")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key after the files are merged; dotted keys reach into dicts "
        "(optimizer.params.lr=3e-4); may be repeated",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchneox", description=__doc__)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verbs.required = True

    config = verbs.add_parser("config", help="read, explain and document GPT-NeoX configs")
    config_verbs = config.add_subparsers(dest="config_verb", metavar="ACTION", parser_class=_Parser)
    config_verbs.required = True
    explain = config_verbs.add_parser(
        "explain", help="load configs and show every derived value with its reason"
    )
    _add_config_inputs(explain)
    explain.add_argument("--world-size", type=int, help="number of processes to plan for")
    fmt = explain.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object (stable keys)")
    fmt.add_argument(
        "--format",
        choices=("text", "json", "yaml"),
        default="text",
        help="yaml prints the resolved config, which loads back to the same config",
    )
    keys = config_verbs.add_parser("keys", help="reference of every config key")
    keys.add_argument("--markdown", action="store_true", help="as the Markdown of docs/config.md")

    verbs.add_parser("demo", help="what `make demo` shows")
    return parser


def _cmd_config_explain(args: argparse.Namespace) -> int:
    from torchneox.config.derive import derive
    from torchneox.config.load import load_config
    from torchneox.config.report import render_json, render_text, render_yaml

    loaded = load_config(args.files, args.overrides)
    derived = derive(loaded, world_size=args.world_size)
    fmt = "json" if args.json else args.format
    if fmt == "json":
        print(render_json(derived))
    elif fmt == "yaml":
        print(render_yaml(loaded, derived), end="")
    else:
        print(render_text(loaded, derived))
    return 0


def _cmd_config_keys(args: argparse.Namespace) -> int:
    from torchneox.config.report import keys_markdown, keys_text

    print(keys_markdown() if args.markdown else keys_text(), end="\n" if not args.markdown else "")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    demo_config = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yml"
    print(
        f"$ torchneox config explain {demo_config.relative_to(Path.cwd()) if demo_config.is_relative_to(Path.cwd()) else demo_config}\n"
    )
    return main(["config", "explain", str(demo_config)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.verb == "config":
            handler = {"explain": _cmd_config_explain, "keys": _cmd_config_keys}[args.config_verb]
        else:
            handler = {"demo": _cmd_demo}[args.verb]
        return handler(args)
    except ConfigError as e:
        print(f"torchneox: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("torchneox: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
