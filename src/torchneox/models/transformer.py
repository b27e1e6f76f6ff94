"""The decoder: embedding -> blocks -> final norm -> output head, for one device.

Parallelism is applied from outside. Parameter names are stable:

    embed.weight                      pos_embed.weight (learned positions; pos_embed.norm.*
                                      under use_bnb_optimizer: StableEmbedding)
    rpe.weight (pos_emb rpe: [buckets, heads], shared by every layer, as in GPT-NeoX)
    layers.{i}.attention_norm.*       layers.{i}.attention.{wq,wk,wv,wo}.{weight,bias}
    layers.{i}.attention.{qk_norm,q_norm,k_norm}.* (use_qk_layernorm, by qk_norm_scope)
    layers.{i}.mlp_norm.*             layers.{i}.mlp.{up,gate,down}.{weight,bias}
    final_norm.*                      output.weight (untied head), value_head.weight (rm)
    soft_prompt.weight (soft_prompt_tuning; under num_unique_layers a layer that shares
    another's weights holds that layer's parameters, named once, by the first layer)
    layers.{i}.mamba_norm.*           layers.{i}.mamba.{in_proj,conv1d,x_proj,dt_proj,out_proj,A_log,D}
    LoRA (models/lora.py): {layer}.lora_A.weight, {layer}.lora_B.weight under each adapted
    linear; layers.{i}.mlp.experts_{up,gate,down}_lora.lora_{A,B}.weight per expert

Build it on the meta device, move it with ``to_empty`` and call ``init_weights()``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from torchneox.models import lora, sharing
from torchneox.models.args import ModelArgs
from torchneox.models.block import Block
from torchneox.models.linear import Linear, linear
from torchneox.models.mixers.attention import (
    AttentionBias,
    ContextShard,
    KVCache,
    StaticKVCache,
)
from torchneox.models.moe import RouterStats
from torchneox.models.mtp import build_mtp, mtp_depths
from torchneox.models.norms import build_norm
from torchneox.models.params import (
    VALUE_HEAD,
    PartFn,
    SoftPrompt,
    init_parameter,
    plain_name,
    trains_with_lora,
    whole,
)
from torchneox.models.positions import (
    alibi_slopes,
    relative_position_buckets,
    rotary_tables,
    sinusoidal_table,
)
from torchneox.models.stable_embedding import StableEmbedding

RouterSink = Callable[[torch.Tensor, list[RouterStats]], torch.Tensor]
"""A pipeline stage's exit for its router statistics (``Transformer.router_sink``)."""


