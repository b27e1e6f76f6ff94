"""Keys other runs read and this one does not (another objective's, the other rollout source's,
a switched-off feature's) are named as having no effect here, with why: config explain lists
them, train warns of each at start-up (tests/train/rl/test_reinforce_run.py)."""

from __future__ import annotations

import pytest

from torchneox.config.derive import derive
from torchneox.config.load import load_mapping

MODEL = {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 2, "seq_length": 16}
REINFORCE = MODEL | {"train_impl": "reinforce", "tokenizer_type": "CharLevelTokenizer"}
SAMPLED = REINFORCE | {
    "rollout_prompts": "p.jsonl",
    "reward_function": "r.py:f",
    "rollout_max_new_tokens": 8,
}
SERVED = REINFORCE | {"dataset_impl": "online"}
DPO = MODEL | {"train_impl": "dpo", "dataset_impl": "pairwise", "pack_impl": "unpacked"}

NOT_REINFORCE = "a reinforce key; train_impl normal does not read it"
SERVER = "the data servers sample the rollouts and send their rewards (no rollout_prompts)"
IN_RUN = "rollouts are sampled in the run (rollout_prompts); no data server is asked"


@pytest.mark.parametrize(
    ("config", "unused"),
    [
        (  # rollout keys in a run that is not reinforce (an SFT run)
            MODEL | {"rollout_prompts": "p.jsonl", "rollout_temperature": 0.7, "kl_div_beta": 0.2},
            {"rollout_prompts": NOT_REINFORCE, "rollout_temperature": NOT_REINFORCE,
             "kl_div_beta": NOT_REINFORCE},
        ),
        (  # a reward function and sampling keys beside the data server that sends the rewards
            SERVED | {"reward_function": "r.py:f", "rollout_max_new_tokens": 8},
            {"reward_function": SERVER, "rollout_max_new_tokens": SERVER},
        ),
        (  # a data server's keys beside rollouts sampled in the run
            SAMPLED | {"dataset_impl": "online", "online_dataserver_ports": 10001},
            {"dataset_impl": IN_RUN, "online_dataserver_ports": IN_RUN},
        ),
        (  # datasets, a clip with one step per batch, a KL form with no KL penalty
            SAMPLED | {"train_data_paths": ["d"], "clip_ratio": 0.3, "kl_div_beta": 0.0,
                       "kl_impl": "abs"},
            {"train_data_paths": "reinforce trains on rollouts; no dataset is read",
             "clip_ratio": "rollout_updates is 1: no importance ratio is clipped",
             "kl_impl": "kl_div_beta is 0: no KL penalty"},
        ),
        (  # another objective's keys: KTO's document rewards and beta in a DPO run
            DPO | {"train_reward_data_paths": ["r"], "kto_beta": 0.3, "dpo_beta": 0.2},
            {"train_reward_data_paths": "only kto reads document rewards, not dpo",
             "kto_beta": "a kto key; train_impl dpo does not read it"},
        ),
        (  # muP's one-off runs without use_mup; 8-bit state with an optimizer not Adam
            MODEL | {"coord_check": True, "use_bnb_optimizer": True,
                     "optimizer": {"type": "sgd", "params": {"lr": 0.01}}},
            {"coord_check": "use_mup is off: muP's one-off runs do not run",
             "use_bnb_optimizer": "8-bit state is Adam's (as GPT-NeoX swaps only Adam); sgd "
                                  "keeps its own"},
        ),
        (  # what a run reads, or a key at its default or null: nothing
            SAMPLED | {"rollout_updates": 2, "clip_ratio": 0.3, "rollout_temperature": 1.0,
                       "reward_model": None},
            {},
        ),
    ],
    ids=["sft", "served", "sampled", "switched off", "dpo", "muP and 8-bit off", "read"],
)  # fmt: skip
def test_keys_this_run_does_not_read_are_named_with_why(config, unused):
    d = derive(load_mapping(config, "run.yml"))
    assert d.unused == unused
    assert {k: d.no_effect[k] for k in unused} == unused  # explain lists them
