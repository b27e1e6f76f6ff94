"""Hugging Face tensor names <-> torchneox's, one tensor at a time.

Conversion streams: ``WeightImporter.add`` takes each Hugging Face tensor as it is read and
files it under torchneox's names (Mixtral's per-expert matrices go into the stacked expert
weights, GPTNeoX's fused query_key_value is split), so nothing holds the source model beside
the converted one; ``hf_tensors`` yields the export's tensors one by one, for the writer to
cut into shards. The mapping is total: a tensor no rule names is refused, never dropped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from torchneox.base.errors import HFError
from torchneox.models.args import ModelArgs
from torchneox.models.hf import deepseek
from torchneox.models.hf import mamba as hf_mamba
from torchneox.models.hf.moe_families import FAMILIES as MOE_FAMILIES

GPT_NEOX = "GPTNeoXForCausalLM"
OLMO2 = "Olmo2ForCausalLM"
MIXTRAL = "MixtralForCausalLM"

# per layer, Hugging Face (after "model.layers.{i}.") -> torchneox (after "layers.{i}.")
LLAMA_LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "mlp_norm",
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "self_attn.q_norm": "attention.q_norm",
    "self_attn.k_norm": "attention.k_norm",
    "mlp.gate_proj": "mlp.gate",
    "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down",
}
# OLMo 2 normalises each sublayer's output: its two norms are torchneox's two block norms
OLMO2_LAYER = {k: v for k, v in LLAMA_LAYER.items() if k != "input_layernorm"} | {
    "post_attention_layernorm": "attention_norm",
    "post_feedforward_layernorm": "mlp_norm",
}
MIXTRAL_LAYER = LLAMA_LAYER | {"block_sparse_moe.gate": "mlp.router", "mlp.gate": "mlp.router"}
# Qwen2-MoE, Qwen3-MoE, OLMoE: the router is mlp.gate; Qwen2-MoE's shared expert and its gate
MOE_LAYER = LLAMA_LAYER | {
    "mlp.gate": "mlp.router",
    "mlp.shared_expert.gate_proj": "mlp.shared_expert.gate",
    "mlp.shared_expert.up_proj": "mlp.shared_expert.up",
    "mlp.shared_expert.down_proj": "mlp.shared_expert.down",
    "mlp.shared_expert_gate": "mlp.shared_expert_gate",
}
GPT_NEOX_LAYER = {
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "mlp_norm",
    "attention.dense": "attention.wo",
    "mlp.dense_h_to_4h": "mlp.up",
    "mlp.dense_4h_to_h": "mlp.down",
}
# Mixtral's experts: w1 gates, w3 goes up, w2 comes down; each [out, in] where torchneox
# stacks [experts, in, out]
EXPERT_MATRICES = {"w1": "experts_gate", "w3": "experts_up", "w2": "experts_down"}
# theirs: mlp.experts.{e}.{gate,up,down}_proj.weight, each [out, in]
MOE_EXPERT_MATRICES = {
    "gate_proj": "experts_gate",
    "up_proj": "experts_up",
    "down_proj": "experts_down",
}
IGNORED = re.compile(r".*(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias)$")
"""Buffers older GPTNeoX checkpoints saved; torchneox recomputes them."""
LAYER = re.compile(r"(?:model|gpt_neox|backbone)\.layers\.(\d+)\.(.+)\.(weight|bias|A_log|D)$")


PER_EXPERT = (*MOE_FAMILIES, deepseek.DEEPSEEK_V3)
"""The families that save each expert's matrices under mlp.experts.{e}.{gate,up,down}_proj."""
WHOLE_LAYER_TENSORS = {deepseek.DEEPSEEK_V3: deepseek.LAYER_TENSORS}
"""Per architecture, per-layer tensors named whole (a buffer: no .weight or .bias)."""


def layer_names(arch: str) -> dict[str, str]:
    if arch == deepseek.DEEPSEEK_V3:
        return deepseek.LAYER | deepseek.MTP_LAYER
    if arch == GPT_NEOX:
        return GPT_NEOX_LAYER
    if arch == hf_mamba.MAMBA:
        return hf_mamba.LAYER
    if arch in MOE_FAMILIES:
        return MOE_LAYER
    return {OLMO2: OLMO2_LAYER, MIXTRAL: MIXTRAL_LAYER}.get(arch, LLAMA_LAYER)


