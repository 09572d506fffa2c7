"""Do the checkpoint shards of a launch layout's ranks cover the converter's mapping, exactly once?

``expected_keys(shape)`` is the converter's side: every ``hf_mapping.mapping_rules`` rule applied
to the variant's Hugging Face tensors (shapes from the ``transformers`` model of
``to_hf_config_dict(shape)`` built on meta; the MTP head, which ``transformers`` does not build,
from its HF names: ``mtp.layers.0`` is a full-attention decoder layer, ``mtp.fc`` is
[H, 2H], its norms [H]), giving each full (TP = 1) Megatron tensor's shape, then laid out as
megatron-core writes checkpoint keys:

    local norms          -> Transformer Engine keys (``specs.FUSED_NORM_KEYS``; MoE layers keep
                            ``pre_mlp_layernorm``)
    GDN in_proj          [q; k; v; z; b; a] rows -> keys ``in_proj.weight.{query,key,value,z,beta,alpha}``
    GDN conv1d           [q; k; v] rows -> keys ``conv1d.weight.{query,key,value}``
    expert e of a layer  -> ``...mlp.experts.experts.<linear>.weight``, e a leading axis of size E
    ViT block i          -> ``vision_model.decoder.layers.<param>``, i a leading axis of size depth
    MTP layer            ``mtp_model_layer`` -> ``transformer_layer``

``coverage_errors(expected, builds, layout)`` checks the other side, the ShardedTensors of
``meta_builds.rank_build`` ranks, and returns every violation (empty: covered):

1. every shard's key is an expected key with the expected global shape, on a regular grid
   (local shape x axis fragmentation = global shape); a stacked key's every slice is a mapping
   tensor (no expert or ViT block missing from the mapping);
2. every expected key has main-replica shards in exactly one (pipeline rank, virtual stage) chunk;
3. tiling: a pipeline stage is *complete* when the builds hold all its main-replica ranks
   (``meta_builds.main_replica_ranks``); per key of a complete stage, the main replicas of all its
   ranks hit each cell of the fragmentation grid exactly once (no gap, no overlap; megatron's own
   rule in ``dist_checkpointing.validation``). A key of an incomplete stage must have the same
   kind (key without its layer index, global shape, local shape, fragmentation) as a key tiled in
   a complete stage, and its shards must not overlap. With every main-replica rank built, every
   stage is complete and the check needs no such argument.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod

import torch

from ..models import model_of
from ..models.qwen35_vl.configuration import FULL, LINEAR, Qwen35VLShape
from ..models.qwen35_vl.hf_mapping import MG_LM, MG_VIS
from ..models.qwen35_vl.specs import FUSED_NORM_KEYS
from .launch_layout import Layout
from .meta_builds import RankBuild, main_replica_ranks

# Qwen3.5 model cards (Qwen/Qwen3.5-*): total and activated parameters, in billions as published
# (whole numbers; a dense card gives one figure).
PUBLISHED = {"9b": (9, 9), "27b": (27, 27), "35b_a3b": (35, 3), "122b_a10b": (122, 10), "397b_a17b": (397, 17)}

_LAYER = re.compile(r"^(language_model\.decoder\.layers\.)(\d+)\.(.*)$")
_MTP = re.compile(r"^(language_model\.mtp\.layers\.\d+\.)mtp_model_layer\.(.*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(.*)$")
_VIT = re.compile(rf"^({re.escape(MG_VIS)}decoder\.layers\.)(\d+)\.(.*)$")


@dataclass
class ExpectedKey:
    global_shape: tuple[int, ...]
    sources: list[str]  # the mapping's Megatron tensors stored under this key
    slices: set[int] = field(default_factory=set)  # stacked keys (experts, ViT blocks): leading indices mapped


def hf_shapes(shape: Qwen35VLShape) -> dict[str, torch.Size]:
    """Every HF tensor of the variant: the ``transformers`` model on meta, plus the MTP head."""
    from ..checkpoint.hf_models import hf_classes

    cfg = model_of(shape).shape_to_hf(shape)
    config_cls, model_cls = hf_classes(cfg.pop("model_type"))
    with torch.device("meta"):
        model = model_cls(config_cls(**cfg))
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    t = shape.text
    if t.mtp_num_layers:
        full = f"model.language_model.layers.{list(t.layer_types).index(FULL)}."
        shapes.update({"mtp." + "layers.0." + n[len(full) :]: s for n, s in shapes.items() if n.startswith(full)})
        hidden = torch.Size([t.hidden_size])
        shapes.update(
            {
                "mtp.fc.weight": torch.Size([t.hidden_size, 2 * t.hidden_size]),
                "mtp.norm.weight": hidden,
                "mtp.pre_fc_norm_embedding.weight": hidden,
                "mtp.pre_fc_norm_hidden.weight": hidden,
            }
        )
    return shapes


def megatron_shapes(shape: Qwen35VLShape, rules=None, hf=None) -> dict[str, tuple[int, ...]]:
    """Full (TP = 1) shape of every Megatron tensor of the mapping: each rule's ``to_megatron``
    run on meta tensors of the HF shapes (a rule naming an HF tensor that does not exist fails)."""
    hf = hf if hf is not None else hf_shapes(shape)
    out = {}
    for rule in rules if rules is not None else model_of(shape).hf_mapping_rules(shape):
        missing = [n for n in rule.hf if n not in hf]
        if missing:
            raise KeyError(f"mapping rule {rule.megatron[:1]} reads HF tensors the config has not: {missing}")
        tensors = rule.to_megatron([torch.empty(hf[n], device="meta") for n in rule.hf])
        out.update({n: tuple(t.shape) for n, t in zip(rule.megatron, tensors)})
    return out


def _gdn_splits(shape: Qwen35VLShape) -> dict[str, list[tuple[str, int]]]:
    """megatron-core's checkpoint split of the fused GDN tensors (rows, TP = 1)."""
    t = shape.text
    qk, v, nv = (
        t.linear_num_key_heads * t.linear_key_head_dim,
        t.linear_num_value_heads * t.linear_value_head_dim,
        t.linear_num_value_heads,
    )
    return {
        "self_attention.in_proj.weight": [
            ("query", qk),
            ("key", qk),
            ("value", v),
            ("z", v),
            ("beta", nv),
            ("alpha", nv),
        ],
        "self_attention.conv1d.weight": [("query", qk), ("key", qk), ("value", v)],
    }


