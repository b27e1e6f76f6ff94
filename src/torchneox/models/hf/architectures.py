"""Hugging Face interop: configs of GPTNeoX, Llama, Mistral, Qwen2/3, OLMo 2, Mixtral, Mamba and
the MoE families of models/hf/moe_families.py (Qwen2-MoE, Qwen3-MoE, OLMoE) and DeepSeek-V3
(models/hf/deepseek.py) as
GPT-NeoX keys and back, and the weight files of a local folder (models/hf/weights.py maps the
tensors' names).

Works from local folders only (config.json + safetensors or pytorch_model.bin) and does not
need the transformers package. What a model computes that no mapping expresses is refused in
one line naming it, never converted into a model that computes something else.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import ConfigError, HFError, first_line
from torchneox.config.features.sparsity import SPARSE_TYPES
from torchneox.models.args import ModelArgs
from torchneox.models.hf import deepseek
from torchneox.models.hf import mamba as hf_mamba
from torchneox.models.hf import moe_families as moe
from torchneox.models.hf.defaults import DEFAULTS, rope, with_defaults

ARCHITECTURES = (
    "GPTNeoXForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Olmo2ForCausalLM",
    "MixtralForCausalLM",
    *moe.FAMILIES,
    deepseek.DEEPSEEK_V3,
    hf_mamba.MAMBA,
)
# Hugging Face hidden_act -> GPT-NeoX config keys. The tanh gelus (gelu_new, gelu_fast,
# gelu_pytorch_tanh: the same function) are GPT-NeoX's gelu under bias_gelu_fusion.
HF_ACTIVATIONS: dict[str, dict[str, Any]] = {
    "gelu": {"activation": "gelu"},
    "gelu_new": {"activation": "gelu", "bias_gelu_fusion": True},
    "gelu_fast": {"activation": "gelu", "bias_gelu_fusion": True},
    "gelu_pytorch_tanh": {"activation": "gelu", "bias_gelu_fusion": True},
    "relu": {"activation": "relu"},
    "silu": {"activation": "silu"},
    "mish": {"activation": "mish"},
}
# ModelArgs.activation -> the hidden_act that computes it in transformers
TO_HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_tanh": "gelu_new",
    "relu": "relu",
    "silu": "silu",
    "mish": "mish",
}


# ---------------------------------------------------------------------------- reading


ARCHITECTURE_OF_TYPE = {
    "gpt_neox": "GPTNeoXForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "mamba": hf_mamba.MAMBA,
    **{kind: arch for arch, kind in moe.MODEL_TYPES.items()},
    deepseek.MODEL_TYPE: deepseek.DEEPSEEK_V3,
}
"""config.json's model_type -> the causal LM transformers' AutoModelForCausalLM builds of it."""
_SAID_BOTH: set[Path] = set()


def read_config(folder: Path) -> dict[str, Any]:
    """A folder's config.json; one without ``architectures`` names its architecture by
    ``model_type``, as transformers' AutoModelForCausalLM reads it."""
    path = folder / "config.json"
    if not path.is_file():
        raise HFError("no config.json: not a Hugging Face model folder", source=str(folder))
    try:
        config = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise HFError(
            f"config.json is not valid JSON ({first_line(e)})", source=str(folder)
        ) from None
    if not isinstance(config, dict):
        raise HFError("config.json is not a JSON object", source=str(folder))
    if not config.get("architectures") and config.get("model_type") in ARCHITECTURE_OF_TYPE:
        config["architectures"] = [ARCHITECTURE_OF_TYPE[config["model_type"]]]
    return config


