#!/usr/bin/env bash
# All GPU checks in one command, for a CUDA host with no package index (one H100 is the target):
#
#   WHEELHOUSE=wheelhouse PYTHON=python3 bash tests/gpu/run.sh
#
# 1. Installs what PYTHON lacks, offline, from WHEELHOUSE (tools/bootstrap_env.sh), then
#    flash-linear-attention from the same folder (not through INSTALL_GPU_EXTRAS: that also asks for
#    Transformer Engine, which no wheelhouse can hold). If the bootstrap fails, it says why and installs
#    megatron-core and FLA alone, so the in-process checks still run.
# 2. Prints nvidia-smi -L and the versions; saves PYTHON's own pip freeze as target-freeze.txt (the
#    --freeze of the next tools/make_wheelhouse.py).
# 3. Runs pytest tests/gpu -m gpu -s, one pytest per group below, each under its own timeout and all
#    within GPU_CHECKS_BUDGET_S (default 560 s), so everything ends inside a 10-minute slot. A group
#    that fails, crashes or times out becomes rows of the table and the next group runs. First the
#    checks that time nothing run together, each in a process of its own: on a fresh machine their time
#    goes to Triton compiling and autotuning FLA's kernels config by config on one core (FLA's gated
#    rule took 56 s of a 94 s group on 2026-11-26), and the machine has a core for each. Then the
#    checks that time the GPU, one at a time, with the GPU to themselves. Groups run fp32 kernels with
#    TRITON_F32_DEFAULT=ieee (and a Triton cache of their own): Triton computes fp32 tl.dot in TF32
#    otherwise, and fp32 parity is meant to be exact.
# 4. Writes results.json and results.md (+ rows.jsonl, run.log, train_*.log, target-freeze.txt) to $OUT
#    if set (the GPU machine returns that folder), else to tests/gpu/results/, and prints the table.
#
# The wheelhouse, built where the package index is (the freeze keeps torch and the image's other big
# packages out), packed as one file:
#   python tools/make_wheelhouse.py wheelhouse --freeze tests/gpu/target-freeze.txt --gpu-extras \
#       --python-version 3.12 --platform manylinux_2_28_x86_64 --pack wheelhouse.tar.xz
# The GPU machine takes 64 MiB a call, tree and wheels together: the folder for its image is ~66 MiB,
# the file 49 MB (its wheels stored uncompressed under one xz), so one call carries both:
#   WHEELHOUSE=wheelhouse.tar.xz PYTHON=python3 bash tests/gpu/run.sh
# A WHEELHOUSE that is a .tar.xz is unpacked into the scratch folder first (tools/wheel_archive.py).
#
# Environment: WHEELHOUSE [wheelhouse/ or wheelhouse.tar.xz at the repository root, if present], PYTHON [python3],
#   GPU_CHECKS     groups to run [micro fla attn parity train resume decode fsdp te parallel]; they always run in the order below
#   GPU_CHECKS_BUDGET_S [560]; GPU_CHECKS_CAP_SCALE [1] multiplies every group's cap (a CPU rehearsal's
#     groups share a loaded host, and a skip for time there would depend on the host); GPU_TRAIN_RUNS, GPU_TRAIN_ITERS, GPU_35B_LAYERS, ... (test_training.py)
#   GPU_CHECKS_SCRATCH  a folder for the runs' files, kept [a temporary one, removed at exit]
#   GPU_CHECKS_REHEARSAL=1  on a host without CUDA, the checks that can run there do (gpu_results.rehearsal)
# Exit status 0 when no row failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
START=$(date +%s)
BUDGET_S=${GPU_CHECKS_BUDGET_S:-560}
CAP_SCALE=${GPU_CHECKS_CAP_SCALE:-1}
DEADLINE=$((START + BUDGET_S))
RESERVE_S=25  # kept for the table at the end
OUTDIR=${OUT:-$ROOT/tests/gpu/results}
mkdir -p "$OUTDIR"
SCRATCH=${GPU_CHECKS_SCRATCH:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_checks.XXXXXX")}
mkdir -p "$SCRATCH"
# A scratch folder this script made (runs' checkpoints, traces, caches) goes at exit; what the table
# needs is in OUTDIR. GPU_CHECKS_SCRATCH=DIR keeps it there.
[[ -z "${GPU_CHECKS_SCRATCH:-}" ]] && trap 'rm -rf "$SCRATCH"' EXIT
export GPU_RESULTS="$OUTDIR/rows.jsonl" GPU_CHECKS_OUTDIR="$OUTDIR" GPU_CHECKS_SCRATCH="$SCRATCH" PYTHONUNBUFFERED=1
# Triton says which kernel it autotuned and in how many seconds: where a group's time went on a fresh machine
export TRITON_PRINT_AUTOTUNING=${TRITON_PRINT_AUTOTUNING:-1}
export PYTHON=${PYTHON:-python3}
if [[ -z "${WHEELHOUSE:-}" && -d "$ROOT/wheelhouse" ]]; then WHEELHOUSE="$ROOT/wheelhouse"; fi
if [[ -z "${WHEELHOUSE:-}" && -f "$ROOT/wheelhouse.tar.xz" ]]; then WHEELHOUSE="$ROOT/wheelhouse.tar.xz"; fi
if [[ -f "${WHEELHOUSE:-}" ]]; then  # one file: a folder of its own once, for every bootstrap below
  "$PYTHON" tools/wheel_archive.py unpack "$WHEELHOUSE" "$SCRATCH/wheelhouse" && WHEELHOUSE="$SCRATCH/wheelhouse"
fi
if [[ -n "${WHEELHOUSE:-}" ]]; then
  [[ -d "$WHEELHOUSE" ]] && WHEELHOUSE="$(cd "$WHEELHOUSE" && pwd)"  # absolute: run_qwen35_vl.sh bootstraps again
  export WHEELHOUSE
fi
GROUPS_WANTED=" ${GPU_CHECKS:-micro fla attn parity train resume decode fsdp te parallel} "
STEPS_FILE="$SCRATCH/steps.txt"  # "name: seconds, exit code" of every step, for the table's header
TOGETHER=()  # "pid log" of the steps running in the background (run_together ... wait_together)

add_row() {  # add_row CHECK CASE STATUS NOTE
  "${PY:-$PYTHON}" tests/gpu/gpu_results.py add --check "$1" --case "$2" --status "$3" --note "$4" \
    || echo "[gpu] could not record: $1 | $2 | $3 | $4"
}

rows() { [[ -f "$GPU_RESULTS" ]] && wc -l <"$GPU_RESULTS" || echo 0; }

# step NAME CAP_S CMD...: CMD under timeout min(CAP_S, time left); the tests inside see their own
# deadline (GPU_CHECKS_DEADLINE) 15 s before that, so they stop launching work and record what they have.
step() {
  local name=$1 cap=$(($2 * CAP_SCALE)) left t t0 rc before
  shift 2
  left=$((DEADLINE - RESERVE_S - $(date +%s)))
  t=$((cap < left ? cap : left))
  if ((t < 20)); then
    echo "== [gpu] $name: not run, ${left}s left of ${BUDGET_S}s =="
    add_row "$name" "" skip "not run: the ${BUDGET_S}s budget was spent (GPU_CHECKS_BUDGET_S, GPU_CHECKS)"
    return
  fi
  echo "== [gpu] $name (timeout ${t}s, $((DEADLINE - $(date +%s)))s of the budget left) =="
  t0=$(date +%s)
  before=$(rows)
  GPU_CHECKS_DEADLINE=$(($(date +%s) + t - 15)) timeout -k 10 "$t" "$@"
  rc=$?
  echo -n "$name: $(($(date +%s) - t0))s exit $rc; " >>"$STEPS_FILE"
  echo "== [gpu] $name: exit $rc after $(($(date +%s) - t0))s =="
  if ((rc == 124 || rc == 137)); then
    add_row "$name" "" fail "timed out after ${t}s: rows above are what finished (run.log has the rest)"
  elif ((rc == 5)) && [[ "$(rows)" == "$before" ]]; then
    add_row "$name" "" skip "no test ran (pytest exit 5: every module skipped, e.g. no CUDA device; run.log)"
  elif ((rc != 0 && rc != 1)) && [[ "$(rows)" == "$before" ]]; then
    add_row "$name" "" fail "pytest exit $rc with no row recorded (run.log)"
  fi
}

# checks GROUP NAME CAP_S [ENV=VALUE ...] -- PYTEST ARGS...: one pytest of GROUP's, now; between
# run_together and wait_together, in the background with its output in a log of its own.
checks() {
  local group=$1 name=$2 cap=$3 envs=() log
  shift 3
  [[ "$GROUPS_WANTED" == *" $group "* ]] || return 0
  while [[ $# -gt 0 && "$1" != "--" ]]; do envs+=("$1"); shift; done
  shift
  local cmd=(step "$name" "$cap" env ${envs[@]+"${envs[@]}"} "$PY" -m pytest -m gpu -s -p no:cacheprovider "$@")
  if [[ -z "${TOGETHER_DIR:-}" ]]; then
    "${cmd[@]}"
    return
  fi
  log="$TOGETHER_DIR/${#TOGETHER[@]}"
  echo "== [gpu] $name: started beside the others (its output follows when they have all ended) =="
  # rows of its own, so that step() sees which rows are this step's; joined in order at the end
  GPU_RESULTS="$log.rows" "${cmd[@]}" >"$log.log" 2>&1 &
  TOGETHER+=("$!|$log|$name")
}

run_together() { TOGETHER_DIR="$SCRATCH/together" && mkdir -p "$TOGETHER_DIR" && TOGETHER=(); }

# every background step's end, then in the order they started their outputs, their rows and a row of
# what Triton autotuned in each (where a fresh machine's time goes)
wait_together() {
  local entry pid log name
  for entry in ${TOGETHER[@]+"${TOGETHER[@]}"}; do wait "${entry%%|*}"; done
  for entry in ${TOGETHER[@]+"${TOGETHER[@]}"}; do
    IFS='|' read -r pid log name <<<"$entry"
    cat "$log.log"
    [[ -f "$log.rows" ]] && cat "$log.rows" >>"$GPU_RESULTS"
    "$PY" tests/gpu/gpu_results.py autotune --check "$name" --log "$log.log" >/dev/null \
      || echo "[gpu] could not read the autotuning of $name"
  done
  TOGETHER=() TOGETHER_DIR=""
}

bootstrap() {
  echo "== [gpu] bootstrap: PYTHON=$PYTHON WHEELHOUSE=${WHEELHOUSE:-(none: the package index)} =="
  # Before anything is installed: the image's own packages, the --freeze of the next wheelhouse.
  env -u PYTHONPATH "$PYTHON" -m pip list --format=freeze >"$OUTDIR/target-freeze.txt" 2>/dev/null \
    || echo "[gpu] pip list failed with $PYTHON"
  # A trial in a child shell first: bootstrap_env.sh exits on failure, and this script must go on.
  timeout 300 bash -c 'source tools/bootstrap_env.sh'
  local rc=$?
  if ((rc == 0)); then
    source tools/bootstrap_env.sh  # installs nothing now; sets PY, PYTHONPATH (and PYDEPS)
    set +e
    BOOT_NOTE="bootstrap_env.sh done with ${WHEELHOUSE:-the package index}"
  else
    PY="$PYTHON"
    PYDEPS="${PYDEPS_DIR:-$ROOT/.pydeps}"
    mkdir -p "$PYDEPS"
    export PYTHONPATH="$ROOT:$PYDEPS${PYTHONPATH:+:$PYTHONPATH}"
    BOOT_NOTE="bootstrap_env.sh failed (exit $rc, output above); went on with megatron-core and FLA alone, from WHEELHOUSE where it has them"
    local w wheels=()
    for w in "${WHEELHOUSE:-/nonexistent}"/megatron_core-*.whl; do [[ -f "$w" ]] && wheels+=("$w"); done
    ((${#wheels[@]})) && "$PY" -m pip install -q --no-index --no-deps --target "$PYDEPS" "${wheels[@]}"
  fi
  install_fla
  add_row bootstrap "$PY" "$([[ $rc == 0 ]] && echo info || echo fail)" "$BOOT_NOTE"
}

install_fla() {
  "$PY" -c 'import fla' >/dev/null 2>&1 && return 0
  local w wheels=() target=()
  for w in "${WHEELHOUSE:-/nonexistent}"/flash_linear_attention-*.whl "${WHEELHOUSE:-/nonexistent}"/fla_core-*.whl; do
    [[ -f "$w" ]] && wheels+=("$w")
  done
  if ((${#wheels[@]} == 0)); then
    echo "[gpu] no flash-linear-attention wheel in WHEELHOUSE: GatedDeltaNet runs on the torch kernels"
    return 0
  fi
  [[ -n "${PYDEPS:-}" ]] && target=(--target "$PYDEPS")
  # --no-deps: FLA needs torch, triton, transformers and einops, which the image has.
  "$PY" -m pip install -q --no-index --no-deps ${target[@]+"${target[@]}"} "${wheels[@]}" \
    || echo "[gpu] installing FLA from $WHEELHOUSE failed"
}

# A group that cannot run here is one row saying why, written before the timed checks (a pytest
# start costs seconds of the budget just to skip).
skip_groups_this_host_cannot_run() {
  local gpus
  if [[ "$GROUPS_WANTED" == *" te "* ]] && ! "$PY" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
    add_row "TE vs local" "" skip "transformer_engine does not import with $PY: Transformer Engine is not on this image; every other check ran the local backend"
    GROUPS_WANTED=${GROUPS_WANTED/ te / }
  fi
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  if [[ "$GROUPS_WANTED" == *" parallel "* ]] && ((gpus < 2)); then
    add_row "TP / EP on GPUs" "" skip "$gpus GPU visible: TP=2 and EP=2 against one GPU need two"
    GROUPS_WANTED=${GROUPS_WANTED/ parallel / }
  fi
}

main() {
  : >"$GPU_RESULTS"
  echo "== [gpu] $(date -Is) budget ${BUDGET_S}s, output in $OUTDIR, scratch in $SCRATCH =="
  nvidia-smi -L || echo "[gpu] nvidia-smi -L failed: no GPU visible (every check will skip)"
  bootstrap
  "$PY" tests/gpu/gpu_results.py env --out "$SCRATCH/env.json" || add_row env "" fail "environment probe failed"
  local ieee=(TRITON_F32_DEFAULT=ieee "TRITON_CACHE_DIR=$SCRATCH/triton_ieee")
  skip_groups_this_host_cannot_run
  # Together, timing nothing (caps in s; a group's rows are written as its tests finish). The bf16
  # groups use the default Triton cache, where the 35b_a3b training run later finds FLA's conv1d and
  # l2norm tuned at its head shapes (parity's wide-moe has them). The resume runs get a cache of their
  # own: a kernel config autotuned by another process in between would make a resumed run differ from
  # the straight one for a reason that is not the resume's.
  run_together
  checks micro "FLA gated rule on Hopper" 200 -- tests/gpu/test_fla_kernels.py -k six_gradients
  checks fla "fla kernels bf16" 200 -- tests/gpu/test_fla_kernels.py -k "bf16 and not six_gradients"
  checks fla "fla kernels fp32" 200 "${ieee[@]}" -- tests/gpu/test_fla_kernels.py -k "fp32 and not six_gradients"
  checks parity "model parity fp32 tiny" 200 "${ieee[@]}" -- tests/gpu/test_model_parity.py -k "fp32 and tiny"
  checks parity "model parity fp32 wide" 200 "${ieee[@]}" -- tests/gpu/test_model_parity.py -k "fp32 and wide"
  checks parity "model parity bf16 tiny" 200 -- tests/gpu/test_model_parity.py -k "bf16 and tiny"
  checks parity "model parity bf16 wide" 200 -- tests/gpu/test_model_parity.py -k "bf16 and wide"
  checks resume "bf16 resume" 240 "TRITON_CACHE_DIR=$SCRATCH/triton_resume" -- tests/gpu/test_resume.py
  # greedy tokens against transformers' generate (tiny MoE, fp32: exact dots, as parity's, lest TF32
  # flip a near-tie of a random model's logits)
  checks decode "decode tokens" 200 "${ieee[@]}" -- tests/gpu/test_decode.py -k greedy
  # Megatron-FSDP on CUDA and NCCL against DDP (tiny MoE, bf16; DP=2 where two GPUs are visible)
  checks fsdp "Megatron-FSDP" 200 -- tests/gpu/test_fsdp_gpu.py
  checks te "TE vs local" 200 -- tests/gpu/test_te_backend.py
  wait_together
  # Alone, one at a time: the checks that time the GPU; training last, as it takes what time is left.
  checks micro "grouped_mm" 60 -- tests/gpu/test_grouped_mm.py
  checks attn "thd attention bf16" 60 -- tests/gpu/test_thd_attention.py
  # new tokens/s at batch 1 and 8 (35b_a3b's widths in 4 layers, bf16)
  checks decode "decode tokens/s" 60 -- tests/gpu/test_decode.py -k tokens_per_second
  checks train "training" 300 -- tests/gpu/test_training.py
  checks parallel "TP / EP" 400 -- tests/gpu/test_parallel.py
  echo "== [gpu] table =="
  "$PY" tests/gpu/gpu_results.py collect --rows "$GPU_RESULTS" --outdir "$OUTDIR" --env "$SCRATCH/env.json" \
    --meta "started=$(date -d "@$START" -Is)" --meta "elapsed_s=$(($(date +%s) - START))" \
    --meta "budget_s=$BUDGET_S" --meta "steps=$(cat "$STEPS_FILE" 2>/dev/null)"
}

main "$@" 2>&1 | tee "$OUTDIR/run.log"
rc=${PIPESTATUS[0]}
if [[ $(stat -c %s "$OUTDIR/run.log") -gt 15000000 ]]; then  # files come back from $OUT under 16 MiB
  tail -c 15000000 "$OUTDIR/run.log" >"$OUTDIR/run.log.tail" && mv "$OUTDIR/run.log.tail" "$OUTDIR/run.log"
fi
exit "$rc"
