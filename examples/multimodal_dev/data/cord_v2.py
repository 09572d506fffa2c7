"""CORD-V2 receipts as image -> JSON SFT conversations.

Source (``--data-path``): a directory written by ``datasets.save_to_disk``, a directory or
glob of parquet files (the hub layout ``data/{split}-*.parquet``), or ``hf://naver-clova-ix/cord-v2``
(the Hub, or its cache: only with the ``hf://`` prefix, see ``sources.py``). A split comes only
from its own files: a source without a validation or test split (or with an empty one) gives no
data and no iterator for it, never the train rows again. Columns: ``image`` and
``ground_truth`` (a JSON string whose ``gt_parse`` is the answer).

Each sample: user turn = image + instruction, assistant turn = ``json.dumps(gt_parse)``, rendered
by the processor's chat template as a finished conversation and trained on the answer's tokens and
its end-of-turn token, found through the template (``answer_spans.py``), as for the user's own JSONL
conversations. So a receipt is trained in the format a generation prompt asks for
(``answer_spans.generation_prompt``): with Qwen3.5's template, after an empty think block, never
inside an open one.
"""

from __future__ import annotations

import contextlib
import io
import json

import torch

from . import sources
from .answer_spans import answer_char_spans, encoded_sample, generation_prompt, trained_sample
from .conversations import Media, Turn
from .patch_budget import PatchBudget
from .processor import load_processor
from .sample import BadSample, DataError
from .skipping import SkippingDataset

INSTRUCTION = "Extract the receipt's contents as JSON."
SPLITS = sources.SPLIT_NAMES
COLUMNS = ("image", "ground_truth")


def load_split(data_path: str, split: str):
    """The ``split`` of CORD-V2 as a ``datasets.Dataset`` with undecoded images; None for a
    validation or test split the source does not have (never another split's rows)."""
    import datasets

    ds = sources.load_split(data_path, split, "--data-path")
    if ds is None:
        return None
    if set(COLUMNS) - set(ds.column_names):
        raise DataError(
            f"--data-path {data_path!r} ({split}): expected columns {list(COLUMNS)}, found {ds.column_names}"
        )
    # Decode images ourselves so one corrupt file is a skipped sample, not a crashed run.
    return ds.cast_column("image", datasets.Image(decode=False))


def _open_image(cell):
    from PIL import Image

    try:
        if cell.get("bytes"):
            image = Image.open(io.BytesIO(cell["bytes"]))
        elif cell.get("path"):
            image = Image.open(cell["path"])
        else:
            raise BadSample("bad_image", "the image cell is empty")
        return image.convert("RGB")
    except BadSample:
        raise
    except Exception as err:  # PIL raises many types for truncated / unreadable files
        raise BadSample("bad_image", f"{type(err).__name__}: {err}") from err


def _answer_text(ground_truth) -> str:
    try:
        parse = json.loads(ground_truth).get("gt_parse") if isinstance(ground_truth, str) else None
    except (json.JSONDecodeError, AttributeError) as err:
        raise BadSample("bad_ground_truth", str(err)) from err
    if not _has_content(parse):
        # e.g. {"text": ""}: training on it would teach the model to answer receipts with nothing
        raise BadSample("empty_answer", f"gt_parse holds no value: {json.dumps(parse, ensure_ascii=False)[:80]}")
    return json.dumps(parse, ensure_ascii=False)


