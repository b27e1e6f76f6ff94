"""A model too large to hold is the user's mistake, said in one line with what it would take
(its parameters' bytes): before anything is built, and when a build runs out of memory
anyway; never an allocation's traceback (it was an internal error in train and estimate)."""

from __future__ import annotations

import pytest
import torch

from torchneox.cli import main
from torchneox.train import fits


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "internal error" not in err, err
    return err


@pytest.mark.parametrize(
    ("hidden", "expected"),
    [
        ("1000000", "2.4e+13 parameters take 87.3 TiB in fp32 (the parameters alone"),
        ("4000000000000", "past the 2^63 bytes torch can address"),
    ],
)
@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["one process", "--nproc 2"])
def test_train_refuses_a_model_this_machine_cannot_hold_before_building_it(
    make_config, tmp_path, capsys, hidden, expected, nproc
):
    cfg = make_config(num_layers=2)
    assert main(["train", cfg, "--device", "cpu", "--set", f"hidden_size={hidden}", *nproc]) == 2
    err = _one_line(capsys)
    assert f"--set: hidden_size: hidden_size {int(hidden):,} with 2 layers: " in err
    assert expected in err
    if hidden == "1000000":
        assert "free on this cpu: use a smaller model, or more GPUs" in err
    assert not (tmp_path / "run").exists()  # nothing made


def test_estimate_refuses_a_model_torch_cannot_describe(make_config, capsys):
    assert main(["estimate", make_config(), "--gpus", "8", "--set", "hidden_size=4e12"]) == 2
    err = _one_line(capsys)
    assert "hidden_size: hidden_size 4,000,000,000,000 with 2 layers: 3.84e+26 parameters" in err
    assert "past the 2^63 bytes torch can address" in err


def test_a_build_that_runs_out_of_memory_is_one_line(make_config, tmp_path, capsys, monkeypatch):
    """What the check before building lets through (gradients, optimizer state, a reference
    model) and then does not fit."""
    from torchneox.train.trainer import Trainer

    def out_of_memory(self, step_dir):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    monkeypatch.setattr(Trainer, "_build_model", out_of_memory)
    assert main(["train", make_config(hidden_size=32), "--device", "cpu"]) == 2
    err = _one_line(capsys)
    assert "hidden_size: hidden_size 32 with 2 layers: " in err
    assert "building it ran out of memory on this cpu (CUDA out of memory. Tried to" in err


def test_other_build_errors_are_not_taken_for_memory(make_config, monkeypatch):
    from torchneox.train.trainer import Trainer

    def broken(self, step_dir):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(Trainer, "_build_model", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        Trainer(fits_config(make_config), device="cpu")


def fits_config(make_config):
    from torchneox.config.load import load_config

    return load_config([make_config()])


def test_the_check_never_refuses_what_could_fit(make_config):
    """Only each rank's share of the parameters alone (the least any layout holds) is
    compared with the free memory."""
    loaded = fits_config(make_config)
    cpu = torch.device("cpu")
    free = fits.free_bytes(cpu)
    assert free is not None and free > 0
    fits.refuse_what_cannot_fit(loaded, free // (2 * fits.PARAM_BYTES), 1, 1, cpu)  # half
