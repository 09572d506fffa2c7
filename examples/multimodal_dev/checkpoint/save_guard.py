"""A checkpoint save that runs out of disk leaves the last complete checkpoint and nothing else.

megatron.training writes ``iter_XXXXXXX/`` and only then points ``latest_checkpointed_iteration.txt``
at it, so a failed save never replaces the previous checkpoint; but the failure surfaced as the
writer's own text (``unexpected pos ...``, ``basic_ios::clear``, a DCP exception) and left the
half-written directory. ``full_disk_in_one_line`` is around every save the training loop makes
(``save_hooks.py``): when a save fails for lack of space, the half-written directory of that
iteration is removed and the run stops with one line naming the place.

Directories newer than the tracker found at start are leftovers of a save that did not finish:
``clear_incomplete_saves`` removes those that are certainly incomplete (no ``.metadata``, the
index torch.distributed.checkpoint writes after every shard) and names the complete ones (a
tracker rolled back by hand must not cost the user the checkpoints after it); those are
overwritten when training reaches that iteration again.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil

from examples.multimodal_dev.console import fail

from .files import TRACKER, iteration_dir, latest_iteration
from .writer_errors import WriterLog, causes

# What the writers say when the disk is full: the OS error, and the C++ stream errors torch's
# serialisation raises on a short write.
_OUT_OF_SPACE = re.compile(r"No space left on device|ENOSPC|errno 28|unexpected pos|basic_ios::clear", re.I)


_writer_errors = WriterLog()


def out_of_space(err: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno == errno.ENOSPC or _OUT_OF_SPACE.search(str(e)) for e in causes(err))


def stale_directories(save_dir: str | None) -> list[str]:
    """``iter_*`` directories newer than the tracker: saves that did not complete."""
    if not save_dir or not os.path.isdir(save_dir):
        return []
    latest = latest_iteration(save_dir) or 0
    return sorted(d for d in os.listdir(save_dir) if re.fullmatch(r"iter_\d{7}", d) and int(d[5:]) > latest)


def clear_incomplete_saves(save_dir: str | None) -> list[str]:
    """Remove the incomplete directories newer than the tracker; one line per directory found."""
    lines: list[str] = []
    if not save_dir:
        return lines
    for name in stale_directories(save_dir):
        path = os.path.join(save_dir, name)
        if os.path.exists(os.path.join(path, ".metadata")):
            lines.append(
                f"{path} is complete but newer than {TRACKER}; it is overwritten when training reaches that iteration"
            )
        else:
            shutil.rmtree(path, ignore_errors=True)  # every rank may try: the others find it gone
            lines.append(f"removed {path}: a save that did not finish (newer than {TRACKER}, no .metadata)")
    return lines


def listen_to_the_writer() -> None:
    """Keep the checkpoint writer's error lines for the life of the run (idempotent)."""
    _writer_errors.attach()


@contextlib.contextmanager
def full_disk_in_one_line(save_dir: str, iteration: int):
    """Around a save (``save_hooks.py``): a save that fails for lack of space removes its partial
    directory and stops the run with one line; any other failure goes on unchanged."""
    _writer_errors.lines.clear()
    try:
        yield
    except BaseException as err:
        if not (out_of_space(err) or any(_OUT_OF_SPACE.search(line) for line in _writer_errors.lines)):
            raise
        partial = iteration_dir(save_dir, iteration)
        latest = latest_iteration(save_dir)
        if latest != iteration:
            shutil.rmtree(partial, ignore_errors=True)
        kept = f"iteration {latest}" if latest is not None else "none"
        fail(
            f"no space left on {save_dir} while saving iteration {iteration}: "
            f"removed the partial {partial}; the last complete checkpoint is {kept}"
        )
