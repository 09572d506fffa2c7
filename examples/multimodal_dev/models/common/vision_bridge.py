"""The vision tower on its own tensor-parallel size, on the language model's ranks.

At TP = t and CP = c, one language replica is a block of t x c ranks that all hold the same
micro-batch. A tower at ``--vision-tensor-parallel-size`` v < t is whole on v ranks, so the block
holds t*c/v copies of it ("slots"). The micro-batch's images are dealt to the slots by their vision
FLOPs; each slot's v ranks encode its share, and megatron-core's ``ColocatedBridgeCommunicator``
gathers the shares into every rank of the block (fan-in from the vision grid [v, DP_v] to the
language grid [t*c, DP]); its backward keeps this slot's rows of the feature gradient.

Rank order is megatron's (tp fastest, pp slowest), so the first pipeline stage is the ranks
[0, t*c*DP) and a slot is v consecutive ranks inside one language TP group. The groups:

    tp      a slot: one tower's tensor-parallel split
    dp      the ranks with the same vision TP index over the first stage, every tower's copy of one
            shard: the checkpoint's replica ids (one main copy per shard)
    copies  the ranks of one language TP group with the same vision TP index (t/v of them)

Gradients, backward: the language TP ranks hold identical feature gradients (the bridge keeps one
slot of them, never a sum), CP ranks hold partial ones (all-reduced over CP first). Each slot's
weight gradients cover its images only: megatron's DDP sums them over the language DP x CP group
and ``reduce_copies`` over ``copies``, together the whole vision DP group. The grad norm counts a
replicated parameter on TP rank 0 only, and a TP-split one on every TP rank: the copies on
language TP ranks >= v are marked as not split, so every shard is counted once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from .context_parallel import _own_rank_group
from .vision_context_parallel import batch_order, idle_features, shares_of, take_items

_BRIDGES: dict[int, "VisionBridge"] = {}


def for_layout(vision_tp: int, language_groups) -> "VisionBridge":
    """The bridge of this run (its groups are made once, by every rank together)."""
    if vision_tp not in _BRIDGES:
        _BRIDGES[vision_tp] = VisionBridge(vision_tp, language_groups)
    return _BRIDGES[vision_tp]


class VisionBridge:
    def __init__(self, vision_tp: int, language_groups):
        from megatron.core.hyper_comm_grid import HyperCommGrid
        from megatron.core.models.mimo.comm.colocated_communicator import ColocatedBridgeCommunicator

        tp, cp, dp = language_groups.tp.size(), language_groups.cp.size(), language_groups.dp.size()
        if tp % vision_tp:
            raise ValueError(f"--vision-tensor-parallel-size {vision_tp} must divide --tensor-model-parallel-size {tp}")
        self.vision_tp, self.block = vision_tp, tp * cp
        span = self.block * dp  # the first pipeline stage
        rank = dist.get_rank()
        self.on_first_stage = rank < span
        if self.on_first_stage:
            _check_megatron_order(language_groups, rank, tp, cp)
        dims = ["tp", "cp", "dp", "pp"]
        vision_grid = HyperCommGrid([vision_tp, 1, span // vision_tp, 1], dims)
        language_grid = HyperCommGrid([self.block, 1, dp, 1], dims)  # TP x CP folded: one replica's block
        # group creation is collective over the world: every rank, in this order
        self.tp = vision_grid.create_pg(["tp"])
        self.dp = vision_grid.create_pg(["dp"])
        copies = [
            [base + j + k * vision_tp for k in range(tp // vision_tp)]
            for base in range(0, span, tp)
            for j in range(vision_tp)
        ]
        self.copies, _ = dist.new_subgroups_by_enumeration(copies)
        self.comm = ColocatedBridgeCommunicator(
            vision_grid, language_grid, "vision", "language", dim_mapping={"b": 0, "h": 1}
        )
        self.cp = language_groups.cp
        self.slots = self.block // vision_tp
        self.slot = (rank % self.block) // vision_tp
        self.language_tp_rank = language_groups.tp.rank()

    def process_groups(self):
        """The tower's groups: its own TP split and no context parallelism (it sees whole images)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        groups = ProcessGroupCollection.use_mpu_process_groups()
        groups.tp, groups.cp = self.tp, _own_rank_group()
        return groups

    def adopt(self, vision_model) -> None:
        """Make this rank's tower one copy of every other's: the same initial weights (the TP-split
        ones were drawn in the language TP rank's random stream) and counted once in the grad norm."""
        source = dist.get_process_group_ranks(self.copies)[0]
        for param in vision_model.parameters():
            dist.broadcast(param.data, src=source, group=self.copies)
            if self.language_tp_rank >= self.vision_tp:
                param.tensor_model_parallel = False

    def encode(self, vision_model, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """Vision features [N, H] of all items of the micro-batch, in its order; this slot encodes
        its share (``grids`` [n, 3] (t, h, w), ``pixels`` their patch rows in order)."""
        owned, tokens, width = shares_of(
            grids.tolist(), vision_model.item_flops, vision_model.shape.spatial_merge_size, self.slots
        )
        mine = owned[self.slot]
        if mine:  # every slot sends ``width`` rows: the gather needs equal sizes
            features = vision_model(take_items(pixels, grids, mine), grids[mine])
            features = torch.nn.functional.pad(features, (0, 0, 0, width - features.shape[0]))
        else:  # nothing to encode: zeros, joined to every weight (joined_zero says why)
            features = idle_features(vision_model, width)
        gathered = self.comm.communicate(features)  # [slots * width, H], slot order
        if self.cp.size() > 1:  # each CP rank's gradient covers its own tokens: sum them
            gathered = copy_to_tensor_model_parallel_region(gathered, group=self.cp)
        return gathered.index_select(0, batch_order(owned, tokens, width).to(gathered.device))

    def reduce_copies(self, vision_model) -> None:
        """Sum the tower's gradients over ``copies`` (after DDP's reduction over DP x CP)."""
        grads = [getattr(p, "main_grad", p.grad) for p in vision_model.parameters() if p.requires_grad]
        grads = [g for g in grads if g is not None]
        for bucket in _buckets(grads):
            flat = torch._utils._flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.copies)
            for grad, summed in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                grad.copy_(summed)


