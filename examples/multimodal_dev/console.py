"""The training script's voice: a user's mistake is one line (``fail``), progress is said once (``say``).

Every line a user reads from a run starts with the script's name, so a line in a log of many ranks
says which program wrote it. A mistake is a ``SystemExit`` carrying that line: Python prints it
without a traceback, and the launcher passes it on (``launcher/torchrun.py``).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

PROGRAM = "pretrain_multimodal.py"


def line(message: str) -> str:
    return f"{PROGRAM}: {message}"


def fail(message: str) -> NoReturn:
    """Stop the run on a user's mistake: one line, no traceback, no chained cause."""
    raise SystemExit(line(message)) from None


def rank() -> int:
    """This process's global rank: torch.distributed's once its group is up, torchrun's ``RANK`` before."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def say(message: str, *, every_rank: bool = False) -> None:
    """Print a progress line on rank 0 (or on every rank: a line about this rank's own state)."""
    if every_rank or rank() == 0:
        print(line(message), flush=True)
