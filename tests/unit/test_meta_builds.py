"""The released variants at their recommended layouts (``pipeline_layout.LAYOUTS``), built rank by
rank on the meta device in this process (``planner/meta_builds.py``): what each rank holds, and
whether the ranks' checkpoint shards cover the converter's mapping exactly once
(``planner/mapping_coverage.py``).

Which ranks are built (the file stays near a minute on two cores): for ``9b``, ``27b`` and
``35b_a3b`` every main-replica rank (every other rank holds a copy of one of theirs), so every
pipeline stage is complete; for ``122b_a10b`` (128 GPUs) and ``397b_a17b`` (256 GPUs) every
main-replica rank of the first and the last pipeline stage, which between them hold every kind
of tensor (vision tower, embeddings, output layer, MTP head, Gated DeltaNet, attention, MoE
layers), and of every other stage its first tensor-parallel group and its last rank (the far end
of the expert coordinates): there the keys, shapes, ownership and overlaps are checked, and each
key must be of a kind (name without the layer index, shapes, fragmentation) tiled exactly in a
complete stage. ``python -m examples.multimodal_dev.tools.rank_memory --check`` builds every
main-replica rank of all five (410 ranks) and checks every stage's tiling directly.
"""

import os
import resource
import subprocess
import sys
from dataclasses import replace
from math import prod

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import is_main_replica

from examples.multimodal_dev.lora.targets import TARGETS, LoraSettings
from examples.multimodal_dev.models.qwen35_vl.configuration import VARIANTS
from examples.multimodal_dev.models.qwen35_vl.hf_mapping import mapping_rules
from examples.multimodal_dev.planner import mapping_coverage as cov
from examples.multimodal_dev.planner import meta_builds as mb
from examples.multimodal_dev.planner.pipeline_layout import LAYOUTS
from examples.multimodal_dev.tools import rank_memory as tool

PLANNER_PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "planner.md")
FULLY_BUILT = ("9b", "27b", "35b_a3b")


class Plan:
    def __init__(self, variant):
        self.name, self.shape, self.layout = variant, VARIANTS[variant], mb.Layout.recommended(variant)
        full = range(self.layout.pp) if variant in FULLY_BUILT else (0, self.layout.pp - 1)
        self.ranks = mb.sampled_ranks(self.layout, full)
        self.builds = {r: mb.rank_build(self.shape, self.layout, r) for r in self.ranks}
        self.expected = cov.expected_keys(self.shape)


