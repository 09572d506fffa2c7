"""A rank killed with SIGKILL must take its data-loader workers with it (``loader.exit_with_parent``)."""

import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_workers_die_with_rank(script: str, workers: int = 2, busy: int = 0) -> None:
    """Run ``script`` (with the repository and tests/ importable) as a rank, wait until it has
    ``workers`` children (and ``busy`` files in the folder ``$BUSY_MARKS``, which its workers write
    once at work), SIGKILL it, and check that none of them outlives it by 10 s."""
    import tempfile

    import psutil

    code = f"import sys\nsys.path[:0] = {[ROOT, os.path.join(ROOT, 'tests')]!r}\n{script}"
    marks = tempfile.mkdtemp(prefix="busy_marks_")
    rank = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "BUSY_MARKS": marks})
    children = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and (
            len(psutil.Process(rank.pid).children()) < workers or len(os.listdir(marks)) < busy
        ):
            time.sleep(0.2)
        children = psutil.Process(rank.pid).children()
        assert len(children) >= workers, "the DataLoader workers did not start"
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait()
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"workers outlived the killed rank: {[p.pid for p in alive]}"
    finally:  # nothing of the test outlives it, whatever failed; only the rank's own processes: this
        # process's other children (the tests' warm engine) are not the test's to end
        for p in children:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if rank.poll() is None:
            rank.kill()
            rank.wait()
