"""MODEL_REGISTRY: model architecture name -> its ``ModelEntry`` (``entry.py``), the seams the other
layers reach a model through.

The data path, checkpoints, generation, the training glue and the commands never import a model's
package: they ask its entry (``model_of(shape)``, or ``get_model_entry(args.model_arch)``) for
the seam they need, and ``tests/unit/test_layout.py`` holds them to it. A new model is an entry
here plus its folder, its ``entry.py`` filling every field of ``ModelEntry``.

The seams are the model's own functions; those whose modules import torch or megatron-core are
imported on first call, so listing or validating names (the launcher, the planner's tables) does not
import megatron-core or the model code.
"""

from __future__ import annotations

from typing import Any

from .entry import ModelEntry, ModelShape
from .qwen35_vl.entry import ENTRY as QWEN35_VL

DEFAULT_ARCH = "qwen35_vl"  # --model-arch's default

# Each entry is checked against the contract at its own shape and FLOPs types (``qwen35_vl/entry.py``);
# a layer reaching a model by name serves any of them.
MODEL_REGISTRY: dict[str, ModelEntry[Any, Any, Any]] = {entry.arch: entry for entry in (QWEN35_VL,)}


def get_model_entry(name: str) -> ModelEntry[Any, Any, Any]:
    if name not in MODEL_REGISTRY:
        raise KeyError(f"unknown --model-arch {name!r}; valid: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[name]


def default_model() -> ModelEntry[Any, Any, Any]:
    """The entry of ``DEFAULT_ARCH``: the model of the run script and of the commands that take a
    variant name (``--model-variant``, ``MODEL_VARIANT``)."""
    return get_model_entry(DEFAULT_ARCH)


def model_of(shape: ModelShape) -> ModelEntry[Any, Any, Any]:
    """The entry of the architecture ``shape`` describes (each shape type names its ``arch``)."""
    return get_model_entry(type(shape).arch)
