"""A video as its frames. Qwen3.5 separates a video's temporal patches with timestamps: each is its own
(1, h, w) grid for MRoPE, and the vision tower encodes each as a segment of its own, so the frames of
one video can be positioned, chunked and dealt to ranks like images."""

from __future__ import annotations

import torch


def frames_of(grid_thw: torch.Tensor) -> torch.Tensor:
    """Every item of ``grid_thw`` [n, 3] as its frames, (1, h, w) each, in order (a video's temporal
    patches are consecutive rows of its pixels)."""
    frames = torch.repeat_interleave(grid_thw, grid_thw[:, 0], dim=0).clone()
    frames[:, 0] = 1
    return frames
