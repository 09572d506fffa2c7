"""MODEL_REGISTRY: model architecture name -> the entry points the training script needs.

Entries are tables of dotted paths imported on first use, so listing or validating names does
not import megatron-core or the model code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelEntry:
    shape_fn: str  # variant name -> shape
    shape_from_hf: str  # HF config -> shape
    configs_fn: str  # (megatron args, shape, backend, flags given) -> (decoder, vision) configs
    build_fn: str  # shape + configs -> model
    load_hf_state: str  # (model, HF state dict, shape) -> model filled in place

    def load(self, attr: str):
        module_name, _, fn = getattr(self, attr).rpartition(".")
        return getattr(importlib.import_module(module_name, __name__), fn)


MODEL_REGISTRY: dict[str, ModelEntry] = {
    "qwen35_vl": ModelEntry(
        shape_fn=".qwen35_vl.configuration.get_variant",
        shape_from_hf=".qwen35_vl.configuration.from_hf_config",
        configs_fn=".qwen35_vl.configuration.configs_from_args",
        build_fn=".qwen35_vl.factory.build_model",
        load_hf_state=".qwen35_vl.hf_mapping.load_hf_into_model",
    ),
}


def get_model_entry(name: str) -> ModelEntry:
    if name not in MODEL_REGISTRY:
        raise KeyError(f"unknown --model-arch {name!r}; valid: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[name]
