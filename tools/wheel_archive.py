#!/usr/bin/env python3
"""A folder of wheels as one file, smaller than the wheels themselves, and back.

    python tools/wheel_archive.py pack DIR FILE.tar.xz     # tools/make_wheelhouse.py --pack FILE does this
    python tools/wheel_archive.py unpack FILE.tar.xz DIR   # tests/gpu/run.sh and tools/bootstrap_env.sh do this

A wheel is a deflated zip, and xz cannot shrink deflated bytes further nor see what two wheels share.
So each wheel is rewritten with its members stored uncompressed (same names, order, dates and modes),
then all of them go into one tar.xz. Nothing pip checks changes: the file name stays, and RECORD
lists a SHA-256 of each member's contents, not of its compressed bytes; pip installs a stored zip as
it is. ``pack`` proves the RECORD point on every rewritten wheel before it writes the archive.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import lzma
import os
import sys
import tarfile
import tempfile
import zipfile


def stored_copy(wheel: str, out: str) -> None:
    """``wheel`` rewritten to ``out`` with every member ZIP_STORED."""
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            copy = zipfile.ZipInfo(info.filename, info.date_time)
            copy.external_attr, copy.create_system = info.external_attr, info.create_system  # modes (scripts)
            copy.compress_type = zipfile.ZIP_STORED
            dst.writestr(copy, src.read(info))


def record_mismatches(wheel: str) -> list[str]:
    """Members whose contents do not hash to what the wheel's RECORD says (empty: the wheel is intact)."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        if len(names) != 1:
            return [f"{len(names)} RECORD files"]
        bad = []
        for row in csv.reader(io.StringIO(zf.read(names[0]).decode())):
            if len(row) < 2 or not row[1]:  # RECORD itself (and signatures) carry no hash
                continue
            algorithm, _, expected = row[1].partition("=")
            digest = hashlib.new(algorithm, zf.read(row[0])).digest()
            if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != expected:
                bad.append(row[0])
        return bad


def pack(folder: str, archive: str, preset: int = 9) -> dict:
    """Every ``*.whl`` of ``folder`` stored uncompressed, in one tar.xz; returns the sizes in bytes."""
    wheels = sorted(f for f in os.listdir(folder) if f.endswith(".whl"))
    if not wheels:
        raise SystemExit(f"wheel_archive: {folder} holds no wheels")
    sizes = {"wheels": len(wheels), "wheel bytes": 0}
    with tempfile.TemporaryDirectory(prefix="wheel_archive-") as tmp:
        # preset 9 is a 64 MiB window: wide enough to find what the wheels share across files.
        with tarfile.open(archive, "w:xz", preset=preset) as tar:
            for name in wheels:
                source, stored = os.path.join(folder, name), os.path.join(tmp, name)
                stored_copy(source, stored)
                bad = record_mismatches(stored)
                if bad:
                    raise SystemExit(f"wheel_archive: {name}: RECORD does not match {bad[:3]} after re-zipping")
                sizes["wheel bytes"] += os.path.getsize(source)
                tar.add(stored, arcname=name)
                os.remove(stored)
    sizes["archive bytes"] = os.path.getsize(archive)
    return sizes


def unpack(archive: str, folder: str) -> list[str]:
    """The wheels of ``archive`` into ``folder`` (created); anything but a plain ``*.whl`` is refused."""
    os.makedirs(folder, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        members = tar.getmembers()
        odd = [m.name for m in members if not (m.isfile() and m.name.endswith(".whl") and "/" not in m.name)]
        if odd:
            raise SystemExit(f"wheel_archive: {archive} holds more than wheels: {odd[:3]}")
        tar.extractall(folder, members=members, filter="data")
    return sorted(m.name for m in members)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="DIR's wheels -> FILE (.tar.xz)")
    p.add_argument("folder")
    p.add_argument("archive")
    p.add_argument("--preset", type=int, default=9, help="xz preset 0-9 [9]")
    u = sub.add_parser("unpack", help="FILE (.tar.xz) -> DIR")
    u.add_argument("archive")
    u.add_argument("folder")
    args = parser.parse_args(argv)
    if args.cmd == "pack":
        s = pack(args.folder, args.archive, args.preset)
        print(
            f"wheel_archive: {s['wheels']} wheels, {s['wheel bytes'] / 2**20:.1f} MiB -> {args.archive} "
            f"{s['archive bytes'] / 2**20:.1f} MiB"
        )
    else:
        try:
            names = unpack(args.archive, args.folder)
        except (OSError, tarfile.TarError, lzma.LZMAError) as err:
            print(f"wheel_archive: cannot unpack {args.archive}: {err}", file=sys.stderr)
            return 1
        print(f"wheel_archive: {len(names)} wheels from {args.archive} in {args.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
