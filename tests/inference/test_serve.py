"""`torchneox serve`, driven from outside with the real `openai` client: a tiny model trained
on chat-formatted text, served with a PEFT adapter, answers completions, chats, streams, n
choices, stop sequences and log-probabilities; greedy text equals `torchneox generate`'s for
the same prompt, alone and among 8 concurrent streams; every mistake is OpenAI's error body
with its 4xx status; a client that goes away frees its slot; a full queue answers 429; SIGTERM
lets the stream in flight finish and exits 0. One server for the whole module (started once,
SIGTERM'd by the last test)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import WORDS
from tests.helpers import make_chat_tokenizer
from torchneox.cli import main

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "sk-test-key"
MAX_BATCH, MAX_QUEUE = 8, 2
STEP_DELAY = 0.02  # seconds per decode step: long requests stay in flight while tests look
ADAPTER = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _corpus(folder: Path) -> Path:
    """Chats as plain text (the tokenizer reads its specials in it): the model learns words."""
    rng = random.Random(0)
    lines = []
    for _ in range(300):
        ask = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
        say = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        lines.append(json.dumps({"text": f"<|user|>{ask}\n<|assistant|>{say}\n"}))
    path = folder / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(folder: Path) -> tuple[Path, Path]:
    """A tiny model trained briefly on chat text: (its checkpoint, the tokenizer folder)."""
    tok = make_chat_tokenizer(folder / "tok")
    args = ["preprocess", "--input", str(_corpus(folder)), "--output-prefix", str(folder / "d")]
    args += ["--tokenizer-type", "HFTokenizer", "--vocab-file", str(tok / "tokenizer.json")]
    assert main([*args, "--append-eod"]) == 0
    keys = {
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 128,
        "pos_emb": "rotary", "norm": "rmsnorm", "activation": "swiglu",
        "tokenizer_type": "HFTokenizer", "vocab_file": str(tok / "tokenizer.json"),
        "make_vocab_size_divisible_by": 64, "train_micro_batch_size_per_gpu": 8,
        "train_iters": 120, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "precision": "fp32", "seed": 1234, "data_path": str(folder / "d_text_document"),
        "split": "100,0,0", "num_workers": 0, "eval_interval": 1000, "eval_iters": 0,
        "log_interval": 100, "save": str(folder / "ckpt"), "checkpoint_factor": 120,
    }  # fmt: skip
    (folder / "c.yml").write_text(json.dumps(keys))
    assert main(["train", str(folder / "c.yml")]) == 0
    return folder / "ckpt", tok


def _adapter(folder: Path, ckpt: Path) -> tuple[Path, Path]:
    """A PEFT adapter folder (B drawn, not zeros) and a checkpoint of the same model with the
    adapters in its weights and lora in its config: what `generate` decodes it from."""
    import yaml
    from safetensors.torch import save_file

    from torchneox.checkpoint import files as checkpoint_format
    from torchneox.checkpoint.weights import load_model
    from torchneox.config.derive import derive
    from torchneox.config.load import load_mapping
    from torchneox.config.report import render_yaml
    from torchneox.models.args import model_args
    from torchneox.models.transformer import build_model

    _, base = load_model(ckpt)
    g = torch.Generator().manual_seed(5)
    theirs, ours = {}, {}
    for i in range(2):
        for proj, mine in (("q_proj", "wq"), ("v_proj", "wv")):
            for ab, shape in (("lora_A", (4, 32)), ("lora_B", (32, 4))):
                t = torch.randn(*shape, generator=g) * 0.3
                theirs[f"base_model.model.model.layers.{i}.self_attn.{proj}.{ab}.weight"] = t
                ours[f"layers.{i}.attention.{mine}.{ab}.weight"] = t
    adapter = folder / "adapter"
    adapter.mkdir()
    save_file(theirs, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"} | ADAPTER))
    values = yaml.safe_load((checkpoint_format.resolve(ckpt) / "config.yml").read_text())
    values["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    with_lora = load_mapping(values, "lora")
    model = build_model(model_args(with_lora), seed=0)
    model.load_state_dict(base.state_dict() | ours)
    merged = folder / "with_adapter"
    checkpoint_format.save_checkpoint(
        merged, 0, {"model": model.state_dict()}, render_yaml(with_lora, derive(with_lora))
    )
    return adapter, merged


def generated(ckpt: Path, prompt: str, tokens: int, *more: str) -> str:
    """What `torchneox generate --prompt` prints for ``prompt`` (greedy unless told)."""
    out = io.StringIO()
    args = ["generate", "--checkpoint", str(ckpt), "--prompt", prompt, "--device", "cpu"]
    args += ["--maximum-tokens", str(tokens), "--temperature", "0", *more]
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return out.getvalue().removesuffix("\n")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    ckpt, tok = _train(folder)
    adapter, merged = _adapter(folder, ckpt)
    command = [sys.executable, "-m", "torchneox", "serve", str(ckpt), "--name", "tiny"]
    command += ["--adapter", f"sft={adapter}", "--port", "0", "--api-key", KEY]
    command += ["--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)]
    command += ["--step-delay", str(STEP_DELAY), "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    timer = threading.Timer(120, proc.kill)
    timer.start()
    line = proc.stdout.readline()
    timer.cancel()
    assert line.startswith("serving tiny and adapters sft"), line + proc.stderr.read()
    url = line.rsplit(" ", 1)[-1].strip()
    yield {"url": url, "proc": proc, "ckpt": ckpt, "merged": merged, "tok": tok}
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"], api_key=KEY, max_retries=0, **kw)


def health(server) -> dict:
    return httpx.get(server["url"].removesuffix("/v1") + "/health").json()


PROMPTS = [
    "<|user|>the king\n<|assistant|>",
    "<|user|>speak now\n<|assistant|>",
    "thou art",
    "my lord",
    "<|user|>all that is good and fair\n<|assistant|>",
    "hold",
    "the model reads",
    "<|user|>or\n<|assistant|>the",
]


def test_models_are_the_base_and_the_adapters(server):
    assert [m.id for m in client(server).models.list().data] == ["tiny", "sft"]


def test_greedy_completions_equal_generate(server):
    c = client(server)
    for model, ckpt in (("tiny", server["ckpt"]), ("sft", server["merged"])):
        for prompt in PROMPTS[:2]:
            want = generated(ckpt, prompt, 16)
            r = c.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
            (choice,) = r.choices
            assert choice.text == want, (model, prompt)
            assert r.usage.prompt_tokens == len(
                prompt.replace("<|user|>", "U").replace("<|assistant|>", "A")
            )
            assert choice.finish_reason == ("length" if r.usage.completion_tokens == 16 else "stop")
            assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    adapted = c.completions.create(model="sft", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    plain = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert adapted.choices[0].text != plain.choices[0].text  # the adapter is on


def test_eight_concurrent_streams_each_equal_generate(server):
    want = [generated(server["ckpt"], p, 24) for p in PROMPTS]
    got: dict[int, str] = {}
    peak = []

    def stream(i: int) -> None:
        chunks = client(server).completions.create(
            model="tiny", prompt=PROMPTS[i], max_tokens=24, temperature=0, stream=True
        )
        got[i] = "".join(ch.choices[0].text for ch in chunks if ch.choices)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(health(server)["running"])
        time.sleep(0.02)
    assert [got[i] for i in range(8)] == want
    assert max(peak) >= 4  # they were decoded together, not one after another


def test_chat_is_the_template_rendered_then_generated(server):
    c = client(server)
    messages = [{"role": "user", "content": "the king"}]
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    want = generated(server["ckpt"], "<|user|>the king\n<|assistant|>", 20)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == 1 + 8 + 1 + 1
    chunks = list(
        c.chat.completions.create(
            model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason


def test_n_choices_are_seeded_samples(server):
    c = client(server)
    ask = dict(model="tiny", prompt="thou", max_tokens=12, temperature=1.0, n=3, seed=7)
    first, again = c.completions.create(**ask), c.completions.create(**ask)
    texts = [ch.text for ch in first.choices]
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert texts == [ch.text for ch in again.choices]
    assert len(set(texts)) > 1
    # choice j draws with seed + j: choice 0 is generate's sample with that seed
    assert texts[0] == generated(server["ckpt"], "thou", 12, "--temperature", "1", "--seed", "7")
    assert first.usage.prompt_tokens == 4 and first.usage.completion_tokens >= 3


def test_stop_sequences_cut_the_text(server):
    c = client(server)
    whole = generated(server["ckpt"], PROMPTS[0], 24)
    stop = whole[4:6]
    cut = whole[: whole.find(stop)]
    r = c.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop, "zzz"]
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    chunks = c.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert "".join(ch.choices[0].text for ch in chunks) == cut


def test_logprobs_and_echo(server):
    c = client(server)
    prompt = "thou art"
    r = c.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(prompt) + 5 and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert len(top) <= 2 and value <= 0.0
    for value, top in zip(lp.token_logprobs[-5:], lp.top_logprobs[-5:], strict=True):
        assert value == pytest.approx(max(top.values()))  # greedy: the likeliest token
    chat = c.chat.completions.create(
        model="sft", messages=[{"role": "user", "content": "hold"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob == t.top_logprobs[0].logprob for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value.status_code, e.value.body


@pytest.mark.parametrize(
    "ask, status, param, code",
    [
        ({"temperature": 2.5}, 400, "temperature", "invalid_value"),
        ({"top_p": -0.1}, 400, "top_p", "invalid_value"),
        ({"n": 0}, 400, "n", "invalid_value"),
        ({"logprobs": 9}, 400, "logprobs", "invalid_value"),
        ({"max_tokens": "many"}, 400, "max_tokens", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ({"model": "gpt-4"}, 404, "model", "model_not_found"),
        ({"max_tokens": 125}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": "x" * 200}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": [[5, 999]]}, 400, "prompt", "invalid_value"),
        ({"prompt": [[5], []]}, 400, "prompt", "invalid_value"),
        ({"prompt": ["a"] * 11, "max_tokens": 1}, 400, "prompt", "invalid_value"),
        ({"n": 11, "max_tokens": 1}, 400, "n", "invalid_value"),
        ({"presence_penalty": 1.0}, 400, "presence_penalty", "invalid_value"),
    ],
)
def test_completion_mistakes_are_openai_errors(server, ask, status, param, code):
    body = {"model": "tiny", "prompt": "thou art", "max_tokens": 10} | ask
    got, error = _error(lambda: client(server).completions.create(**body))
    assert got == status and error["param"] == param and error["code"] == code, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_other_mistakes_are_openai_errors_and_the_server_goes_on(server):
    c = client(server)
    bad_role = [{"role": "wizard", "content": "hi"}]
    got, error = _error(lambda: c.chat.completions.create(model="tiny", messages=bad_role))
    assert (got, error["param"]) == (400, "messages") and "unknown role" in error["message"]
    got, error = _error(
        lambda: c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a"}], top_logprobs=2
        )
    )
    assert (got, error["param"]) == (400, "top_logprobs")
    nobody = openai.OpenAI(base_url=server["url"], api_key="wrong", max_retries=0)
    got, error = _error(lambda: nobody.models.list())
    assert (got, error["code"]) == (401, "invalid_api_key")
    url, auth = server["url"], {"Authorization": f"Bearer {KEY}"}
    raw = [
        (httpx.post(f"{url}/completions", content=b"{not json", headers=auth), 400, "invalid_json"),
        (httpx.post(f"{url}/completions", content=b"[1, 2]", headers=auth), 400, "invalid_json"),
        (httpx.post(f"{url}/completions", content=b"\xff\xfe", headers=auth), 400, "invalid_json"),
        (httpx.post(f"{url}/completions", content=b"[" * 100000, headers=auth), 400, "invalid_json"),
        (httpx.post(f"{url}/completions", content=b" " * (9 << 20), headers=auth), 413, "request_too_large"),
        (httpx.post(f"{url}/completions", json={"model": "tiny", "prompt": "a"}), 401, "invalid_api_key"),
        (httpx.get(f"{url}/nothing", headers=auth), 404, "not_found"),
        (httpx.get(f"{url}/completions", headers=auth), 405, "method_not_allowed"),
    ]  # fmt: skip
    for response, status, code in raw:
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert response.json()["error"]["code"] == code
    assert health(server)["status"] == "ok"
    r = c.completions.create(model="tiny", prompt="thou", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def _long_stream(server, c=None):
    c = c or client(server)
    return c.completions.create(
        model="tiny", prompt="my", max_tokens=120, stream=True, extra_body={"ignore_eos": True}
    )


def _wait_for(server, what, seconds: float = 5.0) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        h = health(server)
        if what(h):
            return h
        time.sleep(0.01)
    raise AssertionError(f"the server never got there: {health(server)}")


def test_a_client_that_goes_away_frees_its_slot(server):
    _wait_for(server, lambda h: h["running"] == 0)
    stream = _long_stream(server)
    next(iter(stream))
    _wait_for(server, lambda h: h["running"] == 1)
    steps = health(server)["steps"]
    stream.close()
    gone = _wait_for(server, lambda h: h["running"] == 0)
    assert gone["steps"] - steps < 90  # freed long before its 120 tokens
    # a client waiting for a whole answer that gives up: freed too (the server looks every 0.5 s)
    body = {"model": "tiny", "prompt": "my", "max_tokens": 120, "ignore_eos": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server['url']}/completions", json=body, headers=auth, timeout=0.3)
    steps = health(server)["steps"]
    gone = _wait_for(server, lambda h: h["running"] == 0)
    assert gone["steps"] - steps < 90


def test_a_full_queue_answers_429(server):
    _wait_for(server, lambda h: h["running"] == 0)
    streams = []
    for _ in range(MAX_BATCH + MAX_QUEUE):
        streams.append(_long_stream(server))
    _wait_for(server, lambda h: h["running"] == MAX_BATCH and h["waiting"] == MAX_QUEUE)
    got, error = _error(lambda: client(server).completions.create(model="tiny", prompt="a"))
    assert (got, error["code"], error["type"]) == (429, "rate_limit_exceeded", "rate_limit_error")
    for s in streams:
        s.close()
    _wait_for(server, lambda h: h["running"] == 0 and h["waiting"] == 0)


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(server):
    """The last test: the server goes."""
    proc = server["proc"]
    want = generated(server["ckpt"], PROMPTS[1], 30)
    chunks = client(server).completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0, stream=True
    )
    it = iter(chunks)
    text = next(it).choices[0].text
    proc.send_signal(signal.SIGTERM)
    text += "".join(ch.choices[0].text for ch in it)
    assert text == want
    assert proc.wait(timeout=30) == 0
    assert "serve: stopped" in proc.stderr.read()


def test_serve_without_fastapi_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'torchneox[serve]'" in err, err


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--adapter", "noequals"], "--adapter noequals: give NAME=PEFT_FOLDER"),
        (["--max-seq-len", "4096"], "--max-seq-len 4096 is past the model's 128 positions"),
        (["--adapter", "x=/nowhere"], "--adapter x: /nowhere is not a folder"),
    ],
)
def test_serve_mistakes_are_one_line(server, capsys, flags, said):
    assert main(["serve", str(server["ckpt"]), *flags]) == 2
    err = capsys.readouterr().err  # "serve: loading CKPT", then the one line
    assert err.count("torchneox: error:") == 1 and "Traceback" not in err, err
    assert said in err.splitlines()[-1], err


def test_a_hugging_face_folder_serves_what_generate_makes_of_it(server, tmp_path):
    """`convert to-hf` of the checkpoint, served in this process (the app on its engine):
    its chat template found beside the weights, the greedy text generate's from the folder."""
    from fastapi.testclient import TestClient

    from torchneox.cli.parser import build_parser
    from torchneox.cli.serve import served_model
    from torchneox.inference.serve.app import create_app

    hf = tmp_path / "hf"
    assert main(["convert", "to-hf", str(server["ckpt"]), str(hf)]) == 0
    served, what = served_model(build_parser().parse_args(["serve", str(hf), "--device", "cpu"]))
    assert what.startswith("hf (cpu, fp32, 8 slots of 128 tokens)")
    served.engine.start()
    try:
        with TestClient(create_app(served)) as http:
            messages = [{"role": "user", "content": "thou art"}]
            body = {"model": "hf", "messages": messages, "max_tokens": 12, "temperature": 0}
            r = http.post("/v1/chat/completions", json=body)
    finally:
        served.engine.stop()
    assert r.status_code == 200, r.text
    out = io.StringIO()
    args = ["generate", "--hf", str(hf), "--prompt", "<|user|>thou art\n<|assistant|>"]
    with contextlib.redirect_stdout(out):
        assert main([*args, "--maximum-tokens", "12", "--temperature", "0"]) == 0
    assert r.json()["choices"][0]["message"]["content"] == out.getvalue().removesuffix("\n")


