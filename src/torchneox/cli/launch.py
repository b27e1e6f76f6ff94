"""``train --nproc N``: the same command in N local processes, through torchrun itself, after
the config and its layout are checked here, once."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def launch_local(args: argparse.Namespace) -> int:
    """The same training command in ``--nproc`` local processes, through torchrun itself."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    from torchneox.config.derive import derive
    from torchneox.config.load import load_config
    from torchneox.train.trainer import require

    loaded = load_config(args.files, args.overrides)
    require(loaded, derive(loaded, world_size=args.nproc))  # config errors once, here
    save = loaded.config.checkpoint.save
    latest = Path(save) / "latest" if save else None

    def newest() -> str | None:
        return latest.read_text().strip() if latest and latest.is_file() else None

    before = newest()

    argv = ["train", *args.files]
    for override in args.overrides:
        argv += ["--set", override]
    if args.device:
        argv += ["--device", args.device]
    if args.load_step is not None:
        argv += ["--load-step", str(args.load_step)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun(["--standalone", "--nproc-per-node", str(args.nproc), "-m", "torchneox", *argv])
    except SignalException as e:
        # SIGTERM/SIGINT reached the launcher and its workers: they finish the step and save
        saved = newest()
        if saved and saved != before:
            print(
                f"stopped by {e.sigval.name}; every rank saved {Path(save) / saved}: rerun the "
                "same command to resume"
            )
            return 0
        print(f"torchneox: error: stopped by {e.sigval.name} before a checkpoint was saved")
        return 1
    except Exception as e:  # torchrun raises ChildFailedError naming each failed rank
        print(
            f"torchneox: error: a training process failed ({type(e).__name__}); its output is above",
            file=sys.stderr,
        )
        return 1
    return 0
