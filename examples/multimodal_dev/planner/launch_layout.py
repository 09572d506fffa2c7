"""One launch layout (TP, PP, VP, CP, EP, ETP, uneven first / last stage, GPUs, Megatron-FSDP): what
the planner chooses, ``tools/plan_layout.py`` prints and ``meta_builds.py`` builds. Free of torch, so
that the run script's DRY_RUN and the planner's refusals start in a tenth of a second."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..models import model_of
from ..models.qwen35_vl.configuration import Qwen35VLShape
from ..models.setting_names import FSDP_REFUSALS
from .pipeline_layout import LAYOUTS, stage_layers

# The planner tries layouts over the divisors of the GPU count: past about 2^20 GPUs (ten times the
# largest clusters trained on) the search no longer ends in seconds; such a count is refused.
MAX_GPUS = 1 << 20

LAYOUT_KEYS = {
    "TP": "tp",
    "PP": "pp",
    "VP": "vp",
    "CP": "cp",
    "EP": "ep",
    "ETP": "etp",
    "FIRST": "first",
    "LAST": "last",
    "GPUS": "gpus",
    "FSDP": "fsdp",
}
# fields whose 0 means unset (off) rather than a size
OPTIONAL_KEYS = ("vp", "first", "last", "fsdp")
SWITCH_KEYS = ("fsdp",)  # 0 or 1


@dataclass(frozen=True)
class Layout:
    """One launch layout (a row of ``pipeline_layout.LAYOUTS`` or any other); None = unset."""

    tp: int = 1
    pp: int = 1
    vp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int = 1
    first: int | None = None
    last: int | None = None
    gpus: int = 1
    fsdp: bool = False  # Megatron-FSDP (the run script's FSDP=1): weights and gradients sharded too

    @classmethod
    def recommended(cls, variant: str) -> Layout:
        if variant not in LAYOUTS:
            raise KeyError(f"no recommended layout for {variant!r}; have {', '.join(LAYOUTS)}")
        return cls(*LAYOUTS[variant])

    @classmethod
    def parse(cls, text: str) -> Layout:
        """From "TP=2 PP=8 VP=2 ..." (keys of ``LAYOUT_KEYS``; unset ones 1, VP / FIRST / LAST
        none; 0 unsets those three as the run script's PP_FIRST=0 does; FSDP=1 / FSDP=0 switches
        Megatron-FSDP on / off; a key given twice is refused)."""
        fields: dict[str, Any] = {}  # each checked against its key above
        for item in text.replace(",", " ").split():
            key, _, value = item.partition("=")
            field = LAYOUT_KEYS.get(key.upper())
            low, high = (0 if field in OPTIONAL_KEYS else 1), (1 if field in SWITCH_KEYS else float("inf"))
            if field is None or not value.isdigit() or not low <= int(value) <= high:
                raise ValueError(
                    f"item {item!r}: expected KEY=N (N >= 1; 0 unsets VP, FIRST, LAST; FSDP 0 or 1) with KEY one "
                    f"of {', '.join(LAYOUT_KEYS)}"
                )
            if field in fields:
                raise ValueError(f"item {item!r}: {key.upper()} is given twice")
            fields[field] = bool(int(value)) if field in SWITCH_KEYS else int(value) or None
        return cls(**fields)

    @property
    def stage_gpus(self) -> int:
        return self.gpus // self.pp

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def dense_shards(self) -> int:
        """The distributed optimizer's group of a dense parameter: DP x CP."""
        return self.gpus // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.gpus // (self.ep * self.etp * self.pp)

    def describe(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}"] + [
            f"{k}={v}"
            for k, v in (
                ("VP", self.vp),
                ("CP", self.cp if self.cp > 1 else None),
                ("EP", self.ep if self.ep > 1 else None),
                ("ETP", self.etp if self.ep > 1 else None),
                ("FIRST", self.first),
                ("LAST", self.last),
            )
            if v
        ]
        parts += ["FSDP"] if self.fsdp else []
        return " ".join(parts) + f", DP={self.dp}, {self.gpus} GPUs"

    def check(self, shape: Qwen35VLShape) -> None:
        """ValueError naming the setting this shape or world size cannot be split by."""
        stage_layers(shape.text.num_layers, self.pp, self.vp, self.first, self.last)
        model_of(shape).validate_parallel(shape, self.tp, self.cp, self.ep)
        if self.gpus % (self.tp * self.pp * self.cp) or self.gpus % (self.ep * self.etp * self.pp):
            raise ValueError(
                f"{self.gpus} GPUs: not a multiple of TP x PP x CP = {self.tp * self.pp * self.cp} "
                f"and of EP x ETP x PP = {self.ep * self.etp * self.pp}"
            )
        if self.fsdp and self.pp > 1:
            raise ValueError(f"FSDP=1 with PP={self.pp}: {FSDP_REFUSALS['pp']}")

    def settings(self) -> dict:
        """The TransformerConfig fields of this layout."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            num_layers_in_first_pipeline_stage=self.first,
            num_layers_in_last_pipeline_stage=self.last,
            sequence_parallel=self.tp > 1,
        )  # megatron requires SP for MoE with TP; same tensors
