"""Every refusal of a feature beside a layout or beside another feature, with its reason.

``FEATURES`` names what switches each feature on, on top of ``BASE`` (a small model on which
every feature runs alone); ``LAYOUTS`` names the layouts, each its config keys and world size.
``REFUSALS`` lists each pair that does not run and why. The checks that refuse a pair take
their reason from here (``refusal``), so the table in docs/parallelism.md (``markdown``,
printed by ``torchneox config refusals --markdown``) and the one-line error cannot drift
apart; tests/config/test_refusals.py runs every feature in every layout and every pair of
features, and fails on a refusal that is not in the table or a line of the table that is not
refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BASE: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 32,
    "max_position_embeddings": 32,
    "no_weight_tying": True,
    "pos_emb": "rotary",
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "train_iters": 4,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
}
"""The model every feature is switched on in: untied, rotary, four layers, world size 1."""

_MIX = "attention_config"
_PAIRS = {"dataset_impl": "pairwise", "pack_impl": "unpacked"}
_PAIR_DATA = {"pos_train_data_paths": ["pos"], "neg_train_data_paths": ["neg"]}
_LABELS = {"pos_train_label_data_paths": ["pos_l"], "neg_train_label_data_paths": ["neg_l"]}

FEATURES: dict[str, dict[str, Any]] = {
    "tied embeddings": {"no_weight_tying": False},
    "qk layernorm": {"use_qk_layernorm": True},
    "z-loss": {"lm_z_loss": 0.01},
    "eod mask": {"eod_mask_loss": True},
    "document masking": {"inter_document_attention_masking": True},
    "rpe": {"pos_emb": "rpe"},
    "alibi": {"pos_emb": "alibi"},
    "learned positions": {"pos_emb": "learned"},
    "sinusoidal positions": {"pos_emb": "sinusoidal"},
    "mamba": {_MIX: [[["mamba", "global"], 2]]},
    "rwkv": {_MIX: [[["rwkv", "global"], 2]]},
    "gmlp": {_MIX: [[["gmlp", "global"], 2]]},
    "amlp": {_MIX: [[["amlp", "global"], 2]]},
    "sparse attention": {_MIX: [[["local", "global"], 2]], "sparsity_config": {"block": 8}},
    "moe": {"moe_num_experts": 4, "moe_top_k": 2},
    "moe shared expert": {
        "moe_num_experts": 4,
        "moe_router_type": "topk",
        "moe_shared_expert_intermediate_size": 64,
        "moe_router_bias_update_rate": 0.001,
    },
    "mtp": {"mtp_num_layers": 2},  # (two modules: one runs where two are refused)
    "mla": {"mla_kv_lora_rank": 16, "mla_qk_nope_head_dim": 8, "mla_qk_rope_head_dim": 8},
    "lora": {"lora": {"rank": 4, "target_modules": ["q_proj", "o_proj", "up_proj"]}},
    "soft prompt": {"soft_prompt_tuning": {"enabled": True, "n_tokens": 4}},
    "mup": {"use_mup": True, "base_shapes_file": "base.yml", "save_base_shapes": True},
    "shared layers": {"num_unique_layers": 2},
    "fp8": {"fp8_recipe": "tensorwise"},
    "8-bit adam": {"use_bnb_optimizer": True},
    "offload": {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}},
    "curriculum": {
        "curriculum_learning": {
            "enabled": True,
            "curriculum_type": "seqlen",
            "min_difficulty": 16,
            "max_difficulty": 32,
            "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 8},
        }
    },
    "sft": {
        "pack_impl": "unpacked",
        "train_data_paths": ["t"],
        "train_label_data_paths": ["t_l"],
    },
    "dpo": {"train_impl": "dpo", **_PAIRS, **_PAIR_DATA},
    "kto": {
        "train_impl": "kto",
        "pack_impl": "unpacked",
        "train_data_paths": ["t"],
        "train_reward_data_paths": ["r"],
    },
    "rm": {"train_impl": "rm", **_PAIRS, **_PAIR_DATA, **_LABELS},
    "reinforce": {
        "train_impl": "reinforce",
        "rollout_prompts": "p.jsonl",
        "reward_function": "r:f",
        "rollout_max_new_tokens": 8,
    },
    "eval tasks": {"eval_tasks": ["lambada_openai"], "eval_interval": 2},
    "replica groups": {"ft_lighthouse": "http://h:29510", "ft_replica_groups": 2},
    "whole-model compile": {"compile": True, "compile_scope": "model"},
}
"""Each feature's keys: set on ``BASE``, it runs in one process."""

