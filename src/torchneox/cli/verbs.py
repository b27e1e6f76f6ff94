"""The verbs: each reads its arguments, calls the function that does the work, and prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from torchneox.base.errors import ConfigError
from torchneox.config.load import load_config


def cmd_config_explain(args: argparse.Namespace) -> int:
    from torchneox.config.derive import derive
    from torchneox.config.layout import Layout, check_layout
    from torchneox.config.load import load_config
    from torchneox.config.report import render_json, render_text, render_yaml
    from torchneox.data.epochs import explained_epochs
    from torchneox.models.hf.folder import explain_note, with_hf_folder

    loaded = with_hf_folder(load_config(args.files, args.overrides))
    loaded = explained_epochs(loaded, args.world_size)
    derived = derive(loaded, world_size=args.world_size)
    note = explain_note(loaded)
    if note is not None:
        derived.notes.insert(0, note)
    check_layout(loaded, Layout.from_derived(loaded.config, derived))
    fmt = "json" if args.json else args.format
    if fmt == "json":
        print(render_json(derived))
    elif fmt == "yaml":
        print(render_yaml(loaded, derived), end="")
    else:
        print(render_text(loaded, derived))
    return 0


def cmd_config_keys(args: argparse.Namespace) -> int:
    from torchneox.config.report import keys_markdown, keys_text

    print(keys_markdown() if args.markdown else keys_text(), end="\n" if not args.markdown else "")
    return 0


def cmd_config_refusals(args: argparse.Namespace) -> int:
    from torchneox.config.refusals import REFUSALS, markdown

    if args.markdown:
        print(markdown(), end="")
    else:
        for r in REFUSALS:
            print(f"{r.feature} beside {r.beside}: {r.reason}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from torchneox.interop import huggingface

    if args.convert_verb == "from-hf" and args.adapter:
        from torchneox.interop import peft_adapter

        step = peft_adapter.from_hf_with_adapter(
            args.hf_dir, args.adapter, args.out_dir, args.force
        )
    elif args.convert_verb == "from-hf":
        step = huggingface.from_hf(args.hf_dir, args.out_dir, force=args.force, progress=True)
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
    elif args.adapter:
        from torchneox.interop import peft_adapter

        step = peft_adapter.to_peft(args.checkpoint, args.out_dir, args.force, args.dtype)
    else:
        step = huggingface.to_hf(
            args.checkpoint,
            args.out_dir,
            force=args.force,
            dtype=args.dtype,
            max_shard_bytes=args.max_shard_size,
            progress=True,
        )
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
    "decode_loop",
    "speculative",
)


def _precompute(model: Any, settings: Any, device: str) -> int:
    """GPT-NeoX's text_gen_type precompute: the reference log-probabilities DPO/KTO read."""
    import torch

    from torchneox.inference.precompute import precompute_logprobs

    if not has_training_data(settings):
        raise ConfigError(
            "precompute reads the config's training data: give the dpo or kto config (with "
            "its data paths and precompute_model_name) as CONFIG",
            key="train_data_paths",
        )
    group = settings.training.train_micro_batch_size_per_gpu or 1
    for prefix in precompute_logprobs(model, settings, group, torch.device(device)):
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


def has_training_data(settings: Any) -> bool:
    return bool(settings.data.train_data_paths or settings.data.pos_train_data_paths)


