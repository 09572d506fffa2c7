"""A Megatron checkpoint's model tensors read a few at a time, by parameter name, into memory of their
own: what export, export-peft and verify read a checkpoint of any size with.

``CheckpointTensors(model, directory)`` takes the weightless model of the checkpoint's shape
(``weightless_model.py``), whose ``sharded_state_dict`` says where each parameter lies in the
checkpoint (its key, its piece of a stacked or split tensor), and ``read(names)`` loads just those
parameters, whole (TP = 1), in the dtype they are stored in (or one asked for), through
megatron-core's own torch_dist loader: the checkpoint may have been saved at any TP / EP / PP. The
index (``.metadata``) is read once for all reads, not once a read. A checkpoint of LoRA adapters alone
(``base``) reads every tensor it does not hold from its base. Megatron-FSDP's fsdp_dtensor format
keeps each weight whole under ``model.module.<name>``, grouped experts as one [E, ...] tensor of
which a read takes an expert's row (``fsdp_weights.py``).

The files' checksums are checked once, before the first read (``files.load_model_weights`` checks
them at every load, which here would read the checkpoint once per read).
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from . import fsdp_weights
from .files import check_own_files, is_fsdp_dtensor, stored_keys


def _with_data(entry, tensor: torch.Tensor):
    """A copy of a ShardedTensor or ShardedTensorFactory of the weightless model that loads into ``tensor``
    (a ShardedTensor also records the dtype, which must be its data's)."""
    if any(f.name == "dtype" for f in dataclasses.fields(entry)):
        return dataclasses.replace(entry, data=tensor, dtype=tensor.dtype)
    return dataclasses.replace(entry, data=tensor)


class CheckpointTensors:
    """Reads the parameters of ``model`` (weightless, the checkpoint's shape) from the iteration
    ``directory``; those it does not hold from ``base`` (a LoRA run saving its adapters alone)."""

    def __init__(
        self,
        model: torch.nn.Module,
        directory: str,
        base: str | None = None,
        stored: dict | None = None,
        dtypes: dict | None = None,
    ):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
        from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
            CachedMetadataFileSystemReader,
        )
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

        from ..megatron_changes import apply

        apply("checkpoints-are-data")
        check_own_files(directory)  # the base was checked by open_megatron (adapters_only.base_to_read)
        self.model, self.directory, self.base = model, directory, base
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        self.dtypes = dtypes or {}  # name -> the dtype it is stored in (fp32 where not given)
        self.fsdp = is_fsdp_dtensor(directory)
        self._template: dict = {}
        if self.fsdp:
            self._sources = fsdp_weights.weight_sources(model, stored)
            self._rows = {key: stored[key].size[0] for key, row in self._sources.values() if row is not None}
        else:
            kinds = (ShardedTensor, ShardedTensorFactory)
            self._template = {n: s for n, s in model.sharded_state_dict().items() if isinstance(s, kinds)}
        held = stored_keys(directory) if base is not None and not self.fsdp else None
        self._from_base = {n for n, s in self._template.items() if held is not None and s.key not in held}
        self._cache = CachedMetadataFileSystemReader
        self._cache.clear_metadata_cache()  # a checkpoint written again at the same path has a new index
        self._strategy = TorchDistLoadShardedStrategy(cache_metadata=True)

    def close(self) -> None:
        self._cache.clear_metadata_cache()

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def nbytes(self, names, dtype: torch.dtype | None = None) -> int:
        """The memory ``read(names, dtype)`` takes."""
        return sum((dtype or self._dtype(n)).itemsize * torch.Size(self.shapes[n]).numel() for n in names)

    def _dtype(self, name: str) -> torch.dtype:
        return self.dtypes.get(name, torch.float32)

    def _request(self, name: str, tensor: torch.Tensor):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if not self.fsdp:
            return _with_data(self._template[name], tensor)
        key, row = self._sources[fsdp_weights.PREFIX + name]
        if row is None:
            return ShardedTensor.from_rank_offsets(key, tensor, replica_id=0)
        return ShardedTensor.from_rank_offsets(key, tensor, (0, row, self._rows[key]), replica_id=0, prepend_axis_num=1)

    def _load(self, request: dict, directory: str) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
        from megatron.core.dist_checkpointing.mapping import (
            ShardedTensor,
            ShardedTensorFactory,
            apply_factories,
            apply_factory_merges,
        )

        factories = {n: s for n, s in request.items() if isinstance(s, ShardedTensorFactory)}
        apply_factories(request)
        originals: dict[int, torch.Tensor] = {}  # by the first byte's address, which a view shares

        def leading_ones(sharded):
            """A piece of a stacked tensor (one expert, one vision layer) asked for with its stacking
            axes as leading 1s: megatron-core's loader takes a part of such a tensor in one process
            only in that form (its other form wants every piece the process would hold)."""
            if not isinstance(sharded, ShardedTensor) or not sharded.prepend_axis_num:
                return sharded
            shape = (1,) * sharded.prepend_axis_num + tuple(sharded.local_shape)
            originals[sharded.data.data_ptr()] = sharded.data  # read in place through the view
            return dataclasses.replace(sharded, data=sharded.data.view(shape), local_shape=shape, prepend_axis_num=0)

        dict_list_map_inplace(leading_ones, request)
        with warnings.catch_warnings():  # DCP's notes on megatron's call (argument order, one process)
            warnings.simplefilter("ignore", UserWarning)
            loaded = self._strategy.load(request, directory)
        dict_list_map_inplace(lambda t: originals.get(t.data_ptr(), t) if t.numel() else t, loaded)
        return apply_factory_merges(loaded, factories)

    def read(self, names, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """{name: the parameter's whole tensor} for every name in ``names``, in the dtype the checkpoint
        stores it in (or ``dtype``)."""
        names = list(dict.fromkeys(names))
        if not names:
            return {}
        out: dict[str, torch.Tensor] = {}
        for directory, part in (
            (self.base, [n for n in names if n in self._from_base]),
            (self.directory, [n for n in names if n not in self._from_base]),
        ):
            if part:
                request = {
                    n: self._request(n, torch.empty(self.shapes[n], dtype=dtype or self._dtype(n))) for n in part
                }
                out.update(self._load(request, directory))
        return {n: out[n] for n in names}
