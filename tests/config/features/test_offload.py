"""ZeRO-Offload's keys in `config explain`: what offload does to the run (host memory per rank,
the step on the CPU), cpu_adam as DeepSpeedCPUAdam's AdamW, the NVMe-only entries noted."""

from __future__ import annotations

import json
import math

import pytest

from torchneox.cli import main

MODEL = "{num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 64}"


def explain(capsys, tmp_path, text: str, *extra: str) -> dict:
    (tmp_path / "model.yml").write_text(MODEL)
    (tmp_path / "a.yml").write_text(text)
    files = [str(tmp_path / "model.yml"), str(tmp_path / "a.yml")]
    assert main(["config", "explain", *files, "--world-size", "2", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "zero",
    [
        "{stage: 3, offload_optimizer: {device: cpu, buffer_count: 4}}",
        "{stage: 3, offload_param: {device: cpu}}",
        "{stage: 1, cpu_offload: true}",
    ],
)
def test_offload_keys_explain_host_memory_and_the_step_on_the_cpu(capsys, tmp_path, zero):
    out = explain(capsys, tmp_path, f"{{zero_optimization: {zero}}}")
    assert out["zero_offload"] == "cpu"
    why = out["reasons"]["zero_offload"]
    assert "CPUOffloadPolicy" in why and "optimizer step on the CPU" in why
    assert "offload_optimizer offloads the parameter shards too" in why
    # by hand: half the parameters (2 ranks) in fp32, their gradients, Adam's two moments
    assert out["offload_host_bytes_per_rank"] == math.ceil(out["num_parameters"] / 2) * 4 * 4
    assert "the optimizer step runs on the CPU" in out["reasons"]["offload_host_bytes_per_rank"]
    assert "gloo" in out["distributed_backend"].split("on GPU")[0]


def test_nvme_buffers_are_noted_as_no_effect(capsys, tmp_path):
    out = explain(
        capsys,
        tmp_path,
        "{zero_optimization: {stage: 3, offload_optimizer: "
        "{device: cpu, buffer_count: 4, pin_memory: true}}}",
    )
    assert "zero_optimization.offload_optimizer.buffer_count" in out["no_effect"]
    assert "zero_optimization.offload_optimizer.pin_memory" not in out["no_effect"]
    assert "pinned (page-locked) on GPUs" in out["reasons"]["zero_offload"]


@pytest.mark.parametrize(
    ("kind", "params", "runs_as"),
    [
        ("cpu_adam", "{lr: 0.001}", "AdamW (adamw_mode true"),
        ("cpu_torch_adam", "{lr: 0.001}", "AdamW (adamw_mode true"),
        ("cpu_adam", "{lr: 0.001, adamw_mode: false}", "Adam (adamw_mode false"),
    ],
)
def test_cpu_adam_implies_offload_and_runs_as_deepspeeds_cpu_adam(
    capsys, tmp_path, kind, params, runs_as
):
    text = f"{{optimizer: {{type: {kind}, params: {params}}}, zero_optimization: {{stage: 2}}}}"
    out = explain(capsys, tmp_path, text)
    assert out["zero_offload"] == "cpu"
    assert f"optimizer.type {kind} (DeepSpeed's CPU Adam)" in out["reasons"]["zero_offload"]
    assert "implies offload" in out["reasons"]["zero_offload"]
    assert runs_as in out["reasons"]["optimizer_type"]


def test_without_offload_nothing_is_offloaded(capsys, tmp_path):
    out = explain(capsys, tmp_path, "{zero_optimization: {stage: 3, cpu_offload: false}}")
    assert out["zero_offload"] == "none"
    assert "offload_host_bytes_per_rank" not in out
