"""The linter and formatter (ruff) and the type checker (pyrefly), pinned, in a folder of their own
(``.lint/`` at the repository root): tools of the tests, not of training. ``tests/unit/test_lint.py``
runs ``.lint/lib/bin/ruff`` and ``.lint/lib/bin/pyrefly`` with the settings of ``pyproject.toml``.

    python tests/lint_install.py     (bash tests/run.sh runs it after the bootstrap)
"""

from __future__ import annotations

import os

from pinned_folder import PinnedFolder

RUFF = PinnedFolder(
    "ruff and pyrefly",
    ".lint",
    ("ruff==0.17.6", "pyrefly==1.5.0"),
    "tests/lint_install.py",
    "lint, format and type checks of tests/unit/test_lint.py",
)
BINARY = os.path.join(RUFF.lib, "bin", "ruff")
PYREFLY = os.path.join(RUFF.lib, "bin", "pyrefly")

if __name__ == "__main__":
    RUFF.main()
