"""The micro-batch the collate makes and the training step reads: ``PackedBatch``.

Legend: T packed tokens (sum of padded sample lengths), B samples, S padded row length, N the
micro-batch's image patches (rows of pixels), M its video patches.

THD (``collate.pack_thd``, the default): one row, every sample right-padded to the collate's
pad multiple and laid end to end:
    tokens            [1, T]    long     input ids; padding 0
    labels            [1, T]    long     next-token targets; padding IGNORE_INDEX
    loss_mask         [1, T]    float32  1 where the loss trains; padding 0
    padding_mask      [1, T]    bool     True at padding (MoE routing statistics skip it)
    position_ids      [3, 1, T] long     MRoPE (temporal, height, width), restarting at 0 per sample
    cu_seqlens        [B+1]     int32    real-token boundaries
    cu_seqlens_padded [B+1]     int32    padded boundaries (what the kernels index by)
    max_seqlen        int                longest padded sample
BSHD (``collate.pad_bshd``): rows [B, S] instead of [1, T] (``position_ids`` [3, B, S]), padded on
the right; ``cu_seqlens`` and ``cu_seqlens_padded`` are None and ``max_seqlen`` is S.
Both:
    pixel_values        [N, patch_dim]  every image's patches, in packing order (None without images)
    image_grid_thw      [images, 3]     long  (t, h, w) patches of each image (None without)
    pixel_values_videos [M, patch_dim]  every video's patches, likewise (None without videos)
    video_grid_thw      [videos, 3]     long  (t, h, w) of each video (None without)
    stats               BatchStats      sizes of the micro-batch (host side, never moved)

A pipeline stage keeps only what it reads (``for_stage``): None replaces the rest. Between the
loader and ``forward_step`` megatron's data iterator carries it as a plain dict (``to_megatron``
says why).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from examples.multimodal_dev.models.common.batch_memo import host_side, to_device


class StageInput(enum.Enum):
    """What a pipeline stage's first layer receives, hence which vision inputs its batch keeps.
    megatron-core builds and names a stage by a boolean ``pre_process``; ``of`` converts."""

    PIXELS = "pixels"  # the first stage with the vision tower: pixels and grids
    GRIDS = "grids"  # a first stage whose vision features come in shares from ranks of their own
    #                  (vision_ranks/groups.py): the grids, to put the shares in batch order; no pixels
    HIDDEN = "hidden"  # no vision inputs: a later stage (the previous stage's activations), or a first
    #                   stage whose vision features come whole from ranks of their own

    @classmethod
    def of(cls, pre_process: bool) -> StageInput:
        """A stage megatron-core builds with ``pre_process`` (its vision tower on the same ranks)."""
        return cls.PIXELS if pre_process else cls.HIDDEN


@dataclass
class BatchStats:
    """Sizes of a micro-batch, for the log's throughput and FLOPs (host side)."""

    samples: int
    real_tokens: int
    padded_tokens: int  # tokens of the row(s), padding included
    pad_fraction: float
    lengths: list[int]  # every sample's real length, in packing order
    model_flops: float = 0.0  # training FLOPs on the real tokens; dataset_provider.py fills it in
    skipped: dict | None = None  # a DataLoader worker's new skip counts on their way to the main process (loader.py)

    def as_dict(self) -> dict:
        """Plain data (``to_megatron``); no ``skipped`` once the main process took the counts off."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None or f.name != "skipped"}


VISION_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
PIXELS = ("pixel_values", "pixel_values_videos")
LAST_STAGE_ONLY = ("labels", "loss_mask")
# Read by the host, not the GPU: the vision tower walks the grids image by image (patch coordinates,
# frame lengths, chunking) and the throughput log prices them; on the device every such read was a sync.
HOST_SIDE = ("image_grid_thw", "video_grid_thw")
# Moved to the device carrying their host copy (``batch_memo.on_host``): the segment bounds the
# attention and Gated DeltaNet check and the placeholder tokens the vision merge counts.
HOST_READ = ("tokens", "cu_seqlens", "cu_seqlens_padded")


@dataclass
class PackedBatch:
    """One collated micro-batch (layouts: the module's legend). ``collate.py`` makes it."""

    tokens: torch.Tensor
    labels: torch.Tensor | None  # None on a stage that does not compute the loss
    loss_mask: torch.Tensor | None  # likewise
    padding_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None  # None: BSHD
    cu_seqlens_padded: torch.Tensor | None
    max_seqlen: int
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    stats: BatchStats | None = None

    @property
    def thd(self) -> bool:
        """Packed into one row (cu_seqlens present), not padded rows."""
        return self.cu_seqlens is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (not None)."""
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}

    def to(self, device: torch.device | str) -> PackedBatch:
        """The tensors on ``device``, the grids (``HOST_SIDE``, three integers an image) left on the host,
        and those the host reads (``HOST_READ``) carrying their host copy."""
        moved = {}
        for name, t in self.tensors().items():
            if name in HOST_SIDE:
                moved[name] = host_side(t)
            elif name in HOST_READ:
                moved[name] = to_device(t, device)
            else:
                moved[name] = t.to(device, non_blocking=True)
        return replace(self, **moved)

    def pin_memory(self) -> PackedBatch:
        """torch's DataLoader (``pin_memory=True``) pins a batch through this method."""
        return replace(self, **{k: v.pin_memory() for k, v in self.tensors().items()})

    def vision_inputs(self) -> dict[str, torch.Tensor | None]:
        """The vision tower's inputs, as the model's keyword arguments."""
        return {k: getattr(self, k) for k in VISION_INPUTS}

    def as_dict(self) -> dict:
        """Plain data, field by field (``to_megatron``); the tensors are not copied."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.stats is not None:
            out["stats"] = self.stats.as_dict()
        return out

    @classmethod
    def from_dict(cls, plain: dict[str, Any]) -> PackedBatch:
        fields_ = dict(plain)
        stats = fields_.pop("stats", None)
        return cls(**fields_, stats=None if stats is None else BatchStats(**stats))

    def for_stage(self, first: StageInput, post_process: bool) -> PackedBatch:
        """The batch without the tensors a pipeline stage never reads (None in their place):
        vision inputs as ``first`` says, labels and loss mask off the last stage."""
        dropped = {StageInput.PIXELS: (), StageInput.GRIDS: PIXELS, StageInput.HIDDEN: VISION_INPUTS}[first]
        dropped += () if post_process else LAST_STAGE_ONLY
        return replace(self, **dict.fromkeys(dropped))


@dataclass
class ServedBatches:
    """One micro-batch of each language replica a vision replica serves under fan-out
    (vision_ranks/groups.py), in replica order."""

    batches: list[PackedBatch]

    def to(self, device: torch.device | str) -> ServedBatches:
        return ServedBatches([b.to(device) for b in self.batches])


@dataclass
class PromptBatch:
    """One micro-batch of GRPO's prompts with their references (``prompts.py``), as the training step reads
    it (``forward_step.grpo_step``): the answers are drawn there, so nothing is packed yet."""

    prompts: list[dict]  # each: input_ids [L] and the processor's media tensors (None where absent)
    references: list[str]
    indices: list[int]
    skipped: dict | None = None  # as ``BatchStats.skipped``: a worker's skip counts (loader.py)

    @classmethod
    def collate(cls, items: list[dict]) -> PromptBatch:
        return cls([i["prompt"] for i in items], [i["reference"] for i in items], [i["index"] for i in items])

    def as_dict(self) -> dict:
        """Plain data (``batch.to_megatron``)."""
        return {"prompts": self.prompts, "references": self.references, "indices": self.indices}


def to_megatron(item: PackedBatch | ServedBatches | PromptBatch) -> dict:
    """A micro-batch as megatron's data iterator hands it on: plain dicts (``{"served": [...]}`` for
    ``ServedBatches``), kept plain on purpose. megatron's rerun state machine (``--rerun-mode
    validate_results``) keeps the micro-batches it drew and, after a NaN, saves them in the
    checkpoint it re-saves; a checkpoint loads as data only (checkpoint/safety.py, weights_only),
    which refuses a class of ours, and plain dicts keep checkpoints the same as before the batch
    was typed. ``from_megatron`` (forward_step) turns it back."""
    if isinstance(item, ServedBatches):
        return {"served": [b.as_dict() for b in item.batches]}
    return item.as_dict()  # a PromptBatch's (GRPO's prompts, prompts.py) is {"prompts": ..., ...}


def from_megatron(item: dict) -> PackedBatch | ServedBatches | PromptBatch:
    """The micro-batch ``to_megatron`` made plain."""
    if "prompts" in item:
        return PromptBatch(**item)
    if "served" in item:
        return ServedBatches([PackedBatch.from_dict(b) for b in item["served"]])
    return PackedBatch.from_dict(item)
