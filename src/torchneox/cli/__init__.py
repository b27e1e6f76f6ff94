"""``torchneox VERB ...``: parse the command line and hand over. Nothing else lives here."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from torchneox.base.errors import ConfigError, DataError, TrainingStopped
from torchneox.config.load import load_config

EXIT_USER_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see --help)")


def _number(
    kind: type, low: float | None = None, high: float | None = None, *, above: bool = False
) -> Callable[[str], Any]:
    """An argparse type: a finite int or float in [low, high] (``above``: strictly > low)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (value < low or (above and value == low)):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if above else '>='} {low:g}, got {text}"
            )
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high:g}, got {text}")
        return value

    return parse


def _device_name(text: str) -> str:
    """An argparse type: a device this machine has (cpu, cuda, cuda:N, mps)."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise argparse.ArgumentTypeError(
                f"{text}: this machine has no CUDA device (torch is {build}); use --device cpu"
            )
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: there are only {count} CUDA devices")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no MPS device")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{text}: only cpu, cuda and mps are supported")
    return text


POSITIVE = _number(int, 1)
COUNT = _number(int, 0)


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


def _config_verbs(verbs: argparse._SubParsersAction) -> None:
    config = verbs.add_parser("config", help="read, explain and document GPT-NeoX configs")
    config_verbs = config.add_subparsers(dest="config_verb", metavar="ACTION", parser_class=_Parser)
    config_verbs.required = True
    explain = config_verbs.add_parser(
        "explain", help="load configs and show every derived value with its reason"
    )
    _add_config_inputs(explain)
    explain.add_argument("--world-size", type=POSITIVE, help="number of processes to plan for")
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


FORCE_HELP = "replace OUT_DIR if it holds anything (it is refused otherwise)"


def _convert_verbs(verbs: argparse._SubParsersAction) -> None:
    convert = verbs.add_parser(
        "convert", help="convert checkpoints: Hugging Face both ways, GPT-NeoX in"
    )
    convert_verbs = convert.add_subparsers(
        dest="convert_verb", metavar="DIRECTION", parser_class=_Parser
    )
    convert_verbs.required = True
    from_hf = convert_verbs.add_parser(
        "from-hf", help="a local GPTNeoX/Llama/Mistral folder -> a torchneox checkpoint"
    )
    from_hf.add_argument("hf_dir", metavar="HF_DIR")
    from_hf.add_argument("out_dir", metavar="OUT_DIR")
    from_hf.add_argument("--force", action="store_true", help=FORCE_HELP)
    to_hf = convert_verbs.add_parser(
        "to-hf", help="a torchneox checkpoint -> a Hugging Face folder"
    )
    to_hf.add_argument("checkpoint", metavar="CHECKPOINT")
    to_hf.add_argument("out_dir", metavar="OUT_DIR")
    to_hf.add_argument("--force", action="store_true", help=FORCE_HELP)

    neox = convert_verbs.add_parser(
        "from-gpt-neox", help="a GPT-NeoX (DeepSpeed) checkpoint -> a torchneox checkpoint"
    )
    neox.add_argument(
        "neox_dir",
        metavar="NEOX_CHECKPOINT_DIR",
        help="a save dir (with 'latest') or a global_stepN dir",
    )
    neox.add_argument("out_dir", metavar="OUT_DIR")
    neox.add_argument("--force", action="store_true", help=FORCE_HELP)
    neox.add_argument(
        "--config",
        nargs="+",
        default=[],
        metavar="NEOX_YML",
        help="default: the checkpoint's configs/ folder",
    )
    neox.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    neox.add_argument("--step", type=COUNT, help="convert global_stepN instead of latest")
    neox.add_argument(
        "--with-optimizer",
        action="store_true",
        help="also the optimizer, iteration, data position and RNG, to continue training",
    )


def _generate_verb(verbs: argparse._SubParsersAction) -> None:
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
    gen.add_argument("--temperature", type=_number(float, 0), help="0 means greedy")
    gen.add_argument("--top-k", type=COUNT, help="0 means no limit")
    gen.add_argument("--top-p", type=_number(float, 0, 1), help="0 means off")
    gen.add_argument("--maximum-tokens", type=POSITIVE)
    gen.add_argument("--sample-input-file")
    gen.add_argument("--sample-output-file")
    gen.add_argument("--force", action="store_true", help="replace an existing output file")
    gen.add_argument("--num-samples", type=POSITIVE)
    gen.add_argument("--recompute", action="store_true", default=None, help="no KV cache")
    gen.add_argument("--seed", type=COUNT, help="seed for sampling")
    gen.add_argument(
        "--device",
        type=_device_name,
        default=None,
        help="cpu or cuda (default: cuda when available)",
    )


def _train_verbs(verbs: argparse._SubParsersAction) -> None:
    train = verbs.add_parser("train", help="train a model from GPT-NeoX configs")
    _add_config_inputs(train)
    train.add_argument(
        "--device", type=_device_name, help="cpu or cuda (default: cuda when available)"
    )
    train.add_argument("--load-step", type=COUNT, help="resume from global_stepN instead of latest")
    train.add_argument(
        "--nproc", type=POSITIVE, help="start this many local processes (torchrun --standalone)"
    )

    pre = verbs.add_parser("preprocess", help="jsonl/text -> GPT-NeoX .bin/.idx token datasets")
    source_group = pre.add_mutually_exclusive_group(required=True)
    source_group.add_argument(
        "--input", nargs="+", metavar="FILE", help=".jsonl, .jsonl.zst or .txt files"
    )
    source_group.add_argument("--builtin", metavar="NAME", help="a built-in demo corpus (pydocs)")
    pre.add_argument(
        "--output-prefix", required=True, metavar="P", help="writes P_{key}_document.bin/.idx"
    )
    pre.add_argument("--tokenizer-type", required=True)
    pre.add_argument("--vocab-file")
    pre.add_argument("--merge-file")
    pre.add_argument(
        "--append-eod", action="store_true", help="end every document with end-of-text"
    )
    pre.add_argument("--jsonl-keys", nargs="+", default=["text"], metavar="KEY")
    pre.add_argument("--workers", type=POSITIVE, default=1)
    pre.add_argument("--log-interval", type=POSITIVE, default=10000, metavar="DOCS")
    pre.add_argument("--force", action="store_true", help="replace existing .bin/.idx files")

    tok = verbs.add_parser(
        "train-tokenizer", help="train a byte-level BPE tokenizer.json on local text"
    )
    tok.add_argument("--input", nargs="+", required=True, metavar="FILE")
    tok.add_argument("--output", required=True, metavar="tokenizer.json")
    tok.add_argument("--vocab-size", type=POSITIVE, default=50257)
    tok.add_argument("--jsonl-keys", nargs="+", default=["text"], metavar="KEY")
    tok.add_argument("--force", action="store_true", help="replace an existing --output")


def _data_and_eval_verbs(verbs: argparse._SubParsersAction) -> None:
    data = verbs.add_parser("data", help="look at the data a config trains on")
    data_verbs = data.add_subparsers(dest="data_verb", metavar="ACTION", parser_class=_Parser)
    data_verbs.required = True
    batch = data_verbs.add_parser("batch", help="the global batch a training step sees")
    _add_config_inputs(batch)
    batch.add_argument(
        "--iteration", type=POSITIVE, required=True, help="training step (the first is 1)"
    )
    batch.add_argument(
        "--out", metavar="FILE.npy", help="write token ids [batch, seq+1] instead of text"
    )
    batch.add_argument("--force", action="store_true", help="replace an existing --out file")

    ev = verbs.add_parser(
        "eval",
        help="evaluate a checkpoint: lm-evaluation-harness tasks, or perplexity on .bin/.idx",
    )
    ev.add_argument("files", nargs="*", metavar="CONFIG")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ev.add_argument("--checkpoint", required=True, metavar="DIR")
    ev.add_argument("--data-path", metavar="PREFIX", help="perplexity on PREFIX.bin/.idx")
    ev.add_argument("--tasks", help="lm-evaluation-harness tasks, comma-separated")
    ev.add_argument("--include-path", metavar="DIR", help="folder of extra lm-eval task YAML files")
    ev.add_argument(
        "--limit", type=_number(float, 0, above=True), help="documents per task (a fraction if < 1)"
    )
    ev.add_argument("--num-fewshot", type=COUNT)
    ev.add_argument("--iters", type=POSITIVE, default=20, help="batches to evaluate")
    ev.add_argument("--batch-size", type=POSITIVE, default=8)
    ev.add_argument("--device", type=_device_name)

    est = verbs.add_parser(
        "estimate", help="parameters, FLOPs, memory per GPU, fit and step time of a config"
    )
    _add_config_inputs(est)
    est.add_argument("--gpus", type=POSITIVE, required=True, help="GPUs in all")
    est.add_argument("--nodes", type=POSITIVE, default=1)
    est.add_argument(
        "--gpu", default="h100", help="accelerator (see the table in docs/estimate.md)"
    )
    est.add_argument(
        "--mfu",
        type=_number(float, 0, 1, above=True),
        default=0.4,
        help="model FLOPs utilisation to assume",
    )
    est.add_argument("--json", action="store_true", help="print one JSON object")

    bench = verbs.add_parser(
        "bench", help="run every benchmark (from a source checkout) and append the results"
    )
    bench.add_argument("rest", nargs="*", help="passed to benchmarks/run_all.py (--list, --only)")

    ck = verbs.add_parser("checkpoint", help="check checkpoints")
    ck_verbs = ck.add_subparsers(dest="checkpoint_verb", metavar="ACTION", parser_class=_Parser)
    ck_verbs.required = True
    verify = ck_verbs.add_parser(
        "verify", help="compare a checkpoint (or every one in a save directory) with its manifest"
    )
    verify.add_argument("dir", metavar="DIR", help="a save directory or one global_stepN")

    plot = verbs.add_parser("plot", help="draw loss curves of runs to a PNG")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="folders with a metrics.jsonl")
    plot.add_argument("--out", default="loss.png")
    plot.add_argument("--force", action="store_true", help="replace an existing --out file")

    demo = verbs.add_parser("demo", help="what `make demo` shows: preprocess, train, generate")
    demo.add_argument("--dir", default="runs/demo", help="where the demo's data and checkpoints go")
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torchneox",
        description="Train GPT-NeoX-style language models from GPT-NeoX configs, on PyTorch alone.",
    )
    from torchneox import __version__

    parser.add_argument("--version", action="version", version=f"torchneox {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    verbs.required = True
    for add in (_config_verbs, _convert_verbs, _generate_verb, _train_verbs, _data_and_eval_verbs):
        add(verbs)
    return parser


def _cmd_config_explain(args: argparse.Namespace) -> int:
    from torchneox.config.derive import derive
    from torchneox.config.layout import Layout, check_layout
    from torchneox.config.load import load_config
    from torchneox.config.report import render_json, render_text, render_yaml

    loaded = load_config(args.files, args.overrides)
    derived = derive(loaded, world_size=args.world_size)
    check_layout(loaded, Layout.from_derived(loaded.config, derived))
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
    from torchneox.interop import huggingface

    if args.convert_verb == "from-hf":
        step = huggingface.from_hf(args.hf_dir, args.out_dir, force=args.force)
    elif args.convert_verb == "from-gpt-neox":
        from torchneox.interop import gpt_neox

        step = gpt_neox.convert(
            args.neox_dir,
            args.out_dir,
            args.config,
            args.overrides,
            args.step,
            args.with_optimizer,
            progress=True,
            force=args.force,
        )
    else:
        step = huggingface.to_hf(args.checkpoint, args.out_dir, force=args.force)
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

    from torchneox.config.load import load_config
    from torchneox.data.tokenizers import build_tokenizer
    from torchneox.inference.generate import TextGenerator, run_mode, sampling_from
    from torchneox.train import checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_overrides = [] if args.files else args.overrides
    if args.hf:
        from torchneox.interop.huggingface import load_hf_model

        loaded, model = load_hf_model(args.hf, device=device)
    else:
        loaded, model = checkpoint.load_model(args.checkpoint, model_overrides, device=device)
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
    mode = settings.textgen.text_gen_type or "interactive"
    if mode in ("unconditional", "input-file"):
        from torchneox.config.paths import refuse_existing

        output = Path(settings.textgen.sample_output_file)
        refuse_existing([output], args.force, f"generate ({mode})")
    run_mode(generator, settings.textgen)
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from torchneox.config.load import load_config
    from torchneox.parallel.dims import shutdown
    from torchneox.train.trainer import Trainer

    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_local(args)
    loaded = load_config(args.files, args.overrides)
    try:
        Trainer(loaded, device=args.device, load_step=args.load_step).run()
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown()
    return 0


def _launch_local(args: argparse.Namespace) -> int:
    """The same training command in ``--nproc`` local processes, through torchrun itself."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    from torchneox.config.derive import derive
    from torchneox.config.load import load_config
    from torchneox.train.trainer import require

    loaded = load_config(args.files, args.overrides)
    require(loaded, derive(loaded, world_size=args.nproc))  # config errors once, here
    save = loaded.config.checkpoint.save
    latest = Path(save) / "latest" if save else None

    def newest() -> str | None:
        return latest.read_text().strip() if latest and latest.is_file() else None

    before = newest()

    argv = ["train", *args.files]
    for override in args.overrides:
        argv += ["--set", override]
    if args.device:
        argv += ["--device", args.device]
    if args.load_step is not None:
        argv += ["--load-step", str(args.load_step)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun(["--standalone", "--nproc-per-node", str(args.nproc), "-m", "torchneox", *argv])
    except SignalException as e:
        # SIGTERM/SIGINT reached the launcher and its workers: they finish the step and save
        saved = newest()
        if saved and saved != before:
            print(
                f"stopped by {e.sigval.name}; every rank saved {Path(save) / saved}: rerun the "
                "same command to resume"
            )
            return 0
        print(f"torchneox: error: stopped by {e.sigval.name} before a checkpoint was saved")
        return 1
    except Exception as e:  # torchrun raises ChildFailedError naming each failed rank
        print(
            f"torchneox: error: a training process failed ({type(e).__name__}); its output is above",
            file=sys.stderr,
        )
        return 1
    return 0


def _cmd_preprocess(args: argparse.Namespace) -> int:
    import tempfile

    from torchneox.config.paths import refuse_existing
    from torchneox.data import builtin
    from torchneox.data.preprocess import PreprocessArgs, preprocess

    outputs = [
        Path(f"{args.output_prefix}_{key}_document{ext}")
        for key in args.jsonl_keys
        for ext in (".bin", ".idx")
    ]
    refuse_existing(outputs, args.force, "preprocess")
    if args.tokenizer_type == "CharLevelTokenizer" and (args.vocab_file or args.merge_file):
        print(
            "warning: CharLevelTokenizer reads no files (a token is a byte): --vocab-file and "
            "--merge-file are not used",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory() as tmp:
        inputs = args.input
        if args.builtin:
            source = Path(tmp) / f"{args.builtin}.jsonl"
            count = builtin.write_jsonl(args.builtin, source)
            print(f"built-in corpus {args.builtin!r}: {count} documents", file=sys.stderr)
            inputs = [str(source)]
        prefixes = preprocess(
            PreprocessArgs(
                inputs=inputs,
                output_prefix=args.output_prefix,
                tokenizer_type=args.tokenizer_type,
                vocab_file=args.vocab_file,
                merge_file=args.merge_file,
                append_eod=args.append_eod,
                jsonl_keys=tuple(args.jsonl_keys),
                workers=args.workers,
                log_interval=args.log_interval,
            )
        )
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


def _cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from torchneox.config.paths import refuse_existing
    from torchneox.data.tokenizers import train_bpe

    refuse_existing([Path(args.output)], args.force, "train-tokenizer")
    size = train_bpe(args.input, args.output, args.vocab_size, tuple(args.jsonl_keys))
    print(f"wrote {args.output} ({size} tokens)")
    return 0


def _cmd_data_batch(args: argparse.Namespace) -> int:
    import numpy as np

    from torchneox.config.derive import derive
    from torchneox.config.load import load_config
    from torchneox.config.paths import refuse_existing
    from torchneox.data.datasets import build_splits
    from torchneox.data.tokenizers import build_tokenizer

    if args.out:
        refuse_existing([Path(args.out)], args.force, "data batch --out")
    loaded = load_config(args.files, args.overrides)
    tbs = derive(loaded, world_size=1)["train_batch_size"]
    if tbs is None:
        raise ConfigError(
            "needs train_micro_batch_size_per_gpu or train_batch_size", key="train_batch_size"
        )
    train_iters = loaded.config.training.train_iters
    if args.iteration < 1 or (train_iters and args.iteration > train_iters):
        raise ConfigError(f"--iteration must be between 1 and train_iters ({train_iters})")
    samples = build_splits(loaded.config, tbs).train
    assert samples is not None
    start = (args.iteration - 1) * tbs
    batch = np.stack([samples[i] for i in range(start, start + tbs)])
    if args.out:
        from torchneox.config.paths import atomic_output

        with atomic_output(args.out, "--out file") as tmp, open(tmp, "wb") as f:
            np.save(f, batch)
        print(f"wrote {args.out}: token ids {list(batch.shape)} of step {args.iteration}")
        return 0
    tokenizer = build_tokenizer(loaded.config)
    for i, row in enumerate(batch):
        print(f"--- sample {start + i} (step {args.iteration}, position {i}) ---")
        pieces, current = [], []
        for token in row.tolist():
            if token == tokenizer.eod_id:
                pieces.append(tokenizer.decode(current))
                current = []
            else:
                current.append(token)
        print("<|endoftext|>".join([*pieces, tokenizer.decode(current)]))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from torchneox.train import checkpoint
    from torchneox.train.evaluation import perplexity

    if not args.data_path and not args.tasks:
        raise ConfigError("give --tasks T1,T2 (lm-evaluation-harness) or --data-path PREFIX")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    overrides = [] if args.files else args.overrides
    loaded, model = checkpoint.load_model(args.checkpoint, overrides, device=device)
    cfg = load_config(args.files, args.overrides).config if args.files else loaded.config
    if args.tasks:
        from torchneox.data.tokenizers import build_tokenizer
        from torchneox.train.lm_eval import evaluate_checkpoint

        limit = args.limit if args.limit is None or args.limit < 1 else int(args.limit)
        results = evaluate_checkpoint(
            model.eval(),
            build_tokenizer(cfg),
            [t.strip() for t in args.tasks.split(",") if t.strip()],
            args.include_path,
            limit,
            args.batch_size,
            args.num_fewshot,
        )
        print(json.dumps(results))
        if not args.data_path:
            return 0
    seq = cfg.model.seq_length or loaded.config.model.seq_length
    result = perplexity(model, args.data_path, seq, args.iters, args.batch_size, cfg.training.seed)
    print(json.dumps(result))
    return 0


def _cmd_estimate(args: argparse.Namespace) -> int:
    from torchneox.config.load import load_config
    from torchneox.estimate.search import estimate, render

    loaded = load_config(args.files, args.overrides)
    est = estimate(loaded, args.gpus, args.gpu.lower(), args.nodes, args.mfu)
    print(json.dumps(est) if args.json else render(est))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    here = Path.cwd() / "benchmarks" / "run_all.py"
    source = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"
    script = here if here.is_file() else source
    if not script.is_file():
        raise ConfigError(
            "the benchmarks live in the source checkout (benchmarks/run_all.py); run this there"
        )
    return subprocess.call([sys.executable, str(script), *args.rest])


def _cmd_checkpoint_verify(args: argparse.Namespace) -> int:
    from torchneox.train import checkpoint

    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError("no such checkpoint directory", source=str(root))
    steps = [p for _, p in checkpoint.step_dirs(root)] or [root]
    bad = 0
    for step in steps:
        problems = checkpoint.verify(step, content=True)
        bad += bool(problems)
        print(f"{step}: " + ("complete" if not problems else "; ".join(problems)))
    latest = root / "latest"
    if latest.is_file():
        name = latest.read_text().strip()
        ok = (root / name).is_dir() and not checkpoint.verify(root / name)
        bad += not ok
        print(f"{latest}: {name}" + ("" if ok else " (missing or damaged)"))
    return 1 if bad else 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from torchneox.config.paths import refuse_existing
    from torchneox.train.plot import plot_runs

    refuse_existing([Path(args.out)], args.force, "plot")
    plot_runs([Path(r) for r in args.runs], Path(args.out))
    print(f"wrote {args.out}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from torchneox.cli.demo import run_demo

    return run_demo(Path(args.dir), args.overrides)


def _one_line(error: BaseException) -> str:
    """Messages from other libraries (YAML, torch) may span lines; the error is one line."""
    return re.sub(r"\s*\n\s*", " ", str(error).strip())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:  # everything after it belongs to benchmarks/run_all.py
            return _cmd_bench(argparse.Namespace(rest=argv[1:]))
        args = parser.parse_args(argv)
        if args.verb == "config":
            handler = {"explain": _cmd_config_explain, "keys": _cmd_config_keys}[args.config_verb]
        elif args.verb == "data":
            handler = {"batch": _cmd_data_batch}[args.data_verb]
        elif args.verb == "checkpoint":
            handler = {"verify": _cmd_checkpoint_verify}[args.checkpoint_verb]
        else:
            handler = {
                "demo": _cmd_demo,
                "convert": _cmd_convert,
                "generate": _cmd_generate,
                "train": _cmd_train,
                "preprocess": _cmd_preprocess,
                "train-tokenizer": _cmd_train_tokenizer,
                "plot": _cmd_plot,
                "estimate": _cmd_estimate,
                "bench": _cmd_bench,
                "eval": _cmd_eval,
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


EXIT_INTERNAL_ERROR = 3


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
