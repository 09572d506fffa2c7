"""A model checkpoint written tensor by tensor, each asked for when the writer reaches it: how an import
writes a checkpoint of any size holding one tensor (and its file's buffer) at a time.

``write_torch_dist(directory, model, common, fill)`` writes what ``dist_checkpointing.save`` writes for
``{"model": model.sharded_state_dict(), **common}`` (the same keys, pieces, dtypes, common state and
``metadata.json``), where ``model`` is the weightless model (``weightless_model.py``) whose meta
parameters carry the dtype each tensor is to be stored in, and ``fill(name)`` gives parameter
``name``'s tensor. megatron-core prepares the save as it always does, on meta tensors (its factories
split Gated DeltaNet's ``in_proj`` and the gated MLPs' ``linear_fc1``, its ShardedTensors stack the
vision layers); torch.distributed.checkpoint's own writer then writes the files (a new one every
``FILE_BYTES``), asking the planner for each piece's data in order, and the planner fills the
parameter the piece belongs to. A parameter's
pieces come one after another, so the last parameter filled is kept for its next piece and then
dropped. megatron-core's writer would take every tensor first (it stages them for an asynchronous
save), which is the whole model.

Megatron-FSDP's format is written the same way by ``fsdp_weights.save_weights(..., fill)``.
"""

from __future__ import annotations

import queue

import torch

# An import's files are cut at this many bytes, in the plan's order: torch's file writer keeps each
# tensor it writes until its file is closed (to end the file as safetensors where asked), so one file
# for the whole checkpoint, as a training rank writes, would hold the whole model in the end.
FILE_BYTES = 256 << 20


def _pieces(sharded: dict) -> dict:
    """(checkpoint key, global offset) of every piece -> (parameter name, factory or None)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for name, entry in sharded.items():
        if isinstance(entry, ShardedTensorFactory):
            built = entry.build_fn(entry.key, entry.data, entry.replica_id, entry.flattened_range)
            for piece in nested_values(built):
                out[(piece.key, tuple(piece.global_offset))] = (name, entry)
        elif isinstance(entry, ShardedTensor):
            out[(entry.key, tuple(entry.global_offset))] = (name, None)
    return out


class _Filled:
    """Each piece's data from ``fill``, keeping the last parameter's pieces for the ones still to come."""

    def __init__(self, fill, pieces: dict):
        self.fill, self.pieces = fill, pieces
        self._name, self._data = None, {}

    def data(self, key: str, offset: tuple) -> torch.Tensor:
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        name, factory = self.pieces[(key, offset)]
        if name != self._name:
            self._name, self._data = name, {}  # the previous parameter's pieces are all written
            tensor = self.fill(name)
            if factory is None:
                self._data[(key, offset)] = tensor
            else:
                built = factory.build_fn(factory.key, tensor, factory.replica_id, factory.flattened_range)
                self._data = {(p.key, tuple(p.global_offset)): p.data for p in nested_values(built)}
        return self._data.pop((key, offset))


def _planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class FilledSavePlanner(MCoreSavePlanner):
        """megatron-core's planner, whose tensors come from ``filled`` as the writer reaches them."""

        def __init__(self, filled: _Filled):
            super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False, flatten_sharded_tensors=False)
            self.filled = filled

        def resolve_data(self, write_item):
            planned = super().resolve_data(write_item)  # bytes as they are; for a tensor, its meta stand-in
            if write_item.type == WriteItemType.BYTE_IO:
                return planned
            index = write_item.index
            data = self.filled.data(index.fqn, tuple(index.offset))
            if data.dtype != planned.dtype or data.numel() != planned.numel():
                got, want = f"{data.dtype} {tuple(data.shape)}", f"{planned.dtype} {tuple(planned.shape)}"
                raise AssertionError(f"{index.fqn}: filled {got}, planned {want}")
            return data.contiguous().view(planned.shape)  # a stacked layer's piece carries its leading 1

    return FilledSavePlanner


def _item_bytes(item) -> int:
    data = item.tensor_data
    return 0 if data is None else torch.Size(data.chunk.sizes).numel() * data.properties.dtype.itemsize


def _writer_class():
    from torch.distributed.checkpoint import FileSystemWriter

    class BoundedFilesWriter(FileSystemWriter):
        """torch's file writer (one thread), a new file whenever the current one would pass
        ``FILE_BYTES``; items keep the plan's order."""

        def write_data(self, plan, planner):
            if not hasattr(self, "_write_data"):  # a torch without the split: one file an item
                self.single_file_per_rank = False
                return super().write_data(plan, planner)
            files: queue.Queue = queue.Queue()
            buckets: list[list] = [[]]
            size = 0
            for item in plan.items:
                if buckets[-1] and size + _item_bytes(item) > FILE_BYTES:
                    buckets.append([])
                    size = 0
                buckets[-1].append(item)
                size += _item_bytes(item)
            for i, bucket in enumerate(buckets):
                name = f"{plan.storage_data.prefix}{i}.distcp"
                files.put((self.fs.concat_path(self.path, name), name, bucket))
            return self._write_data(planner, files)

    return BoundedFilesWriter


def write_torch_dist(directory: str, model, common: dict, fill) -> None:
    """``model``'s checkpoint in megatron's torch_dist format into the empty ``directory``."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import save

    sharded = model.sharded_state_dict()
    filled = _Filled(fill, _pieces(sharded))
    part, common_state = save_preprocess({"model": sharded, **common}, validate_access_integrity=True)
    # where dist_checkpointing.save keeps the common state: one object among the shards
    part["common_state"] = ShardedObject("common_state", common_state, (1,), (0,), replica_id=0)
    part, _, _ = _replace_state_dict_keys_with_sharded_keys(part, True)
    state = mcore_to_pyt_state_dict(part, False)
    # one writing thread: the writer then asks for the pieces in the plan's order, one at a time
    save(
        state,
        storage_writer=_writer_class()(directory, thread_count=1),
        planner=_planner_class()(filled),
        no_dist=True,
    )
    save_config(CheckpointingConfig("torch_dist", 1), directory)
