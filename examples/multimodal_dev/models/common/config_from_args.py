"""megatron's parsed args -> the TransformerConfigs a model shape is built from.

The decoder's config starts from megatron.training's ``core_transformer_config_from_args`` so
every training flag (recompute, precision, fusions, dispatcher, parallel sizes, ...) takes
effect; the shape's architecture is laid over it. Three kinds of field:

    architecture   fixed by the shape (layers, widths, norms, Gated DeltaNet pattern, experts):
                   a flag given on the command line that contradicts it is refused by name
    recipe         the released models' training settings (dropout 0, router aux-loss coefficient):
                   used unless the flag is given
    backend        fused kernels that exist only with Transformer Engine / Apex: off on the local
                   backend
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

# TransformerConfig field -> megatron flag dest, where they are not the same name
_FLAG_OF_FIELD = {"num_moe_experts": "num_experts", "gated_linear_unit": "swiglu", "activation_func": "swiglu"}

# Fused kernels megatron turns on by default (``--no-...`` flags turn them off) that need
# Transformer Engine or Apex: the weight-gradient accumulation GEMM and the rotary kernel. The
# local backend runs without them.
_BACKEND_FUSIONS = ("gradient_accumulation_fusion", "apply_rope_fusion")


def megatron_parser(extra_args_provider=None) -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    return extra_args_provider(parser) if extra_args_provider else parser


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> dict[str, str]:
    """dest -> the option string the user typed, for every option on the command line."""
    by_option = {opt: action.dest for action in parser._actions for opt in action.option_strings}
    given = {}
    for token in sys.argv[1:] if argv is None else argv:
        option = token.split("=", 1)[0]
        if option in by_option:
            given[by_option[option]] = option
    return given


def _describe(value) -> str:
    return getattr(value, "__name__", None) or repr(value)


def _refuse_contradictions(base, architecture: dict, given: dict[str, str], source: str) -> None:
    wrong = []
    for field, value in architecture.items():
        dest = _FLAG_OF_FIELD.get(field, field)
        if dest in given and getattr(base, field) != value:
            wrong.append(
                f"{given[dest]} gives {field}={_describe(getattr(base, field))} (the {source} has {_describe(value)})"
            )
    if wrong:
        raise ValueError("flags contradict the model shape: " + "; ".join(wrong))


def _settled_args(args, architecture: dict, given: dict[str, str], fused_kernels_ok: bool):
    """A copy of ``args`` whose unset architecture flags carry the shape's values and whose unset
    fusion flags suit the backend, so that megatron's own config (and its validation of e.g.
    fused SwiGLU or rotary fusion) sees the model that will be built."""
    settled = argparse.Namespace(**vars(args))
    for field, value in architecture.items():
        dest = _FLAG_OF_FIELD.get(field, field)
        if field != "activation_func" and dest not in given and hasattr(settled, dest):
            setattr(settled, dest, value)
    if not fused_kernels_ok:
        for field in _BACKEND_FUSIONS:
            setattr(settled, field, False)
    return settled


def transformer_configs(
    args, architecture: dict, recipe: dict, vision_architecture: dict, source: str, backend: str, given: dict[str, str]
):
    """(decoder config, vision config) for these args."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    base = core_transformer_config_from_args(_settled_args(args, architecture, given, backend == "te"))
    _refuse_contradictions(base, architecture, given, source)
    # megatron synchronizes the device after every batched pipeline send / receive, for a race in
    # torch's batch_isend_irecv that torch 1.13 fixed (pytorch#82450: the work objects now wait on the
    # NCCL streams); the torch this project pins has the fix, so the sync only drains the GPU's queue
    base.batch_p2p_sync = False
    recipe = {k: v for k, v in recipe.items() if _FLAG_OF_FIELD.get(k, k) not in given}
    language = dataclasses.replace(base, **recipe, **architecture)
    # Packed (and padded-to-longest) rows change length from one micro-batch to the next, so
    # pipeline stages exchange each activation's shape before it (one 3-integer message). Set
    # after validation: megatron-core refuses it with the allgather MoE dispatcher (and even for
    # dense models, whose dispatcher setting is unused) because that dispatcher gathers
    # equal-sized buffers; forward_step pads the rows of a TP x EP group to one length first.
    language.variable_seq_lengths = base.pipeline_model_parallel_size > 1
    # The vision tower shares precision, TP and recompute settings; its own shape replaces the rest.
    vision = dataclasses.replace(base, **_vision_neutral(base), **vision_architecture)
    return language, vision


# Decoder-only settings that would not validate for the vision tower's shape, and their values for
# it: the tower is whole on the first pipeline stage (no pipeline split of its own layers). It
# shares every other setting (precision, TP, recompute, ...).
VISION_PIPELINE = {
    "pipeline_model_parallel_size": 1,
    "virtual_pipeline_model_parallel_size": None,
    "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None,
    "pipeline_model_parallel_layout": None,
}


def _vision_neutral(base) -> dict:
    return {k: v for k, v in VISION_PIPELINE.items() if getattr(base, k, None) not in (None, v)}


def vision_settings(settings: dict) -> dict:
    """The decoder's ``settings`` (TransformerConfig fields) as the vision tower takes them."""
    return {**settings, **{k: v for k, v in VISION_PIPELINE.items() if k in settings}}
