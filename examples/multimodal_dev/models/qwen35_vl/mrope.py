"""Multimodal rotary positions (MRoPE) for Qwen3.5: position indices and interleaved frequencies.

Position indices, ``position_ids_3BS`` [3 (t, h, w), batch, seq]:
  - text tokens advance one step on all three axes together;
  - an image (or one video frame: Qwen3.5 separates frames with timestamps, so each frame is
    its own grid with t = 1) occupies (t, h/m, w/m) merged patches starting at the current
    position p: axis t = p + frame, h = p + row, w = p + col; afterwards p += max(h, w)/m.
Computed vectorised per sample from run boundaries (no per-token Python loop). Packed rows
restart at 0 for every sample.

Interleaved frequencies: the rotary half-dim r = head_dim * partial_rotary_factor / 2 is split
channel by channel round-robin: channel c uses the h axis when c % 3 == 1 and c < 3*sec_h,
the w axis when c % 3 == 2 and c < 3*sec_w, else t. ``InterleavedMRoPE`` returns the angles
in megatron-core's layout ``[seq, batch, 1, 2r]`` (cos/sin computed by the attention).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import overload

import torch
from torch import nn

from ..common.video_frames import frames_of


def _vision_runs(tokens_1d: torch.Tensor, vision_ids: torch.Tensor):
    """Start index and length of each maximal run of vision tokens in a 1-D token row."""
    is_vis = torch.isin(tokens_1d, vision_ids).to(torch.int8)
    edges = torch.diff(torch.nn.functional.pad(is_vis, (1, 1)))
    starts = torch.nonzero(edges == 1).flatten()
    ends = torch.nonzero(edges == -1).flatten()
    return starts, ends - starts


def sample_position_ids(tokens_1d: torch.Tensor, grids_thw: torch.Tensor, vision_ids, spatial_merge: int):
    """MRoPE positions [3, L] of one unpadded sample. ``grids_thw`` lists this sample's
    images/video frames in order (videos already split one frame per row)."""
    device = tokens_1d.device
    length = tokens_1d.numel()
    vision_ids = torch.as_tensor(list(vision_ids), device=device)
    starts, lengths = _vision_runs(tokens_1d, vision_ids)
    grids = grids_thw.to(device=device, dtype=torch.long).reshape(-1, 3)
    gt, gh, gw = grids[:, 0], grids[:, 1] // spatial_merge, grids[:, 2] // spatial_merge
    if starts.numel() != grids.shape[0]:
        raise ValueError(f"sample has {starts.numel()} vision runs but {grids.shape[0]} grids")
    if not torch.equal(lengths, gt * gh * gw):
        raise ValueError(f"vision run lengths {lengths.tolist()} != grid token counts {(gt * gh * gw).tolist()}")
    # Each earlier vision run of n tokens advances the position by span = max(h, w) instead of
    # n, so every later token is shifted back by the sum of (n - span) over the runs before it.
    span = torch.maximum(gh, gw)
    shift_before = torch.cumsum(torch.nn.functional.pad(lengths - span, (1, 0)), 0)  # [n_runs + 1]
    pos = torch.arange(length, device=device)
    runs_started = torch.bucketize(pos, starts, right=True)  # runs starting at or before pos
    out = (pos - shift_before[runs_started]).unsqueeze(0).repeat(3, 1)
    if len(starts):
        vis_idx = torch.nonzero(torch.isin(tokens_1d, vision_ids)).flatten()  # runs in order
        owner = torch.repeat_interleave(torch.arange(len(starts), device=device), lengths)
        local = vis_idx - starts[owner]
        hw = gh[owner] * gw[owner]
        base = starts[owner] - shift_before[owner]  # position of the run's first token
        out[0, vis_idx] = base + local // hw
        out[1, vis_idx] = base + (local % hw) // gw[owner]
        out[2, vis_idx] = base + local % gw[owner]
    return out


def packed_position_ids(
    tokens_T: torch.Tensor,
    grids_thw: torch.Tensor,
    vision_ids: Iterable[int],
    spatial_merge: int,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """MRoPE positions [3, T] of a packed row, restarting at 0 at every ``cu_seqlens`` boundary.

    One scan over the whole row: positions are affine in the running shift, so treating the row
    as one sample and subtracting each sample's value at its first token (equal on all three
    axes, text or vision) gives every sample's own positions. ``grids_thw`` lists all images /
    frames of the row in order; padding between samples must not be a vision token."""
    out = sample_position_ids(tokens_T, grids_thw, vision_ids, spatial_merge)
    bounds = cu_seqlens.to(device=tokens_T.device, dtype=torch.long)
    starts, lengths = bounds[:-1], torch.diff(bounds)
    offset = torch.repeat_interleave(out[0, starts], lengths)
    return out - offset.unsqueeze(0)


@overload
def split_video_frames(video_grid_thw: torch.Tensor) -> torch.Tensor: ...
@overload
def split_video_frames(video_grid_thw: None) -> None: ...
def split_video_frames(video_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """Qwen3.5 puts a timestamp between frames: each frame is its own (1, h, w) grid."""
    if video_grid_thw is None or video_grid_thw.numel() == 0:
        return video_grid_thw
    return frames_of(video_grid_thw)


def run_grids(
    row: torch.Tensor,
    image_grids: torch.Tensor,
    video_frames: torch.Tensor,
    image_token_id: int,
    video_token_id: int,
    first_image: int = 0,
    first_frame: int = 0,
    where: str = "the row",
) -> tuple[torch.Tensor, int, int]:
    """(the grid of every vision run of ``row`` in reading order, images used, frames used): image
    runs take ``image_grids`` and video runs ``video_frames`` (``split_video_frames``), each in
    order from ``first_image`` / ``first_frame``; a run's first token says which it is."""
    starts, _ = _vision_runs(row, torch.tensor([image_token_id, video_token_id], device=row.device))
    is_image = row[starts] == image_token_id
    n_img, n_vid = int(is_image.sum()), int((~is_image).sum())
    for what, needed, have in (
        ("images", first_image + n_img, len(image_grids)),
        ("videos", first_frame + n_vid, len(video_frames)),
    ):
        if needed > have:
            kind = "image_grid_thw" if what == "images" else "video frames in video_grid_thw"
            raise ValueError(
                f"{what}: {where} {'have' if where.startswith('rows') else 'has'} {needed} placeholder "
                f"runs but {kind} lists {have}; the processor's token expansion and the grids disagree"
            )
    grids = torch.zeros(len(starts), 3, dtype=torch.long, device=row.device)
    grids[is_image] = image_grids[first_image : first_image + n_img].to(row.device, torch.long)
    grids[~is_image] = video_frames[first_frame : first_frame + n_vid].to(row.device, torch.long)
    return grids, n_img, n_vid


