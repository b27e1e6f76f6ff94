"""The rewards of online reinforcement learning's rollouts: a Python function the config names
(``reward_function``) or a torchneox reward model (``reward_model``).

A reward function is ``module:function`` (a module on the import path) or
``path/to/file.py:function`` (a relative path is looked for beside the config first, then in
the working directory). It is called once per rollout batch with the prompts' texts and the
completions' texts (lists of equal length) and returns one finite number per completion (one
float32 can hold: at most 3.4e38 in size). It is given the prompts' whole records too (the ``rollout_prompts`` line: an ``answer`` key, say)
when it can take a third argument: as the third positional argument when it has one, else as
``records=`` when it has a ``records`` keyword or ``**kwargs``.

Whatever goes wrong in it stops the run in one line naming it (``TrainingStopped``): an
exception, ``sys.exit``, a result that is not one finite float32 per completion. It runs
``Interruptible``: Ctrl-C interrupts it, a second Ctrl-C ends the process.
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

from torchneox.base.errors import ConfigError, TrainingStopped, did_you_mean, first_line, shown
from torchneox.data.online import FP32_MAX
from torchneox.train.rl.interrupt import Interruptible

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
        with Interruptible(f"the reward function {self.spec}") as watch:
            try:
                if self.records_as == "positional":
                    out = self.fn(prompts, completions, records)
                elif self.records_as == "keyword":
                    out = self.fn(prompts, completions, records=records)
                else:
                    out = self.fn(prompts, completions)
            except KeyboardInterrupt:
                if not watch.interrupted:
                    self._stop("raised KeyboardInterrupt")
                self._stop(f"was interrupted by SIGINT (Ctrl-C) after {watch.seconds():.0f} s")
            except SystemExit as e:
                self._stop(f"exited (sys.exit({shown(e.code)})) instead of returning rewards")
            except BaseException as e:
                text = first_line(e)
                self._stop(f"raised {type(e).__name__}: {text[:200]}{'...' * (len(text) > 200)}")
        return self._checked(out, prompts, len(completions))

    def _checked(self, out: Any, prompts: list[str], count: int) -> list[float]:
        if not isinstance(out, list | tuple):
            self._stop(f"returned a {type(out).__name__}, not a list of {count} numbers")
        if len(out) != count:
            self._stop(f"returned {len(out)} rewards for {count} completions")
        rewards = []
        for i, value in enumerate(out):
            number = value if type(value) is float else None
            if number is None:
                if not isinstance(value, numbers.Real):
                    what = f"{type(value).__name__} {shown(value)}"
                    self._stop(f"returned {what} {_at(i, prompts)}, not a number")
                try:
                    number = float(value)
                except Exception as e:
                    why = f"{type(e).__name__}: {first_line(e)[:100]}"
                    self._stop(f"returned {shown(value)} {_at(i, prompts)}, not a float ({why})")
            if not math.isfinite(number) or abs(number) > FP32_MAX:
                self._stop(
                    f"returned {shown(value)} {_at(i, prompts)}; a reward must be a finite "
                    f"number float32 holds (at most {FP32_MAX:.4g} in size)"
                )
            rewards.append(number)
        return rewards

    def _stop(self, what: str):
        raise TrainingStopped(
            f"the reward function {self.spec} {what}; nothing of this step was saved"
        )


def _at(i: int, prompts: list[str]) -> str:
    """Completion ``i`` as a message names it: its index and its prompt."""
    return f"at {i} (prompt {shown(prompts[i])})" if i < len(prompts) else f"at {i}"


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
    except SystemExit as e:
        raise ConfigError(f"importing {name} exited (sys.exit({shown(e.code)}))", key=KEY) from None
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
    except (Exception, SystemExit) as e:
        sys.modules.pop(name, None)
        why = (
            f"exited (sys.exit({shown(e.code)}))"
            if isinstance(e, SystemExit)
            else f"failed ({type(e).__name__}: {first_line(e)})"
        )
        raise ConfigError(f"importing {found} {why}", key=KEY) from None
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
    position. A sequence longer than the model's positions keeps its last ones.

    ``policy`` (the policy's tokenizer keys) and ``policy_vocab`` (its padded vocabulary): the
    reward model must read the ids the policy samples, so its tokenizer must be the policy's
    (the same files, or the same size, end-of-text and ids of a probe text) and its vocabulary
    at least as large; otherwise a ConfigError at start-up. A score that is not a finite number
    stops the run (``TrainingStopped``) naming the completion."""

    def __init__(
        self,
        checkpoint: str,
        device,
        eos_id: int | None = None,
        batch_size: int = 16,
        policy: Any = None,
        policy_vocab: int | None = None,
    ):
        from torchneox.checkpoint.files import checkpoint_config, resolve
        from torchneox.checkpoint.tensors import missing_heads
        from torchneox.checkpoint.weights import load_model
        from torchneox.data.tokenizers import model_tokenizer

        try:
            step_dir = resolve(checkpoint)
        except ConfigError as e:  # the key that named it, too
            raise ConfigError(e.message, source=e.source, key="reward_model") from None
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
        self.source = str(step_dir)
        tokenizer = model_tokenizer(loaded.config.tokenizer, self.source)
        if policy is not None:
            _check_tokenizer(loaded.config.tokenizer, tokenizer, policy, self.source)
        rows = self.model.args.vocab_size
        if policy_vocab is not None and rows < policy_vocab:
            raise ConfigError(
                f"{step_dir} has {rows} vocabulary rows, fewer than the policy's {policy_vocab} "
                "(padded), any of which the policy may sample; train the reward model with the "
                "policy's make_vocab_size_divisible_by",
                key="reward_model",
            )
        self.eos_id = eos_id if eos_id is not None else _eos_id(loaded, tokenizer)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(
        self,
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        prompts: list[str] | None = None,
    ) -> list[float]:
        """The score of each completion; ``prompts``: the prompts' texts, which a message names."""
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
        for i, value in enumerate(values):
            if not math.isfinite(value) or abs(value) > FP32_MAX:
                at = f"at {i}" if prompts is None else _at(i, prompts)
                raise TrainingStopped(
                    f"the reward model {self.source} scored the completion {at} {value}; a "
                    "reward must be a finite number (check the reward model's weights); nothing "
                    "of this step was saved"
                )
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


