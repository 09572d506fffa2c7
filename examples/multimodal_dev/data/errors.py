"""The data layer's two errors, in a module that imports nothing: budgets and plans that the
launcher and the planner read (``patch_budget.py``, ``token_budget.py``) raise them without torch."""

from __future__ import annotations


class BadSample(Exception):
    """A sample that must be skipped (corrupt image, empty answer, over budget, ...).
    ``reason`` is a short key used for the running skip counts."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class DataError(ValueError):
    """The user's data cannot be trained on at all (a missing or empty train split, wrong
    columns, every row unusable): one line naming the flag and the value, never a traceback."""
