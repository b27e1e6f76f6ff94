"""GPT-NeoX's configs/rwkv/170M.yml (copied unchanged from GPT-NeoX ea7aefd into
tests/neox_configs/rwkv): it explains, with RWKV-6's widths and exact counts, and trains from
the CLI scaled down with --set, its loss falling."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import losses
from torchneox.cli import main

CONFIG = str(Path(__file__).parents[1] / "neox_configs" / "rwkv" / "170M.yml")


def test_gpt_neox_rwkv_config_explains(capsys):
    assert main(["config", "explain", CONFIG]) == 0
    out = capsys.readouterr().out
    assert "12 RWKV-6 layers: dim_att 768 (12 heads of 64), channel mix 2688" in out
    # 12 x 8,024,064 per layer + embeddings, learned positions and the untied head
    assert "175,129,344 (175M), of which 78,839,808 in embeddings" in out
    # 3 x (12 layers x 16,220,160 + the head's 2 x 50,304 x 768)
    assert "815,726,592 (816MFLOP) = 3 x forward (2 per weight a token meets, output head " in out
    assert "plus the RWKV recurrence's state read-out and update)" in out
    assert "bf16.loss_scale: DeepSpeed reads it for fp16 only" in out


def test_gpt_neox_rwkv_config_trains_scaled_down(tmp_path, tiny_data):
    run = tmp_path / "run"
    overrides = [
        "num_layers=2",
        "attention_config=[[[rwkv], 2]]",
        "hidden_size=64",
        "num_attention_heads=2",
        "seq_length=64",
        "max_position_embeddings=64",
        "train_micro_batch_size_per_gpu=4",
        "train_iters=12",
        "lr_decay_iters=12",
        "eval_interval=12",
        "eval_iters=1",
        "log_interval=4",
        "tokenizer_type=CharLevelTokenizer",
        "make_vocab_size_divisible_by=64",
        f"data_path={tiny_data}",
        "split=90,8,2",
        "distributed_backend=gloo",
        "num_workers=0",
        f"save={run}",
        "load=null",
    ]
    assert main(["train", CONFIG, *[a for o in overrides for a in ("--set", o)]]) == 0
    loss = losses(run)
    assert sorted(loss) == [4, 8, 12]
    assert loss[12] < loss[8] < loss[4]