def weight_files(folder: Path) -> list[Path]:
    """The files holding a local HF folder's tensors: model.safetensors, the shards its index
    names, or pytorch_model*.bin."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        if index.is_file() and folder.resolve() not in _SAID_BOTH:
            _SAID_BOTH.add(folder.resolve())
            print(
                f"{folder}: holds model.safetensors and a sharded model.safetensors.index.json: "
                "reading model.safetensors, as transformers does (remove the other to be sure)",
                file=sys.stderr,
            )
        return [single]
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, TypeError):
            raise HFError("is not a safetensors index (no weight_map)", source=str(index)) from None
        return [folder / name for name in names]
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        return bins
    raise HFError("no model.safetensors or pytorch_model.bin found", source=str(folder))


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """One weight file's tensors, read one at a time (safetensors) or memory-mapped (.bin):
    a shard is never held whole beside what it is converted into."""
    if path.suffix == ".bin":
        try:
            tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            raise HFError("is missing (the index names it)", source=str(path)) from None
        except Exception as e:
            raise HFError(
                f"cannot be read as torch weights ({first_line(e)})", source=str(path)
            ) from None
        yield from tensors.items()
        return
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)
    except FileNotFoundError:
        raise HFError("is missing (the index names it)", source=str(path)) from None
    except HFError:
        raise
    except Exception as e:  # a truncated or foreign file
        raise HFError(
            f"cannot be read as safetensors ({first_line(e)}); is it truncated? download it again",
            source=str(path),
        ) from None


def neox_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """A GPT-NeoX-style config (flat keys) describing the same model as the HF config."""
    named = (hf.get("architectures") or [None])[0]
    arch = causal_family(named) if isinstance(named, str) else named
    if arch not in ARCHITECTURES:
        raise HFError(
            f"architecture {named!r} is not supported; torchneox reads {', '.join(ARCHITECTURES)}"
            " (and their ForSequenceClassification reward models)",
            key="architectures",
        )
    reward = _reward_model_keys(hf, named)
    if arch == hf_mamba.MAMBA:
        return hf_mamba.neox_keys(hf) | reward
    hf = with_defaults(hf, arch)  # what transformers assumes where config.json says nothing
    theta, pct, scaling = rope(hf, arch)
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    context = hf["max_position_embeddings"]
    cfg: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": h,
        "num_attention_heads": heads,
        "seq_length": context,
        "max_position_embeddings": context,
        "pos_emb": "rotary",
        "rotary_pct": pct,
        "rotary_emb_base": int(theta) if float(theta).is_integer() else theta,
        "no_weight_tying": not hf["tie_word_embeddings"],
        "padded_vocab_size": hf["vocab_size"],
        "make_vocab_size_divisible_by": 1,
        "attention_dropout": float(hf["attention_dropout"]),
    }
    if hf.get("head_dim") not in (None, h // heads) and arch != deepseek.DEEPSEEK_V3:
        if arch == "GPTNeoXForCausalLM":
            raise HFError(
                f"head_dim {hf['head_dim']} differs from hidden_size / heads", key="head_dim"
            )
        cfg["head_dim"] = hf["head_dim"]
    if scaling is not None:
        cfg["rope_scaling"] = scaling
        if scaling["type"] == "dynamic":  # positions reach factor x the original context
            cfg["max_position_embeddings"] = int(context * scaling["factor"])
    _full_attention_only(hf)
    act = hf["hidden_act"]
    if arch == "GPTNeoXForCausalLM":
        cfg.update(_gpt_neox_keys(hf, act))
    else:
        cfg.update(_llama_family_keys(hf, arch, act))
    return cfg | reward


def _reward_model_keys(hf: dict[str, Any], named: Any) -> dict[str, Any]:
    """A *ForSequenceClassification with one score: a reward model (train_impl rm, its
    value head the score)."""
    if not (isinstance(named, str) and named.endswith(SEQUENCE_CLASSIFICATION)):
        return {}
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if labels != 1:
        raise HFError(
            f"{named} with num_labels {labels} is a classifier, not a reward model (one score); "
            "torchneox reads reward models",
            key="num_labels",
        )
    return {"train_impl": "rm", "dataset_impl": "pairwise", "pack_impl": "unpacked"}


def _full_attention_only(hf: dict[str, Any]) -> None:
    kinds = set(hf.get("layer_types") or ["full_attention"])
    if kinds - {"full_attention"}:
        raise HFError(
            f"layer_types {sorted(kinds)}: per-layer attention kinds are not mapped (torchneox "
            "gives every layer the same attention)",
            key="layer_types",
        )


def _gpt_neox_keys(hf: dict[str, Any], act: str) -> dict[str, Any]:
    """GPTNeoXForCausalLM: layernorm, a plain MLP, parallel residual, biases."""
    if act not in HF_ACTIVATIONS:
        raise HFError(f"hidden_act {act!r} is not supported", key="hidden_act")
    if hf["intermediate_size"] % 2:
        raise HFError(
            "an odd intermediate_size cannot be expressed in GPT-NeoX terms",
            key="intermediate_size",
        )
    return HF_ACTIVATIONS[act] | {
        "norm": "layernorm",
        "layernorm_epsilon": hf["layer_norm_eps"],
        "intermediate_size": hf["intermediate_size"],
        "mlp_multiple_of": 1,
        "gpt_j_residual": hf["use_parallel_residual"],
        "use_bias_in_attn_linear": hf["attention_bias"],
        "hidden_dropout": float(hf["hidden_dropout"]),
    }


def _llama_family_keys(hf: dict[str, Any], arch: str, act: str) -> dict[str, Any]:
    """Llama, Mistral, Qwen2/3, OLMo 2 and Mixtral: rmsnorm, SwiGLU, sequential residual,
    GQA; Qwen2's q/k/v biases, Qwen3's and OLMo 2's query/key norms, OLMo 2's post-norm,
    Mistral's sliding window, Mixtral's experts."""
    if act != "silu":
        raise HFError(f"hidden_act {act!r} is not supported for {arch}", key="hidden_act")
    width = hf["intermediate_size"]
    # attention_bias and mlp_bias where the architecture reads them (hf_defaults.DEFAULTS
    # has them then); elsewhere its layers have none, whatever config.json says
    bias = bool(hf.get("attention_bias", False)) if "attention_bias" in DEFAULTS[arch] else False
    keys = {
        "norm": "rmsnorm",
        "rms_norm_epsilon": hf["rms_norm_eps"],
        "activation": "swiglu",
        # GPT-NeoX's gated sizing: 2/3 of intermediate_size, halved, rounded to mlp_multiple_of
        "intermediate_size": 3 * width,
        "mlp_multiple_of": width,
        "gpt_j_residual": False,
        "use_bias_in_norms": False,
        "use_bias_in_attn_linear": bias,
        "use_bias_in_mlp": bool(hf["mlp_bias"]) if "mlp_bias" in DEFAULTS[arch] else False,
        "num_kv_heads": hf["num_key_value_heads"],
    }
    qwen = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", moe.QWEN2_MOE, moe.QWEN3_MOE)
    if arch in qwen and hf.get("use_sliding_window"):
        raise HFError(
            f"{arch}'s per-layer sliding window (use_sliding_window) is not supported",
            key="use_sliding_window",
        )
    if arch == "Qwen2ForCausalLM":  # biases on q, k and v, none on the output
        keys.update(use_bias_in_attn_linear=True, attention_output_bias=False)
    if arch == "Qwen3ForCausalLM":  # each head's queries and keys normalised
        keys.update(use_qk_layernorm=True, qk_norm_scope="head")
    if arch == "Olmo2ForCausalLM":  # all heads' queries (keys) normalised; post-norm blocks
        keys.update(use_qk_layernorm=True, qk_norm_scope="width", norm_position="output")
    if arch == "MixtralForCausalLM":
        keys.update(_mixtral_keys(hf))
    if arch in moe.FAMILIES:
        keys.update(moe.neox_keys(hf, arch))
    if arch == deepseek.DEEPSEEK_V3:
        del keys["num_kv_heads"]  # MLA rebuilds every head's keys from one latent
        keys.update(deepseek.neox_keys(hf))
    window = hf.get("sliding_window") if arch in SLIDING_WINDOW else None
    if window:
        keys["sliding_window_width"] = window
    return keys


SLIDING_WINDOW = ("MistralForCausalLM", "MixtralForCausalLM")
"""The architectures whose sliding_window applies to every layer."""


def _mixtral_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """Mixtral: every MLP is top-k experts; the k gates are renormalised to sum to 1."""
    if hf.get("router_jitter_noise"):
        raise HFError(
            f"router_jitter_noise {hf['router_jitter_noise']} is not mapped (it scales what the "
            "experts read too; GPT-NeoX's moe_jitter_eps only the router's input); set it to 0",
            key="router_jitter_noise",
        )
    return {
        "moe_num_experts": hf["num_local_experts"],
        "moe_top_k": hf["num_experts_per_tok"],
        "moe_router_type": "topk",
        "moe_expert_interval": 1,
        "moe_renormalize_top_k": True,
    }


def architecture_of(hf: dict[str, Any]) -> str:
    return hf["architectures"][0]


# ---------------------------------------------------------------------------- writing


def export_architecture(args: ModelArgs) -> str:
    """The HF architecture that expresses ``args`` exactly, or an HFError naming what cannot."""
    if hf_mamba.has_mamba(args):
        problems = hf_mamba.problems(args)
        if problems:
            raise HFError(
                "cannot be exported to Hugging Face without changing the model: "
                + "; ".join(problems)
            )
        return hf_mamba.MAMBA
    llama_like = args.norm == "rmsnorm" and args.activation == "swiglu"
    problems = _common_problems(args)
    problems += _llama_problems(args) if llama_like else _gpt_neox_problems(args)
    if problems:
        raise HFError(
            "cannot be exported to Hugging Face without changing the model: " + "; ".join(problems)
        )
    arch = _causal_architecture(args, llama_like)
    # a reward model: the same trunk with a one-value head, read at the last real token
    return arch.replace("ForCausalLM", SEQUENCE_CLASSIFICATION) if args.value_head else arch


def _common_problems(args: ModelArgs) -> list[str]:
    problems = []
    gmlp = [kind for kind in ("gmlp", "amlp") if kind in args.layer_types]
    if gmlp:
        problems.append(f"attention_config {' and '.join(gmlp)} layers (transformers has no gMLP)")
    if "rwkv" in args.layer_types:
        problems.append("RWKV-6 layers (transformers' Rwkv is RWKV-4; GPTNeoX and Llama attend)")
    if args.pos_emb != "rotary":
        problems.append(f"pos_emb {args.pos_emb!r} (Hugging Face GPTNeoX and Llama use rotary)")
    if args.shared_norm:
        problems.append("gpt_j_tied (one norm for attention and MLP)")
    sparse = sorted({t for t in args.layer_types if t in SPARSE_TYPES})
    if sparse:
        problems.append(f"block-sparse layers ({', '.join(sparse)}; Hugging Face attends densely)")
    if args.qk_norm == "neox":
        problems.append(
            "qk_norm_scope neox (GPT-NeoX's one query/key norm; Qwen3 normalises each head, "
            "OLMo 2 all heads, each with its own query and key norm)"
        )
    if args.attn_out_bias and not args.attn_bias:
        problems.append("an attention output bias without q/k/v biases")
    if args.mup is not None:
        problems.append("use_mup (muP's attention, embedding and output multipliers)")
    return problems


def _gpt_neox_problems(args: ModelArgs) -> list[str]:
    problems = []
    if args.norm != "layernorm":
        problems.append(f"norm {args.norm!r} (GPTNeoX uses layernorm, Llama rmsnorm with swiglu)")
    elif not args.norm_bias:
        problems.append("use_bias_in_norms: false with layernorm (GPTNeoX's norms have biases)")
    if args.gated or args.activation not in TO_HF_ACTIVATIONS:
        problems.append(
            f"activation {args.activation!r} (GPTNeoX takes gelu, tanh gelu, relu, silu or "
            "mish; onnx_safe's gelu has none)"
        )
    if not args.mlp_bias:
        problems.append("use_bias_in_mlp: false (GPTNeoX's MLP has biases)")
    if args.num_kv_heads != args.num_heads:
        problems.append("num_kv_heads (GPTNeoX has no grouped-query attention)")
    if args.sliding_window:
        problems.append("sliding_window_width (GPTNeoX has no sliding window)")
    if args.norm_eps <= 0:
        problems.append("layernorm_epsilon <= 0")
    if args.attn_bias and not args.attn_out_bias:
        problems.append("q/k/v biases without an output bias with the GPTNeoX layout")
    if args.head_dim * args.num_heads != args.hidden_size:
        problems.append("head_dim (GPTNeoX's heads are hidden_size / num_attention_heads wide)")
    if args.qk_norm or args.norm_position != "input":
        problems.append("query/key norms or norm_position output with the GPTNeoX layout")
    if args.moe_num_experts > 1:
        problems.append("mixture-of-experts layers with the GPTNeoX layout (Mixtral's is Llama's)")
    return problems


def _llama_problems(args: ModelArgs) -> list[str]:
    if args.mla:
        return deepseek.problems(args)
    problems = []
    if args.parallel_residual:
        problems.append("gpt_j_residual with rmsnorm/swiglu (Llama has a sequential residual)")
    if args.rotary_dims != args.head_dim:
        problems.append("rotary_pct < 1 with rmsnorm/swiglu (Llama rotates whole heads)")
    olmo = args.qk_norm == "width"
    if args.moe_num_experts == 1 and olmo != (args.norm_position == "output"):
        problems.append(
            "query/key norms over all heads (qk_norm_scope width) go with norm_position output "
            "only (OLMo 2 has both, every other dense architecture neither)"
        )
    qkv_bias_only = args.attn_bias and not args.attn_out_bias
    if qkv_bias_only and args.moe_num_experts == 1 and (args.sliding_window or args.qk_norm):
        problems.append("q/k/v biases only (Qwen2's) with a sliding window or qk norms")
    if args.qk_norm and args.sliding_window:
        problems.append("query/key norms with sliding_window_width (Qwen3 and OLMo 2 have none)")
    if args.moe_num_experts > 1:
        problems += moe.problems(args)
    return problems


def _causal_architecture(args: ModelArgs, llama_like: bool) -> str:
    if not llama_like:
        return "GPTNeoXForCausalLM"
    if args.mla:
        return deepseek.DEEPSEEK_V3
    if args.moe_num_experts > 1:
        return moe.architecture(args)
    if args.qk_norm == "width":
        return "Olmo2ForCausalLM"
    if args.qk_norm == "head":
        return "Qwen3ForCausalLM"
    if args.attn_bias and not args.attn_out_bias:
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if args.sliding_window else "LlamaForCausalLM"


SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def causal_family(arch: str) -> str:
    """The causal-LM architecture whose trunk ``arch`` shares (a reward model's, say)."""
    return arch.replace(SEQUENCE_CLASSIFICATION, "ForCausalLM")


def hf_config(
    arch: str, args: ModelArgs, eod_id: int | None = None, pad_id: int | None = None
) -> dict[str, Any]:
    if arch == hf_mamba.MAMBA:
        return hf_mamba.hf_config(args, eod_id)
    out = _hf_config(causal_family(arch), args, eod_id)
    out["architectures"] = [arch]
    if arch.endswith(SEQUENCE_CLASSIFICATION):
        # one score per sequence, read at its last token that is not padding
        out |= {"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
        out |= {"pad_token_id": pad_id if pad_id is not None else eod_id}
        out["tie_word_embeddings"] = False
    return out


def _rope_fields(args: ModelArgs) -> tuple[str, dict[str, Any], int]:
    """(rope type, its fields as Hugging Face writes them, max_position_embeddings)."""
    scaling = dict(args.rope_scaling)
    kind = scaling.pop("type", "default")
    context = args.max_positions
    for name in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
        if name in scaling and float(scaling[name]).is_integer():
            scaling[name] = int(scaling[name])
    if "truncate" in scaling:
        scaling["truncate"] = bool(scaling["truncate"])
    if kind == "dynamic":  # Hugging Face counts dynamic scaling from max_position_embeddings
        context = scaling.pop("original_max_position_embeddings")
    return kind, scaling, context


def _hf_config(arch: str, args: ModelArgs, eod_id: int | None = None) -> dict[str, Any]:
    kind, scaling, context = _rope_fields(args)
    rope = {"rope_theta": args.rotary_base, "rope_type": kind, **scaling}
    common: dict[str, Any] = {
        "architectures": [arch],
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "max_position_embeddings": context,
        "tie_word_embeddings": args.tied_embeddings,
        "attention_dropout": args.attention_dropout,
        "initializer_range": args.init_std,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if eod_id is not None:
        common.update(bos_token_id=eod_id, eos_token_id=eod_id)
    if scaling:  # transformers < 5 reads rope_scaling
        common["rope_scaling"] = {"rope_type": kind, "type": kind, **scaling}
    if arch == "GPTNeoXForCausalLM":
        pct = args.rotary_dims / args.head_dim
        return common | {
            "model_type": "gpt_neox",
            "intermediate_size": args.mlp_width,
            "hidden_act": TO_HF_ACTIVATIONS[args.activation],
            "layer_norm_eps": args.norm_eps,
            "use_parallel_residual": args.parallel_residual,
            "attention_bias": args.attn_bias,
            "hidden_dropout": args.hidden_dropout,
            # both spellings: transformers >= 5 reads rope_parameters, older ones the flat keys
            "rope_parameters": rope | {"partial_rotary_factor": pct},
            "rotary_pct": pct,
            "rotary_emb_base": args.rotary_base,
        }
    return common | _llama_family_config(arch, args, rope)


MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "MixtralForCausalLM": "mixtral",
    **moe.MODEL_TYPES,
    deepseek.DEEPSEEK_V3: deepseek.MODEL_TYPE,
}


def _llama_family_config(arch: str, args: ModelArgs, rope: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model_type": MODEL_TYPES[arch],
        "intermediate_size": args.mlp_width,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "attention_bias": args.attn_bias,
        "mlp_bias": args.mlp_bias,
        "rope_parameters": rope,
        "rope_theta": args.rotary_base,
    }
    if arch in SLIDING_WINDOW:
        out["sliding_window"] = args.sliding_window
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        del out["mlp_bias"]
        out |= {"use_sliding_window": False, "sliding_window": None}
    if arch == "Qwen2ForCausalLM":
        del out["attention_bias"]
    if arch == "MixtralForCausalLM":
        del out["attention_bias"], out["mlp_bias"]
        out |= {
            "num_local_experts": args.moe_num_experts,
            "num_experts_per_tok": args.moe_top_k,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }
    if arch in moe.FAMILIES:
        out = moe.hf_config(arch, args, out)
    if arch == deepseek.DEEPSEEK_V3:
        out = deepseek.hf_config(args, out)
    return out


@contextlib.contextmanager
def naming_errors(path: Path) -> Iterator[None]:
    """Errors of reading a Hugging Face folder that name no file name ``path``; a tensor
    whose reshape fails (a size config.json does not give) is one line saying so."""
    try:
        yield
    except HFError as e:
        if e.source is not None:
            raise
        raise HFError(e.message, source=str(path), key=e.key) from None
    except RuntimeError as e:
        raise ConfigError(
            f"the weights do not match config.json ({str(e).splitlines()[0]}); do they "
            "belong to this config.json?",
            source=str(path),
        ) from None
