"""The estimator's parameter, gradient and optimizer bytes per rank equal what training
processes hold under layer weight sharing (each shared tensor once) with a soft prompt
(gradients and optimizer state for the prompt alone), on 2 processes under ZeRO-3."""

from __future__ import annotations

from tests.estimate.test_memory import probe
from torchneox.config.load import load_config
from torchneox.estimate.search import estimate

SHARED_AND_PROMPTED = [
    "num_unique_layers=2",
    'soft_prompt_tuning={"enabled": true, "n_tokens": 4}',
    "zero_optimization.stage=3",
]


def test_estimated_bytes_per_rank_equal_the_processes(make_config, tmp_path):
    cfg = make_config(
        num_layers=4,
        train_batch_size=8,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        hidden_size=48,
        num_attention_heads=4,
        no_weight_tying=True,
        hidden_dropout=0.0,
        num_workers=0,
    )
    measured = probe(cfg, tmp_path / "probe", 2, SHARED_AND_PROMPTED)
    measured.pop("activations")
    est = estimate(load_config([cfg], SHARED_AND_PROMPTED), gpus=2, gpu="h100")
    assert est["resident_bytes"] == measured
    assert est["resident_bytes"]["optimizer"] == 4 * 48 * 8 // 2  # Adam's 2 moments, halved


def test_through_stages_only_the_first_holds_and_trains_the_prompt(make_config):
    """Through 2 stages the prompt sits with the embedding on the first; the second holds
    weights alone (no gradients, no optimizer state; estimate counted them as trained and put
    the prompt on the last stage before)."""
    from torchneox.config.derive import derive
    from torchneox.estimate.parameters import stage_params

    cfg = make_config(
        num_layers=4, hidden_size=48, num_attention_heads=4, no_weight_tying=True, num_workers=0
    )
    keys = ['soft_prompt_tuning={"enabled": true, "n_tokens": 4}', "pipe_parallel_size=2"]
    loaded = load_config([cfg], keys)
    stages = stage_params(loaded, derive(loaded)["padded_vocab_size"], 2, "type:transformer")
    assert [[n for n, _ in s if n.startswith("soft_prompt")] for s in stages] == [
        ["soft_prompt.weight"],
        [],
    ]
    est = estimate(loaded, gpus=2, gpu="h100")
    resident, prompt = est["resident_bytes"], 4 * 48 * 4  # the prompt's fp32 bytes
    assert resident["parameter_shard"] > 10 * prompt
    want = prompt if est["heaviest_stage"] == 0 else 0  # stage 1: weights alone
    assert (resident["gradient_shard"], resident["optimizer"]) == (want, 2 * want)
