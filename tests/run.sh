#!/usr/bin/env bash
# Bootstrap the environment (tools/bootstrap_env.sh) and run pytest: bash tests/run.sh [pytest args]
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO_ROOT/tools/bootstrap_env.sh"
# FLA, for its kernels' check on CPU under Triton's interpreter, goes to a folder of its own (.fla/);
# when it cannot be installed those tests skip with the reason and the rest of the suite runs.
"$PY" "$REPO_ROOT/tests/fla_cpu/fla_install.py" || true
# The linter and type checker (ruff, pyrefly) go to .lint/, for tests/unit/test_lint.py; where they cannot be
# installed those tests fail with the reason (a check that cannot run has not passed).
"$PY" "$REPO_ROOT/tests/lint_install.py" || true
cd "$REPO_ROOT"
# TEST_WORKERS pytest-xdist workers [2]: an engine test's launch leaves cores idle while its processes
# import or wait on a collective, and the other worker's test takes them. One thread a process (torchrun's own choice for several ranks): two
# workers' OpenMP pools on two cores would wait on each other. TEST_WORKERS=1: no workers, which is
# the default with -s (a worker's prints do not reach the terminal). --dist loadfile: a file's tests
# share a worker, so its module fixtures (a saved checkpoint, an import, a straight run) are built
# once; the session fixtures of tests/distributed/conftest.py once a worker.
WORKERS=2
for arg in "$@"; do [[ "$arg" == -s || "$arg" == --capture=no ]] && WORKERS=1; done
WORKERS=${TEST_WORKERS:-$WORKERS}
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || { echo "tests/run.sh: TEST_WORKERS=$WORKERS must be a positive integer" >&2; exit 2; }
if (( WORKERS > 1 )); then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  exec "$PY" -m pytest -n "$WORKERS" --dist loadfile "$@"
fi
exec "$PY" -m pytest "$@"
