"""Raw records of one unit read from a position on: jsonl lines (bytes, parsed later in the
loader's workers) or a parquet/arrow column's values, each with where it came from (file and
line, or file and row) and the position after it, so that reading can start again there.

A position is (records read, byte offset): the lines read so far of a jsonl file (blank ones
too) and where the next begins (plain files seek to it; .gz/.zst read up to it again), or the
rows read so far of an arrow file or a parquet row group.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator
from typing import Any

from torchneox.base.errors import DataError
from torchneox.data.stream.sources import Unit, need

Record = tuple[str, bool, Any]
"""(where, is a jsonl line, raw): raw is the line's bytes, or a column's value."""

BATCH_ROWS = 1024


def read_unit(unit: Unit, key: str, row: int, byte: int) -> Iterator[tuple[int, int, Record]]:
    """(records read, byte offset, record) after each record of ``unit`` from (row, byte) on;
    blank jsonl lines are counted, not yielded."""
    try:
        if unit.kind == "jsonl":
            yield from _jsonl(unit.file, row, byte)
        elif unit.kind == "parquet":
            yield from _parquet(unit, key, row)
        else:
            yield from _arrow(unit.file, key, row)
    except DataError:
        raise
    except (OSError, EOFError, ValueError) as e:
        raise DataError(f"{unit.file}: cannot be read ({str(e)[:160]})") from None
    except Exception as e:  # zstandard's and pyarrow's own errors
        if type(e).__module__.split(".")[0] in ("zstandard", "pyarrow"):
            raise DataError(f"{unit.file}: cannot be read ({str(e)[:160]})") from None
        raise


def _open_binary(path: str) -> io.BufferedIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    if path.endswith(".zst"):
        zstandard = need("zstandard", path, ".zst")
        raw = open(path, "rb")  # noqa: SIM115 (closed with the reader)
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return open(path, "rb")


def _jsonl(path: str, row: int, byte: int) -> Iterator[tuple[int, int, Record]]:
    with _open_binary(path) as f:
        if row:
            if path.endswith((".gz", ".zst")):
                for _ in range(row):
                    f.readline()
            else:
                f.seek(byte)
        for line in f:
            row += 1
            byte += len(line)
            text = line[:-1] if line.endswith(b"\n") else line
            if text.endswith(b"\r"):
                text = text[:-1]
            if text.strip():
                yield row, byte, (f"{path}:{row}", True, text)


def _column(batch: Any, key: str, path: str) -> Any:
    index = batch.schema.get_field_index(key)
    if index < 0:
        raise DataError(
            f"{path}: no column {key!r} (columns: {', '.join(batch.schema.names)}); "
            "set jsonl_keys to the text column"
        )
    return batch.column(index)


def _rows(batches: Iterator[Any], key: str, path: str, row: int, first: int):
    seen = 0
    for batch in batches:
        if seen + batch.num_rows <= row:
            seen += batch.num_rows
            continue
        values = _column(batch, key, path).to_pylist()
        for i in range(max(row - seen, 0), len(values)):
            yield seen + i + 1, 0, (f"{path}: row {first + seen + i + 1}", False, values[i])
        seen += batch.num_rows


def _parquet(unit: Unit, key: str, row: int) -> Iterator[tuple[int, int, Record]]:
    pq = need("pyarrow.parquet", unit.file, "parquet")
    with pq.ParquetFile(unit.file) as f:
        if key not in f.schema_arrow.names:
            raise DataError(
                f"{unit.file}: no column {key!r} (columns: {', '.join(f.schema_arrow.names)}); "
                "set jsonl_keys to the text column"
            )
        batches = f.iter_batches(batch_size=BATCH_ROWS, row_groups=[unit.group], columns=[key])
        yield from _rows(batches, key, unit.file, row, unit.first_row)


def _arrow(path: str, key: str, row: int) -> Iterator[tuple[int, int, Record]]:
    pa = need("pyarrow", path, "arrow")
    with pa.OSFile(path) as raw:
        try:
            reader = pa.ipc.open_file(raw)
            batches: Any = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # the streaming format, as datasets writes it
            raw.seek(0)
            batches = iter(pa.ipc.open_stream(raw))
        yield from _rows(batches, key, path, row, 0)
