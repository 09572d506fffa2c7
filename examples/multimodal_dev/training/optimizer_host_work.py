"""The optimizer step without a per-parameter loop on the host, where megatron-core has neither Apex
nor Transformer Engine (rows of ``megatron_changes/table.py``, group ``optimizer-host-work``).

megatron's fallbacks for Apex's multi-tensor kernels walk the parameters one at a time:
``local_multi_tensor_l2_norm`` takes one norm per gradient and builds a tensor from the list of
them, which on a GPU reads every norm back to the host (one sync per parameter: ~2,400 a step at the
35b_a3b cut before grouped experts); ``local_multi_tensor_scale`` copies and scales one tensor at a
time. torch's ``_foreach_*`` ops do each list in one call (a few fused kernels on a GPU, the same
per-tensor kernels on a CPU), with the same arithmetic.

torch's AdamW runs its fused kernel here, on every host: one pass over each parameter's weight,
gradient and two moments. Left to itself it picks its foreach path on a GPU (eight list ops, each a
pass over memory: ~2.9x the traffic of the fused pass, ~60 ms a step on an H200 for the 35b_a3b cut's
4.8 B parameters, by bandwidth) and reads every parameter's step count on the host to form the bias
corrections, and on a CPU host it loops in Python. The fused kernel keeps the step counts on the
parameters' device (a checkpoint load leaves them on the host; they are moved before the step). Its
updates differ from the foreach path's by an ulp (the same formula, evaluated in one kernel). It is
asked before every step, since loading a checkpoint restores the parameter groups' saved settings.
"""

from __future__ import annotations

import torch


def foreach_l2_norm(original, run=None):
    """``l2_norm_impl(chunk_size, noop_flag, [tensors], per_tensor)`` -> (norm [1], None): one
    ``_foreach_norm`` and one reduction, the result left on the device."""

    def l2_norm(_chunk_size, _noop_flag, tensor_lists, _per_tensor=False, *_args):
        tensors = tensor_lists[0]
        if not tensors:
            return torch.zeros(1, dtype=torch.float32, device=torch.cuda.current_device()), None
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None

    return l2_norm


def foreach_scale(original, run=None):
    """``multi_tensor_scale(chunk_size, noop_flag, [sources, destinations], scale)``: destination =
    source * scale, for the whole lists at once (a copy with dtype conversion when scale is 1)."""

    def scale_lists(_chunk_size, _noop_flag, tensor_lists, scale):
        sources, destinations = tensor_lists
        if not sources:
            return
        if all(s is d for s, d in zip(sources, destinations)):
            torch._foreach_mul_(destinations, scale)
        elif scale == 1.0:
            torch._foreach_copy_(destinations, sources)
        else:
            torch._foreach_copy_(destinations, torch._foreach_mul(sources, scale))

    return scale_lists


def fused_adam(original, run=None):
    """megatron's optimizer builder, with torch's Adam / AdamW set to its fused path before each step."""

    def build(*args, **kwargs):
        result = original(*args, **kwargs)
        inner = result[0] if isinstance(result, tuple) else getattr(result, "optimizer", result)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            inner.register_step_pre_hook(_fused_before_step)
        return result

    return build


def _fused_before_step(optimizer, _args, _kwargs):
    for group in optimizer.param_groups:
        if "fused" not in group:
            continue
        group["foreach"], group["fused"] = False, True
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None and step.device != param.device:  # as a checkpoint load left it
                optimizer.state[param]["step"] = step.to(param.device, torch.float32)