def _buckets(tensors, limit: int = 1 << 26):
    """Same-dtype runs of at most ``limit`` elements (one flat copy each)."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and (size + t.numel() > limit or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


def _check_megatron_order(language_groups, rank: int, tp: int, cp: int) -> None:
    """The grids above enumerate ranks as megatron's default order does (tp, cp, ..., dp, pp)."""
    base = rank - rank % tp
    block = rank - rank % (tp * cp)
    expected = {"TP": list(range(base, base + tp)), "CP": list(range(block + rank % tp, block + tp * cp, tp))}
    for name, group in (("TP", language_groups.tp), ("CP", language_groups.cp)):
        if dist.get_process_group_ranks(group) != expected[name]:
            raise RuntimeError(
                f"--vision-tensor-parallel-size: the language model's {name} group "
                f"{dist.get_process_group_ranks(group)} is not {expected[name]}; the vision "
                "layout needs megatron's default rank order (tp-cp-ep-dp-pp)"
            )


def finalize_model_grads(model, *args, **kwargs):
    """megatron-core's gradient finalisation, then the vision copies' sum (``config.
    finalize_model_grads_func`` of a run with its own vision layout)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads as finalize
    from megatron.core.utils import unwrap_model

    finalize(model, *args, **kwargs)
    for chunk in model:
        vision_model = getattr(unwrap_model(chunk), "vision_model", None)
        if vision_model is not None and getattr(vision_model, "bridge", None) is not None:
            vision_model.bridge.reduce_copies(vision_model)
