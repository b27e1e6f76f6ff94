"""What several test modules share: running training as a user does, reading a run's metrics
and weights, and the parity assertions every parallel layout is held to."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from tests.conftest import shared_dir
from tests.forked import run_cli
from torchneox.checkpoint import files as checkpoint_format
from torchneox.checkpoint.weights import load_model_weights
from torchneox.config.load import load_mapping
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model

# the global batch the parity tests train: 8 sequences in 2 accumulation steps
DP_KEYS = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "eval_iters": 1,
    "hidden_dropout": 0.0,
    "num_workers": 0,
}


def metric_rows(folder: Path) -> list[dict]:
    """Every row of a run's metrics.jsonl."""
    return [json.loads(x) for x in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def train(config: str, *overrides: str, nproc: int = 1) -> subprocess.CompletedProcess:
    """``torchneox train CONFIG [--nproc N] --set OVERRIDE ...``, which must succeed, in a
    process forked from the tests' server (tests/forked.py: the same command, without a fresh
    import of torch; with several processes, the ranks forked from that one). tests/cli and
    tests/reliability start ``python -m torchneox train --nproc`` itself, as a user does."""
    args = ["train", config]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    for o in overrides:
        args += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = run_cli(args, env, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run


def losses(folder, key: str = "lm_loss") -> dict[int, float]:
    """``key`` (the loss by default) of every logged step of the run in ``folder``."""
    return {r["iteration"]: r[key] for r in metric_rows(folder) if key in r}


def weights(folder) -> dict[str, torch.Tensor]:
    step = checkpoint_format.resolve(folder)
    model = build_model(model_args(checkpoint_format.checkpoint_config(step)))
    load_model_weights(step, model)
    return model.state_dict()


def reference(folder):
    """What a parallel run is compared with: the losses, gradient norms and final weights of
    a one-process run."""
    return losses(folder), losses(folder, "grad_norm"), weights(folder)


# one-process runs already trained in this test process: (what they trained, keys) -> folder
_TRAINED: dict[tuple[str, tuple[str, ...]], Path] = {}
_ONE_PROCESS_ROOT = Path(tempfile.mkdtemp(prefix="torchneox-one-process-"))
atexit.register(shutil.rmtree, _ONE_PROCESS_ROOT, True)


def trained_once(config: str, *overrides: str) -> Path:
    """The folder of a one-process run of ``config`` from scratch with ``overrides``, trained
    once per test process however many tests compare with it: keyed by the config's values
    (its own save and load paths aside) and the overrides."""
    values = {
        k: v for k, v in json.loads(Path(config).read_text()).items() if k not in ("save", "load")
    }
    key = (json.dumps(values, sort_keys=True), tuple(overrides))
    if key not in _TRAINED or not (_TRAINED[key] / "metrics.jsonl").is_file():
        folder = _ONE_PROCESS_ROOT / f"run{len(_TRAINED)}"
        train(config, f"save={folder}", "load=null", *overrides)
        _TRAINED[key] = folder
    return _TRAINED[key]


def one_process(config: str, tmp_path_factory, *overrides: str):
    """The reference of a one-process run of ``config``: the parity tests' global batch of 8 as
    micro-batches of 4 (``overrides`` on top)."""
    return reference(trained_once(config, "train_micro_batch_size_per_gpu=4", *overrides))


def assert_same_training(out, baseline) -> None:
    """The run in ``out`` has the losses, gradient norms (the gradients of every step, taken
    whole) and final weights of the one-process ``baseline``."""
    one_losses, one_norms, one_weights = baseline
    got, norms = losses(out), losses(out, "grad_norm")
    assert sorted(got) == sorted(one_losses) == sorted(norms)
    for k in got:
        assert got[k] == pytest.approx(one_losses[k], rel=1e-5, abs=1e-6), k
        assert norms[k] == pytest.approx(one_norms[k], rel=1e-4, abs=1e-6), k
    # Adam's first update is lr * g / (|g| + eps) per element: where a gradient is float noise
    # (~1e-9) the layouts' different summation orders can move that element by up to ~lr * 1e-2
    for name, tensor in weights(out).items():
        torch.testing.assert_close(
            tensor, one_weights[name], rtol=1e-4, atol=5e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def assert_resumes_like_whole(
    cfg,
    tmp_path,
    whole: list[str],
    first: list[str],
    first_nproc: int,
    then: list[str],
    then_nproc: int = 1,
):
    """Stop at step 3 under layout ``first``, resume under ``then``: steps 4-6 equal a run
    never stopped (``whole``, one process). Returns the run's folder."""
    unstopped = trained_once(cfg, *whole)
    moved = tmp_path / "moved"
    train(cfg, f"save={moved}", f"load={moved}", *first, "exit_interval=3", nproc=first_nproc)
    train(cfg, f"save={moved}", f"load={moved}", *then, nproc=then_nproc)
    done, after = losses(unstopped), losses(moved)
    for k in (4, 5, 6):
        assert after[k] == pytest.approx(done[k], rel=1e-5), k
    return moved


def assert_resumes_bitwise(
    cfg,
    whole: Path,
    step: int,
    overrides: list[str],
    nproc: int,
    until: int | None = None,
    keys: tuple[str, ...] = ("lm_loss", "grad_norm"),
) -> None:
    """Resumed from the step-``step`` checkpoint of the run in ``whole`` (same layout,
    ``overrides``), the later steps' losses and gradient norms (``keys``) and the final weights
    are that run's, to the bit. With ``until``, the resume stops there and is held to those
    steps and to the weights of ``whole``'s step-``until`` checkpoint."""
    moved = whole.parent / f"{whole.name}-resumed{step}"
    stop = [] if until is None else [f"exit_interval={until}"]
    train(
        cfg, f"save={moved}", f"load={whole / f'global_step{step}'}", *overrides, *stop,
        nproc=nproc,
    )  # fmt: skip
    for key in keys:
        done, after = losses(whole, key), losses(moved, key)
        later = [k for k in sorted(done) if k > step and (until is None or k <= until)]
        assert sorted(after) == later and later, key
        assert all(after[k] == done[k] for k in after), (key, after, done)
    resumed = weights(moved)
    for name, tensor in weights(whole if until is None else whole / f"global_step{until}").items():
        assert torch.equal(tensor, resumed[name]), name


def poison(trainer, at_step: int, value: float) -> None:
    forward = trainer.model.forward

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        return out * value if trainer.iteration + 1 == at_step and trainer.model.training else out

    trainer.model.forward = poisoned


def seed_config(tmp_path: Path) -> Path:
    """The config quoted in the seed report, cut out of the report as it is."""
    report = next((shared_dir() / "seed").glob("*.txt")).read_text()
    start = report.index("# GPT-2 pretraining setup")
    end = report.index("[StellaAthena]")
    path = tmp_path / "seed.yml"
    path.write_text(report[start:end])
    return path


# tiny models of each family the tests build directly
BASE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "max_position_embeddings": 64,
    "tokenizer_type": "CharLevelTokenizer",
    "make_vocab_size_divisible_by": 64,
}

VARIANTS = {
    "neox-rotary": {"pos_emb": "rotary", "rotary_pct": 0.25, "gpt_j_residual": True},
    "gpt-j-tied": {"pos_emb": "rotary", "gpt_j_residual": True, "gpt_j_tied": True},
    "learned": {"pos_emb": "learned", "opt_pos_emb_offset": 2},
    "sinusoidal": {"pos_emb": "sinusoidal"},
    "alibi": {"pos_emb": "alibi"},
    "rpe": {"pos_emb": "rpe", "rpe_num_buckets": 8, "rpe_max_distance": 16},
    "none": {"pos_emb": "none"},
    # multi-head latent attention (DeepSeek-V3's MLA), queries through their own latent
    "mla": {
        "pos_emb": "rotary",
        "norm": "rmsnorm",
        "activation": "swiglu",
        "mla_kv_lora_rank": 24,
        "mla_q_lora_rank": 32,
        "mla_qk_nope_head_dim": 12,
        "mla_qk_rope_head_dim": 8,
        "mla_v_head_dim": 16,
    },
    "rmsnorm-swiglu-gqa": {
        "pos_emb": "rotary",
        "norm": "rmsnorm",
        "activation": "swiglu",
        "num_kv_heads": 2,
        "use_bias_in_norms": False,
        "use_bias_in_attn_linear": False,
        "use_bias_in_mlp": False,
    },
    "mqa-geglu": {"pos_emb": "rotary", "activation": "geglu", "num_kv_heads": 1},
    "scalenorm-reglu": {"norm": "scalenorm", "activation": "reglu", "pos_emb": "rotary"},
    "nonparam-bilinear": {"norm": "non_parametric_layernorm", "activation": "bilinear"},
    "glu-mish": {"activation": "glu", "intermediate_size": 96, "mlp_multiple_of": 8},
    "relu-untied": {"activation": "relu", "no_weight_tying": True},
    "window": {"pos_emb": "rotary", "sliding_window_width": 8},
    "inits": {"init_method": "xavier_normal", "output_layer_init_method": "scaled_orthogonal"},
    "dropout": {"hidden_dropout": 0.1, "attention_dropout": 0.1, "pos_emb": "rotary"},
    # GPT-NeoX's one query/key norm, rmsnorm (per head) and layernorm (over all heads)
    "qk-norm-neox-rmsnorm": {"pos_emb": "rotary", "use_qk_layernorm": True, "norm": "rmsnorm"},
    "qk-norm-neox-layernorm": {"pos_emb": "rotary", "use_qk_layernorm": True},
    # Qwen3's: a query and a key norm per head, heads wider than hidden / heads
    "qwen3-like": {
        "pos_emb": "rotary",
        "norm": "rmsnorm",
        "activation": "swiglu",
        "num_kv_heads": 2,
        "head_dim": 32,
        "use_qk_layernorm": True,
        "qk_norm_scope": "head",
    },
    # OLMo 2's: over all heads, and each sublayer's output normalised
    "olmo2-like": {
        "pos_emb": "rotary",
        "norm": "rmsnorm",
        "activation": "swiglu",
        "num_kv_heads": 2,
        "use_qk_layernorm": True,
        "qk_norm_scope": "width",
        "norm_position": "output",
    },
    # RWKV-6 (GPT-NeoX's configs/rwkv), alone and every other layer with attention
    "rwkv": {"attention_config": [[["rwkv"], "all"]]},
    "rwkv-global": {"attention_config": [[["rwkv"], 1], [["global"], 1]], "pos_emb": "rotary"},
    # its own widths: dim_att 128 (4 heads of 32), a channel mix of 100 rounded down to 96
    "rwkv-widths": {
        "attention_config": [[["rwkv"], "all"]],
        "dim_att": 128,
        "intermediate_size": 100,
    },
    # Mamba (GPT-NeoX's configs/mamba: rmsnorm, no positions) and a mix with attention
    "mamba": {"attention_config": [[["mamba"], 2]], "norm": "rmsnorm", "pos_emb": "none"},
    "mamba-global": {
        "attention_config": [[["mamba", "global"], 1]],
        "pos_emb": "rotary",
        "mamba_use_bias_in_linears": True,
        "mamba_use_bias_in_conv": False,
        "expansion_factor": 1.5,
    },
    "reward-model": {
        "pos_emb": "rotary",
        "train_impl": "rm",
        "dataset_impl": "pairwise",
        "pack_impl": "unpacked",
    },
    # gMLP and aMLP blocks (GPT-NeoX's gmlp_small.yml, scaled down), alone and mixed
    "gmlp": {"attention_config": [[["gmlp"], "all"]], "pos_emb": "none"},
    "amlp": {"attention_config": [[["amlp"], "all"]], "pos_emb": "none", "gmlp_attn_dim": 16},
    "gmlp-global-mix": {"attention_config": [[["gmlp", "global"], 1]], "pos_emb": "rotary"},
}


def build(variant: str, seed: int = 0):
    loaded = load_mapping(BASE | VARIANTS[variant], variant)
    return loaded, build_model(model_args(loaded), seed=seed)


# a chat tokenizer for post-training tests: characters, chat specials, a chat template
TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


CHAT_SPECIALS = ["<|endoftext|>", "<|padding|>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_chat_tokenizer(
    folder: Path,
    template: str = TEMPLATE,
    specials: list[str] = CHAT_SPECIALS,
    config: dict | None = None,
) -> Path:
    """A character-level tokenizer.json with chat specials (ids 0.. in order) and a
    tokenizer_config.json (``config`` replaces its special tokens)."""
    from tokenizers import Tokenizer, decoders, models

    # 77 tokens: a vocabulary padded to 128 both by 64 on one tensor rank and by 2 x 64 on two
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.!?'-:\n"))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    tokens = config or {"eos_token": "<|endoftext|>", "pad_token": "<|padding|>"}
    tokens = {"tokenizer_class": "PreTrainedTokenizerFast"} | tokens
    (folder / "tokenizer_config.json").write_text(json.dumps(tokens | {"chat_template": template}))
    return folder


CHAT_WORDS = [
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


def write_chat_data(folder: Path, records: int = 48, seed: int = 0) -> dict[str, Path]:
    """Chat jsonl made of random words: SFT chats, preference pairs and KTO records (half of
    them desirable)."""
    import random

    rng = random.Random(seed)

    def line(n: int) -> str:
        return " ".join(rng.choice(CHAT_WORDS) for _ in range(n)).capitalize() + "."

    pairs, sft, kto = [], [], []
    for _ in range(records):
        # short enough that every chat fits a sample of 64 tokens
        user = {"role": "user", "content": line(rng.randint(1, 3))}
        good = {"role": "assistant", "content": line(rng.randint(2, 4))}
        bad = {"role": "assistant", "content": line(rng.randint(1, 3))}
        pairs.append({"chosen": [user, good], "rejected": [user, bad]})
        sft.append({"messages": [user, good]})
        kto += [{"messages": [user, good], "reward": 1}, {"messages": [user, bad], "reward": -1}]
    out = {}
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("pairs", pairs), ("sft", sft), ("kto", kto)):
        out[name] = folder / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def post_training_data(folder: Path, only: tuple[str, ...] = ()) -> dict[str, dict]:
    """Chat data preprocessed as a user does (`torchneox preprocess --chat`) and the data keys
    of each objective's config: sft, dpo, kto and rm (``only``: those alone preprocessed)."""
    from torchneox.cli import main

    tok = make_chat_tokenizer(folder / "tokenizer")
    jsonl = write_chat_data(folder)
    d = folder / "data"

    def pre(source: str, prefix: str, keys: list[str], *flags: str) -> None:
        if only and prefix not in only:
            return
        args = ["preprocess", "--input", str(jsonl[source]), "--output-prefix", str(d / prefix)]
        args += ["--tokenizer-path", str(tok), "--jsonl-keys", *keys, *flags]
        assert main(args) == 0

    pre("sft", "sft", ["messages"])
    pre("pairs", "dpo", ["chosen", "rejected"], "--only-last")
    pre("pairs", "rm", ["chosen", "rejected"], "--for-rm")
    pre("kto", "kto", ["messages"], "--reward-key", "reward")
    common = {
        "tokenizer_type": "HFTokenizer",
        "vocab_file": str(tok / "tokenizer.json"),
        "pack_impl": "unpacked",
    }

    def paths(prefix: str, *kinds: str, sides: tuple[str, ...] = ("",)) -> dict:
        keys = {}
        for side in sides:
            stem = {"": "messages", "pos_": "chosen", "neg_": "rejected"}[side]
            for split in ("train", "valid"):
                for kind in kinds:
                    key = f"{side}{split}_{kind + '_' if kind else ''}data_paths"
                    name = f"{prefix}_{stem}_{kind + '_' if kind else ''}document"
                    keys[key] = [str(d / name)]
        return keys

    pairs = {"dataset_impl": "pairwise"}
    return {
        "sft": common | paths("sft", "", "label"),
        "dpo": common | pairs | {"train_impl": "dpo"}
        | paths("dpo", "", "label", sides=("pos_", "neg_")),
        "rm": common | pairs | {"train_impl": "rm"}
        | paths("rm", "", "label", sides=("pos_", "neg_")),
        "kto": common | {"train_impl": "kto"} | paths("kto", "", "label", "reward"),
    }  # fmt: skip


def assert_same_safetensors(original: Path, back: Path) -> None:
    """A Hugging Face folder's ``model.safetensors`` written back identically: the same
    tensors under the same names, equal to the bit."""
    from safetensors.torch import load_file

    theirs, ours = load_file(original / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(theirs) == set(ours)
    for key, tensor in theirs.items():
        assert torch.equal(tensor, ours[key]), key
