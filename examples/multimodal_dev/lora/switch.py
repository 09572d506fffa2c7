"""Every adapter of the process switched off for a while: the model is its base model again.

DPO's reference is the policy's own base (``post_training/dpo.py``): the same forward with the
adapters off, no second copy of the weights. The switch is read by each adapter's forward
(``adapter.LoraLinear``, ``grouped.LoraExpertWeights``); an adapter that is off adds nothing and
does no communication, on every rank alike, since every rank runs the same step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_off = 0  # nesting depth of adapters_off()


def adapters_on() -> bool:
    return _off == 0


@contextmanager
def adapters_off() -> Iterator[None]:
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1
