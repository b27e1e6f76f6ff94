"""``torchneox demo`` (and ``make demo``): prepare the built-in corpus, train the tiny model on
the CPU, evaluate it, and generate text from the result."""

from __future__ import annotations

import sys
from pathlib import Path

from torchneox.data import builtin
from torchneox.data.preprocess import PreprocessArgs, preprocess

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yml"
PROMPTS = ["Return the ", "This module provides ", "The default value is "]


def run_demo(folder: Path, overrides: list[str]) -> int:
    from torchneox.base.errors import ConfigError
    from torchneox.checkpoint.weights import load_model
    from torchneox.config.load import load_config
    from torchneox.data.tokenizers import build_tokenizer
    from torchneox.inference.generate import Sampling, TextGenerator
    from torchneox.train.trainer import Trainer

    data_prefix = folder / "data" / "pydocs"
    document_prefix = Path(f"{data_prefix}_text_document")
    run_dir = folder / "run"
    settings = [f"data_path={document_prefix}", f"save={run_dir}", f"load={run_dir}", *overrides]
    config = load_config([CONFIG], settings)  # a wrong --set is named before anything is written
    for part in (run_dir, folder / "data", folder, *folder.parents):
        if part.exists() and not part.is_dir():
            raise ConfigError("is a file; the demo needs a folder here (--dir)", source=str(part))
    if not Path(f"{document_prefix}.idx").is_file():
        print(
            "== 1. the built-in corpus (frozen Python 3.11 docstrings), byte-level tokens",
            flush=True,
        )
        source = folder / "data" / "pydocs.jsonl"
        count = builtin.write_jsonl("pydocs", source)
        print(f"{count} documents", flush=True)
        preprocess(
            PreprocessArgs([str(source)], str(data_prefix), "CharLevelTokenizer", append_eod=True)
        )
        source.unlink()
    else:
        print(f"== 1. the built-in corpus is ready in {document_prefix}", flush=True)
    print(f"\n== 2. training {CONFIG.name} on the CPU", flush=True)
    Trainer(config, device="cpu").run()
    print("\n== 3. generating from the trained model", flush=True)
    loaded, model = load_model(run_dir)
    tokenizer = build_tokenizer(loaded.config.tokenizer)
    room = model.args.max_positions - max(len(tokenizer.encode(p)) for p in PROMPTS)
    sampling = Sampling(
        temperature=0.8, top_k=40, maximum_tokens=room, stop_ids={tokenizer.eod_id}, seed=0
    )
    generator = TextGenerator(model, tokenizer, sampling)
    for prompt, text in zip(PROMPTS, generator.complete(PROMPTS), strict=True):
        print(f"\n>>> {prompt}{text}", flush=True)
    print(
        f"\nCheckpoints and metrics are in {run_dir}. Try:\n"
        f"  .venv/bin/torchneox generate --checkpoint {run_dir} --prompt 'Return a list'\n"
        f"  .venv/bin/torchneox plot {run_dir} --out loss.png",
        file=sys.stderr,
    )
    return 0
