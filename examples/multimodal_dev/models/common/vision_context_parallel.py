"""The vision tower's work split over context-parallel ranks.

Every CP rank holds the same micro-batch, so without a split each ran the vision tower on all of
its images and videos: the same work CP times over. Here the images and video frames (a video's
temporal patches are independent segments of the tower, so one long video spreads over every rank)
are dealt to the CP ranks by their vision FLOPs (the tower's ``item_flops``; largest first, to the
least-loaded rank), each rank encodes its own, and one all-gather over the CP group hands every
rank every feature, in the batch's order, for the merge. The gather's backward reduce-scatters:
each image's feature gradients, from the tokens of every CP rank, are summed on the rank that
encoded it. The tower's weight gradients then come from one rank per image, and megatron reduces
them over DP x CP, so they add up to the whole batch's.

With fewer images and frames than CP ranks every rank encodes all of them, as before: a rank with
nothing to encode would leave the tower out of its backward.
"""

from __future__ import annotations

import itertools

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from .batch_memo import host_side
from .video_frames import frames_of
from .work_deal import deal


def shares_of(grids: list, item_flops, merge: int, count: int) -> tuple[list[list[int]], list[int], int]:
    """A micro-batch's items (``grids`` [(t, h, w)]) dealt to ``count`` encoders by ``item_flops``:
    (each encoder's items, each item's feature rows, the rows every encoder sends: its largest share,
    padded, for a gather or a bridge's equal split, at least one). Both ends of a hand-over compute
    it from the grids alone, so no index list travels with the features."""
    tokens = [t * h * w // merge**2 for t, h, w in grids]
    owned = deal([item_flops(g) for g in grids], count)
    return owned, tokens, max(1, *(sum(tokens[i] for i in items) for items in owned))


def take_items(pixels: torch.Tensor, grids: torch.Tensor, items: list[int]) -> torch.Tensor:
    """The patch rows of ``items`` (``pixels`` holds the rows of every item of ``grids``, in order)."""
    rows = [t * h * w for t, h, w in grids.tolist()]
    starts = [0, *itertools.accumulate(rows)]
    return torch.cat([pixels[starts[i] : starts[i] + rows[i]] for i in items])


def encode(vision_model, pixels: torch.Tensor, grids: torch.Tensor, cp_group) -> torch.Tensor:
    """Vision features [N, H] of all items (``grids`` [n, 3] (t, h, w), ``pixels`` their patch rows
    in order), each frame encoded on one rank of ``cp_group``."""
    cp = cp_group.size() if cp_group is not None else 1
    if cp == 1:
        return vision_model(pixels, grids)
    frames = host_side(frames_of(grids))  # the grids stay on the host on every device, and so do their frames
    if frames.shape[0] < cp:
        return vision_model(pixels, grids)
    owned, tokens, width = shares_of(
        frames.tolist(), vision_model.item_flops, vision_model.shape.spatial_merge_size, cp
    )
    mine = owned[cp_group.rank()]
    features = vision_model(take_items(pixels, frames, mine), host_side(frames[mine]))  # [tokens of my frames, H]
    features = torch.nn.functional.pad(features, (0, 0, 0, width - features.shape[0]))  # every rank sends as many
    gathered = gather_from_sequence_parallel_region(features, tensor_parallel_output_grad=True, group=cp_group)
    return gathered.index_select(0, batch_order(owned, tokens, width).to(gathered.device))


def batch_order(owned: list[list[int]], tokens: list[int], width: int) -> torch.Tensor:
    """Rows of a gather of ``width`` rows per rank (rank r's items in order, then padding) that put
    the items back in batch order: item i sits in its owner's block, after the owner's earlier items."""
    where = [0] * len(tokens)
    for r, items in enumerate(owned):
        offset = r * width
        for i in items:
            where[i] = offset
            offset += tokens[i]
    return torch.cat([torch.arange(where[i], where[i] + tokens[i]) for i in range(len(tokens))])


def joined_zero(module: torch.nn.Module) -> torch.Tensor:
    """0, computed from every trainable weight of ``module``: added where it did no work (a
    text-only micro-batch, a rank with no image to encode), it gives each weight a zero gradient.
    megatron's DDP with ``--overlap-grad-reduce`` starts a bucket's reduction when all its weights
    have a gradient from the step's last micro-batch, and stops the run if one never gets one."""
    return sum((p.sum() for p in module.parameters() if p.requires_grad), torch.zeros(())) * 0


def idle_item(vision_model) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels, grids) of the smallest frame the tower encodes, all zeros: one merged token."""
    s, weight = vision_model.shape, vision_model.patch_embed.proj.weight
    merge = s.spatial_merge_size
    pixels = torch.zeros(merge**2, s.patch_dim, dtype=weight.dtype, device=weight.device)
    return pixels, torch.tensor([[1, merge, merge]])


def idle_features(vision_model, rows: int) -> torch.Tensor:
    """[rows, H] zeros in the tower's dtype, joined to every weight: what a tower with nothing to
    encode hands on where features must go (a gather needs equal sizes, a bridge at least a row)."""
    weight = vision_model.patch_embed.proj.weight
    zeros = torch.zeros(rows, vision_model.shape.out_hidden_size, dtype=weight.dtype, device=weight.device)
    return zeros + joined_zero(vision_model).to(weight.dtype)
