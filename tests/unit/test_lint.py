"""The code is formatted and lint-clean under ``pyproject.toml``'s settings: ``ruff format --check``
and ``ruff check`` over the repository, with the ruff pinned in ``.lint/`` (``tests/lint_install.py``;
offline, this test skips with pip's line)."""

import ast
import os
import subprocess
import sys

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


def _seam_files() -> list[str]:
    """The files ``pyproject.toml``'s ``[tool.pyrefly]`` checks (folders read for their ``.py`` files)."""
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        includes = tomllib.load(f)["tool"]["pyrefly"]["project-includes"]
    files = []
    for include in includes:
        path = os.path.join(ROOT, include)
        files += (
            sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".py"))
            if os.path.isdir(path)
            else [path]
        )
    return files


def test_the_seams_type_check(ruff):
    """pyrefly, pinned beside ruff, over the seams ``pyproject.toml`` names, against the training
    environment's packages (torch, megatron-core): no error."""
    from lint_install import PYREFLY

    proc = subprocess.run(
        [PYREFLY, "check", "--python-interpreter-path", sys.executable],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"run: .lint/lib/bin/pyrefly check\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


def test_the_type_check_finds_a_planted_fault(ruff, tmp_path):
    """The checker reads the launcher's types: a RunConfig section given a string where a number goes."""
    from lint_install import PYREFLY

    planted = tmp_path / "planted.py"
    planted.write_text(
        "from examples.multimodal_dev.launcher.run_config import Layout\n\nLayout(tp='2').processes + 1\n"
    )
    proc = subprocess.run(
        [PYREFLY, "check", "--preset", "default", "--python-interpreter-path", sys.executable, str(planted)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "bad-argument-type" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _public_functions(tree: ast.Module):
    """Module-level functions and the methods of module-level classes, not named with ``_``."""
    for node in tree.body:
        members = node.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_") else [node]
        for member in members:
            if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)) and not member.name.startswith("_"):
                yield member


def test_the_seams_public_functions_are_annotated():
    """Every parameter and the return of every public function of the seams: a signature a reader (and
    the checker) can trust without reading the body."""
    missing = []
    for path in _seam_files():
        with open(path) as f:
            tree = ast.parse(f.read())
        for fn in _public_functions(tree):
            a = fn.args
            params = [p for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg not in ("self", "cls")]
            params += [p for p in (a.vararg, a.kwarg) if p]
            names = [p.arg for p in params if p.annotation is None] + (["return"] if fn.returns is None else [])
            if names:
                missing.append(f"{os.path.relpath(path, ROOT)}:{fn.lineno} {fn.name}: {', '.join(names)}")
    assert not missing, "\n".join(missing)


LONGEST_FUNCTION = 60  # lines, from ``def`` to its last line


def test_no_product_function_is_longer_than_a_screen():
    """A function a reader takes in at once: the product (``examples/``, ``megatron/cpu``) has none
    over ``LONGEST_FUNCTION`` lines; a longer one is split into steps with names."""
    long = []
    for top in ("examples/multimodal_dev", "megatron/cpu"):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in sorted(n for n in names if n.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                for fn in ast.walk(tree):
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = fn.end_lineno - fn.lineno + 1
                        if lines > LONGEST_FUNCTION:
                            long.append(f"{os.path.relpath(path, ROOT)}:{fn.lineno} {fn.name}: {lines} lines")
    assert not long, "\n".join(long)
