"""lm-evaluation-harness on torchneox models: the adapter's log-likelihoods equal a direct
computation and lm-eval's own Hugging Face model on the same weights; local tasks run through
`torchneox eval --tasks` and their metrics are the harness's arithmetic on those numbers."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from tests.conftest import shared_dir
from tests.helpers import metric_rows
from torchneox.checkpoint.weights import load_model
from torchneox.cli import main
from torchneox.data.tokenizers import build_tokenizer
from torchneox.train.lm_eval import make_adapter

QUESTIONS = [
    ("the cat sat on the", ["mat", "zebra quantum"], 0),
    ("one two three", [" four", " xqzv"], 0),
    ("hello", [" world", " world and more words here"], 0),
    ("a", [" b", " c"], 1),
]


def tiny_run(folder, data, **extra) -> str:
    """A 20-step character-level run saving to folder/run; returns its config path."""
    cfg = folder / "c.yml"
    keys = {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "seq_length": 64,
        "pos_emb": "rotary",
        "train_micro_batch_size_per_gpu": 4,
        "train_iters": 20,
        "optimizer": {"type": "Adam", "params": {"lr": 0.003}},
        "tokenizer_type": "CharLevelTokenizer",
        "data_path": str(data),
        "split": "100,0,0",
        "eval_iters": 0,
        "num_workers": 0,
        "save": str(folder / "run"),
    }
    cfg.write_text(json.dumps(keys | extra))
    return str(cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_data):
    folder = tmp_path_factory.mktemp("ckpt")
    assert main(["train", tiny_run(folder, tiny_data)]) == 0
    loaded, model = load_model(folder / "run")
    return folder / "run", model.eval(), build_tokenizer(loaded.config.tokenizer)


def direct_loglikelihood(model, tok, context: str, continuation: str) -> float:
    ctx = tok.encode(context) or [tok.eod_id]
    cont = tok.encode(continuation)
    tokens = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = F.log_softmax(model(tokens[:, :-1]).float(), -1)[0]
    targets = tokens[0, 1:]
    return logp[-len(cont) :].gather(-1, targets[-len(cont) :, None]).sum().item()


def requests(*pairs):
    return [SimpleNamespace(args=p) for p in pairs]


def test_loglikelihood_equals_the_direct_computation_in_any_batch(trained):
    _, model, tok = trained
    pairs = [(q, c) for q, choices, _ in QUESTIONS for c in choices] + [("", "from nothing")]
    want = [direct_loglikelihood(model, tok, *p) for p in pairs]
    for batch in (1, 3, 16):
        got = make_adapter(model, model.args, tok, batch_size=batch).loglikelihood(requests(*pairs))
        assert [g for g, _ in got] == pytest.approx(want, abs=1e-4)


def test_rolling_loglikelihood_is_the_sum_over_the_text(trained):
    _, model, tok = trained
    text = "the quick brown fox"
    want = direct_loglikelihood(model, tok, "", text)  # from the end-of-text token on
    (got,) = make_adapter(model, model.args, tok).loglikelihood_rolling(requests((text,)))
    assert got == pytest.approx(want, abs=1e-4)
    # longer than the model's positions: windows, each token scored once
    long = "the cat sat " * 20
    (rolled,) = make_adapter(model, model.args, tok).loglikelihood_rolling(requests((long,)))
    assert math.isfinite(rolled) and rolled < 0


def test_generate_until_is_greedy_generation_cut_at_the_stop(trained):
    from torchneox.inference.generate import Sampling, generate

    _, model, tok = trained
    ids = generate(model, [tok.encode("the ")], Sampling(maximum_tokens=20, stop_ids={tok.eod_id}))
    full = tok.decode(ids[0])
    stop = full[3:5]
    (got,) = make_adapter(model, model.args, tok).generate_until(
        requests(("the ", {"until": [stop], "max_gen_toks": 20}))
    )
    assert got == full[: full.index(stop)]


def write_tasks(folder):
    mc = folder / "mc.jsonl"
    mc.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )
    )
    texts = ["the cat sat on the mat", "one two three four five", "hello world"]
    ppl = folder / "ppl.jsonl"
    ppl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (folder / "local_mc.yaml").write_text(
        f"""task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
    )
    (folder / "local_ppl.yaml").write_text(
        f"""task: local_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {ppl}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
    )
    return texts


def test_local_tasks_through_the_eval_command(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run, model, tok = trained
    texts = write_tasks(tmp_path)
    capsys.readouterr()
    argv = ["eval", "--checkpoint", str(run), "--tasks", "local_mc,local_ppl"]
    assert main([*argv, "--include-path", str(tmp_path)]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    adapter = make_adapter(model, model.args, tok)
    # accuracy: the harness picks the choice with the highest log-likelihood of " " + choice
    right = 0
    for q, choices, answer in QUESTIONS:
        scores = [g for g, _ in adapter.loglikelihood(requests(*[(q, " " + c) for c in choices]))]
        right += scores.index(max(scores)) == answer
    assert results["local_mc"]["acc"] == pytest.approx(right / len(QUESTIONS))
    # word perplexity: exp(-total log-likelihood / total words)
    total = sum(adapter.loglikelihood_rolling(requests(*[(t,) for t in texts])))
    words = sum(len(t.split()) for t in texts)
    assert results["local_ppl"]["word_perplexity"] == pytest.approx(
        math.exp(-total / words), rel=1e-4
    )


def test_unknown_task_is_one_line(trained, capsys):
    run, _, _ = trained
    assert main(["eval", "--checkpoint", str(run), "--tasks", "no_such_task_anywhere"]) == 2
    assert "unknown lm-eval task(s) no_such_task_anywhere" in capsys.readouterr().err


def test_loglikelihoods_equal_lm_evals_own_hugging_face_model():
    """The same weights as a transformers GPTNeoXForCausalLM, scored by lm-eval's HFLM."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    shared = shared_dir()
    if shared is None:
        pytest.skip("needs ../shared (the GPT-2 tokenizer)")
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer

    from torchneox.config.load import load_mapping
    from torchneox.data.tokenizers import HFTokenizer
    from torchneox.models.args import model_args
    from torchneox.models.hf import architectures as hf
    from torchneox.models.hf.weights import hf_tensors
    from torchneox.models.transformer import build_model

    keys = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 128,
        "pos_emb": "rotary",
        "rotary_pct": 0.25,
        "gpt_j_residual": True,
        "no_weight_tying": True,
        "padded_vocab_size": 50304,
    }
    args = model_args(load_mapping(keys, "t"))
    ours = build_model(args, seed=3).eval()
    arch = hf.export_architecture(args)
    config = transformers.GPTNeoXConfig(**hf.hf_config(arch, args))
    theirs = transformers.GPTNeoXForCausalLM(config).eval()
    weights = dict(hf_tensors(arch, ours.state_dict(), args))
    if hasattr(theirs, "lm_head"):  # transformers 5 names GPT-NeoX's embed_out lm_head
        weights["lm_head.weight"] = weights.pop("embed_out.weight")
    theirs.load_state_dict(weights, strict=True)
    tok_file = shared / "data/tokenizers/gpt2/tokenizer.json"
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_file))
    hf_tok.eos_token = "<|endoftext|>"
    hf_tok.pad_token = "<|endoftext|>"
    reference = HFLM(pretrained=theirs, tokenizer=hf_tok, batch_size=4, max_length=128)
    tok = HFTokenizer(Tokenizer.from_file(str(tok_file)), str(tok_file))
    pairs = [
        ("The capital of France is", " Paris"),
        ("Question: what is two plus two?\nAnswer:", " four"),
        ("", "A sentence from nothing."),
    ]
    want = [x for x, _ in reference.loglikelihood(requests(*pairs))]
    got = [
        x for x, _ in make_adapter(ours, args, tok, batch_size=2).loglikelihood(requests(*pairs))
    ]
    assert got == pytest.approx(want, abs=1e-4)


