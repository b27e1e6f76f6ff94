"""EleutherAI's lm-evaluation-harness on a torchneox model: an ``LM`` adapter (loglikelihood,
loglikelihood_rolling, generate_until, batched) and the runner behind ``torchneox eval
--tasks`` and GPT-NeoX's ``eval_tasks`` during training."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from torchneox.base.errors import ConfigError
from torchneox.inference.generate import Sampling, generate
from torchneox.models.transformer import Transformer
from torchneox.parallel.collectives import plain


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.api.model import LM
    except ImportError:
        raise ConfigError(
            "evaluation tasks need the lm-eval package: pip install 'torchneox[eval]'"
        ) from None
    return LM


class TorchNeoXScorer:
    """What the harness asks of a model, computed with ``model``: log-likelihoods of
    continuations (batched, longest first), rolling log-likelihoods, and greedy or sampled
    continuations until a stop string."""

    def __init__(self, model: torch.nn.Module, max_length: int, tokenizer, batch_size: int, device):
        self.model = model
        self.tok = tokenizer
        self.eot = tokenizer.eod_id
        self.max_length = max_length
        self.batch_size = batch_size
        self._device = device or next(model.parameters()).device

    # -------------------------------------------------------------- scoring
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # trailing spaces of the context belong to the continuation's first token
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation = context[-spaces:] + continuation
            context = context[:-spaces]
        whole = self.tok.encode(context + continuation)
        ctx = self.tok.encode(context) if context else []
        if not ctx:
            return [self.eot], whole
        if whole[: len(ctx)] != ctx:  # the join merged tokens: split where context ends
            return ctx, self.tok.encode(continuation)
        return ctx, whole[len(ctx) :]

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log-probabilities of each continuation and whether it is the greedy one."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        self.model.eval()
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            rows, spans = [], []
            for i in chunk:
                ctx, cont = pairs[i]
                whole = (ctx + cont)[-(self.max_length + 1) :]
                inp = whole[:-1]
                n = len(cont)
                rows.append(inp)
                spans.append((len(inp) - n, len(inp), whole[-n:]))
            width = max(len(r) for r in rows)
            tokens = torch.zeros(len(rows), width, dtype=torch.long)
            for r, row in enumerate(rows):
                tokens[r, : len(row)] = torch.tensor(row)  # right-padded: causal, harmless
            logits = plain(self.model(tokens.to(self._device))).float()
            logprobs = F.log_softmax(logits, dim=-1).cpu()
            for r, (begin, end, target) in zip(range(len(rows)), spans, strict=True):
                lp = logprobs[r, begin:end]
                want = torch.tensor(target)
                total = lp.gather(-1, want[:, None]).sum().item()
                greedy = bool((lp.argmax(-1) == want).all())
                results[chunk[r]] = (total, greedy)
        return [r for r in results if r is not None]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self._score([self._encode_pair(*req.args) for req in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            tokens = self.tok.encode(req.args[0])
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=tokens,
                    prefix_token=self.eot,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            out.append(sum(score for score, _ in self._score(windows)))
        return out

    # ------------------------------------------------------------ generation
    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            budget = int(kwargs.pop("max_gen_toks", 256))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
            if not kwargs.pop("do_sample", False):
                temperature = 0.0
            prompt = self.tok.encode(context) or [self.eot]
            room = self.max_length - budget
            prompt = prompt[-max(room, 1) :]
            budget = min(budget, self.max_length - len(prompt))
            sampling = Sampling(
                temperature=temperature, maximum_tokens=budget, stop_ids={self.eot}, seed=0
            )
            if getattr(self.model, "cacheless", False):  # a pipeline's stages keep no cache
                ids = self._cacheless(prompt, sampling)
            else:
                ids = generate(self.model, [prompt], sampling)[0]
            text = self.tok.decode(ids)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            out.append(text)
        return out

    @torch.no_grad()
    def _cacheless(self, prompt: list[int], s: Sampling) -> list[int]:
        """A continuation by whole forwards, one per token: greedy, or drawn at the temperature
        by seed 0's generator; it ends before a stop token."""
        generator = torch.Generator().manual_seed(0)
        ids = list(prompt)
        for _ in range(s.maximum_tokens):
            logits = self.model(torch.tensor([ids], device=self._device))[0, -1].float().cpu()
            if s.temperature > 0:
                probs = torch.softmax(logits / s.temperature, -1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            else:
                token = int(logits.argmax())
            if token in s.stop_ids:
                break
            ids.append(token)
        return ids[len(prompt) :]


def make_adapter(model: torch.nn.Module, args, tokenizer, batch_size: int = 8, device=None):
    """An lm-eval ``LM`` backed by ``model`` (a Transformer, or the module training calls)."""
    LM = _lm_eval()
    # a soft prompt's model reads seq_length less the prompt of text
    longest = args.seq_length - args.soft_prompt_tokens if args.soft_prompt_tokens else None
    scorer = TorchNeoXScorer(model, longest or args.max_positions, tokenizer, batch_size, device)

    class TorchNeoXLM(LM):
        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            return scorer.loglikelihood(requests)

        def loglikelihood_rolling(self, requests) -> list[float]:
            return scorer.loglikelihood_rolling(requests)

        def generate_until(self, requests) -> list[str]:
            return scorer.generate_until(requests)

    return TorchNeoXLM()


@functools.lru_cache(maxsize=8)
def task_manager(include_path: str | None):
    """lm-eval's index of its tasks (and those under ``include_path``), built once per process:
    building it reads every task's YAML (about 8 s), which evaluation during training would
    otherwise pay at every eval_interval."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def run_tasks(
    adapter,
    tasks: list[str],
    include_path: str | Path | None = None,
    limit: int | float | None = None,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, Any]]:
    """Run ``tasks`` (names, or task groups) and return {task: {metric: value}}."""
    from lm_eval import simple_evaluate

    logging.getLogger("lm-eval").setLevel(logging.ERROR)
    if include_path and not Path(include_path).is_dir():
        raise ConfigError(
            "no such folder of task YAML files (--include-path, or eval_tasks_include_path)",
            source=str(include_path),
        )
    manager = task_manager(str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"unknown lm-eval task(s) {', '.join(unknown)}; tasks in --include-path folders and "
            "the harness's own are known (`lm-eval ls tasks` lists them)",
            key="eval_tasks",
        )
    try:
        results = simple_evaluate(
            model=adapter,
            tasks=tasks,
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=False,
            bootstrap_iters=0,
        )
    except (ConnectionError, OSError) as e:  # datasets' hub errors derive from these
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"task(s) {', '.join(tasks)}: their data could not be fetched ({first}); without "
            "network access, write local tasks and pass their folder with --include-path "
            "(docs/evaluation.md)",
            key="eval_tasks",
        ) from None
    out: dict[str, dict[str, Any]] = {}
    for task, metrics in (results or {}).get("results", {}).items():
        out[task] = {
            k.split(",")[0]: v
            for k, v in metrics.items()
            if k != "alias" and "_stderr" not in k and isinstance(v, int | float)
        }
    return out


def evaluate_checkpoint(
    model: Transformer,
    tokenizer,
    tasks: list[str],
    include_path=None,
    limit=None,
    batch_size: int = 8,
    num_fewshot: int | None = None,
) -> dict[str, dict[str, Any]]:
    adapter = make_adapter(model, model.args, tokenizer, batch_size)
    return run_tasks(adapter, tasks, include_path, limit, num_fewshot)
