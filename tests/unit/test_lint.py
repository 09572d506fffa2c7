"""The code is formatted and lint-clean under ``pyproject.toml``'s settings: ``ruff format --check``
and ``ruff check`` over the repository, with the ruff pinned in ``.lint/`` (``tests/lint_install.py``;
offline, this test skips with pip's line)."""

import os
import subprocess

import pytest
from lint_install import BINARY, RUFF

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ruff():
    reason = RUFF.missing_reason()
    if reason:
        pytest.skip(reason)

    def run(*args):
        return subprocess.run([BINARY, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)

    return run


def test_the_code_is_formatted(ruff):
    proc = ruff("format", "--check", ".")
    assert proc.returncode == 0, f"run: .lint/lib/bin/ruff format .\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"


def test_the_code_is_lint_clean(ruff):
    proc = ruff("check", "--output-format", "concise", ".")
    assert proc.returncode == 0, f"run: .lint/lib/bin/ruff check --fix .\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"


def test_the_check_finds_a_planted_fault(ruff, tmp_path):
    """The settings are read and applied: an unused import and a long line are reported."""
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n" + "x = '" + "a" * 130 + "'\n")
    proc = ruff("check", "--config", os.path.join(ROOT, "pyproject.toml"), "--output-format", "concise", str(planted))
    assert proc.returncode == 1 and "F401" in proc.stdout and "E501" in proc.stdout, proc.stdout
