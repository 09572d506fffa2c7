#!/usr/bin/env bash
# Train Qwen3.5-VL with Megatron-Core: bash run_qwen35_vl.sh [extra megatron flags]
# (a flag that a variable below sets, such as --tensor-model-parallel-size for TP, is refused: set the variable)
#
# Environment (defaults in brackets):
#   MODEL_VARIANT   tiny | proxy | 0.8b | 2b | 4b | 9b | 27b | 35b_a3b | 122b_a10b | 397b_a17b
#                   [tiny without a GPU, proxy with one]
#   HF_CONFIG       take the shape from a Hugging Face config.json instead of a variant
#                   [CKPT_LOAD/hf_config.json when CKPT_LOAD is an import from Hugging Face]
#   TP CP EP PP     tensor / context / expert / pipeline parallel sizes [1 1 1 1]
#   ETP             expert tensor parallel size [TP]
#   VP              virtual pipeline stages per pipeline rank: the interleaved schedule [1]
#   PP_FIRST PP_LAST  decoder layers on the first / last pipeline stage (uneven split) [even]
#   SP              1 = sequence parallelism (needs TP>1) [1 for MoE with TP>1, which megatron requires; else 0]
#   VISION_TP       the vision tower's tensor parallel size (the rest of its ranks is its data parallelism); on
#                   the language model's ranks a divisor of TP [TP; with VISION_NPROC: VISION_NPROC / the language
#                   model's DP, a vision replica for each language one, else 1 where VISION_NPROC divides that DP];
#                   with VISION_NPROC its DP is a multiple (fan-in) or a divisor (fan-out) of the language model's
#   VISION_NPROC    ranks 0..VISION_NPROC-1 run only the vision tower, the others only the language model
#                   [0: it runs on the language model's first-stage ranks] (examples/multimodal_dev/vision_ranks/layout.py)
#   NPROC           processes on this node [TP*CP*PP + VISION_NPROC]
#   DATASET         mock | mock_mix (the length / image mix of a real SFT set) | mock_video (images and
#                   videos) | cord_v2 | jsonl (your own conversations; README "Your own data") | energon
#                   (Megatron-Energon shards, e.g. from tools/jsonl_to_energon.py) [mock];
#                   DATA_PATH, HF_PROCESSOR_PATH for cord_v2, jsonl and energon
#   jsonl only:     VALID_DATA_PATH (else VALID_FRACTION of DATA_PATH [0]), MEDIA_ROOT, STRICT_DATA=1,
#                   REMOTE_MEDIA=1 (fetch http(s) media), MEDIA_ANYWHERE=1 (media outside the JSONL's
#                   folder or MEDIA_ROOT), VIDEO_FPS [2], VIDEO_MAX_FRAMES [768],
#                   VIDEO_MAX_PIXELS (one frame's area after resizing)
#   TRAIN_ITERS MBS GBS SEQ_LEN LR    [30 2 4 1024 2e-3 on CPU; 20 1 8 4096 1e-4 on GPU]
#   CKPT_LOAD       checkpoint to start from (with --finetune semantics: weights only)
#   CKPT_SAVE       where to save (at the end, and every SAVE_INTERVAL iterations)
#   CKPT_RESUME     one directory to resume from and keep saving to (exact resume); a resumed run
#                   keeps the checkpoint's LR schedule, so TRAIN_ITERS may grow to extend a run
#                   (with CKPT_LOAD too: the first run starts from CKPT_LOAD's weights, later ones resume)
#   LR_WARMUP_ITERS LR_DECAY_ITERS  the LR schedule [TRAIN_ITERS/10, TRAIN_ITERS]; when resuming,
#                   setting either replaces the checkpoint's schedule
#   PACKED          1 = THD packing (default), 0 = padded BSHD
#   PACKING         samples: a micro-batch packs MBS conversations [default]; tokens: a micro-batch is
#                   one row of PACKED_SEQ_LENGTH tokens [SEQ_LEN], rows dealt to DP ranks by FLOPs,
#                   GBS counts rows, MBS is 1 (examples/multimodal_dev/data/token_budget.py; with
#                   DATASET=energon each rank's loader fills its rows from its own stream)
#   MOE=1           tiny only: 4 experts (top-2), so EP can be exercised on CPU
#   MTP=1           also train the multi-token-prediction head (--mtp-num-layers 1)
#                   [1 when HF_CONFIG has one, so an import's MTP weights are trained and kept; else 0]
#   TRANSFORMER_IMPL  transformer_engine | local  [transformer_engine on a GPU host where it imports, else local]
#   MASTER_PORT     rendezvous port [a free one, chosen by torchrun --standalone]
#   FORK_RANKS      1: the ranks fork from one process that imported the engine once; 0: each is a fresh
#                   interpreter [1 without CUDA where NPROC exceeds the cores or on a warm engine, else 0]
#                   (examples/multimodal_dev/training/torchrun_launcher.py)
#   ENGINE_SERVER   CPU hosts: the socket of a warm engine that imported the engine once; the launch forks
#                   from it [unset] (examples/multimodal_dev/training/warm_engine.py)
#   DRY_RUN=1       print the command and exit, and the layout tools/plan_layout.py plans for GPUS H100s
#   GPUS            DRY_RUN only: the cluster's GPU count to plan for [9b ... 397b_a17b: the README's count]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

