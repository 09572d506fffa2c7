"""The tests' warm engine: one process imports the engine once, and every launch of a test forks from it.

    python tests/warm_engine.py SOCKET &    # serves until SIGTERM or ^C
                                            # (started with its stdin a pipe: until that closes too)
    ENGINE_SERVER=SOCKET PYTHONPATH=tests/hooks bash run_qwen35_vl.sh ...

A launch on a host without CUDA spends most of a short run importing: about 2 s of CPU for torchrun's
launcher, about 6 s for each fresh rank (torch, megatron-core with dynamo and inductor, transformers);
the suite launches hundreds of runs. It is a test helper, not part of the product: the product's
launcher knows nothing of it. With ``ENGINE_SERVER`` set, ``tests/hooks/sitecustomize.py`` makes the
torchrun launcher (``launcher/torchrun.py``) hand its arguments,
environment, working directory and standard streams to this server instead of importing anything;
the server forks a child that takes them on and runs the launcher's ``main`` there, and the ranks fork
from that child (``FORK_RANKS``'s path, with nothing left to import). The engine each rank runs is
the one a fresh interpreter runs; what a fork cannot inherit is refused, and the launcher then starts
cold as it would without the server:

- a variable that torch, Triton or Python read while importing (``IMPORT_TIME``) set otherwise than
  in the server's own environment;
- a host with CUDA (a process forked after CUDA was initialised cannot use it).

A ``sitecustomize`` that the launch's ``PYTHONPATH`` adds runs in the child, as a fresh interpreter
would run it at start. The child is a session of its own: the job's processes are one process group,
as ``run_qwen35_vl.sh``'s are, and it ends with the launcher that asked for it (a launcher killed
mid-run takes its job with it). The launcher exits with the child's status.

SOCKET is a path the server creates: what is there already is refused by name (a file, a folder,
another user's socket, a live server's), except this user's socket that nobody serves any more, the
leftover of a server that died, which is replaced. At its end the server removes its own socket
only. Each connection starts with the server's hello (``engine_handover.py`` says why).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import stat
import sys

from engine_handover import (
    HELLO,
    ForeignPeer,
    own_socket_problem,
    private_listener,
    receive,
    send,
)

# Read while torch, Triton, OpenMP or the interpreter start: a forked child keeps the server's values
IMPORT_TIME = ("PYTHON", "TORCH", "PYTORCH", "TRITON", "OMP_", "MKL_", "CUDA", "NCCL", "LD_", "MEGATRON_CPU_FLA")
# ... PYTHONPATH, which the child applies itself; PYTHONUNBUFFERED, which the server's streams honour already
APPLIED_BY_THE_CHILD = ("PYTHONPATH", "PYTHONUNBUFFERED")
GRACE_S = 10  # a job whose launcher vanished: SIGTERM, then SIGKILL after this long
# The server's environment before it imported anything, and (main) after: what the engine's imports set
# themselves (torch's inductor sets TORCHINDUCTOR_CACHE_DIR) is what a fresh interpreter would set too, so
# a launch from a process that imported the engine already carries it without differing
_START_ENV = dict(os.environ)
_START_PARENT = os.getppid()  # before the imports, which take seconds
_IMPORTED_ENV: dict = {}


def import_time_differences(launch_env: dict, *server_envs: dict) -> list[str]:
    """The import-time variables that ``launch_env`` sets otherwise than each of ``server_envs`` (the
    server's environment before and after its imports)."""
    names = {
        k
        for env in (launch_env, *server_envs)
        for k in env
        if k.startswith(IMPORT_TIME) and k not in APPLIED_BY_THE_CHILD
    }
    return sorted(k for k in names if all(launch_env.get(k) != env.get(k) for env in server_envs))


# --- the server's side -----------------------------------------------------------------------------


def _refusal(env: dict) -> str | None:
    differing = import_time_differences(env, _START_ENV, _IMPORTED_ENV or _START_ENV)
    if differing:
        return f"{', '.join(differing)} differ from the server's, and are read at import"
    return None


def _take_on(request: dict, fds: list[int]) -> None:
    """In the forked child: become the launch that asked (streams, session, environment, directory,
    PYTHONPATH and its sitecustomize), then run the launcher; never returns."""
    import atexit
    import runpy

    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        added = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:0] = added
        for folder in added:
            if os.path.isfile(os.path.join(folder, "sitecustomize.py")):
                runpy.run_path(os.path.join(folder, "sitecustomize.py"), run_name="sitecustomize")
        from examples.multimodal_dev.launcher import torchrun

        # the engine is imported here: the ranks fork with nothing left to import, from a forkserver
        # forked from this process rather than one that would import the engine again
        os.environ.setdefault(torchrun.FORK_SWITCH, "1")
        if os.environ[torchrun.FORK_SWITCH] == "1":
            _fork_the_forkserver()
        sys.argv = [torchrun.__file__, *request["argv"]]
        code = torchrun.main(request["argv"])
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        try:
            atexit._run_exitfuncs()  # as the launcher's interpreter would at its end
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _fork_the_forkserver() -> None:
    """multiprocessing's forkserver, forked from this process, which holds the engine already: what
    ``ForkServer.ensure_running`` sets up, with ``os.fork`` in place of a fresh interpreter that would
    import the engine again. Before any thread of torchrun's starts: the forkserver is forked from a
    process of one Python thread, as the ranks are from it."""
    from multiprocessing import connection, forkserver, resource_tracker

    resource_tracker.ensure_running()
    address = connection.arbitrary_address("AF_UNIX")
    listener = private_listener(address)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            forkserver.main(listener.fileno(), alive_r, [])  # serves until every client has closed alive_w
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


