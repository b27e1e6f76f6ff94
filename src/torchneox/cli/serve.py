"""``torchneox serve MODEL``: the model (a checkpoint or a Hugging Face folder) and its PEFT
adapters loaded, the engine started, and the OpenAI-compatible server run until SIGTERM
(inference/serve/)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from torchneox.base.errors import ConfigError, DataError

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def cmd_serve(args: argparse.Namespace) -> int:
    served, what = served_model(args)
    from torchneox.inference.serve.app import create_app, run

    def ready(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {what} at http://{shown}:{port}/v1", flush=True)

    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"serve: warning: listening on {args.host} without --api-key: anyone who reaches "
            "the port can use the model",
            file=sys.stderr,
            flush=True,
        )
    served.engine.warm_up()
    served.engine.start()
    try:
        run(create_app(served), args.host, args.port, ready)
    finally:
        served.engine.stop(drain=True)
    print("serve: stopped", file=sys.stderr, flush=True)
    return 0


def served_model(args: argparse.Namespace) -> tuple[Any, str]:
    """The model and its adapters loaded, their engine (not started yet), and a line saying
    what is served."""
    import torch

    from torchneox.inference.serve.engine import Engine, refuse_unservable

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    adapters = _adapter_flags(args.adapter)
    folder = Path(args.model).resolve()
    if folder.name.startswith("global_step"):  # one step of a run: named as the run
        folder = folder.parent
    name = args.name or folder.name
    if name in adapters:
        raise ConfigError(f"--adapter {name}=...: {name} is MODEL's own name; name it otherwise")
    if not Path(args.model).exists():
        raise ConfigError(
            f"{args.model}: no such folder; give a checkpoint or a Hugging Face folder"
        )
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"serve needs FastAPI and uvicorn ({e.name} is not installed): "
            "pip install 'torchneox[serve]'"
        ) from None
    from torchneox.inference.serve.app import Served

    print(f"serve: loading {args.model}", file=sys.stderr, flush=True)
    loaded, base = _load(args.model, device)
    limit = base.args.max_positions
    max_seq_len = args.max_seq_len or limit
    if max_seq_len > limit:
        raise ConfigError(
            f"--max-seq-len {max_seq_len} is past the model's {limit} positions; give {limit} "
            "at most",
            source=args.model,
        )
    refuse_unservable(base.args, max_seq_len, args.model)
    dtype = getattr(torch, DTYPES[args.dtype])
    models = {name: base.to(dtype)}  # before the adapters: they share its converted weights
    for adapter_name, folder in adapters.items():
        from torchneox.interop.peft_adapter import adapted_model

        models[adapter_name] = adapted_model(loaded, base, folder)
    tokenizer, chat, no_chat, stops = _tokenizers(loaded, args.model)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eod_id
    engine = Engine(
        models, args.max_batch, max_seq_len, args.max_queue, pad, args.step_delay, args.decode_loop
    )
    served = Served(
        list(models), tokenizer, chat, no_chat, stops, max_seq_len,
        base.args.vocab_size, engine, args.api_key, args.max_body,
    )  # fmt: skip
    others = f" and adapters {', '.join(adapters)}" if adapters else ""
    what = (
        f"{name}{others} ({device}, {args.dtype}, {args.max_batch} slots of {max_seq_len} tokens)"
    )
    return served, what


def _adapter_flags(flags: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for flag in flags:
        name, eq, folder = flag.partition("=")
        if not eq or not name.strip() or not folder.strip():
            raise ConfigError(f"--adapter {flag}: give NAME=PEFT_FOLDER")
        if name in out:
            raise ConfigError(f"--adapter {name} is given twice; give each adapter its own name")
        if not Path(folder).is_dir():
            raise ConfigError(f"--adapter {name}: {folder} is not a folder (a PEFT adapter's)")
        out[name.strip()] = folder.strip()
    return out


def _load(model: str, device: str) -> tuple[Any, Any]:
    from torchneox.models.hf.folder import is_hf_folder

    if is_hf_folder(model):
        from torchneox.interop.huggingface import load_hf_model

        return load_hf_model(model, device=device)
    from torchneox.checkpoint import weights

    return weights.load_model(model, device=device)


def _tokenizers(loaded: Any, model: str) -> tuple[Any, Any, str, set[int]]:
    """The model's tokenizer, its chat template (None, and why, without one) and the stop
    tokens ``generate`` stops at."""
    from torchneox.data.chat import ChatTokenizer
    from torchneox.data.tokenizers import model_tokenizer
    from torchneox.inference.generate import generation_stop_ids

    tok = loaded.config.tokenizer
    tokenizer = model_tokenizer(tok, model)
    chat, no_chat = None, ""
    if tok.tokenizer_type == "HFTokenizer" and tok.vocab_file:
        try:
            chat = ChatTokenizer.from_file(tok.vocab_file)
        except DataError as e:
            no_chat = f"this model has no chat template ({e}); use /v1/completions"
    else:
        no_chat = (
            f"this model's {tok.tokenizer_type} tokenizer has no chat template; use /v1/completions"
        )
    stops = {tokenizer.eod_id} | generation_stop_ids(tok.vocab_file)
    return tokenizer, chat, no_chat, stops
