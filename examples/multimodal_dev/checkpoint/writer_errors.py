"""What megatron's torch_dist writer says when a save fails, for the two places that tell a failed
write in one line (``save_guard.py`` during training, ``hf_conversion.py`` when importing).

The writer's worker turns an ``OSError`` into "Worker failure: An error is caught while starting
worker 0, error: <class 'OSError'>" (the type alone) and logs the text itself ("Local worker 0
encountered an error: [Errno 28] No space left on device"); DCP wraps writer errors in its
``CheckpointException``, a BaseException whose ``failures`` hold them. So the cause is found by
walking the exception's causes and DCP's failures, and by reading the writer's log lines.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator


class WriterLog(logging.Handler):
    """The error lines megatron's checkpoint writer logs. ``attach()`` keeps listening for the life of
    the process; as a context manager it listens for one block and keeps the lines out of the
    terminal (the failure is then reported once, in one line)."""

    LOGGER = "megatron.core.dist_checkpointing"

    def __init__(self):
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def attach(self) -> None:
        """Idempotent: one handler however often it is called."""
        logger = logging.getLogger(self.LOGGER)
        if self not in logger.handlers:
            logger.addHandler(self)

    def __enter__(self):
        logger = logging.getLogger(self.LOGGER)
        self._propagate, logger.propagate = logger.propagate, False
        logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logger = logging.getLogger(self.LOGGER)
        logger.removeHandler(self)
        logger.propagate = self._propagate


def causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, what caused it, and the writer errors DCP's exceptions carry, each once."""
    seen, queue = set(), [err]
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        queue += [e.__cause__, e.__context__]
        queue += [
            pair[0] if isinstance(pair, tuple) else pair for pair in (getattr(e, "failures", None) or {}).values()
        ]
