"""Peak memory of `torchneox convert from-hf` and `to-hf` on a Llama-shaped model many times
larger than one safetensors shard: conversions stream tensor by tensor, so the peak should stay
near one copy of the model plus one shard, not two copies.

    python benchmarks/convert_memory.py [--layers 16] [--hidden 1024] [--shard-mb 64]

The Hugging Face folder is written here directly (random bf16 tensors in shards with an
index, as the hub holds them), without transformers. Each conversion runs in its own process;
its peak resident memory (VmHWM, Linux) less the peak of a process that only imports torchneox
is compared with the model's size and the shard size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file


def llama_folder(folder: Path, layers: int, hidden: int, shard_bytes: int) -> int:
    """A Llama config.json and bf16 weights in shards of about ``shard_bytes``; their bytes."""
    heads, kv, width, vocab = hidden // 64, max(hidden // 256, 1), int(hidden * 8 / 3), 32000
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": width,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    d = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    shapes["model.norm.weight"] = (hidden,)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * d, hidden),
            p + "self_attn.k_proj.weight": (kv * d, hidden),
            p + "self_attn.v_proj.weight": (kv * d, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * d),
            p + "mlp.gate_proj.weight": (width, hidden),
            p + "mlp.up_proj.weight": (width, hidden),
            p + "mlp.down_proj.weight": (hidden, width),
        }
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, shape in shapes.items():
        t = (torch.randn(shape) * 0.02).to(torch.bfloat16)
        if size + t.nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
        total += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def peak_mb(args: list[str]) -> float:
    """Peak resident memory of one child process, MiB."""
    # VmHWM: this process image's peak (ru_maxrss would carry the parent's over the fork)
    code = (
        "import sys, torch; from torchneox.cli import main; code = main(sys.argv[1:]); "
        "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM')][0]; "
        "print(hwm.split()[1], file=sys.stderr); sys.exit(code)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        raise SystemExit(run.stderr[-2000:])
    return int(run.stderr.strip().splitlines()[-1]) / 1024  # kB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--shard-mb", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf_bytes = llama_folder(root / "hf", args.layers, args.hidden, args.shard_mb * 2**20)
        baseline = peak_mb(["config", "keys"])
        read = peak_mb(["convert", "from-hf", str(root / "hf"), str(root / "ckpt")])
        shard = f"{args.shard_mb}MiB"
        write = peak_mb(
            ["convert", "to-hf", str(root / "ckpt"), str(root / "out"), "--max-shard-size", shard]
        )
        write_bf16 = peak_mb(
            ["convert", "to-hf", str(root / "ckpt"), str(root / "out16"), "--dtype", "bf16"]
            + ["--max-shard-size", shard]
        )
    model_mb = hf_bytes / 2**20  # bf16 on the hub; the checkpoint keeps the dtype it read
    print(
        json.dumps(
            {
                "benchmark": "convert_memory",
                "model_mb": round(model_mb),
                "shard_mb": args.shard_mb,
                "baseline_mb": round(baseline),
                "from_hf_extra_mb": round(read - baseline),
                "to_hf_extra_mb": round(write - baseline),
                "to_hf_bf16_extra_mb": round(write_bf16 - baseline),
                "from_hf_extra_in_models": round((read - baseline) / model_mb, 2),
                "to_hf_extra_in_models": round((write - baseline) / model_mb, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
