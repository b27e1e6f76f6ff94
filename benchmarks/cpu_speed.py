"""CPU training speed side by side, in one run on one machine:

- the machine's GEMM peaks: fp32 on PyTorch's default kernel (MKL) and on oneDNN, and bf16;
- nanoGPT's character-level tiny Shakespeare recipe (4 layers, 4 heads, width 128, context 64,
  batch 12, fp32, no compile) as a plain-PyTorch script written the way nanoGPT writes it (its
  model and its loop, no framework), against torchneox on configs/shakespeare_char.yml, eager
  and with ``compile`` (the whole model as one graph), compiled with nanoGPT's own
  architecture in GPT-NeoX's keys (learned positions, no biases), and compiled in bf16
  autocast, which is also set against the plain loop under bf16 autocast; and the plain loop's
  kernel floor (benchmarks/_kernel_floor.py: its step as bare kernels, nothing around them),
  whose speed over the plain loop's is the most any step on these kernels could gain; the sides
  alternate in rounds so that all see the same machine;
- transformers' GPTNeoXForCausalLM against torchneox at the Pythia 14M, 70M and 160M shapes
  (fp32), torchneox eager and compiled, and torchneox bf16 against fp32 at 70M
  (benchmarks/train_vs_hf.py's sides);

every row with its MFU against the measured peak of its precision (FLOPs per token by
torchneox's own count: every weight a token meets, the head, and attention scores in full).

    python benchmarks/cpu_speed.py [--only peaks nanogpt pythia] [--text tinyshakespeare.txt]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _kernel_floor import KernelFloor  # benchmarks/_kernel_floor.py
from torch import nn
from torch.nn import functional as F

from torchneox.config.load import load_config, load_mapping
from torchneox.config.sizes import count
from torchneox.reporting import hardware
from torchneox.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
RECIPE = {"layers": 4, "heads": 4, "width": 128, "block": 64, "batch": 12}
NANOGPT_ARCH = [
    "pos_emb=learned",
    "use_bias_in_norms=false",
    "use_bias_in_attn_linear=false",
    "use_bias_in_mlp=false",
]


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------------- peaks


def peaks() -> dict[str, float]:
    """TFLOP/s of a 1024^3 GEMM: fp32 by MKL and by oneDNN, bf16 by PyTorch (oneDNN)."""
    out = {
        "fp32_default": hardware.measure_cpu_tflops(torch.float32, 1024, 0.3, trials=5),
        "bfloat16": hardware.measure_cpu_tflops(torch.bfloat16, 1024, 0.3, trials=5),
    }
    if torch.backends.mkldnn.is_available():
        out["fp32_onednn"] = hardware.measure_cpu_tflops(
            torch.float32, 1024, 0.3, trials=5, kernel="onednn"
        )
    out["fp32"] = max(out["fp32_default"], out.get("fp32_onednn", 0.0))
    emit({"benchmark": "cpu_gemm_peak", "size": 1024} | {k: round(v, 4) for k, v in out.items()})
    return out


def mfu(tokens_per_sec: float, flops_per_token: float, peak_tflops: float) -> float:
    return round(tokens_per_sec * flops_per_token / (peak_tflops * 1e12), 4)


# ---------------------------------------------------- nanoGPT's model and loop, plain PyTorch


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, layers: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width, bias=False)
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.c_proj = nn.Linear(width, width, bias=False)
        self.ln_2 = nn.LayerNorm(width, bias=False)
        self.c_fc = nn.Linear(width, 4 * width, bias=False)
        self.mlp_proj = nn.Linear(4 * width, width, bias=False)
        for proj in (self.c_proj, self.mlp_proj):  # GPT-2's scaled residual projections
            nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPT(nn.Module):
    """GPT-2 as nanoGPT builds it: learned positions, pre-norm blocks, a head tied to wte."""

    def __init__(self, vocab: int, block: int, layers: int, heads: int, width: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(_Block(width, heads, layers) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, bias=False)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding) and module not in (
                *(b.c_proj for b in self.blocks),
                *(b.mlp_proj for b in self.blocks),
            ):
                nn.init.normal_(module.weight, std=0.02)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


class NanoGPTLoop:
    """nanoGPT's train.py on its CPU recipe: random windows of the memmapped text, AdamW with
    weight decay on matrices only (foreach on the CPU: nanoGPT fuses only on CUDA), warmup and
    cosine decay, clipping at 1.0, the loss read back every step (log_interval 1). ``bf16``:
    the forward and loss under bf16 autocast, as nanoGPT's train.py does on a GPU (on the CPU
    it runs fp32)."""

    def __init__(self, data: np.ndarray, vocab: int, bf16: bool = False):
        torch.manual_seed(1337)
        r = RECIPE
        self.data, self.rng = data, np.random.default_rng(1337)
        self.model = NanoGPT(vocab, r["block"], r["layers"], r["heads"], r["width"])
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))
        self.iteration, self.bf16 = 0, bf16

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        r = RECIPE
        ix = self.rng.integers(0, len(self.data) - r["block"] - 1, size=r["batch"])
        x = torch.stack(
            [torch.from_numpy(self.data[i : i + r["block"]].astype(np.int64)) for i in ix]
        )
        y = torch.stack(
            [torch.from_numpy(self.data[i + 1 : i + 1 + r["block"]].astype(np.int64)) for i in ix]
        )
        return x, y

    def lr(self, it: int) -> float:
        warmup, decay, top, floor = 100, 2000, 1e-3, 1e-4
        if it < warmup:
            return top * (it + 1) / (warmup + 1)
        ratio = min(1.0, (it - warmup) / (decay - warmup))
        return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - floor)

    def step(self) -> float:
        for group in self.opt.param_groups:
            group["lr"] = self.lr(self.iteration)
        x, y = self.batch()
        with torch.autocast("cpu", torch.bfloat16, enabled=self.bf16):
            _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.iteration += 1
        return loss.item()


def recipe_flops(vocab: int, learned: bool) -> int:
    """Training FLOPs per token of the recipe's shape at ``vocab`` (torchneox's count)."""
    r = RECIPE
    keys = {
        "num_layers": r["layers"],
        "hidden_size": r["width"],
        "num_attention_heads": r["heads"],
        "seq_length": r["block"],
        "max_position_embeddings": r["block"],
        "pos_emb": "learned" if learned else "rotary",
    }
    return count(load_mapping(keys, "recipe").config, vocab).flops_per_token


def nanogpt_recipe(args, peak: dict) -> None:
    """Both sides, alternating rounds of ``args.steps`` steps; median tokens/s of the rounds."""
    from shakespeare import prepare  # benchmarks/shakespeare.py

    text = Path(args.text)
    if not text.is_file():
        emit({"benchmark": "cpu_speed_nanogpt_recipe", "skipped": f"no text at {text} (--text)"})
        return
    chars = sorted(set(text.read_text()))
    codes = {c: i for i, c in enumerate(chars)}
    data = np.array([codes[c] for c in text.read_text()], dtype=np.uint16)
    no_bf16 = _no_bf16_units(peak)
    if no_bf16:
        emit({"benchmark": "cpu_speed_nanogpt_recipe", "precision": "bfloat16"} | no_bf16)
    plain = NanoGPTLoop(data[: int(0.9 * len(data))], len(chars))
    plain_bf16 = NanoGPTLoop(data[: int(0.9 * len(data))], len(chars), bf16=True)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = prepare(text, Path(tmp))
        settings = [f"data_path={prefix}", "save=null", "load=null", "eval_interval=100000"]
        recipe = [ROOT / "configs" / "shakespeare_char.yml"]
        trainers = {
            "torchneox": Trainer(load_config(recipe, settings)),
            "torchneox_compiled": Trainer(load_config(recipe, [*settings, "compile=true"])),
            # nanoGPT's own architecture in GPT-NeoX's keys: learned positions, no biases
            "torchneox_compiled_nanogpt_arch": Trainer(
                load_config(recipe, [*settings, "compile=true", *NANOGPT_ARCH])
            ),
        }
        # the plain loop's kernels with nothing around them: no step on them can be faster
        floor = KernelFloor(len(chars), **RECIPE)
        sides = {"nanogpt_plain_loop": plain.step, "kernel_floor": floor.step}
        if not no_bf16:
            # bf16 autocast (fp32 master weights), which nanoGPT's train.py does not do on the
            # CPU; attention in fp32 where cpu_attention's timing finds it faster
            trainers["torchneox_compiled_bf16"] = Trainer(
                load_config(recipe, [*settings, "compile=true", "precision=bfloat16"])
            )
            sides["nanogpt_plain_loop_bf16"] = plain_bf16.step
        sides |= {name: trainer.train_step for name, trainer in trainers.items()}
        speeds: dict[str, list[float]] = {name: [] for name in sides}
        tokens = RECIPE["batch"] * RECIPE["block"] * args.steps
        for round_ in range(args.rounds + 1):
            for name, step in sides.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                if round_:  # the first round warms all up (and compiles)
                    speeds[name].append(tokens / (time.perf_counter() - start))
        flops = dict.fromkeys(sides, recipe_flops(len(chars), learned=True))
        for name, trainer in trainers.items():
            trainer.train_loader.close()
            flops[name] = trainer.derived["flops_per_token"]
    median = {name: statistics.median(v) for name, v in speeds.items()}
    for name, value in median.items():
        emit(
            {
                "benchmark": "cpu_speed_nanogpt_recipe",
                "side": name,
                "tokens_per_sec": round(value, 1),
                "ms_per_iteration": round(1000 * RECIPE["batch"] * RECIPE["block"] / value, 2),
                "rounds": [round(v) for v in speeds[name]],
                "mfu": mfu(value, flops[name], peak["bfloat16" if "bf16" in name else "fp32"]),
            }
        )
    plain_speed = median.pop("nanogpt_plain_loop")
    ratios = {f"ratio_{name}_over_plain": round(v / plain_speed, 3) for name, v in median.items()}
    if not no_bf16:
        ratios["ratio_torchneox_compiled_bf16_over_plain_bf16"] = round(
            median["torchneox_compiled_bf16"] / median["nanogpt_plain_loop_bf16"], 3
        )
    emit({"benchmark": "cpu_speed_nanogpt_recipe"} | ratios)


def _no_bf16_units(peak: dict) -> dict:
    """``{"skipped": why}`` where this CPU's bf16 GEMM is slower than its fp32 one (no bf16
    units: the bf16 rows would take hours and mean nothing), else empty."""
    if peak["bfloat16"] >= peak["fp32"]:
        return {}
    why = (
        f"this CPU's bf16 GEMM runs at {peak['bfloat16']:.4f} TFLOP/s, below fp32's "
        f"{peak['fp32']:.4f}: no bf16 units (AVX512-BF16 or AMX) to use"
    )
    return {"skipped": why}


# ------------------------------------------------------------------ Pythia shapes, transformers

PYTHIA_STEPS = {"14m": 20, "70m": 10, "160m": 4}


def pythia_shapes(args, peak: dict) -> None:
    import train_vs_hf as hf  # benchmarks/train_vs_hf.py

    runs = [(shape, "fp32") for shape in args.shapes] + [("70m", "bfloat16")]
    for shape, precision in runs:
        if precision == "bfloat16" and _no_bf16_units(peak):
            row = {"benchmark": "cpu_speed_pythia", "shape": shape, "precision": precision}
            emit(row | _no_bf16_units(peak))
            continue
        steps = max(1, round(PYTHIA_STEPS[shape] * args.pythia_scale))
        row = {"benchmark": "cpu_speed_pythia", "shape": shape, "precision": precision}
        row |= {"batch": 8, "seq": 128, "steps": steps}
        theirs = None
        if precision == "fp32":
            side = argparse.Namespace(batch=8, seq=128, steps=steps, warmup=2, precision=precision)
            theirs = hf.hf_side(shape, argparse.Namespace(**vars(side), device="cpu"))
            row |= {"transformers_tokens_per_sec": round(theirs, 1)}
        for compiled in (False, True):
            name = "torchneox_compiled" if compiled else "torchneox"
            ours, flops = _torchneox_pythia(hf, shape, precision, steps, compiled)
            row |= {f"{name}_tokens_per_sec": round(ours, 1)}
            row |= {f"{name}_mfu": mfu(ours, flops, peak[precision])}
            if theirs is not None:
                row |= {f"ratio_{name}_over_transformers": round(ours / theirs, 3)}
        if theirs is not None:
            row["transformers_mfu"] = mfu(theirs, flops, peak[precision])
        emit(row)


def _torchneox_pythia(hf, shape: str, precision: str, steps: int, compiled: bool):
    """torchneox's tokens/s at a Pythia shape (warmed up: 2 steps, 3 when compiled) and its
    FLOPs per token."""
    side = argparse.Namespace(
        batch=8, seq=128, steps=steps, warmup=3 if compiled else 2, precision=precision,
        device="cpu", compile=compiled,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        data = hf.synthetic_data(Path(tmp), (steps + 5) * 8 * 129 * 2)
        keys = hf.torchneox_keys(shape, side, data)
        flops = count(load_mapping(keys, "pythia").config, hf.VOCAB).flops_per_token
        return hf.torchneox_side(shape, side, data, tmp), flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="+", choices=("peaks", "nanogpt", "pythia"))
    parser.add_argument(
        "--text", default=str(ROOT.parent / "shared/data/corpora/tinyshakespeare.txt")
    )
    parser.add_argument("--steps", type=int, default=40, help="steps per round, nanoGPT recipe")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=["14m", "70m", "160m"])
    parser.add_argument("--pythia-scale", type=float, default=1.0, help="scales the steps")
    args = parser.parse_args()
    parts = args.only or ["peaks", "nanogpt", "pythia"]
    peak = peaks()
    if "nanogpt" in parts:
        nanogpt_recipe(args, peak)
    if "pythia" in parts:
        pythia_shapes(args, peak)


if __name__ == "__main__":
    main()
