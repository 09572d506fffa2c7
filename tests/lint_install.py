"""The linter and formatter (ruff), pinned, in a folder of its own (``.lint/`` at the repository
root): a tool of the tests, not of training. ``tests/unit/test_lint.py`` runs ``.lint/lib/bin/ruff``
with the settings of ``pyproject.toml``.

    python tests/lint_install.py     (bash tests/run.sh runs it after the bootstrap)
"""

from __future__ import annotations

import os

from pinned_folder import PinnedFolder

RUFF = PinnedFolder(
    "ruff", ".lint", ("ruff==0.17.6",), "tests/lint_install.py", "lint and format checks of tests/unit/test_lint.py"
)
BINARY = os.path.join(RUFF.lib, "bin", "ruff")

if __name__ == "__main__":
    RUFF.main()