def _say_positions_cut(maximum_tokens: int, positions: int) -> None:
    """maximum_tokens asked past the model's positions: said once as generation starts, as
    GPT-NeoX cuts it (each sample stops at the model's last position)."""
    if maximum_tokens >= positions:
        print(
            f"generate: maximum_tokens {maximum_tokens} is past the model's {positions} "
            "positions: each sample stops at the last position (prompt and text together)",
            file=sys.stderr,
        )


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from torchneox.checkpoint import weights
    from torchneox.config.load import load_config
    from torchneox.inference.generate import (
        TextGenerator,
        generation_mode,
        generation_stop_ids,
        run_mode,
        sampling_from,
    )

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_overrides = [] if args.files else args.overrides
    if args.hf:
        from torchneox.interop.huggingface import load_hf_model

        loaded, model = load_hf_model(args.hf, device=device)
    else:
        loaded, model = weights.load_model(args.checkpoint, model_overrides, device=device)
    asked = load_config(args.files, args.overrides) if args.files else None
    settings = asked.config if asked is not None else loaded.config
    asked_tokens = args.maximum_tokens is not None or (
        asked is not None and asked.given("maximum_tokens")
    )
    for name in GEN_FLAGS:
        if getattr(args, name) is not None:
            settings.set(name, getattr(args, name))
    if (settings.textgen.text_gen_type or "") == "precompute":
        return _precompute(model, settings, device)
    tok_cfg, tokenizer = _generation_tokenizer(args, settings, loaded.config)
    sampling = sampling_from(settings.textgen, tokenizer.eod_id, args.seed)
    sampling.stop_ids |= generation_stop_ids(tok_cfg.tokenizer.vocab_file)
    generator = TextGenerator(model, tokenizer, sampling)
    positions = model.args.max_positions if asked_tokens else None
    if args.prompt is not None:
        if positions is not None:
            _say_positions_cut(sampling.maximum_tokens, positions)
        print(generator.complete([args.prompt])[0])
        return 0
    mode = generation_mode(settings.textgen)
    inputs = [args.checkpoint or args.hf, *args.files, settings.textgen.sample_input_file]
    inputs += [tok_cfg.tokenizer.vocab_file, tok_cfg.tokenizer.merge_file]
    if mode in ("unconditional", "input-file"):
        from torchneox.config.paths import refuse_existing

        output = Path(settings.textgen.sample_output_file)
        refuse_existing([output], args.force, f"generate ({mode})", inputs=inputs)
    if positions is not None:
        _say_positions_cut(sampling.maximum_tokens, positions)
    run_mode(generator, settings.textgen, inputs=inputs)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from torchneox.cli.serve import cmd_serve

    return cmd_serve(args)


TOKENIZER_FILE_KEYS = {"tokenizer_type", "vocab_file", "merge_file"}


def _generation_tokenizer(args: argparse.Namespace, settings: Any, model_cfg: Any) -> tuple:
    """The config whose tokenizer generate uses (the settings' where they name one, else the
    model's) and that tokenizer."""
    from torchneox.data.tokenizers import build_tokenizer, model_tokenizer

    tok_cfg = (
        settings
        if settings.tokenizer.vocab_file
        or settings.tokenizer.tokenizer_type == "CharLevelTokenizer"
        else model_cfg
    )
    tokenizer_set = {o.partition("=")[0].strip() for o in args.overrides} & TOKENIZER_FILE_KEYS
    if tok_cfg is model_cfg and not tokenizer_set:  # the model's own: say what is missing
        return tok_cfg, model_tokenizer(tok_cfg.tokenizer, _model_config_name(args))
    return tok_cfg, build_tokenizer(tok_cfg.tokenizer)


def _model_config_name(args: argparse.Namespace) -> str:
    """What names the model's tokenizer: the checkpoint's config.yml, or the HF folder."""
    if args.hf:
        return str(args.hf)
    from torchneox.checkpoint.files import resolve

    return str(resolve(args.checkpoint) / "config.yml")


def cmd_train(args: argparse.Namespace) -> int:
    dry_flags = [f for f in ("world_size", "ranks", "json") if getattr(args, f)]
    if args.nodes != 1:
        dry_flags.append("nodes")
    if dry_flags and not args.dry_run:
        raise ConfigError(f"--{dry_flags[0].replace('_', '-')} is for a dry run: add --dry-run")
    if args.dry_run:
        return _dry_run(args)
    if _mup_one_off(args):
        return 0
    from torchneox.cli.launch import launch_local, train_here

    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return launch_local(args)
    return train_here(args)


def _mup_one_off(args: argparse.Namespace) -> bool:
    """use_mup's save_base_shapes or coord_check, run once (rank 0 only when launched) instead
    of training, as GPT-NeoX does."""
    loaded = load_config(args.files, args.overrides)
    t = loaded.config.training
    if not (t.use_mup and (t.save_base_shapes or t.coord_check)):
        return False
    if os.environ.get("RANK", "0") != "0":  # launched by torchrun: rank 0 writes
        return True
    from torchneox.train.mup_checks import one_off

    return one_off(loaded)


def _dry_run(args: argparse.Namespace) -> int:
    """``train --dry-run``: 0 when every rehearsed rank builds, agrees and holds what
    estimate computes, 1 when the report lists problems."""
    import dataclasses

    from torchneox.config.derive import derive
    from torchneox.config.load import load_config
    from torchneox.data.epochs import apply_train_epochs
    from torchneox.estimate.dry_run import dry_run, render

    if args.nproc:
        raise ConfigError("--nproc starts processes; a dry run needs none (give --world-size)")
    from torchneox.models.hf.folder import with_hf_folder

    loaded = with_hf_folder(load_config(args.files, args.overrides))
    world = args.world_size or derive(loaded)["world_size"]
    if not world:
        raise ConfigError("a dry run needs the ranks in all: give --world-size N", key="num_gpus")
    loaded = apply_train_epochs(loaded, world)  # train_epochs: the steps the data makes

    def progress(done: int, total: int, report) -> None:
        if not args.json:
            print(
                f"[{done}/{total}] rank {report.rank} built in {report.seconds:.1f} s", flush=True
            )

    run = dry_run(loaded, world, args.nodes, args.ranks, progress)
    print(json.dumps(dataclasses.asdict(run)) if args.json else render(run))
    return 1 if run.problems else 0