def _eos_id(loaded, tokenizer) -> int:
    """The end-of-text ``--for-rm`` ends a chat with: the tokenizer_config.json's eos_token
    beside a Hugging Face tokenizer file, else the tokenizer's end-of-text."""
    from torchneox.data.tokenizers import _configured_specials

    vocab = loaded.config.tokenizer.vocab_file
    backend = getattr(tokenizer, "_tok", None)
    if vocab and backend is not None:
        eos = _configured_specials(Path(vocab)).get("eos_token")
        if eos is not None and backend.token_to_id(eos) is not None:
            return backend.token_to_id(eos)
    return tokenizer.eod_id


PROBE = "The quick brown fox, 13 lazy dogs.\n\tÜber naïve café — 漢字 😀 <|endoftext|>"
"""A text both tokenizers encode: the same ids say the same tokenizer (with the same size)."""


def _check_tokenizer(mine: Any, tokenizer: Any, policy: Any, where: str) -> None:
    """The reward model's tokenizer (its keys ``mine``, built: ``tokenizer``) is the policy's
    (its keys ``policy``), or a ConfigError naming both."""
    from torchneox.data.tokenizers import build_tokenizer

    if _same_files(mine, policy):
        return
    theirs = build_tokenizer(policy)
    if tokenizer.vocab_size != theirs.vocab_size:
        why = f"{tokenizer.vocab_size} tokens, the policy's {theirs.vocab_size}"
    elif tokenizer.eod_id != theirs.eod_id:
        why = f"end-of-text {tokenizer.eod_id}, the policy's {theirs.eod_id}"
    elif tokenizer.encode(PROBE) != theirs.encode(PROBE):
        why = "the same text becomes other token ids"
    else:
        return
    raise ConfigError(
        f"{where}: the reward model's tokenizer ({_named(mine)}) is not the policy's "
        f"({_named(policy)}): {why}; a reward model reads the policy's token ids, so train it "
        "with the policy's tokenizer",
        key="reward_model",
    )


def _same_files(a: Any, b: Any) -> bool:
    """Two tokenizer key sets naming the same type and files of the same contents (a file-less
    type, the character tokenizer, by its type)."""
    if a.tokenizer_type != b.tokenizer_type:
        return False
    if a.tokenizer_type == "CharLevelTokenizer":
        return True
    for key in ("vocab_file", "merge_file"):
        x, y = getattr(a, key), getattr(b, key)
        if bool(x) != bool(y):
            return False
        try:
            if x and Path(x).read_bytes() != Path(y).read_bytes():
                return False
        except OSError:
            return False
    return True


def _named(tok: Any) -> str:
    files = [Path(f).name for f in (tok.vocab_file, tok.merge_file) if f]
    return " ".join([str(tok.tokenizer_type), *files])
