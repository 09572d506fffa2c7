"""Every command users run answers ``--help`` at once and says nothing else: torch's and megatron-core's
import notices (eight lines of them before convert_checkpoint's usage) come only after the arguments
are read. Each tool runs in an interpreter of its own, as a user runs it."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = sorted(
    n[:-3]
    for n in os.listdir(os.path.join(ROOT, "examples", "multimodal_dev", "tools"))
    if n.endswith(".py") and n != "__init__.py"
)
# Runs the tool's --help, then says which heavy packages the run imported.
_RUNNER = r"""
import runpy, sys
sys.argv = [sys.argv[1], "--help"]
try:
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code or 0
heavy = sorted({m.split(".")[0] + "." + m.split(".")[1] for m in sys.modules if m.startswith("megatron.") and "." in m})
print("IMPORTED", ",".join(heavy), "EXIT", code, file=sys.__stdout__)
"""


@pytest.mark.parametrize("tool", TOOLS)
def test_help_is_quiet_and_imports_no_megatron(tool):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))}
    run = subprocess.run(
        [sys.executable, "-c", _RUNNER, f"examples.multimodal_dev.tools.{tool}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "usage:" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stderr == "", run.stderr[-2000:]
    last = run.stdout.strip().splitlines()[-1]
    assert last == "IMPORTED  EXIT 0", last  # no megatron.* module, exit status 0