def _listen(address: str) -> socket.socket:
    """A listening socket at ``address``; a socket file of this user's left by a server that died is
    replaced, one that a server answers on is refused in one line, and so is anything else there: a
    path is only ever removed when it is this user's socket and nobody listens on it."""
    try:
        return private_listener(address)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise SystemExit(f"warm_engine.py: {address}: {err.strerror}") from None
    try:
        problem = own_socket_problem(address)
    except OSError as err:  # gone since the bind failed
        raise SystemExit(f"warm_engine.py: {address}: {err.strerror}") from None
    if problem:
        raise SystemExit(f"warm_engine.py: {address} exists and is {problem}: name a path that does not exist")
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(address)
    except ConnectionRefusedError:  # nobody listens: what a dead server left
        os.unlink(address)
        return private_listener(address)
    except OSError as err:
        raise SystemExit(f"warm_engine.py: {address}: {err.strerror}") from None
    finally:
        probe.close()
    raise SystemExit(f"warm_engine.py: {address}: a warm engine serves there already")


def _identity(address: str) -> tuple[int, int] | None:
    try:
        info = os.lstat(address)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _remove_own(address: str, identity: tuple[int, int]) -> None:
    """Remove the server's socket file, unless something else has taken its path since."""
    if _identity(address) == identity:
        os.unlink(address)


class _Server:
    def __init__(self, address: str):
        import selectors

        self.listener = _listen(address)
        self.identity = _identity(address)  # the file this server made: the only one it removes
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        # started by a program (stdin a pipe): it ends when that program does, seen as the pipe's end or,
        # where a process the program forked holds the pipe open, as a new parent
        self.parent = _START_PARENT if stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode) else None
        if self.parent is not None:
            self.selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
        self.jobs: dict[int, socket.socket] = {}  # child pid -> its launcher's connection
        self.dropped: dict[int, float] = {}  # child pid -> when its launcher vanished
        # a dropped job's processes as last seen: torchrun starts each rank in a session of its own, out of
        # the job's process group, and a rank whose agent is killed is reparented and out of its tree too
        self.members: dict[int, list] = {}

    def serve(self) -> None:
        import time

        while True:
            for key, _ in self.selector.select(timeout=0.2):
                if key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):
                        return  # whoever started the server is gone
                elif key.data == "accept":
                    self._accept()
                else:  # a launcher's connection became readable: it closed (it sends nothing more)
                    self._drop(key.data, time.monotonic())
            self._reap()
            if self.parent is not None and os.getppid() != self.parent:
                return
            for pid, since in list(self.dropped.items()):
                if time.monotonic() - since > GRACE_S:
                    self._signal_job(pid, signal.SIGKILL)
                    if pid not in self.jobs:  # the child is reaped and every process it left is killed
                        self.dropped.pop(pid)
                        self.members.pop(pid, None)

    def _accept(self) -> None:
        import selectors

        conn, _ = self.listener.accept()
        conn.settimeout(30)
        fds: list[int] = []
        try:
            send(conn, HELLO)  # first: a launcher sends nothing to a socket that has not said this
            _, fds, _, _ = socket.recv_fds(conn, 1, 3)
            request = receive(conn)
        except (OSError, ForeignPeer):
            request = None
        if request is None or len(fds) != 3 or not isinstance(request.get("env"), dict):
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        refusal = _refusal(request["env"])
        if refusal:
            send(conn, {"refused": refusal})
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        send(conn, {"running": True})
        pid = os.fork()
        if pid == 0:
            self.selector.close()
            self.listener.close()
            for other in (conn, *self.jobs.values()):
                other.close()
            _take_on(request, fds)
        for fd in fds:
            os.close(fd)
        self.jobs[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _drop(self, pid: int, now: float) -> None:
        self.selector.unregister(self.jobs[pid])
        self.dropped[pid] = now
        self._signal_job(pid, signal.SIGTERM)

    def _signal_job(self, pid: int, sig: int) -> None:
        """``sig`` to the job's process group and to every process of the job seen so far."""
        import psutil

        known = self.members.setdefault(pid, [])
        try:
            known += [p for p in psutil.Process(pid).children(recursive=True) if p not in known]
        except psutil.NoSuchProcess:
            pass
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        for process in known:
            try:
                process.send_signal(sig)  # psutil checks it is still that process, not a reused pid
            except psutil.NoSuchProcess:
                pass

    def _reap(self) -> None:
        while self.jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.jobs.pop(pid, None)
            if conn is None:  # a child of the server's own (none is expected): reaped, nothing to tell
                continue
            if pid not in self.dropped:
                self.selector.unregister(conn)
                try:
                    send(
                        conn,
                        {
                            "exit": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1,
                            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                        },
                    )
                except OSError:
                    pass
            conn.close()


def main(argv: list[str]) -> int:
    usage = "usage: python tests/warm_engine.py SOCKET"
    if argv in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}")
        return 0
    if len(argv) != 1:
        print(usage, file=sys.stderr)
        return 2
    import importlib

    import torch

    from examples.multimodal_dev.launcher import torchrun

    if torch.cuda.is_available():
        print(
            "warm_engine.py: this host has CUDA; a process forked after CUDA was initialised cannot use it "
            "(launch without ENGINE_SERVER)",
            file=sys.stderr,
        )
        return 2
    for module in (*torchrun.PRELOAD, "torch.distributed.run", "torch.distributed.launcher.api"):
        importlib.import_module(module)
    _IMPORTED_ENV.update(os.environ)
    server = _Server(argv[0])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"warm_engine.py: serving {argv[0]}", file=sys.stderr, flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:  # ^C where it runs in the foreground: the same end as SIGTERM
        pass
    finally:
        for pid in list(server.jobs):
            server._signal_job(pid, signal.SIGKILL)
        _remove_own(argv[0], server.identity)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
