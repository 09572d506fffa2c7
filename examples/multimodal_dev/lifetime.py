"""Processes that never outlive the one they serve: a rank its torchrun, a data-loader worker its rank.

A process whose parent is killed (SIGKILL, the kernel's OOM killer, a node agent) is re-parented to
init and runs on: a rank waits in a collective, a server rank keeps answering on its port, a worker
holds a copy of its rank's memory. Linux's ``PR_SET_PDEATHSIG`` has the kernel send this process
SIGKILL when its parent thread exits; elsewhere nothing changes. The request lasts across ``exec`` and
is not inherited by children (each asks for itself).

A parent that died before the request was made is caught by looking for it once after the request:
``watched`` is the process this one must not outlive, its parent or (a rank forked from torchrun's
forkserver) the launcher above that parent, whose death ends the forkserver and so its children.
"""

from __future__ import annotations

import os
import signal
import sys

# torchrun's PID, set by ``launcher/torchrun.py`` for its ranks: the process a rank must not outlive
LAUNCHER_PID = "MULTIMODAL_DEV_LAUNCHER_PID"


def die_with_parent(watched: int | None) -> None:
    """SIGKILL to this process when its parent dies; now, where ``watched`` has already gone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if watched is not None and os.getppid() != watched and not running(watched):
        os.kill(os.getpid(), signal.SIGKILL)


def rank_dies_with_launcher() -> None:
    """Under this project's torchrun: this rank ends when torchrun does, however torchrun ends."""
    pid = os.environ.get(LAUNCHER_PID, "")
    if pid.isdigit():
        die_with_parent(int(pid))


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")
