"""Text generation: batched prompts, KV cache, greedy / temperature / top-k / top-p sampling."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchneox.base.errors import ConfigError
from torchneox.config.keys.io import TextGenConfig
from torchneox.config.paths import atomic_output
from torchneox.data.tokenizers import Tokenizer
from torchneox.inference.speculative import Drafts, check_speculative, speculative_greedy
from torchneox.models.mixers.attention import KVCache, StaticKVCache
from torchneox.models.transformer import Transformer
from torchneox.parallel.collectives import plain


@dataclass
class Sampling:
    temperature: float = 0.0
    """0 means greedy."""
    top_k: int = 0
    top_p: float = 0.0
    maximum_tokens: int = 64
    stop_ids: set[int] = field(default_factory=set)
    use_cache: bool = True
    seed: int | None = None
    decode_loop: str = "auto"
    """static: fixed-shape steps (CUDA graphs on a GPU); dynamic; auto: static on CUDA."""
    speculative: bool = False
    """Greedy, drafting with the model's MTP module (inference/speculative.py)."""


def filter_logits(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits outside the top-k tokens, or outside the smallest set reaching top_p, set to -inf."""
    if top_k > 0:
        kth = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1]), dim=-1).values[..., -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits_BV, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


def next_tokens(
    logits_BV: torch.Tensor, s: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    if s.temperature <= 0.0:
        return logits_BV.argmax(dim=-1)
    logits = filter_logits(logits_BV.float() / s.temperature, s.top_k, s.top_p)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# Decoding changes the key length every step; cuDNN's attention re-plans for each new shape
# (about 3 ms of host time per call on an H200), so generation uses the other kernels.
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.no_grad()
@sdpa_kernel(DECODE_BACKENDS)
def generate(
    model: Transformer,
    prompts: list[list[int]],
    s: Sampling,
    pad_id: int = 0,
    drafts: Drafts | None = None,
) -> list[list[int]]:
    """The continuation of each prompt (stop token excluded). Prompts may differ in length:
    they are left-padded, and padding is masked out and excluded from positions. With
    ``s.speculative``, one prompt at a time, drafting with the MTP module (``drafts`` counts)."""
    model.eval()
    if s.speculative:
        check_speculative(model, s.temperature, s.use_cache)
        device = model.embed.weight.device
        rows = [
            speculative_greedy(
                model, p, _steps(model, [p], s), s.stop_ids, _cache_dtype(model, device),
                drafts=drafts,
            )
            for p in prompts
        ]  # fmt: skip
    else:
        rows = _decode(model, model, prompts, s, pad_id, _seeded(s, model.embed.weight.device))
    return _cut_at_stops(rows, s.stop_ids, keep_stop=False)


# How many tokens sample_policy generates between two calls of its ``lockstep`` (each one a
# collective over the world, and a read back to the host).
LOCKSTEP_INTERVAL = 8


@torch.no_grad()
@sdpa_kernel(DECODE_BACKENDS)
def sample_policy(
    model: nn.Module,
    prompts: list[list[int]],
    s: Sampling,
    pad_id: int,
    generator: torch.Generator | None,
    tp: int = 1,
    lockstep: Callable[[bool], bool] | None = None,
) -> list[list[int]]:
    """Completions of ``prompts`` sampled from the model a training run calls (a Transformer,
    or one under DDP, ZeRO's ``fully_shard`` or tensor parallelism over ``tp`` ranks, not
    sequence parallelism: a decode step's one token cannot be split over the ranks), in eval
    mode and without autograd; its train/eval mode is restored afterwards. ``generator`` (None:
    ``s.seed``'s, or torch's default) draws the tokens; the ranks of a tensor-parallel group
    are given the same prompts and the same generator state, and sample the same tokens.

    Unlike ``generate``, a completion ends WITH its first stop token (included): a rollout
    must end with its end-of-text so that the policy learns to stop. A completion without one
    ran to ``s.maximum_tokens`` (or the model's last position).

    ``lockstep`` (None in one process): ``all_done(local_done) -> bool``, true once every rank
    is done (an all-reduce over the world). Every rank then makes the same number of forwards,
    as ZeRO's all-gathers and DDP's broadcasts ask: it is called every LOCKSTEP_INTERVAL
    tokens, and a rank that is done early (or whose cache is full) makes idle forwards of one
    token until it returns True. The static loop (CUDA graphs) runs only for a plain model in
    one process; every other layout decodes with the dynamic KV cache."""
    core = model.module if isinstance(getattr(model, "module", None), Transformer) else model
    device = _device_of(core)
    was_training = model.training
    model.eval()
    try:
        generator = generator if generator is not None else _seeded(s, device)
        static = lockstep is None and tp == 1 and _plain_parameters(model)
        rows = _decode(model, core, prompts, s, pad_id, generator, tp, lockstep, static)
    finally:
        model.train(was_training)
    return _cut_at_stops(rows, s.stop_ids, keep_stop=True)


def _device_of(core: nn.Module) -> torch.device:
    """Where ``core`` computes: its embedding's device, or a pipeline's (``PipelineLogits``,
    whose rank may hold no embedding) own ``device``."""
    device = getattr(core, "device", None)
    return device if isinstance(device, torch.device) else core.embed.weight.device


def _seeded(s: Sampling, device: torch.device) -> torch.Generator | None:
    if s.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(s.seed)


def _plain_parameters(model: nn.Module) -> bool:
    """Whether no parameter of ``model`` is a DTensor (no ZeRO shards, no tensor split)."""
    from torch.distributed.tensor import DTensor

    return not any(isinstance(p, DTensor) for p in model.parameters())


def _decode(
    call: nn.Module,
    core: Transformer,
    prompts: list[list[int]],
    s: Sampling,
    pad_id: int,
    generator: torch.Generator | None,
    tp: int = 1,
    lockstep: Callable[[bool], bool] | None = None,
    static: bool = True,
) -> list[list[int]]:
    """Each prompt's generated tokens (pad after a row's stop token): ``call`` is the module
    to run (``core``, or a wrapper of it), ``core`` the Transformer (its args and weights)."""
    device = _device_of(core)
    longest, steps = max((len(p) for p in prompts), default=0), _steps(core, prompts, s)
    prompt = core.args.soft_prompt_tokens
    tokens, positions, valid, padded = _left_padded(prompts, longest + steps, pad_id, device)
    mask = valid if padded else None
    if static and s.use_cache and static_decoding(s.decode_loop, device) and not prompt:
        return _static_loop(core, tokens, positions, mask, longest, s, pad_id, generator).tolist()
    return _dynamic_loop(
        call, core, tokens, positions, mask, longest, s, pad_id, generator, tp, lockstep
    )


def _steps(core: Transformer, prompts: list[list[int]], s: Sampling) -> int:
    """How many tokens to generate after ``prompts``: maximum_tokens, never past the model's
    last position (as GPT-NeoX, whatever maximum_tokens asks)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    limit, prompt = core.args.max_positions, core.args.soft_prompt_tokens
    if prompt:  # a soft prompt's model: prompt and text within seq_length, as in training
        limit = min(limit, core.args.seq_length) - prompt
    if longest >= limit:
        raise ConfigError(
            f"a prompt of {longest} tokens leaves no room in the model's {limit} positions; "
            "shorten it (TextGenerator cuts such prompts from the left)",
            key="maximum_tokens",
        )
    return min(s.maximum_tokens, limit - longest)


def _dynamic_loop(
    call: nn.Module,
    core: Transformer,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor | None,
    longest: int,
    s: Sampling,
    pad_id: int,
    generator: torch.Generator | None,
    tp: int,
    lockstep: Callable[[bool], bool] | None,
) -> list[list[int]]:
    """The tokens after the prompts, one forward per token into a KVCache (or over the whole
    sequence without one); with ``lockstep``, idle forwards once this rank is done, until every
    rank is."""
    b, width = tokens.shape
    device = tokens.device
    cache = None
    if s.use_cache:
        room = width + core.args.soft_prompt_tokens  # a soft prompt is cached before the text
        cache = KVCache(core.args, b, room, _cache_dtype(core, device), device, tp)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stop = torch.tensor(sorted(s.stop_ids), dtype=torch.long, device=device)
    end, begin, forwards = longest, 0, 0
    while True:
        if end < width:
            out = call(
                tokens[:, begin:end],
                positions_BT=positions[:, begin:end],
                key_valid_BS=valid[:, :end] if valid is not None else None,
                cache=cache,
            )
            new = torch.where(done, pad_id, next_tokens(_last_logits(out), s, generator))
            tokens[:, end] = new
            done |= torch.isin(new, stop)
            end += 1
            begin = end - 1 if cache is not None else 0
        else:  # idle: this rank is done, another is not
            call(tokens[:, :1], positions_BT=positions[:, :1])
        forwards += 1
        look = lockstep is None or forwards % LOCKSTEP_INTERVAL == 0
        finished = end == width or (look and bool(done.all()))
        if look and (lockstep(finished) if lockstep is not None else finished):
            break
    return tokens[:, longest:end].tolist()


def _cache_dtype(core: Transformer, device: torch.device) -> torch.dtype:
    """What the keys arrive in: autocast's dtype under autocast, else the weights'."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return core.embed.weight.dtype


def _last_logits(out: torch.Tensor) -> torch.Tensor:
    """[B, vocab] the logits of each row's last token, whole (tensor parallelism splits the
    vocabulary over its ranks)."""
    return plain(out[:, -1])


def _cut_at_stops(rows: list[list[int]], stop_ids: set[int], keep_stop: bool) -> list[list[int]]:
    out = []
    for row in rows:
        cut = next((i for i, t in enumerate(row) if t in stop_ids), None)
        out.append(row if cut is None else row[: cut + 1 if keep_stop else cut])
    return out


def static_decoding(decode_loop: str, device: torch.device) -> bool:
    return decode_loop == "static" or (decode_loop == "auto" and device.type == "cuda")


# How many tokens the static loop generates between looks at whether every row has stopped
# (the one read back to the host).
STOP_CHECK_INTERVAL = 32


def _static_loop(
    model: Transformer,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor | None,
    longest: int,
    s: Sampling,
    pad_id: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The generated tokens [B, steps] (pad after a row's stop token): the prompts in one
    forward into a StaticKVCache, then one fixed-shape step per token, replayed as a CUDA
    graph on a GPU; nothing is read back to the host but the stop check every
    STOP_CHECK_INTERVAL tokens."""
    b, width = tokens.shape
    device, steps = tokens.device, width - longest
    cache = StaticKVCache(model.args, b, width, _cache_dtype(model, device), device)
    logits = model(
        tokens[:, :longest], positions_BT=positions[:, :longest], key_valid_BS=valid, cache=cache
    )[:, -1]
    token_B1, position_B1 = tokens[:, longest - 1 : longest].clone(), positions[:, :1].clone()

    def step() -> torch.Tensor:
        return model(token_B1, positions_BT=position_B1, key_valid_BS=valid, cache=cache)[:, -1]

    if device.type == "cuda" and graph_capturable(model):
        step = _cuda_graph(step, cache)
    out = torch.full((b, steps), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stop = torch.tensor(sorted(s.stop_ids), dtype=torch.long, device=device)
    pad = torch.full((b,), pad_id, dtype=torch.long, device=device)
    for i in range(steps):
        new = torch.where(done, pad, next_tokens(logits, s, generator))
        out[:, i] = new
        done |= torch.isin(new, stop)
        if i + 1 == steps or ((i + 1) % STOP_CHECK_INTERVAL == 0 and bool(done.all())):
            break
        token_B1.copy_(new[:, None])
        position_B1.copy_(positions[:, longest + i : longest + i + 1])
        logits = step()
    return out


def graph_capturable(model: Transformer) -> bool:
    """Whether a decode step can be captured as a CUDA graph: MoE routing sizes its dispatch
    on the host, and dynamic rope scaling reads the longest position back."""
    a = model.args
    return a.moe_num_experts <= 1 and dict(a.rope_scaling).get("type") != "dynamic"


def _cuda_graph(step, cache: StaticKVCache):
    """``step`` captured as a CUDA graph: replaying it runs the same kernels on the same
    buffers (its inputs are copied into them beforehand) without launching each one.
    Warm-up runs on a side stream first, as capture asks; each writes the keys the real
    step writes and the slot is put back after it."""
    put_back = snapshot(cache)  # the slot, and the states a recurrent layer's step advances
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
            put_back()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    put_back()

    def replay() -> torch.Tensor:
        graph.replay()
        return logits

    return replay


def snapshot(cache: StaticKVCache):
    """A function that puts the cache's slot and its recurrent states back as they are now
    (in place: a captured graph reads them where they are)."""
    slot = cache.slot.clone()
    states = {(layer, k): v.clone() for layer, s in cache.states.items() for k, v in s.items()}

    def put_back() -> None:
        cache.slot.copy_(slot)
        for (layer, name), value in states.items():
            cache.states[layer][name].copy_(value)

    return put_back


def _left_padded(
    prompts: list[list[int]], width: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The prompts left-padded into a [B, width] buffer, each token's position (counted from
    its prompt's first real token), which keys are real, and whether any prompt is padded."""
    longest = max(len(p) for p in prompts)
    pads = torch.tensor([longest - len(p) for p in prompts], device=device)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p) : longest] = torch.tensor(p, device=device)
    index = torch.arange(width, device=device)
    positions = (index[None, :] - pads[:, None]).clamp(min=0)
    valid = index[None, :] >= pads[:, None]
    return tokens, positions, valid, bool(pads.any())


# ------------------------------------------------------------------- the generate command


@dataclass
class TextGenerator:
    """A model with its tokenizer and sampling settings: text in, text out."""

    model: Transformer
    tokenizer: Tokenizer
    sampling: Sampling

    def complete(self, texts: list[str]) -> list[str]:
        """The continuations of ``texts``. A prompt that fills the model's positions keeps its
        last half (GPT-NeoX's advice: a context of at most half the sequence), with a warning;
        the others are not affected."""
        prompts = [self.tokenizer.encode(t) or [self.tokenizer.eod_id] for t in texts]
        limit = self.model.args.max_positions
        for i, ids in enumerate(prompts):
            if len(ids) >= limit:
                prompts[i] = ids[-(limit // 2) :]
                print(
                    f"warning: prompt {i + 1} has {len(ids)} tokens, the model {limit} positions: "
                    f"it keeps its last {limit // 2}",
                    file=sys.stderr,
                )
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else self.tokenizer.eod_id
        return self._texts(prompts, pad)

    def unconditional(self, count: int) -> list[str]:
        return self._texts([[self.tokenizer.eod_id]] * count, self.tokenizer.eod_id)

    def _texts(self, prompts: list[list[int]], pad: int) -> list[str]:
        drafts = Drafts()
        outputs = generate(self.model, prompts, self.sampling, pad_id=pad, drafts=drafts)
        if self.sampling.speculative:
            print(
                f"speculative decoding: {drafts.tokens} tokens in {drafts.forwards} forwards "
                f"of the model, {drafts.accepted} drafts kept",
                file=sys.stderr,
            )
        return [self.tokenizer.decode(ids) for ids in outputs]


def sampling_from(cfg: TextGenConfig, eod_id: int, seed: int | None) -> Sampling:
    if cfg.recompute and cfg.decode_loop == "static":
        raise ConfigError(
            "a static decode loop runs on the KV cache, which recompute turns off: drop one",
            key="decode_loop",
        )
    if cfg.speculative and cfg.decode_loop == "static":
        raise ConfigError(
            "speculative decoding keeps as many tokens as each forward's draft allows, which a "
            "static loop's fixed steps cannot: set decode_loop auto or dynamic",
            key="decode_loop",
        )
    return Sampling(
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        maximum_tokens=cfg.maximum_tokens,
        stop_ids={eod_id},
        use_cache=not cfg.recompute,
        decode_loop=cfg.decode_loop,
        seed=seed,
        speculative=cfg.speculative,
    )


def generation_stop_ids(tokenizer_file: str | None) -> set[int]:
    """The eos ids of the Hugging Face generation_config.json beside a tokenizer file (a model
    converted from the hub: Llama 3 Instruct ends turns with <|eot_id|> as well as its
    end-of-text); empty when there is none. Generation stops at these and the end-of-text."""
    import json
    from pathlib import Path

    if not tokenizer_file:
        return set()
    try:
        config = json.loads(Path(tokenizer_file).with_name("generation_config.json").read_text())
    except (OSError, ValueError):
        return set()
    eos = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = eos if isinstance(eos, list) else [eos]
    return {i for i in ids if isinstance(i, int) and not isinstance(i, bool)}


def generation_mode(cfg: TextGenConfig) -> str:
    """text_gen_type, or when it is unset: input-file if a sample_input_file is given (GPT-NeoX
    refuses an unset type), else interactive."""
    return cfg.text_gen_type or ("input-file" if cfg.sample_input_file else "interactive")


def run_mode(
    gen: TextGenerator, cfg: TextGenConfig, batch_size: int = 8, *, inputs: list[str | Path]
) -> None:
    """GPT-NeoX's text_gen_type modes: unconditional, input-file, interactive; ``inputs``: what
    the samples must not be written over (the checkpoint, the configs)."""
    mode = generation_mode(cfg)
    inputs = [*inputs, cfg.sample_input_file]
    if mode == "unconditional":
        with (
            atomic_output(cfg.sample_output_file, "sample_output_file", inputs=inputs) as tmp,
            open(tmp, "w") as out,
        ):
            for start in range(0, cfg.num_samples, batch_size):
                for text in gen.unconditional(min(batch_size, cfg.num_samples - start)):
                    out.write(json.dumps({"context": "", "text": text}) + "\n")
        print(f"wrote {cfg.num_samples} samples to {cfg.sample_output_file}", file=sys.stderr)
    elif mode == "input-file":
        if not cfg.sample_input_file:
            raise ConfigError(
                "text_gen_type input-file needs sample_input_file", key="sample_input_file"
            )
        try:
            text = Path(cfg.sample_input_file).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(
                f"cannot read it ({e.strerror})",
                key="sample_input_file",
                source=cfg.sample_input_file,
            ) from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"not UTF-8 text ({e.reason} at byte {e.start}); the prompts file holds text "
                "prompts separated by prompt_end",
                key="sample_input_file",
                source=cfg.sample_input_file,
            ) from None
        prompts = [p for p in text.split(cfg.prompt_end) if p.strip()]
        with (
            atomic_output(cfg.sample_output_file, "sample_output_file", inputs=inputs) as tmp,
            open(tmp, "w") as out,
        ):
            for start in range(0, len(prompts), batch_size):
                chunk = prompts[start : start + batch_size]
                for prompt, cont in zip(chunk, gen.complete(chunk), strict=True):
                    out.write(json.dumps({"context": prompt, "text": cont}) + "\n")
        print(f"wrote {len(prompts)} completions to {cfg.sample_output_file}", file=sys.stderr)
    else:
        print("Type a prompt and press enter; an empty line or Ctrl-D ends.", file=sys.stderr)
        try:
            for line in sys.stdin:
                prompt = line.rstrip("\n")
                if not prompt:
                    break
                print(gen.complete([prompt])[0], flush=True)
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"standard input is not UTF-8 text ({e.reason} at byte {e.start}); type or pipe "
                "text prompts"
            ) from None
