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

    convert = verbs.add_parser("convert", help="convert to and from Hugging Face")
    convert_verbs = convert.add_subparsers(
        dest="convert_verb", metavar="DIRECTION", parser_class=_Parser
    )
    convert_verbs.required = True
    from_hf = convert_verbs.add_parser(
        "from-hf", help="a local GPTNeoX/Llama/Mistral folder -> a torchneox checkpoint"
    )
    from_hf.add_argument("hf_dir", metavar="HF_DIR")
    from_hf.add_argument("out_dir", metavar="OUT_DIR")
    to_hf = convert_verbs.add_parser(
        "to-hf", help="a torchneox checkpoint -> a Hugging Face folder"
    )
    to_hf.add_argument("checkpoint", metavar="CHECKPOINT")
    to_hf.add_argument("out_dir", metavar="OUT_DIR")

    gen = verbs.add_parser(
        "generate", help="generate text from a checkpoint or a Hugging Face folder"
    )
    gen.add_argument(
        "files", nargs="*", metavar="CONFIG", help="configs with text-generation settings"
    )
    gen.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint", metavar="DIR", help="a torchneox checkpoint (save dir or step dir)"
    )
    source.add_argument("--hf", metavar="DIR", help="a local Hugging Face model folder")
    gen.add_argument("--prompt", help="complete this text and print the continuation")
    gen.add_argument("--text-gen-type", choices=("unconditional", "input-file", "interactive"))
    gen.add_argument("--temperature", type=float, help="0 means greedy")
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--maximum-tokens", type=int)
    gen.add_argument("--sample-input-file")
    gen.add_argument("--sample-output-file")
    gen.add_argument("--num-samples", type=int)
    gen.add_argument("--recompute", action="store_true", default=None, help="no KV cache")
    gen.add_argument("--seed", type=int, help="seed for sampling")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")

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


def _cmd_convert(args: argparse.Namespace) -> int:
    from torchneox import convert

    if args.convert_verb == "from-hf":
        step = convert.from_hf(args.hf_dir, args.out_dir)
    else:
        step = convert.to_hf(args.checkpoint, args.out_dir)
    print(f"wrote {step}")
    return 0


GEN_FLAGS = (
    "text_gen_type",
    "temperature",
    "top_k",
    "top_p",
    "maximum_tokens",
    "sample_input_file",
    "sample_output_file",
    "num_samples",
    "recompute",
)


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from torchneox import convert
    from torchneox.config.load import load_config
    from torchneox.data.tokenizers import build_tokenizer
    from torchneox.generate import TextGenerator, run_mode, sampling_from

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_overrides = [] if args.files else args.overrides
    if args.hf:
        loaded, model = convert.load_hf_model(args.hf, device=device)
    else:
        loaded, model = convert.load_model(args.checkpoint, model_overrides, device=device)
    settings = load_config(args.files, args.overrides).config if args.files else loaded.config
    for name in GEN_FLAGS:
        if getattr(args, name) is not None:
            settings.set(name, getattr(args, name))
    tok_cfg = (
        settings
        if settings.tokenizer.vocab_file
        or settings.tokenizer.tokenizer_type == "CharLevelTokenizer"
        else loaded.config
    )
    tokenizer = build_tokenizer(tok_cfg)
    sampling = sampling_from(settings.textgen, tokenizer.eod_id, args.seed)
    generator = TextGenerator(model, tokenizer, sampling)
    if args.prompt is not None:
        print(generator.complete([args.prompt])[0])
        return 0
    run_mode(generator, settings.textgen)
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
            handler = {"demo": _cmd_demo, "convert": _cmd_convert, "generate": _cmd_generate}[
                args.verb
            ]
        return handler(args)
    except ConfigError as e:
        print(f"torchneox: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("torchneox: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
