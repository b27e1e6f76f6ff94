"""The training loop: reproducibility, exact resume, accumulation, clipping, precision,
non-finite values, checkpoints and metrics."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import losses, metric_rows, poison
from torchneox.base.errors import TrainingStopped
from torchneox.checkpoint import files as checkpoint_format
from torchneox.checkpoint.manager import save_iterations
from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.train.trainer import Trainer


def run(config: str, *overrides: str) -> Trainer:
    trainer = Trainer(load_config([config], list(overrides)), device="cpu")
    trainer.run()
    return trainer


def test_same_seed_gives_bitwise_identical_losses(make_config, tmp_path):
    a = run(make_config(), f"save={tmp_path / 'a'}", f"load={tmp_path / 'a'}")
    b = run(make_config(), f"save={tmp_path / 'b'}", f"load={tmp_path / 'b'}")
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(la) == 6 and la == lb
    assert la[6] < la[1]  # it learns
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "dropout, decay", [(0.0, None), (0.1, None), (0.0, 0.0)], ids=["", "dropout", "no decay"]
)
def test_resume_is_bitwise_exact(make_config, tmp_path, dropout, decay):
    """(weight_decay 0 leaves the decayed parameter group empty, which torch's distributed
    state dict drops: it once resumed with a KeyError)"""
    keys = {
        "train_iters": 8,
        "hidden_dropout": dropout,
        "attention_dropout": dropout,
        "eval_interval": 3,
    }
    if decay is not None:
        keys["weight_decay"] = decay
    whole = run(make_config("w.yml", save=str(tmp_path / "w"), load=str(tmp_path / "w"), **keys))
    cfg = make_config(
        "s.yml", save=str(tmp_path / "s"), load=str(tmp_path / "s"), exit_interval=4, **keys
    )
    first = run(cfg)
    assert first.iteration == 4
    second = run(cfg)  # the same command again resumes at 5
    assert second.iteration == 8
    lw, ls = losses(tmp_path / "w"), losses(tmp_path / "s")
    assert {k: lw[k] for k in range(5, 9)} == {k: ls[k] for k in range(5, 9)}
    for p, q in zip(whole.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(p, q)

    def valid(d):
        return [
            json.loads(x)
            for x in (d / "metrics.jsonl").read_text().splitlines()
            if "valid_lm_loss" in x
        ]

    assert [r["valid_lm_loss"] for r in valid(tmp_path / "w")] == [
        r["valid_lm_loss"] for r in valid(tmp_path / "s")
    ]


def test_gradient_accumulation_equals_a_bigger_micro_batch(make_config, tmp_path):
    one = run(make_config("a.yml", save=str(tmp_path / "a"), train_micro_batch_size_per_gpu=8))
    two = run(make_config("b.yml", save=str(tmp_path / "b"), gradient_accumulation_steps=2))
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    for k in la:
        assert la[k] == pytest.approx(lb[k], rel=1e-5)
    for p, q in zip(one.model.parameters(), two.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_gradient_clipping_bounds_the_update(make_config, tmp_path):
    sgd = {"type": "SGD", "params": {"lr": 1.0}}
    cfg = make_config(
        optimizer=sgd,
        weight_decay=0.0,
        warmup=0.0,
        lr_decay_style="constant",
        gradient_clipping=1e-3,
        train_iters=1,
        save=str(tmp_path / "c"),
    )
    trainer = Trainer(load_config([cfg]), device="cpu")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    out = trainer.train_step()
    delta = torch.sqrt(
        sum(((p - b) ** 2).sum() for p, b in zip(trainer.model.parameters(), before, strict=True))
    )
    assert out["grad_norm"] > 1e-2  # the reported norm is the one before clipping
    assert delta.item() == pytest.approx(1e-3, rel=1e-3)


def test_weight_decay_skips_biases_and_norms(make_config):
    trainer = Trainer(load_config([make_config()]), device="cpu")
    decayed, plain = trainer.optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert {names[id(p)] for p in decayed["params"]} >= {
        "embed.weight",
        "layers.0.attention.wq.weight",
    }


@pytest.mark.parametrize("opt", ["AdamW", "SGD", "Lion", "SM3", "madgrad_wd", "LAMB"])
def test_every_optimizer_trains(make_config, tmp_path, opt):
    params = {"SGD": {"lr": 0.3, "momentum": 0.9}, "SM3": {"lr": 0.03}}.get(opt, {"lr": 0.003})
    run(
        make_config(
            optimizer={"type": opt, "params": params}, train_iters=10, save=str(tmp_path / opt)
        )
    )
    la = losses(tmp_path / opt)
    assert la[10] < la[1]


OPTIMIZERS = {
    "Adam": {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1.0e-8},
    "AdamW": {"lr": 0.003},
    "SGD": {"lr": 0.3, "momentum": 0.9, "dampening": 0.1},
    "Lion": {"lr": 0.0003},
    "SM3": {"lr": 0.01, "momentum": 0.5, "beta": 0.9},
    "madgrad_wd": {"lr": 0.003, "momentum": 0.9},
    "LAMB": {"lr": 0.003, "betas": [0.9, 0.95], "max_coeff": 5.0},
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_saving_never_changes_what_is_trained(make_config, tmp_path, opt):
    """Pythia's extra_save_iters [0, 1, 2, 4, ...]: a checkpoint before the first step used to
    create the optimizer's state with a step counted; every later update was then off."""
    trained = {}
    for name, extra in (("saves", [0, 1, 2, 4]), ("end", [])):
        cfg = make_config(
            f"{name}.yml",
            optimizer={"type": opt, "params": OPTIMIZERS[opt]},
            extra_save_iters=extra,
            save=str(tmp_path / name),
            load=None,
        )
        trained[name] = run(cfg)
    assert {p.name for p in (tmp_path / "saves").glob("global_step*")} == {
        f"global_step{i}" for i in (0, 1, 2, 4, 6)
    }
    assert losses(tmp_path / "saves") == losses(tmp_path / "end")  # bitwise
    for p, q in zip(
        trained["saves"].model.parameters(), trained["end"].model.parameters(), strict=True
    ):
        assert torch.equal(p, q)