_PP = {"pipe_parallel_size": 2}
_TP = {"model_parallel_size": 2}
_EP = {"moe_num_experts": 4, "expert_parallel_size": 2}
_HYBRID = {"zero_optimization": {"stage": 3, "mics_shard_size": 2}}


@dataclass(frozen=True)
class LayoutCase:
    world: int
    keys: dict[str, Any]
    parts: tuple[str, ...] = ()
    """The simpler layouts this one holds: a refusal beside one of them holds here too."""


LAYOUTS: dict[str, LayoutCase] = {
    "tp2": LayoutCase(2, _TP),
    "tp2 sp": LayoutCase(2, _TP | {"sequence_parallel": True}, ("tp2",)),
    "pp2": LayoutCase(2, _PP),
    "pp2 interleaved": LayoutCase(2, _PP | {"pipeline_schedule": "interleaved_1f1b"}, ("pp2",)),
    "pp2 zbv": LayoutCase(2, _PP | {"pipeline_schedule": "zbv"}, ("pp2",)),
    "tp2 sp pp2": LayoutCase(4, _TP | _PP | {"sequence_parallel": True}, ("tp2 sp", "pp2")),
    "cp2": LayoutCase(2, {"context_parallel_size": 2}),
    "pp2 cp2": LayoutCase(4, _PP | {"context_parallel_size": 2}, ("pp2", "cp2")),
    "ep2": LayoutCase(2, _EP),
    "zero1": LayoutCase(2, {"zero_optimization": {"stage": 1}}),
    "zero3": LayoutCase(2, {"zero_optimization": {"stage": 3}}),
    "hybrid sharding": LayoutCase(4, _HYBRID, ("zero3",)),
    "hybrid sharding ep2": LayoutCase(4, _HYBRID | _EP, ("hybrid sharding", "ep2")),
    "hybrid sharding cp2": LayoutCase(
        8, _HYBRID | {"context_parallel_size": 2}, ("hybrid sharding", "cp2")
    ),
}
"""Each layout: its world size and keys (expert parallelism with an MoE model)."""


@dataclass(frozen=True)
class Refusal:
    feature: str
    """A feature of FEATURES (or a layout of LAYOUTS, refused beside another layout)."""
    beside: str
    """A layout of LAYOUTS or a feature of FEATURES; or several, joined by ' + '."""
    reason: str
    """Why the pair does not run: what it cannot do and because of what, or plainly that it
    is unbuilt."""


def _each(feature: str, besides: tuple[str, ...], reason: str) -> tuple[Refusal, ...]:
    return tuple(Refusal(feature, beside, reason) for beside in besides)


OBJECTIVES = ("dpo", "kto", "rm", "reinforce")
"""The post-training objectives that are not language modelling (train_impl)."""
SEQUENTIAL = ("mamba", "rwkv", "gmlp", "amlp")
"""The layer families that read the whole sequence in order."""
_ONE_GRAPH = "cannot compile the whole model as one graph, because this layout splits or "
_ONE_GRAPH += "wraps it below its top level"
_ROTARY = "cannot take these positions, because MLA's keys are rotary"
_MTP_LM = "cannot run, because multi-token prediction is a term of language modelling's loss"

REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "mtp",
        "pp2 zbv",
        "cannot run two or more modules (or one beside tied embeddings) under zbv or "
        "interleaved_zero_bubble, because these split a stage's backward into input and weight "
        "halves and the embedding reaches the loss through every depth (and through the tied "
        "head after it): torch's weight half would run back through the first use's freed graph",
    ),
    Refusal(
        "reinforce",
        "tp2 sp",
        "cannot sample rollouts in the run with sequence parallelism, because a decode step's "
        "one token cannot be split by positions",
    ),
    *_each("whole-model compile", ("tp2", "pp2", "cp2", "ep2", "zero1", "zero3"), _ONE_GRAPH),
    Refusal("qk layernorm", "mla", "cannot apply, because MLA's latents have their own RMSNorms"),
    Refusal("mup", "mla", "cannot apply, because MLA scales its softmax its own way (DeepSeek's)"),
    *_each("mla", ("rpe", "alibi", "learned positions", "sinusoidal positions"), _ROTARY),
    *_each(
        "document masking",
        ("gmlp", "amlp"),
        "cannot apply, because the spatial gating mixes the positions of the whole sample "
        "(as GPT-NeoX's)",
    ),
    Refusal(
        "document masking",
        "soft prompt",
        "cannot apply, because the prompt would belong to the first document only",
    ),
    Refusal(
        "mtp", "soft prompt", "cannot train, because soft prompt tuning freezes the MTP layers"
    ),
    *_each("mtp", OBJECTIVES, _MTP_LM),
    *(
        Refusal(
            "soft prompt",
            f"lora + {impl}",
            "cannot keep the reference's prompt, because LoRA's reference is the policy with "
            "its adapters off, which carries the prompt as it trains",
        )
        for impl in ("dpo", "kto", "reinforce")
    ),
    Refusal(
        "curriculum",
        "rm",
        "cannot cut a pair shorter, because a reward model reads each sample's value at its "
        "one labelled position, the answer's end, which the cut takes off",
    ),
    Refusal(
        "curriculum",
        "reinforce",
        "cannot cut a rollout shorter, because each completion's reward and advantage are for "
        "the whole completion sampled, not for the part a shorter length keeps",
    ),
    Refusal(
        "8-bit adam",
        "mup",
        "is not run, because GPT-NeoX runs muP's 32-bit MuAdam and drops use_bnb_optimizer "
        "without a word, and an 8-bit MuAdam would compute something else: which one is meant "
        "must be said",
    ),
)
"""Every pair that does not run, in the order of the table."""

_BY_PAIR = {(r.feature, r.beside): r for r in REFUSALS}
_BY_PAIR |= {(r.beside, r.feature): r for r in REFUSALS}


def refusal(feature: str, beside: str) -> str:
    """The table's reason ``feature`` does not run beside ``beside`` (either way round)."""
    return _BY_PAIR[feature, beside].reason


def merged(*parts: dict[str, Any]) -> dict[str, Any]:
    """Config mappings merged, dicts key by key (a layout's ZeRO stage beside offload's)."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                value = merged(out[key], value)
            out[key] = value
    return out


def keys_of(name: str) -> dict[str, Any]:
    """The config keys of a feature, a layout, or several joined by ' + '."""
    parts = [FEATURES.get(n) or LAYOUTS[n].keys for n in name.split(" + ")]
    return merged(*parts)


def _keys(name: str) -> str:
    """``key: value`` for a plain value, the key alone for a mapping or a list."""
    shown = [
        f"`{k}: {str(v).lower() if isinstance(v, bool) else v}`"
        if isinstance(v, str | int | float)
        else f"`{k}`"
        for k, v in keys_of(name).items()
    ]
    return ", ".join(shown)


def markdown() -> str:
    """The table of docs/parallelism.md: each refused pair, the keys of each side, the reason."""
    lines = ["| feature | beside | why it does not run |", "|---|---|---|"]
    for r in REFUSALS:
        lines.append(
            f"| {r.feature} ({_keys(r.feature)}) | {r.beside} ({_keys(r.beside)}) | {r.reason} |"
        )
    return "\n".join(lines) + "\n"
