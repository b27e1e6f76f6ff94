"""Serving speed: `torchneox serve` on a Pythia-shaped model (random weights), driven by 1, 4
and 16 concurrent streaming clients. Reports time to first token, inter-token latency, tokens/s,
and the memory-bandwidth utilisation of decoding: the bytes a decode step reads (every weight
but the input embedding's, and the keys and values the step attends over) per inter-token
interval, against the read bandwidth measured on this machine: a tensor of the step's size
summed (from a cache that holds it, if the processor's last-level cache does) and a 1 GiB one
(from memory).

    python benchmarks/serve.py [--shape 70m] [--clients 1 4 16] [--prompt 128] [--tokens 64]
        [--requests 2] [--device cpu|cuda] [--dtype fp32|bf16]

The tokenizer is a word list ("w0 w1 ..."): every token decodes to text, so each arrives as a
chunk of its own. Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

SHAPES = {
    "14m": {"num_layers": 6, "hidden_size": 128, "num_attention_heads": 4},
    "70m": {"num_layers": 6, "hidden_size": 512, "num_attention_heads": 8},
    "160m": {"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12},
    "1b": {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 8},
}
VOCAB = 50304
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def word_tokenizer(folder: Path) -> Path:
    """A tokenizer.json of VOCAB words, w0 the end-of-text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0} | {f"w{i}": i for i in range(1, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def checkpoint(folder: Path, shape: str, seq: int) -> tuple[Path, dict]:
    from torchneox.checkpoint import files as checkpoint_format
    from torchneox.config.derive import derive
    from torchneox.config.load import load_mapping
    from torchneox.config.report import render_yaml
    from torchneox.models.args import model_args
    from torchneox.models.transformer import build_model

    keys = SHAPES[shape] | {
        "seq_length": seq,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "padded_vocab_size": VOCAB,
        "tokenizer_type": "HFTokenizer",
        "vocab_file": str(word_tokenizer(folder / "tok")),
    }
    loaded = load_mapping(keys, shape)
    model = build_model(model_args(loaded), seed=0)
    read = sum(p.numel() for n, p in model.named_parameters() if n != "embed.weight")
    a = model.args
    sizes = {"weights_read": read, "kv_per_token": 2 * a.num_layers * a.num_kv_heads * a.head_dim}
    state = {"model": model.state_dict()}
    checkpoint_format.save_checkpoint(
        folder / "ckpt", 0, state, render_yaml(loaded, derive(loaded))
    )
    return folder / "ckpt", sizes


def read_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second summing an fp32 tensor of ``nbytes`` (the best of 5, warm)."""
    x = torch.ones(max(1, nbytes // 4), device=device)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def start_server(ckpt: Path, args) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "torchneox", "serve", str(ckpt), "--port", "0"]
    command += ["--max-batch", str(max(args.clients)), "--device", args.device]
    command += ["--dtype", args.dtype, "--max-seq-len", str(args.prompt + args.tokens + 1)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("serving"):
        raise SystemExit(f"the server did not start: {line}")
    return proc, line.rsplit(" ", 1)[-1].strip()


def one_request(http, url: str, prompt: str, tokens: int) -> dict:
    """A streamed completion: when it was sent, when each chunk of text came, its usage."""
    body = {"model": "ckpt", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    body |= {"stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    sent, arrivals, usage = time.perf_counter(), [], None
    with http.stream("POST", f"{url}/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals, "usage": usage}


def round_of(url: str, clients: int, args) -> dict:
    """``clients`` threads each sending ``args.requests`` requests one after another."""
    results: list[dict] = []
    prompt = " ".join(f"w{1 + i % (VOCAB - 1)}" for i in range(args.prompt))

    def client() -> None:
        with httpx.Client() as http:  # one connection per client, as a real client keeps
            for _ in range(args.requests):
                results.append(one_request(http, url, prompt, args.tokens))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = [r["arrivals"][0] - r["sent"] for r in results]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    return {"ttft": ttft, "itl": itl, "tokens": tokens, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", choices=SHAPES, default="70m")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--requests", type=int, default=2, help="per client, one after another")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPE_BYTES, default=None)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    bandwidth = read_bandwidth(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, sizes = checkpoint(Path(tmp), args.shape, args.prompt + args.tokens + 1)
        proc, url = start_server(ckpt, args)
        try:
            with httpx.Client() as http:
                one_request(http, url, "w1 w2", 4)  # warm-up
            for clients in args.clients:
                print(
                    json.dumps(row(round_of(url, clients, args), clients, sizes, bandwidth, args))
                )
        finally:
            proc.terminate()
            proc.wait()


def row(r: dict, clients: int, sizes: dict, bandwidth: float, args) -> dict:
    """The round's numbers: latencies in ms, and the bandwidth a decode step used."""
    itl = statistics.median(r["itl"])
    width = DTYPE_BYTES[args.dtype]
    context = args.prompt + args.tokens / 2  # the keys a step attends over, on average
    step_bytes = width * (sizes["weights_read"] + clients * context * sizes["kv_per_token"])
    at_size = read_bandwidth(args.device, int(step_bytes))
    return {
        "benchmark": "serve",
        "shape": args.shape,
        "device": args.device,
        "dtype": args.dtype,
        "threads": int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())),
        "clients": clients,
        "prompt_tokens": args.prompt,
        "new_tokens": args.tokens,
        "ttft_ms_median": round(1000 * statistics.median(r["ttft"]), 1),
        "ttft_ms_max": round(1000 * max(r["ttft"]), 1),
        "itl_ms_median": round(1000 * itl, 2),
        "itl_ms_p90": round(1000 * statistics.quantiles(r["itl"], n=10)[-1], 2),
        "tokens_per_sec": round(r["tokens"] / r["wall"], 1),
        "decode_step_mb": round(step_bytes / 1e6, 1),
        "bandwidth_used_gb_s": round(step_bytes / itl / 1e9, 2),
        "read_gb_s_at_step_size": round(at_size / 1e9, 2),
        "read_gb_s_1gib": round(bandwidth / 1e9, 2),
        "bandwidth_utilisation": round(step_bytes / itl / at_size, 3),
    }


if __name__ == "__main__":
    main()
