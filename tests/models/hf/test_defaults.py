"""A Hugging Face folder converts into the model transformers builds from it: transformers'
defaults for the keys config.json leaves out, its precedence between the legacy rope_scaling
and rope_parameters, the head it loads beside tied embeddings; nothing in the folder dropped
without a word."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.interop.test_huggingface import _hf_model
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.models.hf.defaults import DEFAULTS, rope, with_defaults

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", list(DEFAULTS))
def test_the_defaults_are_transformers_config_defaults(arch):
    """Every key torchneox reads, absent from config.json, takes the value transformers'
    config class gives it (the rope base and partial rotary factor included)."""
    conf = getattr(transformers, arch.replace("ForCausalLM", "Config"))()
    ours = with_defaults({}, arch)
    for key, value in DEFAULTS[arch].items():
        # None: derived (one kv head per query head, heads hidden_size / heads wide)
        assert getattr(conf, key) in ((None, ours[key]) if value is None else (ours[key],)), key
    theta, pct, scaling = rope(ours, arch)
    assert scaling is None and conf.rope_parameters["rope_type"] == "default"
    assert theta == conf.rope_parameters["rope_theta"]
    assert pct == conf.rope_parameters.get("partial_rotary_factor", 1.0)


ROPE_KEYS = [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 5e5}, "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 1234.0},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_scaling": {"rope_type": "default"}},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}, "rope_scaling": {}, "rope_theta": 7.0},
    {"rope_parameters": {"rope_type": "default"}, "rope_theta": 1234.0, "rotary_emb_base": 77, "rotary_pct": 0.5},
    {"rope_theta": 1234.0, "partial_rotary_factor": 0.5},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "rotary_pct": 0.75},
]  # fmt: skip


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MixtralForCausalLM", "GPTNeoXForCausalLM"])
@pytest.mark.parametrize("keys", ROPE_KEYS, ids=range(len(ROPE_KEYS)))
def test_rope_keys_are_read_as_transformers_reads_them(arch, keys):
    sizes = {"hidden_size": 64, "num_attention_heads": 4}
    conf = getattr(transformers, arch.replace("ForCausalLM", "Config")).from_dict(
        copy.deepcopy(keys | sizes)
    )
    theta, pct, scaling = rope(with_defaults(keys | sizes, arch), arch)
    expected = conf.rope_parameters
    assert theta == expected["rope_theta"]
    assert pct == expected.get("partial_rotary_factor", 1.0)
    assert (scaling or {"type": "default"})["type"] == expected["rope_type"]
    assert (scaling or {}).get("factor") == expected.get("factor")


def _drop(*names):
    return lambda config: {k: v for k, v in config.items() if k not in names}


EDITS = {
    # OLMo 2's rms_norm_eps is 1e-5 where config.json has none (torchneox's rmsnorm: 1e-6)
    "olmo2-no-eps": ("olmo2", _drop("rms_norm_eps")),
    # a legacy rope_scaling replaces rope_parameters whole, its rope_theta included
    "legacy-rope-scaling": (
        "llama-gqa",
        lambda c: (
            _drop("rope_theta")(c)
            | {
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            }
        ),
    ),
    # Mixtral's rope base is 1e6 where no key gives one
    "mixtral-no-theta": ("mixtral", _drop("rope_parameters", "rope_theta")),
    # GPTNeoX rotates a quarter of each head where no key says
    "pythia-no-rotary-pct": ("sequential-residual", _drop("rope_parameters", "rotary_pct")),
    # no tie_word_embeddings: untied (Llama's default), the stored lm_head is the head
    "llama-no-tie-key": ("llama-gqa", _drop("tie_word_embeddings")),
    # tied, but the folder's lm_head differs from the embedding: transformers loads it
    "tied-with-its-own-head": ("llama-gqa", lambda c: c | {"tie_word_embeddings": True}),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_logits_equal_transformers_where_config_json_leaves_it_to_transformers(
    tmp_path, capsys, name
):
    case, edit = EDITS[name]
    _, folder = _hf_model(tmp_path, case)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(edit(config)))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "ckpt")]) == 0
    _, ours = load_model(tmp_path / "ckpt")
    tokens = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.eval()(tokens), hf_model(tokens).logits, atol=1e-5, rtol=1e-5
        )
    if name == "tied-with-its-own-head":
        err = capsys.readouterr().err
        assert "lm_head.weight differs from the embedding: loaded as its own head" in err, err


def _edit_weights(folder, edit):
    weights = load_file(folder / "model.safetensors")
    save_file(edit(weights), folder / "model.safetensors", metadata={"format": "pt"})


def test_a_head_stored_twice_is_refused_not_one_dropped(tmp_path, capsys):
    _, folder = _hf_model(tmp_path, "pythia-14m")

    # the head under both its names (transformers 5 saves lm_head, older ones embed_out)
    def both(w):
        head = w.get("lm_head.weight", w.get("embed_out.weight"))
        return w | {"embed_out.weight": head.clone(), "lm_head.weight": head.clone()}

    _edit_weights(folder, both)
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "are both the model's output.weight" in err, err
    assert not (tmp_path / "out").exists()


def test_an_untied_folder_without_a_head_is_refused(tmp_path, capsys):
    """transformers would draw the head at random: refused, naming the key to set."""
    _, folder = _hf_model(tmp_path, "llama-gqa")
    _edit_weights(folder, lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"})
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no output head (lm_head.weight)" in err, err
    assert "tie_word_embeddings" in err and not (tmp_path / "out").exists()


def test_skipped_rotary_buffers_are_listed(tmp_path, capsys):
    _, folder = _hf_model(tmp_path, "llama-gqa")
    inv_freq = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit_weights(folder, lambda w: w | {inv_freq: torch.ones(8)})
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 0
    assert f"skipped 1 buffers that torchneox recomputes, as transformers does ({inv_freq}" in (
        capsys.readouterr().err
    )


def test_a_pythia_folder_without_its_head_names_embed_out(tmp_path, capsys):
    _, folder = _hf_model(tmp_path, "pythia-14m")
    heads = ("lm_head.weight", "embed_out.weight")
    _edit_weights(folder, lambda w: {k: v for k, v in w.items() if k not in heads})
    config = json.loads((folder / "config.json").read_text()) | {"tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["convert", "from-hf", str(folder), str(tmp_path / "out")]) == 2
    assert "no output head (embed_out.weight)" in capsys.readouterr().err


@pytest.mark.parametrize("verb", ["from-hf", "generate"])
def test_a_folder_with_nan_weights_is_refused_naming_the_tensor(tmp_path, capsys, verb):
    """It used to convert, or generate garbage with exit 0."""
    _, folder = _hf_model(tmp_path, "llama-gqa")
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_weights(folder, lambda w: w | {name: torch.full_like(w[name], float("nan"))})
    capsys.readouterr()
    argv = {
        "from-hf": ["convert", "from-hf", str(folder), str(tmp_path / "out")],
        "generate": ["generate", "--hf", str(folder), "--prompt", "the", "--device", "cpu"],
    }[verb]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{folder}: tensor {name} holds NaN or infinite values" in err, err
    assert not (tmp_path / "out").exists()
