"""flash-linear-attention (FLA), pinned, in a folder of its own (``.fla/`` at the repository root),
never in the training environment: there FLA would import on a CPU host and be picked for
GatedDeltaNet. Only the tests of this folder put ``.fla/lib`` on a subprocess's ``PYTHONPATH``.

    python tests/fla_cpu/fla_install.py     (bash tests/run.sh runs it after the bootstrap)

The wheels are pure Python and installed without dependencies: Triton and torch are the training
environment's, and einops (FLA's one other requirement) comes along pinned. ``.fla/pins.txt``, written
last, records what ``lib/`` holds; with the same pins nothing runs. A failed install (no package
index, a ``WHEELHOUSE`` without these wheels) leaves one line in ``.fla/failed.txt``, which the tests
give as their skip reason.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.path.join(ROOT, ".fla")
LIB = os.path.join(FOLDER, "lib")
PINS = ("fla-core==0.6.0", "flash-linear-attention==0.6.0", "einops==0.8.2")
_STAMP, _FAILED = os.path.join(FOLDER, "pins.txt"), os.path.join(FOLDER, "failed.txt")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def installed() -> bool:
    return _read(_STAMP) == " ".join(PINS) and os.path.isdir(LIB)


def missing_reason() -> str | None:
    """None when ``.fla/lib`` holds the pins, else one line: why not, and how to install."""
    if installed():
        return None
    last = _read(_FAILED)
    return "FLA is not installed in .fla/ (python tests/fla_cpu/fla_install.py; bash tests/run.sh runs it)" + (
        f": {last}" if last else ""
    )


def _pip_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    line = ((errors or lines or ["pip gave no output"])[-1])[:300]
    # With no index pip ends on "No matching distribution"; its retry warnings name the cause.
    unreachable = any("NewConnectionError" in ln or "connection broken" in ln for ln in lines)
    return line + (" (the package index is unreachable)" if unreachable else "")


def install(python: str = sys.executable) -> str | None:
    """Install the pins into ``.fla/lib`` unless there already; returns None or the failure's line."""
    os.makedirs(FOLDER, exist_ok=True)
    with open(os.path.join(FOLDER, "lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once install once
        if installed():
            return None
        # pip writes into a fresh folder that replaces lib/ only when complete; the stamp comes last,
        # so an interrupted install is redone rather than trusted.
        fresh = LIB + ".new"
        shutil.rmtree(fresh, ignore_errors=True)
        wheelhouse = os.environ.get("WHEELHOUSE")
        source = ["--no-index", "--find-links", os.path.abspath(wheelhouse)] if wheelhouse else []
        # One retry and a short timeout: with no package index this fails in seconds, not minutes.
        cmd = [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--retries",
            "1",
            "--timeout",
            "20",
            "--target",
            fresh,
            *source,
            *PINS,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            failure = None if proc.returncode == 0 else _pip_error(proc.stderr)
        except (OSError, subprocess.TimeoutExpired) as err:
            failure = f"{type(err).__name__}: {err}"
        if failure:
            shutil.rmtree(fresh, ignore_errors=True)
            failure = f"pip could not install {' '.join(PINS)}{' from ' + wheelhouse if wheelhouse else ''}: {failure}"
            with open(_FAILED, "w") as f:
                f.write(failure + "\n")
            return failure
        shutil.rmtree(LIB, ignore_errors=True)
        os.replace(fresh, LIB)
        with open(_STAMP, "w") as f:
            f.write(" ".join(PINS) + "\n")
        if os.path.exists(_FAILED):
            os.remove(_FAILED)
        return None


def main() -> None:
    if installed():
        return
    print(
        f"[fla] installing {' '.join(PINS)} into {os.path.relpath(LIB, ROOT)}/ (FLA's kernels checked on "
        "CPU under Triton's interpreter)",
        file=sys.stderr,
        flush=True,
    )
    failure = install()
    if failure:  # the FLA tests skip with this line; the rest of the suite runs
        print(f"[fla] {failure}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