fail() { echo "run_qwen35_vl.sh: $*" >&2; exit 2; }

# Extra flags come last and win in megatron's parser, but the script sizes the processes, the LR
# schedule and its tables from these variables: a flag that replaces one would run a layout other
# than the one checked and printed (--vision-nproc 1 left no rank for the language model).
declare -A VARIABLE_OF=(
  [--tensor-model-parallel-size]=TP [--context-parallel-size]=CP [--expert-model-parallel-size]=EP
  [--expert-tensor-parallel-size]=ETP [--pipeline-model-parallel-size]=PP [--num-virtual-stages-per-pipeline-rank]=VP
  [--decoder-first-pipeline-num-layers]=PP_FIRST [--decoder-last-pipeline-num-layers]=PP_LAST [--sequence-parallel]=SP
  [--vision-tensor-parallel-size]=VISION_TP [--vision-nproc]=VISION_NPROC [--micro-batch-size]=MBS
  [--global-batch-size]=GBS [--seq-length]=SEQ_LEN [--train-iters]=TRAIN_ITERS [--lr]=LR [--packing]=PACKING
  [--packed-seq-length]=PACKED_SEQ_LENGTH [--dataset-provider]=DATASET [--transformer-impl]=TRANSFORMER_IMPL)
for arg in "$@"; do
  flag=${arg%%=*}
  [[ -z "${VARIABLE_OF[$flag]:-}" ]] || fail "$flag: set ${VARIABLE_OF[$flag]} instead (the script sizes the run from it)"
done

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAS_GPU=1; else HAS_GPU=0; fi
HF_CONFIG=${HF_CONFIG:-}
if [[ -z "$HF_CONFIG" && -n "${CKPT_LOAD:-}" && -f "${CKPT_LOAD}/hf_config.json" ]]; then
  HF_CONFIG="$CKPT_LOAD/hf_config.json"
  echo "run_qwen35_vl.sh: model shape from $HF_CONFIG (written by convert_checkpoint.py import)"
fi
if [[ -n "$HF_CONFIG" ]]; then
  [[ -f "$HF_CONFIG" ]] || fail "HF_CONFIG=$HF_CONFIG: no such file"
  MODEL_VARIANT=hf_config
elif [[ -z "${MODEL_VARIANT:-}" ]]; then
  MODEL_VARIANT=$([[ $HAS_GPU == 1 ]] && echo proxy || echo tiny)
  echo "run_qwen35_vl.sh: MODEL_VARIANT not set; using '$MODEL_VARIANT' ($([[ $HAS_GPU == 1 ]] && echo GPU found || echo no GPU))"
