"""LoRA-DPO keeps no second model: a DPO run with adapters reaches its first step holding one
copy of the weights (the reference is the policy with its adapters off), measured from outside
the process (VmHWM in /proc) against the same run as SFT; the same DPO run without adapters,
measured the same way, holds a second copy (so the measurement sees one)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from tests.helpers import post_training_data
from tests.parallel.test_build_memory import _descendants, _status
from torchneox.config.derive import derive
from torchneox.config.load import load_config

# about 50 M parameters: 200 MB of fp32 weights, against a process of a few hundred MB
MODEL = {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8}
COMMON = {
    "seq_length": 64,
    "max_position_embeddings": 64,
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    "precision": "fp32",
    "num_workers": 0,
    "train_iters": 1,
    "save": None,
    "load": None,
}
LORA = {"lora": {"rank": 4, "target_modules": ["q_proj", "v_proj"]}}


def peak_at_first_step(config: str) -> int:
    """The training process's peak resident bytes as its first step begins (it stops itself
    there), read from /proc by this process."""
    return status_at_first_step(config)["VmHWM"]


def status_at_first_step(config: str, **env: str) -> dict[str, int]:
    """The training process's memory figures in bytes (VmHWM, VmRSS, RssAnon, ...) as its
    first step begins (it stops itself there), read from /proc by this process; ``env``
    added to its environment."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "TORCHNEOX_FAULT": "stop@step.start:1"} | env
    command = [sys.executable, "-m", "torchneox", "train", config]
    run = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, peak = time.monotonic() + 240, None
        while time.monotonic() < deadline and peak is None and run.poll() is None:
            for pid in (run.pid, *_descendants(run.pid)):
                status = _status(pid)
                if status.get("State", "")[:1] == "T":
                    peak = {
                        k: int(v.split()[0]) * 1024
                        for k, v in status.items()
                        if k.startswith(("Vm", "Rss")) and v.endswith("kB")
                    }
            time.sleep(0.2)
    finally:
        for pid in (*_descendants(run.pid), run.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, _ = run.communicate()
    assert peak is not None, f"the run did not reach its first step:\n{out.decode()[-3000:]}"
    return peak


def test_lora_dpo_holds_one_copy_of_the_weights(tmp_path):
    data = post_training_data(tmp_path)
    configs = {}
    for name, keys in (
        ("sft_lora", data["sft"] | LORA),
        ("dpo_lora", data["dpo"] | LORA),
        ("dpo_full", data["dpo"]),
    ):
        path = tmp_path / f"{name}.yml"
        path.write_text(json.dumps(keys | COMMON | MODEL))
        configs[name] = str(path)
    weights = derive(load_config([configs["dpo_full"]]))["num_parameters"] * 4
    peaks = {name: peak_at_first_step(path) for name, path in configs.items()}
    mib = {k: round(v / 2**20) for k, v in peaks.items()} | {"weights": round(weights / 2**20)}
    # the reference of LoRA-DPO costs less than a third of a model over LoRA-SFT's run...
    assert peaks["dpo_lora"] - peaks["sft_lora"] < 0.3 * weights, mib
    # ...while a full DPO run's reference is a second copy, which the measurement sees
    assert peaks["dpo_full"] - peaks["dpo_lora"] > 0.7 * weights, mib
