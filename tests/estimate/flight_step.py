"""Run under torchrun by tests/estimate/test_dry_run.py: one real training step of CONFIG on gloo,
then write the collectives torch's flight recorder saw during it to OUT/rank{R}.json."""

from __future__ import annotations

import json
import os
import sys

from torchneox.config.load import load_config
from torchneox.parallel import flight_recorder
from torchneox.parallel.dims import shutdown
from torchneox.train.trainer import Trainer


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    trainer = Trainer(load_config([config]), device="cpu")
    before = len(flight_recorder.entries())
    trainer.train_step()
    entries = flight_recorder.entries()[before:]
    rows = [[e["profiling_name"], e["input_sizes"]] for e in entries]
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(rows, f)
    shutdown()


if __name__ == "__main__":
    main()