fi

# The model's numbers come from the one variant table (models/qwen35_vl/configuration.py) or the
# Hugging Face config, through models/megatron_args.py; megatron's model flags below repeat them for its own
# argument checks, and the training script verifies they agree.
# shellcheck source=tools/bootstrap_env.sh
source "$ROOT/tools/bootstrap_env.sh"
# ROW: the numbers on stdout; on failure ROW_ERROR is megatron_args.py's one-line reason.
shape_row() {
  local err; err="$(mktemp)"
  SHAPE_ARGS=("$@")  # also for the vision heads below
  if ROW=$("$PY" -m examples.multimodal_dev.models.megatron_args shape-row "$@" 2>"$err"); then rm -f "$err"; return 0; fi
  ROW_ERROR="$(tail -n 1 "$err")"; ROW_ERROR="${ROW_ERROR#megatron_args.py: }"; rm -f "$err"; return 1
}
VARIANT_FLAGS=()
if [[ -n "$HF_CONFIG" ]]; then
  shape_row --hf-config "$HF_CONFIG" || fail "HF_CONFIG=$HF_CONFIG: $ROW_ERROR"
  VARIANT_FLAGS=(--hf-config-path "$HF_CONFIG")
elif [[ "${MOE:-0}" == 1 ]]; then  # tiny with 4 experts (top-2), for expert-parallel runs on CPU
  [[ $MODEL_VARIANT == tiny ]] || fail "MOE=1 applies to MODEL_VARIANT=tiny only ($MODEL_VARIANT is fixed)"
  shape_row --variant tiny --moe || fail "MOE=1: $ROW_ERROR"
  VARIANT_FLAGS=(--variant-moe on)
else
  shape_row --variant "$MODEL_VARIANT" || fail "MODEL_VARIANT=$MODEL_VARIANT: $ROW_ERROR"
fi
[[ "${MOE:-0}" == 0 || "${MOE:-0}" == 1 ]] || fail "MOE=$MOE: expected 0 or 1"
read -r LAYERS HIDDEN HEADS KV HEAD_DIM FFN VOCAB EXPERTS TOPK MOE_FFN GDN_K GDN_V SHAPE_MTP <<<"$ROW"
HF_MTP=0; [[ -n "$HF_CONFIG" ]] && HF_MTP=$SHAPE_MTP  # the MTP layers of HF_CONFIG, never read from the environment

# Every number is checked before bash arithmetic sees it (set -u would report "abc: unbound variable").
positive() { local var; for var in "$@"; do [[ "${!var}" =~ ^[1-9][0-9]*$ ]] || fail "$var=${!var} must be a positive integer"; done; }
TP=${TP:-1}; CP=${CP:-1}; EP=${EP:-1}; PP=${PP:-1}
positive TP CP EP PP
ETP=${ETP:-$TP}; VP=${VP:-1}
VISION_TP=${VISION_TP:-}; VISION_NPROC=${VISION_NPROC:-0}  # VISION_TP unset: vision_ranks/layout.py's default
[[ "$VISION_NPROC" =~ ^(0|[1-9][0-9]*)$ ]] || fail "VISION_NPROC=$VISION_NPROC must be a non-negative integer"
PP_FIRST=${PP_FIRST:-0}; PP_LAST=${PP_LAST:-0}
SP=${SP:-$(( TP > 1 && EXPERTS > 0 ? 1 : 0 ))}
NPROC=${NPROC:-$((TP * CP * PP + VISION_NPROC))}
DATASET=${DATASET:-mock}
PACKED=${PACKED:-1}
PACKING=${PACKING:-samples}
[[ "$PACKING" == samples || "$PACKING" == tokens ]] || fail "PACKING=$PACKING: expected samples or tokens"
[[ "$PACKING" == samples ]] || MBS=${MBS:-1}  # a micro-batch is one row
if [[ $HAS_GPU == 1 ]]; then
  TRAIN_ITERS=${TRAIN_ITERS:-20}; MBS=${MBS:-1}; GBS=${GBS:-8}; SEQ_LEN=${SEQ_LEN:-4096}; LR=${LR:-1e-4}
