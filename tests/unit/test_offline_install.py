"""Offline install: ``tools/make_wheelhouse.py`` fetches what an interpreter that already has torch
lacks; the bootstrap installs it with every index off (``WHEELHOUSE``), into the interpreter's
prefix or, when that prefix is read-only, only the missing packages into ``PYDEPS_DIR``;
``run_qwen35_vl.sh`` then trains.

A target is a fresh venv that sees some of this checkout's packages through a ``.pth`` file to a
folder of symlinks, as a GPU image sees its preinstalled torch: torch and its own dependencies
only, for the wheelhouse and the training run. Building the wheelhouse
needs PyPI: the tests skip with the reason when it cannot be reached."""

import os
import platform
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _index_unreachable():
    """Why the package index cannot be reached (one HEAD request, 5 s at most), or None. A TCP
    connect alone is not enough: a proxy may accept every connection and fail the TLS handshake."""
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/"
    try:
        context = ssl.create_default_context(cafile=os.environ.get("PIP_CERT"))  # pip's CA bundle, if set
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=5, context=context).close()
    except OSError as err:  # URLError, timeouts and TLS errors are OSErrors
        return f"package index unreachable ({url}: {err}); building a wheelhouse needs it"
    return None


def _torch_closure() -> list:
    """torch and everything it requires, transitively (extras included), as installed here."""
    dists = {_canonical(d.metadata["Name"]): d for d in metadata.distributions()}
    todo, done, found = [("torch", frozenset())], set(), {}
    while todo:
        name, extras = todo.pop()
        name = _canonical(name)
        if (name, extras) in done or name not in dists:
            continue
        done.add((name, extras))
        found[name] = dists[name]
        for line in dists[name].requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((req.name, frozenset(req.extras)))
    return list(found.values())


def _link_present(folder: Path, dists: list) -> Path:
    """Symlinks to these installed distributions (their packages and .dist-info) in `folder`, which a
    venv then imports as if installed; returns their freeze file."""
    folder.mkdir()
    for dist in dists:
        site = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or []}:
            if top not in ("..", "__pycache__") and not (folder / top).exists() and (site / top).exists():
                (folder / top).symlink_to(site / top)
    freeze = folder.parent / f"{folder.name}-freeze.txt"
    freeze.write_text("".join(sorted(f"{d.metadata['Name']}=={d.version}\n" for d in dists)))
    return freeze


def _current_platform() -> str:
    libc, version = platform.libc_ver()
    if libc != "glibc":
        pytest.skip(f"wheelhouse test targets manylinux; this host's C library is {libc or 'unknown'}")
    major, minor = version.split(".")[:2]
    return f"manylinux_{major}_{minor}_{platform.machine()}"


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    reason = _index_unreachable()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("offline")
    freeze = _link_present(tmp / "present", _torch_closure())
    start = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "make_wheelhouse.py"),
            str(tmp / "wheels"),
            "--freeze",
            str(freeze),
            "--platform",
            _current_platform(),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = sorted((tmp / "wheels").glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"\nwheelhouse: {len(wheels)} wheels, {size:.1f} MiB, built in {seconds:.1f} s")
    yield tmp / "wheels", tmp / "present"
    shutil.rmtree(tmp, ignore_errors=True)  # ~180 MiB; pytest would keep it for three sessions


@pytest.fixture
def scratch(tmp_path):
    """tmp_path, emptied afterwards: each venv here holds a few hundred MiB of installed packages."""
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


