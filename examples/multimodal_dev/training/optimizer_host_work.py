"""The optimizer step without a per-parameter loop on the host, where megatron-core has neither Apex
nor Transformer Engine (rows of ``megatron_changes/table.py``, group ``optimizer-host-work``).

megatron's fallbacks for Apex's multi-tensor kernels walk the parameters one at a time:
``local_multi_tensor_l2_norm`` takes one norm per gradient and builds a tensor from the list of
them, which on a GPU reads every norm back to the host (one sync per parameter: ~2,400 a step at the
35b_a3b cut before grouped experts); ``local_multi_tensor_scale`` copies and scales one tensor at a
time. torch's ``_foreach_*`` ops do each list in one call (a few fused kernels on a GPU, the same
per-tensor kernels on a CPU), with the same arithmetic.

torch's AdamW picks its multi-tensor (foreach) path by itself only when every parameter is on a GPU;
on a CPU host it loops in Python. Asking for foreach everywhere gives CPU hosts the path GPU hosts
run (the same updates: on a CPU the foreach ops run the per-tensor kernels), so the host work counted
on CPU (``benchmarks/bench_step_ops.py``) is the GPU's. It is asked before every step, since loading
a checkpoint restores the parameter groups' saved settings.
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


def _foreach_before_step(optimizer, _args, _kwargs):
    for group in optimizer.param_groups:
        if "foreach" in group and not group.get("fused"):
            group["foreach"] = True


def foreach_adam(original, run=None):
    """megatron's optimizer builder, with torch's Adam / AdamW set to its foreach path before each step."""

    def build(*args, **kwargs):
        result = original(*args, **kwargs)
        inner = result[0] if isinstance(result, tuple) else getattr(result, "optimizer", result)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            inner.register_step_pre_hook(_foreach_before_step)
        return result

    return build
