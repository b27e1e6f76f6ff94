"""The rewards of online reinforcement learning's rollouts: a Python function the config names
(``reward_function``) or a torchneox reward model (``reward_model``).

A reward function is ``module:function`` (a module on the import path) or
``path/to/file.py:function`` (a relative path is looked for beside the config first, then in
the working directory). It is called once per rollout batch with the prompts' texts and the
completions' texts (lists of equal length) and returns one finite number per completion. It
is given the prompts' whole records too (the ``rollout_prompts`` line: an ``answer`` key, say)
when it can take a third argument: as the third positional argument when it has one, else as
``records=`` when it has a ``records`` keyword or ``**kwargs``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from pathlib import Path
from typing import Any

import torch

from torchneox.base.errors import ConfigError, TrainingStopped, did_you_mean, first_line

KEY = "reward_function"


class RewardFunction:
    """The function ``spec`` names, loaded once; calling it checks what it returns."""

    def __init__(self, spec: str, config_dir: Path | None):
        self.spec = spec
        where, sep, name = spec.rpartition(":")
        if not sep or not where or not name.isidentifier():
            raise ConfigError(
                f"{spec!r} names no function; write module:function or path/to/file.py:function",
                key=KEY,
            )
        module = _file_module(where, config_dir) if where.endswith(".py") else _module(where)
        fn = getattr(module, name, None)
        if fn is None:
            names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
            raise ConfigError(f"{where} has no function {name}{did_you_mean(name, names)}", key=KEY)
        if not callable(fn):
            raise ConfigError(f"{spec}: {name} is a {type(fn).__name__}, not a function", key=KEY)
        self.fn = fn
        self.records_as = _records_as(fn)
        """How the records are passed: "positional", "keyword" or None (not at all)."""

    def __call__(
        self, prompts: list[str], completions: list[str], records: list[dict]
    ) -> list[float]:
        try:
            if self.records_as == "positional":
                out = self.fn(prompts, completions, records)
            elif self.records_as == "keyword":
                out = self.fn(prompts, completions, records=records)
            else:
                out = self.fn(prompts, completions)
        except Exception as e:
            self._stop(f"raised {type(e).__name__}: {first_line(e)}")
        return self._checked(out, len(completions))

    def _checked(self, out: Any, count: int) -> list[float]:
        if not isinstance(out, list | tuple):
            self._stop(f"returned a {type(out).__name__}, not a list of {count} numbers")
        if len(out) != count:
            self._stop(f"returned {len(out)} rewards for {count} completions")
        rewards = []
        for i, value in enumerate(out):
            if not isinstance(value, numbers.Real):
                self._stop(f"returned {type(value).__name__} {value!r} at {i}, not a number")
            if not math.isfinite(float(value)):
                self._stop(f"returned {value!r} at {i}; a reward must be a finite number")
            rewards.append(float(value))
        return rewards

    def _stop(self, what: str):
        raise TrainingStopped(
            f"the reward function {self.spec} {what}; nothing of this step was saved"
        )


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name):
            raise ConfigError(
                f"no module {e.name} on the import path; install it, or name a file "
                "(path/to/file.py:function)",
                key=KEY,
            ) from None
        raise ConfigError(f"importing {name} failed ({first_line(e)})", key=KEY) from None
    except Exception as e:
        raise ConfigError(
            f"importing {name} failed ({type(e).__name__}: {first_line(e)})", key=KEY
        ) from None


def _file_module(path: str, config_dir: Path | None):
    """The module of a .py file: beside the config first, then from the working directory."""
    given = Path(path)
    places = [given] if given.is_absolute() else [Path(config_dir or ".") / given, given]
    found = next((p for p in places if p.is_file()), None)
    if found is None:
        looked = " nor ".join(dict.fromkeys(str(p) for p in places))
        raise ConfigError(f"{path}: no such file ({looked})", key=KEY)
    name = f"torchneox_reward_{found.stem}"
    spec = importlib.util.spec_from_file_location(name, found)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ConfigError(
            f"importing {found} failed ({type(e).__name__}: {first_line(e)})", key=KEY
        ) from None
    return module


def _records_as(fn) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: prompts and completions
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len([p for p in params if p.kind in positional]) >= 3 or any(
        p.kind == inspect.Parameter.VAR_POSITIONAL for p in params
    ):
        return "positional"
    if any(p.kind == inspect.Parameter.VAR_KEYWORD or p.name == "records" for p in params):
        return "keyword"
    return None


class RewardModelScorer:
    """A torchneox reward model (a checkpoint trained with ``train_impl: rm``) scoring
    completions: the value its head gives at the position ``train_impl rm`` reads.

    ``preprocess --chat --for-rm`` writes a chat as its tokens, then end-of-text twice, the
    second labelled; the objective reads the value where the label is predicted, i.e. at the
    FIRST end-of-text after the chat. So a rollout is scored as prompt + completion, then an
    end-of-text unless the completion already ends with one (a rollout that stopped ends with
    its stop token, ``sample_policy``), and the value is read at that end-of-text: the last
    position. A sequence longer than the model's positions keeps its last ones."""

    def __init__(self, checkpoint: str, device, eos_id: int | None = None, batch_size: int = 16):
        from torchneox.checkpoint.files import checkpoint_config, resolve
        from torchneox.checkpoint.tensors import missing_heads
        from torchneox.checkpoint.weights import load_model

        step_dir = resolve(checkpoint)
        impl = checkpoint_config(step_dir).config.training.train_impl
        if impl != "rm":
            raise ConfigError(
                f"{step_dir} is not a reward model (train_impl {impl}); give a checkpoint "
                "trained with train_impl: rm",
                key="reward_model",
            )
        if "value_head.weight" in missing_heads(step_dir):
            raise ConfigError(
                f"{step_dir} holds no value head (value_head.weight); give a trained reward "
                "model's checkpoint",
                key="reward_model",
            )
        loaded, self.model = load_model(step_dir, device=str(device))
        self.model.eval().requires_grad_(False)
        self.eos_id = eos_id if eos_id is not None else _eos_id(loaded, str(step_dir))
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[float]:
        if len(prompt_ids) != len(completion_ids):
            raise ValueError("one prompt per completion")
        limit = self.model.args.max_positions
        rows = []
        for p, c in zip(prompt_ids, completion_ids, strict=True):
            row = [*p, *c]
            if not c or c[-1] != self.eos_id:
                row.append(self.eos_id)
            rows.append(row[-limit:])
        values = []
        for start in range(0, len(rows), self.batch_size):
            values += self._values(rows[start : start + self.batch_size])
        return values

    def _values(self, rows: list[list[int]]) -> list[float]:
        """The value at each row's last token (rows right-padded: a causal model's earlier
        positions do not see the padding)."""
        device = self.model.embed.weight.device
        tokens = torch.full((len(rows), max(map(len, rows))), self.eos_id, device=device)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, device=device)
        last = torch.tensor([len(r) - 1 for r in rows], device=device)
        values = self.model(tokens).float().squeeze(-1)  # [B, T]
        return values.gather(1, last[:, None]).squeeze(1).tolist()


def _eos_id(loaded, where: str) -> int:
    """The end-of-text ``--for-rm`` ends a chat with: the tokenizer_config.json's eos_token
    beside a Hugging Face tokenizer file, else the tokenizer's end-of-text."""
    from torchneox.data.tokenizers import _configured_specials, model_tokenizer

    tokenizer = model_tokenizer(loaded.config.tokenizer, where)
    vocab = loaded.config.tokenizer.vocab_file
    backend = getattr(tokenizer, "_tok", None)
    if vocab and backend is not None:
        eos = _configured_specials(Path(vocab)).get("eos_token")
        if eos is not None and backend.token_to_id(eos) is not None:
            return backend.token_to_id(eos)
    return tokenizer.eod_id
