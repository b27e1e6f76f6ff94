"""GPT-NeoX's online data server as a rollout source: a real server process on loopback
(tests/data/dataserver.py) speaking the protocol, the safe unpickler, the answer's checks."""

from __future__ import annotations

import collections
import copyreg
import io
import math
import os
import pickle
import signal
import socket
import threading
import time

import numpy as np
import pytest

from tests.data.dataserver import start_server
from torchneox.base.errors import ConfigError, DataError, TrainingStopped
from torchneox.data.online import (
    DataServer,
    Group,
    check_addresses,
    groups_from_answer,
    safe_loads,
)

RECORDS = [
    {"prefix": [5, 6, 7], "completions": [[8, 9], [10], [11, 12, 2]], "rewards": [1.0, 0, -0.5]},
    {"prefix": [3], "completions": [[4, 4], [2]], "rewards": [0.25, 2]},
]
GROUPS = [
    Group([5, 6, 7], [[8, 9], [10], [11, 12, 2]], [1.0, 0.0, -0.5]),
    Group([3], [[4, 4], [2]], [0.25, 2.0]),
]
OTHER = [{"prefix": [1, 1], "completions": [[3]], "rewards": [7.5]}]


def one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def free_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fetch_returns_the_groups_the_server_sends(tmp_path):
    log = tmp_path / "requests.txt"
    with start_server(tmp_path, RECORDS, log=log) as (_, port):
        server = DataServer("127.0.0.1", port, dp_rank=0, timeout_s=10)
        assert server.address == f"127.0.0.1:{port}"
        train = server.fetch("train")
        valid = server.fetch("valid")
    assert train == GROUPS and valid == GROUPS
    assert all(type(r) is float for g in train for r in g.rewards)
    assert log.read_text().splitlines() == ["train", "valid"]


def test_the_default_address_is_loopback(tmp_path):
    with start_server(tmp_path, RECORDS) as (_, port):
        server = DataServer(ports=port, dp_rank=3, timeout_s=10)
        assert server.address == f"localhost:{port}"
        assert server.fetch("test") == GROUPS


def test_each_data_parallel_rank_reaches_its_own_server(tmp_path):
    with (
        start_server(tmp_path, RECORDS) as (_, port0),
        start_server(tmp_path, OTHER) as (_, port1),
    ):
        ports = [port0, port1]
        assert DataServer("127.0.0.1", ports, dp_rank=0, timeout_s=10).fetch("train") == GROUPS
        assert DataServer("127.0.0.1", ports, 1, timeout_s=10).fetch("train") == [
            Group([1, 1], [[3]], [7.5])
        ]
        ips = ["localhost", "127.0.0.1"]
        assert DataServer(ips, port1, dp_rank=1, timeout_s=10).address == f"127.0.0.1:{port1}"


def test_a_list_of_addresses_needs_one_per_rank():
    check_addresses("localhost", 10000, dp_size=8)  # one for every rank, as GPT-NeoX
    check_addresses(["a", "b"], [10000, 10001], dp_size=2)
    with pytest.raises(ConfigError) as e:
        check_addresses("localhost", [10000, 10001], dp_size=4, source="rl.yml")
    assert one_line(e).startswith("rl.yml: online_dataserver_ports: 2 ports for 4 data-parallel")
    with pytest.raises(ConfigError) as e:
        check_addresses(["h0"], 10000, dp_size=2)
    assert one_line(e).startswith("online_dataserver_ips: 1 host names or IP addresses for 2")
    with pytest.raises(ConfigError, match="online_dataserver_ports: 70000 is not a port"):
        check_addresses("localhost", [10000, 70000], dp_size=2)
    with pytest.raises(ConfigError, match="online_dataserver_ports: True is not a port"):
        check_addresses("localhost", True, dp_size=1)
    with pytest.raises(ConfigError, match="online_dataserver_ips: '' is not a host name"):
        check_addresses("", 10000, dp_size=1)
    with pytest.raises(ConfigError, match="online_dataserver_ports: 2 ports for 3 data-parallel"):
        DataServer("localhost", [10000, 10001], dp_rank=2)


def test_a_refused_connection_is_one_line_naming_the_address():
    port = free_port()
    with pytest.raises(DataError) as e:
        DataServer("127.0.0.1", port, 0, timeout_s=5).fetch("train")
    assert one_line(e) == (
        f"data server 127.0.0.1:{port}: connection refused; is the server running? "
        "check online_dataserver_ips / online_dataserver_ports"
    )


