"""LoRA from a Hugging Face base and back: a tiny random Llama imported, SFT-trained with
adapters by `torchneox train`, exported as a PEFT adapter folder that peft loads onto the
base, and merged into the weights by plain `convert to-hf`; both compute the trained model's
logits, and training changed the adapters and nothing else."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import post_training_data
from tests.interop.test_post_training_export import converted_model_keys, run, tiny_llama
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.models.params import init_parameter
from torchneox.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "attention.wo", "down_proj"]}


DATA: dict = {}
"""The chat data's configs (post_training_data's), once the fixture made them."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The base folder, its conversion and the LoRA-SFT run from it."""
    tmp = tmp_path_factory.mktemp("lora")
    data = post_training_data(tmp / "chat")
    hf_in = tiny_llama(tmp / "hf_base", tmp / "chat" / "tokenizer")
    base = tmp / "base"
    assert main(["convert", "from-hf", str(hf_in), str(base)]) == 0
    model_cfg = converted_model_keys(base, tmp)
    ran = []
    original = Trainer.run

    def keep(self):  # the trained model as training left it, not as a checkpoint holds it
        out = original(self)
        ran.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "run", keep)
        sft = run(tmp, "sft", data["sft"] | {"lora": LORA}, base, model_cfg)
    (trained_weights,) = ran
    DATA.update(data)
    return tmp, hf_in, base, sft, trained_weights