def test_eval_tasks_run_during_training(tmp_path, tiny_data, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_tasks(tmp_path)
    cfg = tiny_run(
        tmp_path,
        tiny_data,
        split="969,30,1",
        eval_interval=10,
        eval_iters=1,
        eval_tasks=["local_ppl"],
        eval_tasks_include_path=str(tmp_path),
    )
    assert main(["train", cfg]) == 0
    rows = metric_rows(tmp_path / "run")
    tasks = {r["iteration"]: r["eval_tasks"] for r in rows if "eval_tasks" in r}
    assert sorted(tasks) == [10, 20]
    out = capsys.readouterr().out
    assert "local_ppl at step 20: " in out and "word_perplexity" in out
    # the same number as evaluating the saved checkpoint afterwards
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--tasks", "local_ppl",
                 "--include-path", str(tmp_path)]) == 0  # fmt: skip
    after = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert tasks[20]["local_ppl"]["word_perplexity"] == pytest.approx(
        after["local_ppl"]["word_perplexity"], rel=1e-5
    )


def test_an_include_path_that_is_not_there_is_named(trained, tmp_path, capsys):
    run, _, _ = trained
    missing = tmp_path / "no_tasks"
    args = ["eval", "--checkpoint", str(run), "--tasks", "x", "--include-path", str(missing)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{missing}: no such folder of task YAML files" in err, err