def _rename_norms(rest: str, layer_type: str, moe: bool) -> str:
    for local, fused in FUSED_NORM_KEYS.items():
        if rest.startswith(local):
            if isinstance(fused, dict):
                fused = fused[layer_type]
            elif moe:
                continue  # the MoE router reads the normed input: that norm keeps its own key
            return fused + rest[len(local) :]
    return rest


def expected_keys(shape: Qwen35VLShape, rules=None, hf=None) -> dict[str, ExpectedKey]:
    """The checkpoint keys the mapping's tensors are written under, with their global shapes."""
    t = shape.text
    splits = _gdn_splits(shape)
    out: dict[str, ExpectedKey] = {}

    def add(key, global_shape, source, index=None):
        entry = out.setdefault(key, ExpectedKey(tuple(global_shape), []))
        if entry.global_shape != tuple(global_shape):
            raise ValueError(f"{key}: mapping tensors of shapes {entry.global_shape} and {tuple(global_shape)}")
        entry.sources.append(source)
        if index is not None:
            entry.slices.add(index)

    for name, full in megatron_shapes(shape, rules, hf).items():
        key, lead, index = name, (), None
        if m := _MTP.match(key):
            key = f"{m[1]}transformer_layer.{m[2]}"
            layer_type = FULL
        elif m := _LAYER.match(key):
            layer_type = t.layer_types[int(m[2])]
        else:
            layer_type = None
        if m := _EXPERT.match(key):
            key, lead, index = f"{m[1]}experts.{m[3]}", (t.num_experts,), int(m[2])
        if m := _VIT.match(key):
            key, lead, index = m[1] + _rename_norms(m[3], FULL, moe=False), (shape.vision.depth,), int(m[2])
        elif layer_type is not None:
            head, rest = _split_layer(key)
            rest = _rename_norms(rest, layer_type, t.is_moe)
            if layer_type == LINEAR and rest in splits:
                for part, rows in splits[rest]:
                    add(f"{head}{rest}.{part}", (rows, *full[1:]), name)
                if sum(rows for _, rows in splits[rest]) != full[0]:
                    raise ValueError(
                        f"{name}: {full[0]} rows; megatron's split {splits[rest]} needs "
                        f"{sum(r for _, r in splits[rest])}"
                    )
                continue
            key = head + rest
        add(key, (*lead, *full), name, index)
    return out


