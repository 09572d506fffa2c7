"""The reference's forward beside the policy's, on every pipeline stage, inside one schedule.

The reference is the policy's base with the adapters off (``lora/switch.py``). Each stage runs a
micro-batch twice: the reference first, without a graph, then the policy. Under pipeline
parallelism the two travel together: a stage that is not the last sends ``[policy; reference]``
joined along the sequence, and the next stage runs each pass on its half. The schedule needs
nothing of its own for this: shapes already vary per micro-batch under packing
(``variable_seq_lengths``), and the reference half carries no graph, so the backward reaches the
policy half alone (the gradient handed back for the reference half is zero).

Both halves have this rank's length: the two passes run the same batch, so whatever splits the
sequence (context and sequence parallelism) splits both alike. The cost is twice the activations
sent between stages.

With the tower on ranks of its own (``VISION_NPROC``) its features arrive once a micro-batch and
serve both passes: the checks refuse adapters in the tower there, so its features are the same with
the adapters on and off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..lora.switch import adapters_off


def _stage_input(model) -> tuple[torch.Tensor | None, Callable[[torch.Tensor], None]]:
    """(what the schedule handed this stage, None on the first; the stage's ``set_input_tensor``)."""
    from megatron.core.utils import get_attr_wrapped_model

    decoder = get_attr_wrapped_model(model, "language_model").decoder
    return decoder.input_tensor, get_attr_wrapped_model(model, "set_input_tensor")


def policy_and_reference(model, run: Callable[[], Any], with_reference: bool = True) -> tuple[Any, Any]:
    """(``run()`` with the adapters on, ``run()`` with them off and no graph, or None without
    ``with_reference``), each reading its half of the stage's input."""
    from megatron.core.utils import get_attr_wrapped_model

    arrived, set_input = _stage_input(model)
    received = get_attr_wrapped_model(model, "received")  # the tower's features, from ranks of its own
    features = None if received is None else received.pending
    halves = (None, None) if arrived is None or not with_reference else arrived.chunk(2, dim=0)
    reference = None
    if with_reference:
        if halves[1] is not None:
            set_input(halves[1])
        with torch.no_grad(), adapters_off():
            reference = run()
        if received is not None:  # the reference's pass took them; the policy's merges them again
            received.pending = features
    if halves[0] is not None:
        set_input(halves[0])
    return run(), reference


def stage_output(policy: torch.Tensor, reference: torch.Tensor | None, multi_module: bool = False):
    """What a stage that is not the last sends on: both passes' activations, the policy's first (in
    megatron's multi-module dict where the tower has ranks of its own)."""
    output = policy if reference is None else torch.cat([policy, reference], dim=0)
    return {"language": output} if multi_module else output
