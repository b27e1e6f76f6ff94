"""The batches of a reinforce run: rollouts (a prompt, its completions and their rewards) made
into training rows as GPT-NeoX's OnlineDataset makes them, each data-parallel rank its own.

Every ``rollout_updates`` steps a rank takes a new rollout batch of micro-batch x accumulation
rows; each later step of the cycle trains on the same rows again. A row is the prompt and one
completion, padded with 0 to seq_length + 1, labelled -100 on the prompt and the padding, with
the completion's advantage (train/rl/reinforce.py) and raw reward. The rollouts come from a
source: sampled in the run from the policy (``SampledRollouts``, rollout_prompts), or asked of
GPT-NeoX's data servers (``ServedRollouts``, dataset_impl online).

What a resumed run needs to go on as if never stopped is the loader's state: the steps taken,
the reward history of the baseline, the rows not yet used (a data server's answer is consumed
across steps) and the current cycle's rows with the sampling policy's log-probabilities; it is
gathered from every data-parallel rank into the checkpoint's metadata.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchneox.base.errors import DataError
from torchneox.data.loader import stack
from torchneox.train.rl.reinforce import advantage_mode, advantages

IGNORE = -100


@dataclass
class Row:
    """One completion as a training row's parts."""

    prompt: list[int]
    completion: list[int]
    advantage: float
    reward: float


def row_arrays(row: Row, seq_length: int) -> dict[str, np.ndarray]:
    """GPT-NeoX's online sample: prompt + completion padded with 0 to seq_length + 1 (a longer
    one cut there), labels -100 on the prompt and the padding."""
    width = seq_length + 1
    text = (row.prompt + row.completion)[:width]
    label = ([IGNORE] * len(row.prompt) + row.completion)[:width]
    pad = width - len(text)
    return {
        "text": np.asarray(text + [0] * pad, dtype=np.int64),
        "label": np.asarray(label + [IGNORE] * pad, dtype=np.int64),
        "advantage": np.asarray([row.advantage], dtype=np.float32),
        "raw_reward": np.asarray([row.reward], dtype=np.float32),
    }


