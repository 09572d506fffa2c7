#!/usr/bin/env bash
# Bootstrap the environment (tools/bootstrap_env.sh) and run pytest: bash tests/run.sh [pytest args]
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/tools/bootstrap_env.sh"
cd "$REPO_ROOT"
exec "$PY" -m pytest "$@"
