"""Sharded safetensors written tensor by tensor: a Hugging Face checkpoint of any size with one tensor in
memory at a time, byte for byte what ``safetensors.torch.save_file`` writes for the same tensors.

The shards are planned first, from names, shapes and dtypes alone (``plan_shards``: tensors in the
order they come, a new shard when the next tensor would take the current one past
``max_shard_bytes``). A shard's header, which holds every tensor's offsets, is then written before
its data, and the data follow in the order safetensors lays them out (``file_order``: by dtype, the
widest first, then by name), each tensor asked for when its turn comes. ``shard_name`` and
``write_index`` give the hub's file names and index.

Why not ``save_file``: it takes every tensor of a shard at once, so an export held a whole shard
(2 GiB by default, a whole small model) in memory; a tool at the 397B's size must hold a tensor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

# safetensors' dtype codes, in the order of its ``Dtype`` enum: a file's data are sorted by this code,
# the last first (the widest types lead, so every tensor starts aligned), then by name.
_CODES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
_RANK = {code: i for i, code in enumerate(_CODES.values())}


@dataclass(frozen=True)
class Planned:
    """A tensor the export will write: its Hugging Face name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(tensors: Iterable[Planned], max_shard_bytes: int) -> list[list[Planned]]:
    """The tensors split into shards in the order given; a tensor larger than the limit gets a shard of
    its own."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return [s for s in shards if s]


def file_order(shard: list[Planned]) -> list[Planned]:
    """The order safetensors lays a file's data out in."""
    return sorted(shard, key=lambda t: (-_RANK[_CODES[t.dtype]], t.name))


def _header(ordered: list[Planned], metadata: dict[str, str]) -> bytes:
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for t in ordered:
        entries[t.name] = {
            "dtype": _CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8)  # padded so the data start 8-byte aligned, as safetensors does


def write_shard(
    path: str,
    shard: list[Planned],
    produce: Callable[[Planned], Iterable[torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Writes ``shard`` to ``path``; ``produce(t)`` gives tensor ``t``'s data, whole or as consecutive
    row blocks (a packed expert tensor, expert by expert), when its turn comes."""
    ordered = file_order(shard)
    header = _header(ordered, metadata if metadata is not None else {"format": "pt"})
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for planned in ordered:
            written = 0
            for part in produce(planned):
                if part.dtype != planned.dtype:
                    raise AssertionError(f"{planned.name}: produced {part.dtype}, planned {planned.dtype}")
                data = part.detach().contiguous().view(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                written += data.numel()
            if written != planned.nbytes:
                raise AssertionError(f"{planned.name}: produced {written} bytes, planned {planned.nbytes}")


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_index(path: str, shards: list[list[Planned]]) -> int:
    """``model.safetensors.index.json`` of ``shards`` at ``path``; returns the bytes of all tensors."""
    weight_map = {t.name: shard_name(i, len(shards)) for i, shard in enumerate(shards) for t in shard}
    total = sum(t.nbytes for shard in shards for t in shard)
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return total