@pytest.fixture(scope="module")
def plans(no_process_group):
    cache = {}

    def get(variant):
        if variant not in cache:
            cache[variant] = Plan(variant)
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_rank_memory_of_representative_ranks(plans, variant):
    """Each representative rank is the stage / expert coordinate it is named after; its parameters
    are exactly its checkpoint shards (replicas included, e.g. the MTP head's copy of the word
    embeddings on the last stage); bytes follow the stated assumptions."""
    plan = plans(variant)
    layout = plan.layout
    for label, rank in mb.representative_ranks(layout).items():
        build = plan.builds[rank]
        stage = {"first": 0, "middle": layout.pp // 2, "last": layout.pp - 1, "every": 0}[label.split()[0]]
        assert build.coords["pp"] == stage, (label, build.coords)
        if "EP rank" in label:
            assert build.coords["ep"] == layout.ep - 1 and build.coords["pp"] == 0
        assert len(build.chunks) == (layout.vp or 1)
        assert [c.pre_process for c in build.chunks] == [stage == 0 and v == 0 for v in range(len(build.chunks))]
        assert [c.post_process for c in build.chunks] == [
            stage == layout.pp - 1 and v == len(build.chunks) - 1 for v in range(len(build.chunks))
        ]
        for chunk in build.chunks:
            assert sum(p.numel for p in chunk.params) == sum(prod(s.local_shape) for s in chunk.shards), (
                label,
                chunk.vp_stage,
            )
            expert_shards = sum(prod(s.local_shape) for s in chunk.shards if ".experts.experts." in s.key)
            assert sum(p.numel for p in chunk.params if p.expert) == expert_shards
        mem = mb.rank_memory(build, layout)
        fp32 = [p for p in build.params if p.dtype == torch.float32]
        assert {p.name.rsplit(".", 1)[-1] for p in fp32} <= {"A_log", "dt_bias"}
        assert {p.dtype for p in build.params} <= {torch.bfloat16, torch.float32}
        assert mem.weight_bytes == 2 * mem.params + 2 * sum(p.numel for p in fp32)
        assert mem.grad_bytes == 4 * mem.params
        print(
            f"{variant} rank {rank} ({label}): {mem.params / 1e9:.2f} B parameters, weights "
            f"{mem.weight_bytes / mb.GIB:.1f} GiB, gradients {mem.grad_bytes / mb.GIB:.1f} GiB, "
            f"optimizer {mem.optimizer_bytes / mb.GIB:.1f} GiB"
        )


def test_rank_memory_formula():
    """Dense state over DP x CP, expert state over expert DP, no main copy of an fp32 parameter."""
    layout = mb.Layout(tp=2, pp=2, cp=2, ep=4, etp=1, gpus=32)  # DP x CP = 8, expert DP = 4
    build = mb.RankBuild(
        0,
        {},
        [
            mb.Chunk(
                None,
                True,
                True,
                [
                    mb.Param("dense", 800, torch.bfloat16, False),
                    mb.Param("expert", 400, torch.bfloat16, True),
                    mb.Param("A_log", 80, torch.float32, False),
                ],
                [],
            )
        ],
    )
    mem = mb.rank_memory(build, layout)
    assert (mem.params, mem.expert_params) == (1280, 400)
    assert mem.weight_bytes == 2 * 1200 + 4 * 80 and mem.grad_bytes == 4 * 1280
    assert mem.optimizer_bytes == 12 * 800 / 8 + 12 * 400 / 4 + 8 * 80 / 8


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_shards_cover_the_mapping_exactly_once(plans, variant):
    plan = plans(variant)
    errors = cov.coverage_errors(plan.expected, list(plan.builds.values()), plan.layout)
    assert not errors, "\n".join(errors[:20])
    seen = {s.key for b in plan.builds.values() for c in b.chunks for s in c.shards}
    assert seen == set(plan.expected)
    print(f"{variant}: {len(plan.builds)} ranks of {plan.layout.gpus}, {len(seen)} checkpoint keys covered once")


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_parameter_totals_match_the_published_figures(plans, variant):
    """Totals three ways: the HF model of the config (on meta, plus the MTP head), the mapping's
    checkpoint keys, the keys the ranks wrote (every stage is built at least once), and for the
    fully built variants the main replicas of all ranks."""
    plan = plans(variant)
    counts = cov.parameter_counts(plan.shape, plan.expected)
    hf = sum(prod(s) for s in cov.hf_shapes(plan.shape).values())
    written = {s.key: prod(s.global_shape) for b in plan.builds.values() for c in b.chunks for s in c.shards}
    assert hf == counts.with_mtp == sum(written.values())
    if variant in FULLY_BUILT:
        main = sum(
            prod(s.local_shape)
            for b in plan.builds.values()
            for c in b.chunks
            for s in c.shards
            if is_main_replica(s.replica_id)
        )
        assert main == counts.with_mtp
    total, active = cov.PUBLISHED[variant]
    print(
        f"{variant}: total {counts.total / 1e9:.2f} B (published {total}), active {counts.active / 1e9:.2f} B "
        f"(published {active}); MTP head {counts.mtp / 1e9:.2f} B, vision tower {counts.vision / 1e9:.2f} B"
    )
    assert cov.within_published_rounding(counts.total, total)
    assert cov.within_published_rounding(counts.active, active)
    if variant in ("122b_a10b", "397b_a17b"):  # the MTP head is not in the published totals
        assert not cov.within_published_rounding(counts.with_mtp, total)


def test_docs_table_is_what_the_tool_prints(plans):
    with open(PLANNER_PAGE) as f:
        page = set(f.read().splitlines())
    for variant in LAYOUTS:
        plan = plans(variant)
        for row in tool.table_rows(variant, plan.shape, plan.layout, build=plan.builds.__getitem__):
            assert row in page, f"docs/planner.md lacks the row\n{row}"


def test_builds_stay_on_the_meta_device(no_process_group):
    """Every tensor of the heaviest rank (397b_a17b's last stage) is on meta, and holding its
    models costs no host memory (in storage it would be 6.4 GiB of bf16 weights)."""

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    before = rss()
    build = mb.rank_build(VARIANTS["397b_a17b"], mb.Layout.recommended("397b_a17b"), 224, keep_models=True)
    tensors = [t for m in build.models for t in [*m.parameters(), *m.buffers()]]
    assert tensors and all(t.is_meta for t in tensors)
    assert sum(t.numel() for t in tensors if isinstance(t, torch.nn.Parameter)) > 3e9
    assert rss() - before < 512 * 2**20


# ---- the checks fail when the mapping or the builds are wrong ----


def _copy(builds):
    return [mb.RankBuild(b.rank, dict(b.coords), [replace(c, shards=list(c.shards)) for c in b.chunks]) for b in builds]


def test_a_rule_missing_from_the_mapping_is_found(plans):
    plan = plans("27b")
    dropped = "language_model.decoder.layers.5.mlp.linear_fc2.weight"
    rules = [r for r in mapping_rules(plan.shape) if r.megatron != (dropped,)]
    errors = cov.coverage_errors(cov.expected_keys(plan.shape, rules), list(plan.builds.values()), plan.layout)
    assert errors and all(e.endswith(f"{dropped} (5120, 17408) is not in the converter's mapping") for e in errors), (
        errors
    )
    assert len(errors) == plan.layout.tp  # one per TP shard of that tensor


def test_an_expert_missing_from_the_mapping_is_found(plans):
    plan = plans("35b_a3b")
    prefix = "language_model.decoder.layers.0.mlp.experts."
    rules = []
    for rule in mapping_rules(plan.shape):
        if rule.megatron[0] == f"{prefix}local_experts.0.linear_fc1.weight":  # expert 17 left out
            rule = replace(
                rule,
                megatron=tuple(n for n in rule.megatron if ".17." not in n),
                to_megatron=lambda ts, unstack=rule.to_megatron: [t for e, t in enumerate(unstack(ts)) if e != 17],
            )
        rules.append(rule)
    errors = cov.coverage_errors(cov.expected_keys(plan.shape, rules), list(plan.builds.values()), plan.layout)
    assert errors == [
        f"{prefix}experts.linear_fc1.weight: the mapping fills 255 of its 256 stacked slices (missing [17])"
    ]


def test_a_layer_no_stage_builds_is_found(plans):
    plan = plans("35b_a3b")
    builds = _copy(plan.builds.values())
    for b in builds:
        for c in b.chunks:
            c.shards = [s for s in c.shards if not s.key.startswith("language_model.decoder.layers.30.")]
    errors = cov.coverage_errors(plan.expected, builds, plan.layout)
    assert errors and all(
        "language_model.decoder.layers.30." in e and "in 0 (pipeline, virtual) stages" in e for e in errors
    ), errors


def test_a_layer_on_two_stages_and_a_misplaced_shard_are_found(plans):
    plan = plans("35b_a3b")
    builds = _copy(plan.builds.values())
    last = next(b for b in builds if b.coords["pp"] == 1)
    twice = [s for s in last.chunks[0].shards if s.key.startswith("language_model.decoder.layers.30.")]
    builds[0].chunks[0].shards += twice  # rank 0 (first stage) also writes layer 30
    errors = cov.coverage_errors(plan.expected, builds, plan.layout)
    assert any("layers.30.mlp.router.weight: main replica in 2 (pipeline, virtual) stages" in e for e in errors)
    assert any("layers.30.mlp.router.weight: 1 shard(s) written by more than one rank" in e for e in errors)

    # the expert shards of the last EP rank written at the place of the one before it
    lay, experts = plan.layout, plan.shape.text.num_experts
    per_rank = experts // lay.ep
    builds = _copy(plan.builds.values())
    mover = next(b for b in builds if (b.coords["pp"], b.coords["ep"], b.coords["etp"]) == (0, lay.ep - 1, 0))
    mover.chunks[0].shards = [
        replace(s, global_offset=(s.global_offset[0] - per_rank, *s.global_offset[1:]))
        if ".experts.experts." in s.key
        else s
        for s in mover.chunks[0].shards
    ]
    errors = cov.coverage_errors(plan.expected, builds, plan.layout)
    fc2 = "language_model.decoder.layers.0.mlp.experts.experts.linear_fc2.weight"
    cell = (experts - 2 * per_rank, 0, 0)  # the first expert of the EP rank before it, TP slice 0
    assert (
        f"{fc2}: {per_rank} shard(s) written by more than one rank (cell {cell}: ranks "
        f"[{mover.rank - lay.etp}, {mover.rank}])" in errors
    ), errors[:4]
    grid = (
        (experts, 1, lay.etp)
        if any(e.startswith(f"{fc2}: ") and f"grid ({experts}, 1, {lay.etp})" in e for e in errors)
        else (experts, lay.etp, 1)
    )
    assert f"{fc2}: {per_rank} of {experts * lay.etp} shards of the grid {grid} written by no rank" in errors


def test_a_shape_the_mapping_disagrees_with_is_found(plans):
    plan = plans("27b")
    hf = dict(cov.hf_shapes(plan.shape))
    name = "model.language_model.layers.7.mlp.down_proj.weight"
    hf[name] = torch.Size([hf[name][0], hf[name][1] + 128])
    errors = cov.coverage_errors(cov.expected_keys(plan.shape, hf=hf), list(plan.builds.values()), plan.layout)
    wrong = [
        e
        for e in errors
        if "layers.7.mlp.linear_fc2.weight has global shape (5120, 17408); the mapping gives (5120, 17536)" in e
    ]
    assert len(wrong) == plan.layout.tp  # every TP shard, and so no rank owns the tensor:
    assert errors[len(wrong) :] == [
        "language_model.decoder.layers.7.mlp.linear_fc2.weight: main replica in 0 "
        "(pipeline, virtual) stages []; expected exactly one"
    ]


def test_an_incomplete_stage_needs_a_tiled_kind(plans):
    """Only 397b_a17b's middle stages (partly built): their MoE / attention / GDN keys have no
    completely built stage to be compared with."""
    plan = plans("397b_a17b")
    middle = [b for b in plan.builds.values() if 0 < b.coords["pp"] < plan.layout.pp - 1]
    errors = cov.coverage_errors(plan.expected, middle, plan.layout)
    assert any("layers.20.mlp.router.weight: its stage is not fully built" in e for e in errors)
    assert any("vision_model.pos_embed.weight: main replica in 0" in e for e in errors)


def test_layouts_that_do_not_split_are_refused(no_process_group):
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size 3: the 32 decoder layers"):
        mb.rank_build(VARIANTS["9b"], mb.Layout(tp=2, pp=3, gpus=6), 0)
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3 does not divide the 256 experts"):
        mb.Layout(ep=3, gpus=3).check(VARIANTS["35b_a3b"])
    with pytest.raises(ValueError, match="12 GPUs: not a multiple of TP x PP x CP = 8"):
        mb.Layout(tp=4, pp=2, gpus=12).check(VARIANTS["27b"])


def test_an_fsdp_layout_is_sent_to_the_planner():
    with pytest.raises(SystemExit, match=r"--layout TP=2 FSDP=1: FSDP=1 is not built here .*plan_layout --layout"):
        tool.parse_layout("TP=2 FSDP=1")
    assert tool.parse_layout("TP=2") == mb.Layout(tp=2)


def test_the_command_refuses_an_unknown_variant_in_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "examples.multimodal_dev.tools.rank_memory", "27b", "400b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "rank_memory: unknown variant '400b'; valid: 9b, 27b, 35b_a3b, 122b_a10b, 397b_a17b"
    ]