def _split_layer(key: str) -> tuple[str, str]:
    """(layer prefix, name within the layer) of a decoder or MTP layer key."""
    m = re.match(r"^(language_model\.(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.)(.*)$", key)
    return m[1], m[2]


def _kind(key: str) -> str:
    return re.sub(r"\.layers\.\d+\.", ".layers.*.", key)


def coverage_errors(expected: dict[str, ExpectedKey], builds: list[RankBuild], layout: Layout) -> list[str]:
    """Every way ``builds`` (ranks of ``layout``) fail to cover ``expected`` exactly once."""
    errors, owners, cells, meta = _gather_shards(expected, builds)
    errors += _ownership_errors(expected, owners)
    errors += _tiling_errors(owners, cells, meta, _complete_stages(builds, layout))
    return errors


def _local_shape(sh) -> tuple[int, ...]:
    """A shard's local shape with its prepended (stacking) axes as 1s."""
    return (1,) * sh.prepend_axis_num + tuple(sh.local_shape)


def _shard_mismatch(where: str, sh, want: ExpectedKey | None) -> str | None:
    """Why a shard does not fit the mapping (its key, its global shape, or local shape x
    fragmentation), or None."""
    if want is None:
        return f"{where}: {sh.key} {sh.global_shape} is not in the converter's mapping"
    if tuple(sh.global_shape) != want.global_shape:
        return (
            f"{where}: {sh.key} has global shape {tuple(sh.global_shape)}; the mapping "
            f"gives {want.global_shape} ({want.sources[0]})"
        )
    local = _local_shape(sh)
    if tuple(a * f for a, f in zip(local, sh.axis_fragmentations)) != want.global_shape:
        return (
            f"{where}: {sh.key} local {local} x fragmentation {sh.axis_fragmentations} "
            f"is not the global shape {want.global_shape}"
        )
    return None


