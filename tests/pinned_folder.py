"""Test tools pinned in a folder of their own at the repository root, never in the training
environment: flash-linear-attention (``.fla/``, ``fla_cpu/fla_install.py``) and the linter
(``.lint/``, ``lint_install.py``). ``bash tests/run.sh`` installs both after the bootstrap.

The wheels are installed without dependencies into ``FOLDER/lib``. ``FOLDER/pins.txt``, written last,
records what ``lib/`` holds; with the same pins nothing runs. A failed install (no package index, a
``WHEELHOUSE`` without these wheels) leaves one line in ``FOLDER/failed.txt``, which the tests that
need the tool report: FLA's kernel tests skip with it, the lint and type checks fail with it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _pip_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    line = ((errors or lines or ["pip gave no output"])[-1])[:300]
    # With no index pip ends on "No matching distribution"; its retry warnings name the cause.
    unreachable = any("NewConnectionError" in ln or "connection broken" in ln for ln in lines)
    return line + (" (the package index is unreachable)" if unreachable else "")


class PinnedFolder:
    def __init__(self, what: str, name: str, pins: tuple[str, ...], installer: str, purpose: str):
        self.folder = os.path.join(ROOT, name)
        self.lib = os.path.join(self.folder, "lib")
        self.what, self.pins, self.installer, self.purpose = what, pins, installer, purpose
        self._stamp, self._failed = os.path.join(self.folder, "pins.txt"), os.path.join(self.folder, "failed.txt")

    def installed(self) -> bool:
        return _read(self._stamp) == " ".join(self.pins) and os.path.isdir(self.lib)

    def missing_reason(self) -> str | None:
        """None when ``lib/`` holds the pins, else one line: why not, and how to install."""
        if self.installed():
            return None
        last = _read(self._failed)
        return (
            f"{self.what} is not installed in {os.path.basename(self.folder)}/ (python {self.installer}; "
            "bash tests/run.sh runs it)" + (f": {last}" if last else "")
        )

    def install(self, python: str = sys.executable) -> str | None:
        """Install the pins into ``lib/`` unless there already; returns None or the failure's line."""
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, "lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs at once install once
            if self.installed():
                return None
            # pip writes into a fresh folder that replaces lib/ only when complete; the stamp comes last,
            # so an interrupted install is redone rather than trusted.
            fresh = self.lib + ".new"
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
                *self.pins,
            ]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                failure = None if proc.returncode == 0 else _pip_error(proc.stderr)
            except (OSError, subprocess.TimeoutExpired) as err:
                failure = f"{type(err).__name__}: {err}"
            if failure:
                shutil.rmtree(fresh, ignore_errors=True)
                failure = (
                    f"pip could not install {' '.join(self.pins)}"
                    f"{' from ' + wheelhouse if wheelhouse else ''}: {failure}"
                )
                with open(self._failed, "w") as f:
                    f.write(failure + "\n")
                return failure
            shutil.rmtree(self.lib, ignore_errors=True)
            os.replace(fresh, self.lib)
            with open(self._stamp, "w") as f:
                f.write(" ".join(self.pins) + "\n")
            if os.path.exists(self._failed):
                os.remove(self._failed)
            return None

    def main(self) -> None:
        if self.installed():
            return
        tag = os.path.basename(self.folder).lstrip(".")
        print(
            f"[{tag}] installing {' '.join(self.pins)} into {os.path.relpath(self.lib, ROOT)}/ ({self.purpose})",
            file=sys.stderr,
            flush=True,
        )
        failure = self.install()
        if failure:  # the tests that need it report this line (skipped or failed); the rest of the suite runs
            print(f"[{tag}] {failure}", file=sys.stderr, flush=True)