def test_tied_embeddings_with_mtp_on_a_later_stage_checkpoint(no_process_group):
    """Found by these builds (megatron-core 0.19.2): with tied embeddings (0.8b, 2b, 4b) and the MTP
    head on a last stage that is not the first, GPTModel allocates an output weight it never reads
    (the logits use the head's copy of the embeddings) and its sharded_state_dict asserts there is
    none. The model drops that weight: the stage's shards build, and its only word-embedding-sized
    tensor is the embeddings' copy, under the first stage's key."""
    layout = mb.Layout(tp=2, pp=2, gpus=8)
    build = mb.rank_build(VARIANTS["4b"], layout, 4)
    names = {p.name for p in build.params}
    assert "language_model.embedding.word_embeddings.weight" in names
    assert "language_model.output_layer.weight" not in names


def _counted(shape, layout, pp_rank):
    from examples.multimodal_dev.planner.rank_params import stage_params

    return stage_params(shape, layout, pp_rank)


def _assert_counted_equals_built(shape, layout, build, label):
    """The planner's count (``rank_params``, no build) is the build, parameter for parameter in
    total per dtype and kind, and gives the same bytes of weights, gradients and optimizer state."""
    counted = _counted(shape, layout, build.coords["pp"])
    built = dict(
        dense=sum(p.numel for p in build.params if not p.expert and p.dtype == torch.bfloat16),
        fp32=sum(p.numel for p in build.params if p.dtype == torch.float32),
        expert=sum(p.numel for p in build.params if p.expert),
    )
    assert built == dict(dense=counted.dense, fp32=counted.fp32, expert=counted.expert), label
    vision = sum(p.numel for p in build.params if p.name.startswith("vision_model."))
    mtp = sum(p.numel for p in build.params if ".mtp." in p.name)
    embedding_copy = sum(
        p.numel
        for c in build.chunks
        if c.post_process and not c.pre_process
        for p in c.params
        if p.name.startswith("language_model.embedding.")
    )  # the MTP head's, on the last stage
    assert vision == counted.vision and mtp + embedding_copy == counted.mtp, label
    from examples.multimodal_dev.planner.layout_cost import state_bytes

    mem = mb.rank_memory(build, layout)
    assert state_bytes(counted, layout) == (mem.weight_bytes, mem.grad_bytes, pytest.approx(mem.optimizer_bytes))


