"""The tests' warm engine (``tests/warm_engine.py``): what it refuses, what a launch on it says and returns,
and that a launcher killed mid-run takes its job with it. That a run forked from it trains as a cold
one does is held by every engine test: they launch on it (``tests/launch.py``), and
``test_training_runs.py::test_exact_resume`` compares the three starts bitwise."""

import os
import signal
import socket
import subprocess
import sys
import time

import engine_handover
import pytest
from engine_handover import hand_over
from launch import ROOT, WarmEngine, on_warm_engine, run_script
from warm_engine import _identity, _listen, _remove_own, import_time_differences


@pytest.mark.parametrize(
    "launch, server, differing",
    [
        (
            {"A": "1", "PYTHONPATH": "/x"},
            {"A": "2", "PYTHONPATH": "/y"},
            [],
        ),  # not read at import, or applied by the child
        ({"TRITON_INTERPRET": "1"}, {}, ["TRITON_INTERPRET"]),
        ({}, {"OMP_NUM_THREADS": "1"}, ["OMP_NUM_THREADS"]),
        ({"TORCH_LOGS": "+dynamo", "MEGATRON_CPU_FLA": "1"}, {"TORCH_LOGS": "+dynamo"}, ["MEGATRON_CPU_FLA"]),
    ],
)
def test_only_what_is_read_at_import_must_match(launch, server, differing):
    assert import_time_differences(launch, server) == differing


def test_what_the_engines_imports_set_is_no_difference():
    """torch's inductor sets TORCHINDUCTOR_CACHE_DIR while importing: a launch from a process that
    imported the engine carries it, the server's start environment does not, its imported one does."""
    launch, start, imported = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/i"}, {}, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/i"}
    assert import_time_differences(launch, start, imported) == []
    assert import_time_differences({}, start, imported) == []  # a launch that imported nothing
    assert import_time_differences({"TORCHINDUCTOR_CACHE_DIR": "/x"}, start, imported) == ["TORCHINDUCTOR_CACHE_DIR"]


def test_without_a_server_the_launch_starts_cold_saying_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ENGINE_SERVER", str(tmp_path / "nothing"))
    assert hand_over(["--help"]) is None
    assert f"torchrun: ENGINE_SERVER={tmp_path / 'nothing'}: no warm engine answers" in capsys.readouterr().err
    monkeypatch.setenv("ENGINE_SERVER", "")
    assert hand_over(["--help"]) is None


def test_a_socket_file_left_by_a_dead_server_is_replaced_and_a_live_one_refused(tmp_path):
    address = str(tmp_path / "socket")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(address)
    dead.close()  # its file stays, nobody listens
    live = _listen(address)
    try:
        with pytest.raises(SystemExit, match=f"warm_engine.py: {address}: a warm engine serves there already"):
            _listen(address)
    finally:
        live.close()
    with pytest.raises(SystemExit, match="No such file or directory"):
        _listen(str(tmp_path / "no" / "socket"))


def test_only_a_socket_of_this_users_is_ever_removed(tmp_path, monkeypatch):
    """A path that is not a socket ("connection refused" too) is refused by name and left as it was;
    at its end the server removes its own socket only, not what has taken the path since."""
    kept = tmp_path / "notes.txt"
    kept.write_text("the user's own file")
    with pytest.raises(SystemExit, match=f"warm_engine.py: {kept} exists and is not a socket: name a path"):
        _listen(str(kept))
    with pytest.raises(SystemExit, match=f"warm_engine.py: {tmp_path} exists and is not a socket"):
        _listen(str(tmp_path))
    assert kept.read_text() == "the user's own file"

    address = str(tmp_path / "socket")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(address)
    dead.close()
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)  # as if another user had left it
    with pytest.raises(SystemExit, match=f"{address} exists and is a socket of user id {os.geteuid()}, not this"):
        _listen(address)
    monkeypatch.undo()
    assert os.path.exists(address)

    listener = _listen(address)
    listener.close()
    own = _identity(address)
    os.unlink(address)
    kept.rename(address)  # something else took the path while the server ran
    _remove_own(address, own)
    assert open(address).read() == "the user's own file"


def _peer(tmp_path, answer: bytes | None):
    """A socket server that accepts one connection, writes ``answer`` (None: nothing) and records
    what the other side sends: (address, thread, received bytes)."""
    import threading

    address, received = str(tmp_path / "peer"), bytearray()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()

    def serve():
        conn, _ = listener.accept()
        with conn:
            if answer is not None:
                conn.sendall(answer)
            conn.settimeout(3)
            try:
                while chunk := conn.recv(4096):
                    received.extend(chunk)
            except OSError:
                pass
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return address, thread, received


