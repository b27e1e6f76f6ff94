"""The command line's grammar: every verb, its arguments and their checked types. A usage
error is one line (``ConfigError``), never argparse's usage dump."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, NoReturn

from torchneox.base.errors import ConfigError
from torchneox.cli.lighthouse import add_lighthouse_verb


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one line (no usage dump), exit status 2."""

    def error(self, message: str) -> NoReturn:
        # the CLI's line starts "torchneox: error: ": the verb follows, not the program again
        verb = self.prog.removeprefix("torchneox").strip()
        raise ConfigError(f"{verb + ': ' if verb else ''}{message} (see --help)")


def number(
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


def device_name(text: str) -> str:
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


POSITIVE = number(int, 1)


COUNT = number(int, 0)


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
    refusals = config_verbs.add_parser(
        "refusals",
        help="every feature that does not run beside a layout or another feature, and why",
    )
    refusals.add_argument(
        "--markdown", action="store_true", help="as the table of docs/parallelism.md"
    )


FORCE_HELP = "replace OUT_DIR if it holds anything (it is refused otherwise)"


def _byte_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    number = text.strip().upper()
    digits = number.rstrip("KMGTIB ")
    try:
        value = float(digits)
        unit = units[number[len(digits) :].strip()]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 5GB, 500MB or 2GiB"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be above 0")
    return int(value * unit)


def _convert_verbs(verbs: argparse._SubParsersAction) -> None:
    convert = verbs.add_parser(
        "convert", help="convert checkpoints: Hugging Face both ways, GPT-NeoX in"
    )
    convert_verbs = convert.add_subparsers(
        dest="convert_verb", metavar="DIRECTION", parser_class=_Parser
    )
    convert_verbs.required = True
    from_hf = convert_verbs.add_parser(
        "from-hf",
        help="a local GPTNeoX/Llama/Mistral/Qwen2/Qwen3/OLMo 2/Mixtral/Qwen2-MoE/Qwen3-MoE/OLMoE/"
        "Mamba folder -> a torchneox checkpoint",
    )
    from_hf.add_argument("hf_dir", metavar="HF_DIR")
    from_hf.add_argument("out_dir", metavar="OUT_DIR")
    from_hf.add_argument("--force", action="store_true", help=FORCE_HELP)
    from_hf.add_argument(
        "--adapter",
        metavar="PEFT_DIR",
        help="a PEFT LoRA adapter folder of HF_DIR's model: the checkpoint gets its lora key "
        "and adapters",
    )
    to_hf = convert_verbs.add_parser(
        "to-hf", help="a torchneox checkpoint -> a Hugging Face folder"
    )
    to_hf.add_argument("checkpoint", metavar="CHECKPOINT")
    to_hf.add_argument("out_dir", metavar="OUT_DIR")
    to_hf.add_argument("--force", action="store_true", help=FORCE_HELP)
    to_hf.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="the exported weights' dtype (default fp32: the checkpoint's master weights)",
    )
    to_hf.add_argument(
        "--adapter",
        action="store_true",
        help="write the checkpoint's LoRA adapters as a PEFT adapter folder (adapter_config.json, "
        "adapter_model.safetensors) instead of the model with them merged into its weights",
    )
    to_hf.add_argument(
        "--max-shard-size",
        type=_byte_size,
        default="5GB",
        metavar="SIZE",
        help="cut the weights into safetensors shards of at most SIZE, with an index, as "
        "transformers does (e.g. 5GB, 500MB; default 5GB)",
    )

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
    gen.add_argument(
        "--text-gen-type",
        choices=("unconditional", "input-file", "interactive", "precompute"),
        help="precompute: the model's log-probabilities of the config's DPO/KTO data",
    )
    gen.add_argument("--temperature", type=number(float, 0), help="0 means greedy")
    gen.add_argument("--top-k", type=COUNT, help="0 means no limit")
    gen.add_argument("--top-p", type=number(float, 0, 1), help="0 means off")
    gen.add_argument("--maximum-tokens", type=POSITIVE)
    gen.add_argument("--sample-input-file")
    gen.add_argument("--sample-output-file")
    gen.add_argument("--force", action="store_true", help="replace an existing output file")
    gen.add_argument("--num-samples", type=POSITIVE)
    gen.add_argument("--recompute", action="store_true", default=None, help="no KV cache")
    gen.add_argument(
        "--decode-loop",
        choices=("auto", "static", "dynamic"),
        help="static: fixed-shape steps, CUDA graphs on a GPU; auto: static on CUDA",
    )
    gen.add_argument(
        "--speculative",
        action="store_true",
        default=None,
        help="greedy, drafting with the model's MTP module: plain greedy decoding's tokens, up "
        "to two per forward",
    )
    gen.add_argument("--seed", type=COUNT, help="seed for sampling")
    gen.add_argument(
        "--device",
        type=device_name,
        default=None,
        help="cpu or cuda (default: cuda when available)",
    )


