"""The records of ``--data-path`` for the jsonl provider: which files, which lines, in which order.

``--data-path`` is one source or a comma-separated list of them, each with an optional weight:

    data/train.jsonl                       one file
    data/chat/                             every ``*.jsonl`` below the folder (sorted), one source
    a.jsonl:3,b.jsonl:1                    blended 3:1
    a.jsonl,b.jsonl                        blended by size (each record once per pass)

Files are not parsed up front: each is scanned once for the byte offset and line number of its
non-blank lines (16 bytes a record), and a record is read and parsed when it is asked for.

Blending is a deterministic interleave, the same on every rank and every run: over one period
of ``P`` rows source ``s`` fills ``q_s`` rows (``q_s / P`` is its weight's share; whole-number
weights are kept exactly, others to 1 part in 10,000), its ``k``-th row of the period falling at
``(k + 0.5) / q_s`` of the period (ties to the earlier source). Each source walks its records
in file order and starts again at its first when it runs out; one pass of the blend ends when
every record of every source has been used at least once.

Shuffled (``Blend(..., seed=S)``: training, unless ``--no-shuffle``): each source walks its records in
a seeded permutation, a new one for each pass over it, and the rows of each period are dealt in a
seeded order too; the share of every source within a period is unchanged. The order is a function of
the seed and the row index alone: the same on every rank, and a run resumed at row ``j`` reads what
the straight run read there.

Validation held out of the training records (``valid_fraction`` f): record ``i`` of each source
(in file order) is held out when ``floor((i + 1) f) > floor(i f)`` -- the last of every 1/f
records -- and trains no more.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import reduce

import numpy as np

from .sample import BadSample, DataError

EXTENSION = ".jsonl"
CHUNK_BYTES = 1 << 22  # 4 MB reads: 1.4 s and ~90 MB of peak memory for a million 360-byte lines
MAX_PERIOD = 1_000_000  # rows in one blend period with whole-number weights
FRACTION_PERIOD = 10_000  # rows in one blend period with fractional weights
_WHITESPACE = np.array([9, 10, 13, 32], dtype=np.uint8)
# One record's bytes at most: a conversation is kilobytes; a longer line is read no further (a 50 MB
# line drove a loader worker to 21 GB) and is a ``line_too_long`` skip (``parse_record``).
MAX_LINE_BYTES = 8 << 20


@dataclass(frozen=True)
class SourceSpec:
    text: str  # as written in the flag
    path: str
    weight: float | None
    files: tuple[str, ...]


def check_data_path(value: str | None, flag: str = "--data-path") -> list[SourceSpec]:
    """The sources ``value`` names; a ``DataError`` naming ``flag`` for a path that does not exist, a
    folder without ``.jsonl`` files, a file of another kind or a weight that is not a positive number.
    Reads no records: cheap enough to call before launch."""
    if not value or not value.strip():
        raise DataError(
            f"{flag} is required for --dataset-provider jsonl (a .jsonl file, a folder of them, "
            "or a comma-separated list such as a.jsonl:3,b.jsonl:1)"
        )
    specs = [_spec(item.strip(), value, flag) for item in value.split(",") if item.strip()]
    weighted = [s.weight is not None for s in specs]
    if any(weighted) and not all(weighted):
        raise DataError(f"{flag} {value!r}: give a weight to every source or to none (e.g. a.jsonl:3,b.jsonl:1)")
    return specs


def _spec(item: str, value: str, flag: str) -> SourceSpec:
    path, weight = item, None
    head, sep, tail = item.rpartition(":")
    if sep and head and not os.path.exists(item):  # a path that exists as written is never read as a weight
        try:
            weight = float(tail)
        except ValueError:
            pass  # a ':' that is part of the path
        else:
            path = head
            if not math.isfinite(weight) or weight <= 0:
                raise DataError(f"{flag} {value!r}: the weight of {path!r} must be a positive number, got {tail!r}")
    if os.path.isdir(path):
        files = jsonl_files(path)
        if not files:
            raise DataError(f"{flag} {value!r}: the folder {path!r} holds no {EXTENSION} files")
    elif os.path.isfile(path):
        if not path.endswith(EXTENSION):
            raise DataError(f"{flag} {value!r}: {path!r} is not a {EXTENSION} file (one JSON conversation a line)")
        files = [path]
    else:
        raise DataError(f"{flag} {value!r}: {path!r}: no such file or directory")
    return SourceSpec(item, path, weight, tuple(files))


def jsonl_files(folder: str) -> list[str]:
    """The ``.jsonl`` files under ``folder`` in path order, each once: symlinked folders are followed,
    but a folder already walked (a link to ``.`` or to a parent) is not walked again, and a file
    reached by two paths counts at its first. (A link to the parent made one file count 41 times;
    two links to ``.`` walked forever.)"""
    walked, found = set(), []
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in walked:
            dirs[:] = []
            continue
        walked.add(real)
        dirs.sort()  # which of two paths to one folder is walked: the same on every host
        found += [os.path.join(root, name) for name in names if name.endswith(EXTENSION)]
    seen, files = set(), []
    for path in sorted(found):
        if os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            files.append(path)
    return files


def index_lines(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(byte offset, 1-based line number) of every line of ``path`` holding more than whitespace."""
    starts, ends, before_start, before_end = [np.zeros(1, np.int64)], [], [np.zeros(1, np.int64)], []
    position = nonblank_total = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            data = np.frombuffer(chunk, np.uint8)
            nonblank = np.cumsum(~np.isin(data, _WHITESPACE), dtype=np.int32)  # a chunk's count fits
            newlines = np.flatnonzero(data == 10)
            counted = nonblank_total + np.where(newlines > 0, nonblank[newlines - 1], 0)
            ends.append(position + newlines)
            before_end.append(counted)
            starts.append(position + newlines + 1)
            before_start.append(counted)  # a newline is whitespace: the count before it stands after it
            nonblank_total += int(nonblank[-1])
            position += len(chunk)
    ends.append(np.array([position], np.int64))
    before_end.append(np.array([nonblank_total], np.int64))
    starts, ends = np.concatenate(starts), np.concatenate(ends)
    has_text = np.concatenate(before_end) > np.concatenate(before_start)
    return starts[has_text], (np.flatnonzero(has_text) + 1).astype(np.int64)