def top_names(arch: str) -> dict[str, str]:
    """The tensors outside the blocks (weights and biases alike)."""
    if arch == hf_mamba.MAMBA:
        return dict(hf_mamba.TOP)
    if arch == GPT_NEOX:
        return {
            "gpt_neox.embed_in": "embed",
            "gpt_neox.final_layer_norm": "final_norm",
            "embed_out": "output",
        }
    return {"model.embed_tokens": "embed", "model.norm": "final_norm", "lm_head": "output"}


class WeightImporter:
    """Collects one model's torchneox state dict from its Hugging Face tensors, in any order."""

    def __init__(self, arch: str, args: ModelArgs):
        self.arch, self.args = arch, args
        self.layer, self.top = layer_names(arch), top_names(arch)
        self.top.setdefault("lm_head", "output")  # GPTNeoX's head as transformers 5 names it
        if args.value_head:  # a reward model (*ForSequenceClassification): one score
            self.top = {k: v for k, v in self.top.items() if v != "output"} | {
                "score": "value_head"
            }
        self.out: dict[str, torch.Tensor] = {}
        self._experts_seen: dict[str, set[int]] = {}
        self.source: dict[str, str] = {}  # torchneox name -> the Hugging Face tensor it is
        self.skipped: list[str] = []  # buffers transformers recomputes too (IGNORED)
        self.stored_head: torch.Tensor | None = None  # a head saved beside tied embeddings
        self.stored_head_name = ""
        self.drop_mtp = False  # DeepSeek-V3's MTP tensors read past (a model without MTP)
        self.dropped_mtp: list[str] = []  # ... those read past, for the caller to say
        self._shared: dict[str, torch.Tensor] = {}  # DeepSeek-V3: embed / head, for MTP's copies
        self._copies: list[tuple[str, str, torch.Tensor]] = []  # copies not yet compared

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """File one Hugging Face tensor; an HFError names one that no rule maps."""
        if IGNORED.match(name):
            self.skipped.append(name)
            return
        top, _, kind = name.rpartition(".")
        if top in self.top:
            ours = f"{self.top[top]}.{kind}"
            self._claim(ours, name)
            if self.arch == deepseek.DEEPSEEK_V3 and self.args.mtp_depth:
                self._shared[ours] = tensor  # (a reference: MTP's copies are compared to it)
                self._compare_copies()
            if ours == "output.weight" and self.args.tied_embeddings:
                self.stored_head = tensor  # the embedding, or a head of its own (unties)
                self.stored_head_name = name
                return
            self.out[ours] = tensor
            return
        if not self._layer_tensor(name, tensor):
            raise HFError(
                f"tensor {name} is not mapped to torchneox's {self.arch} (the model would "
                "compute something else without it)"
            )

    def _claim(self, ours: str, name: str) -> None:
        """Two Hugging Face tensors for one of torchneox's (GPTNeoX's embed_out beside
        lm_head): refused, never one kept and the other dropped."""
        if ours in self.source:
            raise HFError(f"tensors {self.source[ours]} and {name} are both the model's {ours}")
        self.source[ours] = name

    @property
    def untied(self) -> bool:
        """config.json ties the embeddings, but the folder's head differs from them: then
        transformers (5.x) loads that head as the model's own, and so does torchneox."""
        head, embed = self.stored_head, self.out.get("embed.weight")
        if head is None or embed is None:
            return False
        return head.shape != embed.shape or not torch.equal(head, embed)

    def _prefix(self, layer: str) -> str | None:
        """torchneox's prefix of ``model.layers.{layer}`` (DeepSeek-V3's MTP modules follow
        the main layers); None: no module of the model is that layer."""
        if self.arch != deepseek.DEEPSEEK_V3:
            return f"layers.{layer}."
        return deepseek.layer_prefix(int(layer), self.args)

    def _mtp_past(self, name: str) -> bool:
        """A DeepSeek-V3 layer past the model's (its MTP modules): read past when the model
        has no MTP (``drop_mtp``), else refused by the caller."""
        index = re.match(r"model\.layers\.(\d+)\.", name)
        if not (index and self.arch == deepseek.DEEPSEEK_V3 and self.drop_mtp):
            return False
        if int(index.group(1)) < self.args.num_layers:
            return False
        self.dropped_mtp.append(name)
        return True

    def _mtp_copy(self, name: str, tensor: torch.Tensor) -> bool:
        """DeepSeek-V3's MTP module's copy of the embedding or head: kept to be compared with
        the model's (torchneox's modules share them), not filed."""
        copy = re.fullmatch(
            r"model\.layers\.(\d+)\.(embed_tokens\.weight|shared_head\.head\.weight)", name
        )
        if not (copy and self.arch == deepseek.DEEPSEEK_V3):
            return False
        prefix = self._prefix(copy.group(1))
        if prefix is None or not prefix.startswith("mtp."):
            return False
        ours = dict(deepseek.mtp_copies(self.args, int(prefix.split(".")[1])))[name]
        self._copies.append((name, ours, tensor))
        self._compare_copies()
        return True

    def _compare_copies(self, final: bool = False) -> None:
        pending = []
        for name, ours, tensor in self._copies:
            main = self._shared.get(ours)
            if main is None and not final:
                pending.append((name, ours, tensor))
            elif main is None or main.shape != tensor.shape or not torch.equal(main, tensor):
                raise HFError(
                    f"tensor {name} differs from the model's {self.source.get(ours, ours)} "
                    "(torchneox's MTP modules share the model's embedding and head)"
                )
        self._copies = pending

    def _layer_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        if self._mtp_past(name) or self._mtp_copy(name, tensor):
            return True
        if self._expert_tensor(name, tensor):
            return True
        whole = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        ours = WHOLE_LAYER_TENSORS.get(self.arch, {}).get(whole.group(2)) if whole else None
        if ours is not None:
            dst = self._prefix(whole.group(1))
            if dst is None:
                return False
            self._claim(f"{dst}{ours}", name)
            self.out[f"{dst}{ours}"] = tensor
            return True
        match = LAYER.fullmatch(name)
        if match is None:
            return False
        layer, module, kind = match.groups()
        dst = self._prefix(layer)
        if dst is None:
            return False
        if self.arch == GPT_NEOX and module == "attention.query_key_value":
            q, k, v = split_qkv(tensor, self.args.num_heads, self.args.head_dim)
            for ours, part in (("wq", q), ("wk", k), ("wv", v)):
                self._claim(f"{dst}attention.{ours}.{kind}", name)
                self.out[f"{dst}attention.{ours}.{kind}"] = part
            return True
        if module not in self.layer:
            return False
        ours = self.layer[module]
        if self.arch == deepseek.DEEPSEEK_V3:  # interleaved rotary rows into halves order
            tensor = deepseek.rope_rows(ours, self.args, tensor, to_hf=False)
        self._claim(f"{dst}{ours}.{kind}", name)
        self.out[f"{dst}{ours}.{kind}"] = tensor
        return True

    def _expert_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        expert = re.fullmatch(
            r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", name
        )
        if expert:
            layer, e, matrix = expert.groups()
            self._expert(f"layers.{layer}.mlp.{EXPERT_MATRICES[matrix]}", int(e), tensor.T)
            return True
        expert = re.fullmatch(
            r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight",
            name,
        )
        if expert and self.arch in PER_EXPERT:
            layer, e, matrix = expert.groups()
            dst = self._prefix(layer)
            if dst is None:
                return False
            self._expert(f"{dst}mlp.{MOE_EXPERT_MATRICES[matrix]}", int(e), tensor.T)
            return True
        fused = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
        if fused:  # transformers >= 5 in memory: [E, 2I, H] and [E, H, I]
            dst = f"layers.{fused.group(1)}.mlp."
            if fused.group(2) == "down_proj":
                self.out[dst + "experts_down"] = tensor.transpose(1, 2).contiguous()
            else:
                gate, up = tensor.chunk(2, dim=1)
                self.out[dst + "experts_gate"] = gate.transpose(1, 2).contiguous()
                self.out[dst + "experts_up"] = up.transpose(1, 2).contiguous()
            return True
        return False

    def _expert(self, name: str, e: int, matrix: torch.Tensor) -> None:
        """One expert's matrix into the stacked [experts, in, out] weight, allocated once."""
        experts = self.args.moe_num_experts
        if e >= experts:
            raise HFError(f"expert {e} of {name} is past num_local_experts {experts}")
        if name not in self.out:
            self.out[name] = matrix.new_empty(experts, *matrix.shape)
            self._experts_seen[name] = set()
        if tuple(self.out[name].shape[1:]) != tuple(matrix.shape):
            raise HFError(
                f"expert {e} of {name} has shape {tuple(matrix.T.shape)}, the others "
                f"{tuple(self.out[name].shape[1:][::-1])}"
            )
        self.out[name][e].copy_(matrix)
        self._experts_seen[name].add(e)

    def take_ready(self) -> dict[str, torch.Tensor]:
        """The tensors filed whole so far, handed over and forgotten (a stacked expert weight
        once every expert is in; the embedding of a tied model is kept, for ``untied``): what
        training streams into its shards, so the importer never holds the model."""
        keep = {
            n for n, seen in self._experts_seen.items() if len(seen) < self.args.moe_num_experts
        }
        if self.args.tied_embeddings:
            keep.add("embed.weight")
        ready = {n: t for n, t in self.out.items() if n not in keep}
        for name in ready:
            del self.out[name]
        return ready

    def result(self) -> dict[str, torch.Tensor]:
        self._compare_copies(final=True)
        for name, seen in self._experts_seen.items():
            if len(seen) != self.args.moe_num_experts:
                missing = min(set(range(self.args.moe_num_experts)) - seen)
                raise HFError(f"the weights have no expert {missing} for {name}")
        if self.untied:
            self.out["output.weight"] = self.stored_head
        return self.out


