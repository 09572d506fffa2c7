"""LoRA and the checkpoints a run loads.

- From base weights: a checkpoint of the base model (an import from Hugging Face, a full training
  run) holds no ``lora_A`` / ``lora_B``. megatron would ask it for them and stop on the missing
  keys, so the load (``_load_base_checkpoint``, a megatron_changes row) leaves out of what it asks
  for the adapters the checkpoint does not hold, and hands back the model's own: they keep their
  start (``B = 0``). A LoRA run's checkpoint loads its adapters as it loads everything else, and
  targets added since start fresh the same way.
- The base is named: ``args.lora_base`` (``record_base``), saved with the run's args in every
  checkpoint, is the checkpoint iteration the adapters adapt: the loaded one when it holds no
  adapters, else the one its own args name, so resumes carry it on.
- Nothing trained is dropped: megatron ignores what a checkpoint holds beyond the model, so a run
  without the adapters a checkpoint was trained with (no ``--lora-rank``, another rank, fewer
  targets) is refused before it starts (``check_adapters_kept``).
"""

from __future__ import annotations

import functools
import os
import re

from examples.multimodal_dev.console import say

from .files import TRACKER, checkpoint_directory, stored_args

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
# megatron stores a parameter's optimizer state under the parameter's own key behind the optimizer's
# prefix (``optimizer.state.exp_avg.KEY``: the plain and the fully reshardable distributed optimizer;
# ``optimizer.distributed.*``: the DP-reshardable buckets), with ``chained_N.`` ahead where it chains a
# dense and an expert optimizer: an adapter's moments are not an adapter
_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")


def is_model_key(key: str) -> bool:
    """Whether a checkpoint's tensor ``key`` is the model's own, not the optimizer's state of one."""
    return _OPTIMIZER_KEY.match(key) is None


def is_adapter_key(key: str) -> bool:
    return key.endswith(ADAPTER_SUFFIXES)


@functools.lru_cache(maxsize=None)
def stored_adapters(directory: str) -> frozenset[str]:
    """The adapter tensors the checkpoint iteration at ``directory`` stores, by key (a ``B`` split
    into the weight's sections, stored as ``...lora_B.query`` and so on, under its own key)."""
    from megatron.core import dist_checkpointing

    out = set()
    for key in filter(is_model_key, dist_checkpointing.load_tensors_metadata(directory).keys()):
        for suffix in ADAPTER_SUFFIXES:
            if f"{suffix}." in f"{key}.":
                out.add(key[: key.index(suffix) + len(suffix)])
    return frozenset(out)


def check_adapters_kept(args, load_dir: str | None, flag: str) -> None:
    """Refuse, by name, a run that would drop the adapters the checkpoint at ``load_dir`` trained."""
    if not load_dir or not os.path.isfile(os.path.join(load_dir, TRACKER)):
        return
    stored = stored_args(checkpoint_directory(load_dir))
    rank = getattr(stored, "lora_rank", 0) or 0
    if not rank:
        return
    fix = (
        f"train on with --lora-rank {rank} --lora-targets {stored.lora_targets} (LORA_RANK, LORA_TARGETS), "
        "or fold the adapters into the weights first (convert_checkpoint export)"
    )
    if args.lora_rank != rank:
        raise ValueError(
            f"{flag} {load_dir} holds LoRA adapters of rank {rank}; this run has "
            f"{'none' if not args.lora_rank else f'rank {args.lora_rank}'}: {fix}"
        )
    dropped = [t for t in stored.lora_targets.split(",") if t not in args.lora_targets.split(",")]
    if dropped:
        raise ValueError(f"{flag} {load_dir} holds LoRA adapters on {','.join(dropped)}, not in --lora-targets: {fix}")
    alpha = getattr(stored, "lora_alpha", None)
    if alpha is not None and alpha != args.lora_alpha:  # the same adapters at another scale: another model
        raise ValueError(
            f"{flag} {load_dir} holds LoRA adapters trained at --lora-alpha {alpha:g} (scale {alpha / rank:g}); "
            f"this run has {args.lora_alpha:g} (scale {args.lora_alpha / rank:g}): train on with "
            f"--lora-alpha {alpha:g} (LORA_ALPHA)"
        )


def record_base(args) -> None:
    """Set ``args.lora_base`` for a LoRA run (see the module's docstring) and name it in one line."""
    if not args.lora_rank:
        return
    # megatron loads --load where it holds a checkpoint, else --pretrained-checkpoint
    loaded = next(
        (d for d in (args.load, args.pretrained_checkpoint) if d and os.path.isfile(os.path.join(d, TRACKER))), None
    )
    args.lora_base = None
    if loaded is not None:
        directory = checkpoint_directory(loaded)
        stored = stored_args(directory)
        trained = getattr(stored, "lora_rank", 0)
        args.lora_base = getattr(stored, "lora_base", None) if trained else os.path.abspath(directory)
    named = args.lora_base or ("a base its checkpoint does not record" if loaded else "the random initialisation")
    say(f"LoRA adapters adapt {named}")


def base_without_adapters(load_base, run=None):
    """``_load_base_checkpoint`` that loads a base checkpoint into a model with adapters."""

    @functools.wraps(load_base)
    def load(load_dir, args, *rest, **kwargs):
        sharded = kwargs.get("sharded_state_dict")
        own = {}
        if sharded and load_dir and os.path.isdir(load_dir):
            own = {
                (part, key): value
                for part, state in sharded.items()
                if part.startswith("model") and isinstance(state, dict)
                for key, value in state.items()
                if is_adapter_key(key)
            }
            held = stored_adapters(checkpoint_directory(load_dir)) if own else frozenset()
            own = {where: value for where, value in own.items() if value.key not in held}
            for part, key in own:
                del sharded[part][key]
        loaded = load_base(load_dir, args, *rest, **kwargs)
        if own and loaded[0] is not None:
            for (part, key), value in own.items():
                loaded[0][part][key] = value.data  # the model's own adapter: its start stays
            fresh = "no LoRA adapters: its weights are the base" if not held else f"{len(own)} adapter tensors fewer"
            say(f"{load_dir} holds {fresh}; the adapters it lacks start at B = 0")
        return loaded

    return load
