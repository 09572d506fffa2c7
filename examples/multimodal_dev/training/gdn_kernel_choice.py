"""Which Gated DeltaNet kernels a GPU run trains with: flash-linear-attention's where they are right
on this host, megatron.cpu's torch kernels where they are not, said in one line.

FLA's gated chunk rule is in doubt on Hopper with the Triton torch <= 2.11 pins (FLA #640): there the
run asks the kernel itself at the model's head dims (``megatron.cpu.fla_gated_check``) and keeps it
where its output and six gradients agree with the torch kernel's."""

from __future__ import annotations

import megatron.cpu
from megatron.cpu import fla_gated_check

from ..checkpoint.run_shape import resolve_shape
from ..console import say


def choose_gdn_kernels(args) -> None:
    """Bind the torch kernels FLA cannot be trusted with on this GPU (before the model is built:
    GatedDeltaNet keeps its kernels from construction)."""
    reason = megatron.cpu.fla_unusable_reason()
    if reason is None:
        return
    names = megatron.cpu.torch_gdn_kernel_names()
    if names == ("chunk_gated_delta_rule",):  # FLA imports; only its gated rule's backward is in doubt
        text = resolve_shape(args).text
        dims = f"K={text.linear_key_head_dim} V={text.linear_value_head_dim}"
        agrees, why = fla_gated_check.fla_gated_rule_agrees(text.linear_key_head_dim, text.linear_value_head_dim)
        if agrees:
            fla_gated_check.lift_guard()
            say(
                f"Gated DeltaNet runs flash-linear-attention's kernels: its gated chunk rule, checked on this GPU "
                f"at {dims} against the torch kernel, agrees ({why}), although {reason}"
            )
            return
        reason = f"{reason}; checked on this GPU at {dims}: {why}"
    rest = sorted(set(megatron.cpu.GDN_KERNELS) - set(names))
    say(
        f"Gated DeltaNet runs {', '.join(names)} on the torch kernels of megatron.cpu (correct, slower)"
        + (f" and {', '.join(rest)} on flash-linear-attention's" if rest else ", not flash-linear-attention's")
        + f": {reason}"
    )
    megatron.cpu.register_torch_gdn_kernels(names)
