"""tools/wheel_archive.py: a folder of wheels packed as one tar.xz of uncompressed wheels, unpacked the
way tests/gpu/run.sh unpacks it, still installs with pip offline. The wheels are built here (zipfile);
nothing is downloaded."""

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "wheel_archive.py"


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _wheel(folder: Path, name: str, version: str, files: dict) -> Path:
    """A pure-Python wheel, deflated as wheels are, with a RECORD of its members' hashes."""
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{member},{_hash(text.encode())},{len(text.encode())}\n" for member, text in files.items())
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, text in files.items():
            zf.writestr(member, text)
        zf.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")
    return path


def _tool():
    """tools/ is a folder of scripts, not a package: load the script as a module by its path."""
    spec = importlib.util.spec_from_file_location("wheel_archive", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args, **kwargs):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=120, **kwargs)


@pytest.fixture
def wheelhouse(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    body = "VALUE = 42\n" + "# repeated text xz finds across wheels\n" * 200
    _wheel(folder, "tinyone", "1.0", {"tinyone/__init__.py": body})
    _wheel(folder, "tinytwo", "2.0", {"tinytwo/__init__.py": body.replace("42", "43")})
    return folder


def test_packed_wheels_unpack_and_install_offline(wheelhouse, tmp_path):
    tool = _tool()

    archive = tmp_path / "wheelhouse.tar.xz"
    sizes = tool.pack(str(wheelhouse), str(archive))
    assert sizes["wheels"] == 2 and 0 < sizes["archive bytes"] < sizes["wheel bytes"]
    with tarfile.open(archive, "r:xz") as tar:
        assert sorted(tar.getnames()) == sorted(os.listdir(wheelhouse))

    unpacked = tmp_path / "unpacked"  # as tests/gpu/run.sh does it
    proc = _run(TOOL, "unpack", archive, unpacked)
    assert proc.returncode == 0 and "2 wheels" in proc.stdout, proc.stderr
    for wheel in unpacked.iterdir():
        with zipfile.ZipFile(wheel) as zf:
            assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}
        assert tool.record_mismatches(str(wheel)) == []  # RECORD hashes contents: re-zipping keeps it valid

    target = tmp_path / "site"
    proc = _run(
        "-m", "pip", "install", "-q", "--no-index", "--find-links", unpacked, "--target", target, "tinyone",
        env={**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    proc = _run("-c", "import tinyone; print(tinyone.VALUE)", env={**os.environ, "PYTHONPATH": str(target)})
    assert proc.stdout.strip() == "42", proc.stderr


def test_a_changed_member_is_caught(wheelhouse, tmp_path):
    tool = _tool()

    wheel = next(wheelhouse.glob("tinyone-*.whl"))
    tampered = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tampered, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, data.replace(b"42", b"41") if info.filename.endswith(".py") else data)
    assert tool.record_mismatches(str(tampered)) == ["tinyone/__init__.py"]


def test_an_archive_with_more_than_wheels_is_refused(tmp_path):
    archive = tmp_path / "odd.tar.xz"
    (tmp_path / "notes.txt").write_text("not a wheel")
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(tmp_path / "notes.txt", arcname="../notes.txt")
    proc = _run(TOOL, "unpack", archive, tmp_path / "out")
    assert proc.returncode != 0 and "holds more than wheels" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
