"""muP (use_mup and the mup_* keys): base shapes, the optimizer's groups against mup's own
MuAdam, the schedule keeping each group's share, the coordinate check, explain, refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.data.datasets import step_batch
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.optim.builder import build_optimizer, param_groups

mup = pytest.importorskip("mup")

MUP = {"use_mup": True, "hidden_dropout": 0.0, "attention_dropout": 0.0}


@pytest.fixture
def base_file(make_config, tmp_path):
    """Base shapes written by save_base_shapes at width 32 (the fixture config's)."""
    path = tmp_path / "shapes.yml"
    cfg = make_config("base_cfg.yml", save_base_shapes=True, base_shapes_file=str(path), **MUP)
    assert main(["train", cfg]) == 0
    return path


def test_save_base_shapes_writes_mups_file_and_refuses_to_replace_it(
    make_config, tmp_path, base_file, capsys
):
    shapes = mup.load_base_shapes(str(base_file))  # mup's own reader
    assert shapes["embed.weight"].base_shape() == [None, 32]  # vocabulary: not a width
    assert shapes["layers.0.attention.wq.weight"].base_shape() == [32, 32]
    assert shapes["layers.0.attention_norm.weight"].base_shape() == [32]
    assert not (tmp_path / "run").exists()  # a one-off: nothing trained, nothing saved
    again = make_config("again.yml", save_base_shapes=True, base_shapes_file=str(base_file), **MUP)
    capsys.readouterr()
    assert main(["train", again]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "base_shapes_file: already exists; base_shapes_file would replace it: "
        "move it away or name another"
    )
    assert len(err.splitlines()) == 1


def _mup_lrs(model, lr: float, weight_decay: float) -> dict[str, tuple[float, float]]:
    """Each parameter's (lr, weight decay) in mup's own MuAdam over the same groups."""
    opt = mup.MuAdam(param_groups(model, weight_decay), lr=lr)
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: (g["lr"], g["weight_decay"]) for g in opt.param_groups for p in g["params"]
    }


def test_group_lrs_are_muadams_and_the_schedule_keeps_them(make_config, base_file):
    cfg = make_config(hidden_size=128, base_shapes_file=str(base_file), **MUP)
    loaded = load_config([cfg])
    args = model_args(loaded)
    assert args.mup is not None and args.mup.width_mult == 4
    model = build_model(args)
    ours = build_optimizer(model, loaded.config.optimizer, "cpu", args.mup)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {
        names[id(p)]: (g["lr"], g["weight_decay"]) for g in ours.param_groups for p in g["params"]
    }
    reference = build_model(args)
    mup.set_base_shapes(reference, str(base_file), rescale_params=False)
    expected = _mup_lrs(reference, 0.003, 0.1)
    assert got.keys() == expected.keys()
    for name, (lr, decay) in expected.items():
        assert got[name] == pytest.approx((lr, decay)), name
    # MuAdam's rule: hidden matrices lr / width_mult, vectors and embeddings lr
    assert got["layers.0.attention.wq.weight"] == pytest.approx((0.003 / 4, 0.1 * 4))
    assert got["layers.1.mlp.down.weight"][0] == pytest.approx(0.003 / 4)
    assert got["embed.weight"] == pytest.approx((0.003, 0.1))
    assert got["layers.0.attention_norm.weight"] == pytest.approx((0.003, 0.0))

    from torchneox.train.trainer import Trainer

    trainer = Trainer(loaded, device="cpu")
    for iteration in (1, 2):
        trainer.train_step()
        lr = trainer.schedule.lr_for_update(iteration)
        by_name = {
            n: g["lr"]
            for g in trainer.optimizer.param_groups
            for p in g["params"]
            for n, q in trainer.model.named_parameters()
            if q is p
        }
        assert by_name["layers.0.attention.wq.weight"] == pytest.approx(lr / 4)
        assert by_name["embed.weight"] == pytest.approx(lr)


def _logit_scales(loaded, widths, bases) -> dict[int, float]:
    from torchneox.train.mup_checks import coord_records

    batches = [torch.from_numpy(step_batch(loaded, i)[1]).long() for i in range(1, 5)]
    rows = coord_records(loaded, widths, batches, bases)
    return {r["width"]: r["l1"] for r in rows if r["module"] == "logits" and r["t"] == 4}


def test_coordinate_check_is_flat_across_widths_with_mup_only(make_config, base_file):
    """After 3 Adam steps the logits' mean |value| stays within 1.5x across widths 64 to 256
    under muP, and grows with the width under the standard parametrisation."""
    cfg = make_config(
        base_shapes_file=str(base_file),
        init_method="normal",
        output_layer_init_method="normal",
        **MUP,
    )
    loaded = load_config([cfg])
    widths = [64, 128, 256]
    up = _logit_scales(loaded, widths, yaml.safe_load(base_file.read_text()))
    sp = _logit_scales(loaded, widths, None)
    assert max(up.values()) / min(up.values()) < 1.5, up
    assert sp[256] / sp[64] > 2.5, sp
    assert sp[64] < sp[128] < sp[256]


