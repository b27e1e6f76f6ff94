"""GPT-NeoX's gmlp_small.yml explains and, scaled down, trains from the CLI; gMLP mixed with
attention trains; what gMLP layers cannot do is one line."""

from __future__ import annotations

import pytest

from tests.helpers import losses
from torchneox.base.errors import ConfigError
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.layout import Layout, check_layout
from torchneox.config.load import load_config

# GPT-NeoX's configs/gmlp_small.yml at ea7aefd, as it is (its comments cut)
GMLP_SMALL = """\
{
   "pipe_parallel_size": 1,
   "model_parallel_size": 1,
   "attention_config": [[["gmlp"], "all"]],
   "num_layers": 12,
   "hidden_size": 768,
   "gmlp_attn_dim": 64,
   "num_attention_heads": 12,
   "seq_length": 2048,
   "max_position_embeddings": 2048,
   "norm": "layernorm",
   "pos_emb": "none",
   "no_weight_tying": true,
   "optimizer": {
     "type": "Adam",
     "params": {
       "lr": 0.0006,
       "betas": [0.9, 0.999],
       "eps": 1.0e_8,
     }
   },
   "train_micro_batch_size_per_gpu": 4,
   "data_impl": "mmap",
   "split": "949,50,1",
   "checkpoint_activations": true,
   "checkpoint_num_layers": 1,
   "partition_activations": false,
   "synchronize_each_layer": true,
   "gradient_clipping": 1.0,
   "weight_decay": 0.1,
   "hidden_dropout": 0.0,
   "attention_dropout": 0.0,
   "fp16": {
     "enabled": true,
     "loss_scale": 0,
     "loss_scale_window": 1000,
     "hysteresis": 2,
     "min_loss_scale": 1
   },
   "train_iters": 320000,
   "lr_decay_iters": 320000,
   "distributed_backend": "nccl",
   "lr_decay_style": "cosine",
   "warmup": 0.01,
   "checkpoint_factor": 10000,
   "eval_interval": 1000,
   "eval_iters": 10,
   "log_interval": 100,
   "steps_per_print": 10,
   "keep_last_n_checkpoints": 4,
   "wall_clock_breakdown": true,
}
"""
EPS = "optimizer.params.eps=1.0e-8"  # GPT-NeoX's 1.0e_8 is text to YAML (and to its Adam)


@pytest.fixture
def gmlp_small(tmp_path):
    path = tmp_path / "gmlp_small.yml"
    path.write_text(GMLP_SMALL)
    return path


def sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def test_gmlp_small_s_eps_is_one_line_naming_it(gmlp_small):
    with pytest.raises(ConfigError) as err:
        load_config([str(gmlp_small)])
    assert err.value.key == "optimizer"
    assert "params.eps must be a number, got the text '1.0e_8'" in str(err.value)
    assert "\n" not in str(err.value)


def test_gmlp_small_explains_with_exact_counts(gmlp_small, capsys):
    assert main(["config", "explain", str(gmlp_small), *sets(EPS)]) == 0
    out = capsys.readouterr().out
    assert "12 of 12 layers are gMLP blocks" in out
    h, ff, s, vocab = 768, 3072, 2048, 50304
    # per block: norm, h -> 2ff, the gate's norm, the s x s projection and its bias, ff -> h
    block = 2 * h + h * 2 * ff + 2 * ff + s * s + s + ff * h
    total = 12 * block + 2 * h + 2 * vocab * h  # final norm, embedding and untied head
    assert f"{total:,}" in out
    forward = 12 * (2 * (h * 2 * ff + ff * h) + 2 * s * ff) + 2 * vocab * h
    assert f"{3 * forward:,}" in out


def test_gmlp_small_trains_scaled_down_with_falling_loss(gmlp_small, tiny_data, tmp_path):
    out = tmp_path / "run"
    scaled = ("num_layers=2", "hidden_size=64", "num_attention_heads=4", "seq_length=64")
    data = (f"data_path={tiny_data}", "tokenizer_type=CharLevelTokenizer", "split=90,8,2")
    short = ("train_iters=20", "lr_decay_iters=20", "warmup=0", "fp16.enabled=false")
    args = (*scaled, "max_position_embeddings=64", *data, *short, EPS)
    args += (f"save={out}", "log_interval=1", "eval_iters=1", "make_vocab_size_divisible_by=64")
    assert main(["train", str(gmlp_small), *sets(*args)]) == 0
    got = losses(out)
    assert sorted(got) == list(range(1, 21))
    assert sum(got[k] for k in (18, 19, 20)) < sum(got[k] for k in (1, 2, 3)) - 1.0


def test_gmlp_amlp_and_attention_layers_train_together(make_config):
    config = make_config(
        num_layers=3,
        attention_config=[[["gmlp", "global", "amlp"], 1]],
        gmlp_attn_dim=16,
        train_iters=12,
        warmup=0.0,
    )
    assert main(["train", config]) == 0
    got = losses(load_config([config]).config.checkpoint.save)
    assert got[12] < got[1] - 0.5


def _refusal(config: str, *overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        loaded = load_config([config], list(overrides))
        check_layout(loaded, Layout.from_derived(loaded.config, derive(loaded, world_size=2)))
    assert "\n" not in str(err.value)
    return err.value


@pytest.mark.parametrize(
    "override, key, says",
    [
        ("max_position_embeddings=128", "max_position_embeddings", "mix at most seq_length"),
        (
            "inter_document_attention_masking=true",
            "inter_document_attention_masking",
            "cannot apply",
        ),
    ],
)
def test_what_gmlp_layers_cannot_do_is_one_line(make_config, override, key, says):
    config = make_config(attention_config=[[["global", "amlp"], 1]], no_weight_tying=True)
    err = _refusal(config, override)
    assert err.key == key
    assert says in str(err)
