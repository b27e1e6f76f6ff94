"""GPT-NeoX's online data server as a rollout source (``dataset_impl: online``), made safe.

The protocol (megatron/data/online_dataset.py at ea7aefd): the client opens a TCP connection to
its data-parallel rank's server, sends the split name ("train", "valid" or "test") as bytes with
no framing, and reads until the server closes; the server answers with ``pickle.dumps`` of a
list of records ``{"prefix": [int], "completions": [[int]], "rewards": [float]}``, one record
per prompt.

GPT-NeoX unpickles the answer as it comes, so anything on the network path can run code in the
trainer. Here the answer is read by ``safe_loads``: its opcodes are checked first (only those
that build lists, dicts, tuples, ints, floats, strings, bools and None; sets, bytes, globals,
persistent ids, extension codes and out-of-band buffers are refused), then it is unpickled with
an unpickler whose ``find_class`` and ``persistent_load`` always refuse (the opcode check is
needed too: an extension code already in copyreg's cache reaches the unpickler without
``find_class``). The connection must open, and then the whole answer arrive, each within the
timeout; an answer longer than ``MAX_ANSWER_BYTES`` is refused as it arrives (the server's
memory is not the trainer's to fill); each failure is one line naming the server's address.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchneox.base.errors import ConfigError, DataError, first_line, shown
from torchneox.config.derivations.rl import for_rank

IPS_KEY = "online_dataserver_ips"
PORTS_KEY = "online_dataserver_ports"
DEFAULT_IP = "localhost"  # GPT-NeoX's default: loopback
DEFAULT_PORT = 10000
CARRIES = "the data-server protocol carries only lists, dicts, ints, floats and strings"
CHUNK = 1 << 16
MAX_ANSWER_BYTES = 1 << 30
"""The longest answer read (1 GiB; a rollout batch of a million tokens pickles to a few MB)."""
FP32_MAX = 3.4028234663852886e38
"""The largest float32: rewards train as float32, so a larger one would become inf."""

# the opcodes that build lists, dicts, tuples, ints, floats, strings, bools and None, and the
# stack, memo and framing ones; nothing here names or calls anything
# fmt: off
_ALLOWED = frozenset((
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4",
    "FLOAT", "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE",
    "STRING", "BINSTRING", "SHORT_BINSTRING",
    "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
))
# fmt: on
# opcodes that name a global: the unpickler's find_class reports which one
_GLOBALS = frozenset({"GLOBAL", "STACK_GLOBAL", "INST"})
# what the other refused opcodes would have built, for the message
_REFUSED = {
    "EMPTY_SET": "a set",
    "ADDITEMS": "a set",
    "FROZENSET": "a frozenset",
    "BINBYTES": "bytes",
    "SHORT_BINBYTES": "bytes",
    "BINBYTES8": "bytes",
    "BYTEARRAY8": "a bytearray",
    "NEXT_BUFFER": "an out-of-band buffer",
    "READONLY_BUFFER": "an out-of-band buffer",
    "PERSID": "a persistent id",
    "BINPERSID": "a persistent id",
    "EXT1": "an object of the extension registry",
    "EXT2": "an object of the extension registry",
    "EXT4": "an object of the extension registry",
}


@dataclass(frozen=True)
class Group:
    """One prompt's rollouts: its token ids, n completions' token ids, one reward each."""

    prompt: list[int]
    completions: list[list[int]]
    rewards: list[float]


class _Refused(Exception):
    """A global the answer names (raised by the unpickler, turned into a DataError)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler that never looks up a global or a persistent id."""

    def find_class(self, module: str, name: str) -> Any:
        text = f"{module}.{name}"
        raise _Refused(f"a {text}" if text.isprintable() and len(text) <= 80 else shown(text))

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("a persistent id")


def _refused(source: str, what: str) -> DataError:
    return DataError(f"{source}: the answer holds {what}, which is refused ({CARRIES})")


def _first_refused_opcode(data: bytes, source: str) -> str | None:
    """The name of the first opcode outside _ALLOWED (None when every one is allowed); a
    truncated or corrupt pickle is a DataError."""
    stream = io.BytesIO(data)
    try:
        for opcode, _arg, _pos in pickletools.genops(stream):
            if opcode.name not in _ALLOWED:
                return opcode.name
    except ValueError as e:
        reason = first_line(e)
        if "unknown" not in reason and stream.tell() >= len(data):
            raise DataError(
                f"{source}: the answer ends after {len(data)} bytes, before its pickle is whole"
            ) from None
        raise DataError(f"{source}: the answer is not a pickle ({reason})") from None
    return None


def safe_loads(data: bytes, source: str) -> Any:
    """``pickle.loads`` of a data server's answer, restricted to plain data: lists, dicts, ints,
    floats and strings (and tuples, bools and None, which need no global). Anything else, and a
    truncated or corrupt pickle, is a one-line DataError starting with ``source``."""
    if not data:
        raise DataError(f"{source}: the answer is empty, not a pickle")
    refused = _first_refused_opcode(bytes(data), source)
    if refused is not None and refused not in _GLOBALS:
        raise _refused(source, _REFUSED.get(refused, f"a {refused} opcode"))
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise _refused(source, e.what) from None
    except Exception as e:  # a malformed pickle the opcode scan let through (unhashable key, ...)
        raise DataError(f"{source}: the answer is not a valid pickle ({first_line(e)})") from None


def _tokens(ids: Any, where: str, vocab_size: int | None) -> list[int]:
    """A list of token ids, checked; ``where`` names it in the message."""
    if not isinstance(ids, list):
        raise ValueError(f"{where} is {shown(ids)}, not a list of token ids")
    if not ids:
        raise ValueError(f"{where} is empty")
    for j, t in enumerate(ids):
        if type(t) is not int:
            raise ValueError(f"{where} token {j} is {shown(t)}, not a token id (an int)")
        if t < 0:
            raise ValueError(f"{where} token {j} is {t}, a negative token id")
        if vocab_size is not None and t >= vocab_size:
            raise ValueError(
                f"{where} token {j} is {t}, beyond the vocabulary ({vocab_size} tokens)"
            )
    return ids


def _rewards(values: Any, n: int) -> list[float]:
    if not isinstance(values, list):
        raise ValueError(f"'rewards' is {shown(values)}, not a list of numbers")
    if len(values) != n:
        raise ValueError(f"{len(values)} rewards for {n} completions; give one per completion")
    out = []
    for k, r in enumerate(values):
        if type(r) not in (int, float):
            raise ValueError(f"reward {k} is {shown(r)}, not a number")
        if type(r) is float and not math.isfinite(r):
            raise ValueError(f"reward {k} is {r}; every reward must be finite")
        if abs(r) > FP32_MAX:
            raise ValueError(
                f"reward {k} is {shown(r)}, beyond float32 (at most {FP32_MAX:.4g} in size); "
                "every reward must be a finite float32"
            )
        out.append(float(r))
    return out


def _group(record: Any, vocab_size: int | None) -> Group:
    if not isinstance(record, dict):
        raise ValueError(f"it is {shown(record)}, not a dict of prefix, completions and rewards")
    for key in ("prefix", "completions", "rewards"):
        if key not in record:
            raise ValueError(f"no '{key}'")
    prompt = _tokens(record["prefix"], "'prefix'", vocab_size)
    completions = record["completions"]
    if not isinstance(completions, list):
        raise ValueError(f"'completions' is {shown(completions)}, not a list of completions")
    if not completions:
        raise ValueError("'completions' is empty")
    completions = [_tokens(c, f"completion {k}", vocab_size) for k, c in enumerate(completions)]
    return Group(prompt, completions, _rewards(record["rewards"], len(completions)))


def groups_from_answer(obj: Any, source: str, vocab_size: int | None = None) -> list[Group]:
    """GPT-NeoX's answer, a list of ``{"prefix": [int], "completions": [[int]], "rewards":
    [float]}``, as Groups. Each record is checked; the first fault is a one-line DataError
    naming the record. Whole-number rewards become floats; bools are refused. Token ids at or
    beyond ``vocab_size`` (when given) are refused."""
    if not isinstance(obj, list):
        raise DataError(
            f"{source}: the answer is {shown(obj)}, not a list of records "
            "(prefix, completions, rewards)"
        )
    if not obj:
        raise DataError(f"{source}: the answer holds no records")
    groups = []
    for i, record in enumerate(obj):
        try:
            groups.append(_group(record, vocab_size))
        except ValueError as e:
            raise DataError(f"{source}: record {i}: {e}") from None
    return groups


def check_addresses(
    ips: str | Sequence[str], ports: int | Sequence[int], dp_size: int, source: str | None = None
) -> None:
    """GPT-NeoX's addressing: a str ip / int port serves every data-parallel rank; a list is
    indexed by the rank, so it needs one entry per rank. A ConfigError names the key."""
    for key, value, kind in ((IPS_KEY, ips, str), (PORTS_KEY, ports, int)):
        many = isinstance(value, (list, tuple))
        entries = list(value) if many else [value]
        what = "host names or IP addresses" if kind is str else "ports"
        if many and len(entries) < dp_size:
            raise ConfigError(
                f"{len(entries)} {what} for {dp_size} data-parallel ranks; give one per rank "
                "(a list) or one for every rank",
                source=source,
                key=key,
            )
        for entry in entries:
            if kind is str and (type(entry) is not str or not entry):
                raise ConfigError(
                    f"{shown(entry)} is not a host name or IP address", source=source, key=key
                )
            if kind is int and (type(entry) is not int or not 0 < entry < 65536):
                raise ConfigError(
                    f"{shown(entry)} is not a port (1 to 65535)", source=source, key=key
                )


class DataServer:
    """The data server of one data-parallel rank, as GPT-NeoX's OnlineDataset reaches it."""

    def __init__(
        self,
        ips: str | Sequence[str] = DEFAULT_IP,
        ports: int | Sequence[int] = DEFAULT_PORT,
        dp_rank: int = 0,
        timeout_s: float = 600.0,
        vocab_size: int | None = None,
        max_bytes: int = MAX_ANSWER_BYTES,
    ):
        check_addresses(ips, ports, dp_rank + 1)
        self.host: str = for_rank(ips, dp_rank)
        self.port: int = for_rank(ports, dp_rank)
        self.timeout_s = float(timeout_s)
        self.vocab_size = vocab_size
        self.max_bytes = max_bytes

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def fetch(self, split: str) -> list[Group]:
        """One request: ``split`` sent, the answer read until the server closes, checked."""
        source = f"data server {self.address}"
        data = self._exchange(split, source)
        if not data:
            raise DataError(
                f"{source}: the connection closed without an answer to '{split}'; "
                "check the server's log"
            )
        return groups_from_answer(self._loads(data, source), source, self.vocab_size)

    def _loads(self, data: bytes, source: str) -> Any:
        try:
            return safe_loads(data, source)
        except DataError as e:
            if "before its pickle is whole" not in str(e):
                raise
            raise DataError(
                f"{source}: the connection closed after {len(data)} bytes, before a whole "
                "pickle arrived; check the server's log"
            ) from None

    def _connect(self, source: str) -> socket.socket:
        keys = f"check {IPS_KEY} / {PORTS_KEY}"
        try:
            return socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except socket.gaierror as e:
            raise DataError(
                f"{source}: cannot resolve '{self.host}' ({first_line(e)}); check {IPS_KEY}"
            ) from None
        except ConnectionRefusedError:
            raise DataError(
                f"{source}: connection refused; is the server running? {keys}"
            ) from None
        except TimeoutError:
            raise DataError(
                f"{source}: no connection within {self.timeout_s:g} s; {keys}"
            ) from None
        except OSError as e:
            raise DataError(f"{source}: cannot connect ({first_line(e)}); {keys}") from None

    def _exchange(self, split: str, source: str) -> bytes:
        """Send ``split``, then read until the server closes: the whole answer within the
        timeout (a server that sends a byte now and then does not hold the run forever)."""
        chunks: list[bytes] = []
        received = 0
        with self._connect(source) as sock:
            deadline = time.monotonic() + self.timeout_s
            try:
                sock.sendall(split.encode())
                while True:
                    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                    if not (chunk := sock.recv(CHUNK)):
                        break
                    chunks.append(chunk)
                    received += len(chunk)
                    if received > self.max_bytes:
                        raise DataError(
                            f"{source}: the answer to '{split}' is longer than "
                            f"{self.max_bytes:,} bytes, the most a data server's answer may be; "
                            "send fewer or shorter rollouts per answer"
                        )
            except TimeoutError:
                raise DataError(
                    f"{source}: no whole answer to '{split}' within {self.timeout_s:g} s "
                    f"({received} bytes came); check that the server is up and answering"
                ) from None
            except ConnectionResetError:
                raise DataError(
                    f"{source}: the server reset the connection after {received} bytes of the "
                    f"answer to '{split}'; check the server's log"
                ) from None
            except OSError as e:
                raise DataError(
                    f"{source}: the connection failed after {received} bytes of the answer to "
                    f"'{split}' ({first_line(e)}); check the server's log"
                ) from None
        return b"".join(chunks)
