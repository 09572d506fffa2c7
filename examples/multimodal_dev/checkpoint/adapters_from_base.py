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
- An MTP head started afresh: a weights-only start (``--finetune``, the run script's ``CKPT_LOAD``) of
  a model with an MTP head from a checkpoint holding none (an import of a checkpoint transformers'
  ``save_pretrained`` wrote, which has no ``mtp.*``) leaves the head out of the request the same way:
  it keeps its initialisation (``MTP=1`` asks for it). A checkpoint holding part of a head is not this
  case, and megatron's missing-key error stands.
- Nothing trained is dropped: megatron ignores what a checkpoint holds beyond the model, so a run
  without the adapters a checkpoint was trained with (no ``--lora-rank``, another rank, fewer
  targets) is refused before it starts (``check_adapters_kept``).
"""

from __future__ import annotations

import functools
import os

from examples.multimodal_dev.console import say

from .adapters_only import ADAPTERS_ONLY, FULL, HF_CONFIG_RECORDED, base_fingerprint, base_to_read
from .files import TRACKER, checkpoint_directory, is_fsdp_dtensor, stored_args, stored_keys
from .hf_safetensors import read_config

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def is_adapter_key(key: str) -> bool:
    return key.endswith(ADAPTER_SUFFIXES)


def is_mtp_key(key: str) -> bool:
    return ".mtp." in f".{key}"


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
    """Set ``args.lora_base`` for a LoRA run (see the module's docstring), its fingerprint and the run's
    HF config (``adapters_only.py``), and name it in one line."""
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
        if trained and getattr(stored, ADAPTERS_ONLY, False):  # its weights are read from the base again
            args.lora_base = base_to_read(stored, getattr(args, "lora_base_path", None), directory)
    # a base that is a checkpoint is read again at every load: the saves hold the adapters alone
    setattr(args, ADAPTERS_ONLY, args.lora_base is not None)
    args.lora_base_fingerprint = base_fingerprint(args.lora_base) if args.lora_base else None
    if args.lora_base and not args.lora_base_fingerprint.startswith(FULL):
        say(
            f"the LoRA base {args.lora_base} has no checksum record (saved by another program): its fingerprint "
            "covers its tensors' names and shapes and two of them, not every byte"
        )
    # the config the model was built from, kept with the adapters: an import's hf_config.json moves with it
    config = getattr(args, "hf_config_path", None)
    setattr(args, HF_CONFIG_RECORDED, read_config(config) if args.lora_base and config else None)
    named = args.lora_base or ("a base its checkpoint does not record" if loaded else "the random initialisation")
    saves = "; its checkpoints hold the adapters, not the base" if args.lora_base else ""
    say(f"LoRA adapters adapt {named}{saves}")


def _not_held(sharded: dict, held: frozenset[str], wanted) -> dict:
    """The model's requested tensors ``wanted`` (by key) that the checkpoint does not hold, taken out
    of the request: {(part, key): sharded tensor}."""
    out = {
        (part, key): value
        for part, state in sharded.items()
        if part.startswith("model") and isinstance(state, dict)
        for key, value in state.items()
        if wanted(key) and getattr(value, "key", None) is not None and value.key not in held
    }
    for part, key in out:
        del sharded[part][key]
    return out


def _taken_out(sharded: dict, wanted) -> dict:
    """Every entry of the model's request whose key ``wanted`` takes (tensors, their factories and the
    modules' extra-state objects, lists of them included), taken out: {(part, key): entry}."""
    out = {
        (part, key): value
        for part, state in sharded.items()
        if part.startswith("model") and isinstance(state, dict)
        for key, value in state.items()
        if wanted(key)
    }
    for part, key in out:
        del sharded[part][key]
    return out


def _own(entry):
    """The model's own value of a request entry (its data), through lists and dicts of entries."""
    if isinstance(entry, dict):
        return {k: _own(v) for k, v in entry.items()}
    if isinstance(entry, (list, tuple)):
        return type(entry)(_own(v) for v in entry)
    return entry.data


def _from_base(base_part: dict, base: str) -> dict:
    """The base's tensors of an adapters-only checkpoint, read from the base at this run's layout."""
    from megatron.core import dist_checkpointing

    request: dict = {}
    for (part, key), value in base_part.items():
        request.setdefault(part, {})[key] = value
    say(f"reading the {len(base_part)} base tensors the checkpoint does not hold from {base}")
    loaded = dist_checkpointing.load(request, base)
    return {(part, key): loaded[part][key] for part, key in base_part}


def _holds_torch_dist(load_dir) -> bool:
    """A checkpoint to read keys from: not a fresh run's empty directory, nor Megatron-FSDP's
    fsdp_dtensor (no LoRA run: FSDP with LoRA is refused before launch)."""
    if not load_dir or not os.path.isfile(os.path.join(load_dir, TRACKER)):
        return False
    directory = checkpoint_directory(load_dir)
    return os.path.isdir(directory) and not is_fsdp_dtensor(directory)


def base_without_adapters(load_base, run=None):
    """``_load_base_checkpoint`` that loads a base checkpoint into a model with adapters, and the
    base of a checkpoint holding the adapters alone (``adapters_only.py``) from where it lives."""

    @functools.wraps(load_base)
    def load(load_dir, args, *rest, **kwargs):
        sharded = kwargs.get("sharded_state_dict")
        own, base_part, head = {}, {}, {}
        if _holds_torch_dist(load_dir) and sharded:
            directory = checkpoint_directory(load_dir)
            held = stored_keys(directory)
            own = _not_held(sharded, held, is_adapter_key)
            adapters_only = getattr(stored_args(directory), ADAPTERS_ONLY, False)  # its base holds the rest
            if getattr(args, "finetune", False) and not adapters_only and not any(map(is_mtp_key, held)):
                head = _taken_out(sharded, is_mtp_key)
            if getattr(args, "lora_rank", 0) and adapters_only:
                base_part = _not_held(sharded, held, lambda key: not is_adapter_key(key))
        loaded = load_base(load_dir, args, *rest, **kwargs)
        if base_part and loaded[0] is not None:
            for (part, key), value in _from_base(base_part, args.lora_base).items():
                loaded[0].setdefault(part, {})[key] = value  # a part the checkpoint held nothing of
        if own and loaded[0] is not None:
            for (part, key), value in own.items():
                loaded[0].setdefault(part, {})[key] = value.data  # the model's own adapter: its start stays
            adapters = any(map(is_adapter_key, held))
            fresh = f"{len(own)} adapter tensors fewer" if adapters else "no LoRA adapters: its weights are the base"
            say(f"{load_dir} holds {fresh}; the adapters it lacks start at B = 0")
        if head and loaded[0] is not None:
            for (part, key), value in head.items():
                loaded[0].setdefault(part, {})[key] = _own(value)  # the model's own initialisation
            say(f"{load_dir} holds no MTP head: the model's head ({len(head)} entries) starts from its initialisation")
        return loaded

    return load
