"""The contract every model architecture fills: ``ModelEntry``, a frozen dataclass of the seams the
other layers reach a model through. Each seam is the function (or table) itself, so a reader's
go-to-definition lands on it, and each seam's type below is the signature the other layers call it
by. The type checker holds every registered model's functions to it at the model's own types
(``ModelEntry[Shape, Breakdown, Model]``: its shape, its FLOPs breakdown, the module it builds); the
registry hands the entries out as ``ModelEntry[Any, Any, Any]``, to layers that serve any model.

A seam whose module imports torch or megatron-core is wrapped by ``on_first_call``: its module is
imported when the seam is first called, so reading the light seams (the variants, a shape, the
layouts a shape refuses) costs the launcher and the planner nothing of the engine. torch and
megatron-core appear here in annotations only (never imported when the program runs)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeAlias, TypeVar, cast

if TYPE_CHECKING:
    from argparse import Namespace

    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import PretrainedConfig

F = TypeVar("F", bound=Callable[..., Any])


def on_first_call(load: Callable[[], F]) -> F:
    """The function ``load`` returns, imported at its first call (``load`` is a lambda naming it)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return load()(*args, **kwargs)

    return cast(F, call)


class ModelShape(Protocol):
    """What the layers outside a model read of its shape: the architecture (its registry key), the
    language model's and vision tower's numbers (each architecture's own types) and the token ids
    the data path and the model agree on."""

    arch: ClassVar[str]

    @property
    def text(self) -> Any: ...

    @property
    def vision(self) -> Any: ...

    @property
    def image_token_id(self) -> int: ...

    @property
    def video_token_id(self) -> int: ...

    @property
    def vision_start_token_id(self) -> int: ...

    @property
    def vision_end_token_id(self) -> int: ...


class FlopsBreakdown(Protocol):
    """A micro-batch's forward FLOPs by part (a dataclass of floats, one field a part)."""

    @property
    def forward(self) -> float: ...

    @property
    def training(self) -> float: ...


class MappingRule(Protocol):
    """Megatron tensors <-> Hugging Face tensors: the names on each side, in order, and a transform
    each way (lists of tensors in, lists out). ``moves_only``: the transforms pick, reorder and join
    elements, never compute one, so they may run in the stored dtype."""

    @property
    def megatron(self) -> tuple[str, ...]: ...

    @property
    def hf(self) -> tuple[str, ...]: ...

    @property
    def to_megatron(self) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]: ...

    @property
    def to_hf(self) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]: ...

    @property
    def moves_only(self) -> bool: ...


S = TypeVar("S", bound=ModelShape)  # an architecture's shape type
B = TypeVar("B", bound=FlopsBreakdown)  # an architecture's FLOPs breakdown type
M = TypeVar("M", bound="torch.nn.Module")  # what an architecture's build_fn returns
S_co = TypeVar("S_co", bound=ModelShape, covariant=True)
S_contra = TypeVar("S_contra", bound=ModelShape, contravariant=True)
B_co = TypeVar("B_co", bound=FlopsBreakdown, covariant=True)
M_co = TypeVar("M_co", bound="torch.nn.Module", covariant=True)

# A Hugging Face config: its dict, a transformers config object, or a config.json path (or its folder).
HFConfig: TypeAlias = "dict[str, Any] | PretrainedConfig | str | os.PathLike[str]"
Grids = Iterable[Sequence[int]]  # (t, h, w) patches of each image / video frame, in order


class ShapeOfVariant(Protocol[S_co]):
    """A released size by name (``moe``/``mtp``: its MoE or MTP form); unknown: KeyError listing valid."""

    def __call__(self, name: str, moe: bool | None = None, mtp: bool | None = None) -> S_co: ...


class ConfigsFromArgs(Protocol[S_contra]):
    """(decoder, vision) TransformerConfigs of a megatron.training run: megatron's ``args`` with the
    shape laid over them (``given``: the flags typed on the command line, flag -> its spelling)."""

    def __call__(
        self, args: Namespace, shape: S_contra, backend: str, given: dict[str, str]
    ) -> tuple[TransformerConfig, TransformerConfig]: ...


class BuildModel(Protocol[S_contra, M_co]):
    """One pipeline stage's model (``module``: "vision" or "language", one of the two alone where the
    tower runs on ranks of its own). ``configs``: from ``configs_fn``; without them, standalone
    configs from ``settings`` (TransformerConfig fields)."""

    def __call__(
        self,
        shape: S_contra,
        backend: str = ...,
        params_dtype: torch.dtype = ...,
        max_sequence_length: int = ...,
        configs: tuple[TransformerConfig, TransformerConfig] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        module: str | None = None,
        **settings: Any,
    ) -> M_co: ...


