#!/usr/bin/env python3
"""Download every wheel a target interpreter lacks to run this project, for an offline install.

    python tools/make_wheelhouse.py DEST [--freeze FILE] [--gpu-extras]
                                         [--python-version 3.12] [--platform manylinux_2_28_x86_64]

then, on the target (no index is contacted):

    WHEELHOUSE=DEST PYTHON=/path/to/python3.12 bash tests/run.sh     # or run_qwen35_vl.sh

--freeze FILE   the target's `python -m pip list --format=freeze`. What it lists counts as present at
                that version and is not fetched (torch and its CUDA libraries, on every GPU image),
                unless a requirement rejects that version (pip on the target upgrades it then; the
                command names it). The kept versions pin the resolution, so what the folder brings
                works with what the target has.
--gpu-extras    also requirements-gpu.txt, as far as wheels exist; an extra that needs a source build
                is skipped with the reason.
--platform      manylinux_2_N_ARCH means glibc >= 2.N: every older manylinux tag is accepted too.
--pack FILE     also write DEST as one FILE.tar.xz of the wheels stored uncompressed
                (tools/wheel_archive.py: ~25% smaller than the folder, for a machine that takes a
                limited upload); WHEELHOUSE=FILE unpacks it on the target.

Works with the pip of the interpreter running it (pip >= 22.2). Run it with network access; it
ends with an offline resolution check (pip --no-index against DEST and the freeze only).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter still has pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
# Stand-in wheels for the freeze's packages carry this wheel build tag. pip ranks candidates of one
# version by tag preference, then build tag, so a stand-in with the target's best tag and this
# build number wins over the index's real wheel of the same version: the real torch (and its
# gigabytes of CUDA libraries) is never chosen, so never downloaded.
STUB_BUILD = "999999"
# Why an extra has no wheel, where the package's own page says so.
SOURCE_ONLY = {
    "transformer-engine-torch": "Transformer Engine's torch extension is published as source only and "
    "is compiled against the target's torch: use an image that ships Transformer Engine, or on the "
    "target run pip install --no-build-isolation 'transformer-engine[pytorch]' (needs CUDA and a compiler)",
}
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def fail(message: str) -> None:
    print(f"make_wheelhouse: {message}", file=sys.stderr)
    sys.exit(1)


def say(message: str) -> None:
    print(f"make_wheelhouse: {message}", flush=True)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: Path) -> list:
    reqs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-"):
            fail(f"{path}:{number}: '{line}': pip options in a requirements file are not supported here")
        reqs.append(Requirement(line))
    return reqs


def read_freeze(path: Path) -> dict:
    """{canonical name: (name, version)} from `pip list --format=freeze` / `pip freeze` output."""
    present = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):  # options; editable checkouts are the target's own
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*===?\s*(\S+)", line)
        if not m:
            fail(
                f"--freeze {path}:{number}: '{line}' is not NAME==VERSION; write the file with "
                "`python -m pip list --format=freeze` (pip freeze prints URLs for some installs)"
            )
        present[canonical(m.group(1))] = (m.group(1), m.group(2))
    return present


def expand_platform(platform: str) -> list:
    """manylinux_2_N_ARCH -> itself and every older manylinux tag (pip does not widen these itself)."""
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
    tags = []
    for v in range(minor, 4, -1):
        tags.append(f"manylinux_{major}_{v}_{arch}")
        if major == 2 and v in LEGACY_MANYLINUX:  # older wheels carry only the legacy alias
            tags.append(f"{LEGACY_MANYLINUX[v]}_{arch}")
    return tags


def write_stub(folder: Path, name: str, version: str, tag: str) -> Path:
    """An empty wheel that declares `name==version` with no dependencies: the target has the real one."""
    dist = re.sub(r"[-_.]+", "_", name)
    ver = version.replace("-", "_")
    info = f"{dist}-{ver}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: make_wheelhouse\nRoot-Is-Purelib: false\n"
        f"Tag: {tag}\nBuild: {STUB_BUILD}\n",
    }
    path = folder / f"{dist}-{ver}-{STUB_BUILD}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in [*files, f"{info}/RECORD"]))
    return path


def run_pip(args: list, env=None, echo=True) -> tuple:
    """Run pip, echoing its lines as they come (downloads take minutes); return (rc, output)."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if echo:
            sys.stdout.write("  " + line)
            sys.stdout.flush()
    return proc.wait(), "".join(lines)


