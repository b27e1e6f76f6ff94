"""GPT-NeoX's own post-training configs (neox_configs/post-training: Llama-3-8B SFT, DPO, KTO,
reward model), scaled down with --set to a tiny model, each train end to end on the CPU from
chat data made by `torchneox preprocess`; REINFORCE explains, and trains against GPT-NeoX's
data-server protocol."""

from __future__ import annotations

import json

import pytest

from tests.conftest import shared_dir
from tests.helpers import metric_rows, post_training_data
from torchneox.cli import main

SHARED = shared_dir()
CONFIGS = SHARED / "neox_configs" / "post-training" if SHARED else None
pytestmark = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")

TINY = [
    "model_parallel_size=1",
    "num_layers=2",
    "hidden_size=32",
    "num_attention_heads=4",
    "num_kv_heads=2",
    "intermediate_size=64",
    "mlp_multiple_of=64",
    "seq_length=64",
    "max_position_embeddings=64",
    "attention_config=[[[flash], 2]]",
    "train_micro_batch_size_per_gpu=2",
    "gradient_accumulation_steps=1",
    "train_iters=3",
    "lr_decay_iters=3",
    "eval_interval=3",
    "eval_iters=1",
    "distributed_backend=gloo",
    "use_wandb=false",
    "num_workers=0",
    "optimizer.params.lr=0.001",
]


@pytest.mark.parametrize("objective", ["sft", "dpo", "kto", "rm"])
def test_gpt_neox_post_training_config_runs_scaled_down(tmp_path, objective):
    data = post_training_data(tmp_path / "chat")[objective]
    overrides = [*TINY, f"save={tmp_path / 'run'}", "load=null"]  # random weights, as asked
    overrides.append(f"log_dir={tmp_path / 'run'}")
    # the config's own data and tokenizer paths, pointed at the data made here
    overrides += [f"{k}={json.dumps(v)}" for k, v in data.items() if k.endswith("paths")]
    overrides += [f"vocab_file={data['vocab_file']}"]
    for split in ("test",):  # the configs evaluate test data too: the valid files serve
        overrides += [
            f"{k.replace('valid', split)}={json.dumps(v)}" for k, v in data.items() if "valid" in k
        ]
    args = ["train", str(CONFIGS / f"llama3-8b-{objective}.yml")]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == 0
    rows = metric_rows(tmp_path / "run")
    steps = [r for r in rows if "lm_loss" in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3]
    assert any("test_lm_loss" in r for r in rows)
    if objective == "dpo":
        assert steps[0]["lm_loss"] == pytest.approx(0.6931472, abs=1e-4)


@pytest.mark.parametrize("objective", ["sft", "dpo", "kto", "rm"])
@pytest.mark.parametrize("nproc", [[], ["--nproc", "2"]], ids=["one process", "--nproc 2"])
def test_a_post_training_run_whose_load_does_not_exist_is_refused_before_anything(
    tmp_path, monkeypatch, capsys, objective, nproc
):
    """GPT-NeoX's config, scaled down: its load (checkpoints/neox_converted/...) is not here.
    Fine-tuning random weights (policy and reference) is never what was meant: one line naming
    load and the folder, exit 2, before a process, a folder or a model is made."""
    monkeypatch.chdir(tmp_path)
    tiny = [a for o in TINY for a in ("--set", o)]  # a layout that runs here
    assert main(["train", str(CONFIGS / f"llama3-8b-{objective}.yml"), *tiny, *nproc]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    load = "checkpoints/neox_converted/llama3-8b-instruct"
    assert f"llama3-8b-{objective}.yml: load: {load} holds no checkpoint, and " in err, err
    assert "set load: null to train from random weights" in err
    assert list(tmp_path.iterdir()) == []  # no save folder, no logs


def test_the_reinforce_config_explains_its_rollouts(capsys):
    """GPT-NeoX's online REINFORCE config: rollouts from its two data servers, RLOO advantages,
    the abs KL penalty against a frozen reference (kl_div_beta's default 0.1)."""
    assert main(["config", "explain", str(CONFIGS / "llama3-8b-reinforce.yml")]) == 0
    out = capsys.readouterr().out
    assert "asked of GPT-NeoX data servers (dataset_impl online)" in out
    assert "rank 0: localhost:10000" in out
    assert "A = r minus the mean reward of the prompt's other completions" in out
    assert "0.1 x |log pi - log pi_ref| (kl_impl abs)" in out
    assert "a frozen copy of the starting policy" in out
    assert "serve_model_weights: torchneox does not send CUDA IPC handles" in out


def test_the_reinforce_config_scaled_down_trains_against_a_data_server(tmp_path):
    """GPT-NeoX's llama3-8b-reinforce.yml, scaled down, trains on what a server speaking its
    online protocol sends (train, then valid and test for the evaluations), RLOO advantages
    and the abs KL penalty logged."""
    from tests.data.dataserver import start_server
    from tests.helpers import make_chat_tokenizer
    from torchneox.data.online import Group

    tok = make_chat_tokenizer(tmp_path / "tokenizer")
    group = Group([5, 6, 7, 8], [[9, 10, 11], [12, 13]], [1.0, 0.0])
    log = tmp_path / "requests.log"
    with start_server(tmp_path, [group], log=log) as (_, port):
        sets = [*TINY, f"save={tmp_path / 'run'}", "load=null", f"log_dir={tmp_path / 'run'}"]
        sets += [f"vocab_file={tok / 'tokenizer.json'}", f"online_dataserver_ports=[{port}]"]
        args = ["train", str(CONFIGS / "llama3-8b-reinforce.yml")]
        for o in sets:
            args += ["--set", o]
        assert main(args) == 0
    assert log.read_text().split() == ["train"] * 3 + ["valid", "valid", "test"]
    rows = metric_rows(tmp_path / "run")
    steps = [r for r in rows if "lm_loss" in r]
    assert [r["iteration"] for r in steps] == [1, 2, 3]
    # RLOO of rewards 1 and 0: advantages +1 and -1, the raw rewards' mean 0.5
    assert all(r["reward"] == 0.5 and r["advantage"] == 0.0 for r in steps)
    # the reference starts as the policy (bf16 rounding apart), which then moves away
    assert steps[0]["kl"] < 1e-3 < steps[-1]["kl"]
    assert any("test_lm_loss" in r for r in rows) and any("valid_reward" in r for r in rows)