else
  TRAIN_ITERS=${TRAIN_ITERS:-30}; MBS=${MBS:-2}; GBS=${GBS:-4}; SEQ_LEN=${SEQ_LEN:-1024}; LR=${LR:-2e-3}
fi
PACKED_SEQ_LENGTH=${PACKED_SEQ_LENGTH:-$SEQ_LEN}
positive ETP VP NPROC TRAIN_ITERS MBS GBS SEQ_LEN PACKED_SEQ_LENGTH
[[ -z "$VISION_TP" ]] || positive VISION_TP
[[ -z "${SAVE_INTERVAL:-}" ]] || positive SAVE_INTERVAL
for var in PP_FIRST PP_LAST; do
  [[ "${!var}" =~ ^[0-9]+$ ]] || fail "$var=${!var} must be a number of decoder layers"
done
for var in LR_WARMUP_ITERS LR_DECAY_ITERS; do
  [[ -z "${!var:-}" || "${!var}" =~ ^[0-9]+$ ]] || fail "$var=${!var} must be a number of iterations"
done
(( ${LR_WARMUP_ITERS:-0} < ${LR_DECAY_ITERS:-$TRAIN_ITERS} )) || fail "LR_WARMUP_ITERS=$LR_WARMUP_ITERS must be smaller" \
  "than the decay iterations ($([[ -n "${LR_DECAY_ITERS:-}" ]] && echo "LR_DECAY_ITERS=$LR_DECAY_ITERS" || echo "TRAIN_ITERS=$TRAIN_ITERS"))"
# the split of the decoder over pipeline stages (planner/pipeline_layout.py: megatron-core's rule, checked by name)
SPLIT_ERROR=$("$PY" -m examples.multimodal_dev.planner.pipeline_layout check "$LAYERS" "$PP" "$VP" "$PP_FIRST" "$PP_LAST" 2>&1) \
  || fail "${SPLIT_ERROR#pipeline_layout.py: }"
