"""The user's own conversations (``--dataset-provider jsonl``): JSONL files of single- or multi-turn
conversations with images and videos, in any of the formats ``conversations.py`` reads.

    --data-path            a .jsonl file, a folder of them, or a weighted list (``jsonl_source.py``)
    --eval-data-path       validation records; else ``--valid-fraction`` of the training records
                           is held out (none by default); --test-data-path likewise, never implied
    --media-root           the folder relative media paths start from (default: each JSONL's own)
    --allow-remote-media   fetch http(s) media (refused by default)
    --allow-media-anywhere media paths outside the JSONL's folder (or --media-root); refused by default
    --strict-data          stop at the first bad record instead of skipping it

A sample is the whole conversation as the processor's chat template renders it (system turn
included), with every assistant turn trained: its content tokens and its end-of-turn token,
found through the template (``answer_spans.py``). Images are sized as ``jsonl_media.py`` says;
videos are sampled and sized by ``video.py`` (``--video-*`` flags, a part's own keys over them).

Bad records are skips (``SkippingDataset``) whose message starts ``file:line``: a line that is
not JSON, an unknown format or role, placeholders that do not match the media, no assistant
turn, a missing, remote or undecodable image or video, a conversation over ``--seq-length``
that cannot be cut after its last image, an image or video over its vision patch budget or a
conversation over the micro-batch's (``patch_budget.py``: videos, and images read from files, are
counted from their headers before anything is decoded). With ``--strict-data`` the first one is a
one-line ``DataError`` instead.

``describe(index)`` gives the same ids and grids from image headers (and ``video_header``)
without decoding pixels; a test holds it to the sample. An image whose header reads but whose
pixels do not is found only when the sample is made.
"""

from __future__ import annotations

import math
import os

import torch

from .answer_spans import answer_char_spans, encoded_sample, generation_prompt, trained_sample
from .conversations import normalise
from .jsonl_media import (
    REMOTE_SCHEMES,
    ImageSizing,
    MediaAccess,
    VideoOptions,
    image_size,
    media_settings,
    open_image,
)
from .jsonl_source import Blend, Records, check_data_path, hold_out, parse_record
from .patch_budget import NO_BUDGET, PatchBudget
from .preferences import PairDataset, PreferencePairs
from .processor import VISION_TOKEN_TEXT, load_processor
from .prompts import PromptDataset, ReferencedPrompts
from .sample import BadSample, DataError, fit_to_budget
from .skipping import SkippingDataset

SPLITS = ("train", "validation", "test")


