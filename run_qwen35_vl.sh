#!/usr/bin/env bash
# Train Qwen3.5-VL with Megatron-Core: bash run_qwen35_vl.sh [extra megatron flags]
#
# Settings come from the environment: MODEL_VARIANT, TP CP EP PP, NPROC, DATASET, CKPT_*, DRY_RUN=1, ...
# (README.md's variable table, which is examples/multimodal_dev/launcher/variables.py). A flag that
# a variable sets, such as --tensor-model-parallel-size for TP, is refused: set the variable.
#
# What must be shell lives here: finding the interpreter and the environment (tools/bootstrap_env.sh).
# examples/multimodal_dev/launcher/launch.py checks every setting once, naming the variable and value,
# prints the DRY_RUN view, and starts torchrun.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tools/bootstrap_env.sh
source "$ROOT/tools/bootstrap_env.sh"
exec "$PY" -m examples.multimodal_dev.launcher.launch "$@"