def split_qkv(t: torch.Tensor, heads: int, d: int) -> tuple[torch.Tensor, ...]:
    """GPTNeoX's fused query_key_value, laid out per head ([heads, (q, k, v), head_dim])."""
    grouped = t.reshape(heads, 3, d, *t.shape[1:])
    return tuple(grouped[:, j].reshape(heads * d, *t.shape[1:]).contiguous() for j in range(3))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    parts = [x.reshape(heads, 1, d, *x.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(3 * heads * d, *q.shape[1:]).contiguous()


def hf_tensors(
    arch: str, sd: dict[str, torch.Tensor], args: ModelArgs
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of torchneox's state dict ``sd``, one at a time (the inverse
    of ``WeightImporter``), in the model's order. ``arch`` is the causal architecture (a
    reward model's score head is ``score.weight``)."""
    theirs_of_top = {ours: theirs for theirs, ours in top_names(arch).items()}
    theirs_of_layer = {ours: theirs for theirs, ours in layer_names(arch).items()}
    if arch == MIXTRAL:
        theirs_of_layer["mlp.router"] = "block_sparse_moe.gate"
    prefixes = {GPT_NEOX: "gpt_neox.", hf_mamba.MAMBA: "backbone."}
    prefix = prefixes.get(arch, "model.")
    expert_of = {ours: theirs for theirs, ours in EXPERT_MATRICES.items()}
    moe_expert_of = {ours: theirs for theirs, ours in MOE_EXPERT_MATRICES.items()}
    whole_of = {ours: theirs for theirs, ours in WHOLE_LAYER_TENSORS.get(arch, {}).items()}
    mtp_started: set[str] = set()
    for name, tensor in sd.items():
        module, _, kind = name.rpartition(".")
        if name == "value_head.weight":
            yield "score.weight", tensor
            continue
        if name.startswith("mtp.") and arch != deepseek.DEEPSEEK_V3:
            continue  # training's MTP modules: only DeepSeek-V3 here holds them
        if module in theirs_of_top:
            yield f"{theirs_of_top[module]}.{kind}", tensor
            continue
        _, layer, rest = name.split(".", 2)
        dst = f"{prefix}layers.{layer}."
        if arch == deepseek.DEEPSEEK_V3:  # (an MTP module: after the main layers)
            dst = deepseek.hf_layer(name, args)
            yield from deepseek.copies_before(name, sd, args, mtp_started)
        if rest in whole_of:
            yield f"{dst}{whole_of[rest]}", tensor
            continue
        module, _, kind = rest.rpartition(".")
        if arch == deepseek.DEEPSEEK_V3:
            tensor = deepseek.rope_rows(module, args, tensor, to_hf=True)
            if module == "mlp.router" and f"{name[: -len(rest)]}mlp.router_bias" not in sd:
                # a model trained without the bias routes as DeepSeek-V3 with a zero one
                yield (
                    f"{dst}mlp.gate.e_score_correction_bias",
                    tensor.new_zeros(tensor.shape[0], dtype=torch.float32),
                )
        if kind in expert_of and arch in PER_EXPERT:
            for e in range(tensor.shape[0]):
                yield f"{dst}mlp.experts.{e}.{moe_expert_of[kind]}.weight", tensor[e].T
            continue
        if kind in expert_of:  # Mixtral: one [out, in] matrix per expert
            for e in range(tensor.shape[0]):
                yield f"{dst}block_sparse_moe.experts.{e}.{expert_of[kind]}.weight", tensor[e].T
            continue
        if arch == GPT_NEOX and module in ("attention.wk", "attention.wv"):
            continue  # fused with wq
        if arch == GPT_NEOX and module == "attention.wq":
            parts = (sd[f"layers.{layer}.attention.{w}.{kind}"] for w in ("wq", "wk", "wv"))
            fused = fuse_qkv(*parts, args.num_heads, args.head_dim)
            yield f"{dst}attention.query_key_value.{kind}", fused
            continue
        yield f"{dst}{theirs_of_layer[module]}.{kind}", tensor
