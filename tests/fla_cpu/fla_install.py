"""flash-linear-attention (FLA), pinned, in a folder of its own (``.fla/`` at the repository root),
never in the training environment: there FLA would import on a CPU host and be picked for
GatedDeltaNet. Only the tests of this folder put ``.fla/lib`` on a subprocess's ``PYTHONPATH``.

    python tests/fla_cpu/fla_install.py     (bash tests/run.sh runs it after the bootstrap)

The wheels are pure Python and installed without dependencies (``tests/pinned_folder.py``): Triton
and torch are the training environment's, and einops (FLA's one other requirement) comes along pinned.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for pinned_folder

from pinned_folder import ROOT, PinnedFolder  # noqa: E402, F401  (ROOT: for the tests of this folder)

FLA = PinnedFolder(
    "FLA",
    ".fla",
    ("fla-core==0.6.0", "flash-linear-attention==0.6.0", "einops==0.8.2"),
    "tests/fla_cpu/fla_install.py",
    "FLA's kernels checked on CPU under Triton's interpreter",
)
FOLDER, LIB, PINS = FLA.folder, FLA.lib, FLA.pins
installed, missing_reason, install = FLA.installed, FLA.missing_reason, FLA.install

if __name__ == "__main__":
    FLA.main()