def _gather_shards(expected: dict[str, ExpectedKey], builds: list[RankBuild]) -> tuple[list[str], dict, dict, dict]:
    """(errors of the shards that do not fit the mapping, and per key of those that do: the
    (pipeline, virtual) stages holding a main replica, the ranks writing each grid cell, and
    (global shape, local shape, fragmentation))."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    errors = []
    owners: dict[str, set] = defaultdict(set)
    cells: dict[str, dict] = defaultdict(lambda: defaultdict(list))  # key -> grid cell -> ranks
    meta: dict[str, tuple] = {}
    for build in builds:
        for chunk in build.chunks:
            where = f"rank {build.rank} (pipeline {build.coords['pp']}, virtual {chunk.vp_stage})"
            for sh in chunk.shards:
                want = expected.get(sh.key)
                mismatch = _shard_mismatch(where, sh, want)
                if mismatch:
                    errors.append(mismatch)
                    continue
                meta[sh.key] = (want.global_shape, _local_shape(sh), tuple(sh.axis_fragmentations))
                if is_main_replica(sh.replica_id):
                    owners[sh.key].add((build.coords["pp"], chunk.vp_stage))
                    cells[sh.key][sh.local_chunk_offset_in_global()].append(build.rank)
    return errors, owners, cells, meta


def _ownership_errors(expected: dict[str, ExpectedKey], owners: dict[str, set]) -> list[str]:
    """Expected keys whose stacked slices the mapping leaves unfilled, or whose main replica is not
    in exactly one (pipeline, virtual) stage."""
    errors = []
    for key, want in expected.items():
        if want.slices and want.slices != set(range(want.global_shape[0])):
            errors.append(
                f"{key}: the mapping fills {len(want.slices)} of its {want.global_shape[0]} stacked "
                f"slices (missing {sorted(set(range(want.global_shape[0])) - want.slices)[:8]})"
            )
        if len(owners[key]) != 1:
            errors.append(
                f"{key}: main replica in {len(owners[key])} (pipeline, virtual) stages "
                f"{sorted(owners[key], key=str)}; expected exactly one"
            )
    return errors


def _complete_stages(builds: list[RankBuild], layout: Layout) -> set[int]:
    """The pipeline stages whose main-replica ranks the builds all hold."""
    built = {b.rank for b in builds}
    return {
        p for p in range(layout.pp) if {r for r in main_replica_ranks(layout) if r // layout.stage_gpus == p} <= built
    }


def _tiling_errors(
    owners: dict[str, set], cells: dict[str, dict], meta: dict[str, tuple], complete: set[int]
) -> list[str]:
    """Keys whose main replicas overlap, or leave a gap in the grid of a complete stage; a key of an
    incomplete stage passes only where a key of its kind was tiled in a complete one."""
    errors = []
    tiled_kinds = set()
    for key, grid in cells.items():
        doubled = {c: r for c, r in grid.items() if len(r) > 1}
        if doubled:
            cell, ranks = next(iter(doubled.items()))
            errors.append(f"{key}: {len(doubled)} shard(s) written by more than one rank (cell {cell}: ranks {ranks})")
        if {p for p, _ in owners[key]} <= complete:
            missing = prod(meta[key][2]) - len(grid)
            if missing:
                errors.append(
                    f"{key}: {missing} of {prod(meta[key][2])} shards of the grid {meta[key][2]} written by no rank"
                )
            elif not doubled:
                tiled_kinds.add((_kind(key), *meta[key]))
    for key in cells:
        if not {p for p, _ in owners[key]} <= complete and (_kind(key), *meta[key]) not in tiled_kinds:
            errors.append(f"{key}: its stage is not fully built and no key of its kind was tiled in a complete stage")
    return errors


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the whole model, each tensor once (the MTP head's copy of the word embeddings
    is not a mapping tensor). ``total`` / ``active``: without the MTP head, the convention of the
    published figures (with it, 122B-A10B and 397B-A17B would be 3.1B and 6.6B above theirs);
    the vision tower (~0.45B, within the published rounding either way) is counted in both."""

    with_mtp: int
    mtp: int
    vision: int
    routed_experts: int  # of the decoder layers (MTP's excluded)
    total: int
    active: int  # total minus the routed experts a token does not use: (E - top_k) / E of them


def parameter_counts(shape: Qwen35VLShape, expected: dict[str, ExpectedKey]) -> ParameterCounts:
    def count(keep):
        return sum(prod(e.global_shape) for k, e in expected.items() if keep(k))

    t = shape.text
    mtp = count(lambda k: k.startswith(MG_LM + "mtp."))
    routed = count(lambda k: ".mlp.experts.experts." in k and not k.startswith(MG_LM + "mtp."))
    with_mtp = count(lambda k: True)
    unused = routed * (t.num_experts - t.moe_top_k) // t.num_experts if t.num_experts is not None else 0
    return ParameterCounts(
        with_mtp, mtp, count(lambda k: k.startswith(MG_VIS)), routed, with_mtp - mtp, with_mtp - mtp - unused
    )


def within_published_rounding(count: int, billions: int) -> bool:
    """A published whole number of billions is the count rounded down or up."""
    return int(count // 10**9) <= billions <= -(-count // 10**9)