def tokens() -> torch.Tensor:
    return torch.randint(2, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def test_only_the_adapters_change_and_the_checkpoint_holds_the_trained_model(trained):
    _, _, base, sft, after = trained
    _, before = load_model(base)
    start = before.state_dict()
    adapters = [n for n in after if ".lora_" in n]
    assert len(adapters) == 2 * 4 * 2  # 2 layers x 4 targets x (A, B)
    assert set(after) == set(start) | set(adapters)
    for name, tensor in after.items():
        if name.endswith("lora_B.weight"):  # zeros at the start, trained since
            assert tensor.abs().max() > 0, name
        elif name not in adapters:
            assert torch.equal(tensor, start[name]), name
    _, saved = load_model(sft)  # the base from its checkpoint, the adapters from the run's
    assert all(torch.equal(t, after[n]) for n, t in saved.state_dict().items())


def test_peft_loads_the_adapter_and_the_merged_export_equals_it(trained, capsys):
    tmp, hf_in, _, sft, _ = trained
    adapter, merged = tmp / "adapter", tmp / "merged"
    assert main(["convert", "to-hf", "--adapter", str(sft), str(adapter)]) == 0
    assert main(["convert", "to-hf", str(sft), str(merged)]) == 0
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["q_proj", "v_proj", "o_proj", "down_proj"]
    from safetensors.torch import load_file

    saved = load_file(adapter / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in saved
    assert "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight" in saved
    _, ours = load_model(sft)
    ids = tokens()
    base = transformers.LlamaForCausalLM.from_pretrained(hf_in)
    with torch.no_grad():  # the adapters matter: the base alone computes something else
        assert (base(ids).logits - ours(ids)).abs().max() > 1e-3
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    plain = transformers.LlamaForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        expected = ours(ids)
        torch.testing.assert_close(with_adapter(ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(plain(ids).logits, expected, rtol=0, atol=1e-5)
    assert not any("lora" in k for k in load_file(merged / "model.safetensors"))


def test_adapter_export_of_a_model_without_adapters_is_one_line(trained, capsys):
    tmp, _, base, _, _ = trained
    assert main(["convert", "to-hf", "--adapter", str(base), str(tmp / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no LoRA adapters" in err, err
    assert not (tmp / "none").exists()


def test_checkpoints_hold_the_adapters_and_name_their_base(trained):
    import torch.distributed.checkpoint as dcp

    from torchneox.checkpoint.files import read_meta, resolve

    _, _, base, sft, _ = trained
    step = resolve(sft)
    held = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    model = [k for k in held if k.startswith("model.")]
    assert model and all(".lora_A." in k or ".lora_B." in k for k in model), model
    assert read_meta(step)["lora_base"] == str(resolve(base).resolve())


def test_a_resumed_lora_run_equals_one_never_stopped(trained):
    from tests.helpers import losses, weights
    from tests.interop.test_post_training_export import TRAINING

    tmp, _, _, sft, _ = trained
    keys = json.loads((tmp / "sft.yml").read_text())
    stopped = tmp / "stopped"
    first = keys | {"save": str(stopped), "log_dir": str(stopped), "exit_interval": 2}
    (tmp / "first.yml").write_text(json.dumps(first))
    assert main(["train", str(tmp / "model.yml"), str(tmp / "first.yml")]) == 0
    assert sorted(losses(stopped)) == [1, 2]
    then = first | {"load": str(stopped), "finetune": False, "exit_interval": None}
    (tmp / "then.yml").write_text(json.dumps(then))
    assert main(["train", str(tmp / "model.yml"), str(tmp / "then.yml")]) == 0
    assert losses(stopped) == losses(sft) and sorted(losses(sft)) == [1, 2, 3, 4]
    assert TRAINING["train_iters"] == 4
    resumed, whole = weights(stopped), weights(sft)
    assert all(torch.equal(t, whole[n]) for n, t in resumed.items())


def keeping_trainer(tmp, name: str, keys: dict, base) -> tuple:
    """A run of ``keys`` with LORA from ``base``, and its trainer's parts and final weights."""
    ran = []
    original = Trainer.run

    def keep(self):
        out = original(self)
        ran.append(
            (self.parts, {k: v.detach().clone() for k, v in self.model.state_dict().items()})
        )
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "run", keep)
        folder = run(tmp, name, keys | {"lora": LORA}, base, tmp / "model.yml")
    return folder, *ran[0]


@pytest.mark.parametrize("impl", ["dpo", "kto"])
def test_lora_dpo_and_kto_take_the_base_as_reference_and_build_no_second_model(trained, impl):
    """DPO and KTO with adapters from the base: the reference is the policy with its adapters
    left out (DPO's step 1 loss is ln 2: the adapters start at zero), no reference model is
    built, and the checkpoint holds the adapters alone."""
    import torch.distributed.checkpoint as dcp

    from tests.helpers import metric_rows
    from torchneox.checkpoint.files import resolve

    tmp, _, base, _, _ = trained
    folder, parts, _ = keeping_trainer(tmp, impl, DATA[impl], base)
    assert parts.reference is None and parts.reference_pipeline is None
    rows = [r for r in metric_rows(folder) if "lm_loss" in r]
    if impl == "dpo":
        assert rows[0]["lm_loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert rows[-1]["lm_loss"] != pytest.approx(rows[0]["lm_loss"], abs=1e-4)  # it learnt
    held = dcp.FileSystemReader(str(resolve(folder))).read_metadata().state_dict_metadata
    assert not any(k.startswith("reference.") for k in held)
    assert all(".lora_" in k for k in held if k.startswith("model."))


def saved_args(folder):
    from torchneox.checkpoint.files import checkpoint_config, resolve
    from torchneox.models.args import model_args

    return model_args(checkpoint_config(resolve(folder)))


def test_lora_dpo_in_two_pipeline_stages_equals_one_process(trained):
    """The base as reference through pipeline stages: the policy's stages run forward with
    their adapters left out; the run equals one process's."""
    from tests.helpers import assert_same_training, reference, train

    tmp, _, base, _, _ = trained
    keys = json.loads((tmp / "model.yml").read_text()) | json.loads((tmp / "dpo.yml").read_text())
    whole = tmp / "dpo_pp.yml"
    whole.write_text(json.dumps(keys | {"lora": LORA, "load": str(base)}))
    one, two = tmp / "dpo_one", tmp / "dpo_pp"
    train(str(whole), f"save={one}", f"log_dir={one}")
    train(str(whole), f"save={two}", f"log_dir={two}", "pipe_parallel_size=2", nproc=2)
    assert_same_training(two, reference(one))


def test_a_lora_reward_model_trains_its_head_and_adapters_only(trained, capsys):
    tmp, _, base, _, _ = trained
    folder, _, after = keeping_trainer(tmp, "rm", DATA["rm"], base)
    start = load_model(base)[1].state_dict()
    frozen = [n for n in after if ".lora_" not in n and n != "value_head.weight"]
    assert len(frozen) == len(start) - 1  # all but the language model's head
    for name in frozen:
        assert torch.equal(after[name], start[name]), name
    drawn = torch.empty_like(after["value_head.weight"])  # as the run drew it (seed 1234)
    init_parameter(saved_args(folder), "value_head.weight", drawn, 1234)
    assert drawn.abs().max() > 0 and not torch.equal(after["value_head.weight"], drawn)
    _, saved = load_model(folder)  # the base from its checkpoint; the head and adapters
    assert all(torch.equal(t, after[n]) for n, t in saved.state_dict().items())
    assert main(["convert", "to-hf", "--adapter", str(folder), str(tmp / "rm_adapter")]) == 0
    assert main(["convert", "to-hf", str(folder), str(tmp / "rm_hf")]) == 0


def test_a_peft_adapter_folder_imports(trained):
    """peft's own adapter (B drawn, not zeros) on the base, converted in with the base: the
    torchneox model computes PeftModel's logits, and exports back to the same tensors."""
    from safetensors.torch import load_file

    tmp, hf_in, _, _, _ = trained
    base = transformers.LlamaForCausalLM.from_pretrained(hf_in)
    config = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=["k_proj", "gate_proj", "up_proj"],
        init_lora_weights=False, task_type="CAUSAL_LM",
    )  # fmt: skip
    torch.manual_seed(2)
    theirs = peft.get_peft_model(base, config).eval()
    theirs.save_pretrained(tmp / "peft_in")
    ckpt = tmp / "imported"
    assert (
        main(["convert", "from-hf", str(hf_in), str(ckpt), "--adapter", str(tmp / "peft_in")]) == 0
    )
    _, ours = load_model(ckpt)
    assert ours.args.lora_targets == ("attention.wk", "mlp.gate", "mlp.up")
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=0, atol=1e-5)
    assert main(["convert", "to-hf", "--adapter", str(ckpt), str(tmp / "peft_out")]) == 0
    before = load_file(tmp / "peft_in" / "adapter_model.safetensors")
    after = load_file(tmp / "peft_out" / "adapter_model.safetensors")
    assert set(before) == set(after)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_peft_option_not_built_is_one_line(trained, capsys):
    tmp, hf_in, _, _, _ = trained
    folder = tmp / "dora"
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    assert main(["convert", "from-hf", str(hf_in), str(tmp / "x"), "--adapter", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "adapter_config.json: use_dora True is not built" in err, err


def test_lora_straight_from_the_hugging_face_folder(trained, capsys):
    """`load` names the Hugging Face folder itself (no convert step): the run trains the same
    adapters as from the converted base, its checkpoints hold the adapters and name the folder
    as their base, and the PEFT export gives the trained logits."""
    import shutil

    from safetensors.torch import load_file, save_file

    from torchneox.checkpoint.files import read_meta, resolve

    tmp, hf_in, _, sft, _ = trained
    seed = tmp / "seed.yml"  # no model keys: the folder's config.json gives them
    seed.write_text("{seed: 1234}")
    folder = tmp / "hf_base_copy"
    shutil.copytree(hf_in, folder)
    direct = run(tmp, "sft-direct", DATA["sft"] | {"lora": LORA}, folder, seed)
    meta = read_meta(resolve(direct))
    assert meta["lora_base"] == str(folder.resolve())
    assert meta["lora_base_fingerprint"].startswith("sampled-sha256:")
    _, from_folder = load_model(direct)
    _, from_converted = load_model(sft)
    for (name, a), b in zip(
        from_folder.state_dict().items(), from_converted.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    adapter = tmp / "adapter-direct"
    assert main(["convert", "to-hf", "--adapter", str(direct), str(adapter)]) == 0
    base_model = transformers.LlamaForCausalLM.from_pretrained(hf_in)
    with_adapter = peft.PeftModel.from_pretrained(base_model, adapter).eval()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(ids).logits, from_folder(ids), rtol=0, atol=1e-5)
    # the folder's weights replaced by another model of the same shape: the adapters refused
    tensors = {k: v * 1.5 for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["convert", "to-hf", "--adapter", str(direct), str(tmp / "replaced")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (
        f"{resolve(direct)}: holds only LoRA adapters, trained on the base weights in "
        f"{folder.resolve()}, which were replaced since" in err
    ), err


def test_a_bf16_base_straight_from_the_folder_trains_as_the_fp32_base(trained):
    """The folder's weights streamed into a base stored in bf16 (lora.base_dtype): under
    bf16 precision the adapters train as with the fp32 base, bit for bit."""
    from tests.helpers import losses
    from torchneox.config.features.lora import is_base_linear

    tmp, hf_in, _, _, _ = trained
    seed = tmp / "seed.yml"
    seed.write_text("{seed: 1234}")
    runs, held = {}, []
    original = Trainer.run

    def keep(self):  # the dtypes the training process holds its weights in
        held.append({n: p.dtype for n, p in self.model.named_parameters()})
        return original(self)

    for dtype in ("fp32", "bf16"):
        keys = DATA["sft"] | {"lora": LORA | {"base_dtype": dtype}, "precision": "bfloat16"}
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Trainer, "run", keep)
            runs[dtype] = run(tmp, f"sft-{dtype}-base", keys, hf_in, seed)
    assert set(held[0].values()) == {torch.float32}
    assert held[1]["layers.0.mlp.up.weight"] == torch.bfloat16
    assert held[1]["layers.0.attention.wq.lora_A.weight"] == torch.float32
    assert held[1]["embed.weight"] == torch.float32
    assert losses(runs["bf16"]) == losses(runs["fp32"])
    _, bf16 = load_model(runs["bf16"])
    _, fp32 = load_model(runs["fp32"])
    # loaded back into fp32: the adapters equal, the base the folder's rounded to bf16, as
    # it trained (load_model's round_stored_base)
    for name, tensor in bf16.state_dict().items():
        expected = fp32.state_dict()[name]
        if is_base_linear(name):
            assert tensor.dtype == torch.float32 and not torch.equal(tensor, expected), name
            expected = expected.bfloat16().float()
        assert torch.equal(tensor, expected), name


def test_save_hf_of_a_lora_run_writes_the_merged_model(trained):
    """`save_hf` at the end of a LoRA run writes what `convert to-hf` writes: the adapters
    merged into the weights, a plain model with the trained logits."""
    tmp, hf_in, _, _, _ = trained
    seed = tmp / "seed.yml"
    seed.write_text("{seed: 1234}")
    out = tmp / "saved-hf"
    keys = DATA["sft"] | {"lora": LORA | {"base_dtype": "bf16"}, "save_hf": str(out)}
    ckpt = run(tmp, "sft-save-hf", keys, hf_in, seed)
    from safetensors.torch import load_file

    assert not any("lora" in k for k in load_file(out / "model.safetensors"))
    _, ours = load_model(ckpt)
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, ours(ids), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def peft_folder(trained):
    """A PEFT adapter of the base (B drawn, not zeros), saved by peft itself."""
    tmp, hf_in, _, _, _ = trained
    folder = tmp / "peft_src"
    if not folder.is_dir():
        config = peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["k_proj"], init_lora_weights=False,
            task_type="CAUSAL_LM",
        )  # fmt: skip
        torch.manual_seed(3)
        peft.get_peft_model(
            transformers.LlamaForCausalLM.from_pretrained(hf_in), config
        ).save_pretrained(folder)
    return folder


def _damaged(folder, kind: str) -> None:
    from safetensors.torch import load_file, save_file

    config, weights = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if kind == "cut-json":
        config.write_text(config.read_text()[:40])
    elif kind == "no-r":
        given = json.loads(config.read_text())
        config.write_text(json.dumps({k: v for k, v in given.items() if k != "r"}))
    elif kind == "cut-safetensors":
        weights.write_bytes(weights.read_bytes()[:20])
    else:
        tensors = load_file(weights)
        name = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
        tensors[name][0, 0] = float("nan")
        save_file(tensors, weights)


PEFT_DAMAGE = [
    ("cut-json", "adapter_config.json: is not valid JSON"),
    ("no-r", "adapter_config.json: has no r (the adapters' rank)"),
    ("cut-safetensors", "adapter_model.safetensors: cannot be read as safetensors"),
    (
        "nan",
        "adapter_model.safetensors: tensor base_model.model.model.layers.1.self_attn.k_proj"
        ".lora_B.weight holds NaN or infinite values",
    ),
]


@pytest.mark.parametrize(("kind", "fragment"), PEFT_DAMAGE, ids=[c[0] for c in PEFT_DAMAGE])
def test_a_damaged_peft_folder_is_one_line_naming_the_file(
    trained, peft_folder, tmp_path, capsys, kind, fragment
):
    import shutil

    _, hf_in, _, _, _ = trained
    folder = tmp_path / "peft"
    shutil.copytree(peft_folder, folder)
    _damaged(folder, kind)
    out = tmp_path / "ckpt"
    assert main(["convert", "from-hf", str(hf_in), str(out), "--adapter", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchneox: error: ") and err.count("\n") == 1, err
    assert fragment in err, err
    assert not out.exists()


def test_a_peft_folder_as_load_is_one_line(trained, peft_folder, capsys):
    tmp, _, _, _, _ = trained
    config = [str(tmp / "model.yml"), str(tmp / "sft.yml")]
    status = main(["train", *config, "--set", f"load={peft_folder}", "--set", "save=null"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert f"{peft_folder} is a PEFT adapter folder, which load does not read" in err, err


def test_an_fp16_adapter_export_refuses_values_past_fp16(trained, peft_folder, tmp_path, capsys):
    """As plain to-hf --dtype fp16 refuses them: no inf written, the tensor named."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, hf_in, _, _, _ = trained
    folder = tmp_path / "peft"
    shutil.copytree(peft_folder, folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"][0, 1] = 1e5
    save_file(tensors, folder / "adapter_model.safetensors")
    ckpt = tmp_path / "ckpt"
    assert main(["convert", "from-hf", str(hf_in), str(ckpt), "--adapter", str(folder)]) == 0
    out = tmp_path / "fp16"
    assert main(["convert", "to-hf", "--adapter", "--dtype", "fp16", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert (
        "--dtype fp16: tensor base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight "
        "holds values up to 100000" in err
    ), err
    assert not out.exists()
    assert main(["convert", "to-hf", "--adapter", "--dtype", "bf16", str(ckpt), str(out)]) == 0