class Records:
    """An ordered selection of lines of some files: record ``i`` is (file, byte offset, line)."""

    def __init__(self, files: list[str], file_ids: np.ndarray, offsets: np.ndarray, lines: np.ndarray):
        self.files, self.file_ids, self.offsets, self.lines = files, file_ids, offsets, lines

    @classmethod
    def of(cls, files) -> "Records":
        indexed = [index_lines(f) for f in files]
        return cls(
            list(files),
            np.concatenate([np.full(len(o), i, np.int32) for i, (o, _) in enumerate(indexed)]),
            np.concatenate([o for o, _ in indexed]),
            np.concatenate([n for _, n in indexed]),
        )

    def __len__(self) -> int:
        return len(self.offsets)

    def select(self, keep: np.ndarray) -> "Records":
        return Records(self.files, self.file_ids[keep], self.offsets[keep], self.lines[keep])

    def where(self, i: int) -> tuple[str, int]:
        return self.files[self.file_ids[i]], int(self.lines[i])

    def read(self, i: int) -> bytes:
        """Record ``i``'s line, at most ``MAX_LINE_BYTES + 1`` bytes of it (``parse_record`` refuses more)."""
        with open(self.files[self.file_ids[i]], "rb") as f:
            f.seek(int(self.offsets[i]))
            return f.readline(MAX_LINE_BYTES + 1).removeprefix(b"\xef\xbb\xbf")  # a BOM some editors write


def parse_record(line: bytes | str):
    """The JSON value of one line; ``BadSample`` for a line over ``MAX_LINE_BYTES``, one that is not
    JSON, or one nested deeper than Python's JSON reader goes."""
    if len(line) > MAX_LINE_BYTES:
        raise BadSample(
            "line_too_long",
            f"a line over {MAX_LINE_BYTES >> 20} MiB; a conversation is far shorter "
            "(store large media as files next to the JSONL)",
        )
    try:
        return json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadSample("bad_json", f"not a JSON line: {err}") from None
    except RecursionError:
        raise BadSample("bad_json", "JSON nested deeper than Python's reader goes") from None


