"""Reading and writing Hugging Face checkpoint directories one tensor at a time.

``HFTensorSource`` opens a directory's safetensors files (one file, or shards listed in
``model.safetensors.index.json``) without loading them, hands out tensors by name and records
which were taken, so a conversion can name every tensor it did not consume. With an index, each
tensor is read from the shard the index names (a stale copy in another shard is ignored); without
one, a tensor found in two files is refused naming both. A config.json or index that is not JSON, or
not JSON of the expected shape, is refused naming the file. MoE experts stored
one tensor per expert (``...experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``) are
served under the packed names ``transformers`` uses (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]); ``per_expert`` is the inverse, for writing the hub layout. The
source also records each tensor's stored dtype (from the headers, before any read) and which tensors
hold NaN or inf (as they are read), so an import can refuse them by name.

``ShardedWriter`` writes tensors as they come into shards of at most ``max_shard_bytes`` and
finishes with the index, so an export never holds more than one shard in memory.
"""

from __future__ import annotations

import json
import os
import re

import torch

INDEX = "model.safetensors.index.json"
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# safetensors' dtype codes under torch's names, so messages and comparisons read like torch.
_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


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


def _checked_header(path: str) -> dict:
    """The header of a complete file. A file cut short (an interrupted copy) has a header promising
    more bytes than it holds; safetensors maps lazily and would only fail, or read garbage, at the
    first access. A header length past the end of the file is corruption (reading it would ask for
    up to 2**64 bytes: MemoryError or OverflowError, naming nothing)."""
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
            dtypes = {k: t["dtype"] for k, t in tensors.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError) as err:
            raise CheckpointFileError(f"{path}: truncated or corrupt safetensors header ({err!r})") from None
    expected = 8 + header_len + end
    if actual < expected:
        raise CheckpointFileError(f"{path}: truncated safetensors file: {actual} bytes, its header needs {expected}")
    return {k: _DTYPE_NAMES.get(d, d) for k, d in dtypes.items()}


def per_expert(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A packed expert tensor as the hub stores it, one tensor per expert: ``experts.gate_up_proj``
    [E, 2I, H] -> ``experts.{e}.gate_proj.weight`` / ``up_proj`` [I, H]; ``experts.down_proj``
    [E, H, I] -> ``experts.{e}.down_proj.weight``. Any other tensor is returned as it is."""
    prefix, _, kind = name.rpartition(".")
    if not prefix.endswith(".experts") or kind not in ("gate_up_proj", "down_proj"):
        return [(name, tensor)]
    if kind == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", t) for e, t in enumerate(tensor.unbind(0))]
    out = []
    for e, t in enumerate(tensor.unbind(0)):
        gate, up = t.chunk(2, dim=0)
        out += [(f"{prefix}.{e}.gate_proj.weight", gate), (f"{prefix}.{e}.up_proj.weight", up)]
    return out


class HFTensorSource:
    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self.hf_dir = hf_dir
        self._where: dict[str, object] = {}
        self._file_of: dict[str, str] = {}  # tensor -> the file it is read from
        self._handles = []
        self.dtypes: dict[str, str] = {}  # file tensor -> stored dtype ("bfloat16", ...), from the headers
        paths, weight_map = _safetensors_files(hf_dir)
        for path in paths:
            dtypes = _checked_header(path)
            handle = safe_open(path, framework="pt")
            self._handles.append(handle)
            for name in handle.keys():
                if self._owns(path, name, weight_map):
                    self._where[name] = handle
                    self.dtypes[name] = dtypes[name]
        if weight_map is not None:
            self._check_index(weight_map)
        self._packed = self._per_expert_groups()
        self.consumed: set[str] = set()
        self.nonfinite: dict[str, str] = {}  # file tensor -> "N NaN, M inf", for those read so far

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

    @property
    def names(self) -> set[str]:
        """Every name this source can serve (packed expert names included)."""
        return set(self._where) | set(self._packed)

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._packed

    def _read(self, name: str) -> torch.Tensor:
        tensor = self._where[name].get_tensor(name)
        self.consumed.add(name)
        # The sum is finite when every element is, and allocates nothing the size of the tensor
        # (isfinite() would); a finite tensor whose sum overflows is counted and let through.
        if tensor.is_floating_point() and not torch.isfinite(tensor.sum()):
            nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
            if nan or inf:
                self.nonfinite[name] = f"{nan} NaN, {inf} inf"
        return tensor

    def get(self, name: str) -> torch.Tensor:
        if name in self._where:
            return self._read(name)
        tensors = [self._read(p) for p in self._packed[name]]
        if name.endswith("gate_up_proj"):  # per expert: [gate; up] rows
            return torch.stack([torch.cat(tensors[i : i + 2], dim=0) for i in range(0, len(tensors), 2)])
        return torch.stack(tensors)

    def unconsumed(self) -> list[str]:
        return sorted(set(self._where) - self.consumed)

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


class ShardedWriter:
    """Writes ``model-XXXXX-of-YYYYY.safetensors`` shards and the index as tensors arrive."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 2 * 1024**3):
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.max_shard_bytes = out_dir, max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[str, list[str]]] = []  # (temporary file, names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = os.path.join(self.out_dir, f".shard-{len(self._written):05d}.partial")
        save_file(self._pending, path, metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Rename the shards to their final names and write the index; returns the file names."""
        if self._pending:
            self._flush()
        n, weight_map, names = len(self._written), {}, []
        for i, (tmp, tensors) in enumerate(self._written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.out_dir, final))
            weight_map.update({t: final for t in tensors})
            names.append(final)
        with open(os.path.join(self.out_dir, INDEX), "w") as f:
            json.dump(
                {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                f,
                indent=2,
            )
        return names
