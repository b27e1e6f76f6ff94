"""estimate with lora: the frozen base counted as parameters only, gradients and optimizer
state of the adapters alone, and no second model for DPO's reference."""

from __future__ import annotations

import json

from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.load import load_config

BASE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "train_micro_batch_size_per_gpu": 2,
    "train_iters": 10,
    "optimizer": {"type": "Adam", "params": {"lr": 1.0e-3}},
    "tokenizer_type": "CharLevelTokenizer",
}
LORA = {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}
ADAPTERS = 2 * 2 * 4 * (64 + 64)  # 2 layers x (q, v) x rank 4 x (in + out)


def estimate(tmp_path, capsys, keys: dict) -> dict:
    path = tmp_path / "a.yml"
    path.write_text(json.dumps(BASE | keys))
    assert main(["estimate", str(path), "--gpus", "1", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_frozen_base_has_no_gradients_or_optimizer_state(tmp_path, capsys):
    full = estimate(tmp_path, capsys, {})
    lora = estimate(tmp_path, capsys, LORA)
    assert lora["parameters_per_stage"] == [full["parameters_per_stage"][0] + ADAPTERS]
    got = lora["memory_per_rank_bytes"]
    assert got["parameters"] == full["memory_per_rank_bytes"]["parameters"] + 4 * ADAPTERS
    assert got["gradients"] == 4 * ADAPTERS
    assert got["optimizer"] == 2 * 4 * ADAPTERS  # Adam's two fp32 moments
    assert min(lora["activations_by_checkpointing_bytes"].values()) > 0


def test_lora_dpo_builds_one_model(tmp_path, capsys):
    dpo = {
        "train_impl": "dpo",
        "dataset_impl": "pairwise",
        "pack_impl": "unpacked",
        "pos_train_data_paths": ["chosen"],
        "neg_train_data_paths": ["rejected"],
    }
    full = estimate(tmp_path, capsys, dpo)
    lora = estimate(tmp_path, capsys, dpo | LORA)
    assert full["build_bytes"] == 2 * full["memory_per_rank_bytes"]["parameters"]
    assert lora["build_bytes"] == lora["memory_per_rank_bytes"]["parameters"]


def test_the_dry_run_of_lora_over_two_tensor_ranks_holds_what_estimate_computes(tmp_path, capsys):
    path = tmp_path / "a.yml"
    keys = BASE | LORA | {"no_weight_tying": True, "model_parallel_size": 2}
    path.write_text(json.dumps(keys | {"train_micro_batch_size_per_gpu": 1}))
    assert main(["train", str(path), "--dry-run", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "gradients 6.00 KiB (= estimate), optimizer 12.00 KiB (= estimate)" in out, out
    assert "every rehearsed rank built and holds what estimate computes" in out


def test_a_base_stored_in_bf16_counts_two_bytes_per_linear_weight(tmp_path, capsys):
    keys = {"no_weight_tying": True, "precision": "bfloat16"}
    fp32 = estimate(tmp_path, capsys, keys | LORA)
    bf16_lora = {"lora": LORA["lora"] | {"base_dtype": "bf16"}}
    bf16 = estimate(tmp_path, capsys, keys | bf16_lora)
    # 2 layers x (q, k, v, o; up, down), their weights and biases, and the untied head
    linear = 2 * (4 * 64 * 64 + 2 * 64 * 256 + 4 * 64 + 256 + 64)
    head = derive(load_config([str(tmp_path / "a.yml")]))["padded_vocab_size"] * 64
    got, was = bf16["memory_per_rank_bytes"], fp32["memory_per_rank_bytes"]
    assert got["gradients"] == was["gradients"] and got["optimizer"] == was["optimizer"]
    saved = was["parameters"] - got["parameters"]
    assert saved == 2 * (linear + head), (saved, linear, head)


def test_the_dry_run_of_a_bf16_base_under_zero3_holds_what_estimate_computes(tmp_path, capsys):
    path = tmp_path / "a.yml"
    lora = {"lora": LORA["lora"] | {"base_dtype": "bf16"}}
    keys = BASE | lora | {"precision": "bfloat16", "zero_optimization": {"stage": 3}}
    path.write_text(json.dumps(keys | {"train_micro_batch_size_per_gpu": 1}))
    assert main(["train", str(path), "--dry-run", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "every rehearsed rank built and holds what estimate computes" in out, out
