"""GPT-NeoX's ``optimizer`` dict read once: which optimizer, its learning rate, the keyword
arguments torch takes, and how many state tensors it keeps per parameter. The optimizer the
trainer builds, the derived values explain shows and the estimator's optimizer bytes all read
this."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchneox.config.schema import OptimizerConfig

# not keyword arguments of the torch optimizers: clipping comes from gradient_clipping, the
# top-level weight_decay wins (as in GPT-NeoX), Adam's bias correction is always on (false is
# refused; LAMB takes it), amsgrad is false for LAMB (true is refused)
NOT_TORCH_PARAMS = ("lr", "max_grad_norm", "weight_decay", "bias_correction", "amsgrad")
# DeepSpeedCPUAdam's switches, read here (adamw_mode picks AdamW or Adam; its states are fp32
# either way: they follow the fp32 master weights)
CPU_ADAM_SWITCHES = ("adamw_mode", "fp32_optimizer_states")
KEPT_PARAMS = {"adam": ("amsgrad",), "adamw": ("amsgrad",), "lamb": ("bias_correction",)}
# Tensors of a parameter's size each optimizer keeps (SM3's accumulators are one number per
# row, column, ... of a tensor: none of its size)
STATE_TENSORS = {
    "adam": 2, "adamw": 2, "lamb": 2, "lion": 1, "sm3": 0, "cpu_adam": 2, "cpu_torch_adam": 2,
    "muon": 2,
}  # fmt: skip
# Muon's defaults (torch.optim.Muon's, but adjust_lr_fn: match_rms_adamw, so that one lr, the
# schedule's, suits its matrices and AdamW's parameters alike)
MUON_DEFAULTS = {
    "momentum": 0.95,
    "nesterov": True,
    "ns_steps": 5,
    "ns_eps": 1e-7,
    "adjust_lr_fn": "match_rms_adamw",
    "ns_dtype": "bf16",
}


def muon_matrix(name: str, shape: tuple[int, ...] | Any) -> bool:
    """Whether ``muon`` steps the parameter ``name`` (as the unwrapped model names it) with
    Muon: a block's 2-D weight (attention, MLP and mixer projections), not the MoE router's.
    Embeddings, the output head, norms, biases, the experts' 3-D weights and the other
    parameters go to AdamW."""
    return (
        len(shape) == 2
        and name.startswith("layers.")
        and name.endswith(".weight")
        and not name.endswith("router.weight")
    )


@dataclass(frozen=True)
class OptimizerSpec:
    kind: str  # adam | adamw | sgd | lion | sm3 | madgrad_wd | lamb | muon
    type_name: str | None  # as the config spells it (None: no optimizer dict, Adam)
    lr: float | None  # optimizer.params.lr, else lr
    weight_decay: float
    params: dict[str, Any] = field(default_factory=dict)  # optimizer.params as given
    torch_params: dict[str, Any] = field(default_factory=dict)

    @property
    def state_tensors(self) -> int:
        """Tensors of a parameter's size the optimizer keeps: Adam's and LAMB's two moments,
        Lion's one, SGD's and SM3's momentum buffer when they have momentum, MADGRAD's sums of
        gradients and of their squares and, with momentum (0.9 unless given), its x0; muon:
        AdamW's two (its hidden matrices: ``hidden_state_tensors``)."""
        momentum = float(self.params.get("momentum", 0.0) or 0.0)
        if self.kind in ("sgd", "sm3"):
            return 1 if momentum else 0
        if self.kind == "madgrad_wd":
            return 3 if float(self.params.get("momentum", 0.9)) else 2
        return STATE_TENSORS[self.kind]

    @property
    def hidden_state_tensors(self) -> int:
        """Tensors of a parameter's size kept for a hidden matrix (``muon_matrix``): Muon's
        momentum buffer; the other optimizers treat them as any parameter."""
        return 1 if self.kind == "muon" else self.state_tensors


