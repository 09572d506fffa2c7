#!/usr/bin/env bash
# Idempotent environment bootstrap. Sourced by tests/run.sh and run_qwen35_vl.sh.
#
#   PYTHON=/path/to/python  use that interpreter as is (GPU containers that already ship
#                           torch / Transformer Engine); only missing requirements are installed,
#                           into its own prefix, or into PYDEPS_DIR when that prefix cannot be
#                           written (read-only image, an externally managed system Python).
#   PYDEPS_DIR              that folder [.pydeps/ at the repository root]; put on PYTHONPATH.
#   WHEELHOUSE=DIR          install from DIR only, no index (tools/make_wheelhouse.py writes it).
#   WHEELHOUSE=FILE.tar.xz  the same folder as one file (make_wheelhouse.py --pack): unpacked into a
#                           temporary folder when something is to be installed, which is then exported
#                           as WHEELHOUSE, so the scripts this one starts reuse it.
#   (unset)                 create .venv/ at the repository root from Python 3.12 found on
#                           PATH or under pyenv, and install requirements.txt into it.
#   INSTALL_GPU_EXTRAS=1    also install requirements-gpu.txt (CUDA hosts only).
#   BOOTSTRAP_MIN_FREE_GIB  free disk required before installing (default 8; 0 skips the check).
#   BOOTSTRAP_WHEELS_ONLY=1 install every wheel of WHEELHOUSE as it is (no resolution, no stamp) where
#                           the requirements would go, and stop: a wheelhouse brought in parts (a GPU
#                           machine that takes 64 MiB a call) lands part by part, the last one normally.
#
# Exports PY (the interpreter to use) and PYTHONPATH (repository root first, so that the
# namespace package megatron.cpu sits beside megatron.core; then PYDEPS_DIR when used).
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAMP_NAME=".requirements.sha256"

_find_python312() {
  local candidates=() c
  command -v python3.12 >/dev/null 2>&1 && candidates+=("$(command -v python3.12)")
  command -v pyenv >/dev/null 2>&1 && candidates+=("$(pyenv root)"/versions/3.12*/bin/python3)
  candidates+=("$HOME"/.pyenv/versions/3.12*/bin/python3 /usr/local/bin/python3.12 /usr/bin/python3.12)
  for c in "${candidates[@]}"; do
    if [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}

_requirements_hash() {
  local files=("$REPO_ROOT/requirements.txt")
  [ "${INSTALL_GPU_EXTRAS:-0}" = "1" ] && files+=("$REPO_ROOT/requirements-gpu.txt")
  cat "${files[@]}" | sha256sum | cut -d' ' -f1
}

# The PyPI torch wheel pulls the CUDA libraries even on CPU hosts (there is no CPU-only build
# there for Python 3.12): a fresh .venv/ is about 6 GiB, and pip needs room to unpack on top.
# Checking first turns a full disk into one clear line instead of a pip OSError mid-install.
MIN_FREE_GIB="${BOOTSTRAP_MIN_FREE_GIB:-8}"

_check_free_space() {
  local dir="$1" free_kib
  free_kib="$(df -Pk "$dir" | awk 'NR == 2 {print $4}')"
  if [ -n "$free_kib" ] && [ "$free_kib" -lt $((MIN_FREE_GIB * 1024 * 1024)) ]; then
    echo "[bootstrap] only $((free_kib / 1024)) MiB free under $dir; installing requirements needs" \
      "about ${MIN_FREE_GIB} GiB (torch with its CUDA libraries). Free some space, or set" \
      "BOOTSTRAP_MIN_FREE_GIB=0 to try anyway." >&2
    exit 1
  fi
}

if [ -n "${WHEELHOUSE:-}" ]; then
  [ -d "$WHEELHOUSE" ] || [[ -f "$WHEELHOUSE" && "$WHEELHOUSE" == *.tar.xz ]] || {
    echo "[bootstrap] WHEELHOUSE=$WHEELHOUSE is not a directory (write one with tools/make_wheelhouse.py)" >&2; exit 1; }
fi
PIP_SOURCE=()

# Before pip runs (not on every sourcing: a run whose stamp matches installs nothing and unpacks
# nothing): a packed wheelhouse becomes a folder, and pip is pointed at the folder.
_open_wheelhouse() {
  [ -n "${WHEELHOUSE:-}" ] || return 0
  if [ -f "$WHEELHOUSE" ]; then
    local folder
    folder="$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse.XXXXXX")"
    "$PY" "$REPO_ROOT/tools/wheel_archive.py" unpack "$WHEELHOUSE" "$folder" >&2 || exit 1
    export WHEELHOUSE="$folder"
  fi
  PIP_SOURCE=(--no-index --find-links "$(cd "$WHEELHOUSE" && pwd)")
}

