"""Reading and writing Hugging Face checkpoint directories one tensor at a time.

``HFTensorSource`` opens a directory's safetensors files (one file, or shards listed in
``model.safetensors.index.json``) without loading them, hands out tensors by name and records
which were taken, so a conversion can name every tensor it did not consume. MoE experts stored
one tensor per expert (``...experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj``) are
served under the packed names ``transformers`` uses (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]).

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


class CheckpointFileError(ValueError):
    pass


def _safetensors_files(hf_dir: str) -> list[str]:
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"--hf-path {hf_dir}: no such directory")
    index = os.path.join(hf_dir, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in files if not os.path.exists(os.path.join(hf_dir, n))]
        if missing:
            raise CheckpointFileError(f"--hf-path {hf_dir}: {INDEX} lists files that are not there: {missing}")
        return [os.path.join(hf_dir, n) for n in files]
    files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointFileError(f"--hf-path {hf_dir}: no *.safetensors files and no {INDEX}")
    return [os.path.join(hf_dir, n) for n in files]


def _check_complete(path: str) -> None:
    """A file cut short (an interrupted copy) has a header promising more bytes than it holds;
    safetensors maps lazily and would only fail, or read garbage, at the first access."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFileError(f"{path}: truncated safetensors file (no header)")
        header_len = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointFileError(f"{path}: truncated or corrupt safetensors header ({err})") from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    expected, actual = 8 + header_len + end, os.path.getsize(path)
    if actual < expected:
        raise CheckpointFileError(f"{path}: truncated safetensors file: {actual} bytes, its header needs {expected}")


class HFTensorSource:
    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self.hf_dir = hf_dir
        self._where: dict[str, object] = {}
        self._handles = []
        for path in _safetensors_files(hf_dir):
            _check_complete(path)
            handle = safe_open(path, framework="pt")
            self._handles.append(handle)
            for name in handle.keys():
                self._where[name] = handle
        self._packed = self._per_expert_groups()
        self.consumed: set[str] = set()

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

    def get(self, name: str) -> torch.Tensor:
        if name in self._where:
            self.consumed.add(name)
            return self._where[name].get_tensor(name)
        parts = self._packed[name]
        self.consumed.update(parts)
        tensors = [self._where[p].get_tensor(p) for p in parts]
        if name.endswith("gate_up_proj"):  # per expert: [gate; up] rows
            return torch.stack([torch.cat(tensors[i:i + 2], dim=0) for i in range(0, len(tensors), 2)])
        return torch.stack(tensors)

    def unconsumed(self) -> list[str]:
        return sorted(set(self._where) - self.consumed)

    def config(self) -> dict:
        path = os.path.join(self.hf_dir, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"--hf-path {self.hf_dir}: no config.json")
        with open(path) as f:
            return json.load(f)


class ShardedWriter:
    """Writes ``model-XXXXX-of-YYYYY.safetensors`` shards and the index as tensors arrive."""

    def __init__(self, out_dir: str, max_shard_bytes: int = 2 * 1024 ** 3):
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
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
                      f, indent=2)
        return names
