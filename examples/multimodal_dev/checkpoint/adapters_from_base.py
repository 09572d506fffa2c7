"""LoRA from base weights: a run with adapters (``--lora-rank``) loads a checkpoint that has none.

A checkpoint of the base model (an import from Hugging Face, a full training run) holds no
``lora_A`` / ``lora_B``. megatron would ask it for them and stop on the missing keys, so the load
(``_load_base_checkpoint``, a megatron_changes row) leaves the adapters out of what it asks for
when the checkpoint has none at all, and hands back the model's own adapters: they keep their
start (``B = 0``), the base weights are the checkpoint's. A checkpoint with adapters (a LoRA run's,
resumed or moved to another layout) loads them as it loads everything else.
"""

from __future__ import annotations

import functools
import os

from examples.multimodal_dev.console import say

from .files import checkpoint_directory

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


def is_adapter_key(key: str) -> bool:
    return key.endswith(ADAPTER_SUFFIXES)


@functools.lru_cache(maxsize=None)
def holds_adapters(directory: str) -> bool:
    """Whether the checkpoint iteration at ``directory`` stores any adapter tensor (sections included:
    a split ``B`` is stored as ``...lora_B.query`` and so on)."""
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(directory).keys()
    return any(f"{suffix}." in f"{key}." for key in keys for suffix in ADAPTER_SUFFIXES)


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
            if own and holds_adapters(checkpoint_directory(load_dir)):
                own = {}
            for part, key in own:
                del sharded[part][key]
        loaded = load_base(load_dir, args, *rest, **kwargs)
        if own and loaded[0] is not None:
            for (part, key), value in own.items():
                loaded[0][part][key] = value.data  # the model's own adapter: its start stays
            say(f"{load_dir} holds no LoRA adapters: its weights are the base, the adapters start at B = 0")
        return loaded

    return load
