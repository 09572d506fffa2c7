"""The launcher's side of the warm engine (``training/warm_engine.py``): hand a launch over to the
server of ``ENGINE_SERVER``, and the messages both sides send (a length, then JSON).

Imported by ``training/torchrun_launcher.py`` before anything heavy: a launch that the server runs
imports nothing more than this.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys

SERVER_VARIABLE = "ENGINE_SERVER"
_HEADER = struct.Struct("!Q")


def send(sock: socket.socket, payload: dict) -> None:
    data = json.dumps(payload).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket) -> dict | None:
    header = _read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    data = _read_exactly(sock, _HEADER.unpack(header)[0])
    return None if data is None else json.loads(data)


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
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(address)
        socket.send_fds(sock, [b"R"], [0, 1, 2])
        send(sock, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()})
        answer = receive(sock)
    except OSError as err:
        print(
            f"torchrun: {SERVER_VARIABLE}={address}: no warm engine answers ({err.strerror or err}); starting cold",
            file=sys.stderr,
        )
        return None
    if answer is None or "refused" in answer:
        reason = answer["refused"] if answer else "it closed the connection"
        print(
            f"torchrun: the warm engine at {address} does not run this launch ({reason}); starting cold",
            file=sys.stderr,
        )
        return None
    try:
        done = receive(sock)  # held open until the job ends: closing it ends the job
    except KeyboardInterrupt:  # the job is a session of its own: ^C reaches it through the server
        print("torchrun: interrupted; the warm engine ends the job", file=sys.stderr)
        return 130
    if done is None:
        print(f"torchrun: the warm engine at {address} stopped during the run", file=sys.stderr)
        return 1
    if done["signal"]:
        signal.signal(done["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), done["signal"])  # as the launcher's own death by that signal
    return done["exit"]
