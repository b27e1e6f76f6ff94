"""A run started from a Hugging Face folder and saving one (save_hf) under ZeRO-3 and tensor
parallelism on 2 processes: the weights read into each rank's shards and gathered back on
rank 0 give what one process gives."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.test_hf_folders import hf_folder, write_config
from tests.helpers import losses, train

pytest.importorskip("transformers")

LAYOUTS = {
    "zero3": ["zero_optimization={stage: 3}"],
    "tp2": ["model_parallel_size=2"],
}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_data):
    tmp = tmp_path_factory.mktemp("hf-one")
    folder = hf_folder(tmp, "llama")
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
    train(cfg, f"save={out}", f"save_hf={out / 'hf'}", *LAYOUTS[layout], nproc=2)
    want, got = losses(one), losses(out)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
    theirs, ours = (
        load_file(one / "hf" / "model.safetensors"),
        load_file(out / "hf" / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=5e-5)
    assert (out / "hf" / "config.json").read_text() == (one / "hf" / "config.json").read_text()
