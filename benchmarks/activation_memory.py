"""The estimator's activation memory against a measurement, on the CPU. Measured: the bytes of
every tensor storage still alive after the forward pass and loss (what backward will need),
less the parameters, tracked by watching every storage the forward allocates until it is
freed. Estimated: `torchneox estimate`'s activations for the same config (one process), which
come from a fake-tensor trace of what autograd saves.

    python benchmarks/activation_memory.py

Prints one JSON row per config; docs/benchmarks.md keeps the table.
"""

from __future__ import annotations

import json
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchneox.config.load import load_mapping
from torchneox.estimate.search import estimate
from torchneox.models.args import model_args
from torchneox.models.transformer import build_model
from torchneox.parallel.activation_ckpt import apply_activation_checkpointing
from torchneox.train.loss import lm_loss
from torchneox.train.precision import autocast


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive."""

    def __init__(self, ignore: list[torch.Tensor]):
        super().__init__()
        self.live: dict[int, int] = {}
        # parameters: a view of one (weight.t()) is an op output whose storage is theirs
        self.ignore = {t.untyped_storage().data_ptr() for t in ignore}

    def _watch(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.live or key in self.ignore or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        weakref.finalize(storage, self.live.pop, key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self._watch(t)
        return out

    def bytes(self) -> int:
        return sum(self.live.values())


def measure(keys: dict, precision: str, checkpoint: str | None, micro_batch: int) -> dict:
    loaded = load_mapping(keys, "activation-memory")
    model = build_model(model_args(loaded), seed=0).train()
    if checkpoint:
        apply_activation_checkpointing(model, 1, checkpoint)
    seq = keys["seq_length"]
    tokens = torch.randint(0, 200, (micro_batch, seq + 1))
    mode = LiveStorages([*model.parameters(), *model.buffers()])
    with mode, autocast(precision, "cpu"):
        # F.cross_entropy, as on GPUs (what the estimate models), not the CPU's blocked loss
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:], None, blocked=False)
    held = mode.bytes()
    del loss
    cfg = loaded.config
    est = estimate(
        load_mapping(
            keys
            | {
                "train_micro_batch_size_per_gpu": micro_batch,
                "precision": precision,
                "checkpoint_activations": checkpoint is not None,
                "checkpoint_activations_mode": checkpoint or "full",
            },
            "activation-memory",
        ),
        gpus=1,
        gpu="h100",
    )
    estimated = est["activations_after_forward_bytes"]
    return {
        "benchmark": "activation_memory",
        "layers": cfg.model.num_layers,
        "hidden": cfg.model.hidden_size,
        "seq": seq,
        "micro_batch": micro_batch,
        "precision": precision,
        "checkpointing": checkpoint or "none",
        "measured_bytes": held,
        "estimated_bytes": estimated,
        "estimated_over_measured": round(estimated / held, 3),
    }


def main() -> None:
    base = {
        "num_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "seq_length": 256,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "padded_vocab_size": 512,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    llama = base | {
        "gpt_j_residual": False,
        "rotary_pct": 1.0,
        "norm": "rmsnorm",
        "activation": "swiglu",
        "num_kv_heads": 2,
        "use_bias_in_attn_linear": False,
    }
    moe = base | {"moe_num_experts": 8, "moe_top_k": 2, "moe_expert_interval": 2}
    for keys, name in ((base, "pythia-like"), (llama, "llama-like"), (moe, "moe-8x-top2")):
        for precision in ("fp32", "bfloat16"):
            for ckpt in (None, "selective", "full"):
                row = measure(keys, precision, ckpt, micro_batch=4) | {"model": name}
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