# pip's report of a wheel missing from a wheelhouse is a screenful of resolver output; the cause is
# nearly always one absent package, so name it in one line (other failures keep pip's own output).
_pip() {
  local log rc=0 missing
  log="$(mktemp)"
  "$PY" -m pip --disable-pip-version-check "$@" ${PIP_SOURCE[@]+"${PIP_SOURCE[@]}"} 2>"$log" || rc=$?
  if [ "$rc" -eq 0 ]; then cat "$log" >&2; rm -f "$log"; return 0; fi
  missing="$(sed -n 's/.*No matching distribution found for \([^ ]*\).*/\1/p' "$log" | head -n 1)"
  if [ -n "${WHEELHOUSE:-}" ] && [ -n "$missing" ]; then
    echo "[bootstrap] WHEELHOUSE=$WHEELHOUSE has no wheel for $missing that $PY can install; rebuild it with" \
      "tools/make_wheelhouse.py --freeze <this interpreter's pip list --format=freeze> (what it skips must be here already)" >&2
  else
    cat "$log" >&2
    echo "[bootstrap] pip install failed with $PY${WHEELHOUSE:+ from WHEELHOUSE=$WHEELHOUSE} (pip's output above)" >&2
  fi
  rm -f "$log"
  exit 1
}

# One requirements file into the interpreter's prefix, or, with PYDEPS set, only what the
# interpreter lacks into that folder: pip --target ignores installed packages (it would fetch torch
# again), so resolve first against what is installed (a dry run writes nothing) and install just
# the packages it names, without their dependencies.
_install_file() {
  local req="$1" report pins=(); shift
  if [ -z "${PYDEPS:-}" ]; then _pip install -q -r "$req" "$@"; return; fi
  report="$(mktemp)"
  _pip install -q --dry-run --report "$report" -r "$req" "$@"
  # pip --target --upgrade replaces a package's files but leaves the old version's .dist-info
  # beside the new one (two versions to importlib.metadata), so those go first.
  mapfile -t pins < <("$PY" -c 'import json, os, re, shutil, sys
canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()
wanted = {}
for item in json.load(open(sys.argv[1]))["install"]:
    wanted[canon(item["metadata"]["name"])] = item["metadata"]["name"] + "==" + item["metadata"]["version"]
for entry in os.listdir(sys.argv[2]):
    if entry.endswith(".dist-info") and canon(entry[:-len(".dist-info")].rsplit("-", 1)[0]) in wanted:
        shutil.rmtree(os.path.join(sys.argv[2], entry))
for pin in wanted.values():
    print(pin)' "$report" "$PYDEPS")
  rm -f "$report"
  [ "${#pins[@]}" -eq 0 ] || _pip install -q --no-deps --upgrade --target "$PYDEPS" "$@" "${pins[@]}"
}

_install_wheels_only() {
  local wheels=()
  [ -n "${WHEELHOUSE:-}" ] || { echo "[bootstrap] BOOTSTRAP_WHEELS_ONLY=1 needs WHEELHOUSE" >&2; exit 1; }
  _open_wheelhouse
  shopt -s nullglob; wheels=("$WHEELHOUSE"/*.whl); shopt -u nullglob
  [ "${#wheels[@]}" -gt 0 ] || { echo "[bootstrap] WHEELHOUSE=$WHEELHOUSE holds no wheels" >&2; exit 1; }
  echo "[bootstrap] installing the ${#wheels[@]} wheels of $WHEELHOUSE as they are${PYDEPS:+ into $PYDEPS}" >&2
  "$PY" -m pip --disable-pip-version-check install -q --no-index --no-deps ${PYDEPS:+--target "$PYDEPS"} "${wheels[@]}"
}

_install_requirements() {
  local stamp="$1" want
  if [ "${BOOTSTRAP_WHEELS_ONLY:-0}" = "1" ]; then _install_wheels_only; return; fi
  want="$(_requirements_hash)"
  # What the folder must hold depends on the interpreter beside it (its torch, its packages), so a
  # different PYTHON re-checks it even with the same requirements.
  [ -n "${PYDEPS:-}" ] && want="$want $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  "$PY" -m pip --version >/dev/null 2>&1 || {
    echo "[bootstrap] $PY has no pip (python -m pip); install it, e.g. $PY -m ensurepip" >&2; exit 1; }
  if [ -n "${PYDEPS:-}" ]; then
    "$PY" -c 'import sys; from pip import __version__ as v; sys.exit(tuple(map(int, v.split(".")[:2])) < (22, 2))' || {
      echo "[bootstrap] PYTHON=$PY: pip older than 22.2 cannot install beside a read-only prefix" \
        "(needs install --dry-run --report); upgrade pip or use a writable Python" >&2; exit 1; }
  fi
  _check_free_space "$(dirname "$stamp")"
  _open_wheelhouse
  echo "[bootstrap] installing requirements with $PY${PYDEPS:+ into $PYDEPS}${WHEELHOUSE:+ from $WHEELHOUSE}" \
    "(first run takes a few minutes)" >&2
  _install_file "$REPO_ROOT/requirements.txt"
  if [ "${INSTALL_GPU_EXTRAS:-0}" = "1" ]; then
    _install_file "$REPO_ROOT/requirements-gpu.txt" --no-build-isolation
  fi
  echo "$want" > "$stamp"
}

# pip can write to the interpreter's own site-packages: not on a read-only image, nor on a system
# Python marked externally managed (PEP 668), where pip refuses.
_prefix_installable() {
  "$PY" -c 'import os, sys, sysconfig
paths = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
managed = sys.prefix == sys.base_prefix and os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if not managed and all(os.access(p, os.W_OK) for p in paths) else 1)'
}

PYDEPS=""
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
  "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || {
    echo "[bootstrap] PYTHON=$PYTHON is not Python 3.12 (megatron-core 0.19.2 ships cp312 wheels only)" >&2; exit 1; }
  if _prefix_installable; then
    STAMP="$("$PY" -c 'import sys; print(sys.prefix)')/$STAMP_NAME"
    [ -w "$(dirname "$STAMP")" ] || STAMP="$REPO_ROOT/.venv-external$STAMP_NAME"
  else
    PYDEPS="${PYDEPS_DIR:-$REPO_ROOT/.pydeps}"
    mkdir -p "$PYDEPS" || { echo "[bootstrap] PYDEPS_DIR=$PYDEPS cannot be created" >&2; exit 1; }
    PYDEPS="$(cd "$PYDEPS" && pwd)"
    STAMP="$PYDEPS/$STAMP_NAME"
  fi
  # Before installing: pip's dry run must see what an earlier run put into PYDEPS.
  export PYTHONPATH="$REPO_ROOT${PYDEPS:+:$PYDEPS}${PYTHONPATH:+:$PYTHONPATH}"
  _install_requirements "$STAMP"
else
  VENV="$REPO_ROOT/.venv"
  if [ ! -x "$VENV/bin/python" ]; then
    BASE_PY="$(_find_python312)" || {
      echo "[bootstrap] Python 3.12 not found on PATH or under pyenv; install it or set PYTHON=..." >&2; exit 1; }
    echo "[bootstrap] creating $VENV from $BASE_PY" >&2
    "$BASE_PY" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
  export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  _install_requirements "$VENV/$STAMP_NAME"
fi
export PY
