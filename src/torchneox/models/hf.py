"""Hugging Face interop: config and weight adapters for GPTNeoX, Llama and Mistral.

Works from local folders only (config.json + safetensors or pytorch_model.bin) and does not
need the transformers package. The fused GPTNeoX query_key_value weight is laid out per head
([heads, (q, k, v), head_dim, hidden]); torchneox keeps q, k and v separate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import HFError, first_line
from torchneox.models.args import ModelArgs

ARCHITECTURES = (
    "GPTNeoXForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
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


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise HFError("no config.json: not a Hugging Face model folder", source=str(folder))
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise HFError(f"config.json is not valid JSON ({e})", source=str(folder)) from None


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except FileNotFoundError:
        raise HFError("is missing (the index names it)", source=str(path)) from None
    except Exception as e:  # a truncated or foreign file
        first = first_line(e)
        raise HFError(
            f"cannot be read as safetensors ({first}); is it truncated? download it again",
            source=str(path),
        ) from None


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a local HF folder: model.safetensors, sharded safetensors, or .bin."""
    load_file = _load_safetensors
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return load_file(single)
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError):
            raise HFError("is not a safetensors index (no weight_map)", source=str(index)) from None
        out: dict[str, torch.Tensor] = {}
        for name in files:
            out.update(load_file(folder / name))
        return out
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        out = {}
        for path in bins:
            try:
                out.update(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as e:
                first = first_line(e)
                raise HFError(
                    f"cannot be read as torch weights ({first})", source=str(path)
                ) from None
        return out
    raise HFError("no model.safetensors or pytorch_model.bin found", source=str(folder))


SCALED_ROPE = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _rope(hf: dict[str, Any]) -> tuple[float, float, dict[str, Any] | None]:
    """(theta, partial rotary factor, rope_scaling key or None) from old-style or
    rope_parameters-style configs."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    chosen: dict[str, Any] | None = None
    # either may ask for scaling (transformers applies rope_scaling over a default
    # rope_parameters): a model converted without it would compute other logits
    for key, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = (spec.get("rope_type") or spec.get("type")) if isinstance(spec, dict) else spec
        if kind in (None, "default"):
            continue
        if kind not in SCALED_ROPE:
            raise HFError(
                f"rope scaling {kind!r} is not supported yet (torchneox maps "
                f"{', '.join(SCALED_ROPE)}); the model would compute other logits without it",
                key=key,
            )
        chosen = {"type": kind} | {name: spec[name] for name in SCALED_ROPE[kind] if name in spec}
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    pct = params.get(
        "partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", 1.0))
    )
    return float(theta), float(pct), chosen


def neox_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """A GPT-NeoX-style config (flat keys) describing the same model as the HF config."""
    arch = (hf.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise HFError(
            f"architecture {arch!r} is not supported; torchneox reads {', '.join(ARCHITECTURES)}",
            key="architectures",
        )
    theta, pct, scaling = _rope(hf)
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, h // heads):
        raise HFError(f"head_dim {hf['head_dim']} differs from hidden_size / heads", key="head_dim")
    cfg: dict[str, Any] = {
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": h,
        "num_attention_heads": heads,
        "seq_length": hf.get("max_position_embeddings", 2048),
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "pos_emb": "rotary",
        "rotary_pct": pct,
        "rotary_emb_base": int(theta) if float(theta).is_integer() else theta,
        "no_weight_tying": not hf.get("tie_word_embeddings", arch != "GPTNeoXForCausalLM"),
        "padded_vocab_size": hf["vocab_size"],
        "make_vocab_size_divisible_by": 1,
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
    }
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    act = hf.get("hidden_act", "gelu")
    if arch == "GPTNeoXForCausalLM":
        cfg.update(_gpt_neox_keys(hf, act))
    else:
        cfg.update(_llama_family_keys(hf, arch, act))
    return cfg


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
        "layernorm_epsilon": hf.get("layer_norm_eps", 1e-5),
        "intermediate_size": hf["intermediate_size"],
        "mlp_multiple_of": 1,
        "gpt_j_residual": hf.get("use_parallel_residual", True),
        "use_bias_in_attn_linear": hf.get("attention_bias", True),
        "hidden_dropout": float(hf.get("hidden_dropout", 0.0)),
    }


def _llama_family_keys(hf: dict[str, Any], arch: str, act: str) -> dict[str, Any]:
    """Llama, Mistral and Qwen2: rmsnorm, SwiGLU, sequential residual, GQA; Qwen2's q/k/v
    biases, Mistral's sliding window."""
    if act != "silu":
        raise HFError(f"hidden_act {act!r} is not supported for {arch}", key="hidden_act")
    width = hf["intermediate_size"]
    keys = {
        "norm": "rmsnorm",
        "rms_norm_epsilon": hf.get("rms_norm_eps", 1e-6),
        "activation": "swiglu",
        # GPT-NeoX's gated sizing: 2/3 of intermediate_size, halved, rounded to mlp_multiple_of
        "intermediate_size": 3 * width,
        "mlp_multiple_of": width,
        "gpt_j_residual": False,
        "use_bias_in_norms": False,
        "use_bias_in_attn_linear": hf.get("attention_bias", False),
        "use_bias_in_mlp": hf.get("mlp_bias", False),
        "num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
    }
    if arch == "Qwen2ForCausalLM":  # biases on q, k and v, none on the output
        if hf.get("use_sliding_window"):
            raise HFError(
                "Qwen2's per-layer sliding window (use_sliding_window) is not supported",
                key="use_sliding_window",
            )
        keys.update(use_bias_in_attn_linear=True, attention_output_bias=False)
    window = hf.get("sliding_window") if arch == "MistralForCausalLM" else None
    if window:
        keys["sliding_window_width"] = window
    return keys


def architecture_of(hf: dict[str, Any]) -> str:
    return hf["architectures"][0]


def state_dict_from_hf(
    arch: str, hf: dict[str, torch.Tensor], args: ModelArgs
) -> dict[str, torch.Tensor]:
    """HF tensors -> torchneox names (see models/transformer.py)."""
    out: dict[str, torch.Tensor] = {}
    if arch == "GPTNeoXForCausalLM":
        p = "gpt_neox."
        out["embed.weight"] = hf[p + "embed_in.weight"]
        for i in range(args.num_layers):
            src, dst = f"{p}layers.{i}.", f"layers.{i}."
            _norm(out, hf, src + "input_layernorm", dst + "attention_norm")
            _norm(out, hf, src + "post_attention_layernorm", dst + "mlp_norm")
            for kind in ("weight", "bias"):
                name = f"{src}attention.query_key_value.{kind}"
                if name in hf:
                    q, k, v = _split_qkv(hf[name], args.num_heads, args.head_dim)
                    out[f"{dst}attention.wq.{kind}"] = q
                    out[f"{dst}attention.wk.{kind}"] = k
                    out[f"{dst}attention.wv.{kind}"] = v
            _linear(out, hf, src + "attention.dense", dst + "attention.wo")
            _linear(out, hf, src + "mlp.dense_h_to_4h", dst + "mlp.up")
            _linear(out, hf, src + "mlp.dense_4h_to_h", dst + "mlp.down")
        _norm(out, hf, p + "final_layer_norm", "final_norm")
        head = hf.get("embed_out.weight", hf.get("lm_head.weight"))
    else:
        p = "model."
        out["embed.weight"] = hf[p + "embed_tokens.weight"]
        for i in range(args.num_layers):
            src, dst = f"{p}layers.{i}.", f"layers.{i}."
            _norm(out, hf, src + "input_layernorm", dst + "attention_norm")
            _norm(out, hf, src + "post_attention_layernorm", dst + "mlp_norm")
            for theirs, ours in (
                ("q_proj", "wq"),
                ("k_proj", "wk"),
                ("v_proj", "wv"),
                ("o_proj", "wo"),
            ):
                _linear(out, hf, f"{src}self_attn.{theirs}", f"{dst}attention.{ours}")
            for theirs, ours in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                _linear(out, hf, f"{src}mlp.{theirs}", f"{dst}mlp.{ours}")
        _norm(out, hf, p + "norm", "final_norm")
        head = hf.get("lm_head.weight")
    if not args.tied_embeddings:
        if head is None:
            raise HFError("the output head (lm_head / embed_out) is missing from the weights")
        out["output.weight"] = head
    return out


def _norm(out: dict, hf: dict, src: str, dst: str) -> None:
    for kind in ("weight", "bias"):
        if f"{src}.{kind}" in hf:
            out[f"{dst}.{kind}"] = hf[f"{src}.{kind}"]


def _linear(out: dict, hf: dict, src: str, dst: str) -> None:
    _norm(out, hf, src, dst)


def _split_qkv(t: torch.Tensor, heads: int, d: int) -> tuple[torch.Tensor, ...]:
    grouped = t.reshape(heads, 3, d, *t.shape[1:])
    return tuple(grouped[:, j].reshape(heads * d, *t.shape[1:]).contiguous() for j in range(3))


def _fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, d: int
) -> torch.Tensor:
    parts = [x.reshape(heads, 1, d, *x.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * heads * d, *q.shape[1:]).contiguous()


# ---------------------------------------------------------------------------- writing


def export_architecture(args: ModelArgs) -> str:
    """The HF architecture that expresses ``args`` exactly, or an HFError naming what cannot."""
    problems = []
    if args.moe_num_experts > 1:
        problems.append(
            "mixture-of-experts layers (Hugging Face's GPTNeoX and Llama have none; its MoE "
            "architectures route and name experts differently)"
        )
    if args.pos_emb != "rotary":
        problems.append(f"pos_emb {args.pos_emb!r} (Hugging Face GPTNeoX and Llama use rotary)")
    if args.shared_norm:
        problems.append("gpt_j_tied (one norm for attention and MLP)")
    llama_like = args.norm == "rmsnorm" and args.activation == "swiglu"
    if llama_like:
        if args.parallel_residual:
            problems.append("gpt_j_residual with rmsnorm/swiglu (Llama has a sequential residual)")
        if args.rotary_dims != args.head_dim:
            problems.append("rotary_pct < 1 with rmsnorm/swiglu (Llama rotates whole heads)")
    else:
        if args.norm != "layernorm":
            problems.append(
                f"norm {args.norm!r} (GPTNeoX uses layernorm, Llama rmsnorm with swiglu)"
            )
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
    if problems:
        raise HFError(
            "cannot be exported to Hugging Face without changing the model: " + "; ".join(problems)
        )
    qkv_bias_only = args.attn_bias and not args.attn_out_bias
    if args.attn_out_bias and not args.attn_bias:
        problems.append("an attention output bias without q/k/v biases")
    if qkv_bias_only and not llama_like:
        problems.append("q/k/v biases without an output bias with the GPTNeoX layout")
    if qkv_bias_only and args.sliding_window:
        problems.append("q/k/v biases only with a sliding window (Qwen2 has no such layout)")
    if problems:
        raise HFError(
            "cannot be exported to Hugging Face without changing the model: " + "; ".join(problems)
        )
    arch = _causal_architecture(args, llama_like, qkv_bias_only)
    # a reward model: the same trunk with a one-value head, read at the last real token
    return arch.replace("ForCausalLM", SEQUENCE_CLASSIFICATION) if args.value_head else arch


def _causal_architecture(args: ModelArgs, llama_like: bool, qkv_bias_only: bool) -> str:
    if not llama_like:
        return "GPTNeoXForCausalLM"
    if qkv_bias_only:
        return "Qwen2ForCausalLM"
    return "MistralForCausalLM" if args.sliding_window else "LlamaForCausalLM"


SEQUENCE_CLASSIFICATION = "ForSequenceClassification"


def causal_family(arch: str) -> str:
    """The causal-LM architecture whose trunk ``arch`` shares (a reward model's, say)."""
    return arch.replace(SEQUENCE_CLASSIFICATION, "ForCausalLM")


def hf_config(
    arch: str, args: ModelArgs, eod_id: int | None = None, pad_id: int | None = None
) -> dict[str, Any]:
    out = _hf_config(causal_family(arch), args, eod_id)
    out["architectures"] = [arch]
    if arch.endswith(SEQUENCE_CLASSIFICATION):
        # one score per sequence, read at its last token that is not padding
        out |= {"num_labels": 1, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
        out |= {"pad_token_id": pad_id if pad_id is not None else eod_id}
        out["tie_word_embeddings"] = False
    return out


def _hf_config(arch: str, args: ModelArgs, eod_id: int | None = None) -> dict[str, Any]:
    scaling = dict(args.rope_scaling)
    kind = scaling.pop("type", "default")
    if "original_max_position_embeddings" in scaling:
        scaling["original_max_position_embeddings"] = int(
            scaling["original_max_position_embeddings"]
        )
    rope = {"rope_theta": args.rotary_base, "rope_type": kind, **scaling}
    common: dict[str, Any] = {
        "architectures": [arch],
        "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "max_position_embeddings": args.max_positions,
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
    out = common | {
        "model_type": "mistral" if arch == "MistralForCausalLM" else "llama",
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
    if arch == "MistralForCausalLM":
        out["sliding_window"] = args.sliding_window
    if arch == "Qwen2ForCausalLM":
        del out["attention_bias"], out["mlp_bias"]
        out |= {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": None}
    return out


def state_dict_to_hf(
    arch: str, sd: dict[str, torch.Tensor], args: ModelArgs
) -> dict[str, torch.Tensor]:
    """torchneox names -> HF names (the inverse of state_dict_from_hf)."""
    out: dict[str, torch.Tensor] = {}
    arch = causal_family(arch)

    def copy(src: str, dst: str) -> None:
        for kind in ("weight", "bias"):
            if f"{src}.{kind}" in sd:
                out[f"{dst}.{kind}"] = sd[f"{src}.{kind}"].contiguous()

    if arch == "GPTNeoXForCausalLM":
        p = "gpt_neox."
        out[p + "embed_in.weight"] = sd["embed.weight"]
        for i in range(args.num_layers):
            src, dst = f"layers.{i}.", f"{p}layers.{i}."
            copy(src + "attention_norm", dst + "input_layernorm")
            copy(src + "mlp_norm", dst + "post_attention_layernorm")
            for kind in ("weight", "bias"):
                if f"{src}attention.wq.{kind}" in sd:
                    out[f"{dst}attention.query_key_value.{kind}"] = _fuse_qkv(
                        *(sd[f"{src}attention.{w}.{kind}"] for w in ("wq", "wk", "wv")),
                        args.num_heads,
                        args.head_dim,
                    )
            copy(src + "attention.wo", dst + "attention.dense")
            copy(src + "mlp.up", dst + "mlp.dense_h_to_4h")
            copy(src + "mlp.down", dst + "mlp.dense_4h_to_h")
        copy("final_norm", p + "final_layer_norm")
        if args.value_head:
            out["score.weight"] = sd["value_head.weight"]
        elif not args.tied_embeddings:
            out["embed_out.weight"] = sd["output.weight"]
        return out
    p = "model."
    out[p + "embed_tokens.weight"] = sd["embed.weight"]
    for i in range(args.num_layers):
        src, dst = f"layers.{i}.", f"{p}layers.{i}."
        copy(src + "attention_norm", dst + "input_layernorm")
        copy(src + "mlp_norm", dst + "post_attention_layernorm")
        for ours, theirs in (
            ("wq", "q_proj"),
            ("wk", "k_proj"),
            ("wv", "v_proj"),
            ("wo", "o_proj"),
        ):
            copy(f"{src}attention.{ours}", f"{dst}self_attn.{theirs}")
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            copy(f"{src}mlp.{ours}", f"{dst}mlp.{theirs}")
    copy("final_norm", p + "norm")
    if args.value_head:
        out["score.weight"] = sd["value_head.weight"]
    elif not args.tied_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    return out
