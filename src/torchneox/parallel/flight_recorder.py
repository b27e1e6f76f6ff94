"""What a rank was doing when the run lost another: torch's flight recorder.

torch records the last collectives of every process group (gloo and NCCL alike) in a ring
buffer when ``TORCH_FR_BUFFER_SIZE`` is set before the process group starts; torchneox sets it
(unless the user did). When a collective times out or a peer goes away, each surviving rank
writes its record as JSON next to the checkpoints (``flight_recorder/rank{R}.json``) and names
the collective it was stuck in: comparing the ranks' records (the collective sequence numbers
of each process group) shows which rank never arrived. The entries are torch's own fields (its
``_dump_fr_trace_json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
ENTRIES = 2000  # collectives kept per process: a few steps' worth


def enable() -> None:
    """Record collectives from the next process group on (call before init_process_group)."""
    os.environ.setdefault(BUFFER_ENV, str(ENTRIES))


def entries() -> list[dict[str, Any]]:
    """This process's recorded collectives, oldest first (empty when nothing is recorded)."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json

        return json.loads(_dump_fr_trace_json()).get("entries", [])
    except Exception:  # no recorder in this build, or nothing recorded
        return []


def describe(recorded: list[dict[str, Any]]) -> str | None:
    """The last collective this rank entered (the one a lost peer left it waiting in: gloo
    marks a timed-out collective retired too, and only NCCL tracks each one's state)."""
    if not recorded:
        return None
    e = recorded[-1]
    group = e.get("process_group", ["?", "?"])
    sizes = e.get("input_sizes") or []
    shape = "x".join(map(str, sizes[0])) if sizes and sizes[0] else "no"
    state = f", {e['state']}" if not str(e.get("profiling_name", "")).startswith("gloo") else ""
    return (
        f"{e.get('profiling_name', '?')} #{e.get('collective_seq_id', '?')} of process group "
        f"{group[-1]} ({group[0]}) on a {shape} tensor{state}"
    )


def dump(folder: Path | None, rank: int) -> tuple[Path | None, str | None]:
    """Write this rank's record under ``folder`` (atomically; None: nowhere) and describe it.
    Never raises: it runs while a run is already failing."""
    recorded = entries()
    path = None
    if folder is not None and recorded:
        try:
            out = Path(folder) / "flight_recorder"
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"rank{rank}.json"
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({"rank": rank, "entries": recorded}, indent=1))
            tmp.replace(path)
        except OSError:
            path = None
    return path, describe(recorded)
