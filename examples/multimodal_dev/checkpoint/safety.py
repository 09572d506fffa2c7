"""Checkpoints are data, never code.

A torch_dist checkpoint is read by ``torch.distributed.checkpoint`` (DCP), which unpickles two
things: the ``.metadata`` index (plain ``pickle.load``) and every non-tensor entry (args, RNG
states, optimizer hyper-parameters: ``torch.load(weights_only=False)``). A checkpoint directory
from anywhere could therefore run arbitrary code on load. Two rows of ``megatron_changes``
(group ``checkpoints-are-data``) narrow both:

- ``.metadata``: an unpickler that resolves only classes of DCP's own modules (plain dataclasses
  and enums), ``torch.Size``, torch dtypes and layouts, and builtin containers; any other global
  (``os.system``, ``builtins.eval``, ...) stops the load naming the file and the global;
- non-tensor entries: ``torch.load(weights_only=True)`` with megatron-core's registered safe
  classes (``megatron.core.safe_globals``: Namespace, numpy arrays, its enums), plus the two
  named tuples megatron's rerun state machine stores when it re-saves a checkpoint after a NaN
  (``Call``, ``Caller``: a message string, a rank, a sequence number). weights_only rebuilds an
  allowed class from its stored fields only, so admitting a plain named tuple runs no code.

Applied by every training run and by the checkpoint tools before they read, on every host.
"""

from __future__ import annotations

import io
import pickle
import re
import types

_BUILTINS = {
    "dict",
    "list",
    "tuple",
    "set",
    "frozenset",
    "int",
    "float",
    "bool",
    "str",
    "bytes",
    "complex",
    "slice",
    "range",
}
_TORCH_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}  # DCP's checkpoint_id
_DCP_MODULE = "torch.distributed.checkpoint."


_REFUSED, _END = "checkpoint refused: ", " (a checkpoint must never run code)"
_DAMAGED_END = " (a damaged or foreign file: restore it, or load another checkpoint)"


class CheckpointCodeError(pickle.UnpicklingError):
    """A checkpoint file names a global that is not checkpoint data."""

    def __init__(self, where: str, what: str):
        super().__init__(f"{_REFUSED}{where}: it names {what}, which is not checkpoint data{_END}")


class CheckpointDamagedError(pickle.UnpicklingError):
    """A checkpoint file that torch's data-only reader cannot read (overwritten bytes, not a pickle)."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{_REFUSED}{where}: not readable as checkpoint data ({why}){_DAMAGED_END}")


def load_failure(where: str, err: BaseException) -> pickle.UnpicklingError:
    """The one line for a file ``torch.load(weights_only=True)`` failed on: the global it names, or
    why it cannot be read. Never torch's own text, which advises loading with weights_only=False
    (running whatever the file holds)."""
    text = str(err)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return CheckpointCodeError(where, f"'{found.group(1)}'")
    detail = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)
    why = detail.group(1) if detail else (text.strip().splitlines() or [type(err).__name__])[0]
    return CheckpointDamagedError(where, why.strip()[:160])


def refusal(err: BaseException) -> str | None:
    """The refusal inside ``err``: DCP re-raises reader errors wrapped in its own exceptions
    (their text carries ours), so the training entry point finds it by its text."""
    text = str(err)
    start = text.find(_REFUSED)
    if start < 0:
        return None
    ends = [(i, end) for end in (_END, _DAMAGED_END) if (i := text.find(end, start)) >= 0]
    i, end = min(ends) if ends else (len(text), "")
    return text[start : i + len(end)]


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        import torch

        allowed = (
            (module == "builtins" and name in _BUILTINS)
            or (module, name) in _TORCH_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)))
        )
        if not allowed and module.startswith(_DCP_MODULE):
            allowed = isinstance(super().find_class(module, name), type)  # DCP's classes, not its functions
        if not allowed:
            raise CheckpointCodeError(self.source, f"'{module}.{name}'")
        return super().find_class(module, name)


def load_metadata(file, source: str = "checkpoint metadata"):
    """``pickle.load`` restricted to what DCP's metadata index holds."""
    return _MetadataUnpickler(file, source).load()


def _safe_pickle_module(original):
    """``filesystem.py``'s view of ``pickle``: the same, except ``load``."""

    def load(file, *args, **kwargs):
        return load_metadata(file, getattr(file, "name", "checkpoint metadata"))

    names = {k: getattr(original, k) for k in dir(original) if not k.startswith("__")}
    return types.SimpleNamespace(**{**names, "load": load})


def load_bytes_weights_only(planner, read_item, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True``."""
    import torch

    try:
        obj = torch.load(value, weights_only=True)
    except Exception as err:  # a planted global, or bytes overwritten: not a zip, not a pickle
        raise load_failure(f"checkpoint entry '{read_item.dest_index.fqn}'", err) from None
    if planner.flatten_state_dict:
        from torch.distributed.checkpoint.default_planner import set_element

        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


def check_tracker(load_dir: str | None, flag: str = "--load") -> None:
    """megatron reads ``latest_checkpointed_iteration.txt`` with ``int()``; a damaged one would be a
    ValueError without the file's name. An iteration number or ``release`` passes."""
    import os

    if not load_dir:
        return
    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return
    with open(tracker, errors="replace") as f:
        text = f.read().strip()
    if not (text.isdigit() or text == "release"):
        raise ValueError(
            f"{flag} {load_dir}: {tracker} holds {text[:40]!r}, not an iteration number (a damaged "
            "checkpoint directory: restore the file, or write the number of the last complete iter_* "
            "directory into it)"
        )


def restricted_pickle(original, run):
    """``filesystem.py``'s ``pickle`` (megatron_changes row): the same module, but ``load`` reads DCP's
    metadata only. Also admits the two named tuples megatron's rerun state machine stores, which
    ``megatron.core.safe_globals`` leaves out."""
    import megatron.core  # noqa: F401  (registers megatron's safe classes: Namespace, numpy RNG state, enums)
    import torch
    from megatron.core.rerun_state_machine import Call, Caller

    torch.serialization.add_safe_globals([Call, Caller])
    return _safe_pickle_module(original)


def weights_only_load_bytes(original, run):
    """``DefaultLoadPlanner.load_bytes`` with ``weights_only=True`` (megatron_changes row), once
    the original is checked to be the one this was written against."""
    import inspect

    source = inspect.getsource(original)
    if "torch.load" not in source or "flatten_state_dict" not in source:
        raise RuntimeError(
            "torch.distributed.checkpoint's DefaultLoadPlanner.load_bytes changed; "
            "checkpoint/safety.py needs updating for this torch"
        )
    return load_bytes_weights_only
