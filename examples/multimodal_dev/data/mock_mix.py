"""A mock with the shape of a real SFT mix (``--dataset-provider mock_mix``): what packing,
padding and balance figures should be measured on.

The default mock draws 0-2 small images (4-12 patches a side) and uniform text lengths, which
says little about a real mix. Here, deterministic by (seed, index):

- text length (prompt + answer) from a truncated log-normal mixture: most documents short
  (median 120 tokens), a long tail (median 1200) cut at what the sequence budget leaves after
  the images; the answer takes 20-80 % of it;
- images per document from a categorical (0: 25 %, 1: 50 %, 2: 15 %, 3: 7 %, 4: 3 %);
- image sizes from resolution buckets (224^2 ... 1344^2 pixels) and aspect ratios up to 3:1
  either way, at Qwen3.5's 16-pixel patches and 2x2 merge (a 1344^2 image is 84x84 patches,
  1764 tokens).

Pixel values are a repeated random tile: their values do not matter for throughput and a
1344^2 image of fresh normals would cost more to draw than to train on.
Videos are not drawn here; `mock_video.py` adds them to the default mock.
"""

from __future__ import annotations

import math

import torch

from . import mock

PATCH_PIXELS = 16
IMAGES_PER_DOCUMENT = (0.25, 0.50, 0.15, 0.07, 0.03)
SIDE_BUCKETS = ((224, 0.15), (448, 0.30), (672, 0.25), (896, 0.15), (1120, 0.10), (1344, 0.05))
ASPECT_RATIOS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16, 2.0, 0.5, 3.0, 1 / 3)  # width / height
# (weight, median tokens, sigma of the log): short documents, then the long tail
LENGTH_MIXTURE = ((0.85, 120.0, 0.7), (0.15, 1200.0, 0.5))
MIN_TEXT = 8


def _choice(gen, weights) -> int:
    return int(torch.multinomial(torch.tensor(weights, dtype=torch.float64), 1, generator=gen))


class RealisticProfile:
    def n_images(self, gen) -> int:
        return _choice(gen, IMAGES_PER_DOCUMENT)

    def grid(self, gen, merge: int) -> tuple[int, int]:
        side = SIDE_BUCKETS[_choice(gen, [w for _, w in SIDE_BUCKETS])][0]
        ratio = ASPECT_RATIOS[int(torch.randint(len(ASPECT_RATIOS), (1,), generator=gen))]
        unit = PATCH_PIXELS * merge  # grids are whole merged patches
        h = max(1, round(side / math.sqrt(ratio) / unit)) * merge
        w = max(1, round(side * math.sqrt(ratio) / unit)) * merge
        return h, w

    def text_lengths(self, gen, room: int) -> tuple[int, int]:
        _, median, sigma = LENGTH_MIXTURE[_choice(gen, [w for w, _, _ in LENGTH_MIXTURE])]
        draw = float(torch.randn(1, generator=gen)) * sigma + math.log(median)
        total = int(min(max(math.exp(draw), MIN_TEXT), max(room, MIN_TEXT)))
        answer_share = 0.2 + 0.6 * float(torch.rand(1, generator=gen))
        n_answer = max(2, int(total * answer_share))
        return max(4, total - n_answer), n_answer

    def pixels(self, gen, n_patches: int, patch_dim: int, materialize: bool = True) -> torch.Tensor:
        tile = torch.randn(min(n_patches, 64), patch_dim, generator=gen)  # drawn either way: same stream
        if not materialize:
            return tile[:1].expand(n_patches, patch_dim)
        return tile.repeat(math.ceil(n_patches / len(tile)), 1)[:n_patches]


def build_datasets(**kwargs):
    """``mock.build_datasets`` with the realistic profile."""
    return mock.build_datasets(profile_fn=RealisticProfile, **kwargs)