def _fresh_venv(path: Path, present: Path) -> Path:
    """A venv (with pip, from the bundled ensurepip wheel: no network) that imports the present torch."""
    proc = subprocess.run([str(BASE_PYTHON), "-m", "venv", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:  # e.g. a Debian Python without python3-venv
        pytest.skip(f"{BASE_PYTHON} -m venv failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    site = next(path.glob("lib/python3.*/site-packages"))
    (site / "present_torch.pth").write_text(f"{present}\n")
    return path / "bin" / "python"


def _offline_env(**extra) -> dict:
    """No pip configuration (its find-links and extra indexes would be other sources), no index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", HF_HUB_OFFLINE="1", **extra)
    return {k: str(v) for k, v in env.items()}


def _bootstrap(env: dict, then: str = "true") -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f"source tools/bootstrap_env.sh && {then}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _make_read_only(folder: Path):
    """chmod 555; root ignores that, so also the immutable attribute (root cannot write there either)."""
    folder.chmod(0o555)
    if os.access(folder, os.W_OK) and shutil.which("chattr"):
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    return not os.access(folder, os.W_OK)


def _make_writable(folder: Path):
    if shutil.which("chattr"):
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


@pytest.mark.network
def test_wheelhouse_lacks_present_packages(wheelhouse):
    wheels, _ = wheelhouse
    names = {_canonical(w.name.split("-")[0]) for w in wheels.glob("*.whl")}
    present = {_canonical(d.metadata["Name"]) for d in _torch_closure()}
    assert "megatron-core" in names and "torchvision" in names and "transformers" in names
    assert not names & present, f"fetched what the target has: {sorted(names & present)}"


@pytest.mark.network
def test_offline_install_then_training(wheelhouse, scratch):
    wheels, present = wheelhouse
    python = _fresh_venv(scratch / "venv", present)
    start = time.perf_counter()
    proc = subprocess.run(
        ["bash", str(ROOT / "run_qwen35_vl.sh")],
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=600,
        env=_offline_env(PYTHON=python, WHEELHOUSE=wheels, TRAIN_ITERS=3, SEQ_LEN=256, MASTER_PORT=_free_port()),
    )
    seconds = time.perf_counter() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "installing requirements" in proc.stderr
    loss = re.search(r"iteration\s+3/\s*3 \|.*?lm loss: ([-+0-9.eE]+)", log)
    assert loss, log[-4000:]
    print(f"\noffline install + 3 iterations: {seconds:.1f} s, iteration 3 lm loss {float(loss.group(1))}")
    assert 0 < float(loss.group(1)) < 20
    # torch stayed the present one: nothing of its closure went into the venv itself
    where = subprocess.run(
        [str(python), "-c", "import torch; print(torch.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env=_offline_env(),
    ).stdout.strip()
    assert where.startswith(str(present)), where
    assert not list((scratch / "venv").glob("lib/python3.*/site-packages/torch"))


# Present in the read-only test's venv: everything this checkout has except these (and pip, which
# the venv brings), so the install beside it is small and its contents say what was missing.
MISSING = ("megatron-core", "transformers", "qwen-vl-utils")


@pytest.mark.network
def test_read_only_prefix_installs_only_the_missing_into_pydeps(wheelhouse, scratch):
    wheels, _ = wheelhouse
    dists = [d for d in metadata.distributions() if _canonical(d.metadata["Name"]) not in (*MISSING, "pip")]
    _link_present(scratch / "present", dists)
    python = _fresh_venv(scratch / "venv", scratch / "present")
    site = next((scratch / "venv").glob("lib/python3.*/site-packages"))
    pydeps = scratch / "pydeps"
    try:
        if not _make_read_only(site):
            pytest.skip(f"cannot make {site} read-only here (neither chmod 555 nor chattr +i)")
        empty = scratch / "empty"
        empty.mkdir()
        proc = _bootstrap(_offline_env(PYTHON=python, WHEELHOUSE=empty, PYDEPS_DIR=pydeps))
        errors = [line for line in proc.stderr.splitlines() if "has no wheel for" in line]
        assert proc.returncode == 1 and len(errors) == 1 and f"WHEELHOUSE={empty}" in errors[0], proc.stderr
        assert "ERROR" not in proc.stderr, proc.stderr  # pip's own screenful is replaced by that line

        # The wheelhouse in two parts, as a machine that takes a limited size a call receives it: the
        # transformers wheel alone first (installed as it is), then the rest, whose resolution sees it.
        parts = {"first": scratch / "first", "rest": scratch / "rest"}
        for folder in parts.values():
            folder.mkdir()
        for wheel in wheels.glob("*.whl"):
            shutil.copy(wheel, parts["first" if _canonical(wheel.name.split("-")[0]) == "transformers" else "rest"])
        proc = _bootstrap(
            _offline_env(PYTHON=python, WHEELHOUSE=parts["first"], PYDEPS_DIR=pydeps, BOOTSTRAP_WHEELS_ONLY=1)
        )
        assert proc.returncode == 0 and "installing the 1 wheels" in proc.stderr, proc.stderr[-4000:]
        assert not (pydeps / ".requirements.sha256").exists()  # the requirements are not all in yet

        show = '"$PY" -c "import megatron.core, transformers, numpy; print(transformers.__file__, numpy.__file__)"'
        env = _offline_env(PYTHON=python, WHEELHOUSE=parts["rest"], PYDEPS_DIR=pydeps)
        proc = _bootstrap(env, then=show)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert f"into {pydeps}" in proc.stderr, proc.stderr
        transformers_file, numpy_file = proc.stdout.split()
        assert transformers_file.startswith(str(pydeps)) and numpy_file.startswith(str(scratch / "present"))
        installed = {_canonical(p.name[: -len(".dist-info")].rsplit("-", 1)[0]) for p in pydeps.glob("*.dist-info")}
        have = {_canonical(d.metadata["Name"]) for d in dists}
        assert set(MISSING) <= installed and not installed & have, sorted(installed)
        assert (pydeps / ".requirements.sha256").is_file()

        proc = _bootstrap(env, then=show)  # the stamp: nothing to install the second time
        assert proc.returncode == 0 and "installing" not in proc.stderr, proc.stderr
    finally:
        _make_writable(site)


def test_missing_wheelhouse_is_one_line():
    proc = _bootstrap(_offline_env(WHEELHOUSE="/nonexistent/wheels"))
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "[bootstrap] WHEELHOUSE=/nonexistent/wheels is not a directory (write one with tools/make_wheelhouse.py)"
    )
