"""Prompts with reference answers for GRPO (``--train-mode grpo``): a JSONL record is a conversation in
any format ``conversations.py`` reads (images and videos included) whose last assistant turn is the
reference answer the rewards score the sampled answers against:

    {"messages": [{"role": "user", "content": "<image>What is the total?"}, {"role": "assistant",
     "content": "$12.50"}], "images": ["r.png"]}

Each record gives the prompt as generation reads it (``JsonlConversations.prompt_sample``: every turn
before the answer, rendered with the generation prompt training's answers follow) and the reference
text. A micro-batch is a ``PromptBatch``: the answers are drawn in the training step, on the training
ranks, so nothing here is packed yet (``post_training/rollout.py`` packs prompt and answer)."""

from __future__ import annotations

import os

from .batch import PromptBatch  # noqa: F401 - the micro-batch of these items, named here too
from .errors import BadSample, DataError
from .skipping import SkippingDataset


class ReferencedPrompts:
    """``produce(index)`` for ``PromptDataset``: row ``index`` of ``conversations``' records as
    {"prompt": the prompt's input_ids and media, "reference": the reference answer's text}."""

    def __init__(self, conversations):  # a jsonl.JsonlConversations (which imports this module)
        self.conversations = conversations
        self.processor, self.info = conversations.processor, conversations.info  # as generation reads them

    def __call__(self, index: int) -> dict:
        c = self.conversations
        records, i = c.rows[index]
        path, line = records.where(i)
        try:
            prompt, reference = c.prompt_sample(records.read(i), os.path.dirname(path), f"{path}:{line}")
        except DataError as bad:
            if c.strict:
                raise DataError(f"{c.source}: {bad} (--strict-data stops at the first bad record)") from None
            raise BadSample("bad_record", str(bad)) from None
        if reference is None or not reference.strip():
            raise BadSample(
                "no_reference", f"{path}:{line}: the conversation must end with the assistant's reference answer"
            )
        return {"prompt": prompt, "reference": reference}

    def prompt(self, index: int) -> tuple[dict, str | None]:  # evaluation by generation reads the same records
        return self.conversations.prompt(index)


class PromptDataset(SkippingDataset):
    """A ``SkippingDataset`` of prompts: each item is {"prompt", "reference", "index"}, ``index`` the
    item's own (the answers' sampling seeds are drawn from it: the same answers after a resume). A prompt
    that leaves no room for an answer within ``--seq-length`` is a skip."""

    def __getitem__(self, index: int) -> dict:
        return {**super().__getitem__(index), "index": index}

    def _checked(self, sample: dict) -> dict:
        length = sample["prompt"]["input_ids"].numel()
        if length >= self.max_length:
            raise BadSample(
                "too_long", f"the prompt's {length} tokens leave no room for an answer in {self.max_length}"
            )
        return sample
