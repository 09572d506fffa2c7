"""Mock conversations: the default dataset. No files, no network, deterministic by (seed, index).

Each sample is shaped like a chat SFT example so loss masks mean something:

    <im_start> user \n [<vision_start> <image>*n <vision_end>]*k  prompt text  <im_end> \n
    <im_start> assistant \n  answer text  <im_end>

k in {0, 1, 2} images of varying non-square sizes; prompt and answer lengths vary. The answer
continues a counting pattern seeded by the prompt's first token, so a model can learn it and
the training loss visibly falls. A profile with ``n_videos`` (``mock_video.py``) adds videos
after the images, each frame as Qwen3.5 lays it out: ``<timestamp> <vision_start> <video>*n
<vision_end>``.
"""

from __future__ import annotations

import torch

from .patch_budget import PatchBudget
from .sample import VisionTokens, build_sft_sample
from .skipping import SkippingDataset

# Template token ids of the mock vocabulary (below every text token).
PAD, IM_END, IM_START, USER, ASSISTANT, NEWLINE, TIMESTAMP = 0, 1, 2, 3, 4, 5, 6
FIRST_TEXT_ID = 16
GRID_SIDES = (4, 6, 8, 10, 12)  # patches per side before merging; even so 2x2 merging is exact


class UniformProfile:
    """The default mock's draws: 0..max_images images of 4..12 patches a side, prompt and answer
    lengths uniform up to ``mean_text_tokens`` (the tests' figures are pinned to these draws)."""

    def __init__(self, mean_text_tokens: int = 96, max_images: int = 2):
        self.mean_text_tokens, self.max_images = mean_text_tokens, max_images

    def n_images(self, gen) -> int:
        return int(torch.randint(self.max_images + 1, (1,), generator=gen))

    def grid(self, gen, merge: int) -> tuple[int, int]:
        h, w = (GRID_SIDES[int(i)] for i in torch.randint(len(GRID_SIDES), (2,), generator=gen))
        return h, w

    def text_lengths(self, gen, room: int) -> tuple[int, int]:
        n_prompt = int(torch.randint(4, self.mean_text_tokens + 1, (1,), generator=gen))
        return n_prompt, int(torch.randint(2, self.mean_text_tokens + 1, (1,), generator=gen))

    def pixels(self, gen, n_patches: int, patch_dim: int, materialize: bool = True) -> torch.Tensor:
        return torch.randn(n_patches, patch_dim, generator=gen)  # small: drawn either way


class MockConversations:
    def __init__(
        self,
        tokens: VisionTokens,
        vocab_size: int,
        patch_dim: int,
        seed: int = 1234,
        mean_text_tokens: int = 96,
        text_vocab: int = 512,
        max_images: int = 2,
        profile=None,
        max_length: int | None = None,
    ):
        top = min(vocab_size, *tokens.vision_ids, tokens.vision_start, tokens.vision_end)
        if top - FIRST_TEXT_ID < 8:
            raise ValueError(f"mock dataset: vocab {vocab_size} leaves no room for text tokens below the vision ids")
        self.tokens, self.patch_dim, self.seed = tokens, patch_dim, seed
        self.text_vocab = min(text_vocab, top - FIRST_TEXT_ID)
        self.profile = profile or UniformProfile(mean_text_tokens, max_images)
        self.max_length = max_length

    def _image(self, gen: torch.Generator, materialize: bool):
        h, w = self.profile.grid(gen, self.tokens.spatial_merge)
        n_tokens = h * w // self.tokens.spatial_merge**2
        ids = [self.tokens.vision_start] + [self.tokens.image] * n_tokens + [self.tokens.vision_end]
        return ids, self.profile.pixels(gen, h * w, self.patch_dim, materialize), (1, h, w)

    def _video(self, gen: torch.Generator, materialize: bool):
        frames = self.profile.n_frames(gen)
        h, w = self.profile.grid(gen, self.tokens.spatial_merge)
        frame_ids = [self.tokens.vision_start] + [self.tokens.video] * (h * w // self.tokens.spatial_merge**2)
        ids = [t for _ in range(frames) for t in (TIMESTAMP, *frame_ids, self.tokens.vision_end)]
        return ids, self.profile.pixels(gen, frames * h * w, self.patch_dim, materialize), (frames, h, w)

    def describe(self, index: int) -> dict:
        """Sample ``index`` with the same tokens and grids but pixels that may be a zero-stride
        view (no memory): what token-budget packing plans with."""
        return self(index, materialize=False)

    def __call__(self, index: int, materialize: bool = True) -> dict:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        images = [self._image(gen, materialize) for _ in range(self.profile.n_images(gen))]
        n_videos = self.profile.n_videos(gen) if hasattr(self.profile, "n_videos") else 0
        videos = [self._video(gen, materialize) for _ in range(n_videos)]
        vision = images + videos
        room = (self.max_length or 1 << 30) - sum(len(ids) for ids, _, _ in vision) - 10  # 10: the template
        n_prompt, n_answer = self.profile.text_lengths(gen, room)
        prompt_text = torch.randint(self.text_vocab, (n_prompt,), generator=gen)
        answer_text = (prompt_text[0] + 1 + torch.arange(n_answer)) % self.text_vocab
        prompt = [IM_START, USER, NEWLINE] + [t for ids, _, _ in vision for t in ids]
        prompt += (prompt_text + FIRST_TEXT_ID).tolist() + [IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE]
        answer = (answer_text + FIRST_TEXT_ID).tolist() + [IM_END]
        pixels, grids = self._stack(images, materialize)
        video_pixels, video_grids = self._stack(videos, materialize)
        return build_sft_sample(torch.tensor(prompt), torch.tensor(answer), pixels, grids, video_pixels, video_grids)

    def _stack(self, items, materialize: bool):
        """(pixels, grids) of images or videos; pixels as a zero-stride view unless ``materialize``."""
        n_patches = sum(len(p) for _, p, _ in items)
        if materialize:
            pixels = torch.cat([p for _, p, _ in items]) if items else torch.zeros(0, self.patch_dim)
        else:
            pixels = torch.zeros(1, self.patch_dim).expand(n_patches, self.patch_dim)
        return pixels, torch.tensor([g for _, _, g in items], dtype=torch.long).reshape(-1, 3)


def build_datasets(
    tokens: VisionTokens,
    vocab_size: int,
    patch_dim: int,
    seq_length: int,
    num_samples: tuple[int, int, int],
    seed: int = 1234,
    mean_text_tokens: int = 96,
    profile_fn=None,
    **options,
):
    """(train, valid, test) of the requested sizes; the splits use disjoint seeds. ``profile_fn``:
    a profile per split (``mock_mix.py``), else the uniform one. ``options``: the vision patch budgets
    (``patch_budget.FLAGS``' names); the other data options do not apply to a mock."""
    patch_budget = PatchBudget.from_options(options)
    splits = []
    for split, n in enumerate(num_samples):
        produce = MockConversations(
            tokens,
            vocab_size,
            patch_dim,
            seed=seed + 7919 * split,
            mean_text_tokens=mean_text_tokens,
            max_length=seq_length,
            profile=profile_fn() if profile_fn else None,
        )
        splits.append(
            SkippingDataset(
                produce,
                num_source=max(n, 1),
                length=n,
                tokens=tokens,
                max_length=seq_length,
                patch_dim=patch_dim,
                name=f"mock[{('train', 'valid', 'test')[split]}]",
                patch_budget=patch_budget,
            )
        )
    return tuple(splits)
