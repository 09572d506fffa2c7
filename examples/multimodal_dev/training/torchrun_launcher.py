"""``torchrun`` for ``run_qwen35_vl.sh``, without the launcher's own traceback when a rank fails.

A rank that stops on a user's mistake prints one line naming it (``pretrain_multimodal.py: ...``)
and exits non-zero; torchrun then raises ``ChildFailedError`` and Python prints a traceback of the
launcher itself, which buries that line. Here the failure becomes one more line (which rank, its
exit code or signal) and the exit status 1. Arguments are torchrun's.
"""

from __future__ import annotations

import sys


def main() -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun()
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"torchrun: rank {rank} stopped ({how}); its output above says why", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
