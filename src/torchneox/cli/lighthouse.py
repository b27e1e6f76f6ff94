"""``torchneox lighthouse``: torchft's lighthouse, the server through which replica groups
agree on each step's quorum; it prints its address (what ft_lighthouse names) and serves
until it is stopped."""

from __future__ import annotations

import argparse
import signal
import threading

from torchneox.base.errors import ConfigError


def add_lighthouse_verb(verbs: argparse._SubParsersAction) -> None:
    lh = verbs.add_parser(
        "lighthouse",
        help="start torchft's lighthouse for replica groups (ft_lighthouse) and print its address",
    )
    lh.add_argument("--port", type=int, default=29510, help="the port it listens on (0: any)")
    lh.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="fewest replica groups a quorum may hold (a step waits until this many are live)",
    )
    lh.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="how long a new quorum waits for live groups that have not joined yet",
    )
    lh.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="how long a group may go silent before it counts as dead",
    )


def cmd_lighthouse(args: argparse.Namespace) -> int:
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise ConfigError(
            "the lighthouse is torchft's: pip install 'torchneox[ft]'", key="lighthouse"
        ) from None
    if args.min_replicas < 1:
        raise ConfigError("--min-replicas must be 1 or more", key="lighthouse")
    server = LighthouseServer(
        bind=f"[::]:{args.port}",
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    print(f"lighthouse: {server.address()}", flush=True)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