class ParallelProblems(Protocol[S_contra]):
    """The splits ``shape`` cannot take, one line each, in ``names``' spelling of the settings
    (``vision``: False leaves the tower's own layout to its plan)."""

    def __call__(
        self,
        shape: S_contra,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        vtp: int | None = None,
        colocated: bool = True,
        names: dict[str, str] = ...,
        vision: bool = True,
    ) -> list[str]: ...


class ValidateParallel(Protocol[S_contra]):
    """ValueError naming every split ``shape`` cannot take (megatron's flags)."""

    def __call__(
        self, shape: S_contra, tp: int = 1, cp: int = 1, ep: int = 1, vtp: int | None = None, colocated: bool = True
    ) -> None: ...


class PackedPositionIds(Protocol):
    """MRoPE positions [3, T] of a packed (THD) row, restarting at each ``cu_seqlens`` boundary."""

    def __call__(
        self,
        tokens_T: torch.Tensor,
        grids_thw: torch.Tensor,
        vision_ids: Iterable[int],
        spatial_merge: int,
        cu_seqlens: torch.Tensor,
    ) -> torch.Tensor: ...


class PaddedPositionIds(Protocol):
    """MRoPE positions [3, B, S] of a left- or right-padded batch (no mask: every token real)."""

    def __call__(
        self,
        tokens_BS: torch.Tensor,
        attention_mask_BS: torch.Tensor | None,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        image_token_id: int,
        video_token_id: int,
        spatial_merge: int,
    ) -> torch.Tensor: ...


class RunGrids(Protocol):
    """(the grid of each run of vision tokens of ``row`` in token order [N, 3], images used, frames
    used), from ``first_image`` / ``first_frame``; too few grids: ValueError naming ``where``."""

    def __call__(
        self,
        row: torch.Tensor,
        image_grids: torch.Tensor,
        video_frames: torch.Tensor,
        image_token_id: int,
        video_token_id: int,
        first_image: int = 0,
        first_frame: int = 0,
        where: str = ...,
    ) -> tuple[torch.Tensor, int, int]: ...


class MicroBatchFlops(Protocol[S_contra, B_co]):
    """Forward FLOPs of a micro-batch with these real sample ``lengths`` and vision ``grids``."""

    def __call__(self, shape: S_contra, lengths: Iterable[int], grids: Grids = ()) -> B_co: ...


class MappingRules(Protocol[S_contra]):
    """The rules between Megatron and Hugging Face names (``per_expert``: one rule an expert, over the
    hub's per-expert names)."""

    def __call__(self, shape: S_contra, per_expert: bool = False) -> Sequence[MappingRule]: ...


class LoadHFState(Protocol[S_contra]):
    """The model (TP = 1) filled from a Hugging Face state dict; ``strict``: every tensor consumed."""

    def __call__(
        self, model: torch.nn.Module, hf_state: dict[str, torch.Tensor], shape: S_contra, strict: bool = True
    ) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ModelEntry(Generic[S, B, M]):
    arch: str  # --model-arch's name for it
    # shapes
    variants: Mapping[str, S]  # {variant name: shape} of the released sizes
    shape_fn: ShapeOfVariant[S]
    shape_from_hf: Callable[[HFConfig], S]  # a Hugging Face config -> its shape
    shape_to_hf: Callable[[S], dict[str, Any]]  # shape -> Hugging Face config dict
    # building
    configs_fn: ConfigsFromArgs[S]
    build_fn: BuildModel[S, M]
    parallel_problems: ParallelProblems[S]
    validate_parallel: ValidateParallel[S]
    # the data path
    packed_position_ids: PackedPositionIds
    padded_position_ids: PaddedPositionIds
    run_grids: RunGrids
    split_video_frames: Callable[[torch.Tensor], torch.Tensor]  # video grids [N, 3] -> one (1, h, w) grid a frame
    micro_batch_flops: MicroBatchFlops[S, B]
    # (the shape's vision part, the hidden size it projects to, grids) -> the tower's forward FLOPs
    vision_flops: Callable[[Any, int, Grids], float]
    flops_breakdown: type[B]  # what micro_batch_flops returns
    # checkpoints
    hf_mapping_rules: MappingRules[S]
    hf_model_state: Callable[[torch.nn.Module], dict[str, torch.Tensor]]  # model -> its state in Megatron names
    hf_fp32_suffixes: tuple[str, ...]  # Hugging Face tensor names kept in fp32 whatever the dtype
    load_hf_state: LoadHFState[S]