[[ "$SP" == 0 || "$SP" == 1 ]] || fail "SP=$SP: expected 0 or 1"
[[ "$PACKED" == 0 || "$PACKED" == 1 ]] || fail "PACKED=$PACKED: expected 0 (padded BSHD) or 1 (THD packing)"
[[ "$LR" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] || fail "LR=$LR: expected a number such as 1e-4"
# the pattern admits 1e999, which is inf in fp32 and in Python alike: the first step would turn every weight NaN
awk -v lr="$LR" 'BEGIN { exit !(lr + 0 >= 0 && lr + 0 < 1e38) }' || fail "LR=$LR: expected a finite learning rate"
(( SP == 0 || TP > 1 )) || fail "SP=1 needs TP>1 (sequence parallelism splits the sequence over TP ranks)"
(( SEQ_LEN % (2 * CP) == 0 )) || fail "SEQ_LEN=$SEQ_LEN must be a multiple of 2*CP=$((2 * CP)) (context parallelism cuts every sample into 2*CP chunks)"
(( SP == 1 || TP == 1 || EXPERTS == 0 )) || fail "SP=0 with TP=$TP: megatron-core requires sequence parallelism for MoE with TP>1"
(( EP == 1 || EXPERTS > 0 )) || fail "EP=$EP needs an MoE variant; MODEL_VARIANT=$MODEL_VARIANT is dense"
(( EXPERTS == 0 || EXPERTS % EP == 0 )) || fail "EP=$EP does not divide the $EXPERTS experts of $MODEL_VARIANT"
# the language model's ranks: all but the VISION_NPROC that run only the vision tower
LANG_NPROC=$((NPROC - VISION_NPROC)); LANG_NAME=$( (( VISION_NPROC > 0 )) && echo "(NPROC-VISION_NPROC)" || echo NPROC)
(( LANG_NPROC > 0 )) || fail "VISION_NPROC=$VISION_NPROC leaves no ranks for the language model (NPROC=$NPROC)"
(( LANG_NPROC % (TP * CP * PP) == 0 )) || fail "$LANG_NAME=$LANG_NPROC is not divisible by TP*CP*PP=$((TP * CP * PP))"
(( (LANG_NPROC / PP) % (EP * ETP) == 0 )) || fail "EP=$EP: $LANG_NAME/PP=$((LANG_NPROC / PP)) is not divisible by EP*ETP=$((EP * ETP))"
(( HEADS % TP == 0 )) || fail "TP=$TP does not divide the $HEADS attention heads of $MODEL_VARIANT"
(( GDN_K % (TP * CP) == 0 && GDN_V % (TP * CP) == 0 )) \
  || fail "TP*CP=$((TP * CP)) does not divide the Gated DeltaNet heads ($GDN_K key, $GDN_V value) of $MODEL_VARIANT"
(( GBS % (MBS * LANG_NPROC / (TP * CP * PP)) == 0 )) \
  || fail "GBS=$GBS is not a multiple of MBS*DP=$((MBS * LANG_NPROC / (TP * CP * PP)))"
# the vision tower's own ranks and TP/DP (vision_ranks/layout.py: refused by name when megatron-core
# cannot run them)
VISION_HEADS=$("$PY" -m examples.multimodal_dev.models.megatron_args vision-heads "${SHAPE_ARGS[@]}" 2>/dev/null) \
  || fail "the vision heads of $MODEL_VARIANT could not be read"
if ! VISION_TABLE=$("$PY" -m examples.multimodal_dev.vision_ranks.layout table "$NPROC" "$TP" "$CP" "$PP" "$VP" \
                    "${VISION_TP:-0}" "$VISION_NPROC" "$VISION_HEADS" 2>&1); then
  fail "${VISION_TABLE#vision_ranks/layout.py: }"
fi
# a layout of the tower's own: its rank table is printed, and a VISION_TP set is passed on
OWN_VISION_LAYOUT=$(( VISION_NPROC > 0 || ${VISION_TP:-$TP} != TP ))
case "$DATASET" in
  mock|mock_mix|mock_video) ;;
  cord_v2|jsonl|energon)
    [[ -n "${DATA_PATH:-}" ]] || fail "DATASET=$DATASET needs DATA_PATH"
    [[ -n "${HF_PROCESSOR_PATH:-}" ]] || fail "DATASET=$DATASET needs HF_PROCESSOR_PATH";;
  *) fail "DATASET=$DATASET must be mock, mock_mix, mock_video, cord_v2, jsonl or energon";;
esac
OWN_DATA=()  # DATASET=jsonl: the user's records and media (arguments.py, "your own data")
for var in STRICT_DATA REMOTE_MEDIA MEDIA_ANYWHERE; do
  [[ "${!var:-0}" == 0 || "${!var:-0}" == 1 ]] || fail "$var=${!var}: expected 0 or 1"
