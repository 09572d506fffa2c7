"""Counting the host's work of a training step: every ATen op dispatched, and every point where the
host waits for the device.

On a GPU each eager ATen op costs the host ~10-25 us of Python and dispatcher time whatever its size,
and each sync stops the host until the GPU has drained its queue; a step that dispatches 125k ops
leaves the GPU idle most of the time. Both counts are properties of the code, not of the host, so
they are taken on CPU, where every commit runs, and hold for the GPU run.

What counts as a sync (the host needs a value the device computes):
- ATen ops whose output size or value the host reads: ``_local_scalar_dense`` (``.item()``,
  ``bool(t)``, ``int(t)``), ``nonzero`` (and boolean-mask indexing, which calls it),
  ``masked_select``, ``unique`` and friends, ``repeat_interleave`` without ``output_size``,
  ``equal``, ``is_nonzero``;
- ``Tensor.tolist`` / ``.cpu()`` / ``.numpy()`` calls (a device-to-host copy on a GPU);
- ``torch.cuda.synchronize`` and stream / event synchronizes.
- ATen ops indexed by a boolean mask (``t[mask]``, ``t[mask] = v`` and their backward): the
  kernel turns the mask into indices with ``nonzero`` below the dispatcher, out of this counter's
  sight, so the op is counted instead. Except ``t[mask] = <Python number>``: on a GPU torch makes
  the number a host scalar and ATen runs ``masked_fill_``, which reads nothing back.
On a CPU host every tensor lives on the host, so the counter has to be told which ones stay there on
a GPU run: a tensor marked ``batch_memo.HOST_SIDE_MARK`` (a batch's host copies, the vision grids,
and ``torch.get_rng_state()``'s CPU generator state, which megatron's RNG tracker compares before and
after each forked region) and every op output computed only from such tensors (an op on host tensors
runs on the host). Reads of those are not syncs; any other tensor counts as a device tensor, so the
count is an upper bound, and each sync is listed with the line that asked for it so that it can be
judged. torch.optim
reading its own step counts, which it keeps on the host (unless ``capturable``), is left out too;
those reads still count as ops.
"""

from __future__ import annotations

import collections
import os
import re
import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from examples.multimodal_dev.models.common.batch_memo import HOST_SIDE_MARK, host_side

SYNC_ATEN = {
    "_local_scalar_dense",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "equal",
    "is_nonzero",
}
SYNC_METHODS = {"tolist", "cpu", "numpy"}
BOOL_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_"}
# (owner, attribute) of the explicit waits for the device
_CUDA_SYNCS = ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"))
_HERE = os.path.dirname(os.path.abspath(__file__))
# torch itself and the CPU device layer (whose function mode sits between every caller and torch)
_PASS_OVER = ("torch", f"megatron{os.sep}cpu")


def _inside_torch_optim() -> bool:
    return any(f"{os.sep}torch{os.sep}optim{os.sep}" in frame.filename for frame in traceback.extract_stack()[:-2])


def _passed_over(filename: str) -> bool:
    return filename.startswith(_HERE) or any(f"{os.sep}{d}{os.sep}" in filename for d in _PASS_OVER)


def _short(filename: str) -> str:
    """The path from its last ``megatron`` or ``examples`` folder on."""
    parts = filename.split(os.sep)
    for anchor in ("megatron", "examples"):
        if anchor in parts:
            return os.sep.join(parts[len(parts) - 1 - parts[::-1].index(anchor) :])
    return filename


