"""Layer weight sharing (num_unique_layers, param_sharing_style): Megatron-LM's layer order,
one tensor per shared weight (in the model, the optimizer, the checkpoint and the counts), the
shared layers equal after training, and the refusals in one line."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import shared_dir
from tests.helpers import BASE, losses
from torchneox.base.errors import ConfigError
from torchneox.checkpoint import files as checkpoint_format
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.features.sharing import owners
from torchneox.config.load import load_config, load_mapping
from torchneox.interop.huggingface import load_hf_model
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.train.trainer import Trainer


def test_layer_order_is_megatrons():
    # GPT-NeoX's help text: 4 layers, 2 unique: grouped 1 2 1 2, spaced 1 1 2 2
    assert owners(4, 2, "grouped") == (0, 1, 0, 1)
    assert owners(4, 2, "spaced") == (0, 0, 2, 2)
    assert owners(6, 3, "grouped") == (0, 1, 2, 0, 1, 2)
    assert owners(6, 3, "spaced") == (0, 0, 2, 2, 4, 4)
    assert owners(4, None, "grouped") == () and owners(4, 4, "spaced") == ()


@pytest.mark.parametrize("style", ["grouped", "spaced"])
def test_shared_layers_hold_one_tensor(style):
    loaded = load_mapping(
        BASE | {"num_layers": 4, "num_unique_layers": 2, "param_sharing_style": style}, "x"
    )
    model = build_model(model_args(loaded))
    layers = model.layers
    pairs = [(0, 2), (1, 3)] if style == "grouped" else [(0, 1), (2, 3)]
    for a, b in pairs:
        for (name, p), (_, q) in zip(
            layers[str(a)].named_parameters(), layers[str(b)].named_parameters(), strict=True
        ):
            assert p is q, name
    assert layers["0"].attention.wq.weight is not layers[str(pairs[1][0])].attention.wq.weight
    unshared = build_model(model_args(load_mapping(BASE | {"num_layers": 4}, "y")))
    per_layer = sum(p.numel() for p in unshared.layers["0"].parameters())
    count = sum(p.numel() for p in model.parameters())
    assert count == sum(p.numel() for p in unshared.parameters()) - 2 * per_layer
    # the count explain shows is the model's
    assert derive(loaded)["num_parameters"] == count
    # a move (dtype, device) keeps them one tensor
    moved = model.to(torch.float64)
    assert moved.layers[str(pairs[0][1])].mlp.up.weight is moved.layers["0"].mlp.up.weight
    # the state dict holds each shared tensor once, and loads back into every sharer
    state = model.state_dict()
    assert not any(k.startswith(f"layers.{pairs[0][1]}.") for k in state)
    other = build_model(model_args(loaded), seed=5).to(torch.float64)
    other.load_state_dict(state)
    assert torch.equal(
        other.layers[str(pairs[0][1])].mlp.up.weight, state["layers.0.mlp.up.weight"]
    )


def test_training_keeps_shared_layers_one_and_checkpoints_them_once(make_config, tmp_path):
    cfg = make_config(num_layers=4, num_unique_layers=2, train_iters=3, load=None)
    trainer = Trainer(load_config([cfg]), device="cpu")
    model = trainer.model
    start = model.layers["0"].attention.wq.weight.detach().clone()
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert len(optimized) == len(list(model.parameters()))
    assert len({id(p) for p in optimized}) == len(optimized)
    trainer.run()
    assert model.layers["2"].attention.wq.weight is model.layers["0"].attention.wq.weight
    assert not torch.equal(model.layers["0"].attention.wq.weight, start)  # it trained
    step = checkpoint_format.resolve(tmp_path / "run")
    held = checkpoint_format.dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    assert "model.layers.0.attention.wq.weight" in held
    assert not any(k.startswith(("model.layers.2.", "model.layers.3.")) for k in held)
    _, loaded = load_model(step)
    assert loaded.layers["3"].mlp.down.weight is loaded.layers["1"].mlp.down.weight
    assert torch.equal(
        loaded.layers["2"].attention.wq.weight, model.layers["0"].attention.wq.weight
    )


def test_resume_is_bitwise(make_config, tmp_path):
    keys = {"num_layers": 4, "num_unique_layers": 2, "cpu_matmul": "default", "train_iters": 6}
    whole = make_config("w.yml", save=str(tmp_path / "w"), load=str(tmp_path / "w"), **keys)
    Trainer(load_config([whole]), device="cpu").run()
    cfg = make_config(
        "s.yml", save=str(tmp_path / "s"), load=str(tmp_path / "s"), exit_interval=3, **keys
    )
    Trainer(load_config([cfg]), device="cpu").run()
    Trainer(load_config([cfg]), device="cpu").run()
    lw, ls = losses(tmp_path / "w"), losses(tmp_path / "s")
    assert {k: lw[k] for k in range(4, 7)} == {k: ls[k] for k in range(4, 7)}


def test_hf_export_writes_every_layer(make_config, tmp_path):
    cfg = make_config(
        num_layers=4,
        num_unique_layers=2,
        param_sharing_style="spaced",
        train_iters=1,
        load=None,
        cpu_matmul="default",
    )
    assert main(["train", cfg]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    _, shared = load_model(tmp_path / "run")
    _, exported = load_hf_model(tmp_path / "hf")
    assert exported.args.layer_owners == ()  # four distinct layers, each a copy
    assert sum(p.numel() for p in exported.parameters()) > sum(
        p.numel() for p in shared.parameters()
    )
    tokens = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(tokens), shared.eval()(tokens))


@pytest.mark.skipif(shared_dir() is None, reason="../shared is not on this machine")
def test_gpt_neox_import_with_sharing_is_refused_in_one_line(tmp_path, capsys):
    src = shared_dir() / "golden" / "neox_checkpoints" / "pp1"
    gpt2 = shared_dir() / "data/tokenizers/gpt2"
    args = ["convert", "from-gpt-neox", str(src), str(tmp_path / "out"), "--step", "10"]
    args += ["--set", f"vocab_file={gpt2}/vocab.json", "--set", f"merge_file={gpt2}/merges.txt"]
    assert main([*args, "--set", "num_unique_layers=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "GPT-NeoX shares no weights" in err and "num_unique_layers=null" in err
    assert "\n" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"num_unique_layers": 3}, "num_layers 4 is not a multiple of 3"),
        ({"num_unique_layers": 5}, "5 is more than num_layers 4"),
        ({"num_unique_layers": 2, "param_sharing_style": "mixed"}, "param_sharing_style"),
        (
            {"num_unique_layers": 2, "attention_config": [[["global", "rwkv"], 2]]},
            "layer 1 (rwkv) would share the weights of layer 0 (global)",
        ),
    ],
)
def test_refusals_in_one_line(make_config, capsys, keys, message):
    if keys.get("attention_config"):  # spaced: layer 1 (rwkv) would hold layer 0's weights
        keys = keys | {"param_sharing_style": "spaced"}
    cfg = make_config(num_layers=4, **keys)
    assert main(["config", "explain", cfg]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_check_raises_config_error(make_config):
    with pytest.raises(ConfigError, match="not a multiple"):
        load_config([make_config(num_layers=4, num_unique_layers=3)])


def test_rerun_with_a_sharing_key_changed_names_the_key(make_config, tmp_path, capsys):
    keys = {"num_layers": 4, "num_unique_layers": 2, "train_iters": 1}
    run = str(tmp_path / "run")
    cfg = make_config("c.yml", save=run, load=run, **keys)
    assert main(["train", cfg]) == 0
    capsys.readouterr()
    changed = make_config("d.yml", save=run, load=run, **(keys | {"num_unique_layers": None}))
    assert main(["train", changed, "--set", "train_iters=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "changed since it was saved" in err and "num_unique_layers (2 -> unset)" in err, err