done
[[ -z "${VALID_FRACTION:-}" || "$VALID_FRACTION" =~ ^0?\.[0-9]+$|^0$ ]] || fail "VALID_FRACTION=$VALID_FRACTION: expected a fraction below 1, such as 0.02"
[[ -z "${VIDEO_FPS:-}" || "$VIDEO_FPS" =~ ^[0-9]*\.?[0-9]+$ ]] || fail "VIDEO_FPS=$VIDEO_FPS: expected a positive number such as 2"
[[ -z "${VIDEO_MAX_FRAMES:-}" ]] || positive VIDEO_MAX_FRAMES
[[ -z "${VIDEO_MAX_PIXELS:-}" ]] || positive VIDEO_MAX_PIXELS
[[ -n "${VALID_DATA_PATH:-}" ]] && OWN_DATA+=(--eval-data-path "$VALID_DATA_PATH")
[[ -n "${VALID_FRACTION:-}" ]] && OWN_DATA+=(--valid-fraction "$VALID_FRACTION")
[[ -n "${MEDIA_ROOT:-}" ]] && OWN_DATA+=(--media-root "$MEDIA_ROOT")
[[ "${STRICT_DATA:-0}" == 1 ]] && OWN_DATA+=(--strict-data)
[[ "${REMOTE_MEDIA:-0}" == 1 ]] && OWN_DATA+=(--allow-remote-media)
[[ "${MEDIA_ANYWHERE:-0}" == 1 ]] && OWN_DATA+=(--allow-media-anywhere)
[[ -n "${VIDEO_FPS:-}" ]] && OWN_DATA+=(--video-fps "$VIDEO_FPS")
[[ -n "${VIDEO_MAX_FRAMES:-}" ]] && OWN_DATA+=(--video-max-frames "$VIDEO_MAX_FRAMES")
[[ -n "${VIDEO_MAX_PIXELS:-}" ]] && OWN_DATA+=(--video-max-pixels "$VIDEO_MAX_PIXELS")
if (( ${#OWN_DATA[@]} > 0 )) && [[ "$DATASET" != jsonl && "$DATASET" != energon ]]; then
  fail "VALID_DATA_PATH, VALID_FRACTION, MEDIA_ROOT, STRICT_DATA, REMOTE_MEDIA, MEDIA_ANYWHERE and VIDEO_* apply to DATASET=jsonl (and energon) only (DATASET=$DATASET)"
fi
if [[ "$DATASET" == energon ]]; then  # the shards hold the media; validation is the dataset's val split
  for var in VALID_DATA_PATH VALID_FRACTION MEDIA_ROOT REMOTE_MEDIA MEDIA_ANYWHERE; do
    [[ -z "${!var:-}" || "${!var}" == 0 ]] || fail "$var applies to DATASET=jsonl; an energon dataset carries its media and its val split"
  done
fi

ARGS=(
  --model-arch qwen35_vl --model-variant "$MODEL_VARIANT"
  --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS"
  --group-query-attention --num-query-groups "$KV" --kv-channels "$HEAD_DIM"
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --tokenizer-type NullTokenizer --vocab-size "$VOCAB"
  --tensor-model-parallel-size "$TP" --context-parallel-size "$CP"
  --expert-model-parallel-size "$EP" --expert-tensor-parallel-size "$ETP" --pipeline-model-parallel-size "$PP"
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
  --lr "$LR" --min-lr "$(awk -v lr="$LR" 'BEGIN { print lr / 10 }')" --lr-decay-style cosine
  --lr-warmup-iters "${LR_WARMUP_ITERS:-$(( TRAIN_ITERS / 10 ))}" --lr-decay-iters "${LR_DECAY_ITERS:-$TRAIN_ITERS}"
  --weight-decay 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0
  --calculate-per-token-loss --log-interval 1 --eval-interval "$TRAIN_ITERS" --eval-iters 2
  --dataset-provider "$DATASET" --seed 1234 "${VARIANT_FLAGS[@]}" "${OWN_DATA[@]}"
)
if (( EXPERTS > 0 )); then
  ARGS+=(--num-experts "$EXPERTS" --moe-router-topk "$TOPK" --moe-ffn-hidden-size "$MOE_FFN" --ffn-hidden-size "$MOE_FFN")
else
  ARGS+=(--ffn-hidden-size "$FFN")
fi
[[ $PACKED == 1 ]] || ARGS+=(--no-packed-sequence)
[[ $PACKING == samples ]] || ARGS+=(--packing tokens --packed-seq-length "$PACKED_SEQ_LENGTH")
(( VP > 1 )) && ARGS+=(--num-virtual-stages-per-pipeline-rank "$VP")
[[ -n "$VISION_TP" ]] && (( OWN_VISION_LAYOUT )) && ARGS+=(--vision-tensor-parallel-size "$VISION_TP")
# the tower on ranks of its own sums its grad norm over the world's distributed-optimizer shards
(( VISION_NPROC > 0 )) && ARGS+=(--vision-nproc "$VISION_NPROC" --use-distributed-optimizer)
(( PP_FIRST > 0 )) && ARGS+=(--decoder-first-pipeline-num-layers "$PP_FIRST")
(( PP_LAST > 0 )) && ARGS+=(--decoder-last-pipeline-num-layers "$PP_LAST")
(( SP == 1 )) && ARGS+=(--sequence-parallel)
# gloo runs the allgather token dispatcher; GPUs use alltoall (uneven per-rank token counts, less traffic)
(( EXPERTS > 0 && HAS_GPU == 1 )) && ARGS+=(--moe-token-dispatcher-type alltoall)
MTP=${MTP:-$(( HF_MTP > 0 ? 1 : 0 ))}
case "$MTP" in
  0) ;;
  # megatron's argument check admits MTP only with rotary positions; the model's interleaved
  # MRoPE is built from the variant, so this flag only satisfies that check.
  1) ARGS+=(--mtp-num-layers 1 --position-embedding-type rope);;
  *) fail "MTP=$MTP: expected 0 or 1 (Qwen3.5 has one MTP layer)";;
