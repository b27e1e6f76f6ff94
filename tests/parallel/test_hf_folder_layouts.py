"""A run started from a Hugging Face folder and saving one (save_hf) under ZeRO-3, tensor
parallelism, and tensor x pipeline parallelism: the weights read into each rank's shards (or
stages) and gathered back on rank 0 give what one process gives. The folder is a tiny random
Llama 3.2: tied embeddings (the first stage's embedding is the last stage's head, its vocabulary
split over the tensor ranks), grouped keys and values, llama3 rope scaling."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.test_hf_folders import write_config
from tests.helpers import losses, train
from torchneox.cli import main

pytest.importorskip("transformers")

LAYOUTS = {
    "zero3": (2, ["zero_optimization={stage: 3}"]),
    "tp2": (2, ["model_parallel_size=2"]),
    "tp2-pp2": (4, ["model_parallel_size=2", "pipe_parallel_size=2"]),
}


def llama_3_2(tmp_path):
    """A Llama 3.2 1B/3B-shaped model, tiny: tied embeddings, 2 key-value heads for 4 query
    heads, rope theta 500000 with llama3 scaling."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from their initial values too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = tmp_path / "hf-llama-3.2"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("hf-one")
    folder = llama_3_2(tmp)
    cfg = write_config(
        tmp / "c.yml",
        data_path=str(tiny_data),
        load=str(folder),
        train_batch_size=8,
        train_micro_batch_size_per_gpu=4,
    )
    train(cfg, f"save={tmp / 'run'}", f"save_hf={tmp / 'run' / 'hf'}")
    return cfg, tmp / "run"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_read_and_save_hf_folders_as_one_process(one_process, tmp_path, layout):
    cfg, one = one_process
    out = tmp_path / "run"
    nproc, keys = LAYOUTS[layout]
    if "pipe_parallel_size=2" in keys:  # no rank holds every stage: the checkpoint converted
        train(cfg, f"save={out}", *keys, nproc=nproc)
        assert main(["convert", "to-hf", str(out), str(tmp_path / "hf")]) == 0
    else:
        train(cfg, f"save={out}", f"save_hf={out / 'hf'}", *keys, nproc=nproc)
    exported = tmp_path / "hf" if "pipe_parallel_size=2" in keys else out / "hf"
    want, got = losses(one), losses(out)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
    theirs, ours = (
        load_file(one / "hf" / "model.safetensors"),
        load_file(exported / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    for name in ours:
        # (the tied embedding's gradient sums the embedding's and the head's parts in another
        # order under a vocabulary split; Adam's first steps magnify such float noise where a
        # gradient is near zero)
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-4)
    assert (exported / "config.json").read_text() == (one / "hf" / "config.json").read_text()
