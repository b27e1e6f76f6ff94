"""A data server speaking GPT-NeoX's online protocol, for the tests (standard library only).

    python tests/data/dataserver.py --port 0 --groups FILE.json [--mode ok|malicious|drop|reset|silent]
                                    [--log FILE] [--marker FILE]

It binds 127.0.0.1, prints its port on stdout, and answers every connection as GPT-NeoX's example
server does (post-training/online_data_example_llama3.py): it reads the split name once, then
sends ``pickle.dumps`` of the records of FILE.json (a list of {"prefix", "completions",
"rewards"}) and closes. The other modes answer wrongly:

    malicious  a pickle whose object's ``__reduce__`` runs ``os.system`` (creating --marker)
    drop       the first half of the pickle, then a clean close
    reset      the first half of the pickle, then a reset (RST) instead of a close
    silent     reads the split and never answers (the connection stays open)
    trickle    sends the pickle one byte every 0.1 s

It exits when its parent process is gone.

``--log FILE`` appends each request's split name to FILE, one a line. ``--sequence``: FILE.json
is a list of answers, request k of a split getting answer k (the last once they run out), as a
server sampling from a changing policy answers. ``start_server`` runs it
for a test: ``with start_server(tmp_path, groups, mode) as (process, port): ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import shlex
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

MODES = ("ok", "malicious", "drop", "reset", "silent", "trickle")


class _RunsCode:
    """Unpickled by plain ``pickle.loads``, this runs a shell command."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def answer(records: list, mode: str, marker: str) -> bytes:
    if mode == "malicious":
        command = f"touch {shlex.quote(marker)}"
        payload = [{"prefix": [1], "completions": [[2]], "rewards": [_RunsCode(command)]}]
        return pickle.dumps(payload)
    return pickle.dumps(records)


def trickle(conn: socket.socket, body: bytes) -> None:
    for i in range(len(body)):
        conn.sendall(body[i : i + 1])
        time.sleep(0.1)


def serve(server: socket.socket, records: list, args: argparse.Namespace) -> None:
    held = []  # the silent mode's connections, kept open
    answers = records if args.sequence else [records]
    bodies = [answer(a, args.mode, args.marker) for a in answers]
    asked: dict[str, int] = {}  # requests so far per split
    parent = os.getppid()
    server.settimeout(1.0)
    while os.getppid() == parent:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        split = conn.recv(4096).decode()
        body = bodies[min(asked.get(split, 0), len(bodies) - 1)]
        asked[split] = asked.get(split, 0) + 1
        if args.log:
            with open(args.log, "a") as f:
                f.write(split + "\n")
        if args.mode == "silent":
            held.append(conn)
            continue
        if args.mode == "trickle":
            trickle(conn, body)
        elif args.mode in ("drop", "reset"):
            conn.sendall(body[: len(body) // 2])
            if args.mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            conn.sendall(body)
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--groups", required=True)
    parser.add_argument("--mode", choices=MODES, default="ok")
    parser.add_argument("--log")
    parser.add_argument("--marker", help="the file the malicious answer would create")
    parser.add_argument(
        "--sequence", action="store_true", help="FILE.json holds an answer a request"
    )
    args = parser.parse_args()
    if args.mode == "malicious" and not args.marker:
        parser.error("--mode malicious needs --marker")
    records = json.loads(Path(args.groups).read_text())
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", args.port))
    server.listen(8)
    print(server.getsockname()[1], flush=True)
    serve(server, records, args)


def records_of(groups: list) -> list[dict]:
    """GPT-NeoX's records of ``groups`` (records already, or objects with prompt, completions
    and rewards, as torchneox.data.online.Group)."""
    return [
        g
        if isinstance(g, dict)
        else {"prefix": g.prompt, "completions": g.completions, "rewards": g.rewards}
        for g in groups
    ]


@contextlib.contextmanager
def start_server(
    tmp_path: Path,
    groups: list,
    mode: str = "ok",
    log: Path | None = None,
    marker: Path | None = None,
    sequence: bool = False,
) -> Iterator[tuple[subprocess.Popen, int]]:
    """A server process answering every request with ``groups``; yields (process, port) and
    stops it on exit. ``log``: the file each request's split name is appended to; ``marker``:
    the file the malicious answer would create; ``sequence``: ``groups`` is a list of answers,
    one per request of a split."""
    tmp_path = Path(tmp_path)
    if mode == "malicious" and marker is None:
        marker = tmp_path / "marker"
    with tempfile.NamedTemporaryFile("w", dir=tmp_path, suffix=".json", delete=False) as f:
        json.dump([records_of(a) for a in groups] if sequence else records_of(groups), f)
    groups_file = f.name
    command = [sys.executable, __file__, "--port", "0", "--groups", groups_file]
    command += ["--mode", mode] + (["--sequence"] if sequence else [])
    if log is not None:
        command += ["--log", str(log)]
    if marker is not None:
        command += ["--marker", str(marker)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        if not line.strip():
            raise RuntimeError(f"the test data server did not start (exit {process.wait(5)})")
        yield process, int(line)
    finally:
        process.kill()
        process.wait(10)
        process.stdout.close()


if __name__ == "__main__":
    main()
