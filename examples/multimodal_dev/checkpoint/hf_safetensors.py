"""Reading Hugging Face checkpoint directories one tensor at a time (``safetensors_writer.py`` writes them).

``HFTensorSource`` reads a directory's safetensors headers (one file, or shards listed in
``model.safetensors.index.json``) and hands out tensors by name, each read from its file's offset
into memory of its own: a plain read, never a mapping of the file, so reading a tensor of an 8 GB
shard costs the tensor. With an index, each tensor is read from the shard the index names (a stale
copy in another shard is ignored); without one, a tensor found in two files is refused naming both.
A config.json or index that is not JSON, or not JSON of the expected shape, is refused naming the
file. MoE experts are served under both layouts' names whichever the files hold: per-expert files
(``...experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``, the hub's) also under the packed
names ``transformers`` uses (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I],
stacked when read), and packed files also expert by expert (a contiguous block of the file each).
The source knows each tensor's stored dtype and shape from the headers, before any read, names the
file tensors a set of names would leave unread, and records which tensors hold NaN or inf as they
are read, so an import can refuse them by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

INDEX = "model.safetensors.index.json"
_BLOCK_BYTES = 64 << 20  # a read converting its dtype goes through a buffer of this size
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# safetensors' dtype codes under torch's names, so messages and comparisons read like torch.
_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointFileError(ValueError):
    pass


def read_json(path: str, what: str):
    """A JSON file's content; a file that is not JSON is named in one line (json's own error names
    neither the file nor what it was meant to be)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise CheckpointFileError(
            f"{path}: not a valid {what}: not JSON ({err.msg} at line {err.lineno} column {err.colno})"
        ) from None
    except UnicodeDecodeError as err:
        raise CheckpointFileError(f"{path}: not a valid {what}: not JSON (not UTF-8 text: {err.reason})") from None


def read_index(path: str) -> dict[str, str]:
    """The weight map of a shard index: tensor name -> file name, checked to be that shape."""
    index = read_json(path, INDEX)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointFileError(
            f"{path}: not a valid {INDEX}: expected an object whose 'weight_map' maps tensor names to file names"
        )
    return weight_map


