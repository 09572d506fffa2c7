"""The dataset sample contract: one conversation, unpadded, ready for the collate.

    field            shape                 dtype     meaning
    input_ids        [L]                   int64     prompt (with expanded image placeholders) + answer
    labels           [L]                   int64     next-token target at i (= input_ids[i+1]) where it
                                                     is trained, IGNORE_INDEX elsewhere
    loss_mask        [L]                   float32   1.0 exactly where labels is trained
    pixel_values     [P, C*t*p*p]          float32   flattened vision patches of all images, in order
    image_grid_thw   [n_images, 3]         int64     (t, h, w) patch grid of each image
    pixel_values_videos [Pv, C*t*p*p]      float32   the same for all videos ([0, C*t*p*p] without)
    video_grid_thw   [n_videos, 3]         int64     (t, h, w) of each video, t temporal patches

A video's frames (temporal patches) each form their own vision run, as Qwen3.5's processor
lays them out: ``<timestamp> <vision_start> <video>*(h*w/merge**2) <vision_end>`` per frame.
The frames of a video may also sit inside one enclosing ``<vision_start> ... <vision_end>``:
transformers 5.x expands only the template's ``<|video_pad|>`` and keeps the pair the chat
template wrote around it, while transformers 4.57 (which replaced the whole triple) and the mock
provider write none. The pair is text to MRoPE (only placeholder runs take grid positions).

Invariants checked by ``validate_sample`` when a provider produces a sample, for images and
videos alike: number of placeholder tokens == sum(t*h*w) / merge**2, P == sum(t*h*w), and
one vision_start per image and per video frame, plus at most one more per video (its enclosing
pair): n_images + sum(t) <= vision_starts <= n_images + sum(t) + n_videos.

``build_conversation_sample`` is the one place labels and the loss mask are derived, so no
provider can shift them differently: the model at position i predicts token i+1, so position i
is trained when token i+1 belongs to an answer (an assistant turn's text and its end-of-turn
token). ``build_sft_sample`` is its single-turn form (prompt, then one answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from examples.multimodal_dev.models import DEFAULT_ARCH

from .errors import BadSample, DataError  # noqa: F401 - the data layer's errors, named here too

IGNORE_INDEX = -100
FIELDS = ("input_ids", "labels", "loss_mask", "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
# (kind: also the VisionTokens attribute of its placeholder id, pixel field, grid field)
VISION_KINDS = (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw"))


@dataclass(frozen=True)
class VisionTokens:
    """Token ids the collate and the model agree on (taken from the processor or the shape)."""

    image: int
    video: int
    vision_start: int
    vision_end: int
    spatial_merge: int
    # the model whose MRoPE positions the collate computes (its MODEL_REGISTRY key); a processor's
    # tokens do not know it and agree with any model's
    arch: str = field(default=DEFAULT_ARCH, compare=False)

    @property
    def vision_ids(self) -> tuple[int, int]:
        return (self.image, self.video)

    @classmethod
    def from_shape(cls, shape) -> "VisionTokens":
        """From a model shape carrying the four token ids and ``vision.spatial_merge_size``."""
        return cls(
            shape.image_token_id,
            shape.video_token_id,
            shape.vision_start_token_id,
            shape.vision_end_token_id,
            shape.vision.spatial_merge_size,
            type(shape).arch,
        )


def build_sft_sample(
    prompt_ids: torch.Tensor,
    answer_ids: torch.Tensor,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> dict:
    """Concatenate prompt and answer; train on the answer tokens only (shifted by one)."""
    prompt_ids = prompt_ids.reshape(-1).long()
    answer_ids = answer_ids.reshape(-1).long()
    if answer_ids.numel() == 0:
        raise BadSample("empty_answer", "the assistant answer has no tokens")
    input_ids = torch.cat([prompt_ids, answer_ids])
    is_answer = torch.zeros_like(input_ids, dtype=torch.bool)
    is_answer[prompt_ids.numel() :] = True
    return build_conversation_sample(
        input_ids, is_answer, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw
    )


def build_conversation_sample(
    input_ids: torch.Tensor,
    is_answer: torch.Tensor,
    pixel_values: torch.Tensor,
    image_grid_thw: torch.Tensor,
    pixel_values_videos: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
) -> dict:
    """A conversation of any number of turns: ``is_answer[i]`` marks token i as part of an
    assistant turn (its text and end-of-turn token); each such token is the target of the
    position before it. A leading answer token has no position before it and is not trained."""
    input_ids = input_ids.reshape(-1).long()
    is_answer = is_answer.reshape(-1).bool()
    if is_answer.shape != input_ids.shape:
        raise ValueError(f"is_answer has {is_answer.numel()} entries for {input_ids.numel()} tokens")
    trained = torch.zeros_like(is_answer)
    trained[:-1] = is_answer[1:]  # position i is trained when its target i+1 is an answer token
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:-1] = torch.where(trained[:-1], input_ids[1:], IGNORE_INDEX)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": trained.float(),
        "pixel_values": pixel_values.float(),
        "image_grid_thw": image_grid_thw.reshape(-1, 3).long(),
        "pixel_values_videos": (
            pixel_values_videos.float()
            if pixel_values_videos is not None
            else pixel_values.new_zeros(0, pixel_values.shape[-1]).float()
        ),
        "video_grid_thw": (
            video_grid_thw.reshape(-1, 3).long() if video_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
        ),
    }


def validate_sample(sample: dict, tokens: VisionTokens, patch_dim: int | None = None) -> dict:
    """Check a sample against the contract; raise ``ValueError`` naming the offending field.

    vision_start tokens: one per image and per video frame, and up to one more per video for a
    pair enclosing its frames. transformers 5.x's processor keeps the chat template's
    ``<|vision_start|>``/``<|vision_end|>`` around a video's per-frame runs; 4.57 and the mock do
    not. Both are the reference's own ids, so both are accepted; any other count is not."""
    missing = [f for f in FIELDS if f not in sample]
    if missing:
        raise ValueError(f"sample is missing field(s) {missing}; the contract is {FIELDS}")
    ids, labels, mask = sample["input_ids"], sample["labels"], sample["loss_mask"]
    _check_field_types(sample)
    _check_trained_positions(ids, labels, mask)
    runs = 0  # vision runs: one per image, one per video frame
    for kind, pixel_field, grid_field in VISION_KINDS:
        runs += _check_vision_kind(sample, tokens, patch_dim, kind, pixel_field, grid_field)
    _check_vision_starts(sample, tokens, runs)
    if not bool(mask.any()):
        raise BadSample("no_trained_tokens", "loss_mask is all zero")
    return sample


