"""Reference log-probabilities precomputed once (GPT-NeoX's text_gen_type precompute with
precompute_model_name): `torchneox generate CONFIG --checkpoint REF --text-gen-type precompute`
writes them beside the data as GPT-NeoX lays them out, and DPO and KTO trained from them equal
the runs with a reference model, without building one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import losses, post_training_data
from torchneox.cli import main
from torchneox.data.indexed import IndexedDataset

MODEL = {
    "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 64,
    "max_position_embeddings": 64, "pos_emb": "rotary", "make_vocab_size_divisible_by": 64,
    "train_micro_batch_size_per_gpu": 2, "train_iters": 3, "num_workers": 0,
    "optimizer": {"type": "Adam", "params": {"lr": 0.003}}, "warmup": 0.0,
    "eval_interval": 3, "eval_iters": 1, "log_interval": 1, "finetune": True,
}  # fmt: skip


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_precomputed_reference_log_probabilities_train_like_a_reference_model(
    tmp_path, objective, capsys
):
    data = post_training_data(tmp_path / "chat")[objective]
    base = tmp_path / "base"  # the reference: a model trained a little on the same data
    cfg = tmp_path / "c.yml"
    cfg.write_text(json.dumps(MODEL | data))
    assert main(["train", str(cfg), "--set", f"save={base}", "--set", "train_iters=1"]) == 0
    live = tmp_path / "live"
    assert main(["train", str(cfg), "--set", f"save={live}", "--set", f"load={base}"]) == 0
    named = ["--set", "precompute_model_name=base"]
    args = ["generate", str(cfg), "--checkpoint", str(base), "--text-gen-type", "precompute"]
    assert main([*args, *named]) == 0
    prefix = next(
        v[0] for k, v in data.items() if k in ("train_data_paths", "pos_train_data_paths")
    )
    tokens, logp = IndexedDataset(prefix), IndexedDataset(f"{prefix}_base")
    assert logp.dtype == np.float32 and set(logp.sizes) == {64}
    assert len(logp) == math.ceil(len(tokens) / 8) * 8 and float(np.max(logp[0])) <= 0.0
    capsys.readouterr()
    assert main([*args, *named]) == 0  # written once: a second run keeps the files
    assert "exists: kept" in capsys.readouterr().err
    pre = tmp_path / "pre"
    train = ["train", str(cfg), "--set", f"save={pre}", "--set", f"load={base}", *named]
    assert main(train) == 0
    ours, theirs = losses(pre), losses(live)
    assert sorted(ours) == [1, 2, 3]
    for k in ours:
        assert ours[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-5), k


def test_training_without_the_precomputed_files_is_one_line_saying_how_to_make_them(
    tmp_path, capsys
):
    data = post_training_data(tmp_path / "chat")["dpo"]
    cfg = tmp_path / "c.yml"
    cfg.write_text(json.dumps(MODEL | data | {"precompute_model_name": "ref"}))
    capsys.readouterr()
    assert main(["train", str(cfg), "--set", f"save={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "dpo_chosen_document_ref: no precomputed log-probabilities" in err
    assert "--text-gen-type precompute" in err


def test_precompute_without_a_name_is_refused(tmp_path, capsys):
    data = post_training_data(tmp_path / "chat")["kto"]
    cfg = tmp_path / "c.yml"
    cfg.write_text(json.dumps(MODEL | data))
    base = tmp_path / "base"
    assert main(["train", str(cfg), "--set", f"save={base}", "--set", "train_iters=1"]) == 0
    args = ["generate", str(cfg), "--checkpoint", str(base), "--text-gen-type", "precompute"]
    assert main(args) == 2
    assert "precompute_model_name: text_gen_type 'precompute' needs precompute_model_name" in (
        capsys.readouterr().err
    )
    assert not list(Path(data["train_data_paths"][0]).parent.glob("*_None*"))
    longer = ["--set", "precompute_model_name=x", "--set", "seq_length=128"]
    longer += ["--set", "max_position_embeddings=128"]
    assert main([*args, *longer]) == 2  # was an internal error inside the rotary embedding
    err = capsys.readouterr().err
    assert "seq_length: 128 is beyond the model's 64 positions" in err and err.count("\n") == 1
    assert not list(Path(data["train_data_paths"][0]).parent.glob("*_x*"))


def test_the_files_are_laid_out_as_gpt_neox_lays_them_out(tmp_path):
    """Per document: seq_length log-probabilities of its tokens (padded with 0); documents in
    groups of micro-batch x data-parallel size up to a multiple of 8, wrapping around."""
    import torch

    from torchneox.config.load import load_mapping
    from torchneox.data.indexed import IndexedDatasetWriter
    from torchneox.inference.precompute import precompute_logprobs
    from torchneox.models.args import model_args
    from torchneox.models.transformer import build_model

    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [5, 5], [9, 8, 7, 6, 5]]
    writer = IndexedDatasetWriter(tmp_path / "t", np.int32)
    for d in docs:
        writer.add_document(d)
    writer.finish()
    keys = MODEL | {"seq_length": 6, "tokenizer_type": "CharLevelTokenizer"}
    keys |= {"train_data_paths": [str(tmp_path / "t")], "precompute_model_name": "m"}
    loaded = load_mapping(keys, "c.yml")
    model = build_model(model_args(loaded), seed=0)
    precompute_logprobs(model, loaded.config, 3, torch.device("cpu"), lambda _: None)
    out = IndexedDataset(tmp_path / "t_m")
    assert len(out) == 9 and set(out.sizes) == {6}  # ceil(ceil(5 / 8) * 8 / 3) * 3
    for j in range(9):
        doc = docs[j % 5]
        tokens = torch.tensor([doc + [0] * (7 - len(doc))])
        with torch.no_grad():
            lp = torch.log_softmax(model(tokens[:, :-1]).float(), -1)
        want = lp.gather(-1, tokens[:, 1:, None])[0, :, 0].numpy()
        np.testing.assert_allclose(out[j], want, rtol=1e-5, atol=1e-6)
