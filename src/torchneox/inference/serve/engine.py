"""Continuous batching: the server's requests decoded together, joining and leaving the batch
between steps. No web here: ``Engine.submit`` takes ``Job``s (one sequence each: a prompt and
its sampling), a thread runs the loop, and each job's ``Sink`` hears its tokens.

Each model name (the base, each adapter) has a lane: a ``SlotKVCache`` of ``max_batch`` rows
of ``max_seq_len`` positions. A job takes the lowest free row of its lane. New jobs are
prefilled together, left-padded into a cache of their own exactly as ``generate`` prefills a
batch, and their keys copied to the start of their rows; then one forward per lane per step
decodes every running row of it at once, each at its own position, its own keys masked in.
A job leaves when it stops (a stop token, ``max_tokens``, the last position, its sink says
stop, or it is cancelled: a client that went away), and its row is free for the next step.
The total of running jobs over the lanes is at most ``max_batch``; at most ``max_queue`` more
wait, and ``submit`` refuses past that (``QueueFull``: the server's 429).
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from torchneox.base.errors import ConfigError
from torchneox.inference.generate import (
    DECODE_BACKENDS,
    Sampling,
    _cache_dtype,
    _cuda_graph,
    _left_padded,
    graph_capturable,
    next_tokens,
    static_decoding,
)
from torchneox.models.linear import Linear, onednn_selected
from torchneox.models.mixers.attention import KVCache
from torchneox.models.transformer import Transformer

WARM_FORWARD_ROWS = 256
"""warm_up runs forwards of up to this many rows (beyond, it makes the kernel choices only)."""
PREFILL_TOKENS = 4096
"""Prompt tokens admitted in one step at most (one prompt at least), and prefilled in one
forward (padding included): the running sequences wait for a step's prefill, so this bounds
the pause a new request makes in their streams."""


class QueueFull(Exception):
    """More jobs than the free slots and the queue hold."""


class Sink(Protocol):
    """Where a job's output goes (called on the engine's thread)."""

    def prompt_logprobs(self, rows: list[tuple[float, list[tuple[int, float]]]]) -> None:
        """Each prompt token's log-probability after the first (and the top ones)."""

    def token(self, token: int, logprob: tuple[float, list[tuple[int, float]]] | None) -> bool:
        """A new token (and its log-probability, with the top ones, when asked); False: the
        job is done (a stop sequence)."""

    def done(self, reason: str, error: str | None = None) -> None:
        """The job ended: "stop", "length", "cancelled" or "error" (with ``error``)."""


@dataclass(eq=False)
class Job:
    """One sequence to generate."""

    lane: str
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    sink: Sink
    logprobs: int | None = None
    """How many top tokens to report beside each token's log-probability; None: none."""
    prompt_logprobs: bool = False
    cancelled: bool = False
    # the engine's
    row: int = -1
    generated: int = 0
    generator: torch.Generator | None = field(default=None, repr=False)


