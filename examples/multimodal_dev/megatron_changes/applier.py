"""Apply the table's rows: ``install(args, meter)`` for a training run, ``apply(group)`` on use.

Each row is applied once per process (the one idempotency rule: a row applied is recorded, and
applying it again does nothing), after its target is checked to exist. A megatron-core other
than the one the table was written for gets one warning naming the groups to re-verify; a target
that no longer exists stops the run naming it.
"""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace
from typing import Any

from .table import CHANGES, EVERY_RUN, GROUPS, NO_FUSED_ADAM, ON_USE, OWN_CALL, WHEEL, WRITTEN_FOR, Change


class MegatronChangeError(RuntimeError):
    """A row of the table cannot be applied to the megatron-core installed."""


_applied: dict[Change, object] = {}  # row -> the object put in place
_warned: list[str] = []


def load(path: str) -> Any:
    """The object at ``module:attribute.path`` (the one dotted-path loader of the project)."""
    module, _, attribute = path.partition(":")
    found = importlib.import_module(module)
    for name in attribute.split(".") if attribute else ():
        found = getattr(found, name)
    return found


def _owner(change: Change):
    module, _, attribute = change.target.partition(":")
    owner_path, _, name = attribute.rpartition(".")
    re_port = f"the change '{change.group}' was written for megatron-core {WRITTEN_FOR} and needs re-porting"
    try:
        owner = load(f"{module}:{owner_path}")
    except (ImportError, AttributeError) as err:
        raise MegatronChangeError(f"{change.target}: not in this megatron-core / torch ({err}); {re_port}") from None
    if not hasattr(owner, name):
        raise MegatronChangeError(f"{change.target}: not in this megatron-core / torch; {re_port}")
    return owner, name


def _put(owner, name: str, new) -> None:
    """Class attributes keep their kind: a staticmethod stays one."""
    if isinstance(inspect.getattr_static(owner, name), staticmethod):
        new = staticmethod(new)
    setattr(owner, name, new)


def _apply_row(change: Change, run) -> None:
    if change in _applied:
        return
    owner, name = _owner(change)
    new = load(change.replacement)(getattr(owner, name), run, **dict(change.options))
    _put(owner, name, new)
    _applied[change] = new


def check_version() -> str | None:
    """One warning line when megatron-core is not the version the table was written for (once a process)."""
    from megatron.core.package_info import __version__

    # megatron appends "+<commit>" of whatever git checkout its package sits in (a .venv inside this
    # repository is one): the release is what the table was written for
    if __version__.split("+")[0] == WRITTEN_FOR or _warned:
        return None
    _warned.append(__version__)
    ours = [g for g in GROUPS if not any(c.by_device_layer for c in CHANGES if c.group == g)]
    return (
        f"megatron-core {__version__}: this project's changes to it were written for {WRITTEN_FOR}; re-verify "
        f"{', '.join(ours)} (examples/multimodal_dev/megatron_changes/table.py)"
    )


def apply(group: str, run=None) -> None:
    """Every row of ``group`` that applies on this host, in the table's order; idempotent."""
    if group not in GROUPS:
        raise KeyError(f"no change group {group!r}; the table has {', '.join(GROUPS)}")
    rows = [c for c in CHANGES if c.group == group]
    if rows[0].by_device_layer:
        raise MegatronChangeError(f"'{group}' is applied by megatron.cpu, not here")
    if rows[0].applies == OWN_CALL:
        raise MegatronChangeError(f"'{group}' is applied by its own call ({rows[0].replacement}), not here")
    for change in rows:
        if change.applies == ON_USE or _applies(change):
            _apply_row(change, run)


def _applies(change: Change) -> bool:
    if change.applies == EVERY_RUN:
        return True
    if change.applies == NO_FUSED_ADAM:
        from megatron.core.optimizer import distrib_optimizer

        return not distrib_optimizer.HAVE_APEX_OR_TE
    if change.applies == WHEEL:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            return False  # a source checkout: megatron builds its helpers itself
        return True
    return False  # on use, or the device layer's


def install(args, meter=None) -> list[str]:
    """Every row that applies to a training run, in the table's order, and the targets of the rows
    applied by their own call checked to exist; the lines to print (a version warning)."""
    lines = [line] if (line := check_version()) else []
    run = SimpleNamespace(args=args, meter=meter)
    for change in CHANGES:
        if change.applies == OWN_CALL:
            _owner(change)
        elif change.applies != ON_USE and _applies(change):
            _apply_row(change, run)
    return lines


def applied() -> dict[Change, object]:
    """The rows applied in this process and what each put in place."""
    return dict(_applied)