def _check_field_types(sample: dict) -> None:
    for name, dtype, dim in (
        ("input_ids", torch.int64, 1),
        ("labels", torch.int64, 1),
        ("loss_mask", torch.float32, 1),
        ("pixel_values", torch.float32, 2),
        ("image_grid_thw", torch.int64, 2),
        ("pixel_values_videos", torch.float32, 2),
        ("video_grid_thw", torch.int64, 2),
    ):
        t = sample[name]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != dim:
            got = f"{t.dtype} with {t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"sample field {name!r} must be a {dim}-D {dtype} tensor, got {got}")


def _check_trained_positions(ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> None:
    """input_ids, labels and loss_mask are one length and agree on which positions are trained."""
    if not (ids.shape == labels.shape == mask.shape):
        raise ValueError(
            f"sample fields input_ids {tuple(ids.shape)}, labels {tuple(labels.shape)} and "
            f"loss_mask {tuple(mask.shape)} must have the same length"
        )
    if bool(((labels != IGNORE_INDEX) != (mask > 0)).any()):
        raise ValueError("sample fields labels and loss_mask disagree on which positions are trained")


def _check_vision_kind(
    sample: dict, tokens: VisionTokens, patch_dim: int | None, kind: str, pixel_field: str, grid_field: str
) -> int:
    """One vision kind's grids, pixels and placeholder tokens agree; its number of vision runs
    (one per image, one per video frame)."""
    ids, pixels, grids = sample["input_ids"], sample[pixel_field], sample[grid_field]
    if grids.shape[-1] != 3:
        raise ValueError(f"sample field {grid_field!r} must be [n_{kind}s, 3], got {tuple(grids.shape)}")
    n_patches = int(grids.prod(-1).sum())
    if pixels.shape[0] != n_patches:
        raise ValueError(
            f"sample field {pixel_field!r} has {pixels.shape[0]} patches but {grid_field} "
            f"{grids.tolist()} needs {n_patches}"
        )
    if patch_dim is not None and pixels.shape[0] and pixels.shape[1] != patch_dim:
        raise ValueError(
            f"sample field {pixel_field!r} rows have {pixels.shape[1]} values; the vision tower expects {patch_dim}"
        )
    n_tokens = int((ids == getattr(tokens, kind)).sum())
    expected = n_patches // tokens.spatial_merge**2
    if n_tokens != expected:
        raise ValueError(
            f"sample field 'input_ids' has {n_tokens} {kind} tokens but {grid_field} "
            f"{grids.tolist()} gives {expected} after {tokens.spatial_merge}x{tokens.spatial_merge} "
            "merging"
        )
    return grids.shape[0] if kind == "image" else int(grids[:, 0].sum())


def _check_vision_starts(sample: dict, tokens: VisionTokens, runs: int) -> None:
    """One vision_start per vision run, plus at most one per video enclosing its frames."""
    n_starts, n_videos = int((sample["input_ids"] == tokens.vision_start).sum()), sample["video_grid_thw"].shape[0]
    if not runs <= n_starts <= runs + n_videos:
        enclosing = f", plus up to {n_videos} enclosing a video's frames" if n_videos else ""
        raise ValueError(
            f"sample field 'input_ids' has {n_starts} vision_start tokens for "
            f"{sample['image_grid_thw'].shape[0]} images and {int(sample['video_grid_thw'][:, 0].sum())} "
            f"video frames: expected {runs}{enclosing}"
        )


def fit_to_budget(sample: dict, tokens: VisionTokens, max_length: int) -> dict:
    """Truncate a sample to ``max_length`` tokens if the cut lands after the last image and
    keeps at least one trained token; otherwise it cannot be used (never cut an image)."""
    length = sample["input_ids"].numel()
    if length <= max_length:
        return sample
    vision = torch.isin(sample["input_ids"], torch.tensor([*tokens.vision_ids, tokens.vision_end]))
    last_vision = int(torch.nonzero(vision).max()) if bool(vision.any()) else -1
    if last_vision >= max_length:
        raise BadSample("over_budget", f"{length} tokens > --seq-length {max_length} and the cut would split an image")
    cut = {k: sample[k][:max_length] for k in ("input_ids", "labels", "loss_mask")}
    if not bool(cut["loss_mask"].any()):
        raise BadSample("over_budget", f"{length} tokens > --seq-length {max_length} and no answer token fits")
    return {**sample, **cut}
