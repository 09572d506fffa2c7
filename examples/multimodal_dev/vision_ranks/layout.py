"""The vision tower's own parallel layout: which ranks run it, with which tensor- and data-parallel
sizes, and the settings megatron-core cannot run, refused by name before any rank starts.

Two layouts:

* colocated (``--vision-nproc 0``, the default): the vision tower runs on the ranks of the language
  model's first pipeline stage, the stage that takes its embeddings. megatron orders ranks tp
  fastest, then cp, (ep,) dp, pp slowest, so these are ranks ``[0, TP*CP*DP)``. The vision tower
  lays its own grid over them, [VISION_TP, VISION_DP] with tp fastest and
  ``VISION_DP = TP*CP*DP / VISION_TP``. VISION_TP must divide TP: every vision TP group then sits
  inside one language TP group, whose ranks all need the same image embeddings; the TP/VISION_TP
  vision replicas inside it encode a share of its images each and gather them there.
* separate ranks (``--vision-nproc k``): ranks ``0..k-1`` run only the vision tower (TP=VISION_TP,
  DP=k/VISION_TP), ranks ``k..NPROC-1`` only the language model (TP, CP, PP in megatron's order,
  offset by k). The embeddings cross between the two through megatron-core's bridge communicator,
  which splits or gathers the batch between the two data-parallel sizes (so one divides the other)
  and in megatron-core 0.19.2 asserts context parallel size 1; only the non-interleaved pipeline
  schedule takes the multi-module communicator, so VP=1. Unset, VISION_TP is k / the language DP
  there (``default_vision_tp``).

Either way VISION_TP divides the vision attention heads (its MLP and merger widths are multiples of
them). ``plan`` checks all of this and names the setting; ``VisionLayout.groups`` enumerates the
process groups so a run's own can be compared with them; ``env_table`` is the run script's check
(``launcher/checks.py``), in the variables' names.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from ..models.setting_names import FLAGS, VARIABLES, named

# How a message names each setting: FLAG_NAMES (the training script) or ENV_NAMES (the run script)
FLAG_NAMES, ENV_NAMES = FLAGS, VARIABLES


def _span(ranks: range) -> str:
    """``0``, ``0-1``, ``2-5``."""
    return str(ranks.start) if len(ranks) == 1 else f"{ranks.start}-{ranks.stop - 1}"


@dataclass(frozen=True)
class VisionGroups:
    """Explicit rank lists, tp fastest."""

    vision_tp: list[list[int]]
    vision_dp: list[list[int]]
    language_tp: list[list[int]]  # of the language model's first pipeline stage


@dataclass(frozen=True)
class VisionLayout:
    world: int
    tp: int
    cp: int
    pp: int
    dp: int  # the language model's
    vtp: int
    vdp: int
    vnproc: int

    @property
    def colocated(self) -> bool:
        return self.vnproc == 0

    @property
    def language_ranks(self) -> range:
        return range(self.vnproc, self.world)

    @property
    def language_first_stage_ranks(self) -> range:
        return range(self.vnproc, self.vnproc + self.tp * self.cp * self.dp)

    @property
    def vision_ranks(self) -> range:
        return self.language_first_stage_ranks if self.colocated else range(self.vnproc)

    def groups(self) -> VisionGroups:
        span, first = self.vision_ranks, self.language_first_stage_ranks
        return VisionGroups(
            vision_tp=[list(range(start, start + self.vtp)) for start in range(span.start, span.stop, self.vtp)],
            vision_dp=[list(range(span.start + t, span.stop, self.vtp)) for t in range(self.vtp)],
            language_tp=[list(range(start, start + self.tp)) for start in range(first.start, first.stop, self.tp)],
        )

    def table(self) -> list[str]:
        vision = f"TP={self.vtp} DP={self.vdp}"
        if self.colocated:
            vision += " (on the language model's " + ("first-stage ranks)" if self.pp > 1 else "ranks)")
        rows = [
            (self.vision_ranks, "vision tower", vision),
            (self.language_ranks, "language model", f"TP={self.tp} CP={self.cp} DP={self.dp} PP={self.pp}"),
        ]
        width = max(len(_span(ranks)) for ranks, _, _ in rows)
        return [f"ranks {_span(ranks):<{width}}  {module:<14}  {sizes}" for ranks, module, sizes in rows]


def default_vision_tp(world: int, tp: int, cp: int, pp: int, vnproc: int) -> int:
    """VISION_TP when it is not set: TP on the language model's ranks. On ranks of its own, the size
    that gives the tower one replica for each of the language model's, VISION_NPROC / the language
    DP, where that divides (VISION_TP=1 with more vision ranks asks for fan-in); else 1 where the
    language DP is a multiple of VISION_NPROC (fan-out, a whole tower on each vision rank); else TP,
    and ``plan`` names what does not fit."""
    language, replica = world - vnproc, tp * cp * pp
    if vnproc and language > 0 and language % replica == 0:
        dp = language // replica
        if vnproc % dp == 0:
            return vnproc // dp
        if dp % vnproc == 0:
            return 1
    return tp


def plan(
    world: int,
    tp: int,
    cp: int,
    pp: int,
    vtp: int,
    vnproc: int,
    vision_heads: int,
    vp: int = 1,
    names: dict = FLAG_NAMES,
) -> VisionLayout:
    """The layout of these settings, or ValueError naming the one that cannot run."""
    name = partial(named, names)
    for key, value in (("world", world), ("tp", tp), ("cp", cp), ("pp", pp), ("vp", vp), ("vtp", vtp)):
        if value < 1:
            raise ValueError(f"{name(key, value)}: must be a positive integer")
    if vnproc < 0:
        raise ValueError(f"{name('vnproc', vnproc)}: must not be negative")
    if vision_heads % vtp:
        raise ValueError(f"{name('vtp', vtp)} does not divide the {vision_heads} vision attention heads")
    if vnproc == 0:
        return _colocated(world, tp, cp, pp, vtp, names)
    return _on_own_ranks(world, tp, cp, pp, vp, vtp, vnproc, names)


def _replica(tp: int, cp: int, pp: int, names: dict) -> str:
    """The ranks of one language model replica, by the settings that make it."""
    name = partial(named, names)
    return f"{name('tp', tp)} * {name('cp', cp)} * {name('pp', pp)} = {tp * cp * pp}"


def _colocated(world: int, tp: int, cp: int, pp: int, vtp: int, names: dict) -> VisionLayout:
    """The tower on the language model's first-stage ranks, each vision TP group inside a language one."""
    name = partial(named, names)
    if world % (tp * cp * pp):
        raise ValueError(f"{name('world', world)} is not divisible by {_replica(tp, cp, pp, names)}")
    if tp % vtp:
        raise ValueError(
            f"{name('vtp', vtp)} does not divide {name('tp', tp)}: on the language model's ranks "
            f"each vision tensor-parallel group sits inside one of its tensor-parallel groups"
        )
    dp = world // (tp * cp * pp)
    return VisionLayout(world, tp, cp, pp, dp, vtp, tp * cp * dp // vtp, 0)


def _on_own_ranks(world: int, tp: int, cp: int, pp: int, vp: int, vtp: int, vnproc: int, names: dict) -> VisionLayout:
    """The tower on ranks ``0..vnproc-1``, the language model on the rest, the bridge between them."""
    name = partial(named, names)
    if vnproc >= world:
        raise ValueError(f"{name('vnproc', vnproc)} leaves no ranks for the language model ({name('world', world)})")
    if vnproc % vtp:
        raise ValueError(
            f"{name('vnproc', vnproc)} is not divisible by {name('vtp', vtp)}: the vision ranks are "
            f"whole tensor-parallel groups"
        )
    if (world - vnproc) % (tp * cp * pp):
        raise ValueError(
            f"{name('world', world)} with {name('vnproc', vnproc)} leaves {world - vnproc} ranks to "
            f"the language model, not divisible by {_replica(tp, cp, pp, names)}"
        )
    _check_bridge_parallelism(cp, vp, vnproc, names)
    dp, vdp = (world - vnproc) // (tp * pp), vnproc // vtp
    if vdp % dp and dp % vdp:
        raise ValueError(
            f"{name('vnproc', vnproc)} / {name('vtp', vtp)} = {vdp} vision data-parallel ranks and "
            f"{dp} language data-parallel ranks: one must divide the other (the bridge splits or "
            f"gathers the batch between them)"
        )
    return VisionLayout(world, tp, cp, pp, dp, vtp, vdp, vnproc)


def _check_bridge_parallelism(cp: int, vp: int, vnproc: int, names: dict) -> None:
    """What megatron-core 0.19.2's bridge communicator runs with: context parallel size 1 and the
    non-interleaved pipeline schedule."""
    name = partial(named, names)
    if cp > 1:
        raise ValueError(
            f"{name('cp', cp)} with {name('vnproc', vnproc)}: megatron-core 0.19.2's bridge between "
            f"the vision and language ranks needs context parallel size 1"
        )
    if vp > 1:
        raise ValueError(
            f"{name('vp', vp)} with {name('vnproc', vnproc)}: only the non-interleaved pipeline "
            f"schedule takes the vision/language communicator"
        )


def env_table(world: int, tp: int, cp: int, pp: int, vp: int, vtp: int | None, vnproc: int, heads: int) -> list[str]:
    """The rank table of the run script's settings (``vtp`` None: VISION_TP unset), or ValueError
    naming the variables."""
    given = bool(vtp)
    vtp = vtp if given else default_vision_tp(world, tp, cp, pp, vnproc)
    try:
        layout = plan(world, tp, cp, pp, vtp, vnproc, heads, vp=vp, names=ENV_NAMES)
    except ValueError as err:
        if given or "VISION_TP=" not in err.args[0]:
            raise
        hint = (
            "VISION_TP unset: VISION_NPROC / the language model's DP where that divides, else 1 where "
            "VISION_NPROC divides that DP, else TP"
            if vnproc
            else "VISION_TP is TP unless set"
        )
        raise ValueError(f"{err.args[0]} ({hint})") from None
    return layout.table()
