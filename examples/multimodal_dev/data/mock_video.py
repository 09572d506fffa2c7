"""Mock conversations with videos (``--dataset-provider mock_video``): the default mock's images
and text, plus a video in half of the conversations, so the video path (frame layout, MRoPE of
frames, the vision tower on temporal patches, FLOPs) trains end to end without files.

A video is 1-3 temporal patches (2-6 frames at Qwen3.5's temporal patch of 2) of 4-12 patches a
side; every frame is its own vision run behind a timestamp token (``mock.py``).
"""

from __future__ import annotations

import torch

from . import mock

MAX_FRAMES = 3  # temporal patches a video


class VideoProfile(mock.UniformProfile):
    def n_videos(self, gen) -> int:
        return int(torch.randint(2, (1,), generator=gen))

    def n_frames(self, gen) -> int:
        return int(torch.randint(1, MAX_FRAMES + 1, (1,), generator=gen))


def build_datasets(**kwargs):
    """``mock.build_datasets`` with videos."""
    return mock.build_datasets(profile_fn=VideoProfile, **kwargs)