class RolloutBatches:
    """The train (or valid/test) loader of a reinforce run, for one data-parallel rank:
    ``next()`` gives the step's ``gas`` micro-batches of ``micro_batch`` rows.

    ``source.make(index)``: the groups of rollout batch ``index`` (sampled, or one answer of a
    data server); ``old_logp(micro_batches)``: the sampling policy's log-probabilities of each
    micro-batch's tokens, needed when a batch trains more than one step."""

    console = ("completion_length", "rollout_tokens_per_sec")
    """The batch's statistics the console line shows (all of ``stats`` are logged)."""

    def __init__(
        self,
        source: Any,
        rollout: Any,
        micro_batch: int,
        gas: int,
        seq_length: int,
        dp_rank: int,
        dp_size: int,
        old_logp: Callable[[list[dict]], list[torch.Tensor]] | None = None,
        updates: int = 1,
    ):
        self.source, self.mode = source, advantage_mode(rollout)
        self.micro_batch, self.gas, self.seq_length = micro_batch, gas, seq_length
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.old_logp, self.updates = old_logp, updates
        self.steps = 0  # next() calls so far
        self.made = 0  # rollout batches asked of the source so far
        self.history: list[float] = []  # the baseline's earlier prompt means
        self.pending: list[Row] = []  # rows received, not yet trained on
        self.cycle: list[Row] = []  # the rows of the current rollout batch
        self.cycle_logp: list[list[float]] | None = None
        self.batches: list[dict] | None = None
        self.stats: dict[str, float] = {}

    # ------------------------------------------------------------------ batches

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.gas

    def next(self) -> list[dict[str, torch.Tensor]]:
        if self.steps % self.updates == 0 or not self.cycle:  # a new rollout batch (or healed)
            self._new_cycle()
            self.batches = None
        if self.batches is None:  # (or the current one, resumed)
            self.batches = self._micro_batches()
        self.steps += 1
        return self.batches

    def has_full_batch(self) -> bool:
        return True  # a source never runs dry

    def rewound(self) -> None:
        """The run went back to its last checkpoint past a loss spike (spike_action rewind):
        the rest of the rollout batch the spike trained on is skipped with it (rollout_updates
        above 1), so the next step samples a new one from the rewound policy, not the policy the
        rewind threw away."""
        self.steps = -(-self.steps // self.updates) * self.updates

    def _new_cycle(self) -> None:
        began, tokens = time.perf_counter(), 0
        while len(self.pending) < self.rows_per_step:
            groups = self.source.make(self.made)
            self.made += 1
            for g in groups:
                self.pending += self._rows(g)
                tokens += sum(len(c) for c in g.completions)
        self.cycle = self.pending[: self.rows_per_step]
        self.pending = self.pending[self.rows_per_step :]
        self.cycle_logp = None
        seconds = time.perf_counter() - began
        lengths = [len(r.completion) for r in self.cycle]
        rewards = [r.reward for r in self.cycle]
        self.stats = {
            "completion_length": float(np.mean(lengths)),
            "rollout_reward_std": float(np.std(rewards)),
            "rollout_s": seconds,
            "rollout_tokens_per_sec": tokens / seconds if seconds > 0 else 0.0,
        }

    def _rows(self, g: Any) -> list[Row]:
        adv = advantages(list(g.rewards), self.mode, self.history)
        return [
            Row(list(g.prompt), list(c), float(a), float(r))
            for c, a, r in zip(g.completions, adv, g.rewards, strict=True)
        ]

    def _micro_batches(self) -> list[dict[str, torch.Tensor]]:
        mb = self.micro_batch
        rows = [row_arrays(r, self.seq_length) for r in self.cycle]
        out = [stack(rows[m * mb : (m + 1) * mb]) for m in range(self.gas)]
        if self.updates > 1:
            if self.cycle_logp is None:
                logps = self.old_logp(out)
                self.cycle_logp = [row for t in logps for row in t.float().cpu().tolist()]
            for m, batch in enumerate(out):
                rows = self.cycle_logp[m * mb : (m + 1) * mb]
                batch["old_logp"] = torch.tensor(rows, dtype=torch.float32)
        return out

    # ------------------------------------------------------------------- state

    def _own_state(self) -> dict[str, Any]:
        def rows(rs: list[Row]) -> list[list[Any]]:
            return [[r.prompt, r.completion, r.advantage, r.reward] for r in rs]

        return {
            "dp_rank": self.dp_rank,
            "history": list(self.history),
            "pending": rows(self.pending),
            "cycle": rows(self.cycle),
            "cycle_logp": self.cycle_logp,
            "stats": dict(self.stats),
        }

    def state_dict(self) -> dict[str, Any]:
        """Collective when distributed: every data-parallel rank's state, in rank order."""
        own = self._own_state()
        ranks = [own]
        if dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, own)
        by_rank = {}
        for state in ranks:
            by_rank.setdefault(state["dp_rank"], state)
        return {
            "steps": self.steps,
            "made": self.made,
            "ranks": [by_rank[r] for r in sorted(by_rank)],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ranks = state["ranks"]
        if len(ranks) != self.dp_size:
            raise DataError(
                f"the checkpoint's rollouts were made by {len(ranks)} data-parallel rank(s), "
                f"this run has {self.dp_size}; resume a reinforce run with the same number"
            )
        mine = ranks[self.dp_rank]
        self.steps, self.made = int(state["steps"]), int(state["made"])
        self.history = [float(x) for x in mine["history"]]
        self.pending = [Row(*r) for r in mine["pending"]]
        self.cycle = [Row(*r) for r in mine["cycle"]]
        self.cycle_logp = mine["cycle_logp"]
        self.stats = dict(mine.get("stats", {}))
        self.batches = None

    def heal_state(self) -> dict[str, Any]:
        """What a replica group restarted after a failure takes from this live one (not
        collective: torchft asks for it in its quorum thread): the position alone. The rows
        and the baseline's history are this rank's own; the healed one's are its own."""
        return {"steps": self.steps, "made": self.made}

    def heal(self, state: dict[str, Any]) -> None:
        """A live group's position (``heal_state``), this group's own rows dropped: the rest of
        the current rollout batch is sampled anew, for this rank's prompts of that batch, from
        the healed policy; the baseline's history stays this rank's (its checkpoint's, or
        none)."""
        self.steps, made = int(state["steps"]), int(state["made"])
        self.pending, self.cycle, self.cycle_logp, self.batches = [], [], None, None
        mid = self.steps % self.updates != 0  # (next() then samples the current batch again)
        self.made = made - 1 if mid and made > 0 else made

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