class SlotKVCache(KVCache):
    """A KV cache whose rows are independent sequences, each with its own length: a decode
    step writes each row's new keys at that row's length. Attention reads the columns up to
    the longest row's length plus one (``length``, which the model reads as the query's
    column): that last column holds this step's keys of every row (a row's own query always
    sees it), and a row's valid mask opens its own earlier columns."""

    def __init__(self, args, batch, max_len, dtype, device):
        super().__init__(args, batch, max_len, dtype, device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = batch
        self.width = 0
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        """What ``generate``'s CUDA-graph capture puts back after its warm-up steps (nothing
        moves it here: a step writes where ``lengths`` say, which only the engine changes)."""

    @property
    def length(self) -> int:  # the model's start column: this step's scratch column
        return self.width

    @length.setter
    def length(self, value: int) -> None:  # the model's ``cache.length += t``: lengths move
        pass

    def update(self, layer, k_BHTD, v_BHTD):
        row, n, w = self.slot_of[layer], self.rows, self.width
        keys, values = self.k[row, :n], self.v[row, :n]
        index = torch.arange(n, device=keys.device)
        for buffer, new in ((keys, k_BHTD[:, :, 0]), (values, v_BHTD[:, :, 0])):
            buffer[:, :, w] = new
            buffer[index, :, self.lengths[:n]] = new
        return keys[:, :, : w + 1], values[:, :, : w + 1]


def refuse_unservable(args, max_seq_len: int, where: str) -> None:
    """Models the slot cache cannot decode exactly: recurrent and block-sparse layers, soft
    prompts, ALiBi and relative positions (their scores read the step's shared column), a
    sliding window shorter than the served context."""
    why = None
    if any(not args.is_attention_layer(i) for i in range(args.num_layers)):
        why = "has recurrent layers (mamba, RWKV) or gMLP"
    elif any(args.sparsity(i) is not None for i in range(args.num_layers)):
        why = "has block-sparse attention"
    elif args.soft_prompt_tokens:
        why = "has a soft prompt"
    elif args.pos_emb in ("alibi", "rpe"):
        why = f"has {args.pos_emb} positions"
    elif args.sliding_window is not None and args.sliding_window < max_seq_len:
        why = (
            f"attends in a sliding window of {args.sliding_window}: serve it with "
            f"--max-seq-len {args.sliding_window} at most"
        )
    if why:
        raise ConfigError(f"{why}, which serve does not decode yet (generate does)", source=where)


class _Lane:
    """One model's rows: its cache, which job holds each row, each row's last token."""

    def __init__(self, model: Transformer, slots: int, max_seq_len: int, static: bool):
        self.model, self.static = model, static
        device = model.embed.weight.device
        self.cache = SlotKVCache(
            model.args, slots, max_seq_len, _cache_dtype(model, device), device
        )
        self.jobs: list[Job | None] = [None] * slots
        self.lengths = [0] * slots
        """Each row's tokens in the cache (on the host; the cache's copy is set each step)."""
        self.last = [0] * slots
        """Each row's last token, the next step's input."""
        self.columns = torch.arange(max_seq_len, device=device)
        self.tokens = torch.zeros(slots, 1, dtype=torch.long, device=device)
        """The static steps' input (its buffer: a captured graph reads it where it is)."""
        self.graph = None

    def static_step(self) -> torch.Tensor:
        """[slots, vocab] the next logits of every row: a step of fixed shapes over all the
        rows and all the columns (the scratch column the last one), replayed as a CUDA graph
        on a GPU (``generate``'s capture) where the model allows one."""
        cache = self.cache
        cache.rows, cache.width = len(self.jobs), self.columns.numel() - 1

        def step() -> torch.Tensor:
            valid = self.columns[None, :] < cache.lengths[:, None]
            lengths = cache.lengths[:, None]
            return self.model(self.tokens, positions_BT=lengths, key_valid_BS=valid, cache=cache)[
                :, -1
            ]

        if self.graph is None:
            self.graph = step
            if self.tokens.device.type == "cuda" and graph_capturable(self.model):
                try:
                    self.graph = _cuda_graph(step, cache)
                except Exception as e:  # a model the capture refuses: the same steps, eager
                    print(f"serve: decoding without a CUDA graph ({e})", file=sys.stderr)
        return self.graph()

    def running(self) -> list[Job]:
        return [j for j in self.jobs if j is not None]

    def free_row(self) -> int:
        return self.jobs.index(None)


class Engine:
    """The scheduler and its thread (``start``; ``stop`` drains first unless told not to)."""

    def __init__(
        self,
        models: dict[str, Transformer],
        max_batch: int,
        max_seq_len: int,
        max_queue: int,
        pad_id: int = 0,
        step_delay: float = 0.0,
        decode_loop: str = "auto",
    ):
        self.models, self.decode_loop = models, decode_loop
        self.max_batch, self.max_seq_len, self.max_queue = max_batch, max_seq_len, max_queue
        self.pad_id, self.step_delay = pad_id, step_delay
        self.lanes: dict[str, _Lane] = {}
        self.waiting: deque[Job] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.steps = 0
        for model in models.values():
            model.eval()

    def warm_up(self) -> None:
        """The kernel choices of every product shape a request can meet, made before the
        first request waits for them: on the CPU, ``cpu_matmul``'s (models/linear.py, timed
        once per machine and shape, by rows rounded up to a power of two) for every power of
        two up to the largest prefill; a forward at each up to WARM_FORWARD_ROWS (the decode
        steps' shapes, and a GPU's kernels loaded). With static decoding, each model's lane is
        made here and its step captured as a CUDA graph (on a GPU)."""
        widest = min(PREFILL_TOKENS, self.max_batch * self.max_seq_len)
        with torch.no_grad(), torch.nn.attention.sdpa_kernel(DECODE_BACKENDS):
            for model in self.models.values():
                device, rows = model.embed.weight.device, 1
                while rows <= widest:
                    if rows <= WARM_FORWARD_ROWS:
                        width = min(rows, self.max_seq_len)
                        batch = -(-rows // width)
                        model(torch.zeros(batch, width, dtype=torch.long, device=device))
                    elif device.type == "cpu" and model.embed.weight.dtype == torch.float32:
                        for k, n, mode in _product_shapes(model):
                            onednn_selected(rows, k, n, mode)
                    rows *= 2
            for name, model in self.models.items():  # each lane's graph captured (static)
                if static_decoding(self.decode_loop, model.embed.weight.device):
                    self._lane(name).static_step()

    # ------------------------------------------------------------ the callers' side

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` (all or none); QueueFull when the slots and queue cannot hold them."""
        with self.cond:
            held = self.running_count() + len(self.waiting)
            if self.stopping or held + len(jobs) > self.max_batch + self.max_queue:
                raise QueueFull
            for job in jobs:
                if job.sampling.seed is not None:
                    device = self.models[job.lane].embed.weight.device
                    job.generator = torch.Generator(device=device).manual_seed(job.sampling.seed)
            self.waiting.extend(jobs)
            self.cond.notify()

    def cancel(self, jobs: list[Job]) -> None:
        """The jobs end at the next step (their rows freed); a finished job is left alone."""
        with self.cond:
            for job in jobs:
                job.cancelled = True
            self.cond.notify()

    def running_count(self) -> int:
        return sum(len(lane.running()) for lane in self.lanes.values())

    def stats(self) -> dict:
        with self.cond:
            return {
                "running": self.running_count(),
                "waiting": len(self.waiting),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                "steps": self.steps,
            }

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="torchneox-engine", daemon=True)
        self.thread.start()

    def stop(self, drain: bool = True) -> None:
        """Stop taking jobs; with ``drain`` finish those running and waiting first."""
        with self.cond:
            self.stopping = True
            if not drain:
                for job in [
                    *self.waiting,
                    *(j for lane in self.lanes.values() for j in lane.running()),
                ]:
                    job.cancelled = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join()

    # ------------------------------------------------------------ the engine's thread

    def _loop(self) -> None:
        with torch.no_grad(), torch.nn.attention.sdpa_kernel(DECODE_BACKENDS):
            while True:
                with self.cond:
                    while not self.waiting and not self.running_count() and not self.stopping:
                        self.cond.wait()
                    if self.stopping and not self.waiting and not self.running_count():
                        return
                    admitted = self._admit()
                try:
                    self._drop_cancelled()
                    for lane, jobs in admitted.items():
                        self._guarded(lane, jobs, self._prefill)
                    for name, lane in list(self.lanes.items()):
                        if lane.running():
                            self._guarded(name, lane.running(), self._step)
                except Exception as e:  # a bug: every running job fails, the engine goes on
                    for lane in self.lanes.values():
                        for job in lane.running():
                            self._finish(job, "error", f"{type(e).__name__}: {e}")
                self.steps += 1
                if self.step_delay:
                    time.sleep(self.step_delay)

    def _guarded(self, lane: str, jobs: list[Job], work) -> None:
        """``work(lane, jobs)``; what it raises ends those jobs with an error, not the server."""
        try:
            work(lane, jobs)
        except Exception as e:  # out of memory, a bug: these jobs fail, the others go on
            for job in jobs:
                if job.row >= 0:
                    self._finish(job, "error", f"{type(e).__name__}: {e}")

    def _admit(self) -> dict[str, list[Job]]:
        """Waiting jobs into free rows (first come first served, PREFILL_TOKENS of prompts at
        most), by lane."""
        admitted: dict[str, list[Job]] = {}
        for job in [j for j in self.waiting if j.cancelled]:
            self.waiting.remove(job)
            job.sink.done("cancelled")
        free, budget = self.max_batch - self.running_count(), PREFILL_TOKENS
        while self.waiting and free > 0:
            if len(self.waiting[0].prompt) > budget and budget < PREFILL_TOKENS:
                break  # the next step takes it
            job = self.waiting.popleft()
            if job.cancelled:
                job.sink.done("cancelled")
                continue
            try:
                lane = self._lane(job.lane)
            except Exception as e:  # its KV cache does not fit: this job fails
                job.sink.done("error", f"{type(e).__name__}: {e}")
                continue
            job.row = lane.free_row()
            lane.jobs[job.row] = job
            admitted.setdefault(job.lane, []).append(job)
            free, budget = free - 1, budget - len(job.prompt)
        return admitted

    def _lane(self, name: str) -> _Lane:
        if name not in self.lanes:
            model = self.models[name]
            static = static_decoding(self.decode_loop, model.embed.weight.device)
            self.lanes[name] = _Lane(model, self.max_batch, self.max_seq_len, static)
        return self.lanes[name]

    def _drop_cancelled(self) -> None:
        for lane in self.lanes.values():
            for job in lane.running():
                if job.cancelled:
                    self._finish(job, "cancelled")

    def _finish(self, job: Job, reason: str, error: str | None = None) -> None:
        lane = self.lanes[job.lane]
        if job.row >= 0 and lane.jobs[job.row] is job:
            lane.jobs[job.row] = None
            lane.lengths[job.row] = 0
            lane.last[job.row] = self.pad_id
        job.row = -1
        job.sink.done(reason, error)

    def _prefill(self, name: str, jobs: list[Job]) -> None:
        """The new jobs' prompts in forwards of at most PREFILL_TOKENS (padding included)."""
        jobs = sorted(jobs, key=lambda j: len(j.prompt))
        start = 0
        while start < len(jobs):
            end = start + 1
            while end < len(jobs) and (end + 1 - start) * len(jobs[end].prompt) <= PREFILL_TOKENS:
                end += 1
            self._prefill_batch(self.lanes[name], jobs[start:end])
            start = end

    def _prefill_batch(self, lane: _Lane, jobs: list[Job]) -> None:
        """One forward over the prompts left-padded (as ``generate`` prefills), their keys
        copied to the start of their rows, and each job's first token."""
        model, cache = lane.model, lane.cache
        device = model.embed.weight.device
        prompts = [j.prompt for j in jobs]
        longest = max(len(p) for p in prompts)
        tokens, positions, valid, padded = _left_padded(prompts, longest, self.pad_id, device)
        own = KVCache(model.args, len(jobs), longest, cache.k.dtype, device)
        every = any(j.prompt_logprobs for j in jobs)  # else the head reads the last token only
        logits = model(
            tokens,
            positions_BT=positions,
            key_valid_BS=valid if padded else None,
            cache=own,
            last_only=not every,
        )
        for i, job in enumerate(jobs):
            n, row = len(job.prompt), job.row
            cache.k[:, row, :, :n] = own.k[:, i, :, longest - n :]
            cache.v[:, row, :, :n] = own.v[:, i, :, longest - n :]
            lane.lengths[row] = n
            if job.prompt_logprobs:
                job.sink.prompt_logprobs(
                    _logprobs(logits[i, longest - n : longest - 1], job.prompt[1:], job.logprobs)
                )
        self._advance(lane, jobs, logits[:, -1])

    def _step(self, name: str, jobs: list[Job]) -> None:
        """One token for every running row of the lane."""
        lane = self.lanes[name]
        if lane.static:
            lane.cache.lengths.copy_(torch.tensor(lane.lengths), non_blocking=True)
            lane.tokens.copy_(torch.tensor(lane.last)[:, None], non_blocking=True)
            logits = lane.static_step()
            for job in jobs:
                lane.lengths[job.row] += 1
            self._advance(lane, jobs, logits, index=[j.row for j in jobs])
            return
        cache, device = lane.cache, lane.columns.device
        rows = max(j.row for j in jobs) + 1
        cache.rows, cache.width = rows, max(lane.lengths[:rows])
        lengths = cache.lengths[:rows]
        lengths.copy_(torch.tensor(lane.lengths[:rows]), non_blocking=True)
        last = torch.tensor(lane.last[:rows], device=device)
        valid = lane.columns[None, : cache.width + 1] < lengths[:, None]
        logits = lane.model(
            last[:, None], positions_BT=lengths[:, None], key_valid_BS=valid, cache=cache
        )
        for job in jobs:
            lane.lengths[job.row] += 1
        self._advance(lane, jobs, logits[:, -1], index=[j.row for j in jobs])

    def _advance(
        self, lane: _Lane, jobs: list[Job], logits_BV: torch.Tensor, index: list[int] | None = None
    ) -> None:
        """Each job's next token from its row of ``logits_BV`` (row ``index[i]``, or i), told
        to its sink; the jobs that are done leave."""
        rows = index if index is not None else list(range(len(jobs)))
        greedy = logits_BV.argmax(dim=-1).tolist()
        for job, r in zip(jobs, rows, strict=True):
            if job.generated >= job.max_tokens:  # max_tokens 0: the prompt's logprobs only
                self._finish(job, "length")
                continue
            s = job.sampling
            if s.temperature <= 0.0:
                token = greedy[r]
            else:
                token = int(next_tokens(logits_BV[r : r + 1], s, job.generator)[0])
            job.generated += 1
            if token in s.stop_ids:
                self._finish(job, "stop")
                continue
            lp = None
            if job.logprobs is not None:
                lp = _logprobs(logits_BV[r : r + 1], [token], job.logprobs)[0]
            go_on = job.sink.token(token, lp)
            lane.last[job.row] = token
            if not go_on:
                self._finish(job, "stop")
            elif job.generated >= job.max_tokens or lane.lengths[job.row] + 1 >= self.max_seq_len:
                self._finish(job, "length")


def _logprobs(
    logits_TV: torch.Tensor, tokens: list[int], top: int | None
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Each token's log-probability under its row of logits, and the ``top`` most likely."""
    lp = torch.log_softmax(logits_TV.float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, device=lp.device)].tolist()
    best = lp.topk(top, dim=-1) if top else None
    out = []
    for t in range(len(tokens)):
        pairs = []
        if best is not None:
            pairs = list(zip(best.indices[t].tolist(), best.values[t].tolist(), strict=True))
        out.append((chosen[t], pairs))
    return out


def _product_shapes(model: Transformer) -> set[tuple[int, int, str]]:
    """(inner width, output width, cpu_matmul) of every linear product of a forward: each
    Linear's, its LoRA adapter's two, and a tied head's."""
    shapes = set()
    for m in model.modules():
        if isinstance(m, Linear):
            shapes.add((m.in_features, m.out_features, m.cpu_matmul))
            a = m._modules.get("lora_A")
            if a is not None:
                shapes |= {(m.in_features, a.out_features, m.cpu_matmul)}
                shapes |= {(a.out_features, m.out_features, m.cpu_matmul)}
    if model.output is None:
        vocab, hidden = model.embed.weight.shape
        shapes.add((hidden, vocab, model.args.cpu_matmul))
    return shapes
