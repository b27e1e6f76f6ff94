"""Keys a config sets that other runs read and this one does not: another objective's keys
(REINFORCE's rollout keys in an SFT run, KTO's document rewards in a DPO run), the rollout
source's that the other source reads (a reward_function beside a data server that sends the
rewards), a key whose switch is off (clip_ratio with one step per rollout batch).

Each is a no-effect key (``config explain`` lists it under "Accepted, no effect here") and a
warning line at the start of ``train`` (``Derived.unused``): loaded and ignored, never silently.
A key left at its default, or set to null, is not named.
"""

from __future__ import annotations

from dataclasses import fields

from torchneox.config.derived import Derived
from torchneox.config.features.eight_bit import eight_bit
from torchneox.config.features.optimizer import optimizer_spec
from torchneox.config.fields import Status
from torchneox.config.keys.rl import RolloutConfig
from torchneox.config.load import DATA_PATH_KEYS, LoadedConfig
from torchneox.config.schema import KEYS

ROLLOUT_KEYS = tuple(f.name for f in fields(RolloutConfig))
SERVER_KEYS = ("online_dataserver_ips", "online_dataserver_ports", "online_dataserver_timeout")
SAMPLING_KEYS = (
    "rollout_generations",
    "rollout_max_new_tokens",
    "rollout_temperature",
    "rollout_top_p",
    "rollout_top_k",
    "reward_function",
    "reward_model",
)
REWARD_PATHS = tuple(f"{split}_reward_data_paths" for split in ("train", "valid", "test"))


def unread_keys(loaded: LoadedConfig, out: Derived) -> None:
    """Put each key the config sets and this run does not read into ``out.unused`` and
    ``out.no_effect``, with why."""
    cfg = loaded.config
    impl = cfg.training.train_impl
    why: dict[str, str] = {}
    if impl != "kto":
        why |= dict.fromkeys(REWARD_PATHS, f"only kto reads document rewards, not {impl}")
    for objective in ("dpo", "kto"):
        if impl != objective:
            named = [n for n in KEYS if n.startswith(f"{objective}_")]
            why |= dict.fromkeys(named, f"a {objective} key; train_impl {impl} does not read it")
    if impl != "reinforce":
        why |= dict.fromkeys(ROLLOUT_KEYS, f"a reinforce key; train_impl {impl} does not read it")
    else:
        why |= _reinforce(loaded)
    why |= _switched_off(loaded)
    for name, reason in why.items():
        spec = KEYS[name]
        if spec.info.status is Status.NO_EFFECT or not loaded.given(name):
            continue  # listed with its own reason
        value = cfg.get(name)
        if value is not None and value != spec.default:
            out.unused[name] = reason
            out.no_effect[name] = reason


def _reinforce(loaded: LoadedConfig) -> dict[str, str]:
    r = loaded.config.rollout
    why = dict.fromkeys(
        (*DATA_PATH_KEYS, "data_path"), "reinforce trains on rollouts; no dataset is read"
    )
    if r.rollout_prompts:
        sampled = "rollouts are sampled in the run (rollout_prompts); no data server is asked"
        why |= dict.fromkeys((*SERVER_KEYS, "dataset_impl"), sampled)
    else:
        served = "the data servers sample the rollouts and send their rewards (no rollout_prompts)"
        why |= dict.fromkeys(SAMPLING_KEYS, served)
    if r.rollout_updates == 1:
        why["clip_ratio"] = "rollout_updates is 1: no importance ratio is clipped"
    if r.kl_div_beta == 0:
        why["kl_impl"] = "kl_div_beta is 0: no KL penalty"
    return why


def _switched_off(loaded: LoadedConfig) -> dict[str, str]:
    """Keys whose feature another key leaves off: muP's one-off runs without use_mup, 8-bit
    state with an optimizer other than Adam (GPT-NeoX swaps only Adam)."""
    cfg, why = loaded.config, {}
    if not cfg.training.use_mup:
        off = "use_mup is off: muP's one-off runs do not run"
        why |= dict.fromkeys(("coord_check", "save_base_shapes"), off)
    if cfg.optimizer.use_bnb_optimizer and not eight_bit(cfg.optimizer):
        kind = optimizer_spec(cfg.optimizer).kind
        why["use_bnb_optimizer"] = (
            f"8-bit state is Adam's (as GPT-NeoX swaps only Adam); {kind} keeps its own"
        )
    return why