def optimizer_spec(o: OptimizerConfig) -> OptimizerSpec:
    """The optimizer the ``optimizer`` config group describes."""
    opt = o.optimizer
    params = dict((opt or {}).get("params") or {})
    lr = params.get("lr", o.lr)
    kind = str(opt["type"]).lower() if opt is not None else "adam"
    return OptimizerSpec(
        kind=kind,
        type_name=str(opt["type"]) if opt is not None else None,
        lr=lr,
        weight_decay=o.weight_decay,
        params=params,
        torch_params={k: v for k, v in params.items() if _torch_param(kind, k)},
    )


def _torch_param(kind: str, name: str) -> bool:
    if name in CPU_ADAM_SWITCHES:
        return False
    return name not in NOT_TORCH_PARAMS or name in KEPT_PARAMS.get(kind, ())


def describe_optimizer(spec: OptimizerSpec) -> str:
    """What SM3, madgrad_wd, LAMB, cpu_adam and Muon run with, their defaults filled in (config
    explain)."""
    p = spec.params
    if spec.kind == "muon":
        return _describe_muon(p)
    if spec.kind in ("cpu_adam", "cpu_torch_adam"):
        return (
            "DeepSpeed's CPU Adam (GPT-NeoX builds DeepSpeedCPUAdam for both cpu_adam and "
            "cpu_torch_adam), here torch's "
            + (
                "AdamW (adamw_mode true, DeepSpeed's default: decoupled weight decay)"
                if p.get("adamw_mode", True)
                else "Adam (adamw_mode false: weight decay added to the gradient)"
            )
            + ", fp32 state, stepped on the CPU"
        )
    if spec.kind == "sm3":
        return (
            f"SM3 (GPT-NeoX's): momentum {p.get('momentum', 0.0):g}, beta "
            f"{p.get('beta', 0.0):g}, eps {p.get('eps', 1e-30):g}, no weight decay"
        )
    if spec.kind == "madgrad_wd":
        return (
            f"MADGRAD with decoupled weight decay p *= 1 - (lr + eps) * weight_decay "
            f"(GPT-NeoX's madgrad_wd): momentum {p.get('momentum', 0.9):g}, "
            f"eps {p.get('eps', 1e-6):g}"
        )
    betas = p.get("betas", (0.9, 0.999))
    eps = f"eps {p.get('eps', 1e-8):g} " + (
        "inside the square root" if p.get("eps_inside_sqrt") else "outside the square root"
    )
    return (
        f"LAMB (DeepSpeed's FusedLamb, in torch): betas ({betas[0]:g}, {betas[1]:g}), {eps}, "
        f"trust ratio clamped to [{p.get('min_coeff', 0.01):g}, {p.get('max_coeff', 10.0):g}], "
        f"bias correction {'on' if p.get('bias_correction', True) else 'off'}"
    )


def _describe_muon(p: dict[str, Any]) -> str:
    m = MUON_DEFAULTS | p
    betas = p.get("betas", (0.9, 0.999))
    adamw_lr = (
        f"adamw_lr {p['adamw_lr']:g} (scaled by the schedule as lr)" if "adamw_lr" in p else "lr"
    )
    return (
        f"torchneox's Muon: torch.optim.Muon on the blocks' 2-D weights (momentum "
        f"{m['momentum']:g}{', nesterov' if m['nesterov'] else ''}, {m['ns_steps']} "
        f"Newton-Schulz steps in {m['ns_dtype']}, eps {m['ns_eps']:g}, lr adjusted by "
        f"{m['adjust_lr_fn']}), "
        f"AdamW (betas ({betas[0]:g}, {betas[1]:g}), eps {p.get('eps', 1e-8):g}, {adamw_lr}) "
        "on embeddings, the output head, norms, biases, the MoE router and experts; "
        "under ZeRO and tensor parallelism each matrix's update is gathered whole on every "
        "rank, orthogonalised, and each rank keeps its shard's part"
    )