def test_an_unknown_host_is_one_line():
    with pytest.raises(DataError) as e:
        DataServer("no-such-host.invalid", 10000, 0, timeout_s=5).fetch("train")
    assert one_line(e).startswith(
        "data server no-such-host.invalid:10000: cannot resolve 'no-such-host.invalid'"
    )
    assert str(e.value).endswith("check online_dataserver_ips")


def test_a_silent_server_times_out(tmp_path):
    with start_server(tmp_path, RECORDS, mode="silent") as (_, port), pytest.raises(DataError) as e:
        DataServer("127.0.0.1", port, 0, timeout_s=0.5).fetch("train")
    assert one_line(e) == (
        f"data server 127.0.0.1:{port}: no whole answer to 'train' within 0.5 s (0 bytes came); "
        "check that the server is up and answering"
    )


def test_a_trickling_server_times_out_too(tmp_path):
    with (
        start_server(tmp_path, RECORDS, mode="trickle") as (_, port),
        pytest.raises(DataError) as e,
    ):
        DataServer("127.0.0.1", port, 0, timeout_s=0.5).fetch("valid")
    text = one_line(e)
    assert text.startswith(
        f"data server 127.0.0.1:{port}: no whole answer to 'valid' within 0.5 s ("
    )
    assert int(text.split("(")[1].split(" ")[0]) < len(pickle.dumps(RECORDS))


def test_a_dropped_connection_says_how_many_bytes_came(tmp_path):
    half = len(pickle.dumps(RECORDS)) // 2
    with start_server(tmp_path, RECORDS, mode="drop") as (_, port), pytest.raises(DataError) as e:
        DataServer("127.0.0.1", port, 0, timeout_s=10).fetch("train")
    assert one_line(e) == (
        f"data server 127.0.0.1:{port}: the connection closed after {half} bytes, before a "
        "whole pickle arrived; check the server's log"
    )


def test_a_reset_connection_is_one_line(tmp_path):
    with start_server(tmp_path, RECORDS, mode="reset") as (_, port), pytest.raises(DataError) as e:
        DataServer("127.0.0.1", port, 0, timeout_s=10).fetch("train")
    text = one_line(e)
    assert text.startswith(f"data server 127.0.0.1:{port}: the server reset the connection after")
    assert text.endswith(" bytes of the answer to 'train'; check the server's log")


def test_a_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "marker"
    with start_server(tmp_path, RECORDS, mode="malicious", marker=marker) as (_, port):
        with pytest.raises(DataError) as e:
            DataServer("127.0.0.1", port, 0, timeout_s=10).fetch("train")
        assert one_line(e) == (
            f"data server 127.0.0.1:{port}: the answer holds a {os.system.__module__}.system, "
            "which is refused (the data-server protocol carries only lists, dicts, ints, "
            "floats and strings)"
        )
        assert not marker.exists()
        # the same answer, unpickled as GPT-NeoX unpickles it, does run the command
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"train")
            answer = b"".join(iter(lambda: s.recv(65536), b""))
    pickle.loads(answer)
    assert marker.exists()


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_safe_loads_reads_plain_data_in_every_protocol(protocol):
    shared = [1, 2]
    value = {
        "a": [0, -1, 2**70, 1.5, float("inf"), "text\n", True, False, None, (1, ("x",))],
        "b": [shared, shared, {"nested": {"k": []}}],
        "c": list(range(3000)),
    }
    assert safe_loads(pickle.dumps(value, protocol=protocol), "s") == value


class _Persistent(pickle.Pickler):
    def persistent_id(self, obj):
        return "id" if obj == "secret" else None


def _persistent() -> bytes:
    out = io.BytesIO()
    _Persistent(out, protocol=2).dump(["secret"])
    return out.getvalue()


REFUSED = [
    (pickle.dumps([{1, 2}]), "a set"),
    (pickle.dumps([frozenset({1})]), "a frozenset"),
    (pickle.dumps([b"raw"]), "bytes"),
    (pickle.dumps([bytearray(b"x")], protocol=5), "a bytearray"),
    (pickle.dumps([1 + 2j]), "a builtins.complex"),
    (pickle.dumps(collections.OrderedDict(a=1)), "a collections.OrderedDict"),
    (pickle.dumps([np.float32(0.5)]), "a numpy."),
    (pickle.dumps([1 + 2j], protocol=0), "a __builtin__.complex"),
    (b"\x80\x02]\x82\x01a.", "an object of the extension registry"),
    (_persistent(), "a persistent id"),
    (b"\x80\x02]\x85R.", "a REDUCE opcode"),
    (b"\x80\x04\x8c\x03a\nb\x8c\x01c\x93.", "'a\\nb.c'"),  # a name is shown on one line
]