def _preprocess_args(args: argparse.Namespace, inputs: list[str]):
    """The preprocess verb's flags as PreprocessArgs; a flag that needs another is refused."""
    from torchneox.base.errors import DataError
    from torchneox.data.chat import ChatOptions
    from torchneox.data.preprocess import PreprocessArgs

    tokenizer_type, vocab = args.tokenizer_type, args.vocab_file
    chat = args.chat or args.tokenizer_path is not None
    if args.tokenizer_path is not None:
        if vocab or tokenizer_type not in (None, "HFTokenizer"):
            raise DataError("--tokenizer-path names the tokenizer; leave out --vocab-file")
        tokenizer_type, vocab = "HFTokenizer", str(Path(args.tokenizer_path) / "tokenizer.json")
    if tokenizer_type is None:
        raise DataError("preprocess needs --tokenizer-type (or --tokenizer-path for chat data)")
    flags = ("only_last", "for_rm", "reward_key", "binary_reward", "no_mask")
    given = [f for f in flags if getattr(args, f)]
    if given and not chat:
        name = "--" + given[0].replace("_", "-")
        raise DataError(f"{name} is for chat data; add --chat (or --tokenizer-path)")
    if args.binary_reward and not args.reward_key:
        raise DataError("--binary-reward needs --reward-key")
    options = None
    if chat:
        options = ChatOptions(args.generation_role, not args.no_mask, args.only_last, args.for_rm)
    return PreprocessArgs(
        inputs=inputs,
        output_prefix=args.output_prefix,
        tokenizer_type=tokenizer_type,
        vocab_file=vocab,
        merge_file=args.merge_file,
        append_eod=args.append_eod,
        jsonl_keys=tuple(args.jsonl_keys),
        workers=args.workers,
        log_interval=args.log_interval,
        chat=options,
        reward_key=args.reward_key,
        binary_reward=args.binary_reward,
    )


def cmd_preprocess(args: argparse.Namespace) -> int:
    import tempfile

    from torchneox.config.paths import refuse_existing
    from torchneox.data import builtin
    from torchneox.data.preprocess import preprocess

    checked = _preprocess_args(args, args.input or [])
    outputs = [Path(f"{p}{ext}") for p in checked.output_prefixes() for ext in (".bin", ".idx")]
    refuse_existing(outputs, args.force, "preprocess", inputs=checked.inputs)
    if checked.tokenizer_type == "CharLevelTokenizer" and (args.vocab_file or args.merge_file):
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
        prefixes = preprocess(_preprocess_args(args, inputs))
    for prefix in prefixes:
        print(f"wrote {prefix}.bin and {prefix}.idx")
    return 0


def cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from torchneox.config.paths import refuse_existing
    from torchneox.data.tokenizers import train_bpe

    refuse_existing([Path(args.output)], args.force, "train-tokenizer", inputs=args.input)
    size = train_bpe(args.input, args.output, args.vocab_size, tuple(args.jsonl_keys))
    print(f"wrote {args.output} ({size} tokens)")
    return 0