def _serve_verb(verbs: argparse._SubParsersAction) -> None:
    serve = verbs.add_parser(
        "serve",
        help="an OpenAI-compatible server (completions, chat) of a checkpoint or a Hugging Face "
        "folder, with continuous batching",
    )
    serve.add_argument("model", metavar="MODEL", help="a torchneox checkpoint or a HF folder")
    serve.add_argument(
        "--adapter",
        action="append",
        default=[],
        metavar="NAME=PEFT_DIR",
        help="a PEFT LoRA adapter folder, served as model NAME (several allowed)",
    )
    serve.add_argument("--name", help="the model name of MODEL itself (default: its folder's)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=number(int, 0, 65535), default=8000, help="8000; 0: any free")
    serve.add_argument(
        "--max-batch", type=POSITIVE, default=8, help="sequences decoded together (8)"
    )
    serve.add_argument(
        "--max-queue", type=COUNT, default=64, help="sequences waiting beyond those (64); then 429"
    )
    serve.add_argument(
        "--max-seq-len", type=POSITIVE, help="prompt and completion tokens per sequence "
        "(default: the model's positions); each slot's KV cache holds this many"
    )  # fmt: skip
    serve.add_argument(
        "--api-key",
        default=os.environ.get("TORCHNEOX_API_KEY"),
        help="requests must carry it as a Bearer token (default: $TORCHNEOX_API_KEY)",
    )
    serve.add_argument(
        "--max-body", type=_byte_size, default=8 << 20, help="largest request body (8MiB)"
    )
    serve.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    serve.add_argument(
        "--decode-loop",
        choices=("auto", "static", "dynamic"),
        default="auto",
        help="static: every slot and position each step, a CUDA graph on a GPU; dynamic: the "
        "running slots up to the longest; auto: static on CUDA",
    )
    serve.add_argument(
        "--device", type=device_name, default=None, help="cpu or cuda (default: cuda if any)"
    )
    serve.add_argument("--step-delay", type=number(float, 0), default=0.0, help=argparse.SUPPRESS)


def _dry_run_arguments(train: argparse.ArgumentParser) -> None:
    dry = train.add_argument_group(
        "dry run",
        "build the run as each rank of a cluster would, on a fake process group and fake "
        "tensors, on this machine: no data, no GPU, nothing written (docs/parallelism.md)",
    )
    dry.add_argument("--dry-run", action="store_true", help="rehearse instead of training")
    dry.add_argument(
        "--world-size", type=POSITIVE, metavar="N", help="ranks in all (default: the config's)"
    )
    dry.add_argument("--nodes", type=POSITIVE, default=1, help="nodes they run on (default 1)")
    dry.add_argument(
        "--ranks",
        metavar="LIST",
        help="'all' or ranks like 0,5,17 (default: the first and last along every mesh axis)",
    )
    dry.add_argument("--json", action="store_true", help="print the reports as one JSON object")


def _train_verbs(verbs: argparse._SubParsersAction) -> None:
    train = verbs.add_parser("train", help="train a model from GPT-NeoX configs")
    _add_config_inputs(train)
    train.add_argument(
        "--device", type=device_name, help="cpu or cuda (default: cuda when available)"
    )
    train.add_argument("--load-step", type=COUNT, help="resume from global_stepN instead of latest")
    train.add_argument(
        "--nproc",
        type=POSITIVE,
        help="train on this many local processes, forked by torchneox itself from one server "
        "that imported the trainer once (no torchrun needed; under torchrun or Slurm, leave it "
        "out)",
    )
    train.add_argument(
        "--force", action="store_true", help="let save_hf replace a folder that holds something"
    )
    _dry_run_arguments(train)

    pre = verbs.add_parser("preprocess", help="jsonl/text -> GPT-NeoX .bin/.idx token datasets")
    source_group = pre.add_mutually_exclusive_group(required=True)
    source_group.add_argument(
        "--input", nargs="+", metavar="FILE", help=".jsonl, .jsonl.zst or .txt files"
    )
    source_group.add_argument("--builtin", metavar="NAME", help="a built-in demo corpus (pydocs)")
    pre.add_argument(
        "--output-prefix", required=True, metavar="P", help="writes P_{key}_document.bin/.idx"
    )
    pre.add_argument("--tokenizer-type", help="GPT-NeoX's tokenizer_type (HFTokenizer, ...)")
    pre.add_argument("--vocab-file")
    pre.add_argument("--merge-file")
    pre.add_argument(
        "--append-eod", action="store_true", help="end every document with end-of-text"
    )
    pre.add_argument("--jsonl-keys", nargs="+", default=["text"], metavar="KEY")
    pre.add_argument("--workers", type=POSITIVE, default=1)
    pre.add_argument("--log-interval", type=POSITIVE, default=10000, metavar="DOCS")
    pre.add_argument("--force", action="store_true", help="replace existing .bin/.idx files")
    chat = pre.add_argument_group(
        "chat data (GPT-NeoX's preprocess_data_with_chat_template.py)",
        "each --jsonl-keys key holds a list of messages, rendered with the chat_template of the "
        "tokenizer_config.json beside tokenizer.json; writes P_{key}_document and "
        "P_{key}_label_document (and P_{key}_reward_document)",
    )
    chat.add_argument(
        "--chat", action="store_true", help="records are chats (with --tokenizer-type HFTokenizer)"
    )
    chat.add_argument(
        "--tokenizer-path",
        metavar="DIR",
        help="a Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json); implies "
        "--chat",
    )
    chat.add_argument(
        "--only-last", action="store_true", help="learn only the last turn of each chat"
    )
    chat.add_argument(
        "--for-rm", action="store_true", help="reward-model data: one labelled end-of-text"
    )
    chat.add_argument("--reward-key", metavar="KEY", help="each record's reward (for KTO)")
    chat.add_argument("--binary-reward", action="store_true", help="the reward's truth as +1 / -1")
    chat.add_argument(
        "--no-mask", action="store_true", help="learn every token; no label dataset is written"
    )
    chat.add_argument(
        "--generation-role", default="assistant", metavar="ROLE", help="the model's role"
    )

    tok = verbs.add_parser(
        "train-tokenizer", help="train a byte-level BPE tokenizer.json on local text"
    )
    tok.add_argument("--input", nargs="+", required=True, metavar="FILE")
    tok.add_argument("--output", required=True, metavar="tokenizer.json")
    tok.add_argument("--vocab-size", type=POSITIVE, default=50257)
    tok.add_argument("--jsonl-keys", nargs="+", default=["text"], metavar="KEY")
    tok.add_argument("--force", action="store_true", help="replace an existing --output")


def _data_verbs(verbs: argparse._SubParsersAction) -> None:
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


def _eval_verbs(verbs: argparse._SubParsersAction) -> None:
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
        "--limit", type=number(float, 0, above=True), help="documents per task (a fraction if < 1)"
    )
    ev.add_argument("--num-fewshot", type=COUNT)
    ev.add_argument("--iters", type=POSITIVE, default=20, help="batches to evaluate")
    ev.add_argument("--batch-size", type=POSITIVE, default=8)
    ev.add_argument("--device", type=device_name)

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
        type=number(float, 0, 1, above=True),
        default=0.4,
        help="model FLOPs utilisation to assume",
    )
    est.add_argument("--json", action="store_true", help="print one JSON object")