def _advance(cache: KVCache | None, t: int) -> None:
    """The cache past the ``t`` tokens a forward added."""
    if isinstance(cache, StaticKVCache):
        cache.advance(t)
    elif cache is not None:
        cache.length += t


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        h = args.hidden_size
        self.embed = nn.Embedding(args.vocab_size, h)
        positions = StableEmbedding if args.stable_embedding else nn.Embedding
        self.pos_embed = (
            positions(args.max_positions + args.pos_offset, h)
            if args.pos_emb == "learned"
            else None
        )
        self.embed_dropout = nn.Dropout(args.hidden_dropout)
        # T5's relative position bias, one table for every layer (GPT-NeoX hands each layer
        # the same module); a lookup by bucket, so tensor parallelism splits its heads
        self.rpe = nn.Embedding(args.rpe_buckets, args.num_heads) if args.pos_emb == "rpe" else None
        self.tp_heads: tuple[int, int] | None = None
        """The heads this tensor rank holds (ALiBi's slopes are cut to them)."""
        self.first_stage = True
        """False on a later pipeline stage: its input is hidden states (its embedding, where it
        holds one, is the tied head's weight)."""
        self.prompt_passed = False  # a soft prompt's last pipeline stage: it cuts the prompt
        self.sequence_shards = 1
        """Set by sequence parallelism: the tensor ranks the hidden states between blocks are
        split over along the sequence (a later pipeline stage receives one slice)."""
        self.embedded_output: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by sequence parallelism with learned or sinusoidal positions: the embeddings
        (added to the whole sequence's positions) cut to this rank's sequence slice."""
        self.tied_head_input: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by tensor parallelism: the tied head's input made whole on every tensor rank
        (the embedding's vocabulary shards then give the logits' shards)."""
        # soft_prompt_tuning: the trained vectors before the text (soft_prompt.weight)
        self.soft_prompt = (
            SoftPrompt(args.soft_prompt_tokens, h) if args.soft_prompt_tokens else None
        )
        # a ModuleDict keyed by layer index keeps names stable when pipeline stages drop layers
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.num_layers)})
        self.final_norm = build_norm(args.norm, h, args.norm_eps, args.norm_bias)
        self.output = (
            None
            if args.tied_embeddings or args.value_head
            else Linear(h, args.vocab_size, bias=False)
        )
        # a reward model's head (GPT-NeoX's rm_linear): one value per position
        self.value_head = Linear(h, 1, bias=False) if args.value_head else None
        # a pipeline stage with MoE layers: takes the stage's hidden states and RouterStats
        # after the blocks (a schedule keeps only a stage's output) and returns the states
        self.router_sink: RouterSink | None = None
        self.mtp = build_mtp(args)  # multi-token prediction (models/mtp.py): mtp.{k}.*
        self.stage_context: ContextShard | None = None
        """A pipeline stage under context parallelism: the ``context`` of every forward (the
        schedule passes a later stage only the hidden states)."""
        self._make_buffers(device=None)
        for module in self.modules():  # the CPU kernel of the fp32 products (cpu_matmul)
            if isinstance(module, Linear):
                module.cpu_matmul = args.cpu_matmul
        if args.lora_rank:
            self._add_adapters()
        sharing.install(self)  # num_unique_layers: the sharers hold their owner's parameters
        self.freeze_for_prompt()

    def _add_adapters(self) -> None:
        """LoRA adapters on the targeted layers of every block (models/lora.py); every other
        parameter frozen but the value head and the soft prompt."""
        lora.add_adapters(self)
        for name, param in self.named_parameters():
            param.requires_grad_(trains_with_lora(name))

    def freeze_for_prompt(self) -> None:
        """soft_prompt_tuning: every parameter but the prompt (and LoRA's adapters and a
        reward model's value head, which train beside it: a fresh head cannot stay as drawn)
        frozen (no gradient, no optimizer state); nothing changes without a soft prompt."""
        if not self.args.soft_prompt_tokens:
            return
        lora = bool(self.args.lora_rank)
        for name, param in self.named_parameters():
            head = name.endswith(VALUE_HEAD)
            param.requires_grad_(head or (lora and trains_with_lora(name)))
        if self.soft_prompt is not None:  # (a later pipeline stage holds none)
            self.soft_prompt.weight.requires_grad_(True)

    def _apply(self, fn, recurse=True):
        """As nn.Module's, then the shared layers tied again (a move gives each module its
        own tensor)."""
        out = super()._apply(fn, recurse)
        if self.args.layer_owners:
            sharing.tie_layers(self)
        return out

    # ------------------------------------------------------------------ buffers and init

    def _make_buffers(self, device: torch.device | None) -> None:
        a = self.args
        if a.pos_emb == "rotary":
            cos, sin = rotary_tables(a.rotary_dims, a.rotary_base, a.max_positions, a.rope_scaling)
            self.register_buffer("rope_cos", cos.to(device), persistent=False)
            self.register_buffer("rope_sin", sin.to(device), persistent=False)
        elif a.pos_emb == "sinusoidal":
            table = sinusoidal_table(a.hidden_size, a.max_positions)
            self.register_buffer("sin_table", table.to(device), persistent=False)
        elif a.pos_emb == "alibi":
            slopes = alibi_slopes(a.num_heads)
            if self.tp_heads is not None:
                slopes = slopes[self.tp_heads[0] : self.tp_heads[1]]
            self.register_buffer("alibi", slopes.to(device), persistent=False)

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the position tables on ``device`` (after ``to_empty``), and the layers'
        own (a block-sparse layer's layout)."""
        self._make_buffers(torch.device(device))
        for module in self.modules():
            if module is not self and hasattr(module, "init_buffers"):
                module.init_buffers(device)

    @torch.no_grad()
    def init_weights(
        self,
        device: torch.device | str | None = None,
        seed: int = 0,
        only: Collection[str] | None = None,
        part: PartFn = whole,
    ) -> int:
        """Initialise the parameters as GPT-NeoX's init_method/output_layer_init_method do (all
        of them, or the names in ``only``), after recomputing the position tables on ``device``;
        returns how many parameters were drawn.

        Each parameter draws from its own generator, seeded from ``seed`` and its name, so the
        weights do not depend on which parameters a process holds (a pipeline stage) or which
        part of them (a tensor-, expert- or ZeRO-parallel shard: the whole parameter is drawn,
        one at a time, and only this rank's part kept: ``part`` tells which)."""
        if device is None:
            device = next(self.parameters()).device
        self.init_buffers(device)
        if torch.device(device).type == "meta":  # shapes only (the dry run): nothing to draw
            return 0
        drawn = 0
        for name, param in self.named_parameters():
            plain = plain_name(name)
            if only is not None and plain not in only:
                continue
            init_parameter(self.args, plain, param, seed, torch.device(device), part)
            drawn += 1
        return drawn

    # -------------------------------------------------------------------------- forward

    def _attention_bias(
        self,
        t: int,
        start: int,
        key_valid_BS: torch.Tensor | None,
        device: torch.device,
        segments_BT: torch.Tensor | None = None,
        context: ContextShard | None = None,
        static: StaticKVCache | None = None,
    ) -> AttentionBias:
        a = self.args
        extras = key_valid_BS is not None or a.sliding_window is not None
        extras = extras or a.pos_emb in ("alibi", "rpe")
        extras = extras or segments_BT is not None or context is not None or static is not None
        if not extras and start == 0:
            return AttentionBias(None, is_causal=True)
        if not extras and t == 1:
            return AttentionBias(None, is_causal=False)
        if context is not None:  # this rank's queries against the gathered keys
            q, k = context.index[:, None], context.keys[None, :]
        elif static is not None:  # every position of the cache, the unwritten ones masked
            q, k = static.queries(t)[:, None], static.keys[None, :]
        else:
            q = torch.arange(start, start + t, device=device)[:, None]
            k = torch.arange(start + t, device=device)[None, :]
        allowed = k <= q
        if a.sliding_window is not None:
            allowed = allowed & (q - k < a.sliding_window)
        allowed = allowed[None, None]  # [1, 1, T, S]
        keys = None
        if segments_BT is not None:  # inter_document_attention_masking: within one's document
            assert start == 0, "document masking is for whole sequences, not cached decoding"
            keys = segments_BT if context is None else context.key_segments
            allowed = allowed & (segments_BT[:, None, :, None] == keys[:, None, None, :])
        if key_valid_BS is not None:
            # a padded query still sees itself, so no row is empty (its output is never used)
            allowed = (allowed & key_valid_BS[:, None, None, :]) | (k == q)[None, None]
        gather = context.gather if context is not None else None
        positions = (q[:, 0], k[0]) if context is not None or static is not None else None
        if a.pos_emb in ("alibi", "rpe"):
            allowed = self._position_scores(q - k)[None].masked_fill(~allowed, float("-inf"))
        rank = context.rank if context is not None else 0
        return AttentionBias(allowed, False, gather, key_valid_BS, positions, keys, rank)

    def _position_scores(self, distance: torch.Tensor) -> torch.Tensor:
        """[heads, T, S] what ALiBi or T5's relative positions add to the attention scores
        at ``distance`` (query position - key position), for the heads this rank holds. The
        relative bias is scaled by sqrt(head_dim), as GPT-NeoX scales it: added to scores
        already divided by that."""
        a = self.args
        if a.pos_emb == "alibi":
            return -self.alibi[:, None, None] * distance.clamp(min=0).float()[None]
        buckets = relative_position_buckets(distance, a.rpe_buckets, a.rpe_max_distance)
        bias = self.rpe(buckets).float().permute(2, 0, 1)  # [T, S, heads] -> [heads, T, S]
        return bias * a.head_dim**0.5

    def _rope(
        self, positions_BT: torch.Tensor | None, start: int, t: int, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin at the positions (``positions_BT``: [B, T], or [T] for every row);
        ``length``: the whole sequence's, when this process holds part of it."""
        a = self.args
        if a.pos_emb != "rotary":
            return None
        cos, sin = self.rope_cos, self.rope_sin
        spec = dict(a.rope_scaling)
        if spec.get("type") == "dynamic":
            # past the original context the frequencies follow the sequence's length, as
            # Hugging Face recomputes them for each forward's last position
            end = start + t if positions_BT is None else int(positions_BT.max()) + 1
            end = length or end
            if end > spec["original_max_position_embeddings"]:
                cos, sin = rotary_tables(
                    a.rotary_dims, a.rotary_base, end, a.rope_scaling, seq_len=end
                )
                cos, sin = cos.to(self.rope_cos.device), sin.to(self.rope_cos.device)
        if positions_BT is None:
            return cos[start : start + t], sin[start : start + t]
        if positions_BT.dim() == 1:
            return cos[positions_BT], sin[positions_BT]
        return cos[positions_BT][:, None], sin[positions_BT][:, None]

    def forward(
        self,
        tokens_BT: torch.Tensor,
        *,
        positions_BT: torch.Tensor | None = None,
        key_valid_BS: torch.Tensor | None = None,
        cache: KVCache | None = None,
        router_stats: bool = False,
        segments_BT: torch.Tensor | None = None,
        context: ContextShard | None = None,
        last_only: bool = False,
        mtp_tokens_BT: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[RouterStats]]:
        """Logits [B, T, vocab] (a middle pipeline stage: hidden states), and with
        ``router_stats`` each MoE layer's ``RouterStats`` too. ``positions_BT`` default to 0..
        (after the cache's length); ``key_valid_BS`` marks the keys (cache + new tokens) that
        are real, not padding; ``segments_BT`` numbers each token's document, and a token
        attends only to its own (``attention.documents`` gives both for a packed batch);
        ``context``: the tokens are this rank's part of each sequence (context parallelism);
        ``last_only``: [B, 1, vocab], the last token's logits only (a prefill that samples);
        ``mtp_tokens_BT``: the inputs (``context``: the whole sequence's) for MTP's depths."""
        t, start = tokens_BT.shape[1], cache.length if cache is not None else 0
        context, positions_BT, length = self._context(context, positions_BT, segments_BT)
        static = cache if isinstance(cache, StaticKVCache) else None
        if static is not None and positions_BT is None:
            positions_BT = static.queries(t)
        prompted = self.soft_prompt is not None and self.first_stage and context is None
        if not self.first_stage:  # a later pipeline stage: the input is hidden states
            x = tokens_BT
            t *= self.sequence_shards  # (sequence parallelism: this rank's slice of them)
        elif prompted:
            x, positions_BT, key_valid_BS = self._prompted(
                tokens_BT, positions_BT, key_valid_BS, start
            )
            t, prompted = x.shape[1] * self.sequence_shards, start == 0  # (its slice's)
        else:
            x = self._embed(tokens_BT, positions_BT, start, t)
        rope = self._rope(positions_BT, start, t, length)
        bias = self._attention_bias(t, start, key_valid_BS, x.device, segments_BT, context, static)
        stats = []
        for block in self.layers.values():
            x, layer_stats = block(x, rope, bias, cache)
            if layer_stats is not None:
                stats.append(layer_stats)
        index = context.index if context is not None else None
        depths = mtp_depths(self, x, mtp_tokens_BT, rope, bias, stats, index)
        if self.router_sink is not None and stats and not router_stats:
            x = self.router_sink(x, stats)  # (the MTP modules' MoE blocks among them)
        _advance(cache, t)
        # the prompt's own outputs are never scored or sampled (cut where the head is; a
        # context split keeps them, out of the loss)
        passed = self.prompt_passed and start == 0 and context is None
        cut = (prompted or passed) and self.final_norm is not None
        out = self._scored(x, cut, last_only)
        out = (out, *depths) if depths else out
        return (out, stats) if router_stats else out

    def _scored(self, x: torch.Tensor, cut: bool, last_only: bool) -> torch.Tensor:
        """The head's outputs, the prompt's own positions ``cut``: before the head, or after
        it under sequence parallelism (whose head gathers the slices first)."""
        n, sliced = self.args.soft_prompt_tokens, self.sequence_shards > 1
        if cut and not sliced:
            x = x[:, n:]
        out = self._head(x[:, -1:] if last_only else x)
        return out[:, n:] if cut and sliced and not last_only else out

    def _context(
        self,
        context: ContextShard | None,
        positions_BT: torch.Tensor | None,
        segments_BT: torch.Tensor | None,
    ) -> tuple[ContextShard | None, torch.Tensor | None, int | None]:
        """The shard a forward runs under (given, or a pipeline stage's), the positions (its
        tokens' in the whole sequence, unless given) and the whole sequence's length. A
        stage's shard serves every micro-batch: the keys' documents are gathered for each."""
        context = context if context is not None else self.stage_context
        if context is None:
            return None, positions_BT, None
        if segments_BT is not None and context.key_segments is None:
            context = context.with_key_segments(segments_BT)
        return context, context.index if positions_BT is None else positions_BT, context.length

    def _prompted(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None,
        key_valid_BS: torch.Tensor | None,
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The embeddings with the soft prompt before the text (on a forward from position 0),
        the positions of what is returned and the keys that are real. The prompt holds
        positions 0..n-1 and the text n onwards; as GPT-NeoX, prompt and text are cut to
        seq_length (a training sample loses its last n tokens; generation stays within it)."""
        n = self.args.soft_prompt_tokens
        b = tokens_BT.shape[0]
        keep = self.args.seq_length - n
        if start == 0 and tokens_BT.shape[1] > keep:
            tokens_BT = tokens_BT[:, :keep]
            positions_BT = None if positions_BT is None else positions_BT[..., :keep]
            key_valid_BS = None if key_valid_BS is None else key_valid_BS[:, :keep]
        text_pos = None if positions_BT is None else positions_BT + n
        t = tokens_BT.shape[1]
        # (sequence parallelism's slice is taken of prompt and text together, below)
        x = self._embed(tokens_BT, text_pos, start + n if start == 0 else start, t, start != 0)
        if key_valid_BS is not None:
            ones = torch.ones(b, n, dtype=key_valid_BS.dtype, device=key_valid_BS.device)
            key_valid_BS = torch.cat([ones, key_valid_BS], dim=1)
        if start != 0:  # decoding: the prompt is in the cache already
            return x, text_pos, key_valid_BS
        prompt = self.soft_prompt.weight.to(x.dtype)
        x = torch.cat([prompt[None].expand(b, -1, -1), x], dim=1)
        if self.embedded_output is not None:
            x = self.embedded_output(x)
        if text_pos is not None:
            head = torch.arange(n, device=x.device).expand(*text_pos.shape[:-1], n)
            text_pos = torch.cat([head, text_pos], dim=-1)
        return x, text_pos, key_valid_BS

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.final_norm is None:  # an earlier pipeline stage: hand on the hidden states
            return x
        x = self.final_norm(x)
        if self.value_head is not None:
            return self.value_head(x)
        return self.logits(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output head's logits of normalised hidden states."""
        mup = self.args.mup
        if mup is not None:  # muP's readout: the hidden states / width_mult (and the temperature)
            x = x / (mup.width_mult * mup.output_temp)
        if self.output is None:
            if self.tied_head_input is not None:
                x = self.tied_head_input(x)
            return linear(x, self.embed.weight, mode=self.args.cpu_matmul)
        return self.output(x)

    def _embed(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None,
        start: int,
        t: int,
        sliced: bool = True,
    ) -> torch.Tensor:
        """The tokens' embeddings, positions added; under sequence parallelism with whole
        embeddings first (``embedded_output``), this rank's slice unless not ``sliced``."""
        x = self.embed(tokens_BT)
        if self.pos_embed is not None or self.args.pos_emb == "sinusoidal":
            pos = (
                positions_BT
                if positions_BT is not None
                else torch.arange(start, start + t, device=x.device)
            )
            if self.pos_embed is not None:
                positional = self.pos_embed(pos + self.args.pos_offset)
            else:
                positional = self.sin_table[pos].to(x.dtype)
            mult = self.args.rp_embedding_mult
            x = x + (positional if mult == 1 else positional * mult)
        x = self.embed_dropout(x)
        if self.args.mup is not None and self.args.mup.embedding_mult != 1:
            x = x * self.args.mup.embedding_mult
        if self.soft_prompt is not None and positions_BT is not None and positions_BT.dim() == 1:
            # a context rank's chunks of [prompt, text]: positions below n are the prompt's
            n = self.args.soft_prompt_tokens
            rows = self.soft_prompt.weight.to(x.dtype)[positions_BT.clamp(max=n - 1)]
            x = torch.where((positions_BT < n)[:, None], rows, x)
        if sliced and self.embedded_output is not None:
            x = self.embedded_output(x)
        return x


def build_model(
    args: ModelArgs, device: torch.device | str = "cpu", seed: int | None = None
) -> Transformer:
    """A model built on the meta device, materialised on ``device`` and initialised (its
    fp32 CPU linears take ``args.cpu_matmul``'s kernel)."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights(device, seed=seed or 0)
    return model