@pytest.mark.parametrize("variant", list(LAYOUTS))
def test_counted_parameters_equal_the_builds(plans, variant):
    """Every rank built for the recommended layouts (all main-replica ranks of 9b / 27b / 35b_a3b)."""
    plan = plans(variant)
    for rank, build in plan.builds.items():
        _assert_counted_equals_built(plan.shape, plan.layout, build, f"{variant} rank {rank}")


@pytest.mark.parametrize(
    "variant,layout",
    [
        ("0.8b", mb.Layout(tp=2, cp=2, gpus=8)),  # tied embeddings, one stage: the output layer is the embedding
        ("2b", mb.Layout(tp=2, pp=2, gpus=4)),  # tied embeddings over two stages: the last keeps a copy
        ("35b_a3b", mb.Layout(tp=4, pp=4, vp=2, ep=4, etp=2, gpus=64)),  # ETP > 1, virtual stages
        ("27b", mb.Layout(tp=8, pp=4, vp=2, first=14, last=14, gpus=32)),  # uneven split with virtual stages
    ],
    ids=lambda v: v if isinstance(v, str) else v.describe(),
)
def test_counted_parameters_at_other_layouts(no_process_group, variant, layout):
    for label, rank in mb.representative_ranks(layout).items():
        build = mb.rank_build(VARIANTS[variant], layout, rank, shards=False)
        _assert_counted_equals_built(VARIANTS[variant], layout, build, f"{variant} {label}")


