"""Where a reinforce run's rollouts come from, for one data-parallel rank.

- ``SampledRollouts`` (rollout_prompts): each rollout batch samples ``rollout_generations``
  completions of the rank's next prompts from the policy as it is now (the module the run
  trains, in its layout: ZeRO shards and tensor-parallel heads included), scores them with the
  reward function or reward model on the first tensor-parallel rank (the rewards broadcast to
  the others, so a reward that is not deterministic cannot split them).
- ``ServedRollouts`` (dataset_impl online): GPT-NeoX's data server of the rank answers the
  first of the ranks that share the data-parallel rank (its pipeline stages and tensor ranks:
  ``model_group``), which sends the answer to the others; GPT-NeoX's loader too runs on one
  model-parallel rank.

The prompts of rollout batch k on rank r are the prompt stream's [(k dp + r) P, ... + P), P
prompts per batch, the stream a fresh permutation of the prompt file per pass (from the seed);
the sampling generator of batch k on rank r is seeded from (seed, k, r), so a resumed run
samples what an unstopped one would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchneox.base.errors import DataError, TrainingStopped


def _broadcast(value: Any, group: Any) -> Any:
    """``value`` of the group's first rank, on every rank of ``group`` (None: one rank)."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def stream_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> 1)


class SampledRollouts:
    def __init__(
        self,
        sample: Callable[[list[list[int]], torch.Generator], list[list[int]]],
        prompts: list[Any],
        score: Callable[[list[Any], list[list[int]]], list[float]],
        per_batch: int,
        generations: int,
        seed: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        group: Any = None,
    ):
        """``sample(prompt_ids, generator)``: one completion per prompt row; ``score(prompts,
        completions)``: their rewards; ``per_batch``: prompts per rollout batch of this rank."""
        self.sample, self.prompts, self.score = sample, prompts, score
        self.per_batch, self.n = per_batch, generations
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.device, self.group = device, group

    def prompt_indices(self, index: int) -> list[int]:
        """The prompt file's records of rollout batch ``index`` on this rank."""
        count = len(self.prompts)
        start = (index * self.dp_size + self.dp_rank) * self.per_batch
        out = []
        for i in range(start, start + self.per_batch):
            epoch, at = divmod(i, count)
            order = np.random.default_rng([self.seed, epoch]).permutation(count)
            out.append(int(order[at]))
        return out

    def make(self, index: int) -> list[Any]:
        from torchneox.data.online import Group

        chosen = [self.prompts[i] for i in self.prompt_indices(index)]
        rows = [p.ids for p in chosen for _ in range(self.n)]
        generator = torch.Generator(device=self.device)
        generator.manual_seed(stream_seed(self.seed, index, self.dp_rank))
        completions = self.sample(rows, generator)
        rewards = None
        if self.group is None or dist.get_rank(self.group) == 0:
            rewards = self.score([p for p in chosen for _ in range(self.n)], completions)
        rewards = _broadcast(rewards, self.group)
        groups = []
        for j, p in enumerate(chosen):
            part = slice(j * self.n, (j + 1) * self.n)
            groups.append(Group(list(p.ids), completions[part], [float(r) for r in rewards[part]]))
        return groups


class ServedRollouts:
    def __init__(self, server: Any, split: str, mode: str, group: Any = None):
        self.server, self.split, self.mode, self.group = server, split, mode, group

    def make(self, index: int) -> list[Any]:
        groups = None
        if self.group is None or dist.get_rank(self.group) == 0:
            groups = self._fetch()
        groups = _broadcast(groups, self.group)
        if self.mode == "rloo":
            for i, g in enumerate(groups):
                if len(g.completions) < 2:
                    raise DataError(
                        f"data server {self.server.address}: record {i} of its '{self.split}' "
                        "answer has one completion; reinforce_leave_one_out compares each "
                        "with the prompt's others, so send at least 2"
                    )
        return groups

    def _fetch(self) -> list[Any]:
        """The server's answer; Ctrl-C interrupts the wait (a second ends the process)."""
        from torchneox.train.rl.interrupt import Interruptible

        what = f"data server {self.server.address}"
        with Interruptible(what) as watch:
            try:
                return self.server.fetch(self.split)
            except KeyboardInterrupt:
                if not watch.interrupted:
                    raise
                raise TrainingStopped(
                    f"{what}: interrupted by SIGINT (Ctrl-C) after {watch.seconds():.0f} s "
                    f"waiting for its answer to '{self.split}'; nothing of this step was saved"
                ) from None


