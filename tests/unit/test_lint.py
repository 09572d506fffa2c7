"""The code is formatted and lint-clean under ``pyproject.toml``'s settings (``ruff format --check`` and
``ruff check`` over the repository) and the product package type-checks (``pyrefly check``), with the
ruff and pyrefly pinned in ``.lint/`` (``tests/lint_install.py``). Where they are not installed or do not
run, these tests fail with the reason in one line: a check that cannot run has not passed."""

import ast
import fnmatch
import os
import subprocess
import sys
import tomllib

import pytest
from lint_install import BINARY, PYREFLY, RUFF

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "examples/multimodal_dev"
# The seams other code is written against: checked in full (no sub-config of pyproject.toml turns a kind
# of error off for them) and their public functions annotated.
SEAMS = (
    f"{PACKAGE}/launcher",
    f"{PACKAGE}/models/__init__.py",
    f"{PACKAGE}/models/entry.py",
    f"{PACKAGE}/models/qwen35_vl/entry.py",
    f"{PACKAGE}/arguments.py",
    f"{PACKAGE}/model_provider.py",
    f"{PACKAGE}/dataset_provider.py",
    f"{PACKAGE}/data/__init__.py",
    f"{PACKAGE}/data/batch.py",
    f"{PACKAGE}/checkpoint/optimizer_format.py",
)


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    """``tool`` run at the repository root; the test fails with one line where the tool is not installed
    or does not start or finish."""
    reason = RUFF.missing_reason()  # one folder holds both tools
    if reason:
        pytest.fail(reason, pytrace=False)
    try:
        return subprocess.run([tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.fail(f"{tool} could not run: {type(err).__name__}: {err}", pytrace=False)


@pytest.fixture(scope="module")
def ruff():
    return lambda *args: _run(BINARY, *args)


@pytest.fixture(scope="module")
def pyrefly():
    """pyrefly against the training environment's packages (this interpreter's: torch, megatron-core)."""
    return lambda *args: _run(PYREFLY, *args, "--python-interpreter-path", sys.executable)


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


def _pyrefly_config() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["pyrefly"]


def _python_files(path: str) -> list[str]:
    """``path`` relative to the root, or the ``.py`` files under it (a folder)."""
    if not os.path.isdir(os.path.join(ROOT, path)):
        return [path]
    return sorted(
        os.path.relpath(os.path.join(folder, n), ROOT)
        for folder, _, names in os.walk(os.path.join(ROOT, path))
        for n in names
        if n.endswith(".py")
    )


def _seam_files() -> list[str]:
    return [os.path.join(ROOT, f) for seam in SEAMS for f in _python_files(seam)]


def test_the_package_type_checks(pyrefly):
    """pyrefly over the whole product package (``pyproject.toml``'s ``[tool.pyrefly]``): no error."""
    proc = pyrefly("check")
    assert proc.returncode == 0, f"run: .lint/lib/bin/pyrefly check\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"


def test_the_type_check_covers_the_package_and_the_seams_in_full():
    """``project-includes`` is the product package, and every sub-config names files that exist and no seam:
    a sub-config left behind by a moved file, or one over a seam, would switch checks off unseen."""
    config = _pyrefly_config()
    assert config["project-includes"] == [PACKAGE], config["project-includes"]
    package = _python_files(PACKAGE)
    seams = [f for seam in SEAMS for f in _python_files(seam)]
    assert all(f in package for f in seams), [f for f in seams if f not in package]
    for sub in config.get("sub-config", []):
        glob = sub["matches"]  # fnmatch's * also matches "/": it finds at least what pyrefly's glob does
        assert any(fnmatch.fnmatch(f, glob) for f in package), f"sub-config {glob!r} matches no file of the package"
        assert not [f for f in seams if fnmatch.fnmatch(f, glob)], f"sub-config {glob!r} turns errors off in a seam"


def test_the_type_check_finds_a_planted_fault(pyrefly, tmp_path):
    """The checker reads the launcher's types: a RunConfig section given a string where a number goes."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from examples.multimodal_dev.launcher.run_config import Layout\n\nLayout(tp='2').processes + 1\n"
    )
    proc = pyrefly("check", "--preset", "default", str(planted))
    assert proc.returncode == 1 and "bad-argument-type" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_a_registered_model_is_held_to_the_contract(pyrefly, tmp_path):
    """Each seam of ``ModelEntry`` is typed with the signature the other layers call: an entry that puts
    one model function where another belongs (the packed rows' MRoPE for the padded batches') is refused."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import dataclasses\n\n"
        "from examples.multimodal_dev.models.qwen35_vl import mrope\n"
        "from examples.multimodal_dev.models.qwen35_vl.entry import ENTRY\n\n"
        "dataclasses.replace(ENTRY, padded_position_ids=mrope.packed_position_ids)\n"
    )
    proc = pyrefly("check", "--preset", "default", str(planted))
    assert proc.returncode == 1 and "padded_position_ids" in proc.stdout, proc.stdout + proc.stderr


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