def test_a_miscounted_tensor_is_caught(plans, monkeypatch):
    """The comparison can fail: one replicated norm too many per layer is seen."""
    from examples.multimodal_dev.planner import rank_params

    plan = plans("9b")
    real = rank_params.layer_params

    def one_more(*args):
        out = real(*args)
        out.dense += 1
        return out

    monkeypatch.setattr(rank_params, "layer_params", one_more)
    with pytest.raises(AssertionError):
        _assert_counted_equals_built(plan.shape, plan.layout, plan.builds[0], "9b rank 0")


LORA = LoraSettings(16)


@pytest.mark.parametrize(
    "variant,layout",
    [
        ("35b_a3b", mb.Layout.recommended("35b_a3b")),  # experts split over TP (ETP=2)
        ("397b_a17b", mb.Layout.recommended("397b_a17b")),  # CP, EP=8, eight stages
        ("9b", mb.Layout(tp=2, pp=2, gpus=4)),  # dense, with the vision tower's adapters too
    ],
    ids=lambda v: v if isinstance(v, str) else v.describe(),
)
def test_lora_adapters_counted_equal_the_builds(no_process_group, variant, layout):
    """With LoRA the planner's count is the build's: the frozen base as without (``stage_params``),
    the trainable adapters by kind (``adapter_params``), and the bytes of weights, gradients and
    optimizer state (the base's gradients and state gone)."""
    from examples.multimodal_dev.planner.layout_cost import state_bytes
    from examples.multimodal_dev.planner.rank_params import adapter_params

    lora = LORA if variant != "9b" else LoraSettings(8, TARGETS)
    for label, rank in mb.representative_ranks(layout).items():
        build = mb.rank_build(VARIANTS[variant], layout, rank, shards=False, lora=lora)
        pp = build.coords["pp"]
        frozen = [p for p in build.params if not p.trainable]
        trained = [p for p in build.params if p.trainable]
        assert {p.name.rsplit(".", 1)[-1] for p in trained} == {"lora_A", "lora_B"}, label
        counted = adapter_params(VARIANTS[variant], layout, pp, lora)
        built = dict(
            dense=sum(p.numel for p in trained if not p.expert),
            expert=sum(p.numel for p in trained if p.expert),
            vision=sum(p.numel for p in trained if p.name.startswith("vision_model.")),
        )
        assert built == dict(dense=counted.dense, expert=counted.expert, vision=counted.vision), label
        assert (counted.expert > 0) == VARIANTS[variant].text.is_moe and (counted.vision > 0) == (
            pp == 0 and lora.trains_vision
        )
        base = _counted(VARIANTS[variant], layout, pp)
        assert sum(p.numel for p in frozen) == base.total, label
        mem = mb.rank_memory(build, layout)
        assert state_bytes(base, layout, adapters=counted) == (
            mem.weight_bytes,
            mem.grad_bytes,
            pytest.approx(mem.optimizer_bytes),
        ), label


def test_docs_lora_table_is_what_the_tool_prints(no_process_group):
    with open(PLANNER_PAGE) as f:
        page = set(f.read().splitlines())
    for variant in ("35b_a3b", "397b_a17b"):
        layout = mb.Layout.recommended(variant)
        for row in tool.table_rows(variant, VARIANTS[variant], layout, lora=LORA):
            assert row in page, f"docs/planner.md lacks the row\n{row}"
