"""The contract every model architecture fills: ``ModelEntry``, a frozen dataclass of the seams the
other layers reach a model through. Each seam is the function (or table) itself, so a reader's
go-to-definition lands on it and a type checker sees its signature.

A seam whose module imports torch or megatron-core is wrapped by ``on_first_call``: its module is
imported when the seam is first called, so reading the light seams (the variants, a shape, the
layouts a shape refuses) costs the launcher and the planner nothing of the engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])


def on_first_call(load: Callable[[], F]) -> F:
    """The function ``load`` returns, imported at its first call (``load`` is a lambda naming it)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return load()(*args, **kwargs)

    return cast(F, call)


class ModelShape(Protocol):
    """What the layers outside a model read of its shape: the architecture (its registry key) and the
    language model's and vision tower's numbers (each architecture's own types)."""

    arch: ClassVar[str]

    @property
    def text(self) -> Any: ...

    @property
    def vision(self) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class ModelEntry:
    arch: str  # --model-arch's name for it
    # shapes
    variants: Mapping[str, Any]  # {variant name: shape} of the released sizes
    shape_fn: Callable[..., Any]  # (variant name, moe=None, mtp=None) -> shape; unknown: KeyError listing valid
    shape_from_hf: Callable[[Any], Any]  # Hugging Face config (dict, object or config.json path) -> shape
    shape_to_hf: Callable[[Any], dict]  # shape -> Hugging Face config dict
    # building
    configs_fn: Callable[..., tuple[Any, Any]]  # (megatron args, shape, backend, flags given) -> configs
    build_fn: Callable[..., Any]  # (shape, backend=..., configs=..., pre_process=..., ...) -> one stage's model
    parallel_problems: Callable[..., list[str]]  # (shape, tp, cp, ep, ...) -> the splits it cannot take
    validate_parallel: Callable[..., None]  # (shape, tp, cp, ep, ...) -> ValueError naming the first problem
    # the data path
    packed_position_ids: Callable[..., Any]  # a packed (THD) row's MRoPE position ids
    padded_position_ids: Callable[..., Any]  # a left/right padded batch's MRoPE position ids
    run_grids: Callable[..., Any]  # the vision grids of each run of vision tokens, in token order
    split_video_frames: Callable[[Any], Any]  # video grids [N, 3] -> one grid a frame
    micro_batch_flops: Callable[..., Any]  # (shape, sample lengths, grids) -> flops_breakdown
    vision_flops: Callable[..., float]  # (vision shape, out hidden, grids) -> the tower's forward FLOPs
    flops_breakdown: type  # what micro_batch_flops returns
    # checkpoints
    # (shape, per_expert=False) -> the rules between Megatron and Hugging Face names
    hf_mapping_rules: Callable[..., list]
    hf_model_state: Callable[[Any], dict]  # model -> its state dict in Megatron names
    hf_fp32_suffixes: tuple[str, ...]  # Hugging Face tensor names kept in fp32 whatever the dtype
    load_hf_state: Callable[..., None]  # (model, Hugging Face state dict, shape) -> the model filled
