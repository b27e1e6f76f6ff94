"""An adversarial pass over the features of the last two weeks (since bed706d): LoRA, Muon,
Hugging Face folders (load, save_hf), 8-bit Adam, ZeRO-Offload keys, muP, layer weight
sharing, soft prompts, S3 keys, pos_emb rpe, data_impl cached, online RL and the resume rule.

Each case: an id, the feature, the kind of input, a setup in its own scratch folder, the
command (``python -m torchneox ...`` in that folder) and the outcome expected:

- ``error``: one line on stderr starting ``torchneox: error:`` (naming ``words`` when given),
  exit 2, and nothing in the scratch folder written or changed;
- ``fault``: the same with exit 1 (a run stopped by a fault);
- ``works``: exit 0 (and the inputs named in ``inputs`` unchanged);
- ``either``: a clear one-line refusal or exit 0 are both fine.

The outcome found is one of: handled, internal error, traceback, silent (accepted, no word),
data lost (an input changed or removed), unclear (the line does not name what it should, or
several lines, or another exit status), wrongly refused, wrote on refusal, timeout.

Small fixtures are built once (a chat-tokenizer model trained 1 step, its Hugging Face folder,
a LoRA run from it and its PEFT folder). Run from anywhere:

    PYTHONPATH=src OMP_NUM_THREADS=1 python tools/bad_input_pass.py [--only ID,ID] [--keep]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PY = sys.executable
TIMEOUT = 150

ROOT = Path(tempfile.mkdtemp(prefix="torchneox-bad-inputs-"))
FIX = ROOT / "fixtures"
ENV = dict(
    os.environ,
    PYTHONPATH=f"{REPO / 'src'}"
    + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
    OMP_NUM_THREADS="1",
    TORCHNEOX_CPU_PEAK_CACHE=str(ROOT / "cpu_peak.json"),
    TORCHNEOX_CPU_KERNEL_CACHE=str(ROOT / "cpu_kernels.json"),
    TORCHNEOX_INDEX_CACHE=str(ROOT / "index"),
)

# ---------------------------------------------------------------------------- fixtures

MODEL = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 32,
    "max_position_embeddings": 32,
    "pos_emb": "rotary",
    "norm": "rmsnorm",
    "activation": "swiglu",
    "no_weight_tying": True,
    "use_bias_in_norms": False,
    "use_bias_in_attn_linear": False,
    "use_bias_in_mlp": False,
}
TRAIN = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "train_iters": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    "warmup": 0.0,
    "precision": "fp32",
    "seed": 1234,
    "make_vocab_size_divisible_by": 64,
    "split": "100,0,0",
    "num_workers": 0,
    "eval_iters": 0,
    "log_interval": 1,
    "cpu_matmul": "default",
    "save": "run",
}


def tokenizer_keys() -> dict:
    return {"tokenizer_type": "HFTokenizer", "vocab_file": str(FIX / "tok" / "tokenizer.json")}


def data_keys() -> dict:
    return {"data_path": str(FIX / "data" / "plain_text_document")}


def base_config(**over) -> dict:
    cfg = MODEL | TRAIN | tokenizer_keys() | data_keys()
    for k, v in over.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def hf_config(**over) -> dict:
    """The training keys only: the Hugging Face folder gives the model (and tokenizer)."""
    cfg = TRAIN | data_keys() | {"load": "hf", "finetune": True}
    for k, v in over.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def rl_config(**over) -> dict:
    cfg = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 32,
        "max_position_embeddings": 32,
        "pos_emb": "rotary",
        "norm": "layernorm",
        "activation": "gelu",
        "optimizer": {"type": "AdamW", "params": {"lr": 3.0e-3}},
        "warmup": 0.0,
        "precision": "fp32",
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "train_iters": 1,
        "seed": 1234,
        "train_impl": "reinforce",
        "rollout_prompts": "prompts.jsonl",
        "rollout_generations": 4,
        "rollout_max_new_tokens": 4,
        "reward_function": "reward.py:spell_neox",
        "kl_div_beta": 0.05,
        "tokenizer_type": "HFTokenizer",
        "vocab_file": str(REPO / "configs" / "reinforce_tiny" / "tokenizer.json"),
        "make_vocab_size_divisible_by": 2,
        "save": "run",
        "eval_iters": 0,
        "log_interval": 1,
        "cpu_matmul": "default",
    }
    for k, v in over.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def cli(args: list[str], cwd: Path, timeout: int = TIMEOUT, env: dict | None = None):
    """``python -m torchneox ARGS`` in ``cwd``: (exit status or 'timeout', stdout, stderr)."""
    proc = subprocess.Popen(
        [PY, "-m", "torchneox", *args],
        cwd=cwd,
        env=env or ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return "timeout", out, err


def must(args: list[str], cwd: Path) -> None:
    rc, out, err = cli(args, cwd)
    if rc != 0:
        raise SystemExit(f"fixture failed: {' '.join(args)}\n{out[-2000:]}\n{err[-3000:]}")


def write_config(d: Path, cfg: dict, name: str = "c.yml") -> str:
    (d / name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return name


def build_fixtures() -> None:
    from tests.helpers import make_chat_tokenizer

    FIX.mkdir(parents=True)
    make_chat_tokenizer(FIX / "tok")
    rng = random.Random(0)
    words = [
        "thou",
        "art",
        "the",
        "king",
        "of",
        "all",
        "that",
        "is",
        "good",
        "and",
        "fair",
        "my",
        "lord",
        "speak",
        "now",
        "or",
        "hold",
    ]
    lines = [
        json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 30)))})
        for _ in range(200)
    ]
    (FIX / "plain.jsonl").write_text("\n".join(lines) + "\n")
    must(
        ["preprocess", "--input", "plain.jsonl", "--output-prefix", "data/plain"]
        + ["--tokenizer-type", "HFTokenizer", "--vocab-file", "tok/tokenizer.json", "--append-eod"],
        FIX,
    )
    write_config(FIX, base_config(save="base"), "base.yml")
    must(["train", "base.yml"], FIX)
    must(["convert", "to-hf", "base", "hf"], FIX)
    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    write_config(
        FIX, base_config(save="lora", load=str(FIX / "base"), finetune=True, lora=lora), "lora.yml"
    )
    must(["train", "lora.yml"], FIX)
    must(["convert", "to-hf", "--adapter", "lora", "peft"], FIX)
    (FIX / "rl").mkdir()
    for name in ("prompts.jsonl", "reward.py"):
        shutil.copy(REPO / "configs" / "reinforce_tiny" / name, FIX / "rl" / name)


def copy(d: Path, *names: str) -> None:
    for name in names:
        src = FIX / name
        if src.is_dir():
            shutil.copytree(src, d / Path(name).name, symlinks=True)
        else:
            shutil.copy(src, d / Path(name).name)


# ---------------------------------------------------------------------------- cases


@dataclass
class Case:
    id: str
    feature: str
    kind: str
    setup: Callable[[Path], list[str]]  # writes the scratch folder, returns the arguments
    expect: str  # error, fault, works, either, warn (trains, a warning names the key)
    words: str | None = None  # what the error line must name (case-insensitive)
    inputs: tuple[str, ...] = ()  # for works cases: paths that must not change
    timeout: int = TIMEOUT
    run: Callable[[Path, list[str]], tuple] | None = None  # a custom run (kills)
    env: dict = field(default_factory=dict)


CASES: list[Case] = []


def case(id, feature, kind, expect, words=None, inputs=(), timeout=TIMEOUT, run=None, env=None):
    def register(setup):
        CASES.append(Case(id, feature, kind, setup, expect, words, inputs, timeout, run, env or {}))
        return setup

    return register


def train_args(d: Path, cfg: dict, *extra: str) -> list[str]:
    return ["train", write_config(d, cfg), *extra]


LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def lora_cfg(d: Path, lora, **over) -> list[str]:
    copy(d, "base")
    return train_args(d, base_config(load="base", finetune=True, lora=lora, **over))


# --- LoRA


@case("lora-rank-float", "lora", "wrong type in a nested dict", "error", "rank")
def _(d):
    return lora_cfg(d, LORA | {"rank": 2.5})


@case("lora-alpha-nan", "lora", "NaN in a nested dict", "error", "alpha")
def _(d):
    return lora_cfg(d, LORA | {"alpha": float("nan")})


@case("lora-dropout-over-1", "lora", "out of range in a nested dict", "error", "dropout")
def _(d):
    return lora_cfg(d, LORA | {"dropout": 1.5})


@case("lora-targets-empty", "lora", "out of range (empty list)", "error", "target_modules")
def _(d):
    return lora_cfg(d, LORA | {"target_modules": []})


@case("lora-unknown-entry", "lora", "unknown entry in a nested dict", "error", "rnk")
def _(d):
    return lora_cfg(d, LORA | {"rnk": 8})


@case("lora-true", "lora", "wrong type (bool for the dict)", "error", "lora")
def _(d):
    return lora_cfg(d, True)


@case("lora-base-dtype-fp16", "lora", "out-of-range enum in a nested dict", "error", "base_dtype")
def _(d):
    return lora_cfg(d, LORA | {"base_dtype": "fp16"})


@case("lora-targets-same-layer-twice", "lora", "a user would expect to work", "either")
def _(d):
    return lora_cfg(d, LORA | {"target_modules": ["q_proj", "attention.wq"]})


@case("lora-resume-alpha-changed", "lora", "resume after changing a key", "error", "lora")
def _(d):
    copy(d, "base")
    cfg = base_config(load="base", finetune=True, lora=LORA)
    must(train_args(d, cfg), d)
    return train_args(d, cfg | {"lora": LORA | {"alpha": 32}, "train_iters": 2})


@case("lora-meta-not-json", "lora", "file not JSON (adapters-only meta.json)", "error", "meta.json")
def _(d):
    copy(d, "lora")
    (d / "lora" / "global_step1" / "meta.json").write_text("{not json")
    return ["convert", "to-hf", "lora", "out"]


@case(
    "toHF-adapter-no-lora", "to-hf --adapter", "a checkpoint without adapters", "error", "adapter"
)
def _(d):
    copy(d, "base")
    return ["convert", "to-hf", "--adapter", "base", "out"]


@case(
    "toHF-adapter-force-over-ckpt",
    "to-hf --adapter",
    "output over input (--force)",
    "error",
    "lora",
)
def _(d):
    copy(d, "lora", "base")
    # the adapters-only checkpoint names its base by absolute path: point it at the copy
    return ["convert", "to-hf", "--adapter", "--force", "lora", "lora/global_step1"]


@case(
    "toHF-adapter-out-is-file",
    "to-hf --adapter",
    "a file where a folder is expected",
    "error",
    "out",
)
def _(d):
    copy(d, "lora")
    (d / "out").write_text("a file\n")
    return ["convert", "to-hf", "--adapter", "lora", "out"]


@case(
    "fromHF-adapter-is-file",
    "from-hf --adapter",
    "a file where a folder is expected",
    "error",
    "adapter_config.json",
)
def _(d):
    copy(d, "hf", "peft")
    return ["convert", "from-hf", "hf", "out", "--adapter", "peft/adapter_config.json"]


@case(
    "fromHF-adapter-config-binary",
    "from-hf --adapter",
    "file not UTF-8 / binary",
    "error",
    "adapter_config.json",
)
def _(d):
    copy(d, "hf", "peft")
    (d / "peft" / "adapter_config.json").write_bytes(b"\xff\xfe\x00\x81binary\x00\x9c")
    return ["convert", "from-hf", "hf", "out", "--adapter", "peft"]


@case("fromHF-adapter-r-string", "from-hf --adapter", "wrong type in a JSON file", "error", "r")
def _(d):
    copy(d, "hf", "peft")
    p = d / "peft" / "adapter_config.json"
    p.write_text(json.dumps(json.loads(p.read_text()) | {"r": "four"}))
    return ["convert", "from-hf", "hf", "out", "--adapter", "peft"]


@case(
    "fromHF-adapter-unknown-target",
    "from-hf --adapter",
    "a target the model lacks",
    "error",
    "target_modules",
)
def _(d):
    copy(d, "hf", "peft")
    p = d / "peft" / "adapter_config.json"
    p.write_text(json.dumps(json.loads(p.read_text()) | {"target_modules": ["foo_proj"]}))
    return ["convert", "from-hf", "hf", "out", "--adapter", "peft"]


@case(
    "fromHF-adapter-wrong-shape",
    "from-hf --adapter",
    "an adapter of another base",
    "error",
    "lora_A",
)
def _(d):
    import torch
    from safetensors.torch import load_file, save_file

    copy(d, "hf", "peft")
    p = d / "peft" / "adapter_model.safetensors"
    tensors = load_file(p)
    name = next(k for k in tensors if "lora_A" in k)
    tensors[name] = torch.zeros(4, 64)
    save_file(tensors, p, metadata={"format": "pt"})
    return ["convert", "from-hf", "hf", "out", "--adapter", "peft"]


@case(
    "fromHF-adapter-no-weights",
    "from-hf --adapter",
    "path that does not exist (weights)",
    "error",
    "adapter_model",
)
def _(d):
    copy(d, "hf", "peft")
    (d / "peft" / "adapter_model.safetensors").unlink()
    return ["convert", "from-hf", "hf", "out", "--adapter", "peft"]


@case(
    "fromHF-adapter-out-is-peft",
    "from-hf --adapter",
    "output into input (--force)",
    "error",
    "peft",
)
def _(d):
    copy(d, "hf", "peft")
    return ["convert", "from-hf", "hf", "peft", "--adapter", "peft", "--force"]


@case(
    "fromHF-adapter-empty-config", "from-hf --adapter", "empty file", "error", "adapter_config.json"
)
def _(d):
    copy(d, "hf", "peft")
    (d / "peft" / "adapter_config.json").write_text("")
    return ["convert", "from-hf", "hf", "out", "--adapter", "peft"]


# --- Muon

MUON = {"type": "muon", "params": {"lr": 0.001, "ns_dtype": "fp32"}}


def muon(**params):
    return MUON | {"params": MUON["params"] | params}


@case("muon-ns-coefficients-2", "muon", "wrong length in a nested list", "error", "ns_coefficients")
def _(d):
    return train_args(d, base_config(optimizer=muon(ns_coefficients=[3.4, -4.7])))


@case("muon-ns-dtype-fp16", "muon", "out-of-range enum in a nested dict", "error", "ns_dtype")
def _(d):
    return train_args(d, base_config(optimizer=muon(ns_dtype="fp16")))


@case("muon-betas-one", "muon", "wrong length (betas of one)", "error", "betas")
def _(d):
    return train_args(d, base_config(optimizer=muon(betas=[0.9])))


@case("muon-lr-inf", "muon", "inf in a nested dict", "error", "lr")
def _(d):
    return train_args(d, base_config(optimizer=muon(lr=float("inf"))))


@case("muon-nesterov-string", "muon", "wrong type (text for a bool)", "error", "nesterov")
def _(d):
    return train_args(d, base_config(optimizer=muon(nesterov="yes")))


@case("muon-with-bnb", "muon", "conflicting keys (use_bnb_optimizer)", "warn", "use_bnb_optimizer")
def _(d):
    return train_args(d, base_config(optimizer=muon(), use_bnb_optimizer=True))


@case("muon-resume-from-adam", "muon", "resume after changing optimizer type", "error", "optimizer")
def _(d):
    cfg = base_config()
    must(train_args(d, cfg), d)
    return train_args(d, cfg | {"optimizer": muon(), "train_iters": 2})


@case("muon-lr-as-text", "muon", "a user would expect to work (lr: '1e-3')", "works")
def _(d):
    return train_args(d, base_config(optimizer=muon(lr="1e-3")))


# --- Hugging Face folders


def hf_case(d: Path, **over) -> list[str]:
    copy(d, "hf")
    return train_args(d, hf_config(**over))


@case("hf-config-cut", "load HF_DIR", "file cut (config.json)", "error", "config.json")
def _(d):
    args = hf_case(d)
    p = d / "hf" / "config.json"
    p.write_text(p.read_text()[:40])
    return args


@case("hf-config-binary", "load HF_DIR", "file not UTF-8 (config.json)", "error", "config.json")
def _(d):
    args = hf_case(d)
    (d / "hf" / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff")
    return args


@case("hf-weights-cut", "load HF_DIR", "file cut (model.safetensors)", "error", "model.safetensors")
def _(d):
    args = hf_case(d)
    p = d / "hf" / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return args


@case("hf-weights-nan", "load HF_DIR", "NaN in a weight file", "error", "q_proj")
def _(d):
    from safetensors.torch import load_file, save_file

    args = hf_case(d)
    p = d / "hf" / "model.safetensors"
    tensors = load_file(p)
    name = next(k for k in tensors if "q_proj" in k)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, p, metadata={"format": "pt"})
    return args


@case(
    "hf-layers-negative", "load HF_DIR", "out of range in config.json", "error", "num_hidden_layers"
)
def _(d):
    args = hf_case(d)
    p = d / "hf" / "config.json"
    p.write_text(json.dumps(json.loads(p.read_text()) | {"num_hidden_layers": -2}))
    return args


@case(
    "hf-load-is-weights-file", "load HF_DIR", "a file where a folder is expected", "error", "load"
)
def _(d):
    copy(d, "hf")
    return train_args(d, hf_config(load="hf/model.safetensors"))


@case(
    "hf-no-tokenizer",
    "load HF_DIR",
    "the folder without tokenizer files (pre-tokenized data)",
    "either",
    "tokenizer",
)
def _(d):
    args = hf_case(d)
    (d / "hf" / "tokenizer.json").unlink()
    (d / "hf" / "tokenizer_config.json").unlink()
    return args


@case(
    "hf-seq-over-positions",
    "load HF_DIR",
    "seq_length past the folder's positions",
    "error",
    "seq_length",
)
def _(d):
    return hf_case(d, seq_length=64)


@case("save-hf-is-file", "save_hf", "a file where a folder is expected", "error", "save_hf")
def _(d):
    (d / "out").write_text("keep me\n")
    return hf_case(d, save_hf="out")


@case(
    "save-hf-inside-load", "save_hf", "output into input (inside the HF folder)", "error", "save_hf"
)
def _(d):
    return hf_case(d, save_hf="hf/trained")


@case(
    "save-hf-soft-prompt",
    "save_hf",
    "a feature it cannot hold (soft prompt)",
    "error",
    "soft_prompt",
)
def _(d):
    copy(d, "base")
    sp = {"enabled": True, "n_tokens": 2}
    return train_args(
        d, base_config(load="base", finetune=True, soft_prompt_tuning=sp, save_hf="out")
    )


@case(
    "save-hf-then-rerun",
    "save_hf",
    "a user would expect to work (rerun after the end)",
    "works",
    inputs=("hf",),
)
def _(d):
    args = hf_case(d, save_hf="out")
    must(args, d)
    return args[:2] + ["--set", "train_iters=2"]


# --- 8-bit Adam


@case(
    "bnb-string", "use_bnb_optimizer", "wrong type (text for a bool)", "error", "use_bnb_optimizer"
)
def _(d):
    return train_args(d, base_config(use_bnb_optimizer="yes"))


@case(
    "bnb-with-sgd",
    "use_bnb_optimizer",
    "conflicting keys (an optimizer with no 8-bit form)",
    "warn",
    "use_bnb_optimizer",
)
def _(d):
    return train_args(
        d, base_config(use_bnb_optimizer=True, optimizer={"type": "sgd", "params": {"lr": 0.01}})
    )


@case(
    "bnb-resume-toggled", "use_bnb_optimizer", "resume after changing a key", "either", "optimizer"
)
def _(d):
    cfg = base_config()
    must(train_args(d, cfg), d)
    return train_args(d, cfg | {"use_bnb_optimizer": True, "train_iters": 2})


# --- ZeRO-Offload


@case(
    "offload-nvme",
    "ZeRO-Offload",
    "out-of-range enum in a nested dict",
    "error",
    "offload_optimizer",
)
def _(d):
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}
    return train_args(d, base_config(zero_optimization=zero))


@case(
    "offload-string", "ZeRO-Offload", "wrong type (text for the dict)", "error", "offload_optimizer"
)
def _(d):
    return train_args(d, base_config(zero_optimization={"stage": 2, "offload_optimizer": "cpu"}))


@case("offload-pin-text", "ZeRO-Offload", "wrong type (text for a bool)", "error", "pin_memory")
def _(d):
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "false"}}
    return train_args(d, base_config(zero_optimization=zero))


@case("offload-device-none", "ZeRO-Offload", "a user would expect to work (device: none)", "works")
def _(d):
    return train_args(
        d, base_config(zero_optimization={"stage": 1, "offload_optimizer": {"device": "none"}})
    )


# --- muP


def mup_cfg(**over):
    return base_config(use_mup=True, base_shapes_file="shapes.yml", **over)


@case("mup-shapes-folder", "muP", "a folder where a file is expected", "error", "base_shapes_file")
def _(d):
    (d / "shapes.yml").mkdir()
    return train_args(d, mup_cfg())


@case("mup-shapes-binary", "muP", "file not UTF-8 / binary", "error", "shapes.yml")
def _(d):
    (d / "shapes.yml").write_bytes(bytes(range(256)))
    return train_args(d, mup_cfg())


@case("mup-shapes-empty", "muP", "empty file", "error", "shapes.yml")
def _(d):
    (d / "shapes.yml").write_text("")
    return train_args(d, mup_cfg())


@case(
    "mup-save-shapes-over-config",
    "muP",
    "output over input (the config itself)",
    "error",
    "base_shapes_file",
)
def _(d):
    return train_args(d, base_config(use_mup=True, save_base_shapes=True, base_shapes_file="c.yml"))


@case("mup-save-shapes-exists", "muP", "output over an existing file", "error", "shapes.yml")
def _(d):
    (d / "shapes.yml").write_text("keep me\n")
    return train_args(d, mup_cfg(save_base_shapes=True))


@case("mup-width-scale-0", "muP", "out of range", "error", "mup_width_scale")
def _(d):
    return train_args(d, mup_cfg(save_base_shapes=True, mup_width_scale=0))


@case(
    "mup-coord-check-no-mup",
    "muP coord_check",
    "conflicting keys (coord_check without use_mup)",
    "warn",
    "coord_check",
)
def _(d):
    return train_args(d, base_config(coord_check=True))


# --- layer weight sharing


@case("share-unique-0", "num_unique_layers", "out of range", "error", "num_unique_layers")
def _(d):
    return train_args(d, base_config(num_unique_layers=0))


@case(
    "share-unique-over-layers",
    "num_unique_layers",
    "out of range (more than num_layers)",
    "error",
    "num_unique_layers",
)
def _(d):
    return train_args(d, base_config(num_unique_layers=4))


@case(
    "share-style-unknown", "num_unique_layers", "out-of-range enum", "error", "param_sharing_style"
)
def _(d):
    return train_args(d, base_config(num_unique_layers=1, param_sharing_style="interleaved"))


@case(
    "share-resume-unshared",
    "num_unique_layers",
    "resume after changing a key",
    "error",
    "num_unique_layers",
)
def _(d):
    cfg = base_config(num_unique_layers=1)
    must(train_args(d, cfg), d)
    return train_args(d, cfg | {"num_unique_layers": None, "train_iters": 2})


# --- soft prompts

SP = {"enabled": True, "n_tokens": 2, "init_range": 0.5}


def sp_cfg(d: Path, sp, **over) -> list[str]:
    copy(d, "base")
    return train_args(d, base_config(load="base", finetune=True, soft_prompt_tuning=sp, **over))


@case("sp-enabled-text", "soft_prompt_tuning", "wrong type in a nested dict", "error", "enabled")
def _(d):
    return sp_cfg(d, SP | {"enabled": "true"})


@case("sp-init-range-nan", "soft_prompt_tuning", "NaN in a nested dict", "error", "init_range")
def _(d):
    return sp_cfg(d, SP | {"init_range": float("nan")})


@case(
    "sp-init-string-unknown-chars",
    "soft_prompt_tuning",
    "an init_string of no tokens",
    "error",
    "init_string",
)
def _(d):
    return sp_cfg(d, SP | {"init_string": "\u20ac\u20ac\u20ac"})


@case(
    "sp-disabled-zero-tokens",
    "soft_prompt_tuning",
    "a user would expect to work (disabled)",
    "works",
)
def _(d):
    return sp_cfg(d, {"enabled": False, "n_tokens": 0})


@case(
    "sp-context-parallel-nproc2",
    "soft_prompt_tuning",
    "a layout it cannot take (--nproc 2, cp 2)",
    "error",
    "context",
)
def _(d):
    copy(d, "base")
    cfg = base_config(load="base", finetune=True, soft_prompt_tuning=SP, context_parallel_size=2)
    return train_args(d, cfg, "--nproc", "2")


@case(
    "sp-left-out-by-next-run",
    "soft_prompt_tuning",
    "a trained part dropped (a prompted checkpoint finetuned without a prompt)",
    "warn",
    "soft prompt",
)
def _(d):
    must(sp_cfg(d, SP), d)  # saves into run/
    return train_args(d, base_config(load="run", finetune=True, save="next"))


@case(
    "sp-other-size-next-run",
    "soft_prompt_tuning",
    "a trained part of another shape (n_tokens changed)",
    "error",
    "soft_prompt_tuning",
)
def _(d):
    must(sp_cfg(d, SP), d)
    sp = SP | {"n_tokens": 3}
    return train_args(d, base_config(load="run", finetune=True, save="next", soft_prompt_tuning=sp))


# --- S3


def no_boto3_env(d: Path) -> dict:
    shim = d / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "boto3.py").write_text("raise ImportError('No module named boto3 (shim)')\n")
    return {"PYTHONPATH": f"{shim}{os.pathsep}{ENV['PYTHONPATH']}"}


@case("s3-no-boto3", "s3_path", "a missing package", "error", "boto3", env={"shim": True})
def _(d):
    return train_args(d, base_config(s3_path="s3://bucket/prefix"))


@case("s3-no-scheme", "s3_path", "a malformed value", "error", "s3_path")
def _(d):
    return train_args(d, base_config(s3_path="bucket/prefix"))


@case("s3-chunk-negative", "s3_path", "out of range", "error", "s3_chunk_size")
def _(d):
    return train_args(d, base_config(s3_path="s3://bucket/prefix", s3_chunk_size=-5))


@case(
    "s3-no-endpoint",
    "s3_path",
    "no endpoint/credentials (upload fails, run completes)",
    "works",
    timeout=240,
)
def _(d):
    return train_args(d, base_config(s3_path="s3://torchneox-no-such-bucket/p"))


# --- pos_emb rpe


@case("rpe-to-hf", "pos_emb rpe", "a format it cannot go to", "error", "rpe")
def _(d):
    cfg = base_config(pos_emb="rpe", rpe_num_buckets=8, rpe_max_distance=16)
    must(train_args(d, cfg), d)
    return ["convert", "to-hf", "run", "out"]


@case(
    "rpe-distance-under-buckets",
    "pos_emb rpe",
    "out-of-range combination",
    "either",
    "rpe_max_distance",
)
def _(d):
    return train_args(d, base_config(pos_emb="rpe", rpe_num_buckets=32, rpe_max_distance=2))


@case("rpe-buckets-float", "pos_emb rpe", "wrong type", "error", "rpe_num_buckets")
def _(d):
    return train_args(d, base_config(pos_emb="rpe", rpe_num_buckets=8.5))


# --- data_impl cached


def tntidx(d: Path) -> str:
    from tests.data.test_old_index import write_tntidx

    from torchneox.data.indexed import IndexedDataset

    write_tntidx(IndexedDataset(str(FIX / "data" / "plain_text_document")), str(d / "old"))
    return str(d / "old")


@case("cached-on-mmap", "data_impl cached", "a user would expect to work (mmap data)", "works")
def _(d):
    return train_args(d, base_config(data_impl="cached"))


@case(
    "cached-lazy", "data_impl cached", "out-of-range enum (GPT-NeoX's lazy)", "error", "data_impl"
)
def _(d):
    return train_args(d, base_config(data_impl="lazy"))


@case("cached-bin-empty", "data_impl cached", "empty file (.bin)", "error", "old.bin")
def _(d):
    prefix = tntidx(d)
    Path(prefix + ".bin").write_bytes(b"")
    return train_args(d, base_config(data_impl="cached", data_path=prefix))


@case(
    "cached-idx-is-folder",
    "data_impl cached",
    "a folder where a file is expected (.idx)",
    "error",
    "old.idx",
)
def _(d):
    prefix = tntidx(d)
    Path(prefix + ".idx").unlink()
    Path(prefix + ".idx").mkdir()
    return train_args(d, base_config(data_impl="cached", data_path=prefix))


# --- online RL


def rl(d: Path, **over) -> list[str]:
    copy(d, "rl/prompts.jsonl", "rl/reward.py")
    return train_args(d, rl_config(**over))


@case("rl-prompts-binary", "rollout_prompts", "file not UTF-8", "error", "prompts.jsonl")
def _(d):
    args = rl(d)
    (d / "prompts.jsonl").write_bytes(b'{"prompt": "\xff\xfe"}\n')
    return args


@case(
    "rl-prompts-folder",
    "rollout_prompts",
    "a folder where a file is expected",
    "error",
    "prompts.jsonl",
)
def _(d):
    args = rl(d)
    (d / "prompts.jsonl").unlink()
    (d / "prompts.jsonl").mkdir()
    return args


@case("rl-prompt-number", "rollout_prompts", "wrong type in a record", "error", "prompts.jsonl")
def _(d):
    args = rl(d)
    (d / "prompts.jsonl").write_text('{"prompt": 123}\n' * 4)
    return args


@case(
    "rl-reward-no-colon",
    "reward_function",
    "a malformed value (no :function)",
    "error",
    "reward_function",
)
def _(d):
    return rl(d, reward_function="reward.py")


@case(
    "rl-reward-tuple",
    "reward_function",
    "a user would expect to work (returns a tuple)",
    "either",
    "reward",
)
def _(d):
    rl(d)
    with open(d / "reward.py", "a") as f:
        f.write(
            "\n\ndef as_tuple(prompts, completions):\n    return tuple(spell_neox(prompts, completions))\n"
        )
    return train_args(d, rl_config(reward_function="reward.py:as_tuple"))


@case(
    "rl-reward-model-file",
    "reward_model",
    "a file where a checkpoint folder is expected",
    "error",
    "reward_model",
)
def _(d):
    args = rl(d, reward_function=None, reward_model="reward.py")
    return args


@case(
    "rl-both-rewards", "reward_function + reward_model", "conflicting keys", "error", "reward_model"
)
def _(d):
    copy(d, "base")
    return rl(d, reward_model="base")


@case("rl-generations-0", "rollout_generations", "out of range", "error", "rollout_generations")
def _(d):
    return rl(d, rollout_generations=0)


@case(
    "rl-generations-indivisible",
    "rollout_generations",
    "a batch it cannot split",
    "error",
    "rollout_generations",
)
def _(d):
    return rl(d, rollout_generations=3)


@case(
    "rl-rloo-one",
    "reinforce_leave_one_out",
    "conflicting keys (RLOO of one completion)",
    "error",
    "rollout_generations",
)
def _(d):
    return rl(d, rollout_generations=1, reinforce_leave_one_out=True)


@case("rl-top-p-over-1", "rollout_top_p", "out of range", "error", "rollout_top_p")
def _(d):
    return rl(d, rollout_top_p=1.5)


@case("rl-kl-negative", "kl_div_beta", "out of range", "error", "kl_div_beta")
def _(d):
    return rl(d, kl_div_beta=-0.1)


@case(
    "rl-dataserver-port-range",
    "data servers",
    "out of range (port 70000)",
    "error",
    "online_dataserver_ports",
)
def _(d):
    return train_args(
        d,
        rl_config(
            rollout_prompts=None,
            reward_function=None,
            dataset_impl="online",
            online_dataserver_ports=70000,
        ),
    )


@case(
    "rl-dataserver-timeout-0",
    "data servers",
    "out of range (timeout 0)",
    "error",
    "online_dataserver_timeout",
)
def _(d):
    return train_args(
        d,
        rl_config(
            rollout_prompts=None,
            reward_function=None,
            dataset_impl="online",
            online_dataserver_timeout=0,
        ),
    )


# --- the resume rule


@case(
    "resume-load-gone",
    "resume rule",
    "a user would expect to work (load deleted, save holds the run)",
    "works",
)
def _(d):
    copy(d, "base")
    cfg = base_config(load="base", finetune=True)
    must(train_args(d, cfg), d)
    shutil.rmtree(d / "base")
    return train_args(d, cfg | {"train_iters": 2})


@case("resume-latest-garbage", "resume rule", "file not UTF-8 (latest)", "either", "latest")
def _(d):
    cfg = base_config()
    must(train_args(d, cfg), d)
    (d / "run" / "latest").unlink()
    (d / "run" / "latest").write_bytes(b"\x00\xff\x80 garbage")
    return train_args(d, cfg | {"train_iters": 2})


@case(
    "resume-load-step-missing",
    "resume rule",
    "path that does not exist (--load-step 5)",
    "error",
    "5",
)
def _(d):
    cfg = base_config()
    must(train_args(d, cfg), d)
    return train_args(d, cfg | {"train_iters": 2}, "--load-step", "5")


@case(
    "resume-save-is-file",
    "resume rule",
    "a file where a folder is expected (save)",
    "error",
    "save",
)
def _(d):
    (d / "run").write_text("keep me\n")
    return train_args(d, base_config())


@case(
    "resume-lora-after-base-finetune",
    "resume rule",
    "resume after adding lora to the command",
    "error",
    "lora",
)
def _(d):
    copy(d, "base")
    cfg = base_config(load="base", finetune=True)
    must(train_args(d, cfg), d)
    return train_args(d, cfg | {"lora": LORA, "train_iters": 2})


# --- kills


def sigint_then_rerun(d: Path, args: list[str], sig=signal.SIGINT, wait_for="metrics.jsonl"):
    """Start the run, send ``sig`` once its first step is logged, then rerun the same command:
    it must resume (exit 0, saying so)."""
    proc = subprocess.Popen(
        [PY, "-m", "torchneox", *args],
        cwd=d,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and proc.poll() is None:
        m = d / "run" / wait_for
        if m.is_file() and m.read_text().count("\n") >= 2:
            break
        time.sleep(0.2)
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        out1, err1 = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out1, err1 = proc.communicate()
        return "timeout", out1, "the killed run did not stop within 90 s\n" + err1
    first = f"(first run exit {proc.returncode}) "
    latest = d / "run" / "latest"
    if latest.is_file():  # go on for one step past the checkpoint the stop left
        step = int(latest.read_text().strip().removeprefix("global_step"))
        args = [*args, "--set", f"train_iters={step + 1}"]
    rc, out, err = cli(args, d)
    resumed = "resum" in (out + err).lower()
    if rc == 0 and not resumed:
        err = err + "\nrerun did not say it resumed"
        return "silent", out, first + err
    return rc, out, first + err


@case(
    "kill-int-mid-lora",
    "LoRA + resume",
    "Ctrl-C mid-run, then rerun",
    "works",
    run=sigint_then_rerun,
)
def _(d):
    copy(d, "base")
    return train_args(
        d,
        base_config(
            load="base", finetune=True, lora=LORA, train_iters=2000, checkpoint_factor=1000
        ),
    )


@case(
    "kill-9-mid-muon",
    "Muon + resume",
    "SIGKILL mid-run, then rerun",
    "works",
    run=lambda d, a: sigint_then_rerun(d, a, signal.SIGKILL),
)
def _(d):
    return train_args(d, base_config(optimizer=muon(), train_iters=2000, checkpoint_factor=2))


# ---------------------------------------------------------------------------- running

NOISE = re.compile(
    r"^(Failed to load|[WIE]\d{4} |\s*warnings\.warn|.*UserWarning|.*FutureWarning|.*DeprecationWarning)"
)


def snapshot(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.rglob("*")):
        rel = str(p.relative_to(d))
        if rel.startswith("shim"):
            continue
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha1(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[rel] = "dir"
    return out


def judge(c: Case, rc, err: str, before: dict, after: dict, out: str = "") -> tuple[str, str]:
    warned = [x for x in out.splitlines() if x.startswith("warning:")]
    if c.expect == "warn":  # a key the run does not read: trains, and says so at start-up
        named = [x for x in warned if not c.words or c.words in x]
        if rc == 0 and named:
            return "handled", named[0][:240]
        return ("silent" if rc == 0 else "unclear"), f"exit {rc}, no warning naming {c.words}"
    lines = [x for x in err.splitlines() if x.strip() and not NOISE.match(x)]
    errors = [x for x in lines if x.startswith("torchneox: error:")]
    first = (errors or lines or [""])[0][:240]
    changed = [k for k, v in before.items() if after.get(k) != v and v != "dir"]
    new = [k for k in after if k not in before]
    if rc == "timeout":
        return "timeout", first
    if "Traceback" in err:
        return "traceback", next((x for x in reversed(lines) if x and not x.startswith(" ")), first)
    if rc == 3 or "internal error" in err:
        return "internal error", first
    if rc == "silent":
        return "silent", first
    if c.expect == "works" or (c.expect == "either" and rc == 0):
        if rc == 0:
            lost = [k for k in changed if any(k == i or k.startswith(i + "/") for i in c.inputs)]
            return ("data lost", f"changed: {lost[:3]}") if lost else ("handled", first)
        if rc in (1, 2) and len(errors) == 1:
            return ("handled" if c.expect == "either" else "wrongly refused"), first
        return "unclear", f"exit {rc}: {first}"
    # a refusal is expected
    if rc == 0:
        return "silent", (lines[-1] if lines else "")[:240]
    if changed:
        return "data lost", f"exit {rc}; changed: {changed[:3]}; {first}"
    want = 1 if c.expect == "fault" else 2
    if len(errors) != 1:
        return "unclear", f"exit {rc}; {len(errors)} error lines: {first}"
    if rc != want and c.expect != "either":
        return "unclear", f"exit {rc} (expected {want}): {first}"
    if c.words and c.words.lower() not in errors[0].lower():
        return "unclear", f"does not name {c.words!r}: {first}"
    if new:
        return "wrote on refusal", f"new: {new[:3]}; {first}"
    return "handled", first + (f" [+{len(lines) - 1} other stderr lines]" if len(lines) > 1 else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case ids")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folders")
    opts = parser.parse_args()
    cases = CASES
    if opts.only:
        wanted = opts.only.split(",")
        cases = [c for c in CASES if c.id in wanted]
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    t0 = time.time()
    build_fixtures()
    print(f"fixtures built in {time.time() - t0:.0f} s under {ROOT}", flush=True)
    rows = []
    for c in cases:
        d = ROOT / "cases" / c.id
        d.mkdir(parents=True)
        t = time.time()
        try:
            args = c.setup(d)
        except BaseException as e:  # a setup that failed is reported, not fatal
            rows.append((c, "setup failed", f"{type(e).__name__}: {str(e)[:200]}", "", 0.0))
            print(f"{c.id}: setup failed: {e}", flush=True)
            continue
        env = dict(ENV, **no_boto3_env(d)) if c.env.get("shim") else ENV
        before = snapshot(d)
        if c.run:
            rc, out, err = c.run(d, args)
        else:
            rc, out, err = cli(args, d, c.timeout, env)
        after = snapshot(d)
        logs = ROOT / "logs"
        logs.mkdir(exist_ok=True)
        (logs / f"{c.id}.out").write_text(out)
        (logs / f"{c.id}.err").write_text(err)
        outcome, detail = judge(c, rc, err, before, after, out)
        rows.append((c, outcome, detail, f"{rc}", time.time() - t, args))
        print(f"{c.id:34} exit {rc!s:7} {outcome:16} {detail[:150]}", flush=True)
    print()
    print(f"{'id':34} {'feature':28} {'kind':52} {'expect':6} {'exit':7} outcome")
    for row in rows:
        c, outcome, detail, rc = row[:4]
        print(f"{c.id:34} {c.feature[:28]:28} {c.kind[:52]:52} {c.expect:6} {rc:7} {outcome}")
    totals: dict[str, int] = {}
    for row in rows:
        totals[row[1]] = totals.get(row[1], 0) + 1
    print(
        "\ntotals:", ", ".join(f"{k} {v}" for k, v in sorted(totals.items(), key=lambda x: -x[1]))
    )
    print(f"{len(rows)} cases in {time.time() - t0:.0f} s")
    print("\nnot handled:")
    for row in rows:
        if row[1] != "handled":
            c, outcome, detail, rc = row[:4]
            cmd = " ".join(row[5]) if len(row) > 5 else ""
            print(f"- {c.id} [{outcome}] `{cmd}` exit {rc}: {detail}")
    if not opts.keep:
        shutil.rmtree(ROOT, ignore_errors=True)
    else:
        print(f"\nscratch kept under {ROOT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
