"""GPT-NeoX's own runs (golden/neox_runs), started in torchneox from their iteration-0
checkpoints: the loss of every iteration, warmup and the save at iteration 0 included."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import shared_dir
from tests.helpers import metric_rows
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main

SHARED = shared_dir()
pytestmark = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")
RUNS = SHARED / "golden" / "neox_runs" if SHARED else None


def golden(run: str, name: str) -> dict:
    return json.loads((RUNS / run / "losses.json").read_text())[name]


def config_for(run: str, config: str, tmp_path: Path) -> Path:
    """The run's config as GPT-NeoX ran it, with its folders pointed here."""
    text = (RUNS / run / "configs" / config).read_text()
    text = re.sub(r'"(save|load)": "<[^"]*"', rf'"\1": "{tmp_path / "ckpt"}"', text)
    text = re.sub(r'"log_dir": "<[^"]*"', f'"log_dir": "{tmp_path / "log"}"', text)
    text = text.replace("<work>/data", str(RUNS / "data"))
    path = tmp_path / config
    path.write_text(text)
    return path


def convert_step(run: str, cfg: Path, tmp_path: Path, step: int, ckpt: str = "ckpt") -> None:
    args = ["convert", "from-gpt-neox", str(RUNS / run / ckpt), str(tmp_path / "ckpt")]
    assert main([*args, "--step", str(step), "--with-optimizer", "--config", str(cfg)]) == 0


def logged(tmp_path: Path) -> tuple[dict, list]:
    """{iteration: lm_loss} and the evaluation losses of the run logged in tmp_path/log."""
    rows = metric_rows(tmp_path / "log")
    losses = {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}
    evals = [r[k] for r in rows for k in ("valid_lm_loss", "test_lm_loss") if k in r]
    return losses, evals


def train_from_iteration_0(run: str, config: str, tmp_path: Path) -> tuple[dict, list]:
    """Convert the run's global_step0 (weights, a never-stepped optimizer, data position, RNG)
    and train its config to the end; returns {iteration: lm_loss} and the evaluation losses."""
    cfg = config_for(run, config, tmp_path)
    convert_step(run, cfg, tmp_path, 0)
    assert main(["train", str(cfg), "--set", "tensorboard_dir=null"]) == 0
    return logged(tmp_path)


def assert_losses_equal(ours: dict, theirs: list, rel: float) -> None:
    assert sorted(ours) == [r["iteration"] for r in theirs]
    for r in theirs:
        assert ours[r["iteration"]] == pytest.approx(r["lm_loss"], rel=rel), r["iteration"]


def test_tanh_gelu_run_gives_gpt_neox_losses_from_iteration_0(tmp_path):
    """bias_gelu_fusion: true (every Pythia config): GPT-NeoX computed the tanh gelu; warmup's
    first update uses peak / warmup (GPT-NeoX #1379); the checkpoint at iteration 0
    (extra_save_iters [0]) leaves the training unchanged."""
    ours, evals = train_from_iteration_0("gelu_tanh_pp1", "gelu_tanh_pp1.yml", tmp_path)
    run = golden("gelu_tanh_pp1", "gelu_tanh_pp1")
    assert_losses_equal(ours, run["train"], rel=1e-6)
    assert evals == pytest.approx([e["lm_loss"] for e in run["eval"]], rel=1e-6)
    # the exact gelu's run is further away than the tolerance: the test can tell them apart
    control = golden("gelu_tanh_pp1", "control_erf_gelu")["train"]
    assert max(abs(ours[r["iteration"]] / r["lm_loss"] - 1) for r in control) > 1e-6


def test_exact_gelu_control_run_gives_gpt_neox_losses(tmp_path):
    ours, _ = train_from_iteration_0("gelu_tanh_pp1", "control_erf_gelu.yml", tmp_path)
    assert_losses_equal(ours, golden("gelu_tanh_pp1", "control_erf_gelu")["train"], rel=1e-6)


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [(2, ["zero_optimization={stage: 1}"]), (1, ["gradient_accumulation_steps=2"])],
    ids=["2-processes-zero1", "1-process"],
)
def test_zero1_run_continues_from_its_optimizer_partitions(tmp_path, nproc, layout):
    """Every Pythia config trains with ZeRO-1: GPT-NeoX keeps the Adam moments in one flat
    partition per data-parallel rank (zero_pp_rank_*). Converted at iteration 10, the run
    continues with GPT-NeoX's losses 11..20, on its 2 ranks or on one process that
    accumulates the same global batch of 8."""
    cfg = config_for("zero1_dp2", "zero1_dp2.yml", tmp_path)
    convert_step("zero1_dp2", cfg, tmp_path, 10, ckpt="run20/ckpt")
    settings = ["tensorboard_dir=null", "global_num_gpus=null", *layout]
    command = ["train", str(cfg), *[a for x in settings for a in ("--set", x)]]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    assert main(command) == 0
    ours, evals = logged(tmp_path)
    run = golden("zero1_dp2", "run20")
    assert_losses_equal(ours, run["train"][10:], rel=1e-6)
    assert evals == pytest.approx([e["lm_loss"] for e in run["eval"][1:]], rel=1e-6)