def test_streamed_text_holds_back_cut_characters_and_stop_prefixes():
    """Bytes as tokens: a character cut between two tokens is not sent half, and text that may
    begin a stop sequence waits until the next token says whether it does."""
    from torchneox.data.tokenizers import CharLevelTokenizer
    from torchneox.inference.serve.responses import ChoiceText

    text = ChoiceText(CharLevelTokenizer(), ["lo!", "xyz"])
    sent, going = [], True
    for byte in "héllo wor".encode():
        going = going and text.add(byte)
        sent.append(text.ready())
    assert sent == ["h", "", "é", "", "l", "", "lo ", "w", "o", "r"]
    assert "".join(sent) + text.finish() == "héllo wor"
    text = ChoiceText(CharLevelTokenizer(), ["lo!"])
    ends = [text.add(b) for b in b"hello!"]
    assert ends == [True, True, True, True, True, False]
    assert text.text == "hel" and text.finish() == "hel"


@pytest.mark.parametrize("loop", ["dynamic", "static"])
def test_the_engine_decodes_what_generate_does_as_requests_come_and_go(loop):
    """In this process, on a GQA model: 12 prompts of 1-12 tokens submitted while others run
    (4 slots: each joins as one leaves), each greedy text generate's for it alone; with the
    dynamic steps (the running rows, up to the longest) and the static ones (every row and
    column: what a GPU captures as a CUDA graph)."""
    from tests.helpers import build
    from torchneox.inference.generate import Sampling, generate
    from torchneox.inference.serve.engine import Engine, Job

    class Sink:
        def __init__(self):
            self.tokens, self.over = [], threading.Event()

        def token(self, token, logprob):
            self.tokens.append(token)
            return True

        def done(self, reason, error=None):
            self.over.set()

    _, model = build("rmsnorm-swiglu-gqa")
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 60) for _ in range(rng.randint(1, 12))] for _ in range(12)]
    lengths = [10 + 8 * (i % 4) for i in range(12)]
    engine = Engine({"m": model}, 4, model.args.max_positions, 16, decode_loop=loop)
    engine.warm_up()
    engine.start()
    sinks = [Sink() for _ in prompts]
    try:
        for p, n, sink in zip(prompts, lengths, sinks, strict=True):
            engine.submit([Job("m", p, n, Sampling(temperature=0.0), sink)])
            time.sleep(0.005)
        assert all(s.over.wait(60) for s in sinks)
    finally:
        engine.stop()
    want = [
        generate(model, [p], Sampling(maximum_tokens=n))[0]
        for p, n in zip(prompts, lengths, strict=True)
    ]
    assert [s.tokens for s in sinks] == want


def test_a_model_the_slots_cannot_decode_is_refused_in_one_line():
    from tests.helpers import build
    from torchneox.base.errors import ConfigError
    from torchneox.inference.serve.engine import refuse_unservable

    _, model = build("alibi")
    with pytest.raises(ConfigError, match="has alibi positions, which serve does not decode yet"):
        refuse_unservable(model.args, 64, "ckpt")