# ------------------------------------------------------------------------------ building


def model_group(dims: Any) -> Any:
    """The process group of the ranks that share this rank's data-parallel rank (its pipeline
    stages, context and tensor ranks), which make and use one rollout batch; None when it is
    alone."""
    names = tuple(n for n in ("pp", "cp", "tp") if getattr(dims, n) > 1)
    if not names:
        return None
    if len(names) == 1:
        return dims.mesh[names[0]].get_group()
    return dims.mesh[names]._flatten("_".join(names)).get_group()


def build_rollouts(run: Any, module: torch.nn.Module, line: Callable[[str], None]) -> dict:
    """The reinforce run's loaders by split (``run``: the trainer), from its config: sampled in
    the run when rollout_prompts is set, else from the data servers (valid and test too)."""
    from torchneox.data.online import DataServer, check_addresses
    from torchneox.train.replicas import data_share
    from torchneox.train.rl.reinforce import advantage_mode
    from torchneox.train.rl.rollouts import RolloutBatches

    cfg, lay, dims = run.cfg, run.layout, run.dims
    share = data_share(cfg, dims)  # replica groups: group g's ranks as data ranks g x dp ..
    r = cfg.rollout
    group = model_group(dims)
    common = dict(
        rollout=r,
        micro_batch=lay.micro_batch,
        gas=lay.gas,
        seq_length=cfg.model.seq_length,
        dp_rank=dims.dp_rank,
        dp_size=dims.dp,
    )
    mode = advantage_mode(r)
    old = _old_logp(run, module) if r.rollout_updates > 1 else None
    if r.rollout_prompts:
        source = _sampled(run, module, line, group, share)
        train = RolloutBatches(source, **common, old_logp=old, updates=r.rollout_updates)
        if cfg.training.eval_iters:
            line("reinforce: rollouts sampled in the run have no valid or test split; "
                 "eval_iters is not used (the reward of each step is logged)")  # fmt: skip
        return {"train": train}
    source = run.loaded.source("online_dataserver_ports")
    check_addresses(r.online_dataserver_ips, r.online_dataserver_ports, share["dp_size"], source)
    server = DataServer(
        r.online_dataserver_ips, r.online_dataserver_ports, share["dp_rank"],
        r.online_dataserver_timeout, run.derived["padded_vocab_size"],
    )  # fmt: skip
    if cfg.rollout.serve_model_weights:
        line("serve_model_weights: torchneox sends no weights to the data server, which "
             "samples with its own; set rollout_prompts to sample from the policy in the run")  # fmt: skip
    out = {"train": RolloutBatches(ServedRollouts(server, "train", mode, group), **common,
                                   old_logp=old, updates=r.rollout_updates)}  # fmt: skip
    if cfg.training.eval_iters:
        for split in ("valid", "test"):
            out[split] = RolloutBatches(ServedRollouts(server, split, mode, group), **common)
    return out