@pytest.mark.parametrize(
    "answer,said",
    [
        (None, "no warm engine answers (no answer in 0.5 s)"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "not a warm engine of this user's (a message of "),
        (b"\x00" * 7 + b"\x05hello", "not a warm engine of this user's (a message that is not JSON)"),
        (b"\x00" * 7 + b"\x02[]", "not a warm engine of this user's (a message that is not a JSON object)"),
        (b"\x00" * 7 + b"\x02{}", "not a warm engine of this user's (it says {})"),
    ],
    ids=["silent", "http", "not json", "a list", "another protocol"],
)
def test_a_foreign_socket_gets_nothing_and_the_launch_starts_cold(tmp_path, monkeypatch, capsys, answer, said):
    """The launcher hands over its environment and streams only to a server that spoke the protocol
    first: a silent or foreign socket gets not a byte, and the launch starts cold in one line."""
    monkeypatch.setattr(engine_handover, "ANSWER_TIMEOUT_S", 0.5)
    monkeypatch.setenv("ENGINE_SERVER", "")
    address, thread, received = _peer(tmp_path, answer)
    monkeypatch.setenv("ENGINE_SERVER", address)
    assert hand_over(["--help"]) is None  # the reason below is not "no answer": nothing waited it out
    thread.join(5)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"torchrun: ENGINE_SERVER={address}: {said}" in err, err
    assert err.rstrip().endswith("starting cold")
    assert bytes(received) == b""


def test_a_socket_of_another_user_gets_nothing(tmp_path, monkeypatch, capsys):
    address, thread, received = _peer(tmp_path, None)
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)
    monkeypatch.setenv("ENGINE_SERVER", address)
    assert hand_over(["--help"]) is None
    monkeypatch.undo()
    socket.socket(socket.AF_UNIX).connect(address)  # lets the peer's accept return
    thread.join(5)
    assert f"{address}: not a warm engine of this user's (a socket of user id {os.geteuid()}" in capsys.readouterr().err
    assert bytes(received) == b""


def test_a_refused_launch_starts_cold_and_a_failed_one_says_which_rank():
    """An import-time variable set otherwise: the launch runs cold, saying why; a mistake only the
    training script sees: one line from the rank, one from the launcher, status 1, as a cold launch."""
    refused = run_script(TRAIN_ITERS=1, TORCH_SHOW_CPP_STACKTRACES="0", PACKING="tokens", MBS=2)
    failed = run_script(TRAIN_ITERS=1, PACKING="tokens", MBS=2)
    assert "does not run this launch (TORCH_SHOW_CPP_STACKTRACES differ from the server's" in refused.output, (
        refused.output[:3000] + "\nthe server:\n" + WarmEngine.log_tail()
    )
    assert "warm engine" not in failed.output, failed.output[:3000]
    for run in (refused, failed):
        assert run.returncode == 1 and "Traceback" not in run.output, run.output[-3000:]
        assert (
            "pretrain_multimodal.py: --micro-batch-size 2: with --packing tokens a micro-batch is one row" in run.output
        )
        assert (
            run.output.strip().splitlines()[-1] == "torchrun: rank 0 stopped (exit code 1); its output above says why"
        )


def test_a_launcher_killed_mid_run_ends_its_job(tmp_path):
    """The launcher (the process run_qwen35_vl.sh execs) is killed: the job it asked for, which runs in
    the warm engine's child, is ended too (SIGTERM, then SIGKILL): no process of it is left."""
    log = tmp_path / "log"
    env = on_warm_engine({**os.environ, "TRAIN_ITERS": "100000", "SEQ_LEN": "256"})
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            ["bash", os.path.join(ROOT, "run_qwen35_vl.sh"), "--eval-iters", "0"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while " iteration        2/" not in log.read_text():
        assert launcher.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    # every process of the job (the engine's child, torchrun's agent, the rank) writes to the log it was
    # handed: the job has ended when no process holds it open
    deadline = time.monotonic() + 60
    while holders := _holding(log):
        if time.monotonic() > deadline:
            for pid in holders:  # a job of 100000 iterations would outlive the test and slow the rest
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"processes {holders} still ran the job:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)


def _holding(path) -> list[int]:
    """The processes with ``path`` open."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in fds):
                found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def test_a_dropped_jobs_processes_in_sessions_of_their_own_are_ended_too():
    """torchrun starts each rank in a session of its own, out of the job's process group; a rank whose
    agent is killed is reparented. The server remembers the job's processes when it first signals them:
    here a grandchild in its own session that ignores SIGTERM outlives its parent, and the SIGKILL
    after the grace period still reaches it."""
    import psutil
    from warm_engine import _Server

    server = _Server.__new__(_Server)  # its job bookkeeping alone: no socket, no stdin
    server.dropped, server.members = {}, {}
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    job = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {stubborn!r}], "
            "start_new_session=True); time.sleep(600)",
        ],
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not psutil.Process(job.pid).children():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = psutil.Process(job.pid).children()[0]
    try:
        server.dropped[job.pid] = time.monotonic()
        server._signal_job(job.pid, signal.SIGTERM)  # the job ends; its grandchild ignores SIGTERM
        job.wait(timeout=30)
        assert grandchild.is_running()
        server._signal_job(job.pid, signal.SIGKILL)  # after the grace period: reparented, and still reached
        grandchild.wait(timeout=30)
    finally:
        if grandchild.is_running():
            grandchild.kill()