@pytest.mark.parametrize("opt", ["SM3", "madgrad_wd", "LAMB"])
def test_a_run_resumed_mid_way_equals_the_whole_run(make_config, tmp_path, opt):
    """The optimizer's state (SM3's accumulators, MADGRAD's sums and x0, LAMB's moments and
    every step counter) saved at step 3 and read back: steps 4-6 are bitwise the whole run's."""
    given = {"optimizer": {"type": opt, "params": OPTIMIZERS[opt]}, "load": None}
    whole = make_config("whole.yml", extra_save_iters=[3], save=str(tmp_path / "w"), **given)
    whole_run = run(whole)
    resumed = make_config(
        "resumed.yml", save=str(tmp_path / "r"), **{**given, "load": str(tmp_path / "w")}
    )
    trainer = Trainer(load_config([resumed]), device="cpu", load_step=3)
    assert trainer.iteration == 3
    trainer.run()
    assert losses(tmp_path / "r") == {k: v for k, v in losses(tmp_path / "w").items() if k > 3}
    for p, q in zip(trainer.model.parameters(), whole_run.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_run_resumed_from_its_iteration_0_checkpoint_equals_the_whole_run(make_config, tmp_path):
    whole = make_config("whole.yml", extra_save_iters=[0], save=str(tmp_path / "w"), load=None)
    run(whole)
    assert (tmp_path / "w" / "global_step0").is_dir()
    resumed = make_config("resumed.yml", save=str(tmp_path / "r"), load=str(tmp_path / "w"))
    trainer = Trainer(load_config([resumed]), device="cpu", load_step=0)
    assert trainer.iteration == 0
    trainer.run()
    assert losses(tmp_path / "r") == losses(tmp_path / "w")


def test_a_weights_only_checkpoint_starts_a_run_at_step_0(make_config, tmp_path, capsys):
    """What `convert from-hf` and a weights-only `convert from-gpt-neox` write: weights and a
    config, no optimizer or data position."""
    first = run(make_config(train_iters=2, save=str(tmp_path / "p")))
    sd = {k: v.clone() for k, v in first.model.state_dict().items()}
    checkpoint_format.save_checkpoint(
        tmp_path / "weights", 0, {"model": sd}, "{}", {"converted_from": "a test"}
    )
    capsys.readouterr()
    cfg = make_config(
        "w.yml", train_iters=2, save=str(tmp_path / "w"), load=str(tmp_path / "weights")
    )
    trainer = Trainer(load_config([cfg]), device="cpu")
    assert trainer.iteration == 0 and not trainer.optimizer.state
    for p, q in zip(first.model.parameters(), trainer.model.parameters(), strict=True):
        assert torch.equal(p, q)
    assert "starting at step 0 from the weights of" in capsys.readouterr().out
    trainer.run()
    assert sorted(losses(tmp_path / "w")) == [1, 2]


def test_a_loaded_run_draws_no_weights_but_the_heads_it_lacks(make_config, tmp_path, monkeypatch):
    """Resumed, or started from a converted checkpoint, a run reads every weight into its
    shards: the initialisation never runs, but for a reward model's fresh head."""
    from tests.helpers import post_training_data
    from torchneox.models import transformer

    data = post_training_data(tmp_path / "chat")
    shape = {"seq_length": 64, "max_position_embeddings": 64, "save": None, "data_path": None}
    sft = {**data["sft"], **shape, "train_micro_batch_size_per_gpu": 2}
    run(
        make_config(
            "sft.yml", **sft | {"train_iters": 2, "save": str(tmp_path / "lm"), "load": None}
        )
    )
    drawn: list[str] = []
    real = transformer.init_parameter

    def recorded(args, name, *rest):
        drawn.append(name)
        return real(args, name, *rest)

    monkeypatch.setattr(transformer, "init_parameter", recorded)
    resumed = make_config("r.yml", **sft | {"train_iters": 3, "load": str(tmp_path / "lm")})
    assert Trainer(load_config([resumed]), device="cpu").iteration == 2
    assert drawn == []
    rm = {**data["rm"], **shape, "train_micro_batch_size_per_gpu": 2}
    reward = make_config("rm.yml", **rm | {"load": str(tmp_path / "lm"), "finetune": True})
    Trainer(load_config([reward]), device="cpu")
    assert drawn == ["value_head.weight"]
    drawn.clear()
    Trainer(load_config([make_config("fresh.yml", **sft | {"load": None})]), device="cpu")
    assert "embed.weight" in drawn and "layers.0.attention.wq.weight" in drawn


@pytest.mark.parametrize("precision", ["bfloat16", "fp16"])
def test_mixed_precision_trains_with_fp32_master_weights(make_config, tmp_path, precision):
    trainer = run(make_config(precision=precision, train_iters=8, save=str(tmp_path / precision)))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    la = losses(tmp_path / precision)
    assert la[8] < la[1]
    if precision == "fp16":
        rows = [
            json.loads(x) for x in (tmp_path / precision / "metrics.jsonl").read_text().splitlines()
        ]
        assert rows[0]["loss_scale"] == 65536.0


def test_fp16_overflow_step_is_skipped_and_counted(make_config, tmp_path):
    cfg = make_config(
        precision="fp16",
        fp16={"enabled": True, "hysteresis": 1, "initial_scale_power": 8},
        train_iters=4,
        save=str(tmp_path / "f"),
    )
    trainer = Trainer(load_config([cfg]), device="cpu")
    poison(trainer, 2, float("inf"))
    trainer.train_step()
    before = [p.detach().clone() for p in trainer.model.parameters()]
    scale = trainer.scaler.scale
    out = trainer.train_step()
    assert out["skipped"] == 1.0 and trainer.scaler.skipped == 1
    assert trainer.scaler.scale == scale / 2
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before, strict=True))
    trainer.train_step()
    assert not all(
        torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before, strict=True)
    )


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_checkpoint(make_config, tmp_path):
    cfg = make_config(train_iters=5, checkpoint_factor=2, save=str(tmp_path / "n"))
    trainer = Trainer(load_config([cfg]), device="cpu")
    poison(trainer, 3, float("nan"))
    with pytest.raises(
        TrainingStopped, match=r"step 3: the loss is nan .*; stopping .*global_step2"
    ):
        trainer.run()
    assert (tmp_path / "n" / "latest").read_text().strip() == "global_step2"
    assert checkpoint_format.read_meta(checkpoint_format.resolve(tmp_path / "n"))["iteration"] == 2


