"""Pipeline splits: which decoder layers each stage holds, refused by name when impossible, and
the launch layouts recommended for the released variants (the layout planner's choices).

megatron-core's rule (``get_transformer_layer_offset`` / ``get_num_layers_to_build``): with
``--decoder-first/last-pipeline-num-layers`` those stages hold that many layers and the middle
stages share the rest evenly, otherwise all stages share evenly; with virtual stages every
stage's layers are cut into ``vp`` equal chunks, and the model runs round by round: chunk v of
every rank in rank order, then chunk v+1 (so a rank's chunks are not contiguous). megatron asserts
these with a traceback, deep in argument validation or model building; ``stage_layers`` checks them
first and says which setting is wrong (``names=ENV_NAMES``: in the run script's variables,
``launcher/checks.py``).
"""

from __future__ import annotations

from functools import partial

from ..models.setting_names import FLAGS, VARIABLES, named

# How a message names each setting: FLAG_NAMES (the training script) or ENV_NAMES (the run script)
FLAG_NAMES, ENV_NAMES = FLAGS, VARIABLES


def stage_layers(
    num_layers: int,
    pp: int,
    vp: int | None = None,
    first: int | None = None,
    last: int | None = None,
    names: dict = FLAG_NAMES,
) -> list[list[range]]:
    """Global decoder layer indices of every (pipeline rank, virtual stage), or ValueError naming
    the setting that cannot be split."""
    name = partial(named, names)
    vp = vp or 1
    if pp < 1 or vp < 1:
        raise ValueError(f"{name('pp', pp)} {name('vp', vp)}: sizes must be positive")
    if pp == 1 and (vp > 1 or first or last):
        given = [name(k, v) for k, v in (("vp", vp if vp > 1 else None), ("first", first), ("last", last)) if v]
        raise ValueError(f"{', '.join(given)} needs pipeline parallelism ({name('pp', pp)})")
    counts = _stage_counts(num_layers, pp, vp, first, last, names)
    bad = [(p, c) for p, c in enumerate(counts) if c % vp]
    if bad:
        p, c = bad[0]
        raise ValueError(
            f"{name('vp', vp)}: pipeline stage {p} holds {c} layers, not a multiple of {vp} "
            f"(every virtual stage needs the same number of layers, at least one)"
        )
    return _virtual_stage_ranges(num_layers, vp, counts)


def _stage_counts(num_layers: int, pp: int, vp: int, first: int | None, last: int | None, names: dict) -> list[int]:
    """Decoder layers of every pipeline stage: FIRST's and LAST's, the rest shared evenly by the
    stages they leave open."""
    name = partial(named, names)
    counts: list[int | None] = [None] * pp
    for key, value, index in (("first", first, 0), ("last", last, pp - 1)):
        if value is not None:
            if not 1 <= value < num_layers:
                raise ValueError(
                    f"{name(key, value)}: must be between 1 and {num_layers - 1} (the model has "
                    f"{num_layers} decoder layers)"
                )
            counts[index] = value
    rest, open_stages = num_layers - sum(c for c in counts if c), counts.count(None)
    if open_stages == 0 and rest != 0:
        raise ValueError(
            f"{name('first', first)} + {name('last', last)} = {num_layers - rest} layers with "
            f"{name('pp', pp)}, but the model has {num_layers}"
        )
    if open_stages and (rest < open_stages or rest % open_stages):
        raise _uneven_split(pp, first, last, rest, open_stages, names)
    if vp > 1 and open_stages == 0:  # its layer offset divides by the number of middle stages
        raise ValueError(
            f"{name('vp', vp)} with both {name('first', first)} and {name('last', last)} at "
            f"{name('pp', pp)}: megatron-core places uneven virtual stages only when some stage "
            f"takes the even share; give one of the two"
        )
    return [c if c is not None else rest // open_stages for c in counts]


def _uneven_split(pp: int, first: int | None, last: int | None, rest: int, open_stages: int, names: dict) -> ValueError:
    """The refusal for layers that do not share evenly over the open stages; with neither FIRST nor
    LAST set it names them, the way to an uneven split."""
    what = "the remaining" if first or last else "the"
    return ValueError(
        f"{named(names, 'pp', pp)}: {what} {rest} decoder layers do not split evenly over {open_stages} "
        f"stages"
        + (f" (set {names['first'].rstrip('=')} / {names['last'].rstrip('=')})" if not (first or last) else "")
    )


def _virtual_stage_ranges(num_layers: int, vp: int, counts: list[int]) -> list[list[range]]:
    """Each rank's layers cut into ``vp`` equal chunks; virtual round v runs chunk v of every rank in
    rank order, L/vp layers a round."""
    chunk = [c // vp for c in counts]  # layers per virtual stage of each rank
    return [
        [
            range(v * num_layers // vp + sum(chunk[:p]), v * num_layers // vp + sum(chunk[:p]) + chunk[p])
            for v in range(vp)
        ]
        for p in range(len(counts))
    ]


# Recommended launch layouts: the layout planner's choice (``tools/plan_layout.py``,
# ``planner/layout_plan.py``) for each variant at this GPU count on 8-GPU H100 (80 GB) nodes,
# 4096-token rows of ``mock_mix``'s conversations, GBS 512 rows, MBS 1; docs/planner.md
# shows why. ``test_layout_plan`` holds each row equal to the planner's current
# choice, so a change to the cost model that moves one shows up there. ETP: expert tensor
# parallelism (for a dense variant it is TP, as the run script sets it).
LAYOUTS = {
    #             TP PP VP    CP EP  ETP FIRST LAST  GPUs
    "9b": (1, 2, None, 2, 1, 1, 18, 14, 8),
    "27b": (2, 4, None, 2, 1, 2, 15, 11, 16),
    "35b_a3b": (2, 2, None, 1, 4, 2, 16, 24, 16),
    "122b_a10b": (2, 4, None, 2, 4, 2, 7, 7, 128),
    "397b_a17b": (1, 8, None, 2, 8, 1, 4, 2, 256),
}