@pytest.mark.parametrize(("data", "holds"), REFUSED, ids=[holds for _, holds in REFUSED])
def test_safe_loads_refuses_everything_else(data, holds):
    with pytest.raises(DataError) as e:
        safe_loads(data, "server")
    assert one_line(e).startswith(f"server: the answer holds {holds}")
    assert str(e.value).endswith(
        ", which is refused (the data-server protocol carries only lists, dicts, ints, floats "
        "and strings)"
    )


def test_an_extension_code_is_refused_even_when_registered_and_cached():
    # a registered extension code, once loaded, is served from a cache that bypasses
    # find_class: only the opcode check keeps it out
    copyreg.add_extension("builtins", "complex", 241)
    try:
        data = pickle.dumps([1 + 2j], protocol=2)
        assert pickle.loads(data) == [1 + 2j]  # now in copyreg's extension cache
        with pytest.raises(DataError) as e:
            safe_loads(data, "s")
    finally:
        copyreg.remove_extension("builtins", "complex", 241)
    assert one_line(e).startswith("s: the answer holds an object of the extension registry")


def test_safe_loads_refuses_a_truncated_or_corrupt_pickle():
    data = pickle.dumps(RECORDS)
    with pytest.raises(DataError) as e:
        safe_loads(data[:-5], "s")
    assert (
        one_line(e) == f"s: the answer ends after {len(data) - 5} bytes, before its pickle is whole"
    )
    with pytest.raises(DataError, match=r"^s: the answer is not a pickle \(at position 0, opcode"):
        safe_loads(b"\xff\xfe\x00", "s")
    with pytest.raises(DataError, match=r"^s: the answer is empty, not a pickle$"):
        safe_loads(b"", "s")
    with pytest.raises(DataError, match=r"^s: the answer is not a valid pickle \(unhashable"):
        safe_loads(b"\x80\x02}]K\x01s.", "s")  # a list as a dict key


def _deep(levels: int = 100_000) -> list:
    """[[[...]]], ``levels`` deep: more than repr() can recurse into."""
    x: list = []
    for _ in range(levels):
        x = [x]
    return x


def _record(**change) -> dict:
    return {"prefix": [1, 2], "completions": [[3], [4, 5]], "rewards": [1.0, 0.0]} | change


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"prefix": [1]}, "the answer is {'prefix': [1]}, not a list of records"),
        ([], "the answer holds no records"),
        ([[1, 2]], "record 0: it is [1, 2], not a dict of prefix, completions and rewards"),
        ([_record(), {"prefix": [1], "completions": [[2]]}], "record 1: no 'rewards'"),
        ([_record(prefix="1 2")], "record 0: 'prefix' is '1 2', not a list of token ids"),
        ([_record(prefix=[])], "record 0: 'prefix' is empty"),
        ([_record(prefix=[1, 2.0])], "record 0: 'prefix' token 1 is 2.0, not a token id (an int)"),
        ([_record(prefix=[True])], "record 0: 'prefix' token 0 is True, not a token id (an int)"),
        (
            [_record(), _record(completions=[[3], [4, -5]])],
            "record 1: completion 1 token 1 is -5, a negative token id",
        ),
        ([_record(completions=[])], "record 0: 'completions' is empty"),
        ([_record(completions=[[3], []])], "record 0: completion 1 is empty"),
        ([_record(completions=[3, 4])], "record 0: completion 0 is 3, not a list of token ids"),
        (
            [_record(rewards=[1.0])],
            "record 0: 1 rewards for 2 completions; give one per completion",
        ),
        ([_record(rewards=1.0)], "record 0: 'rewards' is 1.0, not a list of numbers"),
        (
            [_record(rewards=[1.0, math.nan])],
            "record 0: reward 1 is nan; every reward must be finite",
        ),
        (
            [_record(rewards=[-math.inf, 0])],
            "record 0: reward 0 is -inf; every reward must be finite",
        ),
        ([_record(rewards=[True, 0.0])], "record 0: reward 0 is True, not a number"),
        ([_record(rewards=["1", 0.0])], "record 0: reward 0 is '1', not a number"),
        (
            [_record(prefix=["x" * 100])],
            "record 0: 'prefix' token 0 is 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...",
        ),
        (  # inf once it is float32, as the rewards train
            [_record(rewards=[0.5, 1e39])],
            "record 0: reward 1 is 1e+39, beyond float32 (at most 3.403e+38 in size); every "
            "reward must be a finite float32",
        ),
        (
            [_record(rewards=[10**400, 0])],
            "record 0: reward 0 is 100000000000000000...0000000000000000000, beyond float32",
        ),
        # nested too deep for repr(): shown a few levels deep
        ({"a": _deep()}, "the answer is {'a': [[[...]]]}, not a list of records"),
        ([_deep()], "record 0: it is [[[[...]]]], not a dict of prefix, completions and rewards"),
        ([_record(rewards={"r": _deep()})], "record 0: 'rewards' is {'r': [[[...]]]}, not a list"),
        ([_record(rewards=[_deep(), 0.0])], "record 0: reward 0 is [[[[...]]]], not a number"),
    ],
    ids=lambda v: v[:60] if isinstance(v, str) else None,
)
def test_groups_from_answer_names_the_record_and_the_fault(answer, message):
    with pytest.raises(DataError) as e:
        groups_from_answer(answer, "data server h:1")
    assert one_line(e).startswith(f"data server h:1: {message}")