def _sampled(
    run: Any, module: torch.nn.Module, line: Callable[[str], None], group: Any, share: dict
):
    from torchneox.data.prompts import read_prompts
    from torchneox.data.tokenizers import build_tokenizer
    from torchneox.inference.generate import Sampling, generation_stop_ids, sample_policy
    from torchneox.parallel.collectives import any_rank
    from torchneox.train.precision import autocast

    cfg, dims = run.cfg, run.dims
    r, tok = cfg.rollout, build_tokenizer(cfg.tokenizer)
    chat = (
        cfg.tokenizer.vocab_file if str(cfg.tokenizer.vocab_file or "").endswith(".json") else None
    )
    prompts = read_prompts(r.rollout_prompts, tok, chat)
    room = cfg.model.seq_length + 1 - r.rollout_max_new_tokens
    long = sum(len(p.ids) > room for p in prompts)
    prompts = [dataclasses.replace(p, ids=p.ids[-room:]) if len(p.ids) > room else p
               for p in prompts]  # fmt: skip
    if long:
        line(f"rollout_prompts: {long} prompt(s) longer than seq_length + 1 - "
             f"rollout_max_new_tokens = {room} tokens keep their last {room}")  # fmt: skip
    stops = {tok.eod_id} | generation_stop_ids(cfg.tokenizer.vocab_file)
    s = Sampling(r.rollout_temperature, r.rollout_top_k, r.rollout_top_p,
                 r.rollout_max_new_tokens, stops)  # fmt: skip
    pad = tok.pad_id if tok.pad_id is not None else tok.eod_id
    lockstep = None
    if dims.distributed:
        lockstep = lambda done: not any_rank(not done, dims, run.device)  # noqa: E731

    if run.parts.pipeline is not None:  # the stages as one module, without a cache
        from torchneox.parallel.pipeline import PipelineLogits

        module = PipelineLogits(run.parts.pipeline, dims.mesh["pp"], run.device)
        s = dataclasses.replace(s, use_cache=False)

    def sample(rows: list[list[int]], generator: torch.Generator) -> list[list[int]]:
        with autocast(run.precision, run.device.type):  # the cache in the forward's dtype
            return sample_policy(module, rows, s, pad, generator, dims.tp, lockstep)

    score = _scorer(
        cfg, run.loaded.origin, tok, stops, run.device, run.derived["padded_vocab_size"]
    )
    per_batch = run.layout.micro_batch * run.layout.gas // r.rollout_generations  # (derive checked)
    return SampledRollouts(sample, prompts, score, per_batch, r.rollout_generations,
                           cfg.training.seed, share["dp_rank"], share["dp_size"], run.device,
                           group)  # fmt: skip


def _scorer(cfg: Any, origin: dict, tok: Any, stops: set[int], device: torch.device, vocab: int):
    """rewards(prompts, completion ids): the reward function on the texts (a completion without
    its stop token), or the reward model on the ids (its tokenizer the policy's, its vocabulary
    holding the policy's ``vocab`` ids)."""
    from pathlib import Path

    r = cfg.rollout
    if r.reward_model:
        from torchneox.train.rl.rewards import RewardModelScorer

        model = RewardModelScorer(r.reward_model, device, policy=cfg.tokenizer, policy_vocab=vocab)
        return lambda prompts, completions: model(
            [p.ids for p in prompts], completions, [p.text for p in prompts]
        )
    from torchneox.train.rl.rewards import RewardFunction

    source = origin.get("reward_function")
    config_dir = Path(source).parent if source and Path(source).is_file() else None
    fn = RewardFunction(r.reward_function, config_dir)

    def score(prompts: list[Any], completions: list[list[int]]) -> list[float]:
        texts = [tok.decode(c[:-1] if c and c[-1] in stops else c) for c in completions]
        return fn([p.text for p in prompts], texts, [p.record for p in prompts])

    return score


def _old_logp(run: Any, module: torch.nn.Module):
    """The policy's log-probabilities of each micro-batch's labels now (the sampling policy,
    for the importance ratio of the later steps on the same rollouts)."""
    from torchneox.parallel.tensor_parallel import loss_context
    from torchneox.train.batch import to_device
    from torchneox.train.loss import kept_logp
    from torchneox.train.precision import autocast

    @torch.no_grad()
    def logps(micro_batches: list[dict]) -> list[torch.Tensor]:
        was = module.training
        module.eval()
        out = []
        try:
            for batch in micro_batches:
                prep = run.objective.prepare(to_device(batch, run.device))
                with loss_context(run.dims.tp > 1), autocast(run.precision, run.device.type):
                    logits = module(prep.inputs)
                    out.append(kept_logp(logits, prep.labels, run.objective.fp32))
        finally:
            module.train(was)
        return out

    return logps
