"""The run rebuilt from the training script's parsed flags: the same ``RunConfig`` the launcher checked,
so the training script runs the launcher's checks (``checks.py``) on what it was actually given, the
user's extra flags included, and a user who starts it with torchrun directly meets every check too.

Each variable declared with a flag (``run_config.py``) is read from that flag's value and parsed by
its own parser, so a value is refused in the same words either way; the few that are not one flag
are read below. A refusal names the variables, then how the command line spells each one
(``SEQ_LEN=335 ... (SEQ_LEN: --seq-length, CP: --context-parallel-size)``): one check, one text."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import replace
from typing import Any

from ..models import ModelShape
from .checks import CHECKS, nodes
from .from_env import Host
from .megatron_argv import SIZES
from .run_config import LaunchError, RunConfig, settings
from .variables import SETTINGS

# How the training script's command line gives the variables that are not one flag of their own
SPELT = {
    "MODEL_VARIANT": "--model-variant",
    "HF_CONFIG": "--hf-config-path",
    "MOE": "--variant-moe",
    "MTP": "--mtp-num-layers",
    "PACKED": "--no-packed-sequence",
    "NPROC": "the ranks on each node (torchrun's --nproc-per-node)",
    "NNODES": "torchrun's --nnodes",
    "CKPT_LOAD": "--load with --finetune, or --pretrained-checkpoint",
    "CKPT_RESUME": "--load",
    "CKPT_SAVE": "--save",
    "SAVE_INTERVAL": "--save-interval",
    "COLLECTIVE_TIMEOUT": "--distributed-timeout-minutes",
}
SPELLING = {**SPELT, **{s.name: s.flag for s in SETTINGS if s.flag}}
_WORD = re.compile(r"\b[A-Z][A-Z0-9_]*[A-Z0-9]\b")
# Read whether typed or not: the script's own defaults size the run (megatron's --micro-batch-size is 1,
# the recipe's MBS 2). The rest are read where typed: untyped, a flag's default is the variable unset.
ALWAYS_READ = (*SIZES, "SEQ_LEN", "TRAIN_ITERS")
# the launcher's own: where the nodes meet is torchrun's concern by the time the script runs
TRAINER_CHECKS = tuple(check for check in CHECKS if check is not nodes)


def _text(value: Any) -> str | None:
    """A parsed flag's value as the variable's text (None: not given)."""
    if isinstance(value, list):  # megatron's --data-path takes several words
        value = " ".join(map(str, value)) or None
    if value is None:
        return None
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def _not_one_flag(args: Any, world: int, per_node: int) -> dict[str, dict[str, Any]]:
    finetuned = bool(getattr(args, "finetune", False))
    return {
        "model": {
            "variant": args.model_variant,
            "hf_config": getattr(args, "hf_config_path", None),
            "moe": getattr(args, "variant_moe", None) == "on",
            "mtp": bool(getattr(args, "mtp_num_layers", None)),
        },
        "layout": {"nproc": per_node, "nnodes": max(1, world // per_node)},
        "batch": {"packed": bool(getattr(args, "use_packed_sequence", True))},
        "checkpoint": {
            "load": getattr(args, "pretrained_checkpoint", None) or (args.load if finetuned else None),
            "resume": None if finetuned else args.load,
            "save": args.save,
            "save_interval": getattr(args, "save_interval", None),
        },
    }


def config_from_args(
    args: Any, dest_of: Mapping[str, str], typed: Collection[str], world: int, per_node: int, moe: bool
) -> RunConfig:
    """The run the parsed ``args`` describe. ``dest_of``: each flag's attribute in ``args``; ``typed``:
    the attributes whose flags the command line names; ``world``, ``per_node``: the ranks in all and on
    each node; ``moe``: the model has routed experts (a dense model has no dispatcher to name)."""
    changes = _not_one_flag(args, world, per_node)
    for section, attribute, setting in settings():
        dest = dest_of.get(setting.flag or "")
        if dest is None or not (dest in typed or setting.name in ALWAYS_READ):
            continue
        text = _text(getattr(args, dest, None))
        if text is not None:
            changes.setdefault(section, {})[attribute] = setting.parse(setting.name, text)
    if not moe:
        changes.get("backend", {}).pop("dispatcher", None)
    config = RunConfig()
    config = replace(config, **{s: replace(getattr(config, s), **c) for s, c in changes.items()})
    if args.global_batch_size is None:  # megatron's: one micro-batch on each data-parallel rank
        config = replace(config, batch=replace(config.batch, gbs=config.batch.mbs * config.layout.dp))
    return config


def spelt(line: str) -> str:
    """``line`` with how the command line gives each variable it names."""
    named = [word for word in dict.fromkeys(_WORD.findall(line)) if word in SPELLING]
    return f"{line} ({', '.join(f'{name}: {SPELLING[name]}' for name in named)})" if named else line


def check_as_launched(config: RunConfig, shape: ModelShape, host: Host) -> None:
    """The launcher's checks on the run the training script was given: ``ValueError`` in one line."""
    for check in TRAINER_CHECKS:
        if line := check(config, shape, host):
            raise ValueError(spelt(line))


def rebuilt(
    args: Any, dest_of: Mapping[str, str], typed: Collection[str], world: int, per_node: int, moe: bool
) -> RunConfig:
    """``config_from_args`` with a malformed value as ``ValueError`` naming its variable and flag."""
    try:
        return config_from_args(args, dest_of, typed, world, per_node, moe)
    except LaunchError as err:
        raise ValueError(spelt(str(err))) from None
