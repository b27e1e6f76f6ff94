"""``compile``: the whole model as one graph where the layout allows, each block otherwise;
compiled runs train like eager ones (to float tolerance: inductor fuses the elementwise work)
and save the same weight names, and what cannot compose is refused in one line."""

from __future__ import annotations

import pytest

from tests.helpers import losses
from torchneox.cli import main
from torchneox.config.derive import derive
from torchneox.config.load import load_config
from torchneox.train.trainer import Trainer


def trained(make_config, tmp_path, name, **keys):
    cfg = make_config(train_iters=4, save=str(tmp_path / name), **keys)
    trainer = Trainer(load_config([cfg]), device="cpu")
    trainer.run()
    return trainer, losses(tmp_path / name)


@pytest.mark.parametrize("scope", ["auto", "blocks"])
def test_compiled_run_trains_like_eager(make_config, tmp_path, scope):
    eager, want = trained(make_config, tmp_path, "eager")
    trainer, got = trained(make_config, tmp_path, scope, compile=True, compile_scope=scope)
    whole = trainer.model._compiled_call_impl is not None
    blocks = [b._compiled_call_impl is not None for b in trainer.model.layers.values()]
    assert (whole, all(blocks)) == ((True, False) if scope == "auto" else (False, True))
    assert trainer.derived["compile"] == ("model" if scope == "auto" else "blocks")
    assert list(trainer.model.state_dict()) == list(eager.model.state_dict())
    assert set(got) == set(want)
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-4)
    assert got[4] < got[1]


def test_auto_scope_follows_the_layout(make_config):
    def scope(world, **keys):
        loaded = load_config([make_config(**{"compile": True} | keys)])
        return derive(loaded, world_size=world)

    one = scope(1)
    assert one["compile"] == "model"
    assert "does not split" in one.reasons["compile"]
    tp = scope(2, model_parallel_size=2)
    assert tp["compile"] == "blocks" and "tensor parallelism" in tp.reasons["compile"]
    zero = scope(2, zero_optimization={"stage": 3})
    assert zero["compile"] == "blocks" and "ZeRO stage 3" in zero.reasons["compile"]
    assert scope(2)["compile"] == "model"  # DDP wraps the compiled model from outside
    assert scope(1, compile=False)["compile"] == "off"


def test_whole_model_compile_under_a_pipeline_is_refused(make_config, capsys):
    cfg = make_config(
        compile=True, compile_scope="model", pipe_parallel_size=2, no_weight_tying=True
    )
    code = main(["config", "explain", str(cfg), "--world-size", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "compile_scope" in err[0] and "the pipeline" in err[0] and "blocks" in err[0]
