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


def _check(args: argparse.Namespace) -> None:
    """The options' ranges, each a one-line mistake."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0 (any) to 65535, got {args.port}", key="lighthouse")
    if args.min_replicas < 1:
        raise ConfigError("--min-replicas must be 1 or more", key="lighthouse")
    for name in ("join_timeout_ms", "heartbeat_timeout_ms"):
        if getattr(args, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be > 0, got {getattr(args, name)}", key="lighthouse")


def cmd_lighthouse(args: argparse.Namespace) -> int:
    _check(args)
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise ConfigError(
            "the lighthouse is torchft's: pip install 'torchneox[ft]'", key="lighthouse"
        ) from None
    try:
        server = LighthouseServer(
            bind=f"[::]:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except RuntimeError as e:  # the port taken, say
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"cannot listen on port {args.port} ({first}); choose another --port",
            key="lighthouse",
        ) from None
    print(f"lighthouse: {server.address()}", flush=True)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