def test_coord_check_run_writes_its_records_and_plots(make_config, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = make_config(
        num_layers=1,
        num_attention_heads=1,
        seq_length=8,
        train_micro_batch_size_per_gpu=2,
        coord_check=True,  # no base_shapes_file: the smallest width is the base
        **MUP,
    )
    assert main(["train", cfg]) == 0
    rows = [json.loads(x) for x in (tmp_path / "coord_check_up.0.jsonl").read_text().splitlines()]
    assert {r["width"] for r in rows} == {4, 8, 16, 32, 64, 128, 256}  # heads x 4 .. x 256
    assert {r["t"] for r in rows} == {1, 2, 3, 4}
    assert (tmp_path / "coord_check_sp.0.jsonl").stat().st_size > 0
    assert (tmp_path / "coord_check_up.0.jpg").read_bytes()[:2] == b"\xff\xd8"  # a JPEG
    assert not (tmp_path / "run").exists()
    assert "muP coordinate check written" in capsys.readouterr().out


def test_explain_shows_the_width_multiplier_the_group_lrs_and_the_scalings(
    make_config, base_file, capsys
):
    cfg = make_config(hidden_size=128, base_shapes_file=str(base_file), mup_attn_temp=2, **MUP)
    capsys.readouterr()
    assert main(["config", "explain", cfg]) == 0
    out = capsys.readouterr().out
    assert "4: hidden_size 128 / the base width 32" in out
    assert "hidden matrices (two width dimensions) lr / 4 = 0.00075" in out
    assert "attention scores x 1/(d x 2) (not 1/sqrt(d))" in out
    assert "logits from hidden / 4" in out


def test_mup_keys_without_use_mup_are_listed_as_having_no_effect(make_config, capsys):
    cfg = make_config(mup_embedding_mult=10.0)
    capsys.readouterr()
    assert main(["config", "explain", cfg]) == 0
    out = capsys.readouterr().out
    assert "mup_embedding_mult" in out and "use_mup is false" in out


def test_a_base_shapes_file_of_another_model_is_refused_in_one_line(make_config, base_file, capsys):
    cfg = make_config(num_layers=3, base_shapes_file=str(base_file), **MUP)
    capsys.readouterr()
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no base shape for layers.2." in err and len(err.splitlines()) == 1


def test_the_model_takes_the_mup_multipliers(make_config, base_file):
    """Same weights: mup_output_temp 2 halves the logits, mup_embedding_mult multiplies the
    embeddings, and attention scores are scaled by 1/(d x mup_attn_temp)."""
    plain = model_args(load_config([make_config(base_shapes_file=str(base_file), **MUP)]))
    hot = model_args(
        load_config(
            [
                make_config(
                    "hot.yml",
                    base_shapes_file=str(base_file),
                    mup_output_temp=2.0,
                    mup_embedding_mult=3.0,
                    mup_attn_temp=4.0,
                    **MUP,
                )
            ]
        )
    )
    assert plain.attention_scale == 1 / 8  # head_dim 8: 1/d, not 1/sqrt(d)
    assert hot.attention_scale == 1 / 32
    model = build_model(plain)
    tokens = torch.randint(0, 60, (2, 8))
    embedded = model._embed(tokens, None, 0, 8)
    hidden = torch.randn(2, 8, 32)
    logits = model._head(hidden)
    model.args = hot
    torch.testing.assert_close(model._embed(tokens, None, 0, 8), 3 * embedded)
    torch.testing.assert_close(model._head(hidden), logits / 2)


def test_mup_draws_hidden_matrices_narrower_by_sqrt_width_mult(make_config, base_file):
    """At width 128 over a base of 32 (width_mult 4), a hidden matrix is drawn with half the
    standard deviation of the same model without muP; the embedding as without."""
    wide = {"hidden_size": 128, "init_method": "normal", "output_layer_init_method": "normal"}
    with_mup = build_model(
        model_args(load_config([make_config(base_shapes_file=str(base_file), **wide, **MUP)]))
    ).state_dict()
    without = build_model(model_args(load_config([make_config("sp.yml", **wide)]))).state_dict()
    for name in ("layers.0.attention.wq.weight", "layers.1.mlp.up.weight"):
        torch.testing.assert_close(with_mup[name], without[name] / 2)
    torch.testing.assert_close(with_mup["embed.weight"], without["embed.weight"])


def test_a_mup_model_is_not_exported_to_hugging_face(make_config, base_file):
    from torchneox.base.errors import HFError
    from torchneox.models.hf.architectures import export_architecture

    args = model_args(load_config([make_config(base_shapes_file=str(base_file), **MUP)]))
    with pytest.raises(HFError, match="use_mup"):
        export_architecture(args)


def test_a_gpt_neox_config_with_mup_explains_and_trains_scaled_down(
    shared, tiny_data, tmp_path, monkeypatch, capsys
):
    """GPT-NeoX's 125M.yml (no config of GPT-NeoX's sets use_mup) with muP: its base shapes
    written at width 32, then 3 steps at width 128 (width_mult 4)."""
    monkeypatch.chdir(tmp_path)
    local = {
        "data_path": str(tiny_data),
        "tokenizer_type": "CharLevelTokenizer",
        "save": "run",
        "num_workers": 0,
        "use_mup": True,
        "base_shapes_file": "shapes.yml",
    }
    (tmp_path / "local.yml").write_text(json.dumps(local))
    scaled = [
        "num_layers=2", "hidden_size=32", "num_attention_heads=4", "seq_length=32",
        "max_position_embeddings=32", "train_iters=3", "lr_decay_iters=3", "eval_iters=1",
        "train_micro_batch_size_per_gpu=2", "precision=fp32", "fp16.enabled=false", "log_interval=1",
    ]  # fmt: skip
    files = [str(shared / "neox_configs" / "125M.yml"), "local.yml"]
    sets = [x for s in scaled for x in ("--set", s)]
    assert main(["train", *files, *sets, "--set", "save_base_shapes=true"]) == 0
    wide = [*sets, "--set", "hidden_size=128"]
    capsys.readouterr()
    assert main(["config", "explain", *files, *wide]) == 0
    assert "hidden matrices (two width dimensions) lr / 4 = 0.00015" in capsys.readouterr().out
    assert main(["train", *files, *wide]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_sgd_groups_are_musgds(make_config, base_file):
    """MuSGD's rule: vector-like parameters (embeddings, the head, biases, norms) at lr x
    width_mult, square hidden matrices at lr."""
    sgd = {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}
    cfg = make_config(hidden_size=128, base_shapes_file=str(base_file), optimizer=sgd, **MUP)
    loaded = load_config([cfg])
    args = model_args(loaded)
    model = build_model(args)
    ours = build_optimizer(model, loaded.config.optimizer, "cpu", args.mup)
    names = {id(p): n for n, p in model.named_parameters()}
    got = {
        names[id(p)]: (g["lr"], g["weight_decay"]) for g in ours.param_groups for p in g["params"]
    }
    reference = build_model(args)
    mup.set_base_shapes(reference, str(base_file), rescale_params=False)
    theirs = mup.MuSGD(param_groups(reference, 0.1), lr=0.01)
    ref_names = {id(p): n for n, p in reference.named_parameters()}
    for g in theirs.param_groups:
        for p in g["params"]:
            assert got[ref_names[id(p)]] == pytest.approx((g["lr"], g["weight_decay"]))
    assert got["embed.weight"] == pytest.approx((0.04, 0.1 / 4))
    assert got["layers.0.attention.wq.weight"][0] == pytest.approx(0.01)


def _damage_shapes(path, kind: str) -> None:
    """A file cut at an entry's end (valid YAML, an entry gone), or one size made NaN (a cut
    that leaves invalid YAML was already refused naming the file)."""
    shapes = yaml.safe_load(path.read_text())
    if kind == "missing":
        del shapes["layers.1.mlp.up.weight"]
    else:
        shapes["layers.0.mlp.up.weight"][0] = float("nan")
    path.write_text(yaml.safe_dump(shapes))


SHAPES_DAMAGE = [
    ("missing", "holds no base shape for layers.1.mlp.up.weight"),
    ("nan", "layers.0.mlp.up.weight: [nan, 32] is not a base shape"),
]


@pytest.mark.parametrize(("kind", "fragment"), SHAPES_DAMAGE, ids=[c[0] for c in SHAPES_DAMAGE])
def test_a_damaged_base_shapes_file_is_one_line_naming_it(
    make_config, base_file, capsys, kind, fragment
):
    _damage_shapes(base_file, kind)
    cfg = make_config(base_shapes_file=str(base_file), train_iters=1, save=None, load=None, **MUP)
    capsys.readouterr()
    assert main(["train", cfg]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: {base_file}: " in err, err
    assert fragment in err, err


def test_a_rerun_whose_base_shapes_changed_is_refused_naming_the_file(
    make_config, base_file, tmp_path, capsys
):
    """The base shapes give the multipliers: a run resumed after its file was replaced by
    another model's would train on with others (the sibling of a LoRA base replaced)."""
    cfg = make_config("run.yml", hidden_size=64, base_shapes_file=str(base_file), **MUP)
    assert main(["train", cfg, "--set", "train_iters=1"]) == 0
    other = tmp_path / "other.yml"
    wider = make_config(
        "w.yml", hidden_size=64, save_base_shapes=True, base_shapes_file=str(other), **MUP
    )
    assert main(["train", wider]) == 0
    base_file.write_text(other.read_text())  # the same path, another base
    capsys.readouterr()
    assert main(["train", cfg, "--set", "train_iters=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"error: {base_file}: base_shapes_file: changed since" in err and "\n" not in err
