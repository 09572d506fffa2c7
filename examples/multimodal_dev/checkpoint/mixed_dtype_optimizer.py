"""Both optimizers' checkpoints of a bf16 model that also has fp32 parameters.

Qwen3.5 keeps ``A_log`` and ``dt_bias`` in fp32 in a bf16 run (``models/common/
gated_delta_net_fp32_decay.py``), so every GPU run has both kinds in one optimizer group.
megatron-core 0.19.2's ``DistributedOptimizer`` records each model parameter's place in its group
(``model_param_group_index_map``) in the order of the gradient buffers, then hands the optimizer
the group's fp32 parameters first and the fp32 copies of its bf16 ones after. With both kinds in a
group the recorded places point at other parameters' main weights and Adam moments, and only the
checkpoint paths read them: saving stopped with a size mismatch, and where the sizes had agreed it
would have saved (and loaded) one parameter's state under another's name. The step itself reads
the optimizer's groups directly and was right.

megatron's plain bf16 optimizer (``Float16OptimizerWithFloat16Params``) has the same flaw in
another form: its checkpoint numbers the bf16 parameters alone, while the optimizer's state is
numbered over all of a group's parameters, so from the first fp32 parameter on the state was
paired with the wrong tensors (saving stopped: "Optimizer shape ((8,) does not match model shape
((16,))"). While it saves or loads, it sees every parameter of a group in the optimizer's order as
a half-precision one, an fp32 parameter being its own main weight. Its checkpoint then holds a main
weight for every parameter, as the distributed optimizer's does, so the two still load each
other's state (``optimizer_switch.py``).

Three rows of ``megatron_changes`` (group ``mixed-dtype-optimizer``) rebuild the distributed
optimizer's map in the optimizer's own order after construction, and wrap the plain one's save
and load. With one kind of parameter per group (every fp32 run, a bf16 model without fp32
parameters) both are exactly megatron's.
"""

from __future__ import annotations

import contextlib
import functools


def optimizer_order_index(optimizer) -> dict:
    """model parameter -> (group, place among the optimizer's parameters of that group)."""
    index = {}
    for group, (fp32, half) in enumerate(zip(optimizer.model_fp32_groups, optimizer.model_float16_groups)):
        for place, param in enumerate([*fp32, *half]):  # the order _build_model_and_main_param_groups hands over
            index[param] = (group, place)
    return index


@contextlib.contextmanager
def every_parameter_as_half(optimizer):
    """The plain optimizer's groups, for the duration, with each group's fp32 parameters in their
    places among the bf16 ones (and as their own main weights)."""
    if not any(optimizer.fp32_from_fp32_groups):
        yield
        return
    models, mains = [], []
    for g, group in enumerate(optimizer.optimizer.param_groups):
        model_of = {id(main): p for main, p in zip(optimizer.fp32_from_float16_groups[g], optimizer.float16_groups[g])}
        models.append([model_of.get(id(p), p) for p in group["params"]])
        mains.append(list(group["params"]))
    kept = optimizer.float16_groups, optimizer.fp32_from_float16_groups
    optimizer.float16_groups, optimizer.fp32_from_float16_groups = models, mains
    try:
        yield
    finally:
        optimizer.float16_groups, optimizer.fp32_from_float16_groups = kept


def every_parameter_as_half_around(method, run=None):
    """A plain optimizer's checkpoint method run with every parameter listed as half (megatron_changes row)."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with every_parameter_as_half(self):
            return method(self, *args, **kwargs)

    return wrapped


def ordered_index_map(init, run=None):
    """The distributed optimizer's ``__init__``, then its group index map in the optimizer's own
    order (megatron_changes row)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if hasattr(self, "model_fp32_groups"):  # Megatron-FSDP's optimizer keeps no such groups nor map
            self.model_param_group_index_map = optimizer_order_index(self)

    return __init__
