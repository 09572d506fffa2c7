"""Vision patch budgets: what the vision tower is given at once, bounded before it runs out of memory.

    --max-vision-patches-per-image N        patches of one image
    --max-vision-patches-per-video N        patches of one video (all its frames)
    --max-vision-patches-per-micro-batch N  patches of every image and video of one micro-batch

A patch is one row the tower reads: t*h*w of a ``*_grid_thw`` row, counted before the 2x2 spatial
merge (the merge comes after the tower's blocks, so its activations grow with these rows, not with
the merged tokens). 0 is no budget, the default, and then nothing here changes a sample or a row.

A conversation with an image or a video over its budget, or whose patches together exceed the
micro-batch's, can never be trained without breaking the budget: it is a skip named by reason
(``image_over_patch_budget``, ``video_over_patch_budget``, ``over_micro_batch_patch_budget``) whose
message gives the count, the flag and its value, through the providers' skip machinery
(``SkippingDataset``, the jsonl provider's per-record skips that energon shares), so every provider
has it and ``--strict-data`` turns it into a stop. Packing keeps the rest under the micro-batch
budget: token-budget rows (``token_budget.py``, energon's ``pack_rows``) close before a
conversation that would take a row past it. Under ``--packing samples`` a micro-batch is
``--micro-batch-size`` conversations whatever their patches, so the micro-batch budget is refused
there unless a micro-batch is one conversation (``check_patch_budget_args``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import BadSample, DataError

# the flags' argparse dests (arguments.PATCH_BUDGET_OPTIONS) -> the flags
FLAGS = {
    "max_vision_patches_per_image": "--max-vision-patches-per-image",
    "max_vision_patches_per_video": "--max-vision-patches-per-video",
    "max_vision_patches_per_micro_batch": "--max-vision-patches-per-micro-batch",
}


def patches(grids) -> int:
    """The tower's input rows of ``grids`` [(t, h, w), ...]."""
    return sum(int(t) * int(h) * int(w) for t, h, w in grids)


@dataclass(frozen=True)
class PatchBudget:
    """The three budgets; 0: none."""

    per_image: int = 0
    per_video: int = 0
    per_micro_batch: int = 0

    @classmethod
    def from_options(cls, options: dict) -> PatchBudget:
        """From a provider's keyword arguments, the flags' dests (absent or None: no budget)."""
        values = [int(options.get(name) or 0) for name in FLAGS]
        for flag, value in zip(FLAGS.values(), values):
            if value < 0:
                raise DataError(f"{flag} {value}: must be 0 (no budget) or a positive patch count")
        return cls(*values)

    def __bool__(self) -> bool:
        return bool(self.per_image or self.per_video or self.per_micro_batch)

    def check(self, image_grids, video_grids, total: bool = True) -> None:
        """``BadSample`` naming the first budget a conversation of these grids breaks. ``total=False``
        leaves the micro-batch budget to a later call, for a caller that has not seen every item yet."""
        for kind, grids, budget, flag in (
            ("image", image_grids, self.per_image, FLAGS["max_vision_patches_per_image"]),
            ("video", video_grids, self.per_video, FLAGS["max_vision_patches_per_video"]),
        ):
            for j, grid in enumerate(grids if budget else ()):
                n = patches([grid])
                if n > budget:
                    raise BadSample(
                        f"{kind}_over_patch_budget",
                        f"{kind} {j + 1} of {len(grids)} is {n} patches ({'x'.join(map(str, grid))} t*h*w) "
                        f"> {flag} {budget}",
                    )
        n = patches(image_grids) + patches(video_grids)
        if total and self.per_micro_batch and n > self.per_micro_batch:
            raise BadSample(
                "over_micro_batch_patch_budget",
                f"its images and videos are {n} patches > {FLAGS['max_vision_patches_per_micro_batch']} "
                f"{self.per_micro_batch}, so no micro-batch can hold it",
            )

    def check_sample(self, sample: dict) -> dict:
        """``sample`` (contract fields), or the ``BadSample`` of the first budget it breaks."""
        if self:
            self.check(sample["image_grid_thw"].tolist(), sample["video_grid_thw"].tolist())
        return sample


NO_BUDGET = PatchBudget()


def check_patch_budget_args(args) -> None:
    """Refuse, by flag and value, budgets a run could not honour (before launch)."""
    budget = PatchBudget.from_options(vars(args))
    if budget.per_micro_batch and args.packing == "samples" and args.micro_batch_size > 1:
        raise ValueError(
            f"{FLAGS['max_vision_patches_per_micro_batch']} {budget.per_micro_batch} with --micro-batch-size "
            f"{args.micro_batch_size}: under --packing samples a micro-batch is that many conversations "
            "whatever their patches; use --packing tokens (rows close at the budget) or --micro-batch-size 1 "
            "(each conversation is checked against it)"
        )
