"""How a setting is named in a message: as megatron's flag (``--tensor-model-parallel-size 2``,
where the training script or a tool checks it) or as the run script's variable (``TP=2``, where
``launcher/checks.py`` checks it before any rank starts). One check, two audiences: the checks
of ``qwen35_vl/parallel.py``, ``planner/pipeline_layout.py``, ``vision_ranks/layout.py`` and
``schedule_problem`` below take ``names=FLAGS`` or ``names=VARIABLES``."""

from __future__ import annotations

FLAGS = {
    "world": "the world size",
    "tp": "--tensor-model-parallel-size",
    "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size",
    "pp": "--pipeline-model-parallel-size",
    "vp": "--num-virtual-stages-per-pipeline-rank",
    "first": "--decoder-first-pipeline-num-layers",
    "last": "--decoder-last-pipeline-num-layers",
    "vtp": "--vision-tensor-parallel-size",
    "vnproc": "--vision-nproc",
    "warmup": "--lr-warmup-iters",
    "decay": "--lr-decay-iters",
    "iters": "--train-iters",
}
VARIABLES = {
    "world": "NPROC=",
    "tp": "TP=",
    "cp": "CP=",
    "ep": "EP=",
    "pp": "PP=",
    "vp": "VP=",
    "first": "PP_FIRST=",
    "last": "PP_LAST=",
    "vtp": "VISION_TP=",
    "vnproc": "VISION_NPROC=",
    "warmup": "LR_WARMUP_ITERS=",
    "decay": "LR_DECAY_ITERS=",
    "iters": "TRAIN_ITERS=",
}


def named(names: dict, key: str, value) -> str:
    """``--tensor-model-parallel-size 2`` (FLAGS) or ``TP=2`` (VARIABLES)."""
    sep = "" if names[key].endswith("=") else " "
    return f"{names[key]}{sep}{value}"


def schedule_problem(warmup: int | None, decay: int | None, train_iters: int, names: dict = FLAGS) -> str | None:
    """megatron's LR scheduler asserts ``warmup < decay`` without naming either (decay: the decay
    iterations, else the training iterations); the line naming both, or None."""
    end, which = (decay, "decay") if decay else (train_iters, "iters")
    if warmup and end and warmup >= end:
        return (
            f"{named(names, 'warmup', warmup)} must be smaller than the decay iterations ({named(names, which, end)})"
        )
    return None


# Why Megatron-FSDP (FSDP=1, --use-megatron-fsdp) does not run with each of these: one text for the
# launcher's checks (by variable), the training script's (by flag) and the planner's
FSDP_REFUSALS = {
    "pp": "its fsdp_dtensor checkpoints name layers per pipeline stage, so stages collide",
    "vision_nproc": "the tower's own ranks save torch_dist",
    "lora": "LoRA checkpoints are torch_dist",
    "vision_chunks": "the tower's layers would run once per chunk, and the number of chunks differs between ranks",
    "grouped_ep": "fsdp_dtensor names an expert weight by its parameter, and every EP rank's grouped weight has the "
    "same name; save at EP=1, or with SequentialMLP (GROUPED_EXPERTS=0)",
    "gen_eval": "decoding reads the model's weights whole, and FSDP holds each rank's shard",
}

# The post-training modes (``--train-mode``) whose reference is the base with the LoRA adapters off: the
# routers are frozen (no load-balancing loss unless asked for) and the MTP head has no loss of theirs.
ON_THE_BASE_MODES = ("dpo", "grpo")
# GRPO's rewards by name (``--grpo-reward``), the keys of post_training/grpo.py's REWARDS: the launcher
# checks a name before any rank starts
REWARD_NAMES = ("exact_match", "token_f1", "anls", "field_f1", "tree_accuracy")