def _caller() -> str:
    """file:line of the innermost frame outside torch and this file: who asked for the value."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not _passed_over(frame.filename):
            return f"{_short(frame.filename)}:{frame.lineno}"
    return "?"


_FORMATTED_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _backward_caller() -> str | None:
    """In a backward pass, the forward line that made the autograd node now running ("backward of
    file:line"; anomaly mode keeps each node's forward stack), or the node's name where it has none
    (AccumulateGrad); None outside a backward pass."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    for entry in reversed(node.metadata.get("traceback_") or []):
        found = _FORMATTED_FRAME.search(entry)
        if found and not _passed_over(found.group(1)):
            return f"backward of {_short(found.group(1))}:{found.group(2)}"
    return f"backward: {node.name()}"


class _AtenCounter(TorchDispatchMode):
    def __init__(self, tally: "StepTally"):
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tally.inside_kernel:
            return func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        self.tally.ops[name] += 1
        if self.tally.by_caller:
            self.tally.callers[_backward_caller() or _caller()] += 1
        place = _placement([t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
        if (
            place != _HOST
            and not (name in BOOL_INDEXED and self.tally.scalar_setitem)
            and _reads_device(name, args, kwargs)
        ):
            self.tally.sync(f"aten.{name}")
        out = func(*args, **kwargs)
        if place != _DEVICE:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    t.__dict__[_PLACE] = place
        return out


# Where an op's output lives on a GPU run. Host: made from host-side tensors only, or from host-side
# tensors of one dimension or more and factory-made ones (a GPU run may mix a device tensor only with
# a 0-dim host one, so those factory tensors are on the host too). Factory: made by a factory with no
# tensor input (``torch.arange``), where the device it names is not known here; read alone it counts
# as a sync. Device: anything else.
_PLACE, _HOST, _FACTORY, _DEVICE = "_counted_placement", "host", "factory", "device"


def _placement(inputs: list) -> str:
    places = [_HOST if _host_side(t) else t.__dict__.get(_PLACE, _DEVICE) for t in inputs]
    if all(p == _HOST for p in places) and places:
        return _HOST
    if all(p == _FACTORY for p in places):  # no inputs at all, or only factory-made ones
        return _FACTORY
    if _DEVICE not in places and any(_host_side(t) and t.dim() > 0 for t in inputs):
        return _HOST
    return _DEVICE


def _host_side(t: torch.Tensor) -> bool:
    return t.__dict__.get(HOST_SIDE_MARK, False) or t.__dict__.get(_PLACE) == _HOST


def _reads_device(name: str, args, kwargs) -> bool:
    """Whether the op makes the host wait for the values of its (device) inputs."""
    if name in SYNC_ATEN:
        return not (name == "_local_scalar_dense" and _inside_torch_optim())
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and len(args) < 3
    if name in BOOL_INDEXED and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ())
    return False


class _MethodCounter(TorchFunctionMode):
    def __init__(self, tally: "StepTally"):
        super().__init__()
        self.tally = tally

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__setitem__" and len(args) == 3 and isinstance(args[2], (bool, int, float)):
            self.tally.scalar_setitem += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.tally.scalar_setitem -= 1
        if (
            name in SYNC_METHODS
            and not self.tally.inside_kernel
            and getattr(func, "__objclass__", None) is not None
            and not (args and isinstance(args[0], torch.Tensor) and _host_side(args[0]))
        ):
            self.tally.sync(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


class StepTally:
    """Counts of the work inside ``with tally.counting():``, accumulated over every use."""

    def __init__(self, by_caller: bool = False):
        # also count ops by the line that dispatched them (slow: a stack walk an op); a backward op by the
        # forward line whose autograd node ran it, where anomaly mode is on (``counting`` turns it on)
        self.by_caller = by_caller
        self.callers: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()
        self.inside_kernel = 0  # > 0: inside a stand-in for one GPU kernel (as_one_kernel)
        self.scalar_setitem = 0  # > 0: inside ``t[index] = <Python number>`` (masked_fill_ on a GPU)
        self._counting_depth = 0
        self.syncs: collections.Counter = collections.Counter()  # (kind, caller) -> count
        self.steps = 0

    def sync(self, kind: str) -> None:
        self.syncs[(kind, _caller())] += 1

    def counting(self):
        return _Counting(self)

    @property
    def counting_now(self) -> bool:
        return self._counting_depth > 0

    def summary(self, top: int = 15) -> dict:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "ops_per_step": sum(self.ops.values()) / steps,
            "syncs_per_step": sum(self.syncs.values()) / steps,
            "top_ops": [(n, c / steps) for n, c in self.ops.most_common(top)],
            "syncs": [(k, where, c / steps) for (k, where), c in self.syncs.most_common()],
            "callers": [(where, c / steps) for where, c in self.callers.most_common(3 * top)],
        }


class _Counting:
    def __init__(self, tally: StepTally):
        self.tally = tally
        self.modes = (_MethodCounter(tally), _AtenCounter(tally))
        self.patched: list = []
        self.anomaly = None

    def _wrap_cuda_syncs(self):
        for owner, name in _CUDA_SYNCS:
            original = getattr(owner, name, None)
            if original is None:
                continue

            def counted(*a, _original=original, _name=name, **k):
                self.tally.sync(f"cuda.{_name}")
                return _original(*a, **k)

            setattr(owner, name, counted)
            self.patched.append((owner, name, original))

    def __enter__(self):
        if self.tally.by_caller:
            self.anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False)
            self.anomaly.__enter__()
        self.tally._counting_depth += 1
        self._wrap_cuda_syncs()
        original = torch.get_rng_state
        torch.get_rng_state = lambda: host_side(original())  # the CPU generator's state: a host tensor
        self.patched.append((torch, "get_rng_state", original))
        for mode in self.modes:
            mode.__enter__()
        return self.tally

    def __exit__(self, *exc):
        for mode in reversed(self.modes):
            mode.__exit__(*exc)
        for owner, name, original in reversed(self.patched):
            setattr(owner, name, original)
        self.tally._counting_depth -= 1
        self.tally.steps += 1
        if self.anomaly is not None:
            self.anomaly.__exit__(*exc)
        return False


class _OneKernel(torch.autograd.Function):
    """Runs ``run(*tensors)`` as one counted op forward and one backward (the backward recomputes
    the forward under autograd and differentiates it, uncounted)."""

    @staticmethod
    def forward(ctx, tally, name, run, *tensors):
        ctx.tally, ctx.name, ctx.run = tally, name, run
        ctx.save_for_backward(*tensors)
        tally.ops[name] += 1
        tally.inside_kernel += 1
        try:
            return run(*tensors)
        finally:
            tally.inside_kernel -= 1

    @staticmethod
    def backward(ctx, grad):
        tally = ctx.tally
        tally.ops[f"{ctx.name}_backward"] += 1
        tally.inside_kernel += 1
        try:
            tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
            with torch.enable_grad():
                out = ctx.run(*tensors)
            wanted = [t for t in tensors if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
            return (None, None, None, *(next(grads) if t.requires_grad else None for t in tensors))
        finally:
            tally.inside_kernel -= 1


def as_one_kernel(tally: StepTally, name: str, run, *tensors):
    """``run(*tensors)`` (one output tensor), counted as the one fused GPU kernel it stands in for
    (one op forward, one backward) while ``tally`` counts; plain otherwise."""
    if not tally.counting_now:
        return run(*tensors)
    present = [t for t in tensors if t is not None]
    positions = [i for i, t in enumerate(tensors) if t is not None]

    def run_present(*given):
        full = list(tensors)
        for i, t in zip(positions, given):
            full[i] = t
        return run(*full)

    return _OneKernel.apply(tally, name, run_present, *present)