esac
[[ -n "${DATA_PATH:-}" ]] && ARGS+=(--data-path "$DATA_PATH")
[[ -n "${HF_PROCESSOR_PATH:-}" ]] && ARGS+=(--hf-processor-path "$HF_PROCESSOR_PATH")
# Backend: Transformer Engine where a GPU has it, else megatron-core's local modules (the same
# checkpoint keys either way). The host decides precision and the collective backend.
if [[ -z "${TRANSFORMER_IMPL:-}" ]]; then
  TRANSFORMER_IMPL=local
  if [[ $HAS_GPU == 1 ]]; then
    "$PY" -c 'import transformer_engine.pytorch' >/dev/null 2>&1 && TRANSFORMER_IMPL=transformer_engine
  fi
  echo "run_qwen35_vl.sh: backend $TRANSFORMER_IMPL ($([[ $HAS_GPU == 1 ]] && echo GPU || echo CPU) host; TRANSFORMER_IMPL overrides)"
fi
case "$TRANSFORMER_IMPL" in
  local) ;;
  transformer_engine)
    [[ $HAS_GPU == 1 ]] || fail "TRANSFORMER_IMPL=transformer_engine needs a GPU; this host has none (use local)"
    "$PY" -c 'import transformer_engine.pytorch' >/dev/null 2>&1 \
      || fail "TRANSFORMER_IMPL=transformer_engine: transformer_engine does not import with $PY (use local, or INSTALL_GPU_EXTRAS=1)";;
  *) fail "TRANSFORMER_IMPL=$TRANSFORMER_IMPL: expected transformer_engine or local";;