class JsonlConversations:
    """``produce(index)`` for ``SkippingDataset``: row ``index`` of a blend of JSONL records."""

    def __init__(
        self,
        rows: Blend,
        processor,
        info,
        sizing: ImageSizing,
        seq_length: int,
        source: str,
        access: MediaAccess = MediaAccess(),
        strict: bool = False,
        videos: VideoOptions | None = None,
        patch_budget: PatchBudget = NO_BUDGET,
    ):
        self.rows, self.processor, self.info, self.sizing = rows, processor, info, sizing
        self.seq_length, self.source, self.access, self.strict = seq_length, source, access, strict
        self.videos = videos or VideoOptions(processor)
        self.patch_budget = patch_budget

    def __call__(self, index: int) -> dict:
        return self._at_record(index, self._produce)

    def describe(self, index: int) -> dict:
        """Sample ``index`` with its real ids and grids but zero-stride pixels: nothing decoded."""
        return self._at_record(index, self._describe)

    def _at_record(self, index: int, make) -> dict:
        records, i = self.rows[index]
        path, line = records.where(i)
        return self.conversation_sample(records.read(i), os.path.dirname(path), f"{path}:{line}", make)

    def conversation_sample(self, line: bytes | str, base_dir: str, where: str, make=None, locate_media=None) -> dict:
        """The sample of one conversation given as JSON text (any format ``conversations.py`` reads):
        relative media paths start from ``base_dir`` (or ``media_root``); ``where`` starts a skip's
        message. ``make``: ``_produce`` (the default) or ``_describe``; ``locate_media``: a ``Media``'s
        location instead of ``self.access``'s (energon: the shard sample's own members). The energon
        provider calls it too, so both providers build a conversation's sample in this one place."""
        return self.turns_sample(lambda: self._turns(line), base_dir, where, make, locate_media)

    def turns_sample(self, turns_of, base_dir: str, where: str, make=None, locate_media=None, last_only=False) -> dict:
        """``conversation_sample`` of the turns ``turns_of()`` reads (its ``BadSample`` is a skip too);
        ``last_only``: only the last assistant turn trained (a preference pair's answer)."""
        make = make or self._produce
        locate_media = locate_media or (lambda media: self.access.locate(media.ref, base_dir))
        try:
            turns = turns_of()
            media = [(m, locate_media(m)) for t in turns for m in t.media]
            text, spans = answer_char_spans(self.processor, turns)
            spans = spans[-1:] if last_only else spans
            sample = fit_to_budget(make(text, spans, media), self.info.tokens, self.seq_length)
            return self.patch_budget.check_sample(sample)  # a cut falls after the last image: the grids stay
        except BadSample as bad:
            detail = bad.detail.replace("\n", " ")
            if self.strict:
                raise DataError(
                    f"{self.source}: {where}: {bad.reason}: {detail} (--strict-data stops at the first bad record)"
                ) from None
            raise BadSample(bad.reason, f"{where}: {detail}") from None

    def _turns(self, line: bytes | str | dict, answered: bool = True):
        turns = normalise(line if isinstance(line, dict) else parse_record(line), answered)
        for turn in turns:
            for token in VISION_TOKEN_TEXT.values():
                if token in turn.text:
                    raise BadSample(
                        "special_token_in_text",
                        f"a {turn.role} turn's text holds {token!r}, which the processor would read as a vision token",
                    )
        return turns

    def prompt(self, index: int) -> tuple[dict, str | None]:
        """Row ``index`` as generation reads it (``prompt_sample``)."""
        records, i = self.rows[index]
        path, line = records.where(i)
        return self.prompt_sample(records.read(i), os.path.dirname(path), f"{path}:{line}")

    def prompt_sample(self, line: bytes | str | dict, base_dir: str, where: str) -> tuple[dict, str | None]:
        """What generation reads of one conversation (a JSONL line, or a record already read: a
        server's request, under the server's own size limit): (the processor's encoding of every turn before its
        last assistant turn, rendered with the generation prompt training's answers follow
        (``answer_spans.generation_prompt``), with their media; that last assistant turn's text, the
        reference answer, or None where the conversation ends with another turn)."""
        try:
            turns = self._turns(line, answered=False)
            reference = None
            if turns and turns[-1].role == "assistant":
                reference, turns = turns[-1].text, turns[:-1]
            if not turns:
                raise BadSample("no_prompt", "the conversation has no turn before its answer")
            media = [(m, self.access.locate(m.ref, base_dir)) for t in turns for m in t.media]
            enc = self.processor(
                text=[generation_prompt(self.processor, turns)], **self._media_inputs(media), return_tensors="pt"
            )
        except BadSample as bad:
            raise DataError(f"{where}: {bad.reason}: {bad.detail}") from None
        prompt = {
            key: enc.get(key) for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        }
        return {"input_ids": enc["input_ids"][0], **prompt}, reference

    def _media_inputs(self, media) -> dict:
        """The processor's keyword arguments for ``media`` [(Media, location)]: images resized, videos
        decoded, as training reads them."""
        opened = [(m, *self.videos.opened(m, location)) for m, location in media if m.kind == "video"]
        self._videos_fit([header for _, _, header in opened])
        self._patches_fit(media, [header for _, _, header in opened])
        images = [
            self.sizing.resize(open_image(location), m.options, location) for m, location in media if m.kind == "image"
        ]
        videos = [self.videos.load(m, source, header) for m, source, header in opened]
        inputs = {"images": images or None}
        if videos:
            frames, metadata = zip(*videos)
            inputs.update(videos=list(frames), video_metadata=list(metadata), videos_kwargs=self.videos.call_kwargs)
        return inputs

    def _produce(self, text: str, spans, media) -> dict:
        return encoded_sample(self.processor, self.info, text, spans, **self._media_inputs(media))

    def _videos_fit(self, headers) -> None:
        """``over_budget`` when the videos alone, counted from their headers, exceed ``--seq-length``:
        a long video is not decoded (1.36 GB over 90 s) only to be skipped afterwards."""
        merge = self.processor.video_processor.merge_size**2
        tokens = sum(math.prod(header.grid_thw) // merge for header in headers)
        if tokens > self.seq_length:
            raise BadSample("over_budget", f"its videos alone are {tokens} tokens > --seq-length {self.seq_length}")

    def _patches_fit(self, media, headers) -> None:
        """The patch budgets from the media's headers, before anything is decoded. A URL's image is left
        to the check of the made sample: reading its header here would fetch it twice."""
        if not self.patch_budget:
            return
        remote = any(m.kind == "image" and location.startswith(REMOTE_SCHEMES) for m, location in media)
        images = [] if remote else [self._image_grid(m, location) for m, location in media if m.kind == "image"]
        self.patch_budget.check(images, [header.grid_thw for header in headers], total=not remote)

    def _image_grid(self, media, location) -> tuple[int, int, int]:
        return self.sizing.grid(*image_size(location), media.options)

    def _describe(self, text: str, spans, media) -> dict:
        grids = _grid_tensor([self._image_grid(m, location) for m, location in media if m.kind == "image"])
        headers = [self.videos.header(m, location) for m, location in media if m.kind == "video"]
        video_grids = _grid_tensor([h.grid_thw for h in headers])
        image_text = [self.processor.replace_image_token({"image_grid_thw": grids}, j) for j in range(len(grids))]
        video_inputs = {"video_grid_thw": video_grids, "video_metadata": [h.metadata for h in headers]}
        video_text = [self.processor.replace_video_token(video_inputs, j) for j in range(len(headers))]
        expanded, replacements = self.processor.get_text_with_replacements([text], image_text, video_text)
        enc = self.processor.tokenizer(expanded, return_offsets_mapping=True, return_tensors="pt")
        return trained_sample(
            self.info,
            enc["input_ids"][0],
            enc["offset_mapping"][0],
            replacements[0],
            spans,
            self._no_pixels(grids),
            grids,
            self._no_pixels(video_grids) if headers else None,
            video_grids if headers else None,
        )

    def _no_pixels(self, grids: torch.Tensor) -> torch.Tensor:
        """Zero-stride pixels of the right shape: planning reads shapes only."""
        return torch.zeros(1, self.info.patch_dim).expand(int(grids.prod(-1).sum()), self.info.patch_dim)


def _grid_tensor(grids) -> torch.Tensor:
    return torch.tensor(grids, dtype=torch.long).reshape(-1, 3)


def prompt_reader(
    hf_processor_path: str,
    max_prompt_tokens: int,
    media_root: str | None = None,
    allow_remote_media: bool = False,
    allow_media_anywhere: bool = False,
) -> JsonlConversations:
    """A reader of conversations as generation prompts (``JsonlConversations.prompt_sample``), with
    media read and sized as training reads them; a video longer than ``max_prompt_tokens`` is refused
    before it is decoded."""
    if media_root and not os.path.isdir(media_root):
        raise DataError(f"--media-root {media_root!r}: no such directory")
    processor, info = load_processor(hf_processor_path)
    sizing, videos = media_settings(processor, info, None, None, {})
    access = MediaAccess(media_root, allow_remote_media, allow_media_anywhere)
    return JsonlConversations(None, processor, info, sizing, max_prompt_tokens, "prompts", access, True, videos)


def load_rows(value: str, flag: str) -> tuple[list[Records], list[float] | None]:
    specs = check_data_path(value, flag)
    parts = [Records.of(spec.files) for spec in specs]
    weights = [spec.weight for spec in specs] if specs[0].weight is not None else None
    return parts, weights


def build_datasets(
    seq_length: int,
    num_samples: tuple[int, int, int],
    data_path: str | None = None,
    hf_processor_path: str | None = None,
    valid_data_path: str | None = None,
    test_data_path: str | None = None,
    valid_fraction: float = 0.0,
    media_root: str | None = None,
    allow_remote_media: bool = False,
    allow_media_anywhere: bool = False,
    strict_data: bool = False,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    seed: int | None = None,
    no_shuffle: bool = False,
    preference_pairs: bool = False,
    referenced_prompts: bool = False,
    **options,
):
    """(train, valid, test) ``SkippingDataset``s over the JSONL records; None for a split with no
    records or no samples asked for. ``video_*``: ``VideoSettings`` fields (None: its default);
    a video part's own keys override them. ``max_vision_patches_*``: the patch budgets
    (``patch_budget.py``). The training records are shuffled by ``seed`` (``jsonl_source.Blend``)
    unless ``no_shuffle`` or no seed is given; validation and test keep file order.
    ``preference_pairs``: each record a DPO pair (``preferences.py``), each item (chosen, rejected);
    ``referenced_prompts``: each record a GRPO prompt and its reference answer (``prompts.py``)."""
    shuffle = None if no_shuffle else seed
    parts, weights = load_rows(data_path, "--data-path")
    valid_fraction = valid_fraction or 0.0  # None: a flag left unset
    _check_split_flags(valid_fraction, valid_data_path, media_root)
    processor, info = load_processor(hf_processor_path, min_pixels, max_pixels)
    sources = _data_path_sources(parts, weights, shuffle, data_path, valid_fraction)
    sources.update(_eval_and_test_sources(valid_data_path, test_data_path))
    _check_records_to_train_on(sources["train"][0], data_path, valid_fraction)
    sizing, videos = media_settings(processor, info, min_pixels, max_pixels, options)
    patch_budget = PatchBudget.from_options(options)
    dataset = PairDataset if preference_pairs else PromptDataset if referenced_prompts else SkippingDataset
    out = []
    for split, n in zip(SPLITS, num_samples):
        rows, source = sources.get(split, (None, None))
        if not n or rows is None or len(rows) == 0:
            out.append(None)
            continue
        access = MediaAccess(media_root, allow_remote_media, allow_media_anywhere)
        produce = JsonlConversations(
            rows, processor, info, sizing, seq_length, source, access, strict_data, videos, patch_budget
        )
        if preference_pairs:
            produce = PreferencePairs(produce)
        elif referenced_prompts:
            produce = ReferencedPrompts(produce)
        out.append(_split_dataset(split, n, produce, len(rows), info, seq_length, source, patch_budget, dataset))
    return tuple(out)


def _check_split_flags(valid_fraction: float, valid_data_path: str | None, media_root: str | None) -> None:
    """The flag checks that need no records read: before the processor is loaded."""
    if not 0 <= valid_fraction < 1:
        raise DataError(f"--valid-fraction {valid_fraction}: must be at least 0 and below 1")
    if valid_data_path and valid_fraction:
        raise DataError(f"--eval-data-path {valid_data_path!r} and --valid-fraction {valid_fraction}: give one")
    if media_root and not os.path.isdir(media_root):
        raise DataError(f"--media-root {media_root!r}: no such directory")


def _data_path_sources(
    parts: list[Records], weights: list[float] | None, shuffle: int | None, data_path: str, valid_fraction: float
) -> dict[str, tuple[Blend, str]]:
    """The train split of --data-path's records, less the validation split ``valid_fraction`` holds out of them."""
    sources = {"train": (Blend(parts, weights, shuffle), f"--data-path {data_path!r}")}
    if valid_fraction:
        held = [hold_out(len(p), valid_fraction) for p in parts]
        if not any(h.any() for h in held):
            raise DataError(
                f"--valid-fraction {valid_fraction} of the {sum(map(len, parts))} records of --data-path "
                f"{data_path!r} holds out none; raise it or give --eval-data-path"
            )
        sources["validation"] = (Blend([p.select(h) for p, h in zip(parts, held)]), f"--data-path {data_path!r}")
        train = Blend([p.select(~h) for p, h in zip(parts, held)], weights, shuffle)
        sources["train"] = (train, f"--data-path {data_path!r}")
    return sources


def _eval_and_test_sources(valid_data_path: str | None, test_data_path: str | None) -> dict[str, tuple[Blend, str]]:
    """The validation and test splits given by their own flags, in file order."""
    sources = {}
    for split, flag, value in (
        ("validation", "--eval-data-path", valid_data_path),
        ("test", "--test-data-path", test_data_path),
    ):
        if value:
            sources[split] = (Blend(*load_rows(value, flag)), f"{flag} {value!r}")
    return sources


def _check_records_to_train_on(train: Blend, data_path: str, valid_fraction: float) -> None:
    if len(train) == 0:
        raise DataError(
            f"--data-path {data_path!r}: no records to train on (every line is blank"
            f"{' or held out' if valid_fraction else ''})"
        )


def _split_dataset(
    split: str,
    n: int,
    produce,
    size: int,
    info,
    seq_length: int,
    source: str,
    patch_budget,
    dataset=SkippingDataset,
) -> SkippingDataset:
    """The ``SkippingDataset`` (or ``dataset``, one of its kind) drawing ``n`` samples of one split from its
    ``size`` records."""
    return dataset(
        produce,
        size,
        n,
        info.tokens,
        seq_length,
        info.patch_dim,
        name=f"jsonl[{split}]",
        source=source,
        patch_budget=patch_budget,
    )