def test_groups_from_answer_reads_records_and_checks_the_vocabulary():
    records = [_record(rewards=[1, 0.5], extra="ignored")]
    (group,) = groups_from_answer(records, "s", vocab_size=6)
    assert group == Group([1, 2], [[3], [4, 5]], [1.0, 0.5])
    assert type(group.rewards[0]) is float
    with pytest.raises(DataError) as e:
        groups_from_answer(records, "s", vocab_size=5)
    assert one_line(e) == "s: record 0: completion 1 token 1 is 5, beyond the vocabulary (5 tokens)"


def test_a_deeply_nested_answer_is_read_and_refused_in_one_line():
    """The unpickler builds it (no recursion), the message shows a few levels of it."""
    levels = 100_000
    data = b"\x80\x02" + b"]" * (levels + 1) + b"a" * levels + b"."  # [[[...]]] pickled
    with pytest.raises(DataError) as e:
        groups_from_answer(safe_loads(data, "s"), "s")
    assert (
        one_line(e)
        == "s: record 0: it is [[[[...]]]], not a dict of prefix, completions and rewards"
    )


def test_an_answer_longer_than_the_cap_is_refused_as_it_arrives(tmp_path):
    from torchneox.data.online import MAX_ANSWER_BYTES

    size = len(pickle.dumps(RECORDS))
    with start_server(tmp_path, RECORDS) as (_, port):
        assert DataServer("127.0.0.1", port, 0, timeout_s=10, max_bytes=size).fetch("t") == GROUPS
        with pytest.raises(DataError) as e:
            DataServer("127.0.0.1", port, 0, timeout_s=10, max_bytes=size - 1).fetch("train")
    assert one_line(e) == (
        f"data server 127.0.0.1:{port}: the answer to 'train' is longer than {size - 1:,} bytes, "
        "the most a data server's answer may be; send fewer or shorter rollouts per answer"
    )
    assert MAX_ANSWER_BYTES == 1 << 30  # the default (docs/post-training.md says it)


def test_ctrl_c_interrupts_the_wait_for_a_silent_server(tmp_path):
    """SIGINT while a reinforce run waits for its data server's answer (the trainer's handler
    would only ask for a stop after the step, i.e. after online_dataserver_timeout): one line
    naming the server; the replaced handler back after."""
    from torchneox.train.rl.sources import ServedRollouts

    asked = []

    def trainers(*args):
        asked.append(args)

    with start_server(tmp_path, RECORDS, mode="silent") as (_, port):
        source = ServedRollouts(DataServer("127.0.0.1", port, 0, timeout_s=10), "train", "none")
        previous = signal.signal(signal.SIGINT, trainers)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        began = time.monotonic()
        timer.start()
        try:
            with pytest.raises(TrainingStopped) as e:
                source.make(0)
        finally:
            timer.cancel()
            restored = signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - began < 5
    text = one_line(e)
    assert text.startswith(f"data server 127.0.0.1:{port}: interrupted by SIGINT (Ctrl-C) after ")
    assert text.endswith(" s waiting for its answer to 'train'; nothing of this step was saved")
    assert restored is trainers and asked == []