def cmd_data_batch(args: argparse.Namespace) -> int:
    import numpy as np

    from torchneox.config.paths import atomic_output, dataset_files, refuse_existing
    from torchneox.data.datasets import step_batch
    from torchneox.data.tokenizers import build_tokenizer, decode_documents

    loaded = load_config(args.files, args.overrides)
    inputs = [*args.files, *dataset_files(loaded.config.data)]
    if args.out:
        refuse_existing([Path(args.out)], args.force, "data batch --out", inputs=inputs)
    start, batch = step_batch(loaded, args.iteration)
    if args.out:
        with (
            atomic_output(args.out, "data batch --out", inputs=inputs) as tmp,
            open(tmp, "wb") as f,
        ):
            if isinstance(batch, dict):
                np.savez(f, **batch)
            else:
                np.save(f, batch)
        shapes = (
            ", ".join(f"{k} {list(v.shape)}" for k, v in batch.items())
            if isinstance(batch, dict)
            else f"token ids {list(batch.shape)}"
        )
        print(f"wrote {args.out}: {shapes} of step {args.iteration}")
        return 0
    tokenizer = build_tokenizer(loaded.config.tokenizer)
    columns = batch if isinstance(batch, dict) else {"text": batch}
    for i in range(len(next(iter(columns.values())))):
        print(f"--- sample {start + i} (step {args.iteration}, position {i}) ---")
        for key, rows in columns.items():
            row = rows[i].tolist()
            if key == "reward":
                print(f"[reward] {sorted(set(row))}")
                continue
            if key.endswith("label"):  # what the loss learns: the labelled tokens
                key, row = f"{key}: learnt", [t for t in row if t >= 0]
            head = f"[{key}] " if len(columns) > 1 else ""
            print(head + "<|endoftext|>".join(decode_documents(tokenizer, row)))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from torchneox.checkpoint import weights
    from torchneox.train.evaluation import perplexity

    if not args.data_path and not args.tasks:
        raise ConfigError("give --tasks T1,T2 (lm-evaluation-harness) or --data-path PREFIX")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    overrides = [] if args.files else args.overrides
    loaded, model = weights.load_model(args.checkpoint, overrides, device=device)
    cfg = load_config(args.files, args.overrides).config if args.files else loaded.config
    if args.tasks:
        from torchneox.data.tokenizers import build_tokenizer
        from torchneox.train.lm_eval import evaluate_checkpoint

        limit = args.limit if args.limit is None or args.limit < 1 else int(args.limit)
        results = evaluate_checkpoint(
            model.eval(),
            build_tokenizer(cfg.tokenizer),
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
    eod = None
    if cfg.model.inter_document_attention_masking:
        from torchneox.data.tokenizers import build_tokenizer

        eod = build_tokenizer(cfg.tokenizer).eod_id
    result = perplexity(
        model, args.data_path, seq, args.iters, args.batch_size, cfg.training.seed, eod
    )
    print(json.dumps(result))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from torchneox.config.load import load_config
    from torchneox.estimate.search import estimate, render
    from torchneox.models.hf.folder import with_hf_folder

    loaded = with_hf_folder(load_config(args.files, args.overrides))
    est = estimate(loaded, args.gpus, args.gpu.lower(), args.nodes, args.mfu)
    print(json.dumps(est) if args.json else render(est))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    here = Path.cwd() / "benchmarks" / "run_all.py"
    source = Path(__file__).resolve().parents[3] / "benchmarks" / "run_all.py"
    script = here if here.is_file() else source
    if not script.is_file():
        raise ConfigError(
            "the benchmarks live in the source checkout (benchmarks/run_all.py); run this there"
        )
    return subprocess.call([sys.executable, str(script), *args.rest])


def cmd_kernels(args: argparse.Namespace) -> int:
    from torchneox.cli.kernels import cmd_kernels

    return cmd_kernels(args)


def cmd_checkpoint_verify(args: argparse.Namespace) -> int:
    from torchneox.checkpoint import files as checkpoint_format
    from torchneox.checkpoint.files import verify

    root = Path(args.dir)
    if not root.is_dir():
        raise ConfigError("no such checkpoint directory", source=str(root))
    steps = [p for _, p in checkpoint_format.step_dirs(root)] or [root]
    nothing = [f"{root} is {checkpoint_format.NOT_A_CHECKPOINT}"]
    if steps == [root] and not (root / "latest").is_file() and verify(root) == nothing:
        raise ConfigError(checkpoint_format.NOT_A_CHECKPOINT, source=str(root))
    bad = 0
    for step in steps:
        problems = checkpoint_format.verify(step, content=True)
        bad += bool(problems)
        print(f"{step}: " + ("complete" if not problems else "; ".join(problems)))
    latest = root / "latest"
    if latest.is_file():
        name = checkpoint_format.read_latest(root) or ""
        ok = bool(name) and (root / name).is_dir() and not checkpoint_format.verify(root / name)
        bad += not ok
        print(f"{latest}: {name}" + ("" if ok else " (missing or damaged)"))
    return 1 if bad else 0


def cmd_plot(args: argparse.Namespace) -> int:
    from torchneox.config.paths import refuse_existing
    from torchneox.reporting.plot import plot_runs, run_files

    read = [f for r in args.runs for f in run_files(Path(r))]  # a PNG beside them is fine
    refuse_existing([Path(args.out)], args.force, "plot", inputs=read)
    plot_runs([Path(r) for r in args.runs], Path(args.out), args.metric)
    print(f"wrote {args.out}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from torchneox.cli.demo import run_demo

    return run_demo(Path(args.dir), args.overrides)
