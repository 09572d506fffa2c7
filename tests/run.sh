#!/usr/bin/env bash
# Bootstrap the environment (tools/bootstrap_env.sh) and run pytest: bash tests/run.sh [pytest args]
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/tools/bootstrap_env.sh"
# FLA, for its kernels' check on CPU under Triton's interpreter, goes to a folder of its own (.fla/);
# when it cannot be installed those tests skip with the reason and the rest of the suite runs.
"$PY" "$REPO_ROOT/tests/fla_cpu/fla_install.py" || true
cd "$REPO_ROOT"
exec "$PY" -m pytest "$@"
