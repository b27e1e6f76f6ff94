"""Mixture of experts: a router sends each token to ``top_k`` of ``num_experts`` MLPs, and every
token reaches its experts (dropless: no capacity factor, nothing dropped).

The experts' weights are stacked ([experts, in, out]); tokens are sorted by expert and the
experts run as grouped GEMMs (``F.grouped_mm``, one kernel for all experts) or, as the
reference, one matmul per expert; a test holds them equal.

The layer is written for one device. It always hands its rows to a token dispatcher: the
default, ``LocalTokenDispatcher``, does no communication; expert parallelism swaps in an
all-to-all one from ``parallel/expert_parallel.py``. ``forward`` returns the output and the
router's statistics (``RouterStats``); the training side sums them over the ranks that split
the batch and turns them into Switch Transformer's load-balancing loss (``balancing_loss``:
experts x sum over experts of token share x mean router probability, 1.0 when balanced).

Routing is GPT-NeoX's ``moe_router_type`` (see ``MoE.route``). GPT-NeoX adds no
load-balancing loss; torchneox computes it always (it is logged) and adds it with the weight
``moe_aux_loss_coeff``, 0 by default.

torchneox's own routing options, for the top-k router (none of them GPT-NeoX's; their defaults
route as it does): sigmoid scores (``moe_score_func``, DeepSeek-V3), DeepSeek-V3's
auxiliary-loss-free balancing (``moe_router_bias_update_rate``: a per-expert bias, the
``router_bias`` buffer, added to the scores to choose the experts but not to weight them, and
moved after each step by ``update_router_bias``), and shared experts (an always-on MLP beside
the routed ones, ``shared_expert``, optionally scaled by Qwen2-MoE's sigmoid gate
``shared_expert_gate``); and DeepSeek-V3's group-limited routing (``moe_expert_groups``,
``moe_topk_groups``), its scaled gates (``moe_routed_scaling_factor``) and experts of their own
width (``moe_intermediate_size``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from torchneox.models.args import ModelArgs
from torchneox.models.linear import Linear
from torchneox.models.lora import expert_term
from torchneox.models.mlp import ACTIVATIONS, MLP


def sinkhorn(cost_NE: torch.Tensor, tol: float | None = 1e-4, max_iter: int = 3) -> torch.Tensor:
    """GPT-NeoX's Sinkhorn balancing of exp(cost): at most ``max_iter`` rounds of row and
    column scaling, stopping early once the column scales move by less than ``tol`` on
    average (the same starting scales, epsilon and stopping rule as its SinkhornRouter);
    ``tol=None`` always runs ``max_iter`` rounds."""
    eps = 1e-8
    cost = torch.exp(cost_NE)
    d0 = torch.ones(cost.shape[0], device=cost.device, dtype=cost.dtype)
    d1 = 1 / (cost.shape[1] * cost.sum(0))
    d1_old = d1
    for _ in range(max_iter):
        d0 = (1 / d0.shape[0]) * 1 / ((d1 * cost).sum(1) + eps)
        d1 = (1 / d1.shape[0]) * 1 / ((d0[:, None] * cost).sum(0) + eps)
        if tol is not None and (d1_old - d1).abs().mean() < tol:
            break
        d1_old = d1
    return d1 * cost * d0[:, None]


def expert_loop(
    x_TH: torch.Tensor, w_EHF: torch.Tensor, counts: list[int], bias_EF: torch.Tensor | None
) -> torch.Tensor:
    """The reference: one matmul per expert over its rows of the expert-sorted tokens."""
    outs, start = [], 0
    for e, n in enumerate(counts):
        y = x_TH[start : start + n] @ w_EHF[e]
        outs.append(y if bias_EF is None else y + bias_EF[e])
        start += n
    return torch.cat(outs) if outs else x_TH.new_zeros(0, w_EHF.shape[-1])


def grouped_fits(x_TH: torch.Tensor, w_EHF: torch.Tensor) -> bool:
    """Whether the grouped GEMM takes these shapes: its rows must be 16-byte aligned."""
    size = x_TH.element_size()
    return (x_TH.shape[-1] * size) % 16 == 0 and (w_EHF.shape[-1] * size) % 16 == 0


def expert_grouped(
    x_TH: torch.Tensor, w_EHF: torch.Tensor, counts: list[int], bias_EF: torch.Tensor | None
) -> torch.Tensor:
    """All experts in one grouped GEMM (``offs``: where each expert's rows end)."""
    offsets = torch.tensor(counts, device=x_TH.device).cumsum(0).to(torch.int32)
    w = w_EHF.to(x_TH.dtype) if w_EHF.dtype != x_TH.dtype else w_EHF
    y = F.grouped_mm(x_TH, w, offs=offsets)
    if bias_EF is not None:
        expert_of_row = torch.repeat_interleave(
            torch.arange(len(counts), device=x_TH.device),
            torch.tensor(counts, device=x_TH.device),
        )
        y = y + bias_EF.to(y.dtype)[expert_of_row]
    return y


class RouterStats(NamedTuple):
    """What one MoE layer's router did with one forward's tokens."""

    tokens_per_expert: torch.Tensor  # [E] assignments (long, no gradient)
    prob_sum: torch.Tensor  # [E] router probabilities summed over the tokens (fp32, with grad)
    tokens: int
    top_k: int


def balancing_loss(stats: RouterStats) -> torch.Tensor:
    """Switch Transformer's load-balancing loss: E x sum_e (share of assignments to e) x (mean
    probability of e); ``stats`` summed over every rank that holds part of the batch."""
    experts, tokens = stats.tokens_per_expert.numel(), float(stats.tokens)
    share = stats.tokens_per_expert.float() / max(tokens * stats.top_k, 1.0)
    return experts * (share * stats.prob_sum / max(tokens, 1.0)).sum()


def update_router_bias(
    bias_E: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float
) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: each expert's bias moves by
    ``rate`` towards balance, up where the expert took fewer than the mean assignments of the
    step, down where it took more, unchanged where exactly the mean (the sign of mean - load;
    Megatron's ``get_updated_expert_bias``). ``tokens_per_expert``: the whole step's load."""
    load = tokens_per_expert.to(torch.float64)
    bias_E.add_(torch.sign(load.mean() - load).to(bias_E.dtype), alpha=rate)
    return bias_E


class LocalTokenDispatcher:
    """Every expert on this device: rows go to them as they are, with nothing sent."""

    def count(self, experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
        """Assignments per expert, as a tensor and as the list the expert GEMMs split by."""
        counts_t = torch.bincount(experts, minlength=num_experts)
        return counts_t, counts_t.tolist()

    def dispatch(
        self, rows: torch.Tensor, counts_t: torch.Tensor, counts: list[int]
    ) -> tuple[torch.Tensor, list[int], object]:
        """Expert-sorted rows -> (the rows this device's experts take, per-expert counts, what
        ``combine`` needs to send the results back)."""
        return rows, counts, None

    def combine(self, out_rows: torch.Tensor, route: object) -> torch.Tensor:
        return out_rows

    def local(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        """This device's part of an expert weight."""
        return weight


class MoE(nn.Module):
    """The MLP of an MoE layer. State dict: router.weight [E, H]; experts_up, experts_gate
    [E, H, F]; experts_down [E, F, H]; and their biases when the model's MLPs have them; with
    the options, router_bias [E] (a buffer), shared_expert.{up,gate,down}.weight (an MLP of
    width moe_shared_width) and shared_expert_gate.weight [1, H]."""

    sinkhorn_tol: float | None = 1e-4
    """GPT-NeoX's early-stopping tolerance of the Sinkhorn rounds (None: always all three)."""

    grouped: bool | None = None
    """True: F.grouped_mm; False: the per-expert loop; None: grouped on GPUs, and on CPUs from
    16 experts up (below that the loop is faster there: benchmarks/moe.py)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        e, h, w = args.moe_num_experts, args.hidden_size, args.expert_width
        self.num_experts, self.top_k = e, args.moe_top_k
        self.router_type = args.moe_router_type
        self.jitter = args.moe_jitter_eps
        self.renormalize = args.moe_renormalize
        self.score_func = args.moe_score_func
        self.bias_rate = args.moe_bias_update_rate
        self.groups, self.topk_groups = args.moe_groups, args.moe_topk_groups
        self.routed_scale = args.moe_routed_scale
        self.act = ACTIVATIONS[args.activation]
        self.router = Linear(h, e, bias=False)
        # saved with the weights (a resume routes as the run did); None without the option
        bias = torch.zeros(e, dtype=torch.float32) if self.bias_rate > 0 else None
        self.register_buffer("router_bias", bias)
        self.experts_up = nn.Parameter(torch.empty(e, h, w))
        self.experts_gate = nn.Parameter(torch.empty(e, h, w)) if args.gated else None
        self.experts_down = nn.Parameter(torch.empty(e, w, h))
        bias = args.mlp_bias
        self.experts_up_bias = nn.Parameter(torch.empty(e, w)) if bias else None
        self.experts_gate_bias = nn.Parameter(torch.empty(e, w)) if bias and args.gated else None
        self.experts_down_bias = nn.Parameter(torch.empty(e, h)) if bias else None
        self.dispatcher = LocalTokenDispatcher()
        shared = args.moe_shared_width
        self.shared_expert = MLP(replace(args, mlp_width=shared)) if shared else None
        self.shared_expert_gate = Linear(h, 1, bias=False) if args.moe_shared_gate else None

    def init_buffers(self, device: torch.device | str) -> None:
        """The bias starts at zero (after ``to_empty``; a checkpoint then brings its own)."""
        if self.router_bias is not None:
            self.router_bias = torch.zeros(self.num_experts, dtype=torch.float32, device=device)

    @torch.no_grad()
    def update_router_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Move the bias by the step's load (summed over every rank that split the batch)."""
        if self.router_bias is not None:
            update_router_bias(self.router_bias, tokens_per_expert, self.bias_rate)

    def _experts(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by (this device's) expert through their experts' MLPs (and their LoRA
        adapters, models/lora.py)."""
        local = self.dispatcher.local
        grouped = self.grouped
        if grouped is None:
            grouped = rows.device.type != "cpu" or len(counts) >= 16
        grouped = grouped and grouped_fits(rows, self.experts_up)  # the down product's too

        def pick(x: torch.Tensor, w: torch.Tensor):
            return expert_grouped if grouped and grouped_fits(x, w) else expert_loop

        def product(x: torch.Tensor, which: str) -> torch.Tensor:
            w = local(getattr(self, f"experts_{which}"))
            out = pick(x, w)(x, w, counts, local(getattr(self, f"experts_{which}_bias")))
            adapter = self._modules.get(f"experts_{which}_lora")
            term = expert_term(adapter, x, counts, local, pick)
            return out if term is None else out + term.to(out.dtype)

        up = product(rows, "up")
        if self.experts_gate is not None:
            hidden = self.act(product(rows, "gate")) * up
        else:
            hidden = self.act(up)
        return product(hidden, "down")

    def route(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(experts [T, k], gates [T, k], router probabilities [T, E]), as GPT-NeoX routes:
        ``topk`` takes the k largest softmax probabilities (jittered inputs while training);
        ``sinkhorn`` scores experts by the sigmoid of the logits (k = 1) or their softmax
        (k > 1), and while training picks them from the Sinkhorn-balanced logits. With
        ``moe_renormalize_top_k`` (Mixtral) the k gates are divided by their sum."""
        if self.training and self.jitter and self.router_type == "topk":
            noise = torch.empty_like(x_TH).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
            x_TH = x_TH * noise
        logits = self.router(x_TH)
        if self.router_type == "topk" and (
            self.score_func != "softmax"
            or self.router_bias is not None
            or self.groups > 1
            or self.routed_scale != 1.0
        ):
            return self._route_scored(logits)
        probs = logits.float().softmax(-1)
        if self.router_type == "sinkhorn":
            scores = torch.sigmoid(logits.float()) if self.top_k == 1 else probs
            if self.training:
                with torch.no_grad():
                    balanced = sinkhorn(logits.detach().float(), self.sinkhorn_tol)
                    experts = balanced.topk(self.top_k, dim=-1).indices
                gates = scores.gather(-1, experts)
            else:
                gates, experts = scores.topk(self.top_k, dim=-1)
        else:
            gates, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        return experts, gates, probs

    def _route_scored(
        self, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The top-k router with torchneox's options (DeepSeek-V3's): softmax or sigmoid
        scores; the experts chosen by score + router_bias, weighted by the score alone;
        renormalised with ``moe_renormalize_top_k``. The probabilities the balancing loss
        reads are the scores divided by their sum (DeepSeek-V3's normalised sigmoid). With
        moe_expert_groups, the experts come from the best groups only; the gates are then
        multiplied by moe_routed_scaling_factor."""
        logits = logits.float()
        if self.score_func == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = logits.softmax(-1)
        choose = scores.detach()
        if self.router_bias is not None:
            choose = choose + self.router_bias
        if self.groups > 1:
            choose = self._best_groups(choose)
        experts = choose.topk(self.top_k, dim=-1).indices
        gates = scores.gather(-1, experts)
        if self.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        return experts, gates * self.routed_scale, probs

    def _best_groups(self, choose_TE: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's group-limited routing: each group of experts scored by the sum of its
        two best selection scores; the experts outside a token's moe_topk_groups best groups
        set to -inf."""
        t, size = choose_TE.shape[0], self.num_experts // self.groups
        grouped = choose_TE.view(t, self.groups, size)
        group_scores = grouped.topk(min(2, size), dim=-1).values.sum(-1)
        best = group_scores.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(t, -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        shape = x.shape
        x_TH = x.reshape(-1, shape[-1])
        experts, gates, probs = self.route(x_TH)
        # every (token, choice) pair, sorted by expert
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts_t, counts = self.dispatcher.count(flat, self.num_experts)
        token_of_row = order // self.top_k
        rows, counts, route = self.dispatcher.dispatch(x_TH[token_of_row], counts_t, counts)
        out_rows = self.dispatcher.combine(self._experts(rows, counts), route)
        weighted = out_rows * gates.reshape(-1)[order, None].to(out_rows.dtype)
        out = torch.zeros(x_TH.shape[0], shape[-1], dtype=weighted.dtype, device=x.device)
        out.index_add_(0, token_of_row, weighted)
        stats = RouterStats(counts_t.detach(), probs.sum(0), x_TH.shape[0], self.top_k)
        out = out.reshape(shape).to(x.dtype)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:  # Qwen2-MoE
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out, stats