def hold_out(n: int, fraction: float) -> np.ndarray:
    """Which of ``n`` records are held out for validation (see the module docstring)."""
    i = np.arange(n, dtype=np.float64)
    return np.floor((i + 1) * fraction) > np.floor(i * fraction)


def quotas(weights: list[float], exact: bool = False) -> list[int]:
    """Whole rows per period for each weight, as small as keeps their ratio (see the docstring);
    ``exact``: whole-number weights kept however long the period."""
    if all(float(w).is_integer() for w in weights) and (exact or sum(weights) <= MAX_PERIOD):
        counts = [int(w) for w in weights]
    else:
        shares = [w / sum(weights) * FRACTION_PERIOD for w in weights]
        counts = [max(1, math.floor(s)) for s in shares]
        for j in sorted(range(len(shares)), key=lambda j: shares[j] - math.floor(shares[j]), reverse=True):
            if sum(counts) >= FRACTION_PERIOD:
                break
            counts[j] += 1
    divisor = reduce(math.gcd, counts)
    return [c // divisor for c in counts]


class Blend:
    """Rows of several ``Records`` interleaved by weight (by size without weights): row ``j`` is
    record ``blend[j][1]`` of part ``blend[j][0]``."""

    def __init__(self, parts: list[Records], weights: list[float] | None = None, seed: int | None = None):
        """``seed``: shuffled by it (see the module docstring); None: file order."""
        self.seed = seed
        self._orders: dict = {}  # (stream, part or period, pass) -> the permutation last drawn for it
        sizes = [len(p) for p in parts]
        by_size = weights is None
        weights = sizes if by_size else weights
        keep = [i for i, n in enumerate(sizes) if n]
        self.parts, self.sizes = [parts[i] for i in keep], [sizes[i] for i in keep]
        self.quotas = quotas([weights[i] for i in keep], exact=by_size) if keep else []
        if len(self.parts) <= 1:  # one source: its records in order
            self.period, self.passes = (self.sizes[0] if keep else 0), 1
            return
        times = np.concatenate([(np.arange(q) + 0.5) / q for q in self.quotas])
        part = np.concatenate([np.full(q, i, np.int32) for i, q in enumerate(self.quotas)])
        rank = np.concatenate([np.arange(q, dtype=np.int64) for q in self.quotas])
        order = np.lexsort((part, times))
        self.slot_part, self.slot_rank = part[order], rank[order]
        self.period = len(order)
        self.passes = max(-(-n // q) for n, q in zip(self.sizes, self.quotas))

    def __len__(self) -> int:
        return self.period * self.passes

    def __getitem__(self, j: int) -> tuple[Records, int]:
        if len(self.parts) == 1:
            return self.parts[0], self._record(0, j)
        cycle, slot = divmod(j, self.period)
        if self.seed is not None:
            slot = self._permuted("slots", 0, cycle, self.period, slot)
        part = int(self.slot_part[slot])
        return self.parts[part], self._record(part, cycle * self.quotas[part] + int(self.slot_rank[slot]))

    def _record(self, part: int, k: int) -> int:
        """The record of ``part`` its ``k``-th row reads: in file order, or the seeded order of that pass."""
        passes, index = divmod(k, self.sizes[part])
        if self.seed is None:
            return index
        return self._permuted("records", part, passes, self.sizes[part], index)

    def _permuted(self, stream: str, which: int, draw: int, size: int, index: int) -> int:
        key = (stream, which)
        if key not in self._orders or self._orders[key][0] != draw:  # one cached permutation per stream
            rng = np.random.default_rng([self.seed, 0 if stream == "slots" else 1 + which, draw])
            self._orders[key] = (draw, rng.permutation(size))
        return int(self._orders[key][1][index])
