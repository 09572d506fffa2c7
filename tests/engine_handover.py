"""The launcher's side of the tests' warm engine (``tests/warm_engine.py``): hand a launch over to the
server of ``ENGINE_SERVER``, and the messages both sides send (a length, then JSON).

Imported by ``tests/hooks/sitecustomize.py`` in the torchrun launcher (``launcher/torchrun.py``) before
anything heavy: a launch that the server runs imports nothing more than this.

A launch hands over its environment and its standard streams, so the launcher trusts a server only
as far as it proves itself: the socket must be this user's (its file and the process serving it),
and the server speaks first (``HELLO``) before the launcher sends anything. Anything else (another
user's socket, a foreign protocol, silence past ``ANSWER_TIMEOUT_S``) is one line, and the launch
starts cold.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import struct
import sys

SERVER_VARIABLE = "ENGINE_SERVER"
_HEADER = struct.Struct("!Q")
HELLO = {"warm_engine": 1}  # the server's first message on every connection: protocol and version
ANSWER_TIMEOUT_S = 10.0  # for the server's hello and its answer to a request (the job itself has no limit)
MAX_MESSAGE = 64 << 20  # a launch's request (its environment) is kilobytes; a foreign length is refused


class ForeignPeer(Exception):
    """The other end of the socket does not speak this protocol."""


def private_listener(address: str) -> socket.socket:
    """A Unix socket listening at ``address`` that only this user may connect to (the warm engine's
    server, and the forkserver a warm launcher forks)."""
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(address)
    except OSError:
        listener.close()
        raise
    os.chmod(address, 0o600)
    listener.listen()
    return listener


def send(sock: socket.socket, payload: dict) -> None:
    data = json.dumps(payload).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket) -> dict | None:
    """The next message (None: the peer closed); ``ForeignPeer`` for bytes that are not one."""
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    size = _HEADER.unpack(header)[0]
    if size > MAX_MESSAGE:
        raise ForeignPeer(f"a message of {size} bytes")
    data = _read_exactly(sock, size)
    if data is None:
        return None
    try:
        message = json.loads(data)
    except ValueError:  # not UTF-8, not JSON
        raise ForeignPeer("a message that is not JSON") from None
    if not isinstance(message, dict):
        raise ForeignPeer("a message that is not a JSON object")
    return message


def own_socket_problem(address: str) -> str | None:
    """Why ``address`` is not a socket of this user's (None: it is one); ``OSError`` where nothing is there."""
    info = os.lstat(address)
    if not stat.S_ISSOCK(info.st_mode):
        return "not a socket"
    if info.st_uid != os.getuid():
        return f"a socket of user id {info.st_uid}, not this user's"
    return None


def _peer_uid(sock: socket.socket) -> int | None:
    if not hasattr(socket, "SO_PEERCRED"):  # Linux's; elsewhere the socket file's owner is the check
        return None
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


def _connect(address: str) -> socket.socket:
    """A connection to the warm engine at ``address`` that has said hello; ``ForeignPeer`` or
    ``OSError`` (``TimeoutError`` for silence) otherwise. Nothing is sent before the hello."""
    problem = own_socket_problem(address)
    if problem:
        raise ForeignPeer(problem)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.settimeout(ANSWER_TIMEOUT_S)
        sock.connect(address)
        uid = _peer_uid(sock)
        if uid is not None and uid != os.getuid():
            raise ForeignPeer(f"served by user id {uid}, not this user")
        hello = receive(sock)
        if hello != HELLO:
            raise ForeignPeer("it closed the connection" if hello is None else f"it says {str(hello)[:80]}")
    except BaseException:
        sock.close()
        raise
    return sock


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def hand_over(argv: list[str]) -> int | None:
    """Run ``argv`` (the launcher's arguments) on the server of ``ENGINE_SERVER``: its exit status, or
    None where there is no server or it refuses (the reason on stderr), and the launcher starts cold."""
    address = os.environ.get(SERVER_VARIABLE)
    if not address:
        return None
    try:
        sock = _connect(address)
    except ForeignPeer as err:
        print(
            f"torchrun: {SERVER_VARIABLE}={address}: not a warm engine of this user's ({err}); starting cold",
            file=sys.stderr,
        )
        return None
    except OSError as err:
        print(
            f"torchrun: {SERVER_VARIABLE}={address}: no warm engine answers ({_why(err)}); starting cold",
            file=sys.stderr,
        )
        return None
    try:
        socket.send_fds(sock, [b"R"], [0, 1, 2])
        send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()})
        answer = receive(sock)
        if answer is not None and not ("refused" in answer or answer.get("running") is True):
            raise ForeignPeer(f"it answered {str(answer)[:80]}")
    except (OSError, ForeignPeer) as err:
        print(f"torchrun: the warm engine at {address} failed the launch ({_why(err)}); starting cold", file=sys.stderr)
        sock.close()
        return None
    if answer is None or "refused" in answer:
        reason = answer["refused"] if answer else "it closed the connection"
        print(
            f"torchrun: the warm engine at {address} does not run this launch ({reason}); starting cold",
            file=sys.stderr,
        )
        sock.close()
        return None
    sock.settimeout(None)  # the job runs as long as it runs
    try:
        done = receive(sock)  # held open until the job ends: closing it ends the job
    except KeyboardInterrupt:  # the job is a session of its own: ^C reaches it through the server
        print("torchrun: interrupted; the warm engine ends the job", file=sys.stderr)
        return 130
    except (OSError, ForeignPeer) as err:
        print(f"torchrun: the warm engine at {address} stopped answering during the run ({_why(err)})", file=sys.stderr)
        return 1
    if done is None or not isinstance(done.get("exit"), int) or not isinstance(done.get("signal"), int):
        print(f"torchrun: the warm engine at {address} stopped during the run", file=sys.stderr)
        return 1
    if done["signal"]:
        if done["signal"] != signal.SIGKILL:  # SIGKILL has no handler to reset (EINVAL)
            signal.signal(done["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), done["signal"])  # as the launcher's own death by that signal
    return done["exit"]


def _why(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return f"no answer in {ANSWER_TIMEOUT_S:g} s"
    return getattr(err, "strerror", None) or str(err) or type(err).__name__
