"""Preference pairs for DPO (``--train-mode dpo``): a JSONL record is a prompt conversation in any
format ``conversations.py`` reads (images and videos included) with two answers to it:

    {"messages": [{"role": "user", "content": "<image>What is the total?"}], "images": ["r.png"],
     "chosen": "$12.50", "rejected": "$15.00"}

Each record gives two contract samples, the prompt with the chosen answer and with the rejected one,
each trained (counted) on its answer only; the pair reaches the collate whole (``PairDataset``) and
is packed chosen first, the two side by side, so the loss reads pair ``k`` as samples ``2k`` and
``2k+1`` of the row (``post_training/dpo.py``). A record that is not a pair is a skip naming what
is wrong with it, as any bad record is."""

from __future__ import annotations

import functools
import os
from typing import Any

from .conversations import Turn
from .jsonl_source import parse_record
from .sample import BadSample
from .skipping import SkippingDataset

ANSWERS = ("chosen", "rejected")


def preference_answers(record) -> dict[str, str]:
    """The record's chosen and rejected answers; ``BadSample`` where they are not two different texts."""
    if not isinstance(record, dict):
        raise BadSample("bad_record", f"a record must be a JSON object, got {type(record).__name__}")
    answers = {}
    for key in ANSWERS:
        value = record.get(key)
        if not isinstance(value, str) or not value.strip():
            raise BadSample("not_a_pair", f"{key!r} must be a non-empty string (a preference record has both answers)")
        answers[key] = value
    if answers["chosen"] == answers["rejected"]:
        raise BadSample("not_a_pair", "'chosen' and 'rejected' are the same text: nothing to prefer")
    return answers


class PreferencePairs:
    """``produce(index)`` for ``PairDataset``: row ``index`` of ``conversations``' records as
    (chosen sample, rejected sample), each made as ``conversations`` makes any conversation's."""

    def __init__(self, conversations):  # a jsonl.JsonlConversations (which imports this module)
        self.conversations = conversations

    def __call__(self, index: int) -> tuple[dict, dict]:
        c = self.conversations
        records, i = c.rows[index]
        path, line = records.where(i)
        text = records.read(i)

        def sample(which: str) -> dict:
            turns = functools.partial(self.pair_turns, text, which)
            return c.turns_sample(turns, os.path.dirname(path), f"{path}:{line}", last_only=True)

        return sample("chosen"), sample("rejected")

    def pair_turns(self, line, which: str) -> list[Turn]:
        """The prompt's turns followed by the ``which`` answer as the assistant's turn."""
        record = parse_record(line)
        answer = preference_answers(record)[which]
        turns = self.conversations._turns({k: v for k, v in record.items() if k not in ANSWERS}, answered=False)
        if turns[-1].role == "assistant":
            raise BadSample(
                "answer_in_prompt", "the prompt ends with an assistant turn; the answers are 'chosen' and 'rejected'"
            )
        return [*turns, Turn("assistant", (answer,))]


class PairDataset(SkippingDataset):
    """A ``SkippingDataset`` whose items are pairs: each sample of a pair checked, a pair skipped whole."""

    def _checked(self, sample: Any) -> Any:
        return tuple(super(PairDataset, self)._checked(one) for one in sample)