def _tool_verbs(verbs: argparse._SubParsersAction) -> None:
    bench = verbs.add_parser(
        "bench", help="run every benchmark (from a source checkout) and append the results"
    )
    bench.add_argument("rest", nargs="*", help="passed to benchmarks/run_all.py (--list, --only)")

    kernels = verbs.add_parser(
        "kernels",
        help="the CPU kernel verdicts and matmul peaks this machine cached, with their times",
    )
    what = kernels.add_mutually_exclusive_group()
    what.add_argument(
        "--remeasure",
        action="store_true",
        help="time this machine's cached verdicts and peaks again and rewrite the files "
        "(on an otherwise idle machine)",
    )
    what.add_argument(
        "--clear", action="store_true", help="remove both files: the next run times afresh"
    )

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
    plot.add_argument(
        "--metric",
        default="lm_loss",
        help="the logged value to draw (and its valid_ twin): lm_loss, or e.g. reward, kl, "
        "completion_length of a reinforce run",
    )
    plot.add_argument("--force", action="store_true", help="replace an existing --out file")

    add_lighthouse_verb(verbs)

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
    for add in (
        _config_verbs,
        _convert_verbs,
        _generate_verb,
        _serve_verb,
        _train_verbs,
        _data_verbs,
        _eval_verbs,
        _tool_verbs,
    ):
        add(verbs)
    return parser
