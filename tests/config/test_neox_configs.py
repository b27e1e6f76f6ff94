"""GPT-NeoX's own configs, and the seed report's, read as they are."""

from __future__ import annotations

import re

import pytest

from tests.conftest import shared_dir
from tests.helpers import seed_config
from torchneox.base.errors import ConfigError
from torchneox.config.derive import derive
from torchneox.config.fields import Status
from torchneox.config.load import load_config, load_mapping, read_file
from torchneox.config.schema import KEYS, NeoXConfig

SHARED = shared_dir()
CONFIG_DIR = SHARED / "neox_configs" if SHARED else None
ALL_CONFIGS = (
    sorted(p.relative_to(CONFIG_DIR).as_posix() for p in CONFIG_DIR.rglob("*.yml"))
    if CONFIG_DIR
    else []
)

# The shipped configs that ask for something torchneox does not build, and the line it says.
REFUSED: dict[str, tuple[str, str]] = {}

needs_shared = pytest.mark.skipif(SHARED is None, reason="../shared is not on this machine")


@needs_shared
@pytest.mark.parametrize("name", ALL_CONFIGS)
@pytest.mark.parametrize("with_local_setup", [False, True])
def test_every_neox_config_explains_or_names_the_unsupported_feature(name, with_local_setup):
    files = [CONFIG_DIR / name]
    if with_local_setup and name != "local_setup.yml":
        files.append(CONFIG_DIR / "local_setup.yml")
    shared_keys = set.intersection(*(set(read_file(f)) for f in files)) if len(files) > 1 else set()
    if shared_keys:
        # local_setup_wandb.yml and prof.yml set keys local_setup.yml sets too: GPT-NeoX refuses
        # such a pair, and so does torchneox, naming both files
        with pytest.raises(ConfigError, match=rf"given in both .*{name} and .*local_setup.yml"):
            load_config(files)
        return
    if name in REFUSED:
        key, message = REFUSED[name]
        with pytest.raises(ConfigError) as err:
            load_config(files)
        assert err.value.key == key
        assert message in str(err.value)
        assert "\n" not in str(err.value)
        return
    derived = derive(load_config(files))
    assert derived["world_size"] >= 1
    assert derived["pipeline_schedule_runs"] is False  # none of these configs has pp >= 2


def neox_keys() -> list[list[str]]:
    """The rows (key, group, type, default) of every config key of GPT-NeoX's newest commit."""
    lines = (CONFIG_DIR / "neox_keys_ea7aefd.tsv").read_text().splitlines()
    rows = [line.split("\t") for line in lines if line and not line.startswith("#")]
    assert rows[0] == ["key", "group", "type", "default"]
    return rows[1:]


@needs_shared
def test_every_key_of_the_newest_neox_has_a_status_here():
    rows = neox_keys()
    assert (
        len({name for name, *_ in rows}) == 318
    )  # two keys are listed twice (two groups declare them)
    unknown = [name for name, *_ in rows if name not in KEYS]
    assert unknown == []
    # a GPT-NeoX key is never a torchneox extension, and each one that does nothing says why
    for name, *_ in rows:
        info = KEYS[name].info
        assert info.status is not Status.EXTENSION, name
        if info.status in (Status.NO_EFFECT, Status.UNSUPPORTED):
            assert info.why, name


@needs_shared
def test_the_schema_defaults_are_the_newest_neox_defaults():
    import ast

    config = NeoXConfig()
    differ = {}
    for name, _, _, default in neox_keys():
        try:
            theirs = ast.literal_eval(default)
        except (ValueError, SyntaxError):
            continue  # computed at launch (git_hash)
        if config.get(name) != theirs:
            differ[name] = (theirs, config.get(name))
    assert differ == {}


@needs_shared
@pytest.mark.parametrize(
    "name",
    [
        "train_impl",
        "pack_impl",
        "dataset_impl",
        "te_fp8_format",
        "kl_impl",
        "precision",
        "norm",
        "activation",
        "pos_emb",
    ],
)
def test_every_choice_of_a_neox_key_is_known(name):
    """Each value GPT-NeoX's Literal type allows is accepted or refused by name, never 'not one
    of' the choices."""
    (row,) = [r for r in neox_keys() if r[0] == name]
    choices = re.findall(r"'([^']+)'", row[2])
    assert choices
    for choice in choices:
        try:
            load_mapping({name: choice}, "x.yml")
        except ConfigError as e:
            assert "is not one of" not in str(e), (name, choice, str(e))


@needs_shared
def test_seed_config_runs_one_stage_without_a_pipeline_schedule(tmp_path):
    derived = derive(load_config([seed_config(tmp_path)]))
    assert derived["pipe_parallel_size"] == 1
    assert derived["pipeline_stages"] == 1
    assert derived["pipeline_schedule_runs"] is False
    assert derived["pipeline_schedule"] is None
    reason = derived.reasons["pipeline_schedule_runs"]
    assert "one stage" in reason and "no pipeline schedule" in reason and "PipelineEngine" in reason
    # model_parallel_size 2 and no world size given: the smallest world that fits
    assert derived["world_size"] == 2
    assert derived["data_parallel_size"] == 1
    assert derived["train_batch_size"] == 4
    assert derived["precision"] == "bfloat16"
    assert derived["num_active_parameters"] < derived["num_parameters"]  # 8 experts, top-1


@needs_shared
def test_pythia_parameter_counts_match_the_published_models():
    # Total parameters of the Hugging Face Pythia checkpoints (untied head, vocabulary 50304).
    published = {
        "pythia/70M.yml": 70_426_624,
        "pythia/160M.yml": 162_322_944,
        "pythia/410M.yml": 405_334_016,
        "pythia/1B.yml": 1_011_781_632,
    }
    for name, total in published.items():
        assert derive(load_config([CONFIG_DIR / name]))["num_parameters"] == total, name


@needs_shared
def test_llama_7b_mlp_width_follows_neox_gated_sizing():
    derived = derive(load_config([CONFIG_DIR / "llama/7B.yml"], ["padded_vocab_size=32000"]))
    assert derived["mlp_width"] == 11008
    assert derived["num_parameters"] == 6_738_415_616  # LLaMA-7B
