"""Ranks never outlive their torchrun (``lifetime.py``, ``launcher/torchrun.py``): SIGTERM to
torchrun's PID ends every rank and torchrun says so in one line; torchrun killed outright (SIGKILL,
the OOM killer) takes its ranks with it. The ranks are two small processes of the launcher's
torchrun, fresh interpreters as on a GPU host."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK = """
import os, sys, time
from examples.multimodal_dev.lifetime import rank_dies_with_launcher
rank_dies_with_launcher()
open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
time.sleep(300)
"""


def _started_ranks(tmp_path):
    (tmp_path / "sleeping_rank.py").write_text(RANK)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "FORK_RANKS": "0"}
    argv = [sys.executable, "-m", "examples.multimodal_dev.launcher.torchrun", "--standalone"]
    argv += ["--nproc-per-node=2", "-m", "sleeping_rank", str(marks)]
    launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while len(os.listdir(marks)) < 2 and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.2)
    ranks = [psutil.Process(int(pid)) for pid in os.listdir(marks)]
    assert len(ranks) == 2, launcher.stderr.read() if launcher.poll() is not None else "the ranks did not start"
    return launcher, ranks


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_ranks_end_with_their_torchrun(tmp_path, sig):
    launcher, ranks = _started_ranks(tmp_path)
    try:
        launcher.send_signal(sig)
        _, alive = psutil.wait_procs(ranks, timeout=15)
        assert not alive, f"ranks outlived torchrun's {sig.name}: {[p.pid for p in alive]}"
        code = launcher.wait(15)
        if sig == signal.SIGTERM:
            assert code == 128 + sig
            said = [line for line in launcher.stderr.read().splitlines() if line.startswith("torchrun:")]
            assert said == ["torchrun: stopped by SIGTERM; every rank has ended"], said
    finally:  # nothing of the test outlives it, whatever failed
        for process in ranks:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_rank_ended_by_sigkill_is_named_as_the_out_of_memory_killer_would_be(tmp_path):
    """A rank SIGKILLed (as the OOM killer does) says nothing itself: torchrun's line names the likely
    cause and where the kernel says it, or the cgroup's count where it rose."""
    (tmp_path / "killed_rank.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "FORK_RANKS": "0"}
    argv = [sys.executable, "-m", "examples.multimodal_dev.launcher.torchrun", "--standalone"]
    done = subprocess.run(
        argv + ["--nproc-per-node=1", "-m", "killed_rank"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = [line for line in done.stderr.splitlines() if line.startswith("torchrun:")]
    assert done.returncode == 1 and len(said) == 1, done.stderr[-2000:]
    assert said[0].startswith("torchrun: rank 0 stopped (signal SIGKILL)") and "out-of-memory killer" in said[0]


def test_the_failure_line_reads_the_cgroups_out_of_memory_count():
    from examples.multimodal_dev.launcher.torchrun import failure_line

    assert "killer ended 2 process(es)" in failure_line(3, -9, "SIGKILL", 5, 7)
    assert "likely cause" in failure_line(3, -9, "SIGKILL", 5, 5) and "likely cause" in failure_line(
        3, -9, "SIGKILL", None, None
    )
    assert failure_line(3, 1, None, 5, 7) == "torchrun: rank 3 stopped (exit code 1); its output above says why"