esac
ARGS+=(--transformer-impl "$TRANSFORMER_IMPL")
# --log-throughput: model TFLOP/s from models/qwen35_vl/flops.py (pretrain_multimodal.py replaces megatron's GPT formula)
ARGS+=(--log-throughput)
if [[ $HAS_GPU == 1 ]]; then ARGS+=(--bf16); else ARGS+=(--distributed-backend gloo); fi
if [[ -n "${CKPT_RESUME:-}" ]]; then
  ARGS+=(--load "$CKPT_RESUME" --save "$CKPT_RESUME" --save-interval "${SAVE_INTERVAL:-$TRAIN_ITERS}")
  # CKPT_LOAD with CKPT_RESUME: the first run starts from CKPT_LOAD's weights (megatron loads
  # --pretrained-checkpoint, as --finetune, while the resume directory holds no checkpoint); later
  # runs resume from CKPT_RESUME
  [[ -n "${CKPT_LOAD:-}" ]] && ARGS+=(--pretrained-checkpoint "$CKPT_LOAD")
  if [[ -f "$CKPT_RESUME/latest_checkpointed_iteration.txt" ]]; then
    # megatron refuses a schedule that differs from the checkpoint's: keep the saved one (a longer
    # TRAIN_ITERS then extends the run at its final LR) unless the user sets one explicitly
    if [[ -n "${LR_WARMUP_ITERS:-}${LR_DECAY_ITERS:-}" ]]; then
      ARGS+=(--override-opt_param-scheduler)
      echo "run_qwen35_vl.sh: resuming with the LR schedule of LR_WARMUP_ITERS / LR_DECAY_ITERS"
    else
      ARGS+=(--use-checkpoint-opt_param-scheduler)
      echo "run_qwen35_vl.sh: resuming with the checkpoint's LR schedule (LR_WARMUP_ITERS / LR_DECAY_ITERS replace it)"
    fi
  fi
else
  [[ -n "${CKPT_LOAD:-}" ]] && ARGS+=(--load "$CKPT_LOAD" --finetune)
  [[ -n "${CKPT_SAVE:-}" ]] && ARGS+=(--save "$CKPT_SAVE" --save-interval "${SAVE_INTERVAL:-$TRAIN_ITERS}")
fi

# Several runs may share a host: without MASTER_PORT, torchrun --standalone picks a free port.
if [[ -n "${MASTER_PORT:-}" ]]; then RDZV=(--master-port "$MASTER_PORT"); else RDZV=(--standalone); fi
# The training script runs as the module of the package examples.multimodal_dev (PYTHONPATH holds
# the repository root: tools/bootstrap_env.sh), so no folder of the example shadows an installed package.
LAUNCH=(torchrun --nproc-per-node "$NPROC" "${RDZV[@]}" --module examples.multimodal_dev.pretrain_multimodal)
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  # the layout planner's choice for a cluster of GPUS H100s (README, "Planning a cluster layout");
  # without GPUS, only the variants with a default count; the command stays the last line
  (( OWN_VISION_LAYOUT )) && echo "$VISION_TABLE"  # which ranks run which module
  if [[ -n "$HF_CONFIG" ]]; then PLAN_MODEL=(--hf-config "$HF_CONFIG"); else PLAN_MODEL=("$MODEL_VARIANT"); fi
  if [[ -n "${GPUS:-}" ]]; then
    positive GPUS
    PLAN_LINE=$("$PY" -m examples.multimodal_dev.tools.plan_layout "${PLAN_MODEL[@]}" --brief --gpus "$GPUS" 2>&1) \
      || fail "GPUS=$GPUS: ${PLAN_LINE##*plan_layout: }"
    echo "# planned cluster layout: $PLAN_LINE"
  elif [[ -z "$HF_CONFIG" ]] && PLAN_LINE=$("$PY" -m examples.multimodal_dev.tools.plan_layout "$MODEL_VARIANT" --brief 2>/dev/null); then
    echo "# planned cluster layout: $PLAN_LINE"
  fi
  printf '%q ' "${LAUNCH[@]}" "${ARGS[@]}" "$@"; echo
  exit 0
fi

echo "run_qwen35_vl.sh: $MODEL_VARIANT, TP=$TP CP=$CP EP=$EP PP=$PP VP=$VP SP=$SP NPROC=$NPROC, dataset $DATASET, packing $PACKING, $TRAIN_ITERS iterations"
(( OWN_VISION_LAYOUT )) && echo "$VISION_TABLE" | sed 's/^# /run_qwen35_vl.sh: /'

# training/torchrun_launcher.py is torchrun without its own traceback when a rank fails (the rank has said why)
exec "$PY" -m examples.multimodal_dev.training.torchrun_launcher "${LAUNCH[@]:1}" "${ARGS[@]}" "$@"