def padded_batch_position_ids(
    tokens_BS: torch.Tensor,
    attention_mask_BS: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    image_token_id: int,
    video_token_id: int,
    spatial_merge: int,
) -> torch.Tensor:
    """MRoPE positions [3, B, S] of a right- or left-padded batch; padding gets position 0
    (never attended by real tokens). Grids are consumed in order across the batch."""
    image_grids = image_grid_thw if image_grid_thw is not None else tokens_BS.new_zeros(0, 3)
    video_grids = split_video_frames(video_grid_thw)
    video_grids = video_grids if video_grids is not None else tokens_BS.new_zeros(0, 3)
    out = tokens_BS.new_zeros((3,) + tuple(tokens_BS.shape), dtype=torch.long)
    next_img = next_vid = 0
    for b in range(tokens_BS.shape[0]):
        keep = (
            attention_mask_BS[b].bool()
            if attention_mask_BS is not None
            else torch.ones_like(tokens_BS[b], dtype=torch.bool)
        )
        row = tokens_BS[b][keep]
        grids, n_img, n_vid = run_grids(
            row,
            image_grids,
            video_grids,
            image_token_id,
            video_token_id,
            next_img,
            next_vid,
            where=f"rows 0..{b} of the batch",
        )
        next_img, next_vid = next_img + n_img, next_vid + n_vid
        out[:, b, keep] = sample_position_ids(row, grids, (image_token_id, video_token_id), spatial_merge)
    return out


class InterleavedMRoPE(nn.Module):
    """Rotary angles from 3-axis positions, with Qwen3.5's interleaved section layout."""

    def __init__(self, head_dim: int, partial_rotary_factor: float, base: float, mrope_section):
        super().__init__()
        rot_dim = int(head_dim * partial_rotary_factor)
        half = rot_dim // 2
        # As transformers: axis h takes channels 1, 4, 7, ... below 3*sec_h, w takes 2, 5, 8, ... below
        # 3*sec_w, t the rest; sections reaching past the rotary channels are clipped (its own
        # tester config has [16, 8, 8] with one rotary channel pair), so any three sizes are valid.
        if len(mrope_section) != 3 or min(mrope_section) < 0:
            raise ValueError(f"mrope_section {list(mrope_section)}: expected three non-negative sizes (t, h, w)")
        # on the host even in a meta-device build (checkpoint/weightless_model.py): no checkpoint fills a buffer
        host = torch.device("cpu")
        inv_freq = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=host) / rot_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        axis = torch.zeros(half, dtype=torch.long, device=host)
        channel = torch.arange(half, device=host)
        for ax in (1, 2):
            axis[(channel % 3 == ax) & (channel < 3 * mrope_section[ax])] = ax
        self.register_buffer("axis_of_channel", axis, persistent=False)

    def forward(self, position_ids_3BS: torch.Tensor, mrope_section=None, cp_group=None) -> torch.Tensor:
        """[3, B, S] positions -> angles [S, B, 1, rot_dim] (the megatron-core ``rotary_pos_emb``)."""
        if position_ids_3BS.dim() == 2:
            position_ids_3BS = position_ids_3BS.unsqueeze(0).expand(3, -1, -1)
        freqs = position_ids_3BS.float()[..., None] * self.inv_freq.to(position_ids_3BS.device)  # [3,B,S,half]
        idx = self.axis_of_channel.to(freqs.device).view(1, 1, 1, -1).expand(1, *freqs.shape[1:])
        angles = torch.gather(freqs, 0, idx)[0]  # [B, S, half]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.transpose(0, 1).unsqueeze(2).contiguous()