def test_zero1_run_from_iteration_0_gives_gpt_neox_losses_on_2_processes(tmp_path):
    cfg = config_for("zero1_dp2", "zero1_dp2.yml", tmp_path)
    convert_step("zero1_dp2", cfg, tmp_path, 0, ckpt="run20/ckpt")
    settings = ["tensorboard_dir=null", "global_num_gpus=null"]
    command = ["train", str(cfg), *[a for x in settings for a in ("--set", x)], "--nproc", "2"]
    assert main(command) == 0
    ours, _ = logged(tmp_path)
    assert_losses_equal(ours, golden("zero1_dp2", "run20")["train"], rel=1e-6)


def test_gqa_llama_run_gives_gpt_neox_losses_from_iteration_0(tmp_path):
    """RMSNorm (its weight is called scale), SwiGLU, 4 query heads on 2 key/value heads (GPT-NeoX
    lays the fused projection out as all of Q, then K, then V), full rotary, no biases."""
    ours, evals = train_from_iteration_0("gqa_llama", "gqa_llama.yml", tmp_path)
    run = golden("gqa_llama", "gqa_llama")
    assert_losses_equal(ours, run["train"], rel=1e-6)
    assert evals == pytest.approx([e["lm_loss"] for e in run["eval"]], rel=1e-6)


def split_like_gpt_neox(name: str, tensor: torch.Tensor, rank: int, heads: int, kv: int, d: int):
    """Tensor rank ``rank`` of 2's share of a GPT-NeoX tensor, cut as GPT-NeoX's
    Column/RowParallelLinear and VocabParallelEmbedding cut it: embeddings and the output head
    by vocabulary rows; query_key_value by output rows, each rank holding [its q heads; its k
    heads; its v heads] (gqa_project splits the local output that way); linear1 of a gated MLP
    as [its up rows; its gate rows]; attention.dense and linear2 by input columns; norms whole."""
    if name.endswith("query_key_value.weight"):
        q, k, v = tensor.split([heads * d, kv * d, kv * d])
        return torch.cat([t.chunk(2)[rank] for t in (q, k, v)])
    if name == "mlp.linear1.weight":
        up, gate = tensor.chunk(2)
        return torch.cat([up.chunk(2)[rank], gate.chunk(2)[rank]])
    if name in ("word_embeddings.weight", "final_linear.weight"):
        return tensor.chunk(2)[rank].clone()
    if name in ("attention.dense.weight", "mlp.linear2.weight"):
        return tensor.chunk(2, dim=1)[rank].clone()
    return tensor.clone()


def test_gqa_checkpoint_split_over_2_tensor_ranks_merges_to_the_same_model(tmp_path):
    source = RUNS / "gqa_llama" / "ckpt" / "global_step0"
    split = tmp_path / "tp2" / "global_step0"
    (split / "configs").mkdir(parents=True)
    (split / "configs" / "gqa_llama.yml").write_bytes(
        (source / "configs" / "gqa_llama.yml").read_bytes()
    )
    for path in source.glob("layer_*-model_00-model_states.pt"):
        tensors = torch.load(path, weights_only=False)
        for rank in (0, 1):
            shard = {n: split_like_gpt_neox(n, t, rank, 4, 2, 16) for n, t in tensors.items()}
            torch.save(shard, split / path.name.replace("model_00", f"model_{rank:02d}"))
    for rank in (0, 1):
        (split / f"mp_rank_{rank:02d}_model_states.pt").write_bytes(
            (source / "mp_rank_00_model_states.pt").read_bytes()
        )
    base = ["convert", "from-gpt-neox"]
    assert main([*base, str(source), str(tmp_path / "one")]) == 0
    # the config of a run on 2 tensor ranks says so
    tp2 = [str(split), str(tmp_path / "two"), "--set", "model_parallel_size=2"]
    tp2 += ["--set", "global_num_gpus=2"]
    assert main([*base, *tp2]) == 0
    _, one = load_model(tmp_path / "one")
    _, two = load_model(tmp_path / "two")
    for (name, a), (_, b) in zip(one.state_dict().items(), two.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("run", ["gelu_tanh_pp1", "gqa_llama"])
def test_converted_golden_runs_export_to_hugging_face_with_equal_logits(tmp_path, run):
    transformers = pytest.importorskip("transformers")
    ckpt = RUNS / run / "ckpt"
    assert main(["convert", "from-gpt-neox", str(ckpt), str(tmp_path / "ours")]) == 0
    assert main(["convert", "to-hf", str(tmp_path / "ours"), str(tmp_path / "hf")]) == 0
    _, ours = load_model(tmp_path / "ours")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.from_numpy(np.load(RUNS / run / "input" / "input_ids.npy"))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)


def copy_step(run: str, step: str, tmp_path: Path, ckpt: str = "ckpt") -> Path:
    source = RUNS / run / ckpt / step
    target = tmp_path / "neox" / step
    shutil.copytree(source, target)
    return target


