#!/usr/bin/env bash
# Idempotent environment bootstrap. Sourced by tests/run.sh and run_qwen35_vl.sh.
#
#   PYTHON=/path/to/python  use that interpreter as is (GPU containers that already ship
#                           torch / Transformer Engine); only missing requirements are installed.
#   (unset)                 create .venv/ at the repository root from Python 3.12 found on
#                           PATH or under pyenv, and install requirements.txt into it.
#   INSTALL_GPU_EXTRAS=1    also install requirements-gpu.txt (CUDA hosts only).
#   BOOTSTRAP_MIN_FREE_GIB  free disk required before installing (default 8; 0 skips the check).
#
# Exports PY (the interpreter to use) and PYTHONPATH (repository root first, so that the
# namespace package megatron.cpu sits beside megatron.core).
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

_install_requirements() {
  local py="$1" stamp="$2"
  local want; want="$(_requirements_hash)"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  _check_free_space "$(dirname "$stamp")"
  echo "[bootstrap] installing requirements with $py (first run takes a few minutes)" >&2
  "$py" -m pip install --disable-pip-version-check -q -r "$REPO_ROOT/requirements.txt"
  if [ "${INSTALL_GPU_EXTRAS:-0}" = "1" ]; then
    "$py" -m pip install --disable-pip-version-check -q --no-build-isolation -r "$REPO_ROOT/requirements-gpu.txt"
  fi
  echo "$want" > "$stamp"
}

if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
  "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || {
    echo "[bootstrap] PYTHON=$PYTHON is not Python 3.12 (megatron-core 0.19.2 ships cp312 wheels only)" >&2; exit 1; }
  STAMP="$("$PY" -c 'import sys; print(sys.prefix)')/$STAMP_NAME"
  [ -w "$(dirname "$STAMP")" ] || STAMP="$REPO_ROOT/.venv-external$STAMP_NAME"
  _install_requirements "$PY" "$STAMP"
else
  VENV="$REPO_ROOT/.venv"
  if [ ! -x "$VENV/bin/python" ]; then
    BASE_PY="$(_find_python312)" || {
      echo "[bootstrap] Python 3.12 not found on PATH or under pyenv; install it or set PYTHON=..." >&2; exit 1; }
    echo "[bootstrap] creating $VENV from $BASE_PY" >&2
    "$BASE_PY" -m venv "$VENV"
  fi
  PY="$VENV/bin/python"
  _install_requirements "$PY" "$VENV/$STAMP_NAME"
fi
export PY
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