def test_a_crash_during_save_leaves_the_previous_checkpoint(make_config, tmp_path, monkeypatch):
    cfg = make_config(
        train_iters=4, checkpoint_factor=2, save=str(tmp_path / "k"), load=str(tmp_path / "k")
    )
    trainer = Trainer(load_config([cfg]), device="cpu")
    real_save = checkpoint_format.dcp.save

    def dying_save(state, checkpoint_id):
        if "global_step4" in checkpoint_id:
            real_save(state, checkpoint_id=checkpoint_id)  # files written, then the process "dies"
            raise KeyboardInterrupt
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint_format.dcp, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert (tmp_path / "k" / "latest").read_text().strip() == "global_step2"
    assert not (tmp_path / "k" / "global_step4").exists()
    resumed = Trainer(load_config([cfg]), device="cpu")
    assert resumed.iteration == 2


def test_finetune_loads_weights_only(make_config, tmp_path):
    first = run(make_config(train_iters=3, save=str(tmp_path / "p")))
    cfg = make_config(
        "ft.yml", train_iters=3, save=str(tmp_path / "ft"), load=str(tmp_path / "p"), finetune=True
    )
    tuned = Trainer(load_config([cfg]), device="cpu")
    assert tuned.iteration == 0 and not tuned.optimizer.state
    for p, q in zip(first.model.parameters(), tuned.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_loading_a_checkpoint_of_another_shape_names_the_tensor(make_config, tmp_path, capsys):
    run(make_config(train_iters=2, save=str(tmp_path / "x")))
    cfg = make_config("big.yml", hidden_size=64, save=str(tmp_path / "y"), load=str(tmp_path / "x"))
    assert main(["train", cfg]) == 2
    assert (
        "tensor embed.weight has shape (512, 32) in the checkpoint but (512, 64)"
        in capsys.readouterr().err
    )


def test_metrics_file_and_checkpoint_rotation(make_config, tmp_path):
    run(
        make_config(
            train_iters=6,
            checkpoint_factor=2,
            keep_last_n_checkpoints=2,
            eval_interval=3,
            save=str(tmp_path / "m"),
        )
    )
    rows = metric_rows(tmp_path / "m")
    steps = [r for r in rows if "lm_loss" in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "tflops", "mfu"):
        assert all(r[key] is not None for r in steps), key
    evals = [r for r in rows if "valid_lm_loss" in r]
    assert [r["iteration"] for r in evals] == [3, 6, 6]  # every eval_interval, then at the end
    assert all(r["valid_ppl"] > 1 for r in evals)
    assert any("test_lm_loss" in r for r in rows)
    assert sorted(p.name for p in (tmp_path / "m").glob("global_step*")) == [
        "global_step4",
        "global_step6",
    ]
    saved = (tmp_path / "m" / "global_step6" / "config.yml").read_text()
    assert (
        load_config([tmp_path / "m" / "global_step6" / "config.yml"]).config.training.train_iters
        == 6
    )
    assert "padded_vocab_size: 512" in saved


def test_lr_in_metrics_follows_the_schedule(make_config, tmp_path):
    trainer = run(make_config(train_iters=6, save=str(tmp_path / "l")))
    rows = metric_rows(tmp_path / "l")
    rows = [r for r in rows if "lr" in r]
    assert [r["lr"] for r in rows] == [trainer.schedule.lr_for_update(k) for k in range(1, 7)]
    assert rows[0]["lr"] == pytest.approx(0.003 / 1.2)  # warmup 0.2 x 6 steps: max(1, 0) / 1.2


def test_eod_mask_loss_changes_the_loss(make_config, tmp_path):
    run(make_config("a.yml", train_iters=1, save=str(tmp_path / "a")))
    run(make_config("b.yml", train_iters=1, save=str(tmp_path / "b"), eod_mask_loss=True))
    assert losses(tmp_path / "a")[1] != losses(tmp_path / "b")[1]


def test_checkpoint_schedule():
    class C:
        class checkpoint:
            checkpoint_factor, checkpoint_scale, extra_save_iters = 10, "linear", [0, 3]

    assert save_iterations(C.checkpoint, 35) == {0, 3, 10, 20, 30, 35}
    C.checkpoint.checkpoint_scale, C.checkpoint.extra_save_iters = "log", None
    assert save_iterations(C.checkpoint, 500) == {1, 10, 100, 500}


def test_train_cli_and_plot(make_config, tmp_path, capsys):
    cfg = make_config(train_iters=3, save=str(tmp_path / "cli"))
    assert main(["train", cfg, "--set", "log_interval=1"]) == 0
    out = capsys.readouterr().out
    assert "step 3/3 | loss" in out and "tok/s" in out and "MFU" in out and "ETA" in out
    assert main(["plot", str(tmp_path / "cli"), "--out", str(tmp_path / "loss.png")]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_needs_its_keys(tmp_path, capsys):
    (tmp_path / "c.yml").write_text(
        "{num_layers: 2, hidden_size: 32, num_attention_heads: 4, seq_length: 16}"
    )
    assert main(["train", str(tmp_path / "c.yml")]) == 2
    assert "train_iters: training needs it" in capsys.readouterr().err


@pytest.fixture
def offline_loggers(tmp_path, monkeypatch):
    """W&B and Comet write locally; the run's working folder is tmp_path."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("COMET_START_ONLINE", "false")
    monkeypatch.chdir(tmp_path)


def test_tensorboard_wandb_offline_timers_and_profiler(
    make_config, tmp_path, offline_loggers, capsys
):
    pytest.importorskip("tensorboard")
    cfg = make_config(
        train_iters=4,
        save=str(tmp_path / "r"),
        tensorboard_dir=str(tmp_path / "tb"),
        use_wandb=True,
        wandb_project="torchneox-test",
        wall_clock_breakdown=True,
        profile=True,
        profile_step_start=2,
        profile_step_stop=3,
        log_interval=2,
    )
    run(cfg)
    out = capsys.readouterr().out
    assert "time per step (ms): data" in out and "forward" in out and "optimizer" in out
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert list((tmp_path / "tb" / "profile").glob("*.json*"))
    assert list((tmp_path / "r" / "wandb").glob("offline-run-*"))


def test_wandb_run_name_and_comet_offline(make_config, tmp_path, offline_loggers):
    pytest.importorskip("comet_ml")
    cfg = make_config(
        train_iters=3,
        save=str(tmp_path / "r"),
        use_wandb=True,
        wandb_project="torchneox-test",
        wandb_run_name="pythia-rerun",
        use_comet=True,
        comet_project="torchneox-test",
        comet_experiment_name="pythia-rerun",
        comet_tags=["a", "b"],
    )
    run(cfg)
    (wandb_run,) = (tmp_path / "r" / "wandb").glob("offline-run-*")
    assert b"pythia-rerun" in b"".join(f.read_bytes() for f in wandb_run.rglob("*.wandb"))
    (archive,) = (tmp_path / "r" / "comet").glob("*.zip")
    import zipfile

    with zipfile.ZipFile(archive) as z:
        text = b"".join(z.read(n) for n in z.namelist()).decode("utf-8", "replace")
    assert "pythia-rerun" in text and "lm_loss" in text and "num_layers" in text


def test_missing_optional_packages_are_one_line_errors(make_config, tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    assert main(["train", make_config(use_wandb=True, save=str(tmp_path / "w"))]) == 2
    assert "use_wandb: needs the wandb package" in capsys.readouterr().err


def test_activation_checkpointing_changes_memory_not_results(make_config, tmp_path):
    plain = run(
        make_config("a.yml", train_iters=3, save=str(tmp_path / "a"), load=str(tmp_path / "a"))
    )
    ckpt = run(
        make_config(
            "b.yml",
            train_iters=3,
            save=str(tmp_path / "b"),
            load=str(tmp_path / "b"),
            checkpoint_activations=True,
            hidden_dropout=0.0,
        )
    )
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    assert sum(type(b).__name__ == "CheckpointWrapper" for b in ckpt.model.layers.values()) == 2
    assert set(ckpt.model.state_dict()) == set(plain.model.state_dict())  # names unchanged
    resumed = Trainer(
        load_config(
            [
                make_config(
                    "b.yml",
                    train_iters=4,
                    save=str(tmp_path / "b"),
                    load=str(tmp_path / "b"),
                    checkpoint_activations=True,
                )
            ]
        ),
        device="cpu",
    )
    assert resumed.iteration == 3


def test_use_checkpoint_lr_scheduler_keeps_the_saved_schedule(make_config, tmp_path):
    cfg = make_config(
        train_iters=4, save=str(tmp_path / "s"), load=str(tmp_path / "s"), exit_interval=2
    )
    run(cfg)
    changed = Trainer(
        load_config([cfg], ["optimizer.params.lr=0.5", "use_checkpoint_lr_scheduler=true"]),
        device="cpu",
    )
    assert changed.schedule.peak == pytest.approx(0.003)
    plain = Trainer(load_config([cfg], ["optimizer.params.lr=0.5"]), device="cpu")
    assert plain.schedule.peak == pytest.approx(0.5)


def test_z_loss_is_logged_and_changes_training(make_config, tmp_path):
    run(make_config(save=str(tmp_path / "plain"), load=None))
    run(make_config(lm_z_loss=0.01, save=str(tmp_path / "z"), load=None))
    rows = metric_rows(tmp_path / "z")
    z = [r["z_loss"] for r in rows if "z_loss" in r]
    assert len(z) == 6 and all(v > 0 for v in z)
    plain, with_z = losses(tmp_path / "plain"), losses(tmp_path / "z")
    assert plain[1] == with_z[1]  # the same first forward
    assert plain[6] != with_z[6]  # a different objective from then on


def test_a_checkpoint_keeps_the_paths_it_was_given_absolute(make_config, tmp_path, monkeypatch):
    """A run trained with --set vocab_file=relative/path must generate, eval and export from any
    other folder: the checkpoint's config names its files by absolute paths."""
    from torchneox.checkpoint.weights import load_model

    work = tmp_path / "work"
    work.mkdir()
    (work / "vocab.txt").write_text("")  # any file: CharLevelTokenizer ignores it
    monkeypatch.chdir(work)
    cfg = make_config(train_iters=1, save="run", load=None, vocab_file="vocab.txt")
    run(cfg)
    monkeypatch.chdir(tmp_path)
    loaded, _ = load_model(work / "run")
    assert loaded.config.tokenizer.vocab_file == str(work / "vocab.txt")
    assert loaded.config.checkpoint.save == str(work / "run")


def test_a_run_without_save_says_nothing_is_kept(make_config, capsys):
    run(make_config(train_iters=1, save=None, load=None))
    assert "warning: no save is set, so nothing of this run is kept" in capsys.readouterr().out


def test_mfu_is_against_a_peak_measured_once_and_never_above_100(
    make_config, tmp_path, monkeypatch
):
    """The CPU's peak used to be measured at every start-up and moved 30x with the load; MFU
    above 100% followed."""
    from torchneox.reporting import hardware

    monkeypatch.setenv(hardware.CPU_PEAK_ENV, str(tmp_path / "peak.json"))
    first = hardware.cpu_peak_tflops("fp32")
    measured = []
    monkeypatch.setattr(hardware, "measure_cpu_tflops", lambda *a, **k: measured.append(1) or 1.0)
    assert hardware.cpu_peak_tflops("fp32") == first and measured == []  # cached
    hardware.raise_cpu_peak("fp32", 1e-9)  # an old, far too low figure is replaced by a higher one
    assert hardware.cpu_peak_tflops("fp32") == first
    # a run whose steps beat the cached peak: MFU stops at 100% and the peak goes up
    data = json.loads((tmp_path / "peak.json").read_text())
    (tmp_path / "peak.json").write_text(json.dumps(dict.fromkeys(data, 1e-6)))
    run(make_config(train_iters=2, save=str(tmp_path / "r"), load=None))
    rows = metric_rows(tmp_path / "r")
    assert all(r["mfu"] <= 1.0 for r in rows if "mfu" in r)
    raised = json.loads((tmp_path / "peak.json").read_text()).values()
    assert max(hardware.peak_value(entry) for entry in raised) > 1e-6


@pytest.mark.parametrize("bf16_peak, warned", [(0.001, True), (1.5, False)])
def test_bf16_on_a_cpu_without_bf16_units_is_warned_of(
    make_config, tmp_path, monkeypatch, capsys, bf16_peak, warned
):
    """On a CPU without AVX512-BF16 or AMX a bf16 GEMM runs about 150x slower than fp32's: a
    user who set precision bfloat16 there trained far slower and was told nothing."""
    from torchneox.reporting import hardware

    peaks = tmp_path / "peak.json"
    monkeypatch.setenv(hardware.CPU_PEAK_ENV, str(peaks))
    keys = {hardware._cpu_key("bfloat16"): bf16_peak, hardware._cpu_key("fp32"): 0.15}
    peaks.write_text(json.dumps(keys))
    run(make_config(train_iters=1, save=None, load=None, precision="bfloat16"))
    out = capsys.readouterr().out
    line = "warning: precision bfloat16 on this CPU"
    assert (line in out) == warned
    if warned:
        assert "0.001 TFLOP/s against fp32's 0.15" in out and "set precision fp32" in out
    run(make_config(train_iters=1, save=None, load=None))  # fp32: nothing to say
    assert "warning: precision" not in capsys.readouterr().out


def test_measuring_the_cpu_peak_leaves_the_rng_alone():
    """The first run on a machine measures the CPU's matmul peak for MFU; it drew its matrices
    from the global RNG, so that run's dropout masks differed from every later run's."""
    from torchneox.reporting import hardware

    before = torch.get_rng_state()
    hardware.measure_cpu_tflops(size=64, seconds=0.01)
    assert hardware.measure_cpu_tflops(size=64, seconds=0.01, kernel="onednn") > 0
    assert torch.equal(before, torch.get_rng_state())


def test_the_fp32_peak_is_the_faster_kernels(monkeypatch):
    """The fp32 linears run on oneDNN where it beats MKL (models/linear.py): MFU measured
    against MKL's peak alone would read above 100%."""
    from torchneox.reporting import hardware

    speeds = {"default": 0.2, "onednn": 0.5}
    monkeypatch.setattr(hardware, "measure_cpu_tflops", lambda *a, kernel="default": speeds[kernel])
    expected = 0.5 if torch.backends.mkldnn.is_available() else 0.2
    assert hardware.machine_cpu_tflops(torch.float32) == expected
    assert hardware.machine_cpu_tflops(torch.bfloat16) == 0.2  # bf16: PyTorch's kernel is oneDNN's