def test_layer_files_alone_import_as_weights(tmp_path, capsys):
    """People delete the mp_rank files (optimizer state) to share weights."""
    step = copy_step("zero1_dp2", "global_step10", tmp_path, "run20/ckpt")
    for path in [*step.glob("mp_rank_*"), *step.glob("zero_pp_rank_*")]:
        path.unlink()
    assert main(["convert", "from-gpt-neox", str(step), str(tmp_path / "w")]) == 0
    whole = tmp_path / "whole"
    assert (
        main(
            [
                "convert",
                "from-gpt-neox",
                str(RUNS / "zero1_dp2/run20/ckpt"),
                str(whole),
                "--step",
                "10",
            ]
        )
        == 0
    )
    _, a = load_model(tmp_path / "w")
    _, b = load_model(whole)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    capsys.readouterr()
    args = ["convert", "from-gpt-neox", str(step), str(tmp_path / "o"), "--with-optimizer"]
    assert main(args) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("torchneox: error:")]
    assert len(errors) == 1 and "has layer files only" in errors[0] and str(step) in errors[0]


@pytest.mark.parametrize(
    "damage", ["missing-partition", "extra-partition", "missing-layer-shard", "foreign-shard"]
)
def test_malformed_checkpoints_are_one_line_naming_the_file(tmp_path, capsys, damage):
    step = copy_step("zero1_dp2", "global_step10", tmp_path, "run20/ckpt")
    extra = ["--with-optimizer"]
    if damage == "missing-partition":
        (step / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
        named = "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"
    elif damage == "extra-partition":
        shutil.copy(
            step / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
            step / "zero_pp_rank_2_mp_rank_00_optim_states.pt",
        )
        named = "cut into 2 data-parallel partitions, but zero_pp_rank_2_mp_rank_00_optim_states.pt"
    elif damage == "missing-layer-shard":  # a tensor-parallel layout with one shard gone
        for path in step.glob("layer_*-model_00-*"):
            shutil.copy(path, step / path.name.replace("model_00", "model_01"))
        shutil.copy(step / "mp_rank_00_model_states.pt", step / "mp_rank_01_model_states.pt")
        (step / "layer_03-model_01-model_states.pt").unlink()
        named = "layer_03-model_01-model_states.pt is missing"
        extra = []
    else:  # a layer file of another model put in place of one of this run's
        other = torch.load(RUNS / "gqa_llama/ckpt/global_step0/layer_02-model_00-model_states.pt")
        torch.save(other, step / "layer_02-model_00-model_states.pt")
        named = "weights do not match the config"
        extra = []
    capsys.readouterr()
    assert main(["convert", "from-gpt-neox", str(step), str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("torchneox: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert named in errors[0] and str(step) in errors[0], err
    assert not (tmp_path / "o").exists()


def test_zero_master_weights_are_cut_back_per_parameter_and_win_over_half_weights(tmp_path):
    """ZeRO keeps fp32 master weights in the partitions. In this fp32 run they equal the layer
    files; a copy whose layer files are rounded to fp16 (as an fp16 run writes them) imports
    with the fp32 masters, not the rounded weights."""
    step = copy_step("zero1_dp2", "global_step10", tmp_path, "run20/ckpt")
    whole = tmp_path / "fp32"
    assert main(["convert", "from-gpt-neox", str(step), str(whole), "--with-optimizer"]) == 0
    for path in step.glob("layer_*"):
        tensors = torch.load(path, weights_only=False)
        torch.save({k: v.half() for k, v in tensors.items()}, path)
    rounded = tmp_path / "weights-only"
    assert main(["convert", "from-gpt-neox", str(step), str(rounded)]) == 0
    masters = tmp_path / "masters"
    assert main(["convert", "from-gpt-neox", str(step), str(masters), "--with-optimizer"]) == 0
    _, a = load_model(whole)
    _, b = load_model(masters)
    _, c = load_model(rounded)
    for (name, x), (_, y), (_, z) in zip(
        a.state_dict().items(), b.state_dict().items(), c.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name
        assert torch.equal(z, x.half().float()), name
    assert any(not torch.equal(x, z) for x, z in zip(a.parameters(), c.parameters(), strict=True))


def test_a_weights_only_conversion_trains_from_step_0(tmp_path, capsys):
    """`convert from-gpt-neox` without --with-optimizer, then `train --set load=DIR`: the run
    starts at step 0 from those weights (and says so); from GPT-NeoX's iteration-0 weights and
    a fresh optimizer that is GPT-NeoX's own run."""
    cfg = config_for("gelu_tanh_pp1", "gelu_tanh_pp1.yml", tmp_path)
    source = str(RUNS / "gelu_tanh_pp1" / "ckpt")
    assert main(["convert", "from-gpt-neox", source, str(tmp_path / "ckpt"), "--step", "0"]) == 0
    capsys.readouterr()
    assert main(["train", str(cfg), "--set", "tensorboard_dir=null"]) == 0
    assert "starting at step 0 from the weights of" in capsys.readouterr().out
    ours, _ = logged(tmp_path)
    assert_losses_equal(ours, golden("gelu_tanh_pp1", "gelu_tanh_pp1")["train"], rel=1e-6)