def _has_content(value) -> bool:
    """Whether a parse holds any value besides empty strings, lists, dicts and nulls."""
    if isinstance(value, dict):
        return any(_has_content(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_content(v) for v in value)
    if isinstance(value, str):
        return bool(value.strip())
    return value is not None


@contextlib.contextmanager
def _aspect_ratio_is_bad_sample():
    """Qwen's smart_resize (qwen_vl_utils' and transformers') refuses an image whose aspect
    ratio is over 200 with a ValueError; that image is a skipped sample, not a crashed run."""
    try:
        yield
    except ValueError as err:
        if "aspect ratio" not in str(err):
            raise
        raise BadSample("aspect_ratio", f"image aspect ratio over 200 ({err})") from err


def _image_size(cell) -> tuple[int, int]:
    """(width, height) from the image's header: nothing is decoded."""
    from PIL import Image

    try:
        source = io.BytesIO(cell["bytes"]) if cell.get("bytes") else cell.get("path")
        if not source:
            raise BadSample("bad_image", "the image cell is empty")
        with Image.open(source) as image:
            return image.size
    except BadSample:
        raise
    except Exception as err:
        raise BadSample("bad_image", f"{type(err).__name__}: {err}") from err


class CordV2Conversations:
    def __init__(self, ds, processor, info, min_pixels=None, max_pixels=None):
        self.ds, self.processor, self.info = ds, processor, info
        self.pixel_budget = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}

    def _messages(self, image) -> list[dict]:
        return [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": image, **self.pixel_budget},
                    {"type": "text", "text": INSTRUCTION},
                ],
            }
        ]

    def _conversation(self, row) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and its answer's characters."""
        turns = [
            Turn("user", (Media("image", "receipt"), INSTRUCTION)),
            Turn("assistant", (_answer_text(row["ground_truth"]),)),
        ]
        return answer_char_spans(self.processor, turns)

    def __call__(self, index: int) -> dict:
        from qwen_vl_utils import process_vision_info

        row = self.ds[index]
        text, spans = self._conversation(row)
        with _aspect_ratio_is_bad_sample():
            images, _ = process_vision_info(
                self._messages(_open_image(row["image"])), image_patch_size=self.info.patch_size
            )
            return encoded_sample(self.processor, self.info, text, spans, images=images)

    def prompt(self, index: int) -> tuple[dict, str]:
        """Receipt ``index`` as generation reads it: (the processor's encoding of the user turn with the
        generation prompt training's answers follow, the ground truth's JSON: the reference)."""
        from qwen_vl_utils import process_vision_info

        row = self.ds[index]
        text = generation_prompt(self.processor, [Turn("user", (Media("image", "receipt"), INSTRUCTION))])
        with _aspect_ratio_is_bad_sample():
            images, _ = process_vision_info(
                self._messages(_open_image(row["image"])), image_patch_size=self.info.patch_size
            )
            enc = self.processor(text=[text], images=images, return_tensors="pt")
        sample = {"input_ids": enc["input_ids"][0], "pixel_values": enc["pixel_values"]}
        return {**sample, "image_grid_thw": enc["image_grid_thw"]}, _answer_text(row["ground_truth"])

    def describe(self, index: int) -> dict:
        """Sample ``index`` with its real token ids and grid but zero-stride pixels, from the
        image's header: the two resizes (qwen_vl_utils', then the image processor's) are computed,
        not performed. Token-budget packing plans with it; a test holds it to ``self(index)``."""
        row = self.ds[index]
        text, spans = self._conversation(row)
        width, height = _image_size(row["image"])
        with _aspect_ratio_is_bad_sample():
            grid = torch.tensor([self._grid(height, width)])
        image_text = [self.processor.replace_image_token({"image_grid_thw": grid}, 0)]
        expanded, replacements = self.processor.get_text_with_replacements([text], image_text, [])
        enc = self.processor.tokenizer(expanded, return_offsets_mapping=True, return_tensors="pt")
        pixels = torch.zeros(1, self.info.patch_dim).expand(int(grid.prod()), self.info.patch_dim)
        return trained_sample(
            self.info, enc["input_ids"][0], enc["offset_mapping"][0], replacements[0], spans, pixels, grid
        )

    def _grid(self, height: int, width: int) -> tuple[int, int, int]:
        from qwen_vl_utils import vision_process as qvu
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        factor = self.info.patch_size * qvu.SPATIAL_MERGE_SIZE
        height, width = qvu.smart_resize(
            height,
            width,
            factor=factor,
            min_pixels=self.pixel_budget.get("min_pixels", qvu.IMAGE_MIN_TOKEN_NUM * factor**2),
            max_pixels=self.pixel_budget.get("max_pixels", qvu.IMAGE_MAX_TOKEN_NUM * factor**2),
        )
        image_processor = self.processor.image_processor
        height, width = smart_resize(
            height,
            width,
            factor=image_processor.patch_size * image_processor.merge_size,
            min_pixels=image_processor.size["shortest_edge"],
            max_pixels=image_processor.size["longest_edge"],
        )
        return (1, height // image_processor.patch_size, width // image_processor.patch_size)


def build_datasets(
    seq_length: int,
    num_samples: tuple[int, int, int],
    data_path: str | None = None,
    hf_processor_path: str | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    **options,
):
    """(train, valid, test) over the CORD-V2 splits, each repeated to the requested size. ``options``: the
    vision patch budgets (``patch_budget.FLAGS``' names); the other data options do not apply here."""
    patch_budget = PatchBudget.from_options(options)
    if not data_path:
        raise ValueError(
            "--data-path is required for --dataset-provider cord_v2 (saved dataset, parquet files "
            "or hf://naver-clova-ix/cord-v2)"
        )
    processor, info = load_processor(hf_processor_path, min_pixels, max_pixels)
    out = []
    for split, n in zip(SPLITS, num_samples):
        if n == 0:
            out.append(None)
            continue
        ds = load_split(data_path, split)
        if ds is None:
            out.append(None)
            continue
        produce = CordV2Conversations(ds, processor, info, min_pixels, max_pixels)
        out.append(
            SkippingDataset(
                produce,
                len(ds),
                n,
                info.tokens,
                seq_length,
                info.patch_dim,
                name=f"cord_v2[{split}]",
                source=f"--data-path {data_path!r}",
                patch_budget=patch_budget,
            )
        )
    return tuple(out)
