"""Shared fixtures: the reference files in ../shared (when present), a tiny training corpus and config."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

import pytest

from torchneox.data.preprocess import PreprocessArgs, preprocess

REPO = Path(__file__).resolve().parents[1]
# the CPU's matmul peak (for MFU) and the CPU kernel verdicts (cpu_matmul, cpu_attention) are
# measured once per test session, not into the user's cache: timings taken while the tests
# load every core would be kept there for every later run
_SESSION_CACHE = Path(tempfile.mkdtemp(prefix="torchneox-cpu-"))
os.environ.setdefault("TORCHNEOX_CPU_PEAK_CACHE", str(_SESSION_CACHE / "peak.json"))
os.environ.setdefault("TORCHNEOX_CPU_KERNEL_CACHE", str(_SESSION_CACHE / "kernels.json"))


def shared_dir() -> Path | None:
    """../shared beside the checkout (or $TORCHNEOX_SHARED); None on a machine without it."""
    candidate = Path(os.environ.get("TORCHNEOX_SHARED", REPO.parent / "shared"))
    return candidate if candidate.is_dir() else None


@pytest.fixture
def shared() -> Path:
    path = shared_dir()
    if path is None:
        pytest.skip("the reference files in ../shared are not on this machine")
    return path


@pytest.fixture
def write(tmp_path: Path):
    """write('name.yml', text) -> path of a file in a fresh temporary folder."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return _write


WORDS = [
    "the",
    "model",
    "reads",
    "tokens",
    "and",
    "learns",
    "to",
    "predict",
    "the",
    "next",
    "one",
    "from",
    "all",
    "that",
    "came",
    "before",
    "it",
]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(600)]
    (folder / "corpus.txt").write_text("\n".join(lines) + "\n")
    (prefix,) = preprocess(
        PreprocessArgs(
            [str(folder / "corpus.txt")],
            str(folder / "corpus"),
            "CharLevelTokenizer",
            append_eod=True,
        )
    )
    return prefix


@pytest.fixture(autouse=True)
def index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNEOX_INDEX_CACHE", str(tmp_path / "index"))


def config_maker(tmp_path, tiny_data):
    """make(**keys) -> path of a tiny training config (keys override the defaults)."""

    def make(name: str = "c.yml", **keys) -> str:
        cfg = {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "seq_length": 32,
            "pos_emb": "rotary",
            "rotary_pct": 0.5,
            "gpt_j_residual": True,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "train_iters": 6,
            "optimizer": {
                "type": "Adam",
                "params": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1.0e-8},
            },
            "min_lr": 0.0003,
            "lr_decay_style": "cosine",
            "warmup": 0.2,
            "weight_decay": 0.1,
            "gradient_clipping": 1.0,
            "precision": "fp32",
            "seed": 1234,
            "tokenizer_type": "CharLevelTokenizer",
            "make_vocab_size_divisible_by": 64,
            "data_path": str(tiny_data),
            "split": "90,8,2",
            "num_workers": 0,
            "eval_interval": 1000,
            "eval_iters": 2,
            "log_interval": 1,
            "save": str(tmp_path / "run"),
            "load": str(tmp_path / "run"),
        } | keys
        path = tmp_path / name
        path.write_text(json.dumps(cfg))
        return str(path)

    return make


@pytest.fixture
def make_config(tmp_path, tiny_data):
    """make_config(**keys) -> path of a tiny training config (keys override the defaults)."""
    return config_maker(tmp_path, tiny_data)


@pytest.fixture(scope="module")
def make_module_config(tmp_path_factory, tiny_data):
    """make_config for module-scoped fixtures: one-process baselines that several parallel
    layouts are compared with are trained once per module."""
    return config_maker(tmp_path_factory.mktemp("configs"), tiny_data)


@pytest.fixture(scope="module")
def moe_config(make_module_config):
    # the seed report's MoE config (8 experts, tensor parallel 2), scaled down to CPU size
    return make_module_config(
        "moe.yml",
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=32,
        no_weight_tying=True,
        moe_num_experts=8,
        moe_top_k=2,
        moe_router_type="topk",
        train_batch_size=8,
        train_micro_batch_size_per_gpu=4,
        gradient_accumulation_steps=2,
        train_iters=6,
        eval_iters=1,
        hidden_dropout=0.0,
        num_workers=0,
    )


_DURATIONS = REPO / "tests" / "durations.json"


def pytest_collection_modifyitems(config, items):
    """The slowest test files first (longest-processing-time order), so that `make test`'s
    workers, each taking whole files (`--dist loadfile --no-loadscope-reorder`), end together
    instead of one waiting on a long multi-process file left for last. The seconds per file
    are a past run's (tests/durations.json, refreshed by tools/test_durations.py); a file not
    in it counts as a middling one. Within a file the order is kept."""
    try:
        seconds = json.loads(_DURATIONS.read_text())
    except (OSError, ValueError):
        return
    middling = sorted(seconds.values())[len(seconds) // 2] if seconds else 0.0
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], i)
    items.sort(
        key=lambda item: (
            -seconds.get(item.nodeid.split("::")[0], middling),
            first_seen[item.nodeid.split("::")[0]],
        )
    )
