"""What a run makes of a checkpoint's LoRA adapters: never dropped. A run without lora takes
them merged into the weights (W + scale x B @ A, said in a line); a LoRA run whose
target_modules leave some out is refused; an adapters-only checkpoint whose base was replaced
is refused; a LoRA run over a full run's training state (or the reverse) starts from its
weights with a fresh optimizer, said in a line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers import train
from torchneox.base.errors import ConfigError
from torchneox.checkpoint.files import read_meta, resolve, write_manifest
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.config.load import load_config
from torchneox.models.lora import merged_state_dict
from torchneox.train.trainer import Trainer

TARGETS = ["attention.wq", "attention.wv", "mlp.down"]
KEYS = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "seq_length": 32,
    "train_iters": 2,
    "eval_iters": 1,
    "num_workers": 0,
    "no_weight_tying": True,
    "lora": {"rank": 4, "alpha": 8, "target_modules": TARGETS},
}


@pytest.fixture(scope="module")
def runs(make_module_config, tmp_path_factory):
    """A base trained one step (no lora, its training state saved), LoRA from it (an
    adapters-only checkpoint naming it) and LoRA from scratch (a full checkpoint holding the
    adapters)."""
    config = make_module_config("lora.yml", **KEYS)
    tmp = tmp_path_factory.mktemp("runs")
    base, adapters, whole = tmp / "base", tmp / "adapters", tmp / "whole"
    train(config, f"save={base}", "load=null", "lora=null", "train_iters=1")
    train(config, f"save={adapters}", f"load={base}", "finetune=true")
    train(config, f"save={whole}", "load=null")
    return config, {"base": base, "adapters": adapters, "whole": whole}


def trainer(config: str, tmp_path, *sets: str) -> Trainer:
    return Trainer(load_config([config], [f"save={tmp_path / 'out'}", *sets]), device="cpu")


@pytest.mark.parametrize("finetune", [True, False])
@pytest.mark.parametrize("held", ["adapters", "whole"])
def test_a_run_without_lora_takes_the_adapters_merged(runs, tmp_path, capsys, held, finetune):
    config, folders = runs
    _, lora_model = load_model(folders[held])
    assert any(t.abs().max() > 0 for n, t in lora_model.state_dict().items() if "lora_B" in n)
    merged = merged_state_dict(lora_model)
    capsys.readouterr()
    run = trainer(config, tmp_path, f"load={folders[held]}", "lora=null", f"finetune={finetune}")
    out = capsys.readouterr().out
    ours = run.model.state_dict()
    assert set(ours) == set(merged)
    for name, tensor in merged.items():
        assert torch.equal(ours[name], tensor), name
    assert (
        "holds LoRA adapters (on attention.wq, attention.wv, mlp.down) and this run has no lora "
        "key: they are merged into the weights they adapt (W + 2 x B @ A)" in out
    ), out
    why = "finetune is set" if finetune else "its adapters are merged (its optimizer state is of"
    assert f"starting at step 0 from the weights of {resolve(folders[held])}" in out
    assert why in out, out
    assert run.iteration == 0 and not run.optimizer.state


MORE = {"rank": 4, "alpha": 8, "target_modules": [*TARGETS, "attention.wk"]}
OTHER_TRAINING = [
    (
        "base",
        KEYS["lora"],
        "lora trains new adapters on attention.wq, attention.wv, mlp.down (its optimizer state "
        "is of a run without lora)",
    ),
    (
        "adapters",
        MORE,
        "lora trains new adapters on attention.wk (its optimizer state is of the adapters on "
        "attention.wq, attention.wv, mlp.down)",
    ),
]


@pytest.mark.parametrize(("start", "lora", "why"), OTHER_TRAINING, ids=["base", "more-layers"])
def test_lora_over_another_runs_training_state_starts_from_its_weights(
    runs, tmp_path, capsys, start, lora, why
):
    """finetune: false from a run without lora, or with adapters on fewer layers: its
    optimizer state is of other parameters; the LoRA run starts at step 0 from its weights
    with a fresh optimizer (was a traceback)."""
    config, folders = runs
    capsys.readouterr()
    sets = [f"load={folders[start]}", "finetune=false", f"lora={json.dumps(lora)}"]
    run = trainer(config, tmp_path, *sets)
    out = capsys.readouterr().out
    assert run.iteration == 0 and not run.optimizer.state
    step = resolve(folders[start])
    assert f"starting at step 0 from the weights of {step}, with a fresh optimizer: {why}" in out
    _, loaded = load_model(folders[start])
    ours = run.model.state_dict()
    assert all(torch.equal(ours[n], t) for n, t in loaded.state_dict().items())


def test_its_own_checkpoint_resumed_with_other_adapters_is_refused(runs, tmp_path):
    """A rerun of the command whose lora key changed: its own checkpoint is not restarted."""
    config, folders = runs
    own = tmp_path / "own"
    shutil.copytree(folders["whole"], own)
    with pytest.raises(ConfigError, match="save holds this run's own checkpoint") as e:
        trainer(config, tmp_path, f"save={own}", "lora=null")
    message = str(e.value)
    assert "trained with adapters on attention.wq, attention.wv, mlp.down, the config" in message
    assert "give lora as it was to resume it" in message


def test_its_own_checkpoint_resumed_with_another_alpha_is_refused(runs, tmp_path):
    """The same layers, another alpha: the adapters would go on at another scale."""
    config, folders = runs
    own = tmp_path / "own"
    shutil.copytree(folders["whole"], own)
    other = json.dumps(
        {"rank": 4, "alpha": 32, "target_modules": ["attention.wq", "attention.wv", "mlp.down"]}
    )
    with pytest.raises(
        ConfigError,
        match="whose adapters trained with rank 4, alpha 8; the config gives rank 4, alpha 32",
    ):
        trainer(config, tmp_path, f"save={own}", f"lora={other}")


@pytest.mark.parametrize("finetune", [True, False])
def test_lora_naming_fewer_layers_than_its_checkpoint_is_refused(runs, tmp_path, capsys, finetune):
    config, folders = runs
    fewer = json.dumps({"rank": 4, "alpha": 8, "target_modules": ["attention.wq"]})
    sets = [f"load={folders['adapters']}", f"finetune={finetune}", f"lora={fewer}"]
    status = main(["train", config, *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert (
        f"{resolve(folders['adapters'])}: lora.target_modules: holds LoRA adapters on "
        "attention.wv, mlp.down, which lora.target_modules does not name (attention.wq): they "
        "would be dropped" in err
    ), err


def test_adapters_whose_base_was_replaced_are_refused(runs, tmp_path, capsys):
    """The base retrained in place (same shapes, other weights): the adapters-only checkpoint
    is refused, naming it and the base; a checkpoint without the fingerprint loads as before."""
    config, _ = runs
    base, adapters = tmp_path / "base", tmp_path / "adapters"
    train(config, f"save={base}", "load=null", "lora=null", "train_iters=1")
    train(config, f"save={adapters}", f"load={base}", "finetune=true", "train_iters=1")
    step = resolve(adapters)
    assert read_meta(step)["lora_base_fingerprint"].startswith("manifest-sha256:")
    load_model(adapters)
    shutil.rmtree(base)
    train(config, f"save={base}", "load=null", "lora=null", "train_iters=1", "seed=5")
    assert main(["convert", "to-hf", str(adapters), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (
        f"{step}: holds only LoRA adapters, trained on the base weights in {resolve(base)}, "
        "which were replaced since" in err
    ), err
    meta = read_meta(step)
    del meta["lora_base_fingerprint"]  # saved before fingerprints
    (step / "meta.json").write_text(json.dumps(meta))
    write_manifest(step)
    assert main(["convert", "to-hf", str(adapters), str(tmp_path / "hf")]) == 0