def unavailable(output: str) -> list:
    """The packages pip names as the reason it failed: not found at all, or the dependency every
    candidate version of the requested package hit (pip backtracks through them all)."""
    names = re.findall(r"No matching distribution found for (\S+)", output)
    names += re.findall(r"^\s+\S+ \S+ depends on ([A-Za-z0-9][A-Za-z0-9._-]*)", output, re.M)
    return sorted({canonical(re.match(r"[A-Za-z0-9._-]+", n).group(0)) for n in names})


def last_error(output: str) -> str:
    """pip's failure in one line: the conflict's causes when it names them, else its last error."""
    causes = re.search(r"The conflict is caused by:\n((?:[ \t]+\S.*\n)+)", output)
    if causes:
        return "conflict: " + "; ".join(line.strip() for line in causes.group(1).splitlines())
    errors = [line.strip() for line in output.splitlines() if line.startswith("ERROR:")]
    return errors[-1] if errors else (output.strip().splitlines() or ["(no output)"])[-1]


class Resolution:
    """pip runs against one target (Python, platform) with the freeze's packages standing in as wheels."""

    def __init__(self, tmp: Path, python_version: str, platform: str, present: dict):
        py = python_version.replace(".", "")
        platforms = expand_platform(platform)
        self.tmp, self.label, self.present = tmp, f"cp{py} {platform}", dict(present)
        self.target = [
            "--only-binary=:all:",
            "--python-version",
            python_version,
            "--implementation",
            "cp",
            "--abi",
            f"cp{py}",
        ] + [x for p in platforms for x in ("--platform", p)]
        arch = re.search(r"(x86_64|aarch64|i686|ppc64le|s390x|armv7l)$", platform)
        self.markers = {
            "python_version": python_version,
            "python_full_version": f"{python_version}.0",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
        }
        if "linux" in platform:
            self.markers.update(sys_platform="linux", platform_system="Linux")
        if arch:
            self.markers["platform_machine"] = arch.group(1)
        self.stubs = tmp / "present"
        self.stubs.mkdir()
        top_tag = f"cp{py}-cp{py}-{platforms[0]}"  # the tag pip prefers most for this target
        self.stub_files = {key: write_stub(self.stubs, n, v, top_tag) for key, (n, v) in self.present.items()}
        self.pin()

    def pin(self, free=()) -> None:
        (self.tmp / "constraints.txt").write_text(
            "".join(f"{n}=={v}\n" for key, (n, v) in self.present.items() if key not in free)
        )

    def fetch_instead(self, key: str, why: str) -> None:
        name, version = self.present.pop(key)
        self.stub_files.pop(key).unlink()
        self.pin()
        say(f"{name} {version} (freeze) does not satisfy {why}: fetching it")

    def pip(self, reqs: list, pip_args: list, env=None, echo=True) -> tuple:
        (self.tmp / "requirements.txt").write_text("".join(f"{r}\n" for r in reqs))
        return run_pip(
            [
                *pip_args,
                *self.target,
                "--find-links",
                str(self.stubs),
                "-c",
                str(self.tmp / "constraints.txt"),
                "-r",
                str(self.tmp / "requirements.txt"),
            ],
            env=env,
            echo=echo,
        )

    def settle_present(self, reqs: list, base: list) -> None:
        """Keep a present package at its version only where what pip picks accepts it, as pip does on
        the target (it keeps an installed package unless a requirement rejects it). Pinning every
        freeze line instead fails on an image with, say, an old fsspec that datasets rejects."""
        for req in reqs:
            key = canonical(req.name)
            if key in self.present and not req.specifier.contains(self.present[key][1], prereleases=True):
                self.fetch_instead(key, f"'{req}'")
        # The rest: resolve once with only the directly required packages pinned, then read what the
        # chosen packages require of each present one.
        direct = {canonical(r.name) for r in reqs}
        free = [key for key in self.present if key not in direct]
        if not free:
            return
        self.pin(free=free)
        report = self.tmp / "report.json"
        rc, _ = self.pip(
            base,
            [
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--report",
                str(report),
                "--target",
                str(self.tmp / "target"),
            ],
            echo=False,
        )
        self.pin()
        if rc != 0:
            return  # the pinned download below names the conflict
        for item in json.loads(report.read_text())["install"]:
            meta = item["metadata"]
            for line in meta.get("requires_dist", []):
                req = Requirement(line)
                key = canonical(req.name)
                if key not in free or key not in self.present:
                    continue
                extras = item.get("requested_extras") or [""]
                if req.marker and not any(req.marker.evaluate({**self.markers, "extra": e}) for e in extras):
                    continue
                if not req.specifier.contains(self.present[key][1], prereleases=True):
                    self.fetch_instead(key, f"'{req.name}{req.specifier}' of {meta['name']} {meta['version']}")

    def download(self, dest: Path, base: list, extras: list) -> tuple:
        """Fetch base (must succeed) and each extra that has a complete set of wheels."""
        fetch = ["download", "--progress-bar", "off", "-d", str(dest)]
        rc, out = self.pip(base, fetch)
        if rc != 0:
            fail(f"pip could not fetch the requirements for {self.label}: {last_error(out)}")
        kept, skipped = [], []
        for extra in extras:
            say(f"GPU extra '{extra}'")
            rc, out = self.pip(base + kept + [extra], fetch)
            if rc == 0:
                kept.append(extra)
                continue
            names = unavailable(out) or [last_error(out)]
            skipped.append(
                f"'{extra}': pip finds no set of wheels for {self.label} (it fails on "
                f"{', '.join(names)})" + "".join(f"; {SOURCE_ONLY[n]}" for n in names if n in SOURCE_ONLY)
            )
        return kept, skipped

    def check_offline(self, dest: Path, reqs: list) -> None:
        """The proof the folder is complete: resolve with no index and no pip configuration (its
        find-links would add sources), from DEST and the stand-ins only."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        rc, out = self.pip(
            reqs,
            [
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--no-index",
                "--target",
                str(self.tmp / "target"),
                "--find-links",
                str(dest),
            ],
            env=env,
            echo=False,
        )
        if rc != 0:
            fail(f"offline check: {dest} lacks something for {self.label}: {last_error(out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", type=Path, help="folder for the wheels (created; existing wheels are reused)")
    parser.add_argument("--freeze", type=Path, help="`python -m pip list --format=freeze` of the target")
    parser.add_argument("--gpu-extras", action="store_true", help="add requirements-gpu.txt where wheels exist")
    parser.add_argument("--python-version", default="3.12", help="target Python X.Y [3.12]")
    parser.add_argument(
        "--platform",
        default="manylinux_2_28_x86_64",
        help="target platform tag, e.g. manylinux_2_35_x86_64 (glibc 2.35) [manylinux_2_28_x86_64]",
    )
    parser.add_argument("--pack", type=Path, metavar="FILE", help="also write the folder as one FILE.tar.xz")
    args = parser.parse_args()

    if not re.fullmatch(r"3\.\d+", args.python_version):
        fail(f"--python-version {args.python_version}: expected X.Y, e.g. 3.12")
    if args.pack is not None and not args.pack.name.endswith(".tar.xz"):
        fail(f"--pack {args.pack}: name the file FILE.tar.xz (what run.sh and the bootstrap unpack)")
    if args.freeze is not None and not args.freeze.is_file():
        fail(f"--freeze {args.freeze}: no such file")
    present = read_freeze(args.freeze) if args.freeze else {}
    base = read_requirements(REPO / "requirements.txt")
    extras = read_requirements(REPO / "requirements-gpu.txt") if args.gpu_extras else []

    args.dest.mkdir(parents=True, exist_ok=True)
    dest = args.dest.resolve()
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        resolution = Resolution(Path(tmp), args.python_version, args.platform, present)
        say(
            f"resolving requirements.txt for {resolution.label}"
            + (f" beside the {len(present)} packages of {args.freeze}" if present else "")
        )
        resolution.settle_present(base + extras, base)
        say(f"downloading into {dest}")
        try:
            kept, skipped = resolution.download(dest, base, extras)
        finally:
            for stub in dest.glob(f"*-{STUB_BUILD}-*.whl"):  # pip download copies the chosen stand-ins too
                stub.unlink()
        resolution.check_offline(dest, base + kept)

    wheels = sorted(dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    say(
        f"{len(wheels)} wheels, {size:.1f} MiB in {dest}; resolves offline"
        + (f" beside {len(resolution.present)} packages of {args.freeze}" if present else "")
    )
    for line in skipped:
        say(f"skipped GPU extra {line}")
    if skipped:
        say("INSTALL_GPU_EXTRAS=1 installs all of requirements-gpu.txt: the target must already have the skipped ones")
    gpu = "INSTALL_GPU_EXTRAS=1 " if kept and not skipped else ""
    where = dest
    if args.pack:
        # A script beside this one, run as one: tools/ is not a package.
        packer = Path(__file__).with_name("wheel_archive.py")
        if subprocess.run([sys.executable, str(packer), "pack", str(dest), str(args.pack)]).returncode:
            fail(f"--pack {args.pack}: packing failed (output above)")
        where = args.pack.resolve()
    say(f"on the target: {gpu}WHEELHOUSE={where} PYTHON=/path/to/python{args.python_version} bash tests/run.sh")


if __name__ == "__main__":
    main()