def _safetensors_files(hf_dir: str) -> tuple[list[str], dict[str, str] | None]:
    """(the safetensors files to open, the index's weight map or None without an index)."""
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"--hf-path {hf_dir}: no such directory")
    index = os.path.join(hf_dir, INDEX)
    if os.path.exists(index):
        weight_map = read_index(index)
        files = sorted(set(weight_map.values()))
        missing = [n for n in files if not os.path.exists(os.path.join(hf_dir, n))]
        if missing:
            raise CheckpointFileError(f"--hf-path {hf_dir}: {INDEX} lists files that are not there: {missing}")
        return [os.path.join(hf_dir, n) for n in files], weight_map
    files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointFileError(f"--hf-path {hf_dir}: no *.safetensors files and no {INDEX}")
    return [os.path.join(hf_dir, n) for n in files], None


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes lie: ``start`` (from the beginning of ``path``), its shape and dtype."""

    path: str
    start: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def block(self, index: int) -> "StoredTensor":
        """``self[index]`` along the leading dim (contiguous in the file, as every row-major slice is)."""
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        return StoredTensor(self.path, self.start + index * row, self.shape[1:], self.dtype)

    def rows(self, first: int, count: int) -> "StoredTensor":
        """``self[first:first + count]`` along the leading dim."""
        row = math.prod(self.shape[1:]) * self.dtype.itemsize
        return StoredTensor(self.path, self.start + first * row, (count, *self.shape[1:]), self.dtype)


def _checked_header(path: str) -> dict[str, tuple[str, StoredTensor]]:
    """Tensor name -> (safetensors dtype code, where its bytes lie) of a complete file. A file cut
    short (an interrupted copy) has a header promising more bytes than it holds; it would only fail,
    or read garbage, at the first access. A header length past the end of the file is corruption
    (reading it would ask for up to 2**64 bytes: MemoryError or OverflowError, naming nothing)."""
    actual = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFileError(f"{path}: truncated safetensors file (no header)")
        header_len = int.from_bytes(head, "little")
        if header_len > actual - 8:
            raise CheckpointFileError(
                f"{path}: corrupt safetensors file: header length {header_len} is more than "
                f"the {actual} bytes of the file"
            )
        try:
            header = json.loads(f.read(header_len))
            tensors = {k: t for k, t in header.items() if k != "__metadata__"}
            end = max((t["data_offsets"][1] for t in tensors.values()), default=0)
            found = {k: (t["dtype"], _stored(path, 8 + header_len, k, t)) for k, t in tensors.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError) as err:
            raise CheckpointFileError(f"{path}: truncated or corrupt safetensors header ({err!r})") from None
    expected = 8 + header_len + end
    if actual < expected:
        raise CheckpointFileError(f"{path}: truncated safetensors file: {actual} bytes, its header needs {expected}")
    return found


def _stored(path: str, data_start: int, name: str, entry: dict) -> StoredTensor:
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise CheckpointFileError(f"{path}: tensor {name} has dtype {entry['dtype']}, which this tool does not read")
    return StoredTensor(path, data_start + entry["data_offsets"][0], tuple(entry["shape"]), dtype)


def _read_into(f, view: memoryview, path: str, start: int) -> None:
    done = 0
    while done < len(view):
        got = f.readinto(view[done:])
        if not got:
            raise CheckpointFileError(f"{path}: ends before the tensor at byte {start} does")
        done += got


def read_stored(where: StoredTensor, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor's bytes read into memory of its own, at ``where.start``: a plain read, not a mapping of
    the file, so the process holds what it reads and no more (the pages of a mapped 8 GB shard count as
    the reader's memory once touched). ``dtype``: converted as it is read, a block at a time, so a bf16
    embedding becomes fp32 without a bf16 copy of it beside. ``out``: a contiguous tensor of the shape
    to read into (in its dtype), such as one expert's rows of a packed tensor."""
    if out is None:
        out = torch.empty(where.shape, dtype=dtype or where.dtype)
    assert out.is_contiguous() and out.numel() == math.prod(where.shape), (tuple(out.shape), where.shape)
    flat = out.view(-1)
    with open(where.path, "rb", buffering=0) as f:
        f.seek(where.start)
        if out.dtype == where.dtype:
            _read_into(f, memoryview(flat.view(torch.uint8).numpy()), where.path, where.start)
            return out
        step = max(1, _BLOCK_BYTES // where.dtype.itemsize)
        buffer = torch.empty(min(step, flat.numel()) * where.dtype.itemsize, dtype=torch.uint8)
        for first in range(0, flat.numel(), step):
            count = min(step, flat.numel() - first)
            _read_into(f, memoryview(buffer.numpy())[: count * where.dtype.itemsize], where.path, where.start)
            flat[first : first + count].copy_(buffer[: count * where.dtype.itemsize].view(where.dtype))
    return out


class HFTensorSource:
    """A Hugging Face checkpoint directory, served tensor by tensor under three kinds of name: the
    files' own; for a packed expert tensor, each expert's hub name (``experts.{e}.gate_proj.weight``, a
    contiguous block of it); for per-expert files, the packed name (stacked when read). ``covered``
    says which file tensors a set of names reads whole, so an import names what it would leave
    unread before it writes anything."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        self._where: dict[str, StoredTensor] = {}
        self._file_of: dict[str, str] = {}  # tensor -> the file it is read from
        self.dtypes: dict[str, str] = {}  # file tensor -> stored dtype ("bfloat16", ...), from the headers
        paths, weight_map = _safetensors_files(hf_dir)
        for path in paths:
            for name, (code, where) in _checked_header(path).items():
                if self._owns(path, name, weight_map):
                    self._where[name] = where
                    self.dtypes[name] = _DTYPE_NAMES.get(code, code)
        if weight_map is not None:
            self._check_index(weight_map)
        self._packed = self._per_expert_groups()
        self._unpacked = self._packed_parts()
        self.nonfinite: dict[str, list[int]] = {}  # file tensor -> [NaN, inf] counts, for those read so far

    def _owns(self, path: str, name: str, weight_map: dict[str, str] | None) -> bool:
        """Whether ``name`` is read from ``path``. A tensor saved twice (a re-sharded checkpoint
        copied over an old one) is read from the shard the index names; without an index there is
        no telling which copy is meant, so both files are named."""
        indexed = weight_map.get(name) if weight_map is not None else None
        if indexed is not None:
            if indexed != os.path.basename(path):
                return False
        elif name in self._file_of:
            raise CheckpointFileError(
                f"--hf-path {self.hf_dir}: tensor {name} is in two files, "
                f"{os.path.basename(self._file_of[name])} and {os.path.basename(path)}, "
                f"and no {INDEX} says which to read"
            )
        self._file_of[name] = path
        return True

    def _check_index(self, weight_map: dict[str, str]) -> None:
        absent = sorted(n for n in weight_map if n not in self._where)
        if absent:
            more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
            raise CheckpointFileError(
                f"--hf-path {self.hf_dir}: {INDEX} names tensors their files do not hold: "
                + ", ".join(f"{n} ({weight_map[n]})" for n in absent[:3])
                + more
            )

    def _per_expert_groups(self) -> dict[str, list[str]]:
        """packed name -> the per-expert file tensors it is made of, in expert order."""
        groups: dict[tuple[str, str], dict[int, dict[str, str]]] = {}
        for name in self._where:
            m = _PER_EXPERT.match(name)
            if m:
                kind = "down_proj" if m["proj"] == "down_proj" else "gate_up_proj"
                groups.setdefault((m["prefix"], kind), {}).setdefault(int(m["e"]), {})[m["proj"]] = name
        packed = {}
        for (prefix, kind), experts in groups.items():
            order = sorted(experts)
            if order != list(range(len(order))):
                raise CheckpointFileError(f"{prefix}: expert indices {order} are not 0..{len(order) - 1}")
            projs = ("down_proj",) if kind == "down_proj" else ("gate_proj", "up_proj")
            packed[f"{prefix}.{kind}"] = [experts[e][p] for e in order for p in projs]
        return packed

    def _packed_parts(self) -> dict[str, tuple[str, StoredTensor]]:
        """Hub name of one expert's weight -> (the packed file tensor, where the block lies in it):
        ``gate_up_proj`` [E, 2I, H] holds expert e's gate rows then its up rows, ``down_proj``
        [E, H, I] its down weight."""
        parts = {}
        for name, where in self._where.items():
            prefix, _, kind = name.rpartition(".")
            if not prefix.endswith(".experts") or kind not in ("gate_up_proj", "down_proj") or len(where.shape) != 3:
                continue
            for e in range(where.shape[0]):
                block = where.block(e)
                if kind == "down_proj":
                    parts[f"{prefix}.{e}.down_proj.weight"] = (name, block)
                else:
                    half = where.shape[1] // 2
                    parts[f"{prefix}.{e}.gate_proj.weight"] = (name, block.rows(0, half))
                    parts[f"{prefix}.{e}.up_proj.weight"] = (name, block.rows(half, half))
        return parts

    @property
    def names(self) -> set[str]:
        """Every name this source can serve (packed and per-expert names included)."""
        return set(self._where) | set(self._packed) | set(self._unpacked)

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._packed or name in self._unpacked

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor of ``name``'s shape and dtype: what reading it would give, with no bytes read."""
        if name in self._packed:
            first = self.meta(self._packed[name][0])
            rows = len(self._packed[name])
            if name.endswith("gate_up_proj"):
                return torch.empty((rows // 2, 2 * first.shape[0], *first.shape[1:]), dtype=first.dtype, device="meta")
            return torch.empty((rows, *first.shape), dtype=first.dtype, device="meta")
        where = self._where[name] if name in self._where else self._unpacked[name][1]
        return torch.empty(where.shape, dtype=where.dtype, device="meta")

    def _read(self, stored: str, where: StoredTensor, dtype=None, out: torch.Tensor | None = None) -> torch.Tensor:
        tensor = read_stored(where, dtype, out)
        # The sum is finite when every element is, and allocates nothing the size of the tensor
        # (isfinite() would); a finite tensor whose sum overflows is counted and let through.
        if tensor.is_floating_point() and not torch.isfinite(tensor.sum()):
            nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
            if nan or inf:
                counts = self.nonfinite.setdefault(stored, [0, 0])
                counts[0], counts[1] = counts[0] + nan, counts[1] + inf
        return tensor

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` as stored, or converted to ``dtype`` as it is read."""
        if name in self._where:
            return self._read(name, self._where[name], dtype)
        if name in self._unpacked:
            return self._read(*self._unpacked[name], dtype)
        # read straight into the packed tensor, expert by expert (gate_up: an expert's gate rows, then up)
        meta = self.meta(name)
        out = torch.empty(meta.shape, dtype=dtype or meta.dtype)
        rows = out.view(-1, *meta.shape[2:]).split([self._where[p].shape[0] for p in self._packed[name]])
        for part, into in zip(self._packed[name], rows):
            self._read(part, self._where[part], out=into)
        return out

    def covered(self, names) -> set[str]:
        """The file tensors that reading every name in ``names`` reads whole (a packed tensor is read
        whole once every expert's blocks of it are)."""
        whole, blocks = set(), {}
        for name in names:
            if name in self._where:
                whole.add(name)
            elif name in self._packed:
                whole.update(self._packed[name])
            elif name in self._unpacked:
                stored = self._unpacked[name][0]
                blocks[stored] = blocks.get(stored, 0) + 1
        expected = {n: sum(1 for s, _ in self._unpacked.values() if s == n) for n in blocks}
        return whole | {n for n, count in blocks.items() if count == expected[n]}

    def unconsumed(self, names) -> list[str]:
        """The file tensors reading ``names`` would leave unread, by name."""
        return sorted(set(self._where) - self.covered(names))

    def config(self) -> dict:
        path = os.path.join(self.hf_dir, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"--hf-path {self.hf_dir}: no config.json")
        return read_config(path)


def read_config(path: str) -> dict:
    """A Hugging Face config.json, checked to be a JSON object (what its readers index into)."""
    config = read_json(path, "config.json")
    if not isinstance(config, dict):
        raise CheckpointFileError(
            f"{path}: not a valid config.json: expected a JSON object, not {type(config).__name__}"
        )
    return config
